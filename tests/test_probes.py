"""The probe battery on the decoy system's rows and the paired statistics it is read with: invariant
features that are invariant, a control that is the most frequent token, degenerate arms excluded,
and on the tiny model a probe that reads the naked boundary and nothing through the defence
(Politis & Pappas 2026, §3–§5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitleak.attacks.probes import (
    N_FEATURES,
    ProbeBattery,
    cross_gram_features,
    row_features,
    squared_gram,
)
from splitleak.defences.gauges import frame_gauge
from splitleak.errors import ConfigError, DataError
from splitleak.stats.bootstrap import frame_weights
from splitleak.stats.paired import (
    battery_verdict,
    frame_accuracy,
    modal_share,
    most_frequent,
    paired_interval,
    score_arms,
)

# ----------------------------------------------------------------------------- unit: features


@pytest.mark.unit
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.integers(2, 30))
def test_row_features_are_rotation_invariant_and_permute_with_the_rows(seed, rows):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 8, generator=gen, dtype=torch.float64)
    g = torch.randn(rows, 8, generator=gen, dtype=torch.float64)
    rot = torch.as_tensor(frame_gauge(seed, "train", 0, 0, rows, 8, scale=False).rotation)
    f = row_features(x)
    assert f.shape == (rows, N_FEATURES)
    torch.testing.assert_close(row_features(x @ rot), f)  # the index feature too: the order is kept
    perm = torch.randperm(rows, generator=gen)
    torch.testing.assert_close(row_features(x[perm])[:, :-1], f[perm, :-1])  # all but the row's index
    c = cross_gram_features(x, g)
    assert c.shape == (rows, N_FEATURES)
    torch.testing.assert_close(cross_gram_features(x @ rot, g @ rot), c)  # the shared rotation cancels
    a = squared_gram(x)
    torch.testing.assert_close(a.sum(-1), torch.ones(rows, dtype=torch.float64))


@pytest.mark.unit
def test_the_features_see_what_a_rotation_hides_and_not_more():
    """A feature that is not invariant would fail above; here the converse: two frames that differ only
    in one row's direction relative to the others get different features."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    y = x.clone()
    y[0] = -y[0]
    assert not torch.allclose(row_features(x), row_features(y))


@pytest.mark.unit
def test_shuffled_tokens_permute_known_rows_globally_and_keep_the_unknown():
    tokens = {0: np.array([5, 5, -1, 7]), 1: np.array([9, 7, 7, -1, 5])}
    out = ProbeBattery(seed=3).shuffled_tokens(tokens, [0, 1])
    flat_in, flat_out = np.concatenate(list(tokens.values())), np.concatenate([out[0], out[1]])
    assert (flat_out[flat_in < 0] == -1).all()
    assert sorted(flat_out[flat_in >= 0]) == sorted(flat_in[flat_in >= 0])
    outs = {tuple(np.concatenate([ProbeBattery(seed=s).shuffled_tokens(tokens, [0, 1])[k] for k in (0, 1)]))
            for s in range(8)}  # fmt: skip
    assert len(outs) > 1  # a permutation that depends on the seed, not the identity every time
    assert tokens[0].tolist() == [5, 5, -1, 7]  # the caller's labels are not touched


@pytest.mark.unit
def test_bad_probe_parameters_are_refused():
    with pytest.raises(ConfigError, match="unknown probe view"):
        ProbeBattery(views="forward,sideways")
    with pytest.raises(ConfigError, match="unknown probe model"):
        ProbeBattery(models=("mlp", "svm"))
    with pytest.raises(ConfigError, match="restarts must be a positive integer"):
        ProbeBattery(restarts=0)
    with pytest.raises(ConfigError, match="multiple of deep_heads"):
        ProbeBattery(deep_width=100, deep_heads=8)


# ----------------------------------------------------------------------------- unit: paired statistics


