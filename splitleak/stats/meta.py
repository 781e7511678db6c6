"""DerSimonian-Laird random-effects pooling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.stats import norm

from splitleak.errors import DataError
from splitleak.stats._checks import check_alpha, finite_array


@dataclass(frozen=True)
class RandomEffects:
    """Pooled estimate with its normal interval, between-study sd ``tau`` (``tau2`` its
    square), heterogeneity ``i2`` (0..1) and Cochran's ``q``."""

    estimate: float
    low: float
    high: float
    tau: float
    tau2: float
    i2: float
    q: float


def random_effects(estimates: Any, variances: Any, alpha: float = 0.05) -> RandomEffects:
    """DerSimonian-Laird random-effects mean of per-study ``estimates`` with within-study
    ``variances``; interval at level 1 - alpha (default 95 %) from the normal z."""
    alpha = check_alpha(alpha)
    y = finite_array(estimates, "estimates", ndim=1)
    v = finite_array(variances, "variances", ndim=1)
    if y.shape != v.shape:
        raise DataError(f"estimates have {y.size} values and variances {v.size}; pass one variance per estimate")
    if y.size < 2:
        raise DataError("random_effects needs at least 2 estimates; pass two or more studies")
    if (v <= 0).any():
        raise DataError("variances hold values <= 0; pass strictly positive within-study variances")
    w = 1.0 / v
    fixed = float((w * y).sum() / w.sum())
    q = float((w * (y - fixed) ** 2).sum())
    df = y.size - 1
    c = float(w.sum() - (w**2).sum() / w.sum())
    tau2 = max(0.0, (q - df) / c)
    ws = 1.0 / (v + tau2)
    est = float((ws * y).sum() / ws.sum())
    se = float(np.sqrt(1.0 / ws.sum()))
    z = float(norm.ppf(1 - alpha / 2))
    i2 = max(0.0, (q - df) / q) if q > 0 else 0.0
    return RandomEffects(est, est - z * se, est + z * se, float(np.sqrt(tau2)), tau2, i2, q)


def leave_one_out(estimates: Any, variances: Any, alpha: float = 0.05) -> list[RandomEffects]:
    """``random_effects`` with each study left out in turn (tau2 re-estimated each time): how much the
    pooled figure rests on any one seed. Needs at least 3 studies."""
    y = finite_array(estimates, "estimates", ndim=1)
    v = finite_array(variances, "variances", ndim=1)
    if y.size < 3:
        raise DataError("leave_one_out needs at least 3 estimates (2 remain in each pooling)")
    if y.shape != v.shape:
        raise DataError(f"estimates have {y.size} values and variances {v.size}; pass one variance per estimate")
    keep = ~np.eye(y.size, dtype=bool)
    return [random_effects(y[k], v[k], alpha) for k in keep]
