"""Both sides in a grid's report: for each defended run, the strongest reading of the grid's attacks beside the most
any reader of its traffic can read (``report.grid_bound``), the same bound the audit computes; a chain without a
noise guarantee says it has none; a defence that declares more noise than it adds is an instrument fault."""

import json
import shutil
from dataclasses import replace

import pytest

SPEC = """\
name: bounded
protocol: proto.yaml
model: tiny-gpt2
depths: [2]
defences: [none, {name: clip-noise, args: {sigma: 0.5}}, quant8]
victim_seeds: [SEED]
attack_seeds: [0]
client_copies: [public]
documents: {n_calib: 8, n_train: 4, n_eval: 12, doc_len: 8}
steps: 2
capture_batch: 4  # three capture frames, so that each attack's mis-paired twin (whole frames) reads one of them
control_docs: 4
attacks:
  - {attack: vmi}
  - {attack: activation, k: 8}
"""


@pytest.mark.e2e
@pytest.mark.parametrize("seed", [1, 2])
def test_the_grid_report_gives_both_sides_and_catches_a_defence_that_adds_less_noise(tmp_path, monkeypatch, seed):
    from splitleak.attacks.knowledge import public_model
    from splitleak.audit.bounds import audit_bound
    from splitleak.audit.protocol import SHIPPED
    from splitleak.defences.noise import ClipNoise
    from splitleak.experiments import plan_grid, read_results, run_grid
    from splitleak.experiments.store import ResultsStore
    from splitleak.report.grid import grid_report
    from splitleak.runs.truth import phase_documents

    shutil.copy(SHIPPED / "paper_main.yaml", tmp_path / "proto.yaml")
    spec = tmp_path / "bounded.yaml"
    spec.write_text(SPEC.replace("SEED", str(seed)))
    store = tmp_path / "store"
    assert run_grid(spec, store=store, workers=1, threads=1, device="cpu").ok
    rep = grid_report(spec, out=tmp_path / "rep", store=store)
    by = {r["defence"]: r for r in rep.bounds}
    assert set(by) == {"clip-noise(sigma=0.5)", "quant8"}  # the undefended run is the reference, not a row
    noise, quant = by["clip-noise(sigma=0.5)"], by["quant8"]
    assert quant["why"] == "no defence of the chain adds noise with a formal guarantee" and quant["fault"] is None
    # the bound is the audit's, on the same run and documents
    job = next(j for j in plan_grid(spec).of_kind("train") if j.fields["defence"].startswith("clip-noise"))
    run = ResultsStore(store).run_dir(job.key)
    docs = phase_documents(run, "capture")
    chain = [{"name": "clip-noise", "args": {"sigma": 0.5}}]
    direct = audit_bound(run, chain, "plain", "os", [d.doc_id for d in docs], [d.token_ids for d in docs],
                         public_model(run).model)  # fmt: skip
    assert noise["bound"]["token_bound"] == pytest.approx(direct["token_bound"]) and direct["bounded"]
    assert noise["reading"]["mean"] <= noise["bound"]["token_bound"] and noise["fault"] is None
    assert noise["reading"]["documents"] == 12 and noise["reading"]["attack"] in ("vmi (public)", "activation (public)")
    text = " ".join(rep.markdown.read_text().split())
    assert "## The upper side: what no reader can read" in text and "INSTRUMENT FAULT" not in text
    # the spec's twins: 4 documents each (one whole frame), not the default's 12
    rows = read_results(store, "attack", as_rows=True)
    assert rows and all(len(json.loads(r["result_json"])["control"]["doc_ids"]) == 4 for r in rows)
    assert "no formal bound: no defence of the chain adds noise" in text
    # a defence that declares ten thousand times the noise it adds: its bound falls under what was read, and its
    # mechanism's game fails; the same store, reported again, names the fault
    declared = ClipNoise.noise_guarantees
    monkeypatch.setattr(ClipNoise, "noise_guarantees",
                        lambda self: [replace(g, sigma=g.sigma * 1e4) for g in declared(self)])  # fmt: skip
    planted = grid_report(spec, out=tmp_path / "planted", store=store)
    fault = next(r for r in planted.bounds if r["defence"].startswith("clip-noise"))["fault"]
    assert fault is not None and "above the" in fault
    assert "**INSTRUMENT FAULT** (tiny-gpt2, clip-noise(sigma=0.5)" in (tmp_path / "planted" / "report.md").read_text()
