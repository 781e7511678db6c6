"""Injected-leak calibration, shuffled-label controls, verdict words, and the protocol analysis."""

import json
import re
import shutil

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from splitleak.audit.analysis import analyse, compare, score_matrix
from splitleak.audit.calibrate import calibrate, dose_order, inject_leak, read_calibration
from splitleak.audit.protocol import freeze_protocol, load_protocol, parse_protocol, shipped_protocols
from splitleak.audit.verdicts import CONTROL_DOCS, arm_effects, arm_gate, control_delta, mispairing
from splitleak.cli import app
from splitleak.errors import ConfigError, DataError, IntegrityError, SplitleakError
from splitleak.report.audit import write_audit_report
from splitleak.report.calibration import write_calibration_report
from splitleak.stats import gate_statistic, heldout_rmse, ratio_bootstrap_ci
from splitleak.training import make_train_config, run_training

runner = CliRunner()


# ------------------------------------------------------------------ injection


@pytest.mark.unit
def test_injection_doses_exactly_the_first_rows_of_one_order_and_nests():
    g = torch.Generator().manual_seed(0)
    act, ref = torch.randn(5, 8, 3, generator=g), torch.randn(5, 8, 3, generator=g)
    order = dose_order(40, seed=3)
    assert sorted(order.tolist()) == list(range(40))
    assert torch.equal(inject_leak(act, ref, 0.0, 1.0, order), act)
    changed = []
    for cov in (0.1, 0.25, 0.5, 1.0):
        out = inject_leak(act, ref, cov, 0.5, order)
        rows = (out != act).any(-1).reshape(-1).nonzero().reshape(-1).tolist()
        assert len(rows) == round(cov * 40)
        assert set(changed) <= set(rows)  # nested: every row dosed at a lower coverage stays dosed
        changed = rows
        flat_out, flat_a, flat_r = out.reshape(40, 3), act.reshape(40, 3), ref.reshape(40, 3)
        assert torch.allclose(flat_out[rows], 0.5 * flat_a[rows] + 0.5 * flat_r[rows])
    assert torch.equal(inject_leak(act, ref, 1.0, 1.0, order), ref)
    assert not np.array_equal(dose_order(40, 3), dose_order(40, 4))
    with pytest.raises(ConfigError, match="must lie in"):
        inject_leak(act, ref, 1.5, 1.0, order)


@pytest.fixture(scope="module", params=[0, 1])
def noisy_run(request, tmp_path_factory):
    """Heavy forward noise on the tiny model: the attack reads at floor before any dose."""
    seed = request.param
    path = tmp_path_factory.mktemp(f"noisy{seed}") / "run"
    cfg = make_train_config(
        model="tiny-gpt2",
        depth=2,
        n_calib=16,
        n_train=16,
        n_eval=48,
        seed=seed,
        all_local_baseline=False,
        defences=[{"name": "clip-noise", "args": {"clip": 1.0, "sigma": 2.0, "where": "forward"}}],
        # the noise keyed by the seed: under the default fresh OS draws every suite trained another run, and
        # on one of them no row of the 0.3 x 0.5 dose moved its probe log-likelihood off the floor
        draws="derived",
    )
    run_training(cfg, path, device="cpu")
    return path


