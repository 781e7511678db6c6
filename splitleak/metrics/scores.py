"""Scores of one reconstruction: token, whole-document and exact span recovery.

``pred[i, t]`` is the predicted token id at position ``t`` of ``docs[i]``. A token is right
when it equals ``docs[i].token_ids[t]``; a document is exact when every counted token is
right; a span is recovered when every token of ``[token_start, token_end)`` is right. An
optional boolean ``mask`` selects the positions that count (default: all). A span with any
position outside the mask is left out of both its class's hits and its class's count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from splitleak.data.documents import LABELS, Document
from splitleak.errors import DataError

__all__ = ["ScoreResult", "score_reconstruction", "position_recovery"]


@dataclass(frozen=True, eq=False)
class ScoreResult:
    """Scores of one reconstruction of ``n_docs`` documents (arrays are read-only).

    ``span_recovery[label]`` is None when that class has no counted span.
    ``leading_space_errors`` is None when no ``decode`` was given.
    """

    n_docs: int
    n_tokens: int
    token_recovery: float
    doc_recovery: float
    span_recovery: dict[str, float | None]
    span_counts: dict[str, int]
    span_hits: dict[str, int]
    leading_space_errors: int | None
    wrong_tokens: int
    doc_ids: tuple[int, ...]
    per_doc_token_correct: np.ndarray  # [n_docs] int64: counted tokens right
    per_doc_token_counted: np.ndarray  # [n_docs] int64: counted positions
    per_doc_exact: np.ndarray  # [n_docs] bool
    per_doc_span_hits: np.ndarray  # [n_docs, len(LABELS)] int64, columns in LABELS order
    per_doc_span_counts: np.ndarray  # [n_docs, len(LABELS)] int64, columns in LABELS order

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary (plain int, float, None, dict); per-document arrays are omitted."""
        return {
            "n_docs": int(self.n_docs),
            "n_tokens": int(self.n_tokens),
            "token_recovery": float(self.token_recovery),
            "doc_recovery": float(self.doc_recovery),
            "span_recovery": {k: (None if v is None else float(v)) for k, v in self.span_recovery.items()},
            "span_counts": {k: int(v) for k, v in self.span_counts.items()},
            "span_hits": {k: int(v) for k, v in self.span_hits.items()},
            "leading_space_errors": (None if self.leading_space_errors is None else int(self.leading_space_errors)),
            "wrong_tokens": int(self.wrong_tokens),
        }

    def per_doc(self) -> list[dict[str, Any]]:
        """One JSON-ready dict per document, in input order.

        Keys: ``doc_id``, ``token_correct``, ``token_counted``, ``exact``, ``span_hits`` and
        ``span_counts`` (dicts keyed by class).
        """
        out = []
        for i, doc_id in enumerate(self.doc_ids):
            out.append(
                {
                    "doc_id": int(doc_id),
                    "token_correct": int(self.per_doc_token_correct[i]),
                    "token_counted": int(self.per_doc_token_counted[i]),
                    "exact": bool(self.per_doc_exact[i]),
                    "span_hits": {lab: int(self.per_doc_span_hits[i, j]) for j, lab in enumerate(LABELS)},
                    "span_counts": {lab: int(self.per_doc_span_counts[i, j]) for j, lab in enumerate(LABELS)},
                }
            )
        return out


def _truth(docs: Sequence[Document]) -> np.ndarray:
    """``[n_docs, T]`` int64 array of the documents' token ids; DataError if ragged or empty."""
    if len(docs) == 0:
        raise DataError("no documents to score; pass at least one Document (and one row of pred)")
    lengths = {len(d.token_ids) for d in docs}
    if len(lengths) != 1:
        raise DataError(
            f"documents have different lengths ({sorted(lengths)} token ids); score documents "
            "of one doc_len together, e.g. one DocumentSets split"
        )
    return np.array([d.token_ids for d in docs], dtype=np.int64).reshape(len(docs), -1)


def _check_pred(pred: Any, truth: np.ndarray) -> np.ndarray:
    n, t = truth.shape
    try:
        arr = np.asarray(pred)
    except (ValueError, TypeError) as exc:
        raise DataError(
            f"pred cannot be read as an array ({type(exc).__name__}: {exc}); pass a "
            f"rectangular [n_docs, T] = [{n}, {t}] array of token ids"
        ) from exc
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.integer) and arr.dtype != np.bool_):
        raise DataError(
            f"pred has dtype {arr.dtype}; pass token ids as integers, e.g. "
            "np.asarray(pred, dtype=np.int64) after checking they are whole numbers"
        )
    if arr.ndim != 2:
        raise DataError(
            f"pred has shape {arr.shape}; pass a 2-D [n_docs, T] = [{n}, {t}] array "
            "(one row per document; for one document use pred[None, :])"
        )
    if arr.shape[0] != n:
        raise DataError(
            f"pred has {arr.shape[0]} rows but {n} documents were given; pass one row per "
            "document, in the same order as docs"
        )
    if arr.shape[1] != t:
        raise DataError(
            f"pred has {arr.shape[1]} positions per row but the documents hold {t} token ids "
            f"each; pass rows of exactly {t} predicted ids"
        )
    return arr.astype(np.int64, copy=False)


