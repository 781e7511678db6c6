"""Run one attack configuration against one run directory and score it.

The orchestrator is the only place that holds both sides: it gives the attack its ``Knowledge``
and the ``Traffic``, and afterwards scores the returned token ids against the documents of the
traffic's phase, which the attack never sees. It sits in the audit stage because scoring
(``splitleak.metrics``) lies to the right of the attacks in the flow of data; the attacks know
nothing of scores.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from splitleak.attacks.config import AttackConfig, perturb_gradients
from splitleak.attacks.core import VMI, Majority, make_attack
from splitleak.attacks.knowledge import Knowledge, Traffic, load_knowledge, load_traffic
from splitleak.attacks.registry import attack_info, attacks_for_mode
from splitleak.audit.defaults import CONTROL_BOOT
from splitleak.audit.extras import TruthJudge
from splitleak.audit.latent_attacks import run_dose_attack, run_partition_attack, run_probe_attack
from splitleak.audit.result_files import check_result_out, write_result  # noqa: F401 (write_result: re-exported)
from splitleak.audit.verdicts import (
    MISPAIRED_CONTROL,
    control_delta,
    control_interval,
    document_control,
    mispaired_documents,
    mispairing,
)
from splitleak.errors import ConfigError
from splitleak.metrics import leakage_index, roc_auc, score_reconstruction
from splitleak.progress import Progress, Silent
from splitleak.runs.manifest import pair_session, read_manifest, run_mode
from splitleak.runs.truth import phase_documents
from splitleak.runs.verify import require_verified
from splitleak.stats import effect_verdict


def attack_label(result: dict[str, Any]) -> str:
    """An attack result's short name with its main hyperparameter (``activation k=32``, ``sipit budget=32``),
    and ``, trained copy`` when the attacker held the client's trained layers (``sipit budget=exhaustive,
    trained copy``)."""
    p = result.get("attack_params", {})
    extra = f" k={p['k']}" if "k" in p else (f" budget={p['budget']}" if "budget" in p else "")
    copy = (result.get("config") or {}).get("client_copy", "public")
    return f"{result['attack']}{extra}" + ("" if copy == "public" else f", {copy} copy")


def _decoder(tokenizer):
    if tokenizer is None:
        return None
    return lambda i: tokenizer.decode([int(i)])


def property_scores(scores: np.ndarray, tokens: list[int], docs) -> list[dict[str, Any]]:
    out = []
    for tok in tokens:
        labels = np.array([int(tok in d.token_ids) for d in docs])
        auc = roc_auc(scores, labels) if 0 < labels.sum() < len(labels) else None
        out.append({"token_id": int(tok), "auc": auc, "share_present": float(labels.mean())})
    return out


def run_attack(
    run_dir: str | Path,
    config: AttackConfig,
    *,
    out: str | Path | None = None,
    force: bool = False,
    knowledge: Knowledge | None = None,
    traffic: Traffic | None = None,
    progress: Progress | None = None,
    device: str | None = None,
    protocol_hash: str | None = None,
    documents: str | Path | None = None,
    verify: bool = True,
    control_docs: int = 0,
    already_verified: bool = False,
) -> dict[str, Any]:
    """Fit and run the attack, score it, and (with ``out``) write RESULT.json and the per-document
    predictions as Parquet beside it. Returns the result dictionary.

    ``control_docs``: with 2 or more, an attack that reads tokens also runs its mis-paired twin on about
    that many documents (``splitleak.audit.verdicts``: the same fitted attack on traffic paired with the
    wrong documents, scored as the arm against its own reading of that traffic); the result's ``control``
    holds the twin's per-document differences, N with its interval and its verdict. 0: no control.

    ``verify``: first check the run (and ``documents``) against its journal (``splitleak verify``), and
    read nothing from one that fails; ``verify=False`` reads it as it is, and the result says so.
    ``already_verified``: the caller has just checked them itself (a grid worker, once for the attack jobs
    of one run: ``experiments.sharing``), so they are not checked again.

    ``run_dir`` may be a server's capture (one ``session-NNNN/`` of ``splitleak serve --capture``):
    the traffic is then what the server recorded, and ``documents`` names the client's run directory
    of the same session, which holds what never reached the server — the calibration documents the
    attacker is given, the client's layers for the trained copy, and the true text for scoring
    (``pair_session`` checks that both recorded the same frames)."""
    progress = progress or Silent()
    run_dir = Path(run_dir)
    out_path = Path(out) if out is not None else None
    if out_path is not None:  # before anything is read or fitted
        check_result_out(out_path, force, run_dir, documents)
    if verify and not already_verified:
        for d in (run_dir, documents):
            if d is not None:
                require_verified(d, "the attack")
    doc_dir, manifest = _documents_of(run_dir, documents, config)
    mode, info = run_mode(manifest), attack_info(config.attack)
    if mode not in info.modes:
        raise ConfigError(
            f"attack {config.attack!r} reads the traffic of {' or '.join(info.modes)} runs, and {run_dir} is a {mode} "
            f"run; attacks for it: {', '.join(attacks_for_mode(mode))}"
        )
    if info.output == "partition":
        return run_partition_attack(
            run_dir, doc_dir, manifest, config, out_path, protocol_hash, force, control_docs=control_docs
        )
    if info.output == "row-tokens":
        return run_probe_attack(run_dir, doc_dir, manifest, config, out_path, protocol_hash, force)
    if info.output == "dose":
        return run_dose_attack(run_dir, doc_dir, manifest, config, out_path, protocol_hash, force)
    attack = make_attack(config.attack, **config.attack_params())
    if knowledge is None:
        knowledge = load_knowledge(doc_dir, config.client_copy, with_top=info.needs_top)
        if doc_dir != run_dir:  # what the observer saw before is in the server's capture
            knowledge.history_loader = lambda: load_traffic(run_dir, phase="train")
    if device is not None:
        knowledge.client.to(device)
    traffic = _attack_traffic(run_dir, config, attack, traffic, knowledge)
    docs_by_id = {d.doc_id: d for d in phase_documents(doc_dir, config.phase)}
    docs = [docs_by_id[i] for i in traffic.doc_ids]
    if control_docs and control_docs < 2:
        raise ConfigError(f"control_docs must be 0 (no control) or at least 2, got {control_docs}")
    t0 = time.perf_counter()
    attack.fit(knowledge)
    rec, shared_from = _reconstruct(attack, knowledge, traffic, config, progress)
    seconds = time.perf_counter() - t0
    result: dict[str, Any] = {
        "attack": config.attack,
        "config": config.model_dump(mode="json"),
        "config_hash": config.hash(),
        "attack_params": attack.params(),
        "run": {
            "dir": str(run_dir),
            "config_hash": manifest["config_hash"],
            "config": manifest["config"],
            "cut": manifest["split"]["cut"],
            **({"documents": str(doc_dir), "traffic_recorded_by": "server"} if doc_dir != run_dir else {}),
        },
        "protocol_hash": protocol_hash,
        "phase": config.phase,
        "channels_read": list(attack.channels_read()),
        "verified": verify,
        "n_docs": len(traffic),
        "n_tokens": int(traffic.activations.shape[0] * traffic.activations.shape[1]),
        "seconds": seconds,
    }
    if shared_from is not None:  # the seconds are this job's; the search's are in the job that ran it
        result["reconstruction_shared_with_attack_seed"] = shared_from
    if rec.tokens is not None:
        judge = TruthJudge(docs, knowledge.client.tokenizer, doc_dir, traffic)
        per_doc_rows = _score_tokens(result, rec, attack, judge, config, control_docs, progress)
    else:
        per_doc_rows = _score_properties(result, rec, knowledge, traffic, docs, config)
    if out_path is not None:
        write_result(out_path, result, per_doc_rows, force=force)
    result["per_doc"] = per_doc_rows
    return result


def _documents_of(run_dir: Path, documents: str | Path | None, config: AttackConfig) -> tuple[Path, dict[str, Any]]:
    """The run that holds the documents (``run_dir``, or ``documents`` for a server's capture, once paired
    with it) and the manifest the result records."""
    manifest = read_manifest(run_dir)
    if manifest.get("role") == "server":
        if documents is None:
            raise ConfigError(
                f"{run_dir} is a server's capture: it holds what crossed, not the documents (they never reach the "
                "server); pass --documents with the client's run directory of the same session"
            )
        pair_session(run_dir, documents, config.phase)
        return Path(documents), {**read_manifest(Path(documents)), "session": str(run_dir)}
    if documents is not None:
        raise ConfigError(f"--documents is for a server's capture; {run_dir} is a client's run and holds its own")
    return run_dir, manifest


def _attack_traffic(
    run_dir: Path, config: AttackConfig, attack, traffic: Traffic | None, knowledge: Knowledge
) -> Traffic:
    """The traffic the attack reads (``traffic``, or loaded from ``run_dir``), its gradients perturbed where
    the configuration asks (``perturb_gradients``): once per traffic and perturbation in ``knowledge``'s memo
    (the seed names it only where it draws noise), so that jobs that differ in nothing else read one object."""
    if traffic is None:
        traffic = load_traffic(run_dir, with_gradients=not config.inference, phase=config.phase)
    if config.inference and attack.uses_gradients:
        raise ConfigError(f"attack {config.attack!r} needs gradients, which inference traffic does not carry")
    if traffic.gradients is not None and (config.gradient_noise is not None or config.gradient_bits is not None):
        base = traffic

        def perturbed() -> Traffic:
            perturb = lambda g: (  # noqa: E731
                None
                if g is None
                else perturb_gradients(g, config.gradient_noise, config.gradient_bits, config.attack_seed)
            )
            return base.replace(gradients=perturb(base.gradients), output_gradients=perturb(base.output_gradients))

        seed = config.attack_seed if config.gradient_noise is not None else None  # rounding draws nothing
        key = ("perturbed", config.gradient_noise, config.gradient_bits, seed)
        traffic = knowledge.memo(key, perturbed, base, whole=True)
    return traffic


def _reconstruct(
    attack, knowledge: Knowledge, traffic: Traffic, config: AttackConfig, progress
) -> tuple[Any, int | None]:
    """``attack.reconstruct(traffic)``, and the attack seed of the job whose reading it is when that was another
    job's (else None). An attack whose reading does not depend on its seed (``AttackInfo.seeded`` False) reads
    one traffic once per knowledge and configuration: the jobs of a grid task (one run and copy) that differ
    only in their attack seed share one search, bit for bit what each would compute alone."""
    if attack_info(config.attack).seeded:
        return attack.reconstruct(traffic, progress), None
    identity = config.model_dump(mode="json")
    identity.pop("attack_seed")
    key = ("reconstruction", json.dumps(identity, sort_keys=True))
    ran: list[int] = []

    def read() -> tuple[Any, int]:
        ran.append(1)
        return attack.reconstruct(traffic, progress), config.attack_seed

    rec, seed = knowledge.memo(key, read, traffic, whole=True)
    return rec, None if ran else seed


def _score_tokens(
    result: dict[str, Any], rec, attack, judge: TruthJudge, config: AttackConfig, control_docs: int, progress
) -> list[dict[str, Any]]:
    """Score a reconstruction of tokens into ``result`` (its extras by ``rec.result_fields``, its mis-paired
    control where asked); return its per-document rows."""
    traffic, docs = judge.traffic, judge.docs
    sc = score_reconstruction(rec.tokens.numpy(), docs, _decoder(judge.tokenizer))
    result.update(sc.as_dict())
    result.update(rec.result_fields(judge))
    if control_docs and len(set(traffic.doc_ids)) >= 2:
        if len(set(traffic.doc_ids)) == len(traffic):
            result["control"] = mispaired_control(
                attack, traffic, controlled_read(rec), docs, control_docs, config, progress
            )
        else:  # training-phase traffic: a document crossed at several steps, and its twin takes all its crossings
            result["control"] = crossings_control(attack, traffic, controlled_read(rec), docs, control_docs, config)
    steps = traffic.steps if traffic.steps is not None else (None,) * len(traffic)
    per_doc_rows = []
    for row, pred, step in zip(sc.per_doc(), rec.tokens.tolist(), steps):
        row = dict(row)
        row["predicted"] = pred
        if config.phase == "train":
            row["step"] = step
        per_doc_rows.append(row)
    if config.phase == "train":
        assert traffic.steps is not None  # training-phase traffic records each frame's step
        result["weights"] = (
            f"each frame was produced by the client weights after as many training steps as its step number "
            f"(0 … {max(traffic.steps)}); the attacker's copy is the {config.client_copy} one "
            f"({'pretrained' if config.client_copy == 'public' else 'after the last step'})"
        )
    return per_doc_rows


def _score_properties(
    result: dict[str, Any], rec, knowledge: Knowledge, traffic: Traffic, docs, config: AttackConfig
) -> list[dict[str, Any]]:
    """Score a property attack (one score per document) into ``result``: the AUC per property token, beside
    VMI and the majority control for the leakage index; return its per-document rows."""
    scores = rec.extra["scores"]
    props = property_scores(scores, rec.extra["property_tokens"], docs)
    vmi = VMI(seed=config.attack_seed).fit(knowledge).reconstruct(traffic).tokens
    maj = Majority().fit(knowledge).reconstruct(traffic).tokens
    assert vmi is not None and maj is not None  # token attacks
    truth = torch.tensor([list(d.token_ids) for d in docs])
    a_vmi = float((vmi == truth).float().mean())
    a_ctl = float((maj == truth).float().mean())
    aucs = [p["auc"] for p in props if p["auc"] is not None]
    result.update(
        {
            "properties": props,
            "vmi_token_recovery": a_vmi,
            "majority_token_recovery": a_ctl,
            "leakage_index": leakage_index(a_vmi, a_ctl, aucs),
            "token_recovery": None,
            "doc_recovery": None,
            "span_recovery": None,
        }
    )
    return [{"doc_id": int(i), "score": float(s)} for i, s in zip(traffic.doc_ids, scores)]


def controlled_read(rec) -> torch.Tensor:
    """What the mis-paired control compares: the tokens, or for a label attack the labels it read (targets
    1..T−1) behind its first token, so that a reader of the labels is caught whatever tokens it returns."""
    labels = rec.extra.get("labels")
    if labels is None:
        return rec.tokens
    return torch.cat([rec.tokens[:, :1], labels.to(rec.tokens.dtype)], dim=1)


def crossings_control(
    attack, traffic: Traffic, arm_read: torch.Tensor, docs, control_docs: int, config: AttackConfig
) -> dict[str, Any]:
    """The twin of a reading of the training traffic (``verdicts.mispaired_documents``): every crossing of another
    training document, labelled as one of ``control_docs`` documents, read by the fitted ``attack``; per document,
    its share of tokens (a label attack's from token 1) read from the other's crossings minus the arm's own reading
    of those crossings against the same labels. A reader of the traffic reads both alike; one that reads the text by
    the documents' identity (or groups a document's rows to look it up) is detected."""
    rows, given, twin_traffic = mispaired_documents(traffic, config.attack_seed, control_docs)
    t0 = time.perf_counter()
    twin = controlled_read(attack.reconstruct(twin_traffic))
    order = list(dict.fromkeys(int(d) for d in traffic.doc_ids))
    by_id = {int(d.doc_id): d for d in docs}
    truth = np.array([list(by_id[d].token_ids) for d in order], dtype=np.int64)
    arm = [{"doc_id": int(d), "predicted": p} for d, p in zip(traffic.doc_ids, arm_read.tolist())]
    read = [{"doc_id": int(d), "predicted": p} for d, p in zip(twin_traffic.doc_ids, twin.tolist())]
    output = attack_info(config.attack).output
    control = document_control(arm, read, order, truth, rows, given, output, config.attack_seed)
    return {**control, "seconds": time.perf_counter() - t0}


def mispaired_control(
    attack, traffic: Traffic, arm_tokens: torch.Tensor, docs, control_docs: int, config: AttackConfig, progress
) -> dict[str, Any]:
    """The arm's mis-paired twin (``splitleak.audit.verdicts``): the fitted ``attack`` reads the traffic of
    other documents labelled with these documents' ids, and is scored against their labels beside the arm's
    own reading of that traffic. The documents and the derangement are drawn from the attack seed."""
    rows, given = mispairing(len(traffic), traffic.frames, control_docs, config.attack_seed)
    # the twin holds the given documents in the traffic's order, so that each of its frames has its rows in the arm's
    # order and a frame-by-frame reader reads the arm's very tensors (GMA-SL reads each frame once:
    # ``GMASL._read_frame``); its reading is put back in the order of ``rows``
    order = sorted(range(len(given)), key=lambda j: given[j])

    def twinned() -> Traffic:
        return traffic.subset([given[j] for j in order]).replace(doc_ids=tuple(traffic.doc_ids[rows[j]] for j in order))

    # one twin per traffic object and pairing in a knowledge's memo: the attacks that share the knowledge and
    # the traffic (a grid worker's group, an audit's suite) then share what they derive from the twin too
    kn = getattr(attack, "knowledge_", None)
    key = ("mispaired", tuple(int(r) for r in rows), tuple(int(g) for g in given))
    twin_traffic = kn.memo(key, twinned, traffic, whole=True) if kn is not None else twinned()
    t0 = time.perf_counter()
    read = controlled_read(attack.reconstruct(twin_traffic, progress))
    twin = torch.empty_like(read)
    twin[order] = read
    truth = np.array([list(d.token_ids) for d in docs], dtype=np.int64)
    delta = control_delta(twin.numpy(), arm_tokens.numpy(), truth, rows, given)
    n = control_interval(delta, n_boot=CONTROL_BOOT, seed=config.attack_seed)
    return {
        "type": MISPAIRED_CONTROL,
        "doc_ids": [int(traffic.doc_ids[r]) for r in rows],
        "given_doc_ids": [int(traffic.doc_ids[g]) for g in given],
        "twin_token_recovery": float((twin.numpy() == truth[rows]).mean()),
        "floor_token_recovery": float((arm_tokens.numpy()[given] == truth[rows]).mean()),
        "per_doc_delta": [float(x) for x in delta],
        "effect": dataclasses.asdict(n),
        "verdict": effect_verdict(n),
        "seconds": time.perf_counter() - t0,
    }