@pytest.mark.integration
def test_dose_ladder_detects_a_large_leak_and_nothing_at_zero_dose(noisy_run):
    out = noisy_run.parent / "cal"
    res = calibrate(noisy_run, "vmi", out=out, n_boot=1000, seed=5)
    doses = res.record["doses"]
    assert [d["coverage"] for d in doses] == [0.0, 0.02, 0.04, 0.06, 0.10, 0.30, 1.0]
    zero = doses[0]
    assert res.record["zero_dose_detects"] == []
    assert all(e is None or (e["effect"] == 0 and not e["detected"]) for e in zero["effects"].values())
    assert zero["token_top1"] < 0.05  # at floor before the dose: the noise hides the tokens
    # token top-1 rises with the dose; the full dose is read almost entirely
    top1 = [d["token_top1"] for d in doses]
    assert all(b >= a - 0.01 for a, b in zip(top1, top1[1:]))
    assert doses[-1]["token_top1"] > 0.95 and doses[-1]["effects"]["token_top1"]["detected"]
    assert doses[-1]["effects"]["token_cross_entropy"]["effect"] > 5  # nats
    assert res.onsets["token_top1"]["coverage"] <= 0.10
    assert res.onsets["rare_token_top1"] is not None and res.onsets["token_cross_entropy"] is not None
    # membership: both sets dosed alike, so a token-identity leak leaves the AUC flat (Politis & Pappas 2026, §4.1)
    assert max(abs(d["effects"]["membership_auc"]["effect"]) for d in doses) < 0.1
    # the gate breaks by the full dose, not at zero dose
    assert not zero["gate_breaks"] and doses[-1]["gate_breaks"]
    assert read_calibration(out)["onsets"] == res.onsets
    assert not (out / "calibration.md").exists()  # measuring writes the record only
    written = write_calibration_report(out)
    assert {p.name for p in written} >= {"calibration.md", "calibration.html", "calibration.png", "calibration.svg"}
    assert (out / "calibration.png").stat().st_size > 10_000 and (out / "calibration.svg").is_file()
    md = (out / "calibration.md").read_text()
    assert re.search(r"^\| 0\.02 × 1 +\|", md, re.M) and "![" in md and "(calibration.png)" in md
    assert "data:image/png;base64," in (out / "calibration.html").read_text()


@pytest.mark.integration
def test_the_dose_ladder_recomputes_only_the_dosed_rows_and_gets_the_whole_frames_numbers(noisy_run):
    from splitleak.attacks import load_knowledge, load_traffic
    from splitleak.audit.calibrate import TokenProbe, dosed_log_likelihood
    from splitleak.runs.truth import eval_token_ids

    kn, tr = load_knowledge(noisy_run, "public"), load_traffic(noisy_run)
    truth = torch.as_tensor(eval_token_ids(noisy_run, tr.doc_ids))
    probe = TokenProbe().fit(kn)
    reference = kn.client.activations(truth).to(tr.activations.dtype)
    order = dose_order(truth.numel(), seed=5)
    undosed = probe.log_likelihood(tr.activations, truth)
    for cov, amp in ((0.0, 1.0), (0.02, 1.0), (0.3, 0.5), (1.0, 1.0)):
        frame = inject_leak(tr.activations, reference, cov, amp, order)
        whole = probe.log_likelihood(frame, truth)
        part = dosed_log_likelihood(probe, undosed, frame, truth, cov, amp, order)
        assert torch.allclose(part, whole, atol=1e-6, rtol=0)
        changed = int((part != undosed).sum())
        assert changed <= round(cov * truth.numel()) and (cov == 0 or changed > 0)


@pytest.mark.integration
def test_calibrate_refuses_bad_input_and_keeps_what_exists(noisy_run, tmp_path):
    with pytest.raises(ConfigError, match="property"):
        calibrate(noisy_run, "property")
    with pytest.raises(ConfigError, match="coverages must lie"):
        calibrate(noisy_run, "vmi", coverages=[0.5, 2.0])
    with pytest.raises(ConfigError, match="unknown attack"):
        calibrate(noisy_run, "nope")
    out = tmp_path / "cal"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    r = runner.invoke(
        app,
        [
            "calibrate",
            str(noisy_run),
            "--attack",
            "vmi",
            "--out",
            str(out),
            "--quiet",
            "--coverage",
            "0.1",
            "--coverage",
            "1.0",
            "--n-docs",
            "16",
            "--n-boot",
            "200",
        ],
    )
    assert r.exit_code == 2 and "--force" in r.output and (out / "keep.txt").read_text() == "x"
    r = runner.invoke(
        app,
        [
            "calibrate",
            str(noisy_run),
            "--attack",
            "vmi",
            "--out",
            str(out),
            "--quiet",
            "--force",
            "--coverage",
            "0.1",
            "--coverage",
            "1.0",
            "--n-docs",
            "16",
            "--n-boot",
            "200",
        ],
    )
    assert r.exit_code == 0, r.output
    rec = json.loads((out / "calibration.json").read_text())
    assert [d["coverage"] for d in rec["doses"]] == [0.0, 0.1, 1.0] and rec["documents"] == 16
    assert "token_top1: first detects at coverage" in r.output


