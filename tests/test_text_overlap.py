"""ROUGE-1/2/L and METEOR of reconstructed text (splitleak.metrics.text_overlap)."""

from __future__ import annotations

import math

import pytest

from splitleak.errors import ConfigError
from splitleak.metrics import text_overlap
from splitleak.metrics.text_overlap import ROUGE_TYPES, meteor, rouge_f, wordnet_available

pytestmark = pytest.mark.unit


def test_rouge_identical_disjoint_and_by_hand():
    preds = ["the cat sat on the mat", "alpha beta gamma", "the cat ran"]
    refs = ["the cat sat on the mat", "delta epsilon", "the cat sat"]
    out = rouge_f(preds, refs)
    assert out["n"] == 3
    for k in ROUGE_TYPES:
        assert len(out[k]["per_doc"]) == 3
        assert out[k]["per_doc"][0] == pytest.approx(1.0)
        assert out[k]["per_doc"][1] == 0.0
    # 'the cat ran' vs 'the cat sat': unigrams 2 of 3 each way; bigrams 'the cat' of 2; LCS 'the cat'
    assert out["rouge1"]["per_doc"][2] == pytest.approx(2 / 3)
    assert out["rouge2"]["per_doc"][2] == pytest.approx(1 / 2)
    assert out["rougeL"]["per_doc"][2] == pytest.approx(2 / 3)
    assert out["rouge1"]["mean"] == pytest.approx((1 + 0 + 2 / 3) / 3)
    assert out["rouge2"]["mean"] == pytest.approx((1 + 0 + 1 / 2) / 3)


def test_rouge_unequal_lengths_and_order():
    # 'a b c d' vs 'c d a b': P = R = 1 for unigrams; bigrams 'a b', 'c d' of 3; LCS 2 of 4
    out = rouge_f(["c d a b", "x y"], ["a b c d", "x y z w"])
    assert out["rouge1"]["per_doc"] == pytest.approx([1.0, 2 * 1.0 * 0.5 / 1.5])
    assert out["rouge2"]["per_doc"] == pytest.approx([2 / 3, 2 * 1.0 * (1 / 3) / (1 + 1 / 3)])
    assert out["rougeL"]["per_doc"][0] == pytest.approx(0.5)
    # case and punctuation do not count; an empty prediction scores 0
    assert rouge_f(["The Cat, sat!", ""], ["the cat sat", "the cat sat"])["rouge1"]["per_doc"] == [1.0, 0.0]


def test_rouge_empty_and_mismatched_inputs():
    out = rouge_f([], [])
    assert out["n"] == 0 and out["rouge1"]["per_doc"] == [] and math.isnan(out["rouge1"]["mean"])
    with pytest.raises(ConfigError, match="2 prediction"):
        rouge_f(["a", "b"], ["a"])
    with pytest.raises(ConfigError, match="not a single string"):
        rouge_f("a b", "a b")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="decode token ids"):
        rouge_f([[1, 2]], ["a"])  # type: ignore[list-item]


def test_meteor_on_this_machine_returns_its_shape():
    preds, refs = ["the dog ran home", "the cat sat"], ["the cat sat", "the cat sat"]
    ok, why = wordnet_available()
    out = meteor(preds, refs)  # 'dog' and 'ran' need WordNet: must not raise either way
    assert out["available"] is ok and out["n"] == 2
    if ok:
        assert len(out["per_doc"]) == 2 and 0.0 <= out["per_doc"][0] < out["per_doc"][1] <= 1.0
        assert out["mean"] == pytest.approx(sum(out["per_doc"]) / 2)
    else:
        assert "python -m nltk.downloader wordnet" in out["reason"] and out["reason"] == why
        assert "per_doc" not in out


def test_meteor_scores_by_hand_when_available(monkeypatch):
    """Exact matches never reach WordNet's stage, so these score with or without the data:
    F_mean = 1, penalty = 0.5 * (chunks / matches)^3."""
    monkeypatch.setattr(text_overlap, "wordnet_available", lambda: (True, ""))
    out = meteor(["the cat sat", "sat the cat", ""], ["the cat sat", "the cat sat", "the cat sat"])
    assert out["available"] is True
    assert out["per_doc"] == pytest.approx([1 - 0.5 / 27, 1 - 0.5 * 8 / 27, 0.0])
    assert out["mean"] == pytest.approx((2 - 4.5 / 27) / 3)


def test_meteor_refuses_when_wordnet_is_missing(monkeypatch):
    monkeypatch.setattr(text_overlap, "wordnet_available", lambda: (False, "no wordnet: install it"))
    out = meteor(["the cat sat"], ["the cat sat"])
    assert out == {"available": False, "reason": "no wordnet: install it", "n": 1}
    with pytest.raises(ConfigError, match="1 prediction"):
        meteor(["a"], ["a", "b"])
