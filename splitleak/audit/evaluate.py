"""Run one attack configuration against one run directory and score it.

The orchestrator is the only place that holds both sides: it gives the attack its ``Knowledge``
and the ``Traffic``, and afterwards scores the returned token ids against the documents of the
traffic's phase, which the attack never sees. It sits in the audit stage because scoring
(``splitleak.metrics``) lies to the right of the attacks in the flow of data; the attacks know
nothing of scores.
"""

from __future__ import annotations

import dataclasses
import fcntl
import glob
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from splitleak.attacks.config import AttackConfig, perturb_gradients
from splitleak.attacks.core import VMI, Majority, make_attack
from splitleak.attacks.knowledge import Knowledge, Traffic, load_knowledge, load_traffic
from splitleak.attacks.partition import LatentPartition, load_latent_traffic, score_partition
from splitleak.attacks.probes import ProbeBattery
from splitleak.attacks.registry import attack_info, attacks_for_mode
from splitleak.audit.extras import TruthJudge
from splitleak.audit.gate import latent_verdict, shipped_thresholds
from splitleak.audit.verdicts import MISPAIRED_CONTROL, control_delta, control_interval, mispairing
from splitleak.errors import ConfigError, SplitleakError
from splitleak.files import json_default, parquet_bytes, write_atomic
from splitleak.metrics import leakage_index, roc_auc, score_reconstruction
from splitleak.progress import Progress, Silent
from splitleak.runs.journal import JOURNAL
from splitleak.runs.manifest import pair_session, read_manifest, run_mode
from splitleak.runs.truth import load_row_tokens, load_truth, phase_documents
from splitleak.runs.verify import require_verified
from splitleak.stats import effect_verdict
from splitleak.stats.paired import battery_verdict, score_arms

#: bootstrap replicates of a single attack's control interval (the audit recomputes its arms' with ARM_BOOT)
CONTROL_BOOT = 2000


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
        return run_partition_attack(run_dir, doc_dir, manifest, config, out_path, protocol_hash, force)
    if info.output == "row-tokens":
        return run_probe_attack(run_dir, doc_dir, manifest, config, out_path, protocol_hash, force)
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
    # a document read at several steps (training-phase traffic) could be paired with itself: no control there
    if control_docs and len(traffic) >= 2 and len(set(traffic.doc_ids)) == len(traffic):
        result["control"] = mispaired_control(attack, traffic, rec.tokens, docs, control_docs, config, progress)
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


def mispaired_control(
    attack, traffic: Traffic, arm_tokens: torch.Tensor, docs, control_docs: int, config: AttackConfig, progress
) -> dict[str, Any]:
    """The arm's mis-paired twin (``splitleak.audit.verdicts``): the fitted ``attack`` reads the traffic of
    other documents labelled with these documents' ids, and is scored against their labels beside the arm's
    own reading of that traffic. The documents and the derangement are drawn from the attack seed."""
    rows, given = mispairing(len(traffic), traffic.frames, control_docs, config.attack_seed)

    def twinned() -> Traffic:
        return traffic.subset(given).replace(doc_ids=tuple(traffic.doc_ids[r] for r in rows))

    # one twin per traffic object and pairing in a knowledge's memo: the attacks that share the knowledge and
    # the traffic (a grid worker's group, an audit's suite) then share what they derive from the twin too
    kn = getattr(attack, "knowledge_", None)
    key = ("mispaired", tuple(int(r) for r in rows), tuple(int(g) for g in given))
    twin_traffic = kn.memo(key, twinned, traffic, whole=True) if kn is not None else twinned()
    t0 = time.perf_counter()
    twin = attack.reconstruct(twin_traffic, progress).tokens
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


def _latent_result(
    config: AttackConfig,
    attack,
    run_dir: Path,
    manifest: dict[str, Any],
    frames: int,
    seconds: float,
    protocol_hash: str | None,
):
    """The head of a latent-mode attack's RESULT.json (it recovers no text: the token fields are None)."""
    return {
        "protocol_hash": protocol_hash,
        "attack": config.attack,
        "config": config.model_dump(mode="json"),
        "config_hash": config.hash(),
        "attack_params": attack.params(),
        "run": {"dir": str(run_dir), "config_hash": manifest["config_hash"], "config": manifest["config"]},
        "phase": config.phase,
        "channels_read": list(attack.channels_read()),
        "n_frames": frames,
        "seconds": seconds,
        "token_recovery": None,
        "doc_recovery": None,
        "span_recovery": None,
    }