# ------------------------------------------------------------------ mis-paired controls and verdicts


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 7, 11])
def test_mispaired_control_reads_floor_for_readers_of_traffic_and_catches_a_reader_of_the_text(seed):
    rng = np.random.default_rng(seed)
    # templated text: position 0 is always token 1, so unrelated documents agree there
    truth = rng.choice(40, size=(60, 16), p=np.r_[0.2, np.full(39, 0.8 / 39)])
    truth[:, 0] = 1
    keep = rng.random(truth.shape) < 0.5
    noise = rng.integers(0, 40, truth.shape)
    traffic_reader = np.where(keep, truth, noise)  # reads each document from its own traffic, half right
    frames = np.repeat(np.arange(15), 4)  # 4 documents per frame
    rows, given = mispairing(60, frames, CONTROL_DOCS, seed)
    assert len(rows) >= CONTROL_DOCS and len(rows) % 4 == 0 and sorted(rows) == sorted(given)
    assert all(r != g for r, g in zip(rows, given))
    assert {frames[r] for r in rows} == {frames[g] for g in given}  # whole frames
    assert sorted(np.flatnonzero(np.isin(frames, [frames[r] for r in rows]))) == sorted(rows)
    arms = {"reader": traffic_reader, "perfect": truth.copy(), "constant": np.zeros_like(truth), "cheat": truth.copy()}
    twins = {
        "reader": traffic_reader[given],  # the same reading of the traffic it was given
        "perfect": truth[given],
        "constant": np.zeros((len(rows), 16), dtype=np.int64),
        "cheat": truth[rows],  # reads the text of the document it is labelled as
    }
    controls = {k: control_delta(twins[k], arms[k], truth, rows, given) for k in arms}
    base, effects = arm_effects(arms, truth, controls=controls, n_boot=2000, seed=seed)
    by = {a.name: a for a in effects}
    assert base.token_id == 0 and abs(base.rate - (truth == 0).mean()) < 1e-12
    assert by["perfect"].verdict == "detected" and by["reader"].verdict == "detected"
    assert by["perfect"].effect.estimate == pytest.approx(1 - base.rate)
    assert by["constant"].effect.estimate == 0 and by["constant"].verdict == "at floor"
    for name in ("reader", "perfect", "constant"):  # readers of the traffic: exactly 0
        assert by[name].control.estimate == 0 and by[name].control_verdict == "at floor", name
    # the reader of the text: the whole document against its unrelated agreement (position 0 and chance)
    assert by["cheat"].control_verdict == "detected" and by["cheat"].control.estimate > 0.6
    assert by["cheat"].verdict == "detected"  # what the arm alone cannot tell from the perfect reader
    # an arm without a twin is not measured, and a control for an unknown arm is refused
    _, only = arm_effects({"reader": traffic_reader}, truth, n_boot=200, seed=seed)
    assert only[0].control is None and only[0].control_verdict == "not measured"
    with pytest.raises(DataError, match="no predictions"):
        arm_effects({"reader": traffic_reader}, truth, controls={"other": controls["reader"]}, n_boot=200)
    g = arm_gate([by["perfect"], by["reader"]], base, 0.05, 0.01)
    ref = gate_statistic([by["perfect"].successes, by["reader"].successes], truth.size, base.rate, 0.05, 0.01)
    assert g == ref and g.breaks


@pytest.mark.unit
def test_mispairing_without_frames_and_its_refusals():
    rows, given = mispairing(5, None, 16, seed=3)  # fewer documents than asked: all of them
    assert sorted(rows) == list(range(5)) and all(r != g for r, g in zip(rows, given))
    assert mispairing(5, None, 16, seed=3) == (rows, given)  # seeded
    assert mispairing(40, None, 16, seed=4) != mispairing(40, None, 16, seed=5)
    rows, _ = mispairing(3, [0, 0, 0], 2, seed=0)  # one frame holds every document
    assert sorted(rows) == [0, 1, 2]
    with pytest.raises(DataError, match="at least 2 documents"):
        mispairing(1, None, 16, seed=0)
    with pytest.raises(DataError, match="control_docs"):
        mispairing(10, None, 1, seed=0)


