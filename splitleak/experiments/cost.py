"""What a grid's ``full`` profile would cost, projected job by job from a store of its quick profile's measured
jobs (``benchmarks/grid.py`` measures and records it; ``splitleak reproduce --plan --price-from`` prices a
reproduction with it).

- attack job: its measured seconds (fit + reconstruct, from the store) for the same configuration (depth, cut,
  defence, attack with its parameters and read-out, k, budget, copy, perturbation; a full job with none is
  unmeasured) and attack seed, scaled by full / quick evaluation documents (linear; an upper bound, since a
  larger batch of documents costs less per document), plus its mis-paired twin's seconds (the result's
  ``control``) scaled by the twins' document ratio. A quick run with both of the full profile's attack seeds
  measures what the jobs that differ only in their seed share; with one seed, every full job pays for its own
  search;
- train job: split-training and all-local seconds (training.json, all_local.json) scaled by the step ratio, the
  rest (utility evaluations, capture, writing) by the evaluation-document ratio.

With ``flops`` (job key -> (counted FLOPs, job seconds)) each job's FLOPs are projected with the same scaling as
its seconds. Seconds are a job's wall seconds at the threads it ran with: core-hours are seconds x threads.
"""

from __future__ import annotations

import json
from pathlib import Path

from splitleak.audit.defaults import CONTROL_DOCS
from splitleak.experiments.runner import plan_grid
from splitleak.experiments.store import read_results


def signature(f: dict) -> tuple:
    return (
        f["depth"],
        f["offload_start"],
        f["offload_length"],
        f["defence"],
        f.get("attack"),
        f.get("k"),
        f.get("budget"),
        f.get("client_copy"),
        f.get("perturbation"),
        f.get("inference"),
        f.get("readout"),
        f.get("params"),  # a profile may run an attack with other parameters (decoys: a smaller probe battery)
    )


def project(
    spec: str | Path,
    quick_profile: str,
    overrides: list[str],
    store: Path,
    flops: dict[str, tuple[int, float]] | None = None,
) -> dict:
    """Projected seconds (and, with ``flops``, FLOPs) of the full profile from the quick run's jobs."""
    quick = plan_grid(spec, profile=quick_profile, overrides=overrides)
    models = quick.loaded.spec.models  # the full grid, on the model that was measured
    full = plan_grid(spec, profile="full", overrides=[*overrides, f"model=[{', '.join(models)}]"])
    qd, fd = quick.loaded.spec.documents, full.loaded.spec.documents
    doc_ratio = fd.n_eval / qd.n_eval
    step_ratio = (full.loaded.spec.steps or fd.n_train) / (quick.loaded.spec.steps or qd.n_train)

    flops = flops or {}
    twin_ratio = min(CONTROL_DOCS, fd.n_eval) / min(CONTROL_DOCS, qd.n_eval)
    # (signature, attack seed) -> (measured fit + reconstruct seconds, counted FLOPs of the job or None, its
    # counted seconds, the mis-paired twin's seconds)
    attack_s: dict[tuple, tuple[float, int | None, float | None, float]] = {}
    for r in read_results(store, as_rows=True, phase=None):  # every attack job, of either traffic
        if r["kind"] == "attack":
            counted = flops.get(r["key"])
            control = json.loads(r["result_json"]).get("control") or {}
            attack_s[(signature({**r}), r["attack_seed"])] = (
                r["seconds"],
                _count(counted),
                counted[1] if counted else None,
                float(control.get("seconds", 0.0)),
            )
    # a full job takes the quick job of its own attack seed where the quick run had it (two seeds measure what the
    # jobs that differ only in their seed share), else the first seed's (every seed paying for its own search)
    first_seed: dict[tuple, tuple[float, int | None, float | None, float]] = {}
    for (sig, _), v in sorted(attack_s.items(), key=lambda kv: kv[0][1]):
        first_seed.setdefault(sig, v)
    train_s: dict[tuple, tuple[float, float, int | None]] = {}
    for r in read_results(store, "train", as_rows=True):
        run = store / r["run_dir"]
        train = json.loads((run / "training.json").read_text())["seconds"]
        local_path = run / "all_local.json"
        local = json.loads(local_path.read_text())["seconds"] if local_path.is_file() else 0.0
        train_s[signature(r)] = (train + local, r["seconds"] - train - local, _count(flops.get(r["key"])))

    total_attack = total_train = 0.0
    total_flops, flops_missing = 0.0, 0
    missing = attack_measured = 0
    for j in full.jobs:
        if j.kind == "attack":
            sig = signature(j.fields)
            a = attack_s.get((sig, j.fields.get("attack_seed"))) or first_seed.get(sig)
            if a is None:
                missing += 1
                continue
            secs, scale, n = a[0] * doc_ratio + a[3] * twin_ratio, doc_ratio, a[1]
            total_attack += secs
            attack_measured += 1
            if n is not None and a[2]:  # the share outside fit + reconstruct: the twin, at its own ratio
                main = min(1.0, a[0] / a[2])
                scale = main * doc_ratio + (1.0 - main) * twin_ratio
        elif j.kind == "train":
            t = train_s.get(signature(j.fields))
            if t is None:
                missing += 1
                continue
            secs = t[0] * step_ratio + t[1] * doc_ratio
            scale, n = secs / max(t[0] + t[1], 1e-9), t[2]
            total_train += secs
        else:
            continue
        if n is None:
            flops_missing += 1
        else:  # the job's FLOPs grow with its projected seconds (the same FLOP rate)
            total_flops += n * scale
    c = full.counts()
    return {
        "attack_s": total_attack,
        "train_s": total_train,
        "missing": missing,
        "counts": c,
        "attack_measured": attack_measured,
        "doc_ratio": doc_ratio,
        "step_ratio": step_ratio,
        "flops": total_flops if flops and not flops_missing else None,
        "flops_missing": flops_missing,
    }


def _count(rec: tuple[int, float] | None) -> int | None:
    return None if rec is None else rec[0]