def run_partition_attack(
    run_dir: Path,
    doc_dir: Path,
    manifest: dict[str, Any],
    config: AttackConfig,
    out_path: Path | None,
    protocol_hash: str | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """A partition attack on a latent run's frames of ``config.phase``, scored against the client's
    record of real rows. The attack is given the training-phase frames where it reads what the server
    saw before, their truth only where it fits on labels (the classifier rule: then it is evaluated on
    the capture pass only), and the run's public latent arguments; never the client's private files."""
    attack = make_attack(config.attack, **config.attack_params())
    if not isinstance(attack, LatentPartition):
        raise ConfigError(
            f"attack {config.attack!r} is registered as a partition attack but is not a LatentPartition "
            "(splitleak.attacks.partition); derive it from that class"
        )
    labels = attack.needs_labels()
    if labels and config.phase == "train":
        raise ConfigError(f"{config.attack} fits on the training frames' truth; evaluate it on the capture pass")
    truth = load_truth(doc_dir)
    traffic = load_latent_traffic(run_dir, config.phase)
    t0 = time.perf_counter()
    history = None
    if labels or attack.reads_history():
        history = traffic if config.phase == "train" else load_latent_traffic(run_dir, "train")
    attack.fit(history, truth if labels else None, public=(manifest["config"] or {}).get("latent"))
    parts = attack.partition(traffic)
    seconds = time.perf_counter() - t0
    scored = score_partition(traffic, truth, parts)
    result = _latent_result(config, attack, run_dir, manifest, len(traffic), seconds, protocol_hash) | {
        "partition": scored
    }
    if attack.report():  # what the attack found on the traffic alone (gauge-key-search: the seed)
        result["attack_summary"] = attack.report()
    per_frame = [
        {"frame_id": f.frame_id, "rows": len(pred), "exact": bool((pred == truth[f.frame_id]).all()),
         "agreement": float((pred == truth[f.frame_id]).mean())}
        for f, (_, pred) in zip(traffic.frames, parts)
    ]  # fmt: skip
    if out_path is not None:
        write_result(out_path, result, per_frame, force=force)
    result["per_doc"] = per_frame
    return result


SHUFFLED_CONTROL = (
    "shuffled-label: the tokens of every labelled row, probe training and evaluation alike, permuted globally "
    "once, and the whole battery retrained on them"
)


#: frame-bootstrap replicates of the probe battery's intervals (recorded in its result)
PROBE_BOOT = 10_000


def run_probe_attack(
    run_dir: Path,
    doc_dir: Path,
    manifest: dict[str, Any],
    config: AttackConfig,
    out_path: Path | None,
    protocol_hash: str | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """The probe battery on a latent run: trained on the training-phase frames with the client's record
    of their tokens, scored on the capture pass's real rows against the most-frequent-token control
    (``splitleak.stats.paired``), with its shuffled-label twin (unless ``control=False``).

    The job runs without its protocol file, so it reads the battery at the shipped gate_002's gate, α
    and family (``splitleak.audit.gate``), recorded in each verdict; ``protocol_verdict`` is the
    protocol's test (002's nine arms per view). ``splitleak protocol analyse`` and a grid's report read
    the stored per-frame differences again under the protocol they check against (``reread_probes``)."""
    attack = make_attack(config.attack, **config.attack_params())
    if not isinstance(attack, ProbeBattery):
        raise ConfigError(f"attack {config.attack!r} is registered as a probe battery but is not a ProbeBattery")
    if config.phase != "capture":
        raise ConfigError("the probes train on the training frames; they are scored on the capture pass only")
    real, tokens = load_truth(doc_dir), load_row_tokens(doc_dir)
    train, evaluation = load_latent_traffic(run_dir, "train"), load_latent_traffic(run_dir, "capture")
    every = [f.frame_id for f in train.frames + evaluation.frames]
    th = shipped_thresholds()
    t0 = time.perf_counter()

    def measure(battery: ProbeBattery) -> dict[str, Any]:
        labels_of = battery.shuffled_tokens(tokens, every) if battery.shuffle else tokens
        labels = [np.where(real[f.frame_id], labels_of[f.frame_id], -1) for f in evaluation.frames]
        arms = battery.run(train, evaluation, tokens, real)
        stats, extra = score_arms({a.name: a.predictions for a in arms}, labels, seed=battery.seed, n_boot=PROBE_BOOT)
        const = extra["constant"]
        w, rate = extra["weights"], const["accuracy"]
        by_view = {
            view: battery_verdict(
                [s for s in stats if s.name.startswith(view + "/")], w, rate, alpha=th.alpha, gate=th.gate
            )
            for view in battery.views
        }
        rows = [{**s.as_dict(), "classes": a.classes, "seconds": a.seconds} for s, a in zip(stats, arms)]
        frames = [
            {"arm": s.name, "frame_id": f.frame_id, "paired_delta": float(d)}
            for s in stats
            for f, d in zip(evaluation.frames, s.frame_delta)
        ]
        verdict = battery_verdict(stats, w, rate, alpha=th.alpha, gate=th.gate)
        return {
            "constant": const,
            "arms": rows,
            "verdict": verdict,
            "by_view": by_view,
            "protocol_verdict": latent_verdict(stats, w, rate, th),
            "bootstrap": {"n_boot": PROBE_BOOT, "seed": battery.seed},
            "_frames": frames,
        }

    measured = measure(attack)
    control = measure(attack.twin()) if attack.control and not attack.shuffle else None
    seconds = time.perf_counter() - t0
    per_frame = measured.pop("_frames")
    if control is not None:
        control.pop("_frames")
        control["type"] = SHUFFLED_CONTROL
        best = measured["verdict"].get("best_arm")
        twin = next((a for a in control["arms"] if a["arm"] == best), None)
        measured["control_of_best_arm"] = None if twin is None else twin["paired_effect"]
    result = _latent_result(config, attack, run_dir, manifest, len(evaluation), seconds, protocol_hash) | {
        "n_train_frames": len(train),
        "probes": {**measured, "negative_control": control},
    }
    if out_path is not None:
        write_result(out_path, result, per_frame, force=force)
    result["per_doc"] = per_frame
    return result


def check_result_out(out: Path, force: bool, *runs: str | Path | None) -> None:
    """Refuse, in one line and before an attack runs, an ``--out`` its result cannot go to: one that ends in
    ``.parquet`` (the name of its own predictions, written beside it), lies inside a run (``runs``, or any
    folder with a journal: a file added to a run makes it fail ``verify``), cannot be created (a file where
    a folder belongs), is a folder, or exists already without ``force``."""
    if out.suffix.lower() == ".parquet":
        raise SplitleakError(
            f"--out {out} ends in .parquet, the name the result's own predictions take beside it; give the result a "
            ".json name"
        )
    where = out.resolve()
    inside = [Path(r) for r in runs if r is not None and where.is_relative_to(Path(r).resolve())]
    inside += [a for a in where.parents if (a / JOURNAL).exists()]
    if inside:
        raise SplitleakError(
            f"--out {out} lies inside the run {inside[0]}, which holds only what it recorded (a file added there "
            "makes it fail `splitleak verify`); write the result outside it"
        )
    if out.is_dir():
        raise SplitleakError(f"--out {out} is a folder; name the result's file (RESULT.json) in it")
    if (out.exists() or out.is_symlink()) and not force:
        raise SplitleakError(f"{out} already exists; choose another --out or pass --force")
    above = next((a for a in out.absolute().parents if a.exists()), None)
    if above is None or not above.is_dir():
        raise SplitleakError(f"--out {out} cannot be created: {above} is not a folder; choose another --out")


def write_result(
    out_path: Path, result: dict[str, Any], per_doc_rows: list[dict[str, Any]], *, force: bool = True
) -> None:
    """RESULT.json and its predictions (``.parquet`` beside it, with page checksums and a content digest,
    its SHA-256 recorded in RESULT.json as ``predictions_sha256``), each written whole to a temporary
    file of this process, flushed to disk and renamed into place (``write_atomic``), the predictions
    first: a job killed at any point leaves no partial file under either name and no RESULT.json without
    its predictions. Temporary files that a killed writer of the same result left behind are removed;
    they never block a rerun.

    Both files are written under an exclusive lock on their folder (``flock``), so that two attacks with
    the same ``--out`` never mix their files; without ``force`` a RESULT.json that another attack wrote
    meanwhile is refused, and nothing is written."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    pq_path = out_path.with_suffix(".parquet")
    flat = []
    for row in per_doc_rows:
        r = {}
        for k, v in row.items():
            r[k] = json.dumps(v, sort_keys=True) if isinstance(v, dict) else v
        flat.append(r)
    data = parquet_bytes(pa.Table.from_pylist(flat) if flat else pa.table({}))
    result = dict(result)
    result["predictions"] = pq_path.name
    result["predictions_sha256"] = hashlib.sha256(data).hexdigest()
    text = json.dumps(result, indent=2, sort_keys=True, default=json_default) + "\n"  # before any file is written
    fd = os.open(out_path.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # one writer of results in this folder at a time; freed when fd closes
        if not force and (out_path.exists() or out_path.is_symlink()):
            raise SplitleakError(
                f"{out_path} already exists (another attack wrote it while this one ran); nothing was written: "
                "choose another --out, or pass --force to replace it"
            )
        write_atomic(pq_path, data)
        write_atomic(out_path, text.encode())
        for path in (pq_path, out_path):
            _remove_stale_temps(path)
    finally:
        os.close(fd)


def _remove_stale_temps(path: Path) -> None:
    """Delete the temporary files of ``path`` (``.NAME.PID.tmp``, or ``.NAME.tmp`` of earlier versions)
    whose writing process is gone: what a job killed mid-write left behind."""
    stale = [path.with_name(f".{path.name}.tmp")]
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid = tmp.name[len(path.name) + 2 : -len(".tmp")]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            stale.append(tmp)
    for tmp in stale:
        if tmp.is_file() and not tmp.is_symlink():
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True
