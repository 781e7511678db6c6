"""Overlap between reconstructed and reference text: ROUGE-1/2/L and METEOR, per document.

ROUGE comes from the ``rouge-score`` package (Google's reimplementation), without stemming: its
tokenizer lowercases, replaces every character outside [a-z0-9] by a space and splits on
whitespace, so punctuation and case never count (and non-ASCII letters split words: 'café' is
'caf'). An empty prediction or reference scores 0.

METEOR comes from ``nltk.translate.meteor_score`` on whitespace tokens (nltk lowercases them
itself, its default ``preprocess=str.lower``; punctuation stays attached to its word). Its third matching stage looks up
WordNet synonyms, and nltk ships WordNet as separate data that is not installed with the
package. Measured here (nltk 3.10.4, no WordNet data): ``meteor_score`` does *not* fail up front;
it reaches WordNet only for words left unmatched by the exact and Porter-stem stages, so
'the cat sat' vs 'the cats sat' scores 0.981 and an empty hypothesis scores 0.0, while
'the cat sat' vs 'the dog sat' raises ``LookupError`` (Resource 'wordnet' not found). A run
without WordNet would therefore score some documents and crash on others, and the scored ones
would be a biased subset. ``meteor`` checks for WordNet before scoring anything and, when it is
missing, scores nothing: it returns ``{"available": False, "reason": ...}`` with the install
command.
"""

from __future__ import annotations

from typing import Any

from splitleak.errors import ConfigError

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")
WORDNET_INSTALL = "python -m nltk.downloader wordnet"


def _check_pairs(predictions: list[str], references: list[str], what: str) -> None:
    if isinstance(predictions, str) or isinstance(references, str):
        raise ConfigError(f"{what}: give lists of strings, one per document, not a single string")
    if len(predictions) != len(references):
        raise ConfigError(
            f"{what}: {len(predictions)} prediction(s) but {len(references)} reference(s); "
            "give one prediction per reference document, in the same order"
        )
    for i, (p, r) in enumerate(zip(predictions, references)):
        if not isinstance(p, str) or not isinstance(r, str):
            raise ConfigError(
                f"{what}: document {i} is not a pair of strings ({type(p).__name__}, {type(r).__name__}); "
                "decode token ids to text first"
            )


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def rouge_f(predictions: list[str], references: list[str]) -> dict[str, Any]:
    """ROUGE-1, ROUGE-2 and ROUGE-L F-measures of each prediction against its reference.

    Returns ``{"rouge1": {"per_doc": [...], "mean": m}, "rouge2": ..., "rougeL": ..., "n": n}``;
    the means are NaN for no documents. ROUGE-L is the sentence-level LCS variant (not rougeLsum).
    """
    # lazy: rouge-score and nltk take seconds to import; only label scores need them
    from rouge_score import rouge_scorer  # type: ignore[import-untyped]

    _check_pairs(predictions, references, "ROUGE")
    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=False)
    per: dict[str, list[float]] = {k: [] for k in ROUGE_TYPES}
    for pred, ref in zip(predictions, references):
        scores = scorer.score(ref, pred)  # score(target, prediction)
        for k in ROUGE_TYPES:
            per[k].append(float(scores[k].fmeasure))
    out: dict[str, Any] = {k: {"per_doc": per[k], "mean": _mean(per[k])} for k in ROUGE_TYPES}
    out["n"] = len(predictions)
    return out


def wordnet_available() -> tuple[bool, str]:
    """(True, "") when nltk's WordNet data loads; else (False, why and how to install it)."""
    try:
        # lazy: rouge-score and nltk take seconds to import; only label scores need them
        from nltk.corpus import wordnet  # type: ignore[import-untyped]

        wordnet.ensure_loaded()
    except LookupError:
        return False, (
            "nltk's WordNet data is not installed, and METEOR's synonym stage needs it; "
            f"install it with `{WORDNET_INSTALL}` (network needed once) or copy an nltk_data folder "
            "holding corpora/wordnet into a directory on nltk.data.path (or point NLTK_DATA at it)"
        )
    except ImportError as e:  # pragma: no cover - nltk comes with rouge-score
        return False, f"nltk cannot be imported ({e}); install it with `pip install nltk`"
    return True, ""


def meteor(predictions: list[str], references: list[str]) -> dict[str, Any]:
    """METEOR of each prediction against its reference, on whitespace tokens.

    With WordNet: ``{"available": True, "per_doc": [...], "mean": m, "n": n}`` (mean NaN for no
    documents). Without: ``{"available": False, "reason": "...", "n": n}`` and nothing scored
    (see the module docstring for why no partial scores).
    """
    _check_pairs(predictions, references, "METEOR")
    ok, why = wordnet_available()
    if not ok:
        return {"available": False, "reason": why, "n": len(predictions)}
    # lazy: rouge-score and nltk take seconds to import; only label scores need them
    from nltk.translate.meteor_score import meteor_score  # type: ignore[import-untyped]

    per = [float(meteor_score([ref.split()], pred.split())) for pred, ref in zip(predictions, references)]
    return {"available": True, "per_doc": per, "mean": _mean(per), "n": len(predictions)}
