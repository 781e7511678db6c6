"""benchmarks/grid.py projects the full profile of a grid from its quick profile's measured jobs. A full job
may only stand on a quick job that ran the same work: the same attack with the same parameters."""

import importlib.util
import json
from pathlib import Path

import pytest

from splitleak.experiments import plan_grid

pytestmark = pytest.mark.unit

GRID = Path(__file__).resolve().parents[1] / "benchmarks" / "grid.py"


def _grid_module():
    spec = importlib.util.spec_from_file_location("bench_grid", GRID)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def _unmatched(grid, name: str, overrides: list[str]) -> list[dict]:
    quick = plan_grid(name, profile="quick", overrides=overrides)
    full = plan_grid(name, profile="full", overrides=[*overrides, f"model=[{', '.join(quick.loaded.spec.models)}]"])
    measured = {grid.signature(j.fields) for j in quick.jobs if j.kind == "attack"}
    return [j.fields for j in full.jobs if j.kind == "attack" and grid.signature(j.fields) not in measured]


def test_a_full_job_is_projected_only_from_a_quick_job_with_the_same_attack_parameters(wikitext_dir):
    grid = _grid_module()
    over = [f"data.path={wikitext_dir}"]
    # decoys' quick profile runs a probe battery of 3 views x 2 models x 1 restart (4 views x the MLP on the
    # mitigation split, the gradient view x the MLP on the ladder); the full one the default 5 x 4 x 3: its 99
    # probe jobs (33 runs x 3 threat models) have no measurement; nor have, on the mitigation split, the 14 other
    # jobs per seed the quick profile leaves out there (the partition rules but the open arm's support rule, the
    # two adaptive attacks), nor the ladder's five arms' 5 others per seed (3 partition rules, 2 adaptive attacks);
    # everything else has
    missing = _unmatched(grid, "decoys", over)
    probes = [f for f in missing if f["attack"] == "latent-probe"]
    others = [f for f in missing if f["attack"] != "latent-probe"]
    ladder = {"open-del12", "open-del8", "open-del6", "open-w96", "open-w128"}
    assert len(probes) == 99 and len(others) == 14 * 3 + 5 * 5 * 3
    assert all(f["defence"].endswith("-mitigation") or f["defence"] in ladder for f in others)
    assert not any(
        f["defence"] == "open-mitigation" and f["params"] and json.loads(f["params"]) == {"rule": "support"}
        for f in others
    )
    missing = probes
    assert {json.loads(f["params"])["threat"] for f in missing} == {"shadow", "trained-codec", "oracle"}
    # mirage's quick GMA-SL runs 100 of its 400 steps: none of the full attack jobs has a measurement
    missing = _unmatched(grid, "mirage", over)
    assert len(missing) == 96 and {f["attack"] for f in missing} == {"gma-sl", "gma-sl-aware", "bisr", "bisr-f"}
    # paper_main's quick profile runs every configuration of the full one: all 3,440 are measured
    assert _unmatched(grid, "paper_main", over) == []
