"""The audit's readers of the whole training traffic: every pass, read at once, beside the bound over it.

Fine-tuning sends each training document once per pass (``--epochs``), each time with fresh noise, and the
audit's other readers read the capture pass (each evaluation document once). Where the chain adds noise
that a reader of every crossing is built for (``Defence.adaptive`` names ``crossings-aware``), the audit
also reads the training traffic as the server received it: ``activation-aware`` one crossing at a time,
and ``crossings-aware`` on the mean of each document's crossings, both on the public copy. A document's
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
from splitleak.audit.stages import finished_attack
from splitleak.runs.truth import eval_token_ids
from splitleak.stats import crossed_bootstrap_ci, paired_difference_ci

#: the one-crossing reader they are set beside (the strongest reader of one noised crossing)
ONE_CROSSING = "activation-aware"
#: the settings of both: the audit's suite's (k = 32)
PASS_PARAMS: dict[str, Any] = {"k": 32}
#: bootstrap replicates of the whole-traffic intervals
PASS_BOOT = 10_000


def pass_readers(adaptive: dict[str, Any]) -> list[str]:
    """The readers of every crossing the run's defences are built for (``AttackInfo.passes``)."""
    return [name for name in adaptive if attack_info(name).passes]


def whole_traffic_stage(a: Any, knowledge: Any, seen: Any, adaptive: dict[str, Any]) -> dict[str, Any] | None:
    """The whole-traffic readings and their bound (module docstring), or None where no defence of the chain
    names a reader of every crossing. ``a``: the audit (``splitleak.audit.run._Audit``); ``knowledge``: the
    public copy's; ``seen``: where the traffic is read (the client's run or the server's session)."""
    readers = pass_readers(adaptive)
    if not readers:
        return None
    traffic = load_traffic(seen.folder, phase="train")
    (a.out / "passes").mkdir(exist_ok=True)
    results = []
    for name in (ONE_CROSSING, *readers):
        stem = f"train-{name}"
        path = a.out / "passes" / f"{stem}.json"
        acfg = make_attack_config(
            attack=name, client_copy="public", attack_seed=a.seed, params=PASS_PARAMS, phase="train"
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
    scores = [document_scores(res["per_doc"], docs, truth) for res in results]
    bound = audit_bound(seen.folder, a.cfg.defences, a.mode, a.cfg.draws, docs, truth, a.pristine.model)
    return whole_traffic_record(a.cfg.n_steps, a.cfg.n_train, traffic.doc_ids, results, scores, bound, a.seed)


def document_scores(per_row: list[dict[str, Any]], docs: list[int], truth: np.ndarray) -> np.ndarray:
    """[documents, T]: per token, the share of a document's crossing rows whose reading is right."""
    sums = np.zeros(truth.shape, dtype=np.float64)
    counts = np.zeros(len(docs), dtype=np.int64)
    where = {d: i for i, d in enumerate(docs)}
    for row in per_row:
        i = where[int(row["doc_id"])]
        sums[i] += np.asarray(row["predicted"], dtype=np.int64) == truth[i]
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
) -> dict[str, Any]:
    """The report's ``whole_traffic``: the readings with their intervals (documents resampled),
    the combining reader's paired gain over the one-crossing reader, the bound, and whether a reading's lower
    end lies above the bound (``fault``)."""
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
    gain = paired_difference_ci(
        scores[-1].mean(1)[None, :],
        scores[0].mean(1)[None, :],
        n_boot=PASS_BOOT,
        seed=np.random.default_rng([seed, 0x6A1]),
    )
    top = bound.get("token_bound")
    fault = top is not None and any(r["tokens"]["low"] > top + 1e-9 for r in readers)
    return {
        "epochs": steps / n_train,
        "steps": steps,
        "documents": len(counts),
        "crossings": {"min": min(counts.values()), "max": max(counts.values())},
        "readers": readers,
        "gain": {"estimate": gain.estimate, "low": gain.low, "high": gain.high},
        "bound": bound,
        "fault": fault,
    }
