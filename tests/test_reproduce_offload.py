"""000 §5's partial-offloading claims read from a store's runs (``reproduce.offload``): the protocol's variance
tests and held-out-seed check, and the pattern of the placement means, each judged against the paper's."""

from __future__ import annotations

import numpy as np
import pytest

from splitleak.audit.analysis import analyse_partial_offloading
from splitleak.audit.protocol import SHIPPED, load_protocol
from splitleak.reproduce.claims import Claim, load_claims
from splitleak.reproduce.judge import measurable
from splitleak.reproduce.run import judge_claim

PROTOCOL, DIGEST = load_protocol(SHIPPED / "partial_offloading.yaml")


def _store(seeds, effect: float, noise: float, rng_seed: int, vmi: float = 0.0):
    """Attack and train rows of a partial-offloading grid: ΔU and I of each placement, the start's effect
    ``effect`` (ΔU grows with the start, I falls), Gaussian noise per run."""
    rng = np.random.default_rng(rng_seed)
    attack, train = [], []
    for seed in seeds:
        for defence in ("quant8", "quant4-noisy"):
            for s in (2, 4, 6):
                for b in range(4):
                    key = f"t{seed}{defence}{s}{b}"
                    du = 0.1 * s + effect * (b == 3) * s + rng.normal(0, noise)
                    li = 0.5 - 0.05 * s - effect * 0.1 * b + rng.normal(0, noise / 10)
                    train.append(
                        {
                            "key": key,
                            "model": "smollm2-135m",
                            "defence_name": defence,
                            "victim_seed": seed,
                            "offload_start": b,
                            "offload_length": s,
                            "delta_u": du,
                            "perplexity": 20.0,
                        }
                    )
                    attack.append({"key": "a" + key, "train_key": key, "attack": "property", "leakage_index": li,
                                   "vmi_token_recovery": 0.3 + vmi + rng.normal(0, 0.005),
                                   "majority_token_recovery": 0.3, "protocol_hash": DIGEST})  # fmt: skip
    return attack, train


def _claim(form: str, treatment: dict, verdict: str | None = None, also: dict | None = None, **agreement):
    return Claim(
        id="po", wording="w", where="§5.1", spec="partial_offloading",
        paper={"estimate": None, "unit": "partial R^2", "verdict": verdict, "also": also or {}},
        statistic={"kind": "offload", "metric": "partial_r2", "form": form, "treatment": treatment},
        agreement={"rule": "pass-mark", "pass_mark": 0.1} if not agreement else agreement,
    )  # fmt: skip


@pytest.mark.unit
def test_a_variance_claim_reads_the_protocols_test_and_turns_with_the_papers_verdict():
    attack, train = _store([11, 22, 88], effect=0.3, noise=0.02, rng_seed=1)
    t = {"outcome": "delta_u", "defence": "quant8"}
    j = judge_claim(_claim("variance", t, "pass"), attack, train)
    assert j.verdict == "agrees", j.reason
    # the number is the protocol's own test of the same runs (what `experiment report` prints)
    from splitleak.report.grid import offload_run_rows

    runs = offload_run_rows(attack, train, DIGEST)
    want = next(
        r for r in analyse_partial_offloading(PROTOCOL, runs) if r["outcome"] == "delta_u" and r["defence"] == "quant8"
    )
    assert (j.ours.estimate, j.ours.low, j.ours.high) == (want["partial_r2"], want["low"], want["high"])
    assert want["passes"] and j.ours.setting["victim_seeds"] == 3
    assert judge_claim(_claim("variance", t, "fail"), attack, train).verdict == "disagrees"


@pytest.mark.unit
@pytest.mark.parametrize("rng_seed", [2, 3])
def test_no_effect_of_the_start_disagrees_with_a_pass_and_agrees_with_a_fail(rng_seed):
    attack, train = _store([11, 22, 33, 44, 88], effect=0.0, noise=0.5, rng_seed=rng_seed)
    t = {"outcome": "delta_u", "defence": "quant4-noisy"}
    j = judge_claim(_claim("variance", t, "fail"), attack, train)
    assert j.verdict == "agrees", j.reason
    passing = judge_claim(_claim("variance", t, "pass"), attack, train)
    # without the start's effect the test fails; a partial R² at the mark with p above its bound is too few seeds
    # to decide, one below the mark a disagreement
    assert passing.verdict == ("underpowered" if passing.ours.estimate >= 0.1 else "disagrees"), passing.reason
    assert "p " in passing.reason and passing.verdict != "agrees"
    # the same runs with the start's effect shrunk to nothing in every cell: the partial R² falls below the mark
    flat = [dict(r, delta_u=0.1 * r["offload_length"] + 1e-4 * r["victim_seed"]) for r in train]
    j = judge_claim(_claim("variance", t, "pass"), attack, flat)
    assert j.verdict == "disagrees" and j.ours.estimate < 0.1, j.reason