@pytest.mark.e2e
def test_audit_under_heavy_noise_reads_at_floor_with_a_calibrated_metric(tmp_path):
    out = tmp_path / "audit"
    r = runner.invoke(
        app,
        [
            "audit",
            "--model",
            "tiny-gpt2",
            "--out",
            str(out),
            "--quiet",
            "--n-calib",
            "16",
            "--n-train",
            "6",
            "--epochs",
            "1",
            "--n-eval",
            "32",
            "--defence",
            "clip-noise",
            "--defence-arg",
            "sigma=2.0",
            "--seed",
            "1",
        ],
    )
    assert r.exit_code == 0, r.output
    rep = json.loads((out / "report.json").read_text())
    assert rep["verdict"].startswith("AT FLOOR")
    assert rep["verdicts"]["calibration"]["onsets"]["token_top1"] is not None
    assert not rep["verdicts"]["gate"]["breaks"]
    assert all(a["arm"]["verdict"] != "detected" and a["arm"]["control_verdict"] != "detected" for a in rep["attacks"])
    assert (out / "calibration" / "calibration.json").is_file()
    # one pass (--epochs 1): every training document crossed once, so no whole-traffic stage runs
    assert rep["whole_traffic"] is None and not (out / "passes").exists()
    md = (out / "report.md").read_text()
    assert "## Instrument calibration" in md and "relative perplexity change against the twin" in md
    assert "(calibration/calibration.png)" in md and (out / "calibration" / "calibration.png").is_file()
    page = (out / "report.html").read_text()
    assert rep["verdict"].split(":")[0] in page and "data:image/png;base64," in page
    # the report is a pure rendering of the JSON: rendering again gives the same bytes
    write_audit_report(out)
    assert (out / "report.md").read_text() == md
    with pytest.raises(SplitleakError, match="report.json does not exist"):
        write_audit_report(tmp_path / "nowhere")
    # the cost of the defence: an undefended twin with the same model, split, data and seed
    twin = json.loads((out / "twin" / "manifest.json").read_text())
    assert twin["defences"] == [{"name": "none", "args": {}}] and twin["config"]["seed"] == 1
    ppl = json.loads((out / "run" / "metrics.json").read_text())["perplexity"]
    ppl_twin = json.loads((out / "twin" / "metrics.json").read_text())["perplexity"]
    assert rep["cost"]["rel_ppl_change"] == pytest.approx(ppl / ppl_twin - 1, rel=1e-12) and ppl != ppl_twin
    assert runner.invoke(app, ["verify", str(out / "twin")]).exit_code == 0


# ------------------------------------------------------------------ statistics added for the analysis


@pytest.mark.unit
def test_ratio_bootstrap_is_a_ratio_of_sums_and_pairs_its_difference():
    num = np.array([3.0, 0.0, 5.0, 2.0])
    den = np.array([4.0, 1.0, 5.0, 6.0])
    iv = ratio_bootstrap_ci(num, den, n_boot=4000, seed=1)
    assert iv.estimate == pytest.approx(10 / 16) and iv.low < iv.estimate < iv.high
    same = ratio_bootstrap_ci(np.stack([num, num]), np.stack([den, den]), n_boot=500, seed=1)
    assert same.estimate == 0 and same.low == 0 and same.high == 0


@pytest.mark.unit
def test_heldout_rmse_matches_scikit_learn_ridge_and_detects_a_start_effect():
    from sklearn.linear_model import Ridge

    rng = np.random.default_rng(3)
    seeds = np.repeat(np.arange(8), 12)
    s = np.tile(np.repeat([2, 4, 6], 4), 8)
    b = np.tile(np.tile([0, 1, 2, 3], 3), 8)
    y = 0.5 * s + 2.0 * b - 0.3 * s * b + rng.normal(0, 0.2, s.size)
    h = heldout_rmse(y, s, b, seeds, test_seeds=[6, 7], ridge=0.7)
    train, test = seeds < 6, seeds >= 6
    for cols, rmse in (([s], h.rmse_length), ([s, b, s * b], h.rmse_with_start)):
        x = np.stack(cols, 1).astype(float)
        mu, sd = x[train].mean(0), x[train].std(0)
        m = Ridge(alpha=0.7).fit((x[train] - mu) / sd, y[train])
        ref = np.sqrt(np.mean((m.predict((x[test] - mu) / sd) - y[test]) ** 2))
        assert rmse == pytest.approx(ref, abs=1e-9)
    assert h.passes and h.reduction > 0.5 and (h.n_train, h.n_test) == (72, 24)
    y0 = 0.5 * s + rng.normal(0, 0.2, s.size)  # the start carries nothing
    assert not heldout_rmse(y0, s, b, seeds, test_seeds=[6, 7]).passes
    with pytest.raises(SplitleakError, match="held-out"):
        heldout_rmse(y, s, b, seeds, test_seeds=[99])


