"""One identity per configuration (issue 34): defence arguments are hashed in their canonical form
(``canonical_args``), and a results store written before — arguments hashed as typed — is reused, not rerun.

``tests/data/legacy-store`` was written by splitleak at 94b4aad (before the change) from its
``legacy.yaml``: mixup with its default ``lambda=0.75`` given explicitly, quant4-noisy with ``clip=1`` (an
int for a float). Every one of its 8 jobs is a job of the same spec today, under a new key."""

import json
import shutil
from pathlib import Path

import pytest

from splitleak.defences import canonical_args
from splitleak.errors import ConfigError
from splitleak.experiments import read_results, run_grid
from splitleak.experiments.rekey import apply_rekeys, find_rekeys
from splitleak.experiments.runner import grid_status, plan_grid
from splitleak.experiments.store import ResultsStore
from splitleak.runs.verify import verify_run
from splitleak.training import make_train_config

PINNED = Path(__file__).parent / "data" / "legacy-store"
MEASURED = ["doc_id", "token_correct", "token_counted", "exact", "predicted", "leakage_index"]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("a", "b"),
    [
        ({"name": "mixup"}, {"name": "mixup", "args": {"lambda": 0.75}}),
        ({"name": "quant4-noisy", "args": {"clip": 1}}, {"name": "quant4-noisy", "args": {"clip": 1.0}}),
        ({"name": "mirage", "args": {"m": 10}}, {"name": "mirage", "args": {"m": 10.0, "groups": 3}}),
        ({"name": "replica-median", "args": {"k": 3}}, {"name": "replica-median"}),
    ],
)
def test_one_configuration_has_one_hash_however_its_arguments_are_typed(a, b):
    assert make_train_config(defences=[a]).hash() == make_train_config(defences=[b]).hash()


@pytest.mark.unit
def test_arguments_that_differ_from_the_defaults_still_tell_configurations_apart():
    base = make_train_config(defences=[{"name": "mixup"}]).hash()
    other = make_train_config(defences=[{"name": "mixup", "args": {"lambda": 0.6}}])
    assert other.hash() != base and other.defences[0].args == {"lambda": 0.6}
    assert canonical_args("quant4-noisy", {"clip": 2, "noise": 0.1}) == {"clip": 2.0}
    assert isinstance(canonical_args("quant4-noisy", {"clip": 2})["clip"], float)
    # the canonical form of a configuration without explicit arguments is what it was: its pinned hash
    assert base == "e6900e41fd5889b63792abca80b2301b55a61f09ad840ce631c02546e79faa11"
    with pytest.raises(ConfigError, match="does not take argument"):
        make_train_config(defences=[{"name": "mixup", "args": {"lamda": 0.6}}])


@pytest.mark.unit
def test_mixups_lambda_keeps_its_hash_under_either_spelling():
    """mixup's ``__init__`` names its weight ``lam`` (``lambda`` is a Python keyword); a configuration may spell
    it either way, and both hash as configurations did before it had that signature (pinned)."""
    typed = make_train_config(defences=[{"name": "mixup", "args": {"lambda": 0.6}}])
    spelled = make_train_config(defences=[{"name": "mixup", "args": {"lam": 0.6}}])
    assert typed.hash() == spelled.hash() == "538d1a262d516e4e584ce0a70bf1bda4f88989d000b7075dd386e6fc73ea1e79"
    assert typed.defences[0].args == spelled.defences[0].args == {"lambda": 0.6}
    with pytest.raises(ConfigError, match="give lambda or lam, not both"):
        make_train_config(defences=[{"name": "mixup", "args": {"lambda": 0.6, "lam": 0.6}}])


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "legacy"
    shutil.copytree(PINNED, dst)
    return dst


def _measured(store: Path) -> dict[tuple, list]:
    rows = read_results(store, "attack", as_rows=True)
    return {(r["defence_name"], r["attack"], r["inference"], r["doc_id"]): [r[c] for c in MEASURED] for r in rows}


@pytest.mark.integration
def test_a_store_written_before_the_canonical_form_is_reused_not_rerun(tmp_path):
    root = _copy(tmp_path)
    spec, store = root / "legacy.yaml", root / "store"
    before = _measured(store)
    old_train = ResultsStore(store).keys("train")
    grid = plan_grid(spec)
    assert not old_train & set(grid.by_key)  # every stored key is an earlier one
    status = grid_status(spec, store=store)
    assert set(status.states.values()) == {"done"}, status.states

    result = run_grid(spec, store=store, workers=1, threads=1)
    assert (result.done_before, result.ran, result.reused, result.failures) == (8, 0, 0, [])
    rs = ResultsStore(store)
    assert rs.done_keys() == set(grid.by_key)  # every file now under its job's key, none left behind
    assert _measured(store) == before  # the same measurements, moved, not recomputed
    trains = read_results(store, "train", as_rows=True)
    assert sorted(r["defence"] for r in trains) == ["mixup(warmup=1)", "quant4-noisy"]
    for r in trains:
        assert json.loads(r["job_config"])["train"] == grid.by_key[r["key"]].config["train"]
        assert (store / r["run_dir"]).is_dir() and verify_run(store / r["run_dir"]).ok
    for r in read_results(store, "attack", as_rows=True):
        assert r["train_key"] in grid.by_key and (r["reuse_of"] is None or r["reuse_of"] in grid.by_key)


@pytest.mark.e2e  # a rekey killed midway, then the grid run again to its end
def test_a_rekeyed_run_serves_the_attacks_added_later_and_a_kill_midway_is_finished(tmp_path, monkeypatch):
    root = _copy(tmp_path)
    spec, store = root / "legacy.yaml", root / "store"
    text = spec.read_text()
    spec.write_text(text.replace("  - {attack: vmi}\n", "  - {attack: vmi}\n  - {attack: majority}\n"))
    grid = plan_grid(spec)
    rs = ResultsStore(store)
    rekeys = find_rekeys(grid, rs)
    assert sorted(r.kind for r in rekeys) == ["attack"] * 6 + ["train"] * 2

    calls = {"n": 0}
    real_remove = ResultsStore.remove

    def killed(self, kind, key):  # dies after writing the third new file (an attack job), before removing its old one
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        real_remove(self, kind, key)

    monkeypatch.setattr(ResultsStore, "remove", killed)
    with pytest.raises(KeyboardInterrupt):
        apply_rekeys(rs, rekeys)
    monkeypatch.setattr(ResultsStore, "remove", real_remove)

    result = run_grid(spec, store=store, workers=1, threads=1)
    assert (result.failures, result.done_before, result.ran) == ([], 8, 2)  # majority on each run only
    assert rs.done_keys() == set(grid.by_key)
    assert set((store / "runs").iterdir()) == {rs.run_dir(j.key) for j in grid.of_kind("train")}


@pytest.mark.unit
def test_an_attack_entry_filters_by_the_canonical_label(tmp_path):
    root = _copy(tmp_path)
    spec = root / "legacy.yaml"
    spec.write_text(
        spec.read_text().replace(
            "  - {attack: vmi}\n",
            "  - {attack: vmi}\n  - {attack: majority, defences: ['mixup(lambda=0.75,warmup=1)', 'quant4-noisy(clip=1)']}\n",
        )
    )
    grid = plan_grid(spec)
    majority = [j for j in grid.jobs if j.kind == "attack" and j.fields["attack"] == "majority"]
    assert sorted(j.fields["defence"] for j in majority) == ["mixup(warmup=1)", "quant4-noisy"]
