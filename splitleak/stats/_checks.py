"""Input checks shared by the statistics helpers; each failure names the problem and the fix."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from splitleak.errors import ConfigError, DataError


def check_alpha(alpha: Any, name: str = "alpha") -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0.0 < float(alpha) < 1.0:
        raise ConfigError(f"{name} is {alpha!r}; pass a number strictly between 0 and 1 (e.g. 0.05)")
    return float(alpha)


def check_count(value: Any, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < minimum:
        raise ConfigError(f"{name} is {value!r}; pass an integer >= {minimum}")
    return int(value)


def make_rng(seed: Any) -> np.random.Generator:
    if isinstance(seed, np.random.Generator):
        return seed
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or int(seed) < 0:
        raise ConfigError(f"seed is {seed!r}; pass a non-negative integer or a numpy.random.Generator")
    return np.random.default_rng(int(seed))


def finite_array(x: Any, name: str, ndim: int | None = None) -> np.ndarray:
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise DataError(f"{name} could not be read as numbers ({exc}); pass a numeric array") from None
    if ndim is not None and a.ndim != ndim:
        shape_word = {1: "a 1-D sequence", 2: "a 2-D (models x documents) matrix"}.get(ndim, f"{ndim}-D")
        raise DataError(f"{name} has shape {a.shape}; pass {shape_word}")
    if a.size == 0:
        raise DataError(f"{name} is empty; pass at least one value")
    bad = ~np.isfinite(a)
    if bad.any():
        raise DataError(f"{name} holds {int(bad.sum())} NaN or infinite value(s); pass finite values")
    return a


def percentile_bounds(replicates: np.ndarray, alpha: float) -> tuple[float, float]:
    lo, hi = np.quantile(replicates, [alpha / 2.0, 1.0 - alpha / 2.0])
    return float(lo), float(hi)
