"""A grid reads the training traffic (attack entries with ``phase: train``): every pass of each training document as
the server received it, a row per crossing in the store, the capture tables untouched, the whole-document twin in
each result, and the report's section that sets the reader of every crossing against the reader of one crossing
and both against the bound over the same crossings (``report.grid_passes``)."""

import json
import shutil

import pytest

from splitleak.errors import ConfigError

SPEC = """\
name: passes
protocol: proto.yaml
model: tiny-gpt2
depths: [3]
defences: [{name: clip-noise, args: {clip: 0.1, sigma: 0.3}}]  # both directions noised
victim_seeds: [SEED]
attack_seeds: [0]
client_copies: [public]
documents: {n_calib: 2, n_train: 8, n_eval: 8, doc_len: 32, seed: SEED}
steps: 32
all_local_baseline: false
draws: derived
control_docs: 4
attacks:
  - {attack: vmi}
  - {attack: activation-aware, k: 32, phase: train}
  - {attack: crossings-aware, k: 32, phase: train}
"""


def _spec(tmp_path, seed, text=SPEC):
    from splitleak.audit.protocol import SHIPPED

    shutil.copy(SHIPPED / "paper_main.yaml", tmp_path / "proto.yaml")
    spec = tmp_path / "passes.yaml"
    spec.write_text(text.replace("SEED", str(seed)))
    return spec


@pytest.mark.unit
def test_phase_expands_the_entries_and_adaptive_adds_the_readers_of_every_crossing_only_there(tmp_path):
    from splitleak.experiments import plan_grid

    base = SPEC.split("attacks:")[0]
    g = plan_grid(
        _spec(tmp_path, 0, base + "attacks:\n  - {attack: adaptive, k: 8, budget: 8, phase: [capture, train]}\n")
    )
    phases = {}
    for j in g.of_kind("attack"):
        phases.setdefault(j.fields["attack"], set()).add(j.config["attack"].get("phase", "capture"))
    # clip-noise's readers, on both traffics; the reader of every crossing on the training traffic only
    assert phases["activation-aware"] == {"capture", "train"} and phases["crossings-aware"] == {"train"}
    capture_only = plan_grid(_spec(tmp_path, 0, base + "attacks:\n  - {attack: adaptive, k: 8, budget: 8}\n"))
    assert "crossings-aware" not in {j.fields["attack"] for j in capture_only.of_kind("attack")}
    # the capture pass keeps its keys (phase is written only when it is train)
    vmi = plan_grid(_spec(tmp_path, 0, base + "attacks:\n  - {attack: vmi}\n"))
    both = plan_grid(_spec(tmp_path, 0, base + "attacks:\n  - {attack: vmi, phase: [capture, train]}\n"))
    assert {j.key for j in vmi.of_kind("attack")} < {j.key for j in both.of_kind("attack")}
    with pytest.raises(ConfigError, match="inference"):
        plan_grid(_spec(tmp_path, 0, base + "attacks:\n  - {attack: vmi, inference: true, phase: train}\n"))


@pytest.mark.e2e
@pytest.mark.parametrize("seed", [0, 1])
def test_a_grid_reads_every_pass_and_its_report_sets_both_readers_beside_the_bound(tmp_path, seed):
    from splitleak.experiments import read_results, run_grid
    from splitleak.report.grid import grid_report

    spec = _spec(tmp_path, seed)
    store = tmp_path / "store"
    assert run_grid(spec, store=store, workers=1, threads=1, device="cpu").ok
    capture = read_results(store, "attack", as_rows=True)
    train = read_results(store, "attack", as_rows=True, phase="train")
    # the capture tables read the evaluation documents once each, as before; the training rows are apart
    assert {r["attack"] for r in capture} == {"vmi"} and len(capture) == 8
    assert {r["attack"] for r in train} == {"activation-aware", "crossings-aware"}
    for name in ("activation-aware", "crossings-aware"):
        rows = [r for r in train if r["attack"] == name]
        assert len(rows) == 32 and len({r["doc_id"] for r in rows}) == 8  # 4 passes x 8 documents, a row each
        assert sorted(r["step"] for r in rows) == list(range(32)) and {r["phase"] for r in rows} == {"train"}
        control = json.loads(rows[0]["result_json"])["control"]
        # the twin over every crossing: 4 documents, each read from another's crossings; a reader of the
        # traffic reads it as it reads its own, so the twin is not detected
        assert len(control["doc_ids"]) == 4 and control["verdict"] != "detected"
    assert len(read_results(store, "attack", as_rows=True, phase=None)) == 8 + 64

    rep = grid_report(spec, out=tmp_path / "rep", store=store)
    (rec,) = rep.passes
    assert rec["crossings"] == 4 and rec["documents"] == 8 and not rec["faults"]
    by = {r["attack"]: r for r in rec["readers"]}
    # reading every pass reads more than one crossing at a time (tests/test_crossings.py: +8 pp or more)
    (gain,) = rec["gains"]
    assert gain["reader"].startswith("crossings-aware") and gain["against"].startswith("activation-aware")
    assert (
        gain["estimate"] > 0.08
        and by["crossings-aware"]["tokens"]["estimate"] > by["activation-aware"]["tokens"]["estimate"]
    )
    # the bound over the same crossings: none here, and the section says why (the draws are the run seed's, so that
    # the test replays; tests/test_grid_bound.py bounds a grid's fresh draws)
    assert rec["bound"]["bounded"] is False and "keyed by the run seed" in rec["bound"]["why"]
    # and so does the capture pass's (a run's configuration leaves derived draws out: they once read as os)
    (capture_bound,) = rep.bounds
    assert capture_bound["bound"]["bounded"] is False and "keyed by the run seed" in capture_bound["why"]
    text = " ".join(rep.markdown.read_text().split())
    assert "## The whole training traffic" in text and "INSTRUMENT FAULT" not in text
    assert "crossings-aware (public)" in text and "100 (no bound: the noise is keyed by the run seed" in text