def _check_mask(mask: Any, shape: tuple[int, int]) -> np.ndarray:
    if mask is None:
        return np.ones(shape, dtype=bool)
    m = np.asarray(mask)
    if m.dtype != np.bool_:
        raise DataError(f"mask has dtype {m.dtype}; pass a boolean [n_docs, T] array (True = the position counts)")
    if m.shape != shape:
        raise DataError(f"mask has shape {m.shape} but pred has shape {shape}; pass one boolean per predicted position")
    return m


def position_recovery(pred: Any, docs: Sequence[Document], *, mask: Any = None) -> np.ndarray:
    """Share of documents whose token at each position is right: float64 ``[T]``.

    With ``mask``, position ``t`` is scored over the documents where ``mask[:, t]`` is True;
    a position counted in no document is NaN.
    """
    truth = _truth(docs)
    p = _check_pred(pred, truth)
    m = _check_mask(mask, truth.shape)
    hits = ((p == truth) & m).sum(axis=0)
    counted = m.sum(axis=0)
    out = np.full(truth.shape[1], np.nan)
    np.divide(hits, counted, out=out, where=counted > 0)
    return out


def _differs_by_leading_space(a: str, b: str) -> bool:
    return a != b and a.lstrip() == b.lstrip()


def score_reconstruction(
    pred: Any,
    docs: Sequence[Document],
    decode: Callable[[int], str] | None = None,
    *,
    mask: Any = None,
) -> ScoreResult:
    """Score ``pred`` ([n_docs, T] int token ids, row i for ``docs[i]``) against ``docs``.

    ``decode`` maps one token id to its string (e.g. ``lambda i: tok.decode([i])``); when
    given, ``leading_space_errors`` counts the wrong counted tokens whose string differs from
    the true token's only by leading whitespace (``" The"`` for ``"The"``); it is called on
    the true and predicted ids of wrong counted tokens only, so it must accept every
    predicted id (its errors propagate). ``mask`` is an
    optional boolean [n_docs, T] array of the positions that count; every document needs at
    least one. Raises DataError on mismatched shapes or types.
    """
    truth = _truth(docs)
    p = _check_pred(pred, truth)
    m = _check_mask(mask, truth.shape)
    n_docs, _ = truth.shape

    counted = m.sum(axis=1).astype(np.int64)
    if (counted == 0).any():
        bad = [docs[i].doc_id for i in np.flatnonzero(counted == 0)[:5]]
        raise DataError(
            f"mask counts no position in document(s) with doc_id {bad}; every document needs "
            "at least one True in its mask row, or leave the document out of docs and pred"
        )

    right = p == truth
    right_counted = right & m
    per_doc_correct = right_counted.sum(axis=1).astype(np.int64)
    per_doc_exact = per_doc_correct == counted
    n_tokens = int(counted.sum())
    n_right = int(per_doc_correct.sum())

    span_hits_arr = np.zeros((n_docs, len(LABELS)), dtype=np.int64)
    span_counts_arr = np.zeros((n_docs, len(LABELS)), dtype=np.int64)
    col = {lab: j for j, lab in enumerate(LABELS)}
    for i, doc in enumerate(docs):
        for span in doc.spans:
            a, b = span.token_start, span.token_end
            if not m[i, a:b].all():
                continue
            j = col[span.label]
            span_counts_arr[i, j] += 1
            span_hits_arr[i, j] += int(right[i, a:b].all())
    totals = span_counts_arr.sum(axis=0)
    hits = span_hits_arr.sum(axis=0)
    span_counts = {lab: int(totals[j]) for lab, j in col.items()}
    span_hits = {lab: int(hits[j]) for lab, j in col.items()}
    span_recovery: dict[str, float | None] = {
        lab: (float(hits[j] / totals[j]) if totals[j] else None) for lab, j in col.items()
    }

    leading: int | None = None
    if decode is not None:
        cache: dict[int, str] = {}

        def text(token: int) -> str:
            if token not in cache:
                cache[token] = decode(token)
            return cache[token]

        wrong = np.argwhere(~right & m)
        leading = sum(_differs_by_leading_space(text(int(p[i, t])), text(int(truth[i, t]))) for i, t in wrong)

    for arr in (per_doc_correct, counted, per_doc_exact, span_hits_arr, span_counts_arr):
        arr.setflags(write=False)
    return ScoreResult(
        n_docs=n_docs,
        n_tokens=n_tokens,
        token_recovery=n_right / n_tokens,
        doc_recovery=float(per_doc_exact.mean()),
        span_recovery=span_recovery,
        span_counts=span_counts,
        span_hits=span_hits,
        leading_space_errors=leading,
        wrong_tokens=n_tokens - n_right,
        doc_ids=tuple(int(d.doc_id) for d in docs),
        per_doc_token_correct=per_doc_correct,
        per_doc_token_counted=counted,
        per_doc_exact=per_doc_exact,
        per_doc_span_hits=span_hits_arr,
        per_doc_span_counts=span_counts_arr,
    )
