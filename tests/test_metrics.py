"""splitleak.metrics: recovery scores, half-up percentages, ROC AUC and the leakage index."""

from __future__ import annotations

import json

import numpy as np
import pytest

from splitleak.data import Document, Span
from splitleak.errors import DataError
from splitleak.metrics import (
    ScoreResult,
    fmt_pct,
    leakage_index,
    pct,
    position_recovery,
    roc_auc,
    score_reconstruction,
)

pytestmark = pytest.mark.unit


def _span(text: str, label: str, sub: str, token_start: int, token_end: int) -> Span:
    start = text.index(sub)
    return Span(label, start, start + len(sub), token_start, token_end, sub)


def _doc(doc_id: int, token_ids, text: str, spans=()) -> Document:
    return Document(doc_id, tuple(token_ids), text, tuple(spans), f"test:{doc_id}")


T0 = "Ann has 42 cats"  # tokens: "Ann" " has" " 42" " cats"
T1 = "Bob Lee id X7"  # tokens: "Bob" " Lee" " id" " X7"
T2 = "The cat sat down"  # tokens: "The" " cat" " sat" " down"


@pytest.fixture
def docs() -> list[Document]:
    return [
        _doc(
            10,
            (100, 101, 102, 103),
            T0,
            [_span(T0, "name", "Ann", 0, 1), _span(T0, "number", "42", 2, 3)],
        ),
        _doc(
            11,
            (200, 201, 202, 203),
            T1,
            [_span(T1, "name", "Bob Lee", 0, 2), _span(T1, "identifier", "X7", 3, 4)],
        ),
        _doc(12, (300, 301, 302, 303), T2),
    ]


def _truth(docs) -> np.ndarray:
    return np.array([d.token_ids for d in docs], dtype=np.int64)


# --- score_reconstruction ---------------------------------------------------------------


def test_perfect_reconstruction(docs):
    r = score_reconstruction(_truth(docs), docs)
    assert isinstance(r, ScoreResult)
    assert (r.n_docs, r.n_tokens, r.wrong_tokens) == (3, 12, 0)
    assert r.token_recovery == 1.0 and r.doc_recovery == 1.0
    assert r.span_recovery == {"name": 1.0, "number": 1.0, "identifier": 1.0}
    assert r.span_counts == {"name": 2, "number": 1, "identifier": 1}
    assert r.leading_space_errors is None


def test_one_wrong_token_spoils_one_document_and_one_span(docs):
    pred = _truth(docs)
    pred[1, 1] = 999  # " Lee": the second token of the two-token name "Bob Lee"
    r = score_reconstruction(pred, docs)
    assert r.token_recovery == pytest.approx(11 / 12, abs=1e-15)
    assert r.doc_recovery == pytest.approx(2 / 3, abs=1e-15)
    assert r.wrong_tokens == 1 and r.n_tokens == 12
    # "Bob" is right but " Lee" is not: the span is not recovered.
    assert r.span_hits == {"name": 1, "number": 1, "identifier": 1}
    assert r.span_counts == {"name": 2, "number": 1, "identifier": 1}
    assert r.span_recovery == {"name": 0.5, "number": 1.0, "identifier": 1.0}
    assert r.per_doc_token_correct.tolist() == [4, 3, 4]
    assert r.per_doc_exact.tolist() == [True, False, True]


def test_wrong_token_outside_spans_leaves_spans_recovered(docs):
    pred = _truth(docs)
    pred[0, 1] = 999  # " has"
    pred[0, 3] = 999  # " cats"
    r = score_reconstruction(pred, docs)
    assert r.token_recovery == pytest.approx(10 / 12, abs=1e-15)
    assert r.doc_recovery == pytest.approx(2 / 3, abs=1e-15)
    assert r.span_recovery == {"name": 1.0, "number": 1.0, "identifier": 1.0}


def test_class_without_spans_is_none(docs):
    r = score_reconstruction(_truth(docs[:1]), docs[:1])
    assert r.span_recovery == {"name": 1.0, "number": 1.0, "identifier": None}
    assert r.span_counts == {"name": 1, "number": 1, "identifier": 0}
    r = score_reconstruction(_truth(docs[2:]), docs[2:])
    assert r.span_recovery == {"name": None, "number": None, "identifier": None}
    assert r.as_dict()["span_recovery"] == {"name": None, "number": None, "identifier": None}


