"""002's gate claims read from the grid report's latent summary (``reproduce.latent._gate``, judged by
``reproduce.judge._gate_rule``): the gate statistic G per seed as the protocol reads the battery, each seed's
decision against the paper's side of its pass mark."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from splitleak.audit.gate import GateThresholds
from splitleak.report.grid_latent import ProbeRun
from splitleak.reproduce.claims import Claim
from splitleak.reproduce.run import judge_claim

#: the open arm's gradient view under the oracle threat model, as 002's claims select it
GRADIENT_OPEN = {"attack": "latent-probe", "view": "gradient", "arm": "open", "threat": "oracle"}
TH = GateThresholds(0.01, 0.05, 9, 0.35, "gate_002", "c191739b8a35" * 5)


def _run(seed: int, arm: str, by_view: dict, arms: list, constant: float = 0.05, threat: str = "oracle"):
    protocol = {"by_view": by_view}
    return ProbeRun("smollm2-135m", arm, "defaults", seed, {}, None, None, constant, arms, protocol, threat)


def _claim(treatment: dict, estimate: float | None = None, low: float | None = None, high: float | None = None):
    return Claim(
        id="g", wording="w", where="§5.3", spec="decoys",
        paper={"estimate": estimate, "low": low, "high": high, "unit": "pp gate statistic G"},
        statistic={"kind": "gate", "metric": "G", "treatment": treatment},
        agreement={"rule": "pass-mark", "pass_mark": 0.01},
    )  # fmt: skip


def _deep(name: str, right: int, known: int, degenerate: bool = False) -> dict:
    return {"arm": name, "right": right, "known": known, "accuracy": right / known, "degenerate": degenerate}


@pytest.fixture
def summary():
    grad = {"gradient": {"gate_statistic": 0.0131, "decision": "breaks"}}
    return SimpleNamespace(
        thresholds=TH,
        probes=[
            _run(1, "open", grad | {"joint": {"gate_statistic": 0.004, "decision": "undecided"}},
                 [_deep("forward/deep/0", 120, 1000)]),
            _run(2, "open", {"gradient": {"gate_statistic": 0.0112, "decision": "breaks"},
                             "joint": {"gate_statistic": 0.003, "decision": "holds"}},
                 [_deep("forward/deep/0", 30, 1000), _deep("forward/deep/1", 900, 1000, degenerate=True)]),
            _run(1, "open", {"gradient": {"gate_statistic": 0.002, "decision": "holds"}}, [], threat="shadow"),
            _run(1, "fix", {"gradient": {"gate_statistic": 0.003, "decision": "holds"}}, []),
        ],
    )  # fmt: skip


@pytest.mark.unit
def test_a_gate_claim_reads_g_per_seed_and_agrees_only_on_the_papers_side(summary):
    grad = GRADIENT_OPEN
    j = judge_claim(_claim(grad, 0.01147), [], [], latent=summary)
    assert j.verdict == "agrees", j.reason
    assert j.ours is not None and list(j.ours.units) == [0.0131, 0.0112] and j.ours.estimate == 0.0131
    assert np.isnan(j.ours.low) and j.detectable is None  # G is a bound itself: no interval, no power
    assert "seed 1 G +1.31 pp breaks" in j.reason and "seed 2 G +1.12 pp breaks" in j.reason
    # the paper's number edited to the holding side turns the verdict
    assert judge_claim(_claim(grad, 0.005), [], [], latent=summary).verdict == "disagrees"
    # a range over cells: every cell must be on one side
    assert judge_claim(_claim(grad, None, 0.0144, 0.0218), [], [], latent=summary).verdict == "agrees"
    assert judge_claim(_claim(grad, None, 0.005, 0.0218), [], [], latent=summary).verdict == "no number"
    # the threat model selects: the shadow battery of the same arm holds the gate
    shadow = judge_claim(_claim({**grad, "threat": "shadow"}, 0.01147), [], [], latent=summary)
    assert shadow.verdict == "disagrees" and list(shadow.ours.units) == [0.002]


@pytest.mark.unit
def test_a_battery_that_cannot_decide_the_gate_is_underpowered_not_agreeing(summary):
    joint = {"attack": "latent-probe", "view": "joint", "arm": "open", "threat": "oracle"}
    # the paper holds the gate; seed 1 ran fewer family arms than declared and holds: undecided
    j = judge_claim(_claim(joint, 0.0048), [], [], latent=summary)
    assert j.verdict == "underpowered" and "fewer family arms" in j.reason
    # where the paper breaks it, a holding seed disagrees even beside an undecided one
    assert judge_claim(_claim(joint, 0.02), [], [], latent=summary).verdict == "disagrees"


@pytest.mark.unit
def test_a_probe_outside_the_family_is_gated_alone_by_its_wilson_bound(summary):
    from statsmodels.stats.proportion import proportion_confint

    deep = {"attack": "latent-probe", "view": "forward", "arm": "open", "threat": "oracle", "probe": "deep"}
    j = judge_claim(_claim(deep, 0.2419), [], [], latent=summary)
    # one-sided upper bound at alpha = the two-sided Wilson interval's upper end at 2 alpha, less the constant
    want1 = proportion_confint(120, 1000, alpha=2 * 0.05, method="wilson")[1] - 0.05
    want2 = proportion_confint(30, 1000, alpha=2 * 0.05, method="wilson")[1] - 0.05  # the degenerate arm left out
    assert j.ours is not None and list(j.ours.units) == pytest.approx([want1, want2], abs=1e-12)
    assert j.ours.setting["decisions"] == {1: "breaks", 2: "holds"}
    assert j.verdict == "disagrees"  # seed 2 holds where the paper breaks
    assert judge_claim(_claim({**deep, "probe": "graph"}), [], [], latent=summary).verdict == "not run"


@pytest.mark.unit
def test_the_threshold_claim_reads_the_protocols_gate_and_bad_gate_claims_say_why(summary):
    threshold = judge_claim(_claim({"attack": "latent-probe"}, 0.01), [], [], latent=summary)
    assert threshold.verdict == "agrees" and "gate_002" in threshold.reason
    assert judge_claim(_claim({"attack": "latent-probe"}, 0.02), [], [], latent=summary).verdict == "disagrees"
    no_view = judge_claim(_claim({"attack": "latent-probe", "arm": "open"}, 0.01), [], [], latent=summary)
    assert no_view.verdict == "not run" and "both its arm and its view" in no_view.reason
    part = judge_claim(
        _claim({"attack": "support-partition", "arm": "open", "view": "x"}, 0.01), [], [], latent=summary
    )
    assert part.verdict == "not run" and "latent-probe" in part.reason
    missing = judge_claim(
        _claim({"attack": "latent-probe", "view": "gradient", "arm": "naked-mitigation"}, 0.01), [], [], latent=summary
    )
    assert missing.verdict == "not run" and "naked-mitigation" in missing.reason
    summary.thresholds = None
    assert "no protocol" in judge_claim(_claim({"attack": "latent-probe"}, 0.01), [], [], latent=summary).reason


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_utility_gate_claims_read_each_runs_ce_over_the_pretrained_model(seed):
    """002's Δ loss: a latent run's held-out CE less the frozen pretrained model's, per victim seed (a train row's
    two columns), judged on the side of the 0.35-nat gate."""
    from scipy import stats

    rng = np.random.default_rng(seed)
    pre = rng.uniform(3.0, 4.0, size=3)
    rise = rng.uniform(0.02, 0.08, size=3)
    train = [
        {"key": f"t{s}", "defence": "open-mitigation", "victim_seed": s, "heldout_ce": p + d, "pretrained_ce": p}
        for s, p, d in zip((1, 2, 3), pre, rise)
    ] + [{"key": "t9", "defence": "open", "victim_seed": 1, "heldout_ce": 3.0, "pretrained_ce": None}]

    def claim(defence, direction):
        return Claim(
            id="u", wording="w", where="§5.3", spec="decoys", paper={"estimate": None, "low": 0.054, "high": 0.071,
            "unit": "nats"}, statistic={"kind": "level", "metric": "ce_increase_over_pretrained",
            "treatment": {"attack": None, "defence": defence}},
            agreement={"rule": "qualitative", "direction": direction, "threshold": 0.35, "ours": True},
        )  # fmt: skip

    j = judge_claim(claim("open-mitigation", "below"), [], train)
    half = stats.t.isf(0.025, 2) * np.std(rise, ddof=1) / np.sqrt(3)
    assert j.ours is not None and list(j.ours.units) == pytest.approx(list(rise), abs=1e-12)
    assert (j.ours.low, j.ours.high) == pytest.approx((rise.mean() - half, rise.mean() + half))
    assert j.verdict == "agrees"  # well under the gate, as the paper's cells
    assert judge_claim(claim("open-mitigation", "above"), [], train).verdict == "disagrees"
    missing = judge_claim(claim("open", "above"), [], train)  # a run without its pretrained CE has no reading
    assert missing.verdict == "not run" and "records its ce_increase_over_pretrained" in missing.reason


@pytest.mark.unit
def test_seeds_that_read_exactly_alike_keep_their_frames_intervals(summary):
    """Two batteries whose twins read the same paired effect (a count over the same frame count can) would give
    Student's t an interval of no width; the reading keeps the seeds' own frame-bootstrap intervals instead."""
    from scipy import stats

    twin = {**GRADIENT_OPEN, "control": "shuffled-label"}
    for r, (low, high) in zip(summary.probes[:2], [(-0.033, -0.006), (-0.032, -0.007)]):
        r.arms = [{"arm": "gradient/mlp/0", "paired_effect": 0.01, "paired_low": 0.0, "paired_high": 0.02}]
        r.twin_arms = [{"arm": "gradient/mlp/0", "paired_effect": -0.0195, "paired_low": low, "paired_high": high}]
    c = Claim(
        id="t", wording="w", where="§5.3", spec="decoys", paper={"estimate": 0.0, "unit": "pp"},
        statistic={"kind": "level", "metric": "m", "treatment": twin},
        agreement={"rule": "tolerance", "tolerance": 0.0008},
    )  # fmt: skip
    j = judge_claim(c, [], [], latent=summary)
    assert j.ours is not None and j.ours.estimate == pytest.approx(-0.0195)
    assert (j.ours.low, j.ours.high) == pytest.approx((-0.0325, -0.0065))
    assert j.verdict == "disagrees"  # below the paper's floor even on the wider interval
    summary.probes[1].twin_arms[0]["paired_effect"] = -0.0185  # alike no more: Student's t over the two seeds
    t = judge_claim(c, [], [], latent=summary)
    half = stats.t.isf(0.025, 1) * np.std([-0.0195, -0.0185], ddof=1) / np.sqrt(2)
    assert t.ours is not None and (t.ours.low, t.ours.high) == pytest.approx((-0.019 - half, -0.019 + half))


@pytest.mark.unit
def test_two_views_of_one_arm_are_read_as_their_difference_per_seed(summary):
    """002 Table 8: the gradient arm over the forward arm of the oracle-partitioned real rows, each the best arm of
    its view over the constant, per seed; Student's t over the seeds, none from one seed."""
    from scipy import stats

    effects = {1: (0.0119, 0.0055), 2: (0.0090, 0.0071)}
    for r in summary.probes[:2]:
        g, f = effects[r.seed]
        r.arms = [
            {"arm": "gradient/mlp/0", "paired_effect": g, "paired_low": g - 0.004, "paired_high": g + 0.004},
            {"arm": "gradient/deep/0", "paired_effect": g - 0.003, "paired_low": 0, "paired_high": 1},
            {"arm": "real-rows/mlp/0", "paired_effect": f, "paired_low": f - 0.004, "paired_high": f + 0.004},
        ]
    forward = {**GRADIENT_OPEN, "view": "real-rows"}
    c = Claim(
        id="d", wording="w", where="§5.1", spec="decoys", paper={"estimate": 0.0064, "unit": "pp"},
        statistic={"kind": "difference", "metric": "m", "treatment": GRADIENT_OPEN, "control": forward},
        agreement={"rule": "same-sign-overlap"},
    )  # fmt: skip
    j = judge_claim(c, [], [], latent=summary)
    diffs = [0.0119 - 0.0055, 0.0090 - 0.0071]
    half = stats.t.isf(0.025, 1) * np.std(diffs, ddof=1) / np.sqrt(2)
    assert j.ours is not None and list(j.ours.units) == pytest.approx(diffs)
    assert (j.ours.low, j.ours.high) == pytest.approx((np.mean(diffs) - half, np.mean(diffs) + half))
    assert j.verdict == "underpowered"  # two seeds: t with one degree of freedom straddles zero
    # a family member's control carries its treatment's fields beside the constant: that is the constant
    constant = {**forward, "predictor": "most-frequent-token constant baseline"}
    member = Claim(**{**c.model_dump(), "statistic": {**c.statistic.model_dump(), "control": constant}})
    assert judge_claim(member, [], [], latent=summary).ours.estimate == pytest.approx((0.0119 + 0.0090) / 2)
    summary.probes = summary.probes[:1]  # one seed: no interval
    one = judge_claim(c, [], [], latent=summary)
    assert one.ours is not None and one.ours.estimate == pytest.approx(diffs[0]) and np.isnan(one.ours.low)
    # two arms, or two threat models, are not two views of one battery
    other = Claim(**{**c.model_dump(), "statistic": {**c.statistic.model_dump(), "control": {**forward, "arm": "fix"}}})
    assert "two views of one arm" in judge_claim(other, [], [], latent=summary).reason