@pytest.mark.unit
def test_the_constant_control_and_frame_accuracy():
    labels = [np.array([3, 3, -1, 4]), np.array([4, 4, 3])]
    assert most_frequent(labels) == 3  # 3 and 4 tie at three rows: the smaller id
    acc, right, known = frame_accuracy([np.array([3, 0, 3, 4]), np.array([4, 0, 0])], labels)
    assert acc.tolist() == [2 / 3, 1 / 3] and (right, known) == (3, 6)  # the unknown row is not scored
    assert modal_share([np.array([3, 0, 9, 4]), np.array([4, 4, 0])], labels) == pytest.approx(3 / 6)
    with pytest.raises(DataError, match="no known row"):
        frame_accuracy([np.array([1])], [np.array([-1])])
    with pytest.raises(DataError, match="predictions for"):
        frame_accuracy([np.array([1, 2])], [np.array([1])])


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1])
def test_paired_interval_is_the_weighted_bootstrap_of_frame_differences(seed):
    rng = np.random.default_rng(seed)
    delta = rng.normal(0.02, 0.05, size=40)
    w = frame_weights(40, 2000, seed)
    iv = paired_interval(delta, w, 0.05)
    reps = np.array([np.repeat(delta, w[b].astype(int)).mean() for b in range(2000)])  # by hand
    assert iv.estimate == pytest.approx(delta.mean())
    assert (iv.low, iv.high) == pytest.approx(tuple(np.quantile(reps, [0.025, 0.975])))
    se = delta.std(ddof=1) / np.sqrt(40)
    assert iv.high - iv.low == pytest.approx(2 * 1.96 * se, rel=0.15)


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 7])
def test_a_reading_arm_is_detected_a_guessing_arm_at_floor_and_a_constant_arm_excluded(seed):
    rng = np.random.default_rng(seed)
    labels = [rng.choice([0, 1, 2, 3, 4, 5, 6, 7], size=32, p=[0.3] + [0.1] * 7) for _ in range(60)]
    reading = [np.where(rng.random(32) < 0.5, y, 99) for y in labels]  # names half the rows right
    guessing = [rng.choice(8, size=32, p=[0.3] + [0.1] * 7) for _ in labels]  # knows the frequencies only
    constant = [np.full(32, 0) for _ in labels]
    stats, extra = score_arms({"read": reading, "guess": guessing, "const": constant}, labels, seed=seed)
    by = {s.name: s for s in stats}
    assert extra["constant"]["token"] == 0 and 0.25 < extra["constant"]["accuracy"] < 0.35
    assert by["read"].effect.low > 0.1
    assert by["guess"].effect.estimate < 0  # below the constant: 0.3 * 0.3 + 7 * 0.01 < 0.3
    assert by["const"].degenerate and by["const"].effect.estimate == 0.0
    v = battery_verdict(stats, extra["weights"], extra["constant"]["accuracy"], alpha=0.05, gate=0.01)
    assert v["verdict"] == "detected" and v["best_arm"] == "read" and v["excluded_degenerate"] == ["const"]
    assert v["eligible"] == 2 and "Bonferroni over the 2 eligible arms" in v["family_correction"]
    assert v["breaks_gate"] and v["gate_statistic"] > 0.1
    v2 = battery_verdict(
        [by["guess"], by["const"]], extra["weights"], extra["constant"]["accuracy"], alpha=0.05, gate=0.01
    )
    assert v2["verdict"] in ("at floor", "below floor") and v2["best_arm"] == "guess"
    v3 = battery_verdict([by["const"]], extra["weights"], extra["constant"]["accuracy"], alpha=0.05, gate=0.01)
    assert v3["verdict"] == "no eligible arm"


# ----------------------------------------------------------------------------- integration


SMALL = dict(model="tiny-gpt2", n_calib=16, n_train=16, n_eval=8, steps=16, lr=3e-4, capture_batch=4)
BATTERY = {"views": "real-rows,joint,gradient", "models": "mlp,graph", "restarts": 1, "epochs": 30}


def _run(tmp_path, seed: int, **latent):
    from splitleak.training.config import make_train_config
    from splitleak.training.run import run_training

    keys = {"gauge_entropy": "derived", **latent}  # seeded, so that each reading is reproducible
    cfg = make_train_config(**SMALL, seed=seed, latent=dict(split_after=0, resume_at=3, width=16, **keys))
    out = tmp_path / f"run-{seed}-{len(latent)}"
    return out if out.exists() else run_training(cfg, out, device="cpu").run_dir


def _probe(tmp_path, seed: int, threat: str = "trained-codec", **latent):
    from splitleak.attacks import make_attack_config
    from splitleak.audit.evaluate import run_attack

    run = _run(tmp_path, seed, **latent)
    out = tmp_path / f"probe-{seed}-{len(latent)}-{threat}.json"
    config = make_attack_config(attack="latent-probe", params={**BATTERY, "threat": threat}, attack_seed=seed)
    return run_attack(run, config, out=out)


NAKED = dict(sigma=0.0, decoys=0, gauges=False)


