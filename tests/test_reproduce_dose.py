"""002's dose-ladder claims (``reproduce.dose``): the onset of a metric per seed judged against the paper's onset
and its tolerance, and the effect at one dose read from the stored frames with the crossed bootstrap."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from splitleak.reproduce.claims import Claim, load_claims
from splitleak.reproduce.dose import measure_dose
from splitleak.reproduce.judge import measurable
from splitleak.reproduce.run import judge_claim
from splitleak.stats.bootstrap import crossed_bootstrap_ci

COVERAGES = (0.0, 0.02, 0.04, 0.06, 0.10, 0.30, 1.0)
FRAMES = 6


def _dose(c: float, onset: float | None, effect: float, half: float, rare_onset: float | None = None) -> dict:
    """A coordinate-mode dose at amplitude 1 whose token top-1 (and gate) detect from ``onset`` on."""
    hit = onset is not None and c >= onset - 1e-12
    rare = rare_onset is not None and c >= rare_onset - 1e-12
    return {
        "mode": "coordinate", "coverage": c, "amplitude": 1.0, "best_arm": "real-rows/mlp/0",
        "token_top1": {"paired_effect": effect, "paired_low": effect - half, "paired_high": effect + half,
                       "verdict": "detected" if hit else "at floor"},
        "gate": {"statistic": effect + half, "breaks": hit},
        "rare_token_top1": {"rows": 40, "accuracy": 0.1 + effect, "low": 0.05 + effect, "high": 0.15 + effect,
                            "constant": 0.1, "detected": rare},
    }  # fmt: skip


def _rows(seed: int, onset: float | None, effects=None, half: float = 0.01, rare_onset=None, frames=FRAMES) -> list:
    """A dose-ladder job's store rows: one per dose and frame, the job's result in each."""
    rng = np.random.default_rng(seed)
    effects = effects or {c: 0.5 * c for c in COVERAGES}
    doses = [_dose(c, onset, effects[c], half, rare_onset) for c in COVERAGES]
    result = {"n_frames": frames, "dose": {"channel": "activations", "doses": doses, "rare_tokens": {"count": 3}}}
    head = {"key": f"d{seed}", "kind": "attack", "attack": "dose-ladder", "model": "tiny-gpt2", "defence": "open",
            "victim_seed": seed, "result_json": json.dumps(result)}  # fmt: skip
    out = []
    for d in doses:
        noise = rng.normal(0, 0.02, frames)
        for f, x in enumerate(d["token_top1"]["paired_effect"] + noise - noise.mean()):
            arm = f"coordinate/coverage={d['coverage']:g}/amplitude=1/real-rows/mlp/0"
            out.append({**head, "doc_id": 100 + f, "arm": arm, "paired_delta": float(x)})
    return out


def _claim(metric: str = "gate", estimate: float = 0.06, tolerance: float = 0.02, at_onset: float | None = 0.0098,
           form: str = "onset", **treatment) -> Claim:  # fmt: skip
    also = {} if at_onset is None else {"effect_at_onset": at_onset}
    t = {"attack": "dose-ladder", "arm": "open", "channel": "activations", **treatment}
    return Claim(
        id="d", wording="w", where="§4.1", spec="decoys",
        paper={"estimate": estimate, "unit": "coverage", "also": also},
        statistic={"kind": "dose", "metric": metric, "form": form, "treatment": t},
        agreement={"rule": "tolerance", "tolerance": tolerance, "ours": True},
    )  # fmt: skip


@pytest.mark.unit
def test_an_onset_within_the_band_agrees_and_editing_the_papers_onset_turns_it():
    rows = _rows(1, 0.06) + _rows(2, 0.04)
    j = judge_claim(_claim(), rows, [])
    assert j.verdict == "agrees" and "seed 1 first detects at 0.06; seed 2 first detects at 0.04" in j.reason
    assert (j.ours.estimate, j.ours.low, j.ours.high) == (0.05, 0.04, 0.06)
    # the paper's onset moved: every seed now detects earlier than its band
    assert judge_claim(_claim(estimate=0.3), rows, []).verdict == "disagrees"
    # a tighter band leaves seed 2 (0.04) outside and seed 1 (0.06) in: the seeds straddle its edge
    straddle = judge_claim(_claim(tolerance=0.01), rows, [])
    assert straddle.verdict == "underpowered" and "both sides" in straddle.reason
    # the claim's metric selects what is read: rare-token top-1 detects from 0.3 on both seeds
    rare = _rows(1, 0.06, rare_onset=0.3) + _rows(2, 0.04, rare_onset=0.3)
    assert judge_claim(_claim("rare_token_top1", estimate=0.3, at_onset=None), rare, []).verdict == "agrees"


@pytest.mark.unit
def test_a_zero_dose_that_detects_reads_no_onset():
    rows = _rows(1, 0.0) + _rows(2, 0.06)
    j = judge_claim(_claim(), rows, [])
    assert j.verdict == "underpowered" and "zero-dose cell already detects" in j.reason


@pytest.mark.unit
def test_a_later_onset_disagrees_unless_the_papers_effect_at_its_onset_lies_in_our_interval():
    # at 0.06 our token top-1 reads 0.03 +- 0.01: the paper's +0.98 pp lies outside [0.02, 0.04]
    rows = _rows(1, 0.3) + _rows(2, 0.3)
    j = judge_claim(_claim(), rows, [])
    assert j.verdict == "disagrees" and "outside every seed's interval" in j.reason
    # a wide interval there ([-0.07, 0.13]) holds +0.98 pp: this run cannot tell its effect from the paper's
    wide = _rows(1, 0.3, half=0.1) + _rows(2, 0.3)
    j = judge_claim(_claim(), wide, [])
    assert j.verdict == "underpowered" and "seed 1's interval" in j.reason
    # with no effect at the paper's onset to compare with, a later onset disagrees
    assert judge_claim(_claim(at_onset=None), wide, []).verdict == "disagrees"
    # a seed on which no dose detects: its onset is after the axis, the estimate says none
    never = _rows(1, None) + _rows(2, None)
    j = judge_claim(_claim(), never, [])
    assert j.verdict == "disagrees" and "seed 1 no dose detects" in j.reason and math.isinf(j.ours.estimate)


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1])
def test_an_effect_at_one_dose_is_the_crossed_bootstrap_of_the_stored_frames(seed):
    rows = _rows(10 + seed, 0.06) + _rows(20 + seed, 0.06)
    c = _claim("token_top1", estimate=0.0419, form="effect", mode="coordinate", coverage=0.1, amplitude=1.0)
    m = measure_dose(c, rows, n_boot=4000, alpha=0.05, seed=seed)
    assert not isinstance(m, str)
    est, low, high, units, seeds, frames, *_ = m
    name = "coordinate/coverage=0.1/amplitude=1/real-rows/mlp/0"
    mt = np.array([[r["paired_delta"] for r in rows if r["arm"] == name and r["victim_seed"] == s] for s in seeds])
    want = crossed_bootstrap_ci(mt, n_boot=4000, alpha=0.05, seed=seed)
    assert (est, low, high) == (want.estimate, want.low, want.high) and frames == FRAMES
    assert est == pytest.approx(0.05) and np.allclose(units, mt.mean(axis=0))
    # ours (+5 pp, its interval about +-1.5 pp) against +3.5 +- 2 pp straddles the band's edge; against +5 +- 2 pp
    # it agrees; against +10 +- 2 pp it disagrees
    assert 0.006 < high - est < 0.02 and 0.006 < est - low < 0.02
    edge = _claim("token_top1", estimate=0.035, form="effect", mode="coordinate", coverage=0.1, amplitude=1.0)
    assert judge_claim(edge, rows, []).verdict == "underpowered"
    near = _claim("token_top1", estimate=0.05, form="effect", mode="coordinate", coverage=0.1, amplitude=1.0)
    assert judge_claim(near, rows, []).verdict == "agrees"
    far = _claim("token_top1", estimate=0.10, form="effect", mode="coordinate", coverage=0.1, amplitude=1.0)
    assert judge_claim(far, rows, []).verdict == "disagrees"
    # seeds that read other frames cannot be crossed; a dose the ladder did not read is not run
    other = _rows(10, 0.06) + [{**r, "doc_id": r["doc_id"] + 50} for r in _rows(20, 0.06)]
    assert "different evaluation frames" in measure_dose(c, other, 100, 0.05)
    missing = _claim("token_top1", form="effect", mode="coordinate", coverage=0.5, amplitude=1.0)
    j = judge_claim(missing, rows, [])
    assert j.verdict == "not run" and "did not read the dose coordinate/coverage=0.5/amplitude=1" in j.reason


@pytest.mark.unit
def test_bad_dose_claims_are_not_measured_and_say_why():
    assert "reads the dose-ladder job" in measurable(_claim(attack="latent-probe"))
    assert "onset is read of" in measurable(_claim("token_cross_entropy"))
    assert "unknown axis" in measurable(_claim(axis="sideways"))
    assert "does not read" in measurable(_claim(budget=3))
    assert "at one dose" in measurable(_claim("token_top1", form="effect"))
    assert judge_claim(_claim(), [], []).verdict == "not run"
    fix = judge_claim(_claim(arm="fix"), _rows(1, 0.06), [])
    assert fix.verdict == "not run" and "arm fix" in fix.reason


@pytest.mark.unit
def test_the_shipped_dose_claims_are_read_by_the_dose_reader():
    claims = {c.id: c for c in load_claims("002")[0].claims}
    for cid in ("dose-gate-onset", "dose-token-top1-cov010", "dose-rare-onset"):
        assert claims[cid].statistic.kind == "dose" and measurable(claims[cid]) == "", cid
    assert claims["dose-gate-onset"].paper.also["effect_at_onset"] == pytest.approx(0.0098)