@pytest.mark.unit
@pytest.mark.parametrize("spread", [0.0, 0.01])
def test_a_views_heterogeneity_is_the_i2_of_its_best_pooled_arm(spread):
    """002 §5.3's I² of the gradient arm over seeds: the DerSimonian-Laird pool of the view's arm that pools highest,
    each seed's SE from its 95 % interval; seeds that agree read I² 0, seeds far apart beyond their SEs near 1."""
    from scipy.stats import norm

    from splitleak.stats import random_effects

    runs = []
    for i, seed in enumerate((1, 2, 3)):
        g = 0.01 + spread * (i - 1)
        arms = [{"arm": "gradient/mlp/0", "paired_effect": g, "paired_low": g - 0.002, "paired_high": g + 0.002},
                {"arm": "gradient/deep/0", "paired_effect": 0.001, "paired_low": -0.01, "paired_high": 0.012},
                {"arm": "forward/mlp/0", "paired_effect": 0.5, "paired_low": 0.4, "paired_high": 0.6}]  # fmt: skip
        runs.append(_run(seed, "open", {}, arms))
    summary = SimpleNamespace(thresholds=TH, probes=runs)
    c = Claim(
        id="h", wording="w", where="§5.3", spec="decoys", paper={"estimate": 0.77, "unit": "I²"},
        statistic={"kind": "level", "metric": "I2", "form": "heterogeneity", "treatment": GRADIENT_OPEN},
        agreement={"rule": "tolerance", "tolerance": 0.2, "ours": True},
    )  # fmt: skip
    j = judge_claim(c, [], [], latent=summary)
    ys = [0.01 + spread * (i - 1) for i in range(3)]
    want = random_effects(ys, [(0.004 / (2 * norm.ppf(0.975))) ** 2] * 3)
    assert (
        j.ours is not None
        and j.ours.estimate == pytest.approx(want.i2)
        and j.ours.setting["probe arm"] == "gradient/mlp/0"
    )
    assert (want.i2 == 0.0) if spread == 0 else (want.i2 > 0.95)
    assert j.verdict == "underpowered" and "no interval" in j.reason  # an I² of three seeds draws none
    summary.probes = runs[:1]
    assert "two seeds or more" in judge_claim(c, [], [], latent=summary).reason


