"""The audit's readers of the whole training traffic: every pass, read at once, beside the bound over it.

Fine-tuning sends each training document once per pass (``--epochs``), each time with fresh noise, and the
audit's other readers read the capture pass (each evaluation document once). Where the chain adds noise
that a reader of every crossing is built for (``Defence.adaptive`` names ``crossings-aware``), the audit
also reads the training traffic as the server received it: the reader of one crossing at a time and the
reader of every crossing built on it (``activation-aware`` and ``crossings-aware``; in label-shielded
fine-tuning ``gma-sl-aware`` and ``gma-sl-crossings``), on the public copy. A document's
reading is the mean over its crossing rows (the combining reader gives each the same). Beside them, the
bound over the same crossings (``splitleak.audit.bounds``, each training document composed over every pass
the tap recorded): a combining reader whose lower end lies above it is an INSTRUMENT FAULT.

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
    results = []
    for name in names:
        stem = f"train-{name}"
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
        results.append(finished_attack(path, acfg, a.cfg.hash()))
    docs = list(dict.fromkeys(int(d) for d in traffic.doc_ids))
    truth = eval_token_ids(a.out / "run", docs, phase="train")
    scores = [document_scores(res["per_doc"], docs, truth, attack_info(res["attack"]).output) for res in results]
    # the mechanism's game reads no document: the audit's own bound plays it
    bound = audit_bound(
        seen.folder, a.cfg.defences, a.mode, a.cfg.draws, docs, truth, a.pristine.model, mechanism=False
    )
    pairs = [(names.index(str(attack_info(r).adapts)), names.index(r)) for r in readers]  # every pass reader adapts one
    return whole_traffic_record(a.cfg.n_steps, a.cfg.n_train, traffic.doc_ids, results, scores, bound, a.seed, pairs)


def document_scores(per_row: list[dict[str, Any]], docs: list[int], truth: np.ndarray, output: str) -> np.ndarray:
    """[documents, positions]: per position, the share of a document's crossing rows whose reading is right
    (a label attack's from token 1 on: token 0 is no label)."""
    first = 1 if output == "labels" else 0
    sums = np.zeros((len(docs), truth.shape[1] - first), dtype=np.float64)
    counts = np.zeros(len(docs), dtype=np.int64)
    where = {d: i for i, d in enumerate(docs)}
    for row in per_row:
        i = where[int(row["doc_id"])]
        sums[i] += np.asarray(row["predicted"], dtype=np.int64)[first:] == truth[i, first:]
        counts[i] += 1
    return sums / counts[:, None]


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
             "tokens": {"estimate": ci.estimate, "low": ci.low, "high": ci.high}}
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
    }
