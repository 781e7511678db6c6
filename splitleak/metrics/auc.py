"""Area under the ROC curve and the normalised leakage index.

``roc_auc`` is the Mann-Whitney form: the sum of the positives' ranks (average ranks for
ties) minus ``n1 (n1 + 1) / 2``, divided by ``n1 * n0``; a tie between a positive and a
negative counts one half. ``leakage_index`` is Eq. 1 of the paper (section 5):
``max(0, a_vmi - a_control, max_j 2 |AUC_j - 0.5|)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
from scipy.stats import rankdata

from splitleak.errors import DataError

__all__ = ["roc_auc", "leakage_index"]


def roc_auc(scores: Any, labels: Any) -> float:
    """AUC of ``scores`` (higher = more likely positive) for binary ``labels`` (0/1 or bool).

    Raises DataError unless both are 1-D and of equal length, scores are finite, labels are
    all 0 or 1, and both classes occur.
    """
    s = np.asarray(scores)
    y = np.asarray(labels)
    if s.ndim != 1 or y.ndim != 1 or s.shape != y.shape:
        raise DataError(
            f"scores have shape {s.shape} and labels {y.shape}; pass two 1-D sequences of "
            "the same length, one score and one label per example"
        )
    if s.dtype.kind not in "biuf":
        raise DataError(f"scores have dtype {s.dtype}; pass numeric scores")
    s = s.astype(np.float64)
    if not np.isfinite(s).all():
        raise DataError(f"{int((~np.isfinite(s)).sum())} score(s) are NaN or infinite; pass finite scores")
    if y.dtype.kind not in "biuf":
        raise DataError(f"labels have dtype {y.dtype}; pass labels as 0/1 integers or bools")
    values = set(np.unique(y).tolist())
    if not values <= {0, 1}:
        raise DataError(
            f"labels take the values {sorted(values)[:10]}; pass binary labels, 0 or 1 "
            "(or False/True), with 1 for the positive class"
        )
    pos = y.astype(bool)
    n1 = int(pos.sum())
    n0 = int(pos.size - n1)
    if n1 == 0 or n0 == 0:
        raise DataError(f"labels hold {n1} positive(s) and {n0} negative(s); the AUC needs at least one of each")
    ranks = rankdata(s, method="average")
    u = float(ranks[pos].sum()) - n1 * (n1 + 1) / 2.0
    return u / (n1 * n0)


def _unit(name: str, v: Any) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError) as exc:
        raise DataError(f"{name} is {v!r}; pass a number in [0, 1]") from exc
    if not (math.isfinite(f) and 0.0 <= f <= 1.0):
        raise DataError(f"{name} is {v!r}; pass a share in [0, 1] (a recovery rate or an AUC, not a percentage)")
    return f


def leakage_index(a_vmi: float, a_control: float, aucs: Iterable[float] = ()) -> float:
    """``max(0, a_vmi - a_control, max_j 2 |aucs[j] - 0.5|)``; empty ``aucs`` drop that term.

    ``a_vmi`` and ``a_control`` are token-recovery shares of the VMI attack and the majority
    control; every input must be a share in [0, 1] (DataError otherwise).
    """
    a = _unit("a_vmi", a_vmi)
    c = _unit("a_control", a_control)
    terms = [0.0, a - c]
    terms += [2.0 * abs(_unit(f"aucs[{j}]", v) - 0.5) for j, v in enumerate(aucs)]
    return max(terms)