def test_all_wrong(docs):
    pred = _truth(docs) + 1
    r = score_reconstruction(pred, docs)
    assert r.token_recovery == 0.0 and r.doc_recovery == 0.0 and r.wrong_tokens == 12
    assert r.span_recovery == {"name": 0.0, "number": 0.0, "identifier": 0.0}


def test_mask_counts_only_selected_positions(docs):
    pred = _truth(docs)
    pred[:, 0] = 999  # every first token wrong
    pred[2, 2] = 999
    mask = np.ones(pred.shape, dtype=bool)
    mask[:, 0] = False
    r = score_reconstruction(pred, docs, mask=mask)
    assert r.n_tokens == 9 and r.wrong_tokens == 1
    assert r.token_recovery == pytest.approx(8 / 9, abs=1e-15)
    assert r.doc_recovery == pytest.approx(2 / 3, abs=1e-15)
    assert r.per_doc_exact.tolist() == [True, True, False]
    # "Ann" and "Bob Lee" touch position 0, so they are left out of hits and counts.
    assert r.span_counts == {"name": 0, "number": 1, "identifier": 1}
    assert r.span_recovery == {"name": None, "number": 1.0, "identifier": 1.0}
    # Without the mask, the first tokens count and no document is exact.
    r = score_reconstruction(pred, docs)
    assert r.doc_recovery == 0.0 and r.span_recovery["name"] == 0.0


def test_as_dict_and_per_doc_are_json_ready(docs):
    pred = _truth(docs)
    pred[1, 1] = 999
    r = score_reconstruction(pred, docs, decode=lambda i: f"t{i}")
    d = json.loads(json.dumps(r.as_dict()))
    assert d == {
        "n_docs": 3,
        "n_tokens": 12,
        "token_recovery": 11 / 12,
        "doc_recovery": 2 / 3,
        "span_recovery": {"name": 0.5, "number": 1.0, "identifier": 1.0},
        "span_counts": {"name": 2, "number": 1, "identifier": 1},
        "span_hits": {"name": 1, "number": 1, "identifier": 1},
        "leading_space_errors": 0,
        "wrong_tokens": 1,
    }
    rows = json.loads(json.dumps(r.per_doc()))
    assert [row["doc_id"] for row in rows] == [10, 11, 12]
    assert rows[1] == {
        "doc_id": 11,
        "token_correct": 3,
        "token_counted": 4,
        "exact": False,
        "span_hits": {"name": 0, "number": 0, "identifier": 1},
        "span_counts": {"name": 1, "number": 0, "identifier": 1},
    }
    assert rows[0]["exact"] is True and rows[0]["span_hits"]["number"] == 1


def test_result_arrays_are_read_only(docs):
    r = score_reconstruction(_truth(docs), docs)
    with pytest.raises(ValueError):
        r.per_doc_exact[0] = False


def test_leading_space_errors():
    table = {1: "The", 2: " The", 3: "cat"}
    doc = _doc(0, (1, 3, 1, 2), "The cat The The")
    pred = np.array([[2, 3, 3, 1]])  # 2 for 1: leading space; 3 for 1: not; 1 for 2: leading
    r = score_reconstruction(pred, [doc], decode=table.__getitem__)
    assert r.wrong_tokens == 3
    assert r.leading_space_errors == 2
    only_cat = np.array([[3, 3, 3, 2]])
    assert score_reconstruction(only_cat, [doc], decode=table.__getitem__).leading_space_errors == 0
    assert score_reconstruction(pred, [doc]).leading_space_errors is None


def test_leading_space_errors_respect_mask():
    table = {1: "The", 2: " The", 3: "cat"}
    doc = _doc(0, (1, 3, 1, 3), "The cat The cat")
    pred = np.array([[2, 3, 2, 3]])
    mask = np.array([[False, True, True, True]])
    r = score_reconstruction(pred, [doc], decode=table.__getitem__, mask=mask)
    assert r.leading_space_errors == 1 and r.wrong_tokens == 1