@pytest.mark.unit
def test_a_row_file_written_before_the_phase_columns_reads_them_as_the_capture_pass(tmp_path):
    import pyarrow as pa

    from splitleak.experiments.store import ATTACK_SCHEMA, ResultsStore, read_results
    from splitleak.files import parquet_bytes, write_atomic

    old = pa.schema([f for f in ATTACK_SCHEMA if f.name not in ("phase", "step")])
    row = {f.name: None for f in old}
    row.update(key="a" * 16, kind="attack", attack="vmi", doc_id=3, token_correct=5, token_counted=8)
    store = ResultsStore(tmp_path / "store")
    write_atomic(store.path("attack", "a" * 16), parquet_bytes(pa.Table.from_pylist([row], schema=old)))
    (back,) = read_results(store.root, "attack", as_rows=True)
    assert back["phase"] is None and back["step"] is None and back["token_correct"] == 5
    assert read_results(store.root, "attack", as_rows=True, phase="train") == []
    # a column that was always there is still required: its absence names the file
    from splitleak.errors import IntegrityError

    broken = pa.schema([f for f in old if f.name != "token_correct"])
    write_atomic(store.path("attack", "a" * 16), parquet_bytes(pa.Table.from_pylist([row], schema=broken)))
    with pytest.raises(IntegrityError, match="attack row file"):
        read_results(store.root, "attack", as_rows=True)


@pytest.mark.unit
def test_the_training_traffic_section_names_a_twin_that_reads_the_documents_it_is_labelled_as():
    """The section's fault check can fail: a reading whose stored twin was detected is an INSTRUMENT FAULT, one
    whose twin was not is not; a reader of every crossing is paired with the reader of one crossing it adapts."""
    from splitleak.report.document import Document, render_markdown
    from splitleak.report.grid_passes import passes_section, run_passes

    def rows(attack, key, verdict, right):
        control = json.dumps({"control": {"verdict": verdict, "effect": {"estimate": 0.0}}})
        return [
            {"train_key": "t", "key": key, "attack": attack, "client_copy": "public", "doc_id": d, "step": s,
             "token_correct": right[d] + s % 2, "token_counted": 8, "result_json": control}
            for d in range(6) for s in range(2)
        ]  # fmt: skip

    train = [{"key": "t", "model": "tiny-gpt2", "depth": 2, "defence": "clip-noise", "victim_seed": 0,
              "train_config": None, "run_dir": "runs/t"}]  # fmt: skip
    one = rows("activation-aware", "a", "at floor", [1, 2, 1, 3, 2, 1])
    for verdict, faulty in (("at floor", False), ("detected", True)):
        every = rows("crossings-aware", "b", verdict, [5, 6, 4, 6, 5, 5])
        (rec,) = run_passes(train, one + every, None)
        assert bool(rec["faults"]) is faulty and rec["crossings"] == 2 and rec["documents"] == 6
        (gain,) = rec["gains"]
        assert gain["reader"].startswith("crossings-aware") and gain["estimate"] == pytest.approx(3.5 / 8)
        doc = Document("t")
        passes_section(doc, [rec])
        assert ("INSTRUMENT FAULT" in render_markdown(doc)) is faulty