# ------------------------------------------------------------------ protocol analysis


def _rows(diff, seeds=(1, 2, 3, 4), n_docs=60, attack_seeds=(0, 1), rng_seed=0, phash="h"):
    """Per-document records of a treatment beating a control by ``diff`` on average."""
    rng = np.random.default_rng(rng_seed)
    rows = []
    for vs in seeds:
        level = rng.uniform(0.6, 0.8)
        for d in range(n_docs):
            p_doc = np.clip(level + rng.normal(0, 0.05), 0, 1)
            for a_seed in attack_seeds:
                for attack, p in (("joint", p_doc + diff), ("activation", p_doc)):
                    rows.append(
                        {
                            "attack": attack,
                            "k": 32,
                            "client_copy": "public",
                            "depth": 6,
                            "defence": "none",
                            "victim_seed": vs,
                            "attack_seed": a_seed,
                            "doc_id": d,
                            "token_counted": 32,
                            "token_correct": int(rng.binomial(32, np.clip(p, 0, 1))),
                            "exact": False,
                            "protocol_hash": phash,
                            "config_hash": f"{attack}{vs}{a_seed}",
                            "readout": "gradient" if attack == "joint" else None,
                        }
                    )
    return rows


@pytest.mark.unit
def test_main_test_passes_a_large_difference_and_fails_a_small_one():
    t = {"attack": "joint", "k": 32, "client_copy": "public", "depth": 6}
    c = {**t, "attack": "activation"}
    big = compare(_rows(0.06), t, c, metric="token_recovery", alpha=0.05, mark=0.02, n_boot=4000, seed=0)
    small = compare(_rows(0.01), t, c, metric="token_recovery", alpha=0.05, mark=0.02, n_boot=4000, seed=0)
    assert big.passes and big.low > 0.02 and abs(big.estimate - 0.06) < 0.01
    assert not small.passes and small.low < 0.02 and (big.n_models, big.n_docs) == (4, 60)
    m, seeds, docs = score_matrix([r for r in _rows(0.0) if r["attack"] == "joint"], "token_recovery")
    assert m.shape == (4, 60) and seeds == [1, 2, 3, 4]
    with pytest.raises(ConfigError, match="2 different configurations"):
        score_matrix(_rows(0.0), "token_recovery")
    # a perturbed joint attack beside the plain one is not picked unless the selector names it
    rows = _rows(0.06)
    rows += [{**r, "gradient_noise": 1.0, "token_correct": 0} for r in rows if r["attack"] == "joint"]
    # ... nor is the joint attacker with the pseudo-label map, or one recorded before read-outs
    # existed (it used that map), unless the selector names the read-out
    pm = [{**r, "readout": "pseudo-map", "token_correct": 32} for r in rows if r["attack"] == "joint"]
    legacy = [{**r, "readout": None, "token_correct": 31} for r in rows if r["attack"] == "joint"]
    again = compare(rows + pm, t, c, metric="token_recovery", alpha=0.05, mark=0.02, n_boot=4000, seed=0)
    assert again.estimate == big.estimate
    for extra in (pm, legacy):
        named = compare(
            rows + extra,
            {**t, "readout": "pseudo-map"},
            c,
            metric="token_recovery",
            alpha=0.05,
            mark=0.02,
            n_boot=200,
            seed=0,
        )
        assert named.estimate > 0.1 and named.n_docs == 60
    mixed = [{**r, "data_seed": r["victim_seed"]} for r in _rows(0.06)]  # each run drew its own documents
    with pytest.raises(SplitleakError, match="different data seeds"):
        compare(mixed, t, c, metric="token_recovery", alpha=0.05, mark=0.02, n_boot=100, seed=0)
    noisy = compare(
        rows, {**t, "gradient_noise": 1.0}, c, metric="token_recovery", alpha=0.05, mark=0.02, n_boot=500, seed=0
    )
    assert noisy.estimate < -0.5
    missing = compare(
        _rows(0.06), {**t, "depth": 3}, c, metric="token_recovery", alpha=0.05, mark=0.02, n_boot=100, seed=0
    )
    assert not missing.passes and "treatment" in missing.missing