@pytest.mark.integration
@pytest.mark.parametrize("seed", [1, 2])
def test_the_probes_read_the_naked_boundary_and_nothing_through_the_defence(tmp_path, seed):
    """Given the victim's trained codec (a threat model that grants it) and its own shadow frames, the
    battery reads the naked control (no noise, no decoys, no gauges) far above the most-frequent-token
    control, and the defended system (noise, decoys, gauges; output gradient open) at floor; the
    shuffled-label twins, scored against the true labels, read at floor in both."""
    naked = _probe(tmp_path, seed, **NAKED)
    assert naked["learnt_from"]["threat"] == "trained-codec" and naked["learnt_from"]["documents"] == 16
    naked = naked["probes"]
    assert naked["verdict"]["verdict"] == "detected" and naked["verdict"]["paired_low"] > 0.05
    assert naked["by_view"]["real-rows"]["verdict"] == "detected"
    assert naked["negative_control"]["verdict"]["verdict"] != "detected" and not naked["instrument_fault"]
    assert "training row" in naked["negative_control"]["type"]
    assert abs(naked["control_of_best_arm"]) < 0.1
    defended = _probe(tmp_path, seed)["probes"]
    assert defended["verdict"]["verdict"] != "detected", defended["verdict"]
    assert defended["verdict"]["paired_effect"] < 0.05
    assert defended["negative_control"]["verdict"]["verdict"] != "detected"
    # the same constant control both times: the most frequent evaluation token, on the real rows only
    assert naked["constant"]["known_rows"] == defended["constant"]["known_rows"] == 8 * 32


@pytest.mark.integration
@pytest.mark.parametrize("seed", [1, 2])
def test_the_codec_is_what_the_naked_boundary_hides_and_the_oracle_reads_it_as_an_upper_bound(tmp_path, seed):
    """Without the victim's codec, shadow frames of the attacker's own codec teach the probes nothing about
    the victim's coordinates: the naked boundary reads at or below floor. The oracle (the client's record)
    reads it, and says it is an upper bound."""
    own = _probe(tmp_path, seed, threat="shadow", **NAKED)
    assert own["learnt_from"]["rows_taken_as_real"].startswith("every row")
    assert own["probes"]["verdict"]["verdict"] != "detected", own["probes"]["verdict"]
    oracle = _probe(tmp_path, seed, threat="oracle", **NAKED)
    assert oracle["learnt_from"]["threat"] == "oracle" and "upper bound" in oracle["learnt_from"]["upper_bound"]
    assert oracle["probes"]["verdict"]["verdict"] == "detected"
    assert "permuted globally" in oracle["probes"]["negative_control"]["type"]


@pytest.mark.integration
def test_the_probe_result_names_its_arms_and_refuses_the_training_phase(tmp_path):
    import json

    from splitleak.attacks import make_attack_config
    from splitleak.audit.evaluate import run_attack

    res = _probe(tmp_path, 4, sigma=0.0, decoys=0, gauges=False)
    arms = [a["arm"] for a in res["probes"]["arms"]]
    assert arms == [f"{v}/{m}/0" for v in ("real-rows", "joint", "gradient") for m in ("mlp", "graph")]
    # 16 training frames seen, so 16 shadow training steps and a capture pass over the 16 own documents (4 frames each)
    assert res["channels_read"] == ["activations", "output-gradient"] and res["n_train_frames"] == 32
    on_disk = json.loads((tmp_path / "probe-4-3-trained-codec.json").read_text())
    assert on_disk["probes"]["verdict"] == res["probes"]["verdict"]
    run = res["run"]["dir"]
    with pytest.raises(ConfigError, match="capture pass only"):
        run_attack(run, make_attack_config(attack="latent-probe", params=BATTERY, phase="train"))


# ----------------------------------------------------------------------------- the dose ladder


