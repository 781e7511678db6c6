"""splitleak.privacy: the reconstruction bound against closed forms and a reader that can beat a wrong one, the
accountant against dp-accounting's PLD, the chain's guarantees, and the composition count against the tap."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
from scipy import integrate, stats

from splitleak.privacy.accounting import compose, gdp_epsilon, pld_epsilon, tradeoff
from splitleak.privacy.bound import count_crossings, document_bound, reconstruction_bound
from splitleak.privacy.guarantee import NoiseGuarantee, chain_guarantees


def simplex_success(mu: float, k: int) -> float:
    """The Bayes-optimal success at telling which of k equiprobable points at pairwise distance ``mu`` (in noise
    units) sent an observation with unit Gaussian noise: the points a e_i with a = mu / sqrt(2), read by the
    largest coordinate, ∫ φ(z − a) Φ(z)^(k−1) dz."""
    a = mu / math.sqrt(2.0)
    f = lambda z: stats.norm.pdf(z - a) * stats.norm.cdf(z) ** (k - 1)  # noqa: E731
    return float(integrate.quad(f, -np.inf, np.inf)[0])


@pytest.mark.unit
@pytest.mark.parametrize("k", [2, 5, 50])
@pytest.mark.parametrize("mu", [0.0, 0.1, 0.5, 1.0, 2.0, 4.0])
def test_the_bound_is_at_least_the_optimal_success_on_a_k_point_prior(k, mu):
    kappa = 1.0 / k
    optimal = simplex_success(mu, k)
    bound = reconstruction_bound(mu, kappa)
    assert optimal <= bound + 1e-9
    assert bound == pytest.approx(1 - stats.norm.cdf(stats.norm.ppf(1 - kappa) - mu), abs=1e-12)
    if mu == 0:
        assert bound == pytest.approx(kappa) and optimal == pytest.approx(kappa, abs=1e-6)
    if k == 2:  # two points: the optimal success is Φ(μ/2), the bound Φ(μ)
        assert optimal == pytest.approx(stats.norm.cdf(mu / 2), abs=1e-7)
        assert bound == pytest.approx(stats.norm.cdf(mu), abs=1e-9)


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_reader_of_a_weaker_mechanism_than_declared_breaks_the_bound(seed):
    """The check can fail: the maximum-likelihood reader of a mechanism whose noise is a third of what it
    declares reads above the declared bound (Wilson lower end), and of the true mechanism stays under it."""
    rng = np.random.default_rng(seed)
    k, mu_declared, n = 20, 1.0, 4000
    bound = reconstruction_bound(mu_declared, 1.0 / k)
    for noise_scale, above in ((1.0, False), (1.0 / 3.0, True)):
        a = mu_declared / math.sqrt(2.0)
        true = rng.integers(0, k, n)
        obs = rng.normal(0.0, noise_scale, (n, k))
        obs[np.arange(n), true] += a
        hits = int((obs.argmax(axis=1) == true).sum())
        low = stats.binomtest(hits, n).proportion_ci(0.95, method="wilson").low
        high = stats.binomtest(hits, n).proportion_ci(0.95, method="wilson").high
        assert (low > bound) == above and (high >= simplex_success(mu_declared / noise_scale, k) - 0.05)


@pytest.mark.unit
@pytest.mark.parametrize("mus", [[0.3] * 10, [1.0], [0.2, 0.5, 1.5], [0.05] * 200])
def test_the_accountant_agrees_with_the_closed_form_of_gaussian_dp(mus):
    mu = compose(mus)
    assert mu == pytest.approx(math.sqrt(sum(m * m for m in mus)))
    exact = gdp_epsilon(mu, 1e-5)
    pld = pld_epsilon([1.0 / m for m in mus], 1e-5)
    assert pld >= exact - 1e-3 and pld == pytest.approx(exact, rel=0.02)  # pessimistic, and close
    assert pld_epsilon([], 1e-5) == 0.0 and math.isinf(pld_epsilon([0.0], 1e-5))


@pytest.mark.unit
def test_a_guarantee_counts_two_clip_norms_per_changed_row():
    g = NoiseGuarantee("clip-noise", "activations", clip=2.0, sigma=0.5)
    assert g.sensitivity(9) == pytest.approx(2 * 2.0 * 3) and g.mu(9) == pytest.approx(24.0)
    assert g.mu(0) == 0.0 and math.isinf(NoiseGuarantee("x", "activations", 1.0, 0.0).mu(1))
    seq = NoiseGuarantee("seq-dp", "output-gradient", clip=1.0, sigma=1.0, level="document")
    assert seq.mu(1) == seq.mu(32) == pytest.approx(2.0)


@pytest.mark.unit
def test_a_chain_credits_noise_only_on_rows_it_derives():
    from splitleak.defences import build_defence

    both = chain_guarantees([build_defence("clip-noise", {"clip": 1.0, "sigma": 0.5})])
    assert {c: [(g.clip, g.sigma) for g in gs] for c, gs in both.by_channel.items()} == {
        "activations": [(1.0, 0.5)],
        "gradient": [(1.0, 0.5)],
    }
    dp = chain_guarantees([build_defence("dp-forward", {"noise_multiplier": 2.0, "clip": 3.0})])
    assert [(g.channel, g.sigma) for g in dp.of("activations")] == [("activations", 6.0)] and not dp.of("gradient")
    after = chain_guarantees([build_defence("mixup", {}), build_defence("clip-noise", {"where": "forward"})])
    assert not after.of("activations") and "after mixup transformed them" in after.notes[0]
    noisy = chain_guarantees([build_defence("quant4-noisy", {})])
    assert not noisy.by_channel and "no formal bound" in noisy.notes[0]
    seq = chain_guarantees([build_defence("seq-dp", {"clip": 1.0, "noise_multiplier": 2.0})])
    assert [(g.level, g.sigma) for g in seq.of("output-gradient")] == [("document", 2.0)]


@pytest.mark.unit
def test_a_document_bound_composes_its_crossings_and_names_a_bare_channel():
    from splitleak.defences import build_defence

    fwd = chain_guarantees([build_defence("clip-noise", {"clip": 1.0, "sigma": 8.0, "where": "forward"})])
    T, kappas = 8, [0.1] * 8
    once = document_bound(0, {"activations": 1}, fwd, T, kappas, 0.01)
    thrice = document_bound(0, {"activations": 3}, fwd, T, kappas, 0.01)
    # a token early in the document changes more rows than a late one: its bound is the higher
    assert once.token_bounds == sorted(once.token_bounds, reverse=True)
    assert once.token_bounds[-1] == pytest.approx(reconstruction_bound(2 / 8, 0.1))
    assert once.mu_doc == pytest.approx(2 * math.sqrt(T) / 8) and thrice.mu_doc == pytest.approx(
        once.mu_doc * math.sqrt(3)
    )
    assert thrice.token_bound > once.token_bound and thrice.doc_bound > once.doc_bound  # more passes, more leaks
    assert once.epsilon_doc == pytest.approx(gdp_epsilon(once.mu_doc), rel=0.02)
    bare = document_bound(0, {"activations": 1, "gradient": 1}, fwd, T, kappas, 0.01)
    assert bare.why_none == "the gradient crosses without a noise guarantee" and bare.token_bound is None
    three = document_bound(0, {"activations": 1, "gradient": 1, "labels": 1, "probe": 1}, fwd, T, kappas, 0.01)
    assert three.why_none == "the gradient, labels and probe cross without a noise guarantee"
    labels = document_bound(0, {"activations": 1, "labels": 1}, fwd, T, kappas, 0.01, exclude=["labels"])
    assert labels.why_none == "" and labels.doc_bound == pytest.approx(once.doc_bound)
    with pytest.raises(ValueError, match="7 prior successes for a document of 8 tokens"):
        document_bound(0, {"activations": 1}, fwd, T, kappas[:7], 0.01)


@pytest.mark.unit
def test_the_composition_counts_every_crossing_the_tap_recorded(shared_run):
    from splitleak.runs.wire import read_wire, wire_phases

    run = shared_run(model="tiny-gpt2", depth=3, n_calib=2, n_train=8, n_eval=8, all_local_baseline=False,
                     draws="derived", seed=0, data_seed=0, steps=16, defences=[{"name": "clip-noise"}])  # fmt: skip
    counted = count_crossings(run)
    frames: dict[int, int] = {}
    for phase in wire_phases(run):
        for rec in read_wire(run, phase):
            for d in rec.frame.doc_ids:
                frames[int(d)] = frames.get(int(d), 0) + 1
    assert set(counted) == set(frames)
    for doc, per in counted.items():  # every frame of the document counted once, in its own channel
        assert sum(per.values()) - per.get("labels", 0) == frames[doc]
    # 16 steps of one document over 8 training documents: each crosses twice each way; the 8 evaluation
    # documents once, in the capture pass
    passes = sorted(per["activations"] for per in counted.values())
    assert passes == [1] * 8 + [2] * 8 and all(per["gradient"] == per["activations"] for per in counted.values())
    assert tradeoff(0.0, 0.3) == pytest.approx(0.7)


@pytest.mark.unit
def test_large_compositions_stay_exact_and_epsilon_says_its_accountant():
    from splitleak.privacy.accounting import PLD_MU_MAX, epsilon

    assert reconstruction_bound(164.0, 1e-75) == 1.0 and reconstruction_bound(0.0, 1e-75) == 1e-75
    assert 1e-75 < reconstruction_bound(8.0, 1e-75) < reconstruction_bound(12.0, 1e-75) < 1.0  # no float cliff
    eps, how = epsilon(1.0)
    assert how == "dp-accounting PLD" and eps == pytest.approx(gdp_epsilon(1.0), rel=0.01)
    big, how = epsilon(PLD_MU_MAX * 10)
    assert how.startswith("closed form") and big == pytest.approx(gdp_epsilon(PLD_MU_MAX * 10)) and big > 1000
    assert math.isfinite(gdp_epsilon(200.0))


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_a_defence_that_declares_more_noise_than_it_adds_is_an_instrument_fault(shared_run, monkeypatch, seed):
    """Check (1) can fail: the activation attack's reading of a run whose clip-noise adds a hundredth of the noise
    it declares lies above the declared bound, and the verdict says INSTRUMENT FAULT; declared honestly, the
    bound (1.0: so little noise guarantees nothing) holds the reading."""
    from splitleak.attacks.config import make_attack_config
    from splitleak.audit.bounds import audit_bound
    from splitleak.audit.evaluate import run_attack
    from splitleak.defences.noise import ClipNoise
    from splitleak.models.presets import load_model
    from splitleak.report.audit_prose import bound_sentence, mechanism_fault
    from splitleak.runs.truth import eval_token_ids

    defences = [{"name": "clip-noise", "args": {"sigma": 0.001}}]  # both directions: no channel crosses bare
    run = shared_run(model="tiny-gpt2", depth=2, n_calib=16, n_train=4, n_eval=24, seed=seed, all_local_baseline=False,
                     draws="os", defences=defences)  # fmt: skip
    res = run_attack(run, make_attack_config(attack="activation", params={"k": 8}))
    per_doc = np.array([d["token_correct"] / d["token_counted"] for d in res["per_doc"]])
    est = float(per_doc.mean())
    half = 1.96 * per_doc.std(ddof=1) / math.sqrt(len(per_doc))
    reading = [
        {"attack": "activation", "intervals": {"tokens": {"estimate": est, "low": est - half, "high": est + half}}}
    ]
    doc_ids = [d["doc_id"] for d in res["per_doc"]]
    truth = eval_token_ids(run, doc_ids)
    model = load_model("tiny-gpt2", seed=0).model
    honest = audit_bound(run, defences, "plain", "os", doc_ids, truth, model)
    assert honest["bounded"] and honest["token_bound"] >= est
    assert bound_sentence(reading, honest).startswith("Upper side:")
    declared = ClipNoise.noise_guarantees
    monkeypatch.setattr(ClipNoise, "noise_guarantees",
                        lambda self: [replace(g, sigma=g.sigma * 1e4) for g in declared(self)])  # fmt: skip
    planted = audit_bound(run, defences, "plain", "os", doc_ids, truth, model)
    assert planted["token_bound"] < est - half, (planted["token_bound"], est)
    assert bound_sentence(reading, planted).startswith("INSTRUMENT FAULT: activation reads")
    # check (2) fails on the same planted defence, and holds on the honest one: the mechanism's own game
    assert [m["fault"] for m in honest["mechanism_audit"]] == [False, False]
    assert [m["fault"] for m in planted["mechanism_audit"]] == [True, True]
    assert bound_sentence([], planted).startswith("INSTRUMENT FAULT: clip-noise's activations release tells")
    keyed = audit_bound(run, defences, "plain", "derived", doc_ids, truth, model)
    assert mechanism_fault(keyed).startswith("INSTRUMENT FAULT")  # the game holds without a bound, too
    monkeypatch.undo()  # declared honestly again
    keyed = audit_bound(run, defences, "plain", "derived", doc_ids, truth, model)
    assert not keyed["bounded"] and "keyed by the run seed" in keyed["why"]
    assert "no formal bound" in bound_sentence(reading, keyed)


@pytest.mark.e2e
def test_the_audit_names_its_upper_side(tiny_audit):
    import json

    from splitleak.report.audit import bound_blocks

    report = json.loads((tiny_audit("none") / "report.json").read_text())
    b = report["bound"]
    assert not b["bounded"] and b["why"] == "no defence of the chain adds noise with a formal guarantee"
    assert "Upper side: no formal bound (no defence of the chain adds noise" in report["verdict"]
    assert "What no reader can read" in (tiny_audit("none") / "report.md").read_text()
    blocks = bound_blocks({**b, "bounded": True, "token_bound": 0.25, "doc_bound": 0.01, "token_kappa": 0.05,
                           "doc_kappa": 1e-30, "epsilon_doc_max": 3.2, "delta": 1e-5, "accountant": ["dp-accounting PLD"],
                           "crossings_max": 6, "documents_bounded": 12, "documents": 12})  # fmt: skip
    rows = dict(blocks[1].rows)
    assert rows["tokens any reader recovers, at most (mean over documents)"] == "25.00 %"
    assert rows["ε per document, at δ"] == "3.2 at 1e-05 (dp-accounting PLD)"


@pytest.mark.unit
def test_the_epsilon_lower_bound_reads_the_error_counts_as_dp_auditing_does():
    """Clopper-Pearson upper ends of both error rates: no error in 2,000 trials per world bounds ε below by
    log((1 - δ - p)/p), p the upper end of 0 of 2,000; errors at chance bound it by nothing."""
    from scipy.stats import binomtest

    from splitleak.audit.dp_audit import epsilon_lower_bound

    p = binomtest(0, 2000).proportion_ci(0.95, method="exact").high
    assert epsilon_lower_bound(0, 0, 2000) == pytest.approx(math.log((1 - 1e-5 - p) / p))
    assert 6.0 < epsilon_lower_bound(0, 0, 2000) < 6.5
    assert epsilon_lower_bound(1000, 1000, 2000) == 0.0
    assert epsilon_lower_bound(100, 700, 2000) > epsilon_lower_bound(300, 700, 2000) > 0


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name, args", [("clip-noise", {}), ("dp-forward", {"noise_multiplier": 0.5}), ("seq-dp", {})])
def test_the_mechanism_game_holds_an_honest_defence_and_catches_one_that_adds_less_noise(name, args, seed):
    """Check (2): each declared channel's release, played on two canaries at μ = 1 under the declared noise. An
    honest defence's releases are told apart at the optimal test's rate (Φ(-1/2) ≈ 0.31 each way), far under the
    claim; the same defence adding a tenth, or a ten-thousandth, of the noise it declares is caught."""
    from dataclasses import replace

    from splitleak.audit.dp_audit import audit_chain
    from splitleak.defences import DEFENCES, build_defence

    honest = audit_chain([build_defence(name, args)], seed=seed)
    assert honest and not any(a.fault for a in honest)
    for a in honest:
        assert a.mu_claimed == pytest.approx(1.0) and 4.0 < a.epsilon_claimed < 4.8
        assert 0.27 < a.fpr < 0.35 and 0.27 < a.fnr < 0.35 and a.epsilon_lower < 1.2
    cls = DEFENCES[name]
    for factor in (10.0, 1e4):
        planted = build_defence(name, args)
        planted.noise_guarantees = lambda d=planted, f=factor: [
            replace(g, sigma=g.sigma * f) for g in cls.noise_guarantees(d)
        ]
        caught = audit_chain([planted], seed=seed)
        assert caught and all(a.fault for a in caught), [(a.epsilon_lower, a.epsilon_claimed) for a in caught]


@pytest.mark.integration
def test_compare_gives_a_run_its_epsilon_over_every_recorded_crossing(shared_run):
    """A run compared on its own (no audit, so no κ): the largest ε per document over its recorded crossings, the
    same the bound's accountant gives for the most-crossed document; keyed noise and a bare channel get none."""
    from splitleak.defences import build_defence
    from splitleak.privacy.accounting import compose, epsilon
    from splitleak.privacy.bound import count_crossings
    from splitleak.privacy.guarantee import chain_guarantees
    from splitleak.report.compare import load_summary

    spec = [{"name": "clip-noise", "args": {"sigma": 2.0}}]
    small = dict(model="tiny-gpt2", depth=2, n_calib=2, n_train=3, n_eval=4, steps=6, seed=0, all_local_baseline=False)
    run = shared_run(**small, draws="os", defences=spec)
    said = load_summary(run).upper
    g = chain_guarantees([build_defence("clip-noise", {"sigma": 2.0})])
    doc_len = json.loads((run / "manifest.json").read_text())["config"]["doc_len"]
    worst = max(
        epsilon(compose([m for c, k in per.items() if c != "labels" for gg in g.of(c) for m in [gg.mu(doc_len)] * k]))[
            0
        ]
        for per in count_crossings(run).values()
    )
    assert said is not None and said.startswith(f"ε ≤ {worst:.3g} per document at δ = 1e-05")
    assert "keyed by the run seed" in load_summary(shared_run(**small, draws="derived", defences=spec)).upper
    bare = shared_run(**small, draws="os", defences=[{"name": "clip-noise", "args": {"where": "forward"}}])
    assert load_summary(bare).upper == "no formal bound: the gradient crosses without a noise guarantee"
