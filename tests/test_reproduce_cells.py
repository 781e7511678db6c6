"""A family whose members carry the paper's own numbers (000's Table 3 cells, ``Statistic.papers``): each member
judged against its cell, the others read with no number, and the report's table of members."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from splitleak.audit.analysis import DEFAULT_READOUT
from splitleak.reproduce.claims import Claim, load_claims
from splitleak.reproduce.run import judge_claim

DEPTHS = (3, 6)


def _rows(seed: int) -> list[dict]:
    """Token recovery of two attacks at two depths: activation reads about 0.5 at depth 3 and 0.8 at depth 6."""
    rng = np.random.default_rng(seed)
    out = []
    for attack, lift in (("activation", 0.0), ("joint", 0.1)):
        for depth in DEPTHS:
            level = (0.5 if depth == 3 else 0.8) + lift
            for d in range(40):
                right = int(np.clip(rng.normal(level, 0.03) * 32, 0, 32))
                out.append({"key": f"{attack}{depth}", "attack": attack, "depth": depth, "defence": "none",
                            "client_copy": "public", "victim_seed": 1, "attack_seed": 0, "data_seed": 0,
                            "doc_id": d, "token_correct": right, "token_counted": 32,
                            "readout": DEFAULT_READOUT if attack == "joint" else None})  # fmt: skip
    return out


def _claim(papers: list[dict], tolerance: float = 0.05) -> Claim:
    return Claim(
        id="cells", wording="w", where="Table 3", spec="paper_main",
        paper={"estimate": None, "unit": "% of tokens"},
        statistic={"kind": "family", "member": "level", "metric": "token_recovery",
                   "treatment": {"defence": "none", "client_copy": "public"},
                   "treatments": [{"attack": "activation"}, {"attack": "joint"}], "over": {"depth": list(DEPTHS)},
                   "papers": papers},
        agreement={"rule": "tolerance", "tolerance": tolerance, "ours": True},
    )  # fmt: skip


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1])
def test_each_member_is_judged_against_its_own_cell_and_editing_one_turns_it(seed):
    rows = _rows(seed)
    cells = [{"match": {"attack": "activation", "depth": 6}, "estimate": 0.8},
             {"match": {"attack": "joint", "depth": 3}, "estimate": 0.6}]  # fmt: skip
    j = judge_claim(_claim(cells), rows, [])
    by = {(m.claim.statistic.treatment["attack"], m.claim.statistic.treatment["depth"]): m for m in j.members}
    assert by[("activation", 6)].verdict == "agrees" and by[("joint", 3)].verdict == "agrees"
    assert by[("activation", 6)].claim.paper.estimate == 0.8 and by[("activation", 3)].claim.paper.estimate is None
    assert by[("activation", 3)].verdict == "no number" and by[("joint", 6)].verdict == "no number"
    assert j.verdict == "no number" and "2 agrees, 2 no number of 4 configurations" in j.reason
    # one cell edited past its tolerance: that member disagrees, and so does the family
    moved = judge_claim(_claim([cells[0], {**cells[1], "estimate": 0.9}]), rows, [])
    assert moved.verdict == "disagrees" and "treatment (depth=3, attack=joint)" in moved.reason
    # the member's reading is the plain level claim's, whatever number it is judged against
    plain = judge_claim(
        Claim(id="one", wording="w", where="Table 3", spec="paper_main", paper={"estimate": 0.6, "unit": "%"},
              statistic={"kind": "level", "metric": "token_recovery",
                         "treatment": {"attack": "joint", "depth": 3, "defence": "none", "client_copy": "public"}},
              agreement={"rule": "tolerance", "tolerance": 0.05}),
        rows, [],
    )  # fmt: skip
    assert (plain.ours.estimate, plain.ours.low) == (by[("joint", 3)].ours.estimate, by[("joint", 3)].ours.low)


@pytest.mark.unit
def test_a_cell_that_matches_no_member_or_two_entries_is_refused():
    with pytest.raises(ValidationError, match="matches no member"):
        _claim([{"match": {"attack": "sipit"}, "estimate": 0.5}])
    with pytest.raises(ValidationError, match="give each member one"):
        _claim([{"match": {"attack": "joint"}, "estimate": 0.5}, {"match": {"depth": 3}, "estimate": 0.4}])
    with pytest.raises(ValidationError, match="belong to a family"):
        Claim(id="x", wording="w", where="w", spec="s", paper={"estimate": 0.5, "unit": "%"},
              statistic={"kind": "level", "metric": "token_recovery", "treatment": {"attack": "joint"},
                         "papers": [{"match": {"attack": "joint"}, "estimate": 0.5}]},
              agreement={"rule": "tolerance", "tolerance": 0.1})  # fmt: skip


@pytest.mark.unit
def test_the_shipped_table3_cells_carry_the_numbers_the_prose_quotes_and_the_report_lists_them():
    from splitleak.reproduce.report import member_table

    claims = {c.id: c for c in load_claims("000")[0].claims}
    tok, doc = claims["table3-token-cells"].statistic, claims["table3-doc-cells"].statistic
    assert len(tok.members()) == len(doc.members()) == 8
    assert sorted(v.estimate for v in doc.papers) == [0.1371, 0.2023, 0.3777, 0.5855]
    assert {(v.match["attack"], v.estimate) for v in tok.papers} >= {("activation", 0.942), ("joint", 0.9738)}
    j = judge_claim(_claim([{"match": {"attack": "joint", "depth": 3}, "estimate": 0.6}]), _rows(0), [])
    t = member_table(j)
    assert t.header[:3] == ["member", "paper", "ours [95 %]"] and len(t.rows) == 4
    assert t.rows[1][:2] == ["depth 3, attack joint", "60.00"] and t.rows[0][:2] == ["depth 3, attack activation", "—"]


def _ranked(seed: int, sipit_lift: float) -> list[dict]:
    """joint reads 0.1 above activation on both copies; SipIt 0.05 below joint on the public copy and ``sipit_lift``
    - 0.05 above it on the trained copy (averaged over the copies: tied with joint at ``sipit_lift`` 0.1)."""
    rng = np.random.default_rng(seed)
    out = []
    for attack, k, budget, lift in (
        ("activation", 32, None, 0.0),
        ("joint", 32, None, 0.1),
        ("sipit", None, 128, 0.05),
    ):
        for depth in DEPTHS:
            for copy in ("public", "trained"):
                level = 0.6 + lift + (sipit_lift if attack == "sipit" and copy == "trained" else 0.0)
                for d in range(40):
                    right = int(np.clip(rng.normal(level, 0.05) * 32, 0, 32))
                    out.append({"key": f"{attack}{depth}{copy}", "attack": attack, "k": k, "budget": budget,
                                "depth": depth, "defence": "none", "client_copy": copy, "victim_seed": 1,
                                "attack_seed": 0, "data_seed": 0, "doc_id": d, "token_correct": right,
                                "token_counted": 32, "readout": DEFAULT_READOUT if attack == "joint" else None})  # fmt: skip
    return out


def _ranking(controls: list[dict]) -> Claim:
    return Claim(
        id="rank", wording="w", where="Table 2", spec="paper_main", paper={"estimate": None, "unit": "%"},
        statistic={"kind": "ranking", "metric": "token_recovery", "controls": controls, "over": {"depth": list(DEPTHS)},
                   "treatment": {"attack": "joint", "k": 32, "defence": "none", "client_copy": ["public", "trained"]}},
        agreement={"rule": "sign", "direction": "above", "ours": True},
    )  # fmt: skip


SIPIT = {"attack": "sipit", "k": None, "budget": 128}


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1])
def test_a_ranking_averages_each_arm_over_the_copies_and_reads_every_rival(seed):
    from splitleak.audit.analysis import paired_matrices
    from splitleak.reproduce.ranking import measure_ranking
    from splitleak.stats.bootstrap import paired_difference_ci

    # SipIt above joint on the trained copy and below it on the public: averaged, the two tie; the ranking is open
    rows = _ranked(seed, 0.1)
    j = judge_claim(_ranking([{"attack": "activation"}, SIPIT]), rows, [])
    assert j.verdict == "underpowered" and "2 of 4 comparisons above 0" in j.reason
    # the closest rival's difference is the paired difference of the copy-averaged matrices, at alpha / 4
    got = measure_ranking(_ranking([SIPIT]), rows, n_boot=2000, alpha=0.05, seed=0)
    assert not isinstance(got, str)
    per = got[-1]["per"]
    d3 = next(p for p in per if p["condition"] == {"depth": 3})
    pairs = [paired_matrices(rows, {"attack": "joint", "k": 32, "depth": 3, "client_copy": c, "defence": "none"},
                             {**SIPIT, "depth": 3, "client_copy": c, "defence": "none"}, "token_recovery")
             for c in ("public", "trained")]  # fmt: skip
    a = np.mean([p[0] for p in pairs], axis=0)
    b = np.mean([p[1] for p in pairs], axis=0)
    want = paired_difference_ci(a, b, n_boot=2000, alpha=0.05 / 2, seed=0)
    assert (d3["estimate"], d3["low"], d3["high"]) == pytest.approx((want.estimate, want.low, want.high))
    # SipIt far ahead on the trained copy: it reads above joint averaged over the copies, and the claim disagrees
    far = judge_claim(_ranking([{"attack": "activation"}, SIPIT]), _ranked(seed, 0.3), [])
    assert far.verdict == "disagrees" and "depth 3 against attack sipit, budget 128" in far.reason
    # activation alone is below joint everywhere: the ranking holds
    assert judge_claim(_ranking([{"attack": "activation"}]), rows, []).verdict == "agrees"
    # a rival the store does not hold is not run
    gone = judge_claim(_ranking([{"attack": "random-candidate"}]), rows, [])
    assert gone.verdict == "not run" and "random-candidate" in gone.reason


@pytest.mark.unit
def test_a_ranking_plans_its_jobs_and_a_missing_rival_leaves_it_unplanned():
    from splitleak.reproduce.ranking import ranking_jobs

    jobs = [{k: r[k] for k in ("key", "attack", "k", "budget", "depth", "defence", "client_copy", "readout")}
            for r in _ranked(0, 0.0) if r["doc_id"] == 0]  # fmt: skip
    assert ranking_jobs(_ranking([{"attack": "activation"}, SIPIT]), jobs) == 12  # 3 attacks x 2 depths x 2 copies
    assert ranking_jobs(_ranking([{"attack": "backward-only", "k": None}]), jobs) == 0
    with pytest.raises(ValidationError, match="names its rivals"):
        _ranking([])
    shipped = {c.id: c for c in load_claims("000")[0].claims}["joint-best-averaged-over-copies"]
    assert shipped.statistic.kind == "ranking" and len(shipped.statistic.controls) == 5