def _traffic(seed: int, frames: int = 3, rows: int = 10, dim: int = 8):
    from splitleak.attacks.partition import LatentFrame, LatentTraffic

    gen = torch.Generator().manual_seed(seed)
    fs, tokens, real = [], {}, {}
    for i in range(frames):
        t = lambda: torch.randn(rows, dim, generator=gen, dtype=torch.float64)  # noqa: E731
        fs.append(LatentFrame(i, t(), t(), t(), t()))
        tokens[i] = np.arange(rows) % 4 + 10
        real[i] = np.arange(rows) < rows // 2
    return LatentTraffic("train", fs, rows // 2), tokens, real


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1])
def test_the_injection_plants_the_codeword_on_real_rows_at_the_dose(seed):
    from splitleak.audit.dose_latent import codeword, dosed_rows, frame_rotation, inject

    traffic, tokens, real = _traffic(seed)
    before = [f.x.clone() for f in traffic.frames]
    half = dosed_rows(traffic, real, 0.5, seed)
    assert len(half) == 8 and half < dosed_rows(traffic, real, 0.8, seed)  # nested: a prefix of one order
    assert all(real[f][r] for f, r in dosed_rows(traffic, real, 1.0, seed))  # decoys are never dosed
    full = inject(traffic, tokens, real, mode="coordinate", coverage=1.0, amplitude=1.0, seed=seed)
    inv = inject(traffic, tokens, real, mode="invariant", coverage=1.0, amplitude=1.0, seed=seed)
    none = inject(traffic, tokens, real, mode="coordinate", coverage=1.0, amplitude=0.0, seed=seed)
    for f, g, h, k, x0 in zip(traffic.frames, full.frames, inv.frames, none.frames, before):
        torch.testing.assert_close(f.x, x0)  # the input is not changed
        torch.testing.assert_close(k.x, x0)  # amplitude 0: nothing planted
        torch.testing.assert_close(g.x.norm(dim=-1), x0.norm(dim=-1))  # norms kept
        torch.testing.assert_close(g.g_out, f.g_out)  # only the dosed channel
        rot = frame_rotation(f.frame_id, 8, seed)
        for r in range(10):
            if not real[f.frame_id][r]:
                torch.testing.assert_close(g.x[r], x0[r])
                continue
            c = torch.as_tensor(codeword(int(tokens[f.frame_id][r]), 8, seed))
            torch.testing.assert_close(g.x[r], x0[r].norm() * c)
            torch.testing.assert_close(h.x[r], x0[r].norm() * (c @ torch.as_tensor(rot)))
    grad = inject(traffic, tokens, real, mode="coordinate", coverage=1.0, amplitude=1.0, channel="output-gradient")
    assert torch.equal(grad.frames[0].x, traffic.frames[0].x) and not torch.equal(
        grad.frames[0].g_out, traffic.frames[0].g_out
    )
    with pytest.raises(ConfigError, match="unknown dose mode"):
        inject(traffic, tokens, real, mode="spectral", coverage=1.0, amplitude=1.0)
    with pytest.raises(ConfigError, match="coverage must be in"):
        inject(traffic, tokens, real, mode="coordinate", coverage=1.5, amplitude=1.0)


@pytest.mark.unit
def test_the_paper_doses_are_the_artefacts_nineteen():
    import json

    from conftest import SHARED, need_shared

    from splitleak.audit.dose_latent import PAPER_DOSES

    path = SHARED / "data/setloop-decoys/anc/paper-data/collected/diagnostic/w24_metric_sweep/w24_dose_response.json"
    need_shared(path)
    theirs = sorted((d["mode"], d["coverage"], d["amplitude"]) for d in json.loads(path.read_text())["doses"])
    assert sorted(PAPER_DOSES) == theirs and len(PAPER_DOSES) == 19


@pytest.mark.integration
@pytest.mark.parametrize("channel", ["activations", "output-gradient"])
def test_the_ladder_detects_a_full_dose_and_not_a_zero_one(tmp_path, channel):
    from splitleak.audit.dose_latent import dose_ladder
    from splitleak.training.config import make_train_config
    from splitleak.training.run import run_training

    latent = dict(split_after=0, resume_at=3, width=16, gauge_entropy="derived")  # seeded: a reproducible reading
    cfg = make_train_config(**SMALL, seed=6, latent=latent)
    run = run_training(cfg, tmp_path / "run", device="cpu")
    doses = [("coordinate", 0.0, 1.0), ("coordinate", 1.0, 1.0), ("coordinate", 1.0, 0.05)]
    res = dose_ladder(run.run_dir, doses=doses, channel=channel, battery={"models": ("mlp",), "epochs": 30})
    zero, full, faint = res["doses"]
    assert zero["token_top1"]["verdict"] != "detected" and full["token_top1"]["verdict"] == "detected"
    assert full["token_top1"]["paired_low"] > 0.3 and faint["token_top1"]["verdict"] != "detected"
    assert res["onsets"]["token_top1"]["coordinate coverage (amplitude 1)"] == 1.0
    assert res["onsets"]["token_top1"]["invariant coverage (amplitude 1)"] is None  # no invariant dose was run
    assert res["battery"]["views"] == (["gradient"] if channel == "output-gradient" else ["real-rows"])


@pytest.mark.unit
def test_the_ladder_cli_never_overwrites_a_calibration(tmp_path):
    from typer.testing import CliRunner

    from splitleak.cli import app

    target = tmp_path / "cal" / "calibration.json"
    target.parent.mkdir()
    target.write_text("{}")
    r = CliRunner().invoke(
        app, ["calibrate", str(tmp_path / "run"), "--attack", "latent-probe", "--out", str(target.parent)]
    )
    assert r.exit_code != 0 and "already exists" in " ".join(r.output.split())
    assert target.read_text() == "{}"