@pytest.mark.unit
def test_analysis_runs_the_shipped_family_and_refuses_foreign_results():
    path = [p for p in shipped_protocols() if p.name == "paper_main.yaml"][0]
    proto = parse_protocol(path)
    fam = proto.family.expand(proto.main_test)
    assert len(fam) == 47 == proto.family.size
    assert proto.main_test.treatment not in [c.treatment for c in fam if c.control == proto.main_test.control]
    quick = proto.model_copy(
        update={
            "main_test": proto.main_test.model_copy(update={"n_boot": 2000}),
            "family": proto.family.model_copy(update={"n_boot": 500}),
        }
    )
    a = analyse(quick, "h", _rows(0.06))
    assert a.main.passes and a.family_alpha == pytest.approx(0.05 / 47)
    assert len(a.family) == 47 and not a.family_passes and all(c.missing for c in a.family)
    with pytest.raises(IntegrityError, match="protocol_hash other"):
        analyse(quick, "h", _rows(0.06, phash="other"))


@pytest.mark.unit
def test_family_size_must_match_its_comparisons(tmp_path):
    src = [p for p in shipped_protocols() if p.name == "paper_main.yaml"][0]
    bad = tmp_path / "p.yaml"
    bad.write_text(src.read_text().replace("size: 47", "size: 46"))
    with pytest.raises(ConfigError, match="generates 47 comparisons but declares size 46"):
        parse_protocol(bad)


@pytest.mark.integration
def test_protocol_analyse_cli_end_to_end_on_tiny_runs(tmp_path):
    proto = tmp_path / "mini.yaml"
    proto.write_text(
        "name: mini\nsource: test\nhypotheses: [activation beats the majority control]\n"
        "main_test:\n  description: activation minus majority\n  metric: token_recovery\n"
        "  treatment: {attack: activation, k: 4, depth: 2}\n  control: {attack: majority, depth: 2}\n"
        "  pass_mark: 0.2\n  n_boot: 2000\n"
        "victim_seeds: [0, 1]\ndocuments: {n_eval: 12}\n"
    )
    assert runner.invoke(app, ["protocol", "freeze", str(proto)]).exit_code == 0
    for seed in (0, 1):
        run = tmp_path / f"run{seed}"
        cfg = make_train_config(
            model="tiny-gpt2", depth=2, n_calib=8, n_train=4, n_eval=12, seed=seed, all_local_baseline=False
        )
        run_training(cfg, run, device="cpu")
        for attack, extra in (("activation", ["--k", "4"]), ("majority", [])):
            r = runner.invoke(
                app,
                [
                    "attack",
                    str(run),
                    "--attack",
                    attack,
                    *extra,
                    "--protocol",
                    str(proto),
                    "--out",
                    str(tmp_path / "results" / f"{attack}{seed}.json"),
                    "--quiet",
                ],
            )
            assert r.exit_code == 0, r.output
    r = runner.invoke(
        app, ["protocol", "analyse", str(proto), str(tmp_path / "results"), "--out", str(tmp_path / "analysis")]
    )
    assert r.exit_code == 0, r.output
    a = json.loads((tmp_path / "analysis.json").read_text())
    assert a["main"]["passes"] and a["main"]["n_models"] == 2 and a["main"]["n_docs"] == 12
    assert a["protocol_hash"] == load_protocol(proto)[1]
    # a result written under another protocol is refused, naming it
    other = tmp_path / "other.yaml"
    shutil.copy(proto, other)
    other.write_text(other.read_text().replace("pass_mark: 0.2", "pass_mark: 0.3"))
    freeze_protocol(other)
    r = runner.invoke(
        app,
        [
            "attack",
            str(tmp_path / "run0"),
            "--attack",
            "vmi",
            "--protocol",
            str(other),
            "--out",
            str(tmp_path / "results" / "vmi0.json"),
            "--quiet",
        ],
    )
    assert r.exit_code == 0
    r = runner.invoke(app, ["protocol", "analyse", str(proto), str(tmp_path / "results")])
    assert r.exit_code == 2 and "vmi" in r.output
