"""The power of a paired test on per-unit differences: what a run could detect, and what would resolve an effect.

The test is the one-sample t-test of the mean of ``n`` paired differences (per document, averaged over the
other factors) against zero, at level ``alpha``, two-sided: the statistic follows a noncentral t with ``n − 1``
degrees of freedom and noncentrality ``effect / sd · √n``. These are the definitions of statsmodels'
``TTestPower`` (tests/test_power.py checks the numbers against it); scipy's noncentral t computes them here, so
that the package does not depend on statsmodels and pandas for three formulas.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy import optimize, stats

from splitleak.stats._checks import check_alpha

#: the power at which "could detect" is read (the convention of the field: 80 %)
POWER = 0.8


def _check(sd: float, n: float) -> None:
    if not (math.isfinite(sd) and sd > 0):
        raise ValueError(f"the standard deviation of the differences must be finite and > 0, got {sd}")
    if not n >= 2:
        raise ValueError(f"a paired t-test needs at least 2 units, got {n}")


def paired_power(effect: float, sd: float, n: float, alpha: float = 0.05) -> float:
    """The probability that the two-sided paired t-test at ``alpha`` rejects "no difference" when the true mean
    difference is ``effect`` and the differences' standard deviation ``sd``, over ``n`` units."""
    check_alpha(alpha)
    _check(sd, n)
    df = n - 1
    nc = effect / sd * math.sqrt(n)
    crit = stats.t.isf(alpha / 2, df)
    return _upper(crit, df, nc) + _upper(crit, df, -nc)  # P(T > crit) + P(T < -crit) = P(-T > crit)


def _upper(x: float, df: float, nc: float) -> float:
    """P(T > x) for T noncentral t; scipy returns NaN for the far tail of few degrees of freedom (a
    noncentrality far below x), where the probability is below double precision's reach: 0 there."""
    p = float(stats.nct.sf(x, df, nc))
    return 0.0 if math.isnan(p) else p


def detectable_effect(sd: float, n: float, alpha: float = 0.05, power: float = POWER) -> float:
    """The smallest mean difference (in the differences' units) the test detects with probability ``power``."""
    _check(sd, n)
    # the root lies below the effect whose noncentrality is the critical value plus 4 (power > 0.9999 there);
    # a bracket this tight keeps scipy's noncentral t away from the noncentralities where it returns NaN
    lo, hi = 0.0, (stats.t.isf(alpha / 2, n - 1) + 4.0) * sd / math.sqrt(n)
    return float(optimize.brentq(lambda e: paired_power(e, sd, n, alpha) - power, lo, hi, xtol=1e-12 * sd))


def units_needed(effect: float, sd: float, alpha: float = 0.05, power: float = POWER) -> int:
    """The fewest units (at least 2) whose test detects a mean difference ``effect`` with probability ``power``."""
    if effect == 0:
        raise ValueError("no count of units resolves an effect of exactly zero")
    _check(sd, 2)
    enough = lambda n: paired_power(abs(effect), sd, n, alpha) >= power  # noqa: E731
    lo, hi = 1, 2  # lo: too few (or below the minimum); hi: enough, found by doubling
    while not enough(hi):
        lo, hi = hi, hi * 2
        if hi > 2**40:
            raise ValueError("more than 10^12 units would be needed")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return hi


def t_half_width(values: Any, alpha: float = 0.05) -> float:
    """Half the width of Student's t interval at level 1 - ``alpha`` around the mean of ``values`` (the units,
    e.g. one value per victim seed); NaN for fewer than two values, which have no interval."""
    x = np.asarray(values, dtype=float)
    if x.size < 2:
        return math.nan
    return float(stats.t.isf(alpha / 2, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))
