"""000's span claims (§4.5, Table 4) read from a store's rows (``reproduce.spans``): the share of a class's spans
recovered exactly, pooled over the spans, with the crossed bootstrap of that ratio."""

from __future__ import annotations

import numpy as np
import pytest

from splitleak.reproduce.claims import Claim
from splitleak.reproduce.run import judge_claim


def _rows(hits: np.ndarray, counts: np.ndarray, attack_seeds: int = 1) -> list[dict]:
    rows = []
    for s in range(hits.shape[0]):
        for d in range(hits.shape[1]):
            for a in range(attack_seeds):
                rows.append(
                    {"model": "m", "depth": 3, "defence": "mixup", "attack": "activation", "k": 8, "victim_seed": s,
                     "attack_seed": a, "data_seed": 0, "doc_id": d, "token_correct": 1, "token_counted": 2,
                     "exact": False, "span_hits_name": int(hits[s, d]), "span_counts_name": int(counts[s, d]),
                     "span_hits_number": 0, "span_counts_number": 0}
                )  # fmt: skip
    return rows


def _claim(metric: str = "name_span_recovery", low: float = 0.4785, high: float = 0.6615) -> Claim:
    return Claim(
        id="s", wording="w", where="§4.5", spec="paper_main",
        paper={"estimate": None, "range": [low, high], "unit": "share of spans"},
        statistic={"kind": "level", "metric": metric, "treatment": {"defence": "mixup", "attack": "activation", "k": 8}},
        agreement={"rule": "range", "tolerance": 0.05, "ours": True},
    )  # fmt: skip


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_span_share_is_pooled_over_spans_with_the_ratios_crossed_bootstrap(seed):
    from splitleak.stats.bootstrap import paired_ratio_ci

    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 4, size=(2, 12))
    counts[:, 0] = 0  # a document without a name span weighs nothing
    hits = rng.binomial(counts, 0.55)
    j = judge_claim(_claim(), _rows(hits, counts), [])
    want = paired_ratio_ci(hits, counts, n_boot=20_000, alpha=0.05, seed=0)
    assert j.ours is not None and j.ours.estimate == pytest.approx(hits.sum() / counts.sum())
    assert (j.ours.low, j.ours.high) == pytest.approx((want.low, want.high))
    per_doc = np.nanmean(np.where(counts > 0, hits / np.maximum(counts, 1), np.nan))
    assert j.ours.estimate != pytest.approx(per_doc)  # spans pooled, not documents' shares averaged
    assert j.ours.setting["spans"] == round(counts.sum(axis=1).mean()) and j.ours.docs == 12


@pytest.mark.unit
def test_a_span_claim_agrees_inside_the_papers_range_and_says_why_it_has_no_reading():
    counts = np.full((2, 10), 4)
    hits = np.full((2, 10), 2)  # half of every document's names: 0.5, inside 47.85-66.15 %
    assert judge_claim(_claim(), _rows(hits, counts, attack_seeds=2), []).verdict == "agrees"
    # the paper's range moved away: the same reading disagrees
    assert judge_claim(_claim(low=0.9, high=0.95), _rows(hits, counts), []).verdict == "disagrees"
    none = judge_claim(_claim("number_span_recovery"), _rows(hits, counts), [])
    assert none.verdict == "not run" and "number span" in none.reason
    bad = _claim().model_copy(
        update={"statistic": _claim().statistic.model_copy(update={"kind": "difference", "control": {"defence": "x"}})}
    )
    assert "read as a level" in judge_claim(bad, _rows(hits, counts), []).reason
