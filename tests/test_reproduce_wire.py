"""Claims of what a defence sends in every realization (``reproduce.wire``): 003's vMF bounds per row and SAS's
last-k rule, read from each label-shielded run's own record of its output gradient, judged as bounds."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from splitleak.defences import build_defence
from splitleak.reproduce.claims import Claim
from splitleak.reproduce.judge import measurable
from splitleak.reproduce.run import judge_claim
from splitleak.reproduce.wire import RECORD, wire_values, with_wire
from splitleak.training import make_train_config, run_training


def _ctx(docs):
    from splitleak.defences import WireContext

    return WireContext(seed=7, phase="capture", step=0, doc_ids=tuple(docs))


def _claim(metric: str, direction: str, threshold: float, defence: str = "vmf"):
    return Claim(
        id="b", wording="w", where="App. A.3", spec="mirage",
        paper={"estimate": threshold, "unit": "bound"},
        statistic={"kind": "bound", "metric": metric, "treatment": {"attack": None, "defence": defence}},
        agreement={"rule": "qualitative", "direction": direction, "threshold": threshold, "ours": True},
    )  # fmt: skip


def _row(values: dict, defence: str = "vmf", seed: int = 1) -> dict:
    return {"key": f"t{defence}{seed}", "model": "tiny-gpt2", "defence": defence, "victim_seed": seed, **values}


@pytest.mark.unit
@pytest.mark.parametrize("kappa", [1.0, 1000.0])
def test_vmf_rows_keep_the_bounds_and_a_sent_gradient_past_them_breaks_them(kappa):
    g = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(int(kappa))) * 3
    g[:, -1] = 0  # the last position has no target: no raw gradient, never read
    sent = build_defence("vmf", {"kappa": kappa}).top_gradient(g, _ctx(range(4)))
    v = wire_values(g, sent)
    assert v["wire_rows"] == 4 * 15 and v["wire_docs"] == 4
    assert v["asnr_min"] >= 0.5 - 1e-12 and v["noise_ratio_max"] <= 2 + 1e-12
    assert v["noise_ratio_max"] == pytest.approx(1 / v["asnr_min"])
    # the reading follows kappa: near-uniform directions (kappa 1) land some row far from its own, near the bound;
    # at kappa 1000 in 32 dimensions every direction stays close (cosine about 0.98)
    assert v["asnr_min"] < 0.8 if kappa == 1.0 else v["asnr_min"] > 2.0
    ok = judge_claim(_claim("asnr_min", "above", 0.5), [], [_row(v)])
    assert ok.verdict == "agrees" and "60 rows" in ok.reason, ok.reason
    # a mechanism that flips and scales a row (sent = -3 g on one row): ‖n‖ = 4 ‖g‖ there, past both bounds
    bad = sent.clone()
    bad[2, 5] = -3 * g[2, 5]
    w = wire_values(g, bad)
    assert w["asnr_min"] == pytest.approx(0.25) and w["noise_ratio_max"] == pytest.approx(4.0)
    assert judge_claim(_claim("asnr_min", "above", 0.5), [], [_row(v), _row(w, seed=2)]).verdict == "disagrees"
    assert judge_claim(_claim("noise_ratio_max", "below", 2.0), [], [_row(w)]).verdict == "disagrees"


@pytest.mark.unit
def test_a_zero_suffix_is_the_last_raw_row_sent_as_zero():
    g = torch.ones(3, 8, 4)
    g[:, -1] = 0
    sent = g.clone()
    sent[1, 5:] = 0  # document 1: its last two rows with a gradient sent as zero
    sent[2, 3] = 0  # document 2: a zero row inside, not at the end
    v = wire_values(g, sent)
    assert v["zero_suffix_share"] == pytest.approx(1 / 3)
    with pytest.raises(Exception, match="NaN or Inf"):
        wire_values(g, sent * float("nan"))


@pytest.mark.integration
@pytest.mark.parametrize("seed", [1, 2])
def test_sas_sends_no_zero_suffix_with_its_last_five_and_does_without_them(tmp_path, seed):
    small = dict(model="tiny-gpt2", n_calib=4, n_train=4, n_eval=16, doc_len=32, lr=1e-3, data="instructions")
    rows = []
    for label, last in (("sas", 5), ("sas-last0", 0)):
        cfg = make_train_config(
            **small, shielded={"bottom": 1, "top": 1}, defences=[{"name": "sas", "args": {"last": last}}], seed=seed,
            draws="derived",
        )  # fmt: skip
        res = run_training(cfg, tmp_path / label, device="cpu")
        assert (res.run_dir / RECORD).is_file()
        rows.append(_row({"run_dir": label}, label, seed))
    read = with_wire(rows, tmp_path)
    assert read[0]["wire_docs"] == 16 and read[0]["zero_suffix_share"] == 0.0
    own = load_file(tmp_path / "sas-last0" / RECORD)
    assert read[1]["zero_suffix_share"] == wire_values(own["raw"], own["sent"])["zero_suffix_share"] > 0
    assert judge_claim(_claim("zero_suffix_share", "below", 0.0, "sas"), [], read).verdict == "agrees"
    j = judge_claim(_claim("zero_suffix_share", "below", 0.0, "sas-last0"), [], read)
    assert j.verdict == "disagrees" and j.ours.estimate > 0, j.reason


@pytest.mark.unit
def test_bound_claims_say_why_when_they_cannot_be_read():
    assert "a bound is read of" in measurable(_claim("asnr", "above", 0.5))
    assert judge_claim(_claim("asnr_min", "above", 0.5), [], []).verdict == "not run"
    j = judge_claim(_claim("asnr_min", "above", 0.5), [], [_row({})])  # a run without its record
    assert j.verdict == "not run" and RECORD in j.reason


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1])
def test_the_vmf_fit_reads_draws_at_the_runs_kappa_and_refutes_draws_at_another(seed):
    """003's metric-DP premise: the sent directions are vMF(kappa) draws around the raw ones. Draws at the kappa the
    run names sit within sampling error of A_d(kappa); draws at twice it (or half) do not, and the claim disagrees."""
    import json

    from splitleak.defences.vmf import privatize_rows
    from splitleak.reproduce.wire import vmf_fit

    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(8, 50, 64, generator=gen, dtype=torch.float64)
    g[:, -1] = 0  # rows without a gradient are not read
    for kappa in (50.0, 1000.0):
        fit = vmf_fit(g, privatize_rows(g, kappa, gen), kappa)
        assert fit["vmf_cosine_z"] < 3.29 and fit["vmf_expected_cosine"] == pytest.approx(
            fit["vmf_mean_cosine"], abs=0.02
        )
        for wrong in (2 * kappa, kappa / 2):
            assert vmf_fit(g, privatize_rows(g, wrong, gen), kappa)["vmf_cosine_z"] > 10
    claim = _claim("vmf_cosine_z", "below", 3.29)
    good = vmf_fit(g, privatize_rows(g, 1000.0, gen), 1000.0)
    bad = vmf_fit(g, privatize_rows(g, 2000.0, gen), 1000.0)
    rows = [{**_row({**good, "wire_rows": 392, "wire_docs": 8}), "train_config": json.dumps({})}]
    ok = judge_claim(claim, [], rows)
    assert ok.verdict == "agrees" and "within sampling error" in ok.reason
    rows.append(_row({**bad, "wire_rows": 392, "wire_docs": 8}, seed=2))
    assert judge_claim(claim, [], rows).verdict == "disagrees"


@pytest.mark.unit
def test_only_a_run_of_the_vmf_mechanism_alone_is_read_for_its_fit():
    import json

    from splitleak.reproduce.wire import _vmf_kappa

    def row(chain):
        return {"train_config": json.dumps({"defences": chain})}

    assert _vmf_kappa(row([{"name": "vmf", "args": {"kappa": 50.0}}])) == 50.0
    assert _vmf_kappa(row([{"name": "vmf", "args": {}}])) == 1000.0  # the class's default, read from the class
    assert _vmf_kappa(row([{"name": "sas", "args": {}}, {"name": "vmf", "args": {}}])) is None
    assert _vmf_kappa(row([{"name": "mirage", "args": {}}])) is None
