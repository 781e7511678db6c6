"""Grids of runs: a YAML spec expanded into train, attack and reuse jobs keyed by the SHA-256 of
their configuration, run on a local process pool or on Ray, into a resumable Parquet store.

    from splitleak.experiments import load_spec, plan_grid, run_grid, grid_status, read_results

    run = run_grid("paper_main", profile="quick", overrides=["model=tiny-gpt2"])
    rows = read_results(run.store)            # pyarrow.Table, one row per (attack job, document)
    utility = read_results(run.store, "train")

Names are imported lazily so that ``splitleak --help`` does not load torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ExperimentSpec": "splitleak.experiments.spec",
    "LoadedSpec": "splitleak.experiments.spec_loading",
    "load_spec": "splitleak.experiments.spec_loading",
    "resolve_spec_path": "splitleak.experiments.spec_loading",
    "shipped_specs": "splitleak.experiments.spec_loading",
    "defence_label": "splitleak.experiments.spec",
    "Grid": "splitleak.experiments.jobs",
    "Job": "splitleak.experiments.jobs",
    "expand": "splitleak.experiments.jobs",
    "ResultsStore": "splitleak.experiments.store",
    "read_results": "splitleak.experiments.store",
    "ATTACK_SCHEMA": "splitleak.experiments.store",
    "TRAIN_SCHEMA": "splitleak.experiments.store",
    "FAILED_SCHEMA": "splitleak.experiments.store",
    "GridRun": "splitleak.experiments.runner",
    "GridStatus": "splitleak.experiments.runner",
    "JobFailure": "splitleak.experiments.runner",
    "grid_status": "splitleak.experiments.runner",
    "plan_grid": "splitleak.experiments.runner",
    "run_grid": "splitleak.experiments.runner",
    "PlainReporter": "splitleak.experiments.display",
    "RichReporter": "splitleak.experiments.display",
    "SilentReporter": "splitleak.experiments.display",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'splitleak.experiments' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)


def __dir__() -> list[str]:
    return __all__