@pytest.mark.unit
def test_a_claim_of_four_tests_agrees_only_where_every_test_does():
    attack, train = _store([11, 22, 88], effect=0.3, noise=0.02, rng_seed=4)
    four = {"outcome": ["delta_u", "leakage_index"], "defence": ["quant8", "quant4-noisy"]}
    j = judge_claim(_claim("variance", four, "pass x4"), attack, train)
    assert j.verdict == "agrees" and j.reason.count("passes") == 5, j.reason  # four tests and the paper's
    # the second defence's start no longer matters: that test fails (its partial R² 0), so the claim disagrees
    flat = [dict(r, delta_u=0.1 * r["offload_length"] + 1e-3 * r["victim_seed"]) if r["defence_name"] ==
            "quant4-noisy" else r for r in train]  # fmt: skip
    j = judge_claim(_claim("variance", four, "pass x4"), attack, flat)
    assert j.verdict == "disagrees" and j.ours.estimate == pytest.approx(0.0, abs=1e-9), j.reason


@pytest.mark.unit
def test_a_heldout_claim_compares_each_outcomes_reduction_with_the_papers():
    attack, train = _store([11, 22, 88], effect=0.3, noise=0.02, rng_seed=5)
    t = {"outcome": ["delta_u", "leakage_index"], "defence": "quant8"}
    both = {"delta_u": {"length_only": 1.5698, "with_start": 0.7594},
            "leakage_index": {"length_only": 0.3042, "with_start": 0.1337}}  # fmt: skip
    j = judge_claim(_claim("heldout", t, "both reach 10% reduction", both), attack, train)
    assert j.verdict == "agrees", j.reason
    assert j.ours.setting["held_out"] == [77, 88] and j.ours.estimate > 0.1
    neither = {k: {"length_only": 0.2154, "with_start": 0.2018} for k in both}  # a 6 % fall: short of 10 %
    assert judge_claim(_claim("heldout", t, "neither", neither), attack, train).verdict == "disagrees"
    # no run of a held-out seed: the check is not run, and says why
    no_held = [r for r in train if r["victim_seed"] != 88]
    j = judge_claim(_claim("heldout", t, "both", both), attack, no_held)
    assert j.verdict == "not run" and "held-out" in j.reason


@pytest.mark.unit
def test_a_placement_claim_reads_the_pattern_of_the_means():
    attack, train = _store([11, 22, 88], effect=0.3, noise=0.01, rng_seed=6)
    pattern = {"defence": ["quant8", "quant4-noisy"]}
    rule = {"rule": "qualitative", "direction": "above", "threshold": 2.0, "tolerance": 0.05, "ours": True}
    j = judge_claim(_claim("placement", pattern, **rule), attack, train)
    assert j.verdict == "agrees", j.reason
    assert j.ours.estimate == pytest.approx(4.0, abs=0.3)  # (0.1 + 0.3) s / (0.1 s): the smallest fold
    # a fold the means do not reach, or a VMI excess far from its control, turns it
    assert judge_claim(_claim("placement", pattern, **{**rule, "threshold": 6.0}), attack, train).verdict == "disagrees"
    leaky, _ = _store([11, 22, 88], effect=0.3, noise=0.01, rng_seed=6, vmi=0.2)
    assert judge_claim(_claim("placement", pattern, **rule), leaky, train).verdict == "disagrees"
    # seeds whose VMI excess reads exactly alike give Student's t no width: near zero, but no certainty either
    alike = [dict(r, vmi_token_recovery=0.31) for r in attack]
    j = judge_claim(_claim("placement", pattern, **rule), alike, train)
    assert j.verdict == "underpowered" and "0 of 12 placements' VMI excess within" in j.reason, j.reason


@pytest.mark.unit
def test_bad_offload_claims_say_why_and_a_store_without_runs_reads_not_run():
    assert "outcome" in measurable(_claim("variance", {"defence": "quant8", "outcome": "perplexity"}, "pass"))
    assert "names its tests" in measurable(_claim("variance", {"defence": "quant8", "k": 32}, "pass"))
    assert "forms" in measurable(_claim("ladder", {"defence": "quant8"}, "pass"))
    j = judge_claim(_claim("variance", {"outcome": "delta_u", "defence": "quant8"}, "pass"), [], [])
    assert j.verdict == "not run" and "no partial-offloading run" in j.reason
    attack, train = _store([11, 22], effect=0.3, noise=0.02, rng_seed=7)
    j = judge_claim(_claim("variance", {"outcome": "delta_u", "defence": "quant2"}, "pass"), attack, train)
    assert j.verdict == "not run" and "pre-registers no test of delta_u under quant2" in j.reason


@pytest.mark.unit
def test_the_shipped_offload_claims_are_read_and_their_jobs_planned():
    from splitleak.reproduce.plan import plan_reproduction

    f, _ = load_claims("000")
    po = [c for c in f.claims if c.spec == "partial_offloading"]
    assert len(po) == 10 and all(c.statistic.kind == "offload" and not measurable(c) for c in po)
    plan = plan_reproduction([f], "quick")
    jobs = {c.claim_id: c.jobs for c in plan.claims if c.spec == "partial_offloading"}
    assert set(jobs) == {c.id for c in po} and min(jobs.values()) == 36  # one defence's placements x three seeds
    assert "partial_offloading" in plan.needed()