def test_position_recovery(docs):
    pred = _truth(docs)
    pred[0, 0] = pred[1, 0] = pred[2, 3] = 999
    curve = position_recovery(pred, docs)
    assert curve.shape == (4,)
    np.testing.assert_allclose(curve, [1 / 3, 1.0, 1.0, 2 / 3], rtol=0, atol=1e-15)
    mask = np.ones(pred.shape, dtype=bool)
    mask[:, 0] = False
    mask[0, 3] = False
    curve = position_recovery(pred, docs, mask=mask)
    assert np.isnan(curve[0])
    np.testing.assert_allclose(curve[1:], [1.0, 1.0, 0.5], rtol=0, atol=1e-15)


def test_accepts_lists_and_other_int_dtypes(docs):
    pred = _truth(docs).astype(np.int32).tolist()
    assert score_reconstruction(pred, docs).token_recovery == 1.0


@pytest.mark.parametrize(
    ("make_pred", "needle"),
    [
        (lambda t: t[:2], "2 rows but 3 documents"),
        (lambda t: t[:, :3], "3 positions per row but the documents hold 4"),
        (lambda t: t[0], "2-D [n_docs, T]"),
        (lambda t: t.astype(np.float64), "integers"),
        (lambda t: t.astype(bool), "integers"),
        (lambda t: [[1, 2, 3, 4], [1, 2], [1, 2, 3, 4]], "rectangular"),
    ],
)
def test_bad_pred_raises(docs, make_pred, needle):
    with pytest.raises(DataError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        score_reconstruction(make_pred(_truth(docs)), docs)


def test_bad_docs_and_mask_raise(docs):
    t = _truth(docs)
    with pytest.raises(DataError, match="no documents"):
        score_reconstruction(np.zeros((0, 4), dtype=np.int64), [])
    short = _doc(13, (1, 2, 3), "abc")
    with pytest.raises(DataError, match="different lengths"):
        score_reconstruction(t, docs[:2] + [short])
    with pytest.raises(DataError, match="mask has shape"):
        score_reconstruction(t, docs, mask=np.ones((3, 3), dtype=bool))
    with pytest.raises(DataError, match="boolean"):
        score_reconstruction(t, docs, mask=np.ones((3, 4), dtype=int))
    mask = np.ones((3, 4), dtype=bool)
    mask[1] = False
    with pytest.raises(DataError, match=r"doc_id \[11\]"):
        score_reconstruction(t, docs, mask=mask)
    with pytest.raises(DataError, match="rows"):
        position_recovery(t[:1], docs)


# --- pct / fmt_pct -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("x", "expected"),
    [
        (0.12345, 12.35),
        (0.123450, 12.35),
        (0.12344999, 12.34),
        (0.5, 50.0),
        (1 / 3, 33.33),
        (0.00005, 0.01),
        (0.02675, 2.68),  # round(0.02675 * 100, 2) == 2.67 (binary float below the half)
        (0.00125, 0.13),  # round(0.00125 * 100, 2) == 0.12 (half to even)
        (1, 100.0),
        (0.0, 0.0),
        (-0.12345, -12.35),  # halves go away from zero
        (np.float64(0.12345), 12.35),
    ],
)
def test_pct_half_up(x, expected):
    assert pct(x) == expected


def test_pct_differs_from_builtin_round():
    assert round(0.02675 * 100, 2) == 2.67 and pct(0.02675) == 2.68
    assert round(0.00125 * 100, 2) == 0.12 and pct(0.00125) == 0.13


def test_pct_places_and_fmt():
    assert pct(0.123456, places=4) == 12.3456
    assert pct(0.12345, places=1) == 12.3
    assert pct(0.12355, places=1) == 12.4
    assert pct(0.125, places=0) == 13.0
    assert fmt_pct(0.12345) == "12.35"
    assert fmt_pct(0.5) == "50.00"
    assert fmt_pct(1 / 3, places=1) == "33.3"
    assert fmt_pct(-0.00001) == "0.00"  # no "-0.00"
    assert fmt_pct(1e-9, places=0) == "0"


def test_differences_before_rounding():
    a, b = 0.123454, 0.000005
    assert pct(a) - pct(b) == pytest.approx(12.35)  # rounding first gives the wrong answer
    assert pct(a - b) == 12.34


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), None, "0.5", True])
def test_pct_rejects_non_numbers(bad):
    with pytest.raises(DataError, match="percentage"):
        pct(bad)


