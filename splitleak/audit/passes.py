"""The audit's readers of the whole training traffic: every pass, read at once, beside the bound over it.

Fine-tuning sends each training document once per pass (``--epochs``), each time with fresh noise, and the
audit's other readers read the capture pass (each evaluation document once). Where the chain adds noise
that a reader of every crossing is built for (``Defence.adaptive`` names ``crossings-aware``), the audit
also reads the training traffic as the server received it: the reader of one crossing at a time and the
reader of every crossing built on it (``activation-aware`` and ``crossings-aware``; in label-shielded
fine-tuning ``gma-sl-aware`` and ``gma-sl-crossings``), on the public copy. A document's
reading is the mean over its crossing rows (the combining reader gives each the same). Beside them, the
bound over the same crossings (``splitleak.audit.bounds``, each training document composed over every pass
the tap recorded): a combining reader whose lower end lies above it is an INSTRUMENT FAULT. Each reader has its
mis-paired twin over every pass (``mispaired_documents``: every crossing of another training document, labelled
as this one), whose detection is an INSTRUMENT FAULT too: the reader reads the text by the documents' identity.

The results are kept in ``passes/`` as attack results (resumed like the audit's attacks); the report's
``whole_traffic`` holds the readings, their paired difference and the bound.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from splitleak.attacks import load_traffic, make_attack_config
from splitleak.attacks.registry import attack_info
from splitleak.audit.bounds import audit_bound
from splitleak.audit.evaluate import attack_label, run_attack
from splitleak.audit.plan import ADAPTIVE_PARAMS
from splitleak.audit.stages import finished_attack
from splitleak.audit.verdicts import document_control, document_scores, mispaired_documents
from splitleak.errors import ConfigError
from splitleak.runs.truth import eval_token_ids
from splitleak.stats import crossed_bootstrap_ci, paired_difference_ci

#: bootstrap replicates of the whole-traffic intervals
PASS_BOOT = 10_000


def pass_readers(adaptive: dict[str, Any]) -> list[str]:
    """The readers of every crossing the run's defences are built for (``AttackInfo.passes``)."""
    return [name for name in adaptive if attack_info(name).passes]


def whole_traffic_stage(a: Any, knowledge: Any, seen: Any, adaptive: dict[str, Any]) -> dict[str, Any] | None:
    """The whole-traffic readings and their bound (module docstring), or None where no defence of the chain
    names a reader of every crossing or no training document crossed twice (one pass). ``a``: the audit (``splitleak.audit.run._Audit``); ``knowledge``: the
    public copy's; ``seen``: where the traffic is read (the client's run or the server's session)."""
    readers = pass_readers(adaptive)
    if not readers:
        return None
    traffic = load_traffic(seen.folder, phase="train")
    if max(Counter(traffic.doc_ids).values()) < 2:  # one pass: the training traffic reads as the capture does
        return None
    (a.out / "passes").mkdir(exist_ok=True)
    # each reader of every crossing beside the reader of one crossing it adapts (AttackInfo.adapts)
    if any(attack_info(r).adapts is None for r in readers):
        raise ConfigError(f"a reader of every crossing names no reader of one crossing it adapts: {readers}")
    names = list(dict.fromkeys(n for r in readers for n in (str(attack_info(r).adapts), r)))
    results = [_read(a, name, f"train-{name}", knowledge, seen, traffic) for name in names]
    docs = list(dict.fromkeys(int(d) for d in traffic.doc_ids))
    truth = eval_token_ids(a.out / "run", docs, phase="train")
    scores = [document_scores(res["per_doc"], docs, truth, attack_info(res["attack"]).output) for res in results]
    for name, res in zip(names, results):  # each reader's mis-paired twin over every pass
        res["control"] = _document_control(a, name, knowledge, seen, traffic, res, docs, truth)
    # the mechanism's game reads no document: the audit's own bound plays it
    bound = audit_bound(
        seen.folder, a.cfg.defences, a.mode, a.cfg.draws, docs, truth, a.pristine.model, mechanism=False
    )
    pairs = [(names.index(str(attack_info(r).adapts)), names.index(r)) for r in readers]  # every pass reader adapts one
    return whole_traffic_record(a.cfg.n_steps, a.cfg.n_train, traffic.doc_ids, results, scores, bound, a.seed, pairs)


