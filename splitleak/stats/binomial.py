"""Wilson score intervals, the Bonferroni split, the gate statistic G and the verdict words."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from scipy.stats import norm

from splitleak.errors import ConfigError, DataError
from splitleak.stats._checks import check_alpha, check_count
from splitleak.stats.bootstrap import Interval


@dataclass(frozen=True)
class GateResult:
    """Paper Politis & Pappas 2026, Eq. (1): ``G = max_j U^Bonf(p_j) - p_const``.

    ``per_arm_upper`` holds each arm's one-sided Wilson upper bound at ``alpha_bonf``;
    ``breaks`` is ``G > gate``."""

    G: float
    per_arm_upper: tuple[float, ...]
    alpha_bonf: float
    breaks: bool
    gate: float


def bonferroni_alpha(alpha: float, m: int) -> float:
    """Per-test level ``alpha / m`` for a family of ``m`` tests."""
    return check_alpha(alpha) / check_count(m, "m")


def passes_lower_bound(interval: Interval, mark: float) -> bool:
    """True when the interval's lower end lies strictly above ``mark``."""
    if not isinstance(mark, numbers.Real) or not math.isfinite(float(mark)):
        raise ConfigError(f"mark is {mark!r}; pass a finite number")
    return bool(interval.low > float(mark))


def _check_binomial(successes: Any, n: Any) -> tuple[int, int]:
    for name, v in (("successes", successes), ("n", n)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise DataError(f"{name} is {v!r}; pass a whole-number count")
    k, n = int(successes), int(n)
    if n < 1:
        raise DataError(f"n is {n}; pass the number of trials, at least 1")
    if not 0 <= k <= n:
        raise DataError(f"successes is {k} with n = {n}; pass a count between 0 and n")
    return k, n


def _wilson(k: int, n: int, z: float) -> tuple[float, float]:
    p = k / n
    z2 = z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def wilson_interval(successes: int, n: int, alpha: float = 0.05) -> Interval:
    """Two-sided Wilson score interval at level 1 - alpha; estimate = successes / n."""
    alpha = check_alpha(alpha)
    k, n = _check_binomial(successes, n)
    low, high = _wilson(k, n, float(norm.ppf(1 - alpha / 2)))
    return Interval(k / n, low, high, 0, alpha)


def wilson_upper(successes: int, n: int, alpha: float = 0.05) -> float:
    """One-sided Wilson upper bound, z = Phi^-1(1 - alpha) (alpha = 0.05: "Wilson upper-95")."""
    alpha = check_alpha(alpha)
    k, n = _check_binomial(successes, n)
    return _wilson(k, n, float(norm.ppf(1 - alpha)))[1]


def gate_statistic(
    arm_successes: Sequence[int],
    n: int | Sequence[int],
    constant_rate: float,
    alpha: float,
    gate: float,
) -> GateResult:
    """G = max over the J arms of the one-sided Wilson upper bound at alpha / J, minus the
    constant-predictor rate; ``breaks`` when G > gate (0.01 = +1.0 percentage point).

    ``n`` is the common number of tokens, or one count per arm. ``alpha`` and ``gate`` have no
    default: they come from the protocol the result is checked against (``splitleak.audit.gate``)."""
    alpha = check_alpha(alpha)
    ks = list(np.atleast_1d(np.asarray(arm_successes, dtype=object)))
    if len(ks) == 0:
        raise DataError("arm_successes is empty; pass one success count per arm")
    ns = list(np.atleast_1d(np.asarray(n, dtype=object)))
    if len(ns) == 1:
        ns = ns * len(ks)
    if len(ns) != len(ks):
        raise DataError(f"n holds {len(ns)} counts for {len(ks)} arms; pass one common n or one per arm")
    if (
        isinstance(constant_rate, bool)
        or not isinstance(constant_rate, numbers.Real)
        or not 0.0 <= float(constant_rate) <= 1.0
    ):
        raise ConfigError(f"constant_rate is {constant_rate!r}; pass a rate between 0 and 1")
    if not isinstance(gate, numbers.Real) or not math.isfinite(float(gate)):
        raise ConfigError(f"gate is {gate!r}; pass a finite number (0.01 = 1 percentage point)")
    alpha_bonf = alpha / len(ks)
    uppers = tuple(wilson_upper(k, nj, alpha_bonf) for k, nj in zip(ks, ns))
    g = max(uppers) - float(constant_rate)
    return GateResult(float(g), uppers, alpha_bonf, bool(g > float(gate)), float(gate))


def effect_verdict(interval: Interval) -> str:
    """Paper Politis & Pappas 2026, §3: "detected" when the interval's lower end is above 0, "at floor" when the
    interval includes 0. An interval wholly below 0 reads "below floor" (an arm that does worse
    than its baseline; Politis & Pappas 2026 have no word for it, and it is not a detection)."""
    if interval.low > 0:
        return "detected"
    return "below floor" if interval.high < 0 else "at floor"


def gate_verdict(result: GateResult) -> str:
    """ "breaks the gate" when ``result.breaks``, else "holds the gate"."""
    return "breaks the gate" if result.breaks else "holds the gate"