def test_pct_rejects_bad_places():
    with pytest.raises(DataError, match="places"):
        pct(0.5, places=-1)


# --- roc_auc ------------------------------------------------------------------------------


def test_roc_auc_hand_example():
    assert roc_auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == 0.75
    assert roc_auc([0.1, 0.4, 0.35, 0.8], [False, False, True, True]) == 0.75


def test_roc_auc_ties_count_half():
    assert roc_auc([1.0, 1.0], [0, 1]) == 0.5
    # positive 0.5 ties one negative, beats one: (1 + 0.5) / 2
    assert roc_auc([0.2, 0.5, 0.5], [0, 0, 1]) == 0.75
    assert roc_auc([3, 3, 3, 3], [0, 1, 0, 1]) == 0.5


def test_roc_auc_extremes_and_flip():
    assert roc_auc([0, 1, 2, 3], [0, 0, 1, 1]) == 1.0
    assert roc_auc([0, 1, 2, 3], [1, 1, 0, 0]) == 0.0
    rng = np.random.default_rng(0)
    s = rng.integers(0, 6, 40)
    y = rng.integers(0, 2, 40)
    assert roc_auc(-s, y) == pytest.approx(1 - roc_auc(s, y), abs=1e-12)


def test_roc_auc_matches_sklearn_with_ties():
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    for seed in range(60):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(2, 300))
        y = rng.integers(0, 2, n)
        y[0], y[1] = 0, 1  # both classes present
        levels = int(rng.integers(1, 12))  # few levels -> many ties; 1 level -> all tied
        s = rng.integers(0, levels, n) / 3.0 + (rng.normal(size=n) if seed % 4 == 0 else 0)
        ours = roc_auc(s, y)
        theirs = sklearn_metrics.roc_auc_score(y, s)
        assert abs(ours - theirs) <= 1e-12, (seed, ours, theirs)


@pytest.mark.parametrize(
    ("scores", "labels", "needle"),
    [
        ([0.1, 0.2, 0.3], [0, 1, 2], "binary"),
        ([0.1, 0.2], [-1, 1], "binary"),
        ([0.1, 0.2, 0.3], [1, 1, 1], "0 negative"),
        ([0.1, 0.2, 0.3], [0, 0, 0], "0 positive"),
        ([0.1, 0.2], [0, 1, 1], "same length"),
        ([[0.1, 0.2]], [[0, 1]], "1-D"),
        ([0.1, float("nan")], [0, 1], "NaN"),
        (["a", "b"], [0, 1], "numeric"),
        ([0.1, 0.2], ["no", "yes"], "0/1"),
    ],
)
def test_roc_auc_bad_inputs(scores, labels, needle):
    with pytest.raises(DataError, match=needle):
        roc_auc(scores, labels)


# --- leakage_index ------------------------------------------------------------------------


def test_leakage_index_hand_examples():
    assert leakage_index(0.5, 0.3) == pytest.approx(0.2, abs=1e-15)
    assert leakage_index(0.3, 0.5) == 0.0  # floored at zero
    assert leakage_index(0.3, 0.5, []) == 0.0
    assert leakage_index(0.3, 0.5, [0.2]) == pytest.approx(0.6, abs=1e-15)  # below 0.5 counts
    assert leakage_index(0.3, 0.5, [0.8]) == pytest.approx(0.6, abs=1e-15)
    assert leakage_index(0.6, 0.1, [0.55, 0.7, 0.5]) == pytest.approx(0.5, abs=1e-15)
    assert leakage_index(0.4, 0.35, [0.55, 0.45, 0.5]) == pytest.approx(0.1, abs=1e-15)
    assert leakage_index(0.4, 0.4, [0.5, 0.5, 0.5]) == 0.0
    assert leakage_index(0.9, 0.0, (a for a in [0.0])) == 1.0  # any iterable


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((45.0, 0.3, []), "a_vmi"),
        ((0.5, float("nan"), []), "a_control"),
        ((0.5, 0.3, [0.5, 1.2]), r"aucs\[1\]"),
        ((0.5, 0.3, [None]), r"aucs\[0\]"),
    ],
)
def test_leakage_index_bad_inputs(args, needle):
    with pytest.raises(DataError, match=needle):
        leakage_index(*args)