def _read(a: Any, name: str, stem: str, knowledge: Any, seen: Any, traffic: Any) -> dict[str, Any]:
    """Reader ``name`` on ``traffic`` (the training traffic, or its twin), kept as ``passes/STEM`` and resumed."""
    path = a.out / "passes" / f"{stem}.json"
    acfg = make_attack_config(
        attack=name, client_copy="public", attack_seed=a.seed, params=ADAPTIVE_PARAMS.get(name, {}), phase="train"
    )
    if not a.stages.done(f"passes:{stem}"):
        a.stages.data["current"] = f"passes {stem}"
        a.stages.clear_files(f"passes/{stem}.json", f"passes/{stem}.parquet")
        run_attack(
            seen.folder, acfg, out=path, knowledge=knowledge, traffic=traffic, progress=a.progress,
            documents=a.out / "run" if seen.session is not None else None, control_docs=0,
        )  # fmt: skip
        a.stages.finish(f"passes:{stem}", [f"passes/{stem}.json", f"passes/{stem}.parquet"])
    return finished_attack(path, acfg, a.cfg.hash())


def _document_control(
    a: Any, name: str, knowledge: Any, seen: Any, traffic: Any, res: dict[str, Any], docs: list[int], truth: np.ndarray
) -> dict[str, Any]:
    """The reader's mis-paired twin over every pass (resumed like the readers): per training document, its share
    of tokens read from another document's crossings labelled as it, minus the reader's own reading of those
    crossings against the same labels. A reader of the traffic reads both alike (N at 0); one that reads the
    text by the documents' identity reads the twin far better (``detected``: an INSTRUMENT FAULT)."""
    rows, given, twin = mispaired_documents(traffic, a.seed)
    twin_res = _read(a, name, f"train-{name}-twin", knowledge, seen, twin)
    return document_control(
        res["per_doc"], twin_res["per_doc"], docs, truth, rows, given, attack_info(name).output, a.seed
    )


def whole_traffic_record(
    steps: int,
    n_train: int,
    doc_ids: tuple[int, ...],
    results: list[dict[str, Any]],
    scores: list[np.ndarray],
    bound: dict[str, Any],
    seed: int,
    pairs: list[tuple[int, int]],
) -> dict[str, Any]:
    """The report's ``whole_traffic``: the readings with their intervals (documents resampled), each combining
    reader's paired gain over the one-crossing reader it adapts (``pairs``: indices into ``results``; ``gain``
    is the first's, ``gains`` all), the bound, and whether a reading's lower end lies above the bound
    (``fault``)."""
    counts = Counter(int(d) for d in doc_ids)
    readers = []
    for res, sc in zip(results, scores):
        ci = crossed_bootstrap_ci(
            sc.mean(1)[None, :], n_boot=PASS_BOOT, seed=np.random.default_rng([seed, 0x9A55])
        )  # documents resampled
        readers.append(
            {"attack": res["attack"], "label": attack_label(res),
             "tokens": {"estimate": ci.estimate, "low": ci.low, "high": ci.high}, "control": res.get("control")}
        )  # fmt: skip
    gains = []
    for one, every in pairs:
        g = paired_difference_ci(
            scores[every].mean(1)[None, :],
            scores[one].mean(1)[None, :],
            n_boot=PASS_BOOT,
            seed=np.random.default_rng([seed, 0x6A1]),
        )
        gains.append(
            {"reader": readers[every]["label"], "against": readers[one]["label"],
             "estimate": g.estimate, "low": g.low, "high": g.high}
        )  # fmt: skip
    top = bound.get("token_bound")
    fault = top is not None and any(r["tokens"]["low"] > top + 1e-9 for r in readers)
    # a reader whose mis-paired twin reads the documents it is labelled as: it reads the text, not the traffic
    control_faults = [r["label"] for r in readers if (r.get("control") or {}).get("verdict") == "detected"]
    return {
        "epochs": steps / n_train,
        "steps": steps,
        "documents": len(counts),
        "crossings": {"min": min(counts.values()), "max": max(counts.values())},
        "readers": readers,
        "gain": gains[0],
        "gains": gains,
        "bound": bound,
        "fault": fault,
        "control_faults": control_faults,
    }