class _Words:
    """A tokenizer stub: ids as words (label_scores decodes the labels for ROUGE)."""

    def decode(self, ids):
        return " ".join(str(i) for i in ids)


@pytest.mark.unit
def test_the_answer_and_query_labels_are_scored_per_document():
    """003 App. E: label_scores splits an instruction document's labels at its answer; a document without a query
    (its answer starts at token 1) has no query reading."""
    import torch

    from splitleak.audit.extras import label_scores
    from splitleak.data.documents import Document

    docs = [
        Document(7, (10, 11, 12, 13, 14, 15), "", (), "t", answer_start=3),
        Document(8, (20, 21, 22, 23, 24, 25), "", (), "t", answer_start=1),
    ]
    labels = torch.tensor([[11, 99, 13, 99, 15], [21, 22, 99, 99, 99]])
    out = label_scores(labels, docs, _Words())
    # doc 7: query labels (tokens 1, 2) right, wrong; answer labels (3, 4, 5) right, wrong, right
    assert out["query_label_recovery_per_doc"] == [[7, 0.5]]
    assert [d for d, _ in out["answer_label_recovery_per_doc"]] == [7, 8]
    assert [v for _, v in out["answer_label_recovery_per_doc"]] == pytest.approx([2 / 3, 0.4])
    assert out["answer_label_recovery"] == pytest.approx(4 / 8) and out["query_label_recovery"] == 0.5
    assert out["label_recovery"] == pytest.approx(5 / 10)


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_answer_over_query_is_read_over_the_documents_that_have_both(seed):
    import json

    from splitleak.stats.bootstrap import crossed_bootstrap_ci

    rng = np.random.default_rng(seed)
    answer, query = rng.uniform(0.5, 1.0, size=8), rng.uniform(0.0, 0.5, size=8)
    result = {
        "answer_label_recovery_per_doc": [[i, float(a)] for i, a in enumerate(answer)],
        "query_label_recovery_per_doc": [[i, float(q)] for i, q in enumerate(query) if i != 5],  # doc 5: no query
        "answer_label_recovery": float(answer.mean()),
    }
    rows = [
        {"key": "j", "attack": "gma-sl", "defence": "none-answer-only", "victim_seed": 1, "doc_id": i,
         "result_json": json.dumps(result)}
        for i in range(8)
    ]  # fmt: skip

    def claim(metric):
        return Claim(
            id="q", wording="w", where="App. E", spec="mirage", paper={"estimate": None, "unit": "share"},
            statistic={"kind": "level", "metric": metric, "treatment": {"attack": "gma-sl",
                       "defence": "none-answer-only"}},
            agreement={"rule": "qualitative", "direction": "above", "threshold": 0.0, "ours": True},
        )  # fmt: skip

    j = judge_claim(claim("answer_minus_query_label_recovery"), rows, [])
    keep = [i for i in range(8) if i != 5]
    want = crossed_bootstrap_ci((answer - query)[keep][None, :], n_boot=20_000, alpha=0.05, seed=0)
    assert j.ours is not None and j.ours.docs == 7 and list(j.ours.units) == pytest.approx((answer - query)[keep])
    assert (j.ours.estimate, j.ours.low, j.ours.high) == pytest.approx((want.estimate, want.low, want.high))
    assert j.verdict == "agrees"  # every answer is read better than its query here
    a = judge_claim(claim("answer_label_recovery"), rows, [])  # per document now: an interval from one seed
    assert a.ours is not None and a.ours.docs == 8 and a.ours.low < answer.mean() < a.ours.high
    old = [{**r, "result_json": json.dumps({"answer_label_recovery": float(answer.mean())})} for r in rows]
    assert judge_claim(claim("answer_label_recovery"), old, []).reason.endswith("no interval")  # an older store
    assert judge_claim(claim("answer_minus_query_label_recovery"), old, []).verdict == "not run"
