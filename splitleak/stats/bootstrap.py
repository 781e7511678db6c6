"""Crossed (models x documents) and hierarchical (seeds x frames) bootstrap intervals."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from splitleak.errors import DataError
from splitleak.stats._checks import (
    check_alpha,
    check_count,
    finite_array,
    make_rng,
    percentile_bounds,
)

# Floats held at once per chunk of replicates (about 32 MB of float64).
_CHUNK_ELEMENTS = 4_000_000


@dataclass(frozen=True)
class Interval:
    """A point estimate with a two-sided interval [low, high] at level 1 - alpha.

    ``n_boot`` is the number of bootstrap replicates (0 for closed-form intervals)."""

    estimate: float
    low: float
    high: float
    n_boot: int
    alpha: float


def crossed_replicates(scores: Any, n_boot: int, seed: Any = 0) -> np.ndarray:
    """The ``n_boot`` crossed-bootstrap replicate means of a (models x documents) matrix.

    Models and documents are resampled with replacement as two independent axes; every
    drawn document stays paired with every drawn model. A replicate is
    ``w^T S v / (sum(w) * sum(v))`` with ``w``, ``v`` multinomial counts over models and
    documents. Computed by batched matrix products, in chunks to bound memory."""
    s = finite_array(scores, "scores", ndim=2)
    n_boot = check_count(n_boot, "n_boot")
    rng = make_rng(seed)
    m, d = s.shape
    pm = np.full(m, 1.0 / m)
    pd = np.full(d, 1.0 / d)
    chunk = max(1, _CHUNK_ELEMENTS // max(m, d))
    out = np.empty(n_boot, dtype=np.float64)
    for start in range(0, n_boot, chunk):
        b = min(chunk, n_boot - start)
        w = rng.multinomial(m, pm, size=b).astype(np.float64)  # (b, m)
        v = rng.multinomial(d, pd, size=b).astype(np.float64)  # (b, d)
        ws = w @ s  # (b, d)
        out[start : start + b] = np.einsum("bd,bd->b", ws, v) / (m * d)
    return out


def crossed_bootstrap_ci(scores: Any, n_boot: int = 100_000, alpha: float = 0.05, seed: Any = 0) -> Interval:
    """Percentile crossed-bootstrap interval for the mean of a (models x documents) matrix.

    ``scores[i, j]`` is model i's score on document j (already averaged over attack seeds).
    The estimate is the plain mean; the interval is the alpha/2 and 1 - alpha/2 quantiles
    of ``n_boot`` crossed-bootstrap replicates (see :func:`crossed_replicates`)."""
    alpha = check_alpha(alpha)
    s = finite_array(scores, "scores", ndim=2)
    reps = crossed_replicates(s, n_boot, seed)
    low, high = percentile_bounds(reps, alpha)
    return Interval(float(s.mean()), low, high, int(n_boot), alpha)


def paired_difference_ci(a: Any, b: Any, n_boot: int = 100_000, alpha: float = 0.05, seed: Any = 0) -> Interval:
    """Crossed-bootstrap interval for mean(a) - mean(b), two (models x documents) matrices
    of equal shape scored on the same models and documents (the pairing is kept)."""
    x = finite_array(a, "a", ndim=2)
    y = finite_array(b, "b", ndim=2)
    if x.shape != y.shape:
        raise DataError(
            f"a has shape {x.shape} and b {y.shape}; pass two matrices of the same "
            "(models x documents) shape, paired cell by cell"
        )
    return crossed_bootstrap_ci(x - y, n_boot=n_boot, alpha=alpha, seed=seed)


def paired_ratio_ci(a: Any, b: Any, n_boot: int = 100_000, alpha: float = 0.05, seed: Any = 0) -> Interval:
    """Crossed-bootstrap interval for mean(a) / mean(b), two (models x documents) matrices paired cell by cell:
    each replicate draws the same models and documents for both (one seed, one shape, the same draws). A
    replicate whose denominator is 0 (it drew only documents b reads 0 on) is left out."""
    alpha = check_alpha(alpha)
    x = finite_array(a, "a", ndim=2)
    y = finite_array(b, "b", ndim=2)
    if x.shape != y.shape:
        raise DataError(f"a has shape {x.shape} and b {y.shape}; pass two matrices paired cell by cell")
    if y.mean() == 0:
        raise DataError("b's mean is 0: the ratio is undefined (the control read nothing)")
    with np.errstate(invalid="ignore", divide="ignore"):
        reps = crossed_replicates(x, n_boot, seed) / crossed_replicates(y, n_boot, seed)
    reps = reps[np.isfinite(reps)]
    low, high = percentile_bounds(reps, alpha)
    return Interval(float(x.mean() / y.mean()), low, high, int(n_boot), alpha)


def hierarchical_replicates(values_by_seed: Sequence[Any], n_boot: int, seed: Any = 0) -> np.ndarray:
    """Replicates of the mean over seeds of per-seed frame means, seeds resampled (outer)
    and then frames resampled within each drawn seed (inner, independently per copy).

    A seed drawn c times contributes the sum of c independent frame-resample means; the
    sum of c independent multinomial(n, uniform) count vectors is multinomial(c*n,
    uniform), so each seed needs one multinomial draw per replicate."""
    n_boot = check_count(n_boot, "n_boot")
    rng = make_rng(seed)
    groups = _seed_groups(values_by_seed)
    k = len(groups)
    out = np.empty(n_boot, dtype=np.float64)
    largest = max(g.size for g in groups)
    chunk = max(1, _CHUNK_ELEMENTS // largest)
    for start in range(0, n_boot, chunk):
        b = min(chunk, n_boot - start)
        copies = rng.multinomial(k, np.full(k, 1.0 / k), size=b)  # (b, k)
        total = np.zeros(b)
        for j, x in enumerate(groups):
            n = x.size
            counts = rng.multinomial(copies[:, j] * n, np.full(n, 1.0 / n))  # (b, n)
            total += counts @ x / n
        out[start : start + b] = total / k
    return out


def hierarchical_bootstrap_ci(
    values_by_seed: Sequence[Any], n_boot: int = 10_000, alpha: float = 0.05, seed: Any = 0
) -> Interval:
    """Two-level percentile bootstrap: seeds outer, frames inner.

    ``values_by_seed`` is one 1-D array of per-frame values per seed. The estimate is the
    mean over seeds of the per-seed mean."""
    alpha = check_alpha(alpha)
    groups = _seed_groups(values_by_seed)
    reps = hierarchical_replicates(groups, n_boot, seed)
    low, high = percentile_bounds(reps, alpha)
    estimate = float(np.mean([g.mean() for g in groups]))
    return Interval(estimate, low, high, int(n_boot), alpha)


def _seed_groups(values_by_seed: Sequence[Any]) -> list[np.ndarray]:
    if isinstance(values_by_seed, np.ndarray) and values_by_seed.ndim == 1:
        raise DataError("values_by_seed is a single 1-D array; pass a list with one 1-D array of frame values per seed")
    groups = [finite_array(v, f"values_by_seed[{i}]", ndim=1) for i, v in enumerate(values_by_seed)]
    if not groups:
        raise DataError("values_by_seed is empty; pass one array of frame values per seed")
    return groups


def frame_weights(n_frames: int, n_boot: int, seed: Any = 0) -> np.ndarray:
    """``(n_boot, n_frames)`` multinomial resampling counts: row b says how often each frame is
    drawn in replicate b. Sharing one weight matrix between statistics keeps them paired."""
    n = check_count(n_frames, "n_frames")
    b = check_count(n_boot, "n_boot")
    rng = make_rng(seed)
    return rng.multinomial(n, np.full(n, 1.0 / n), size=b).astype(np.float64)


def ratio_bootstrap_ci(
    numerators: Any,
    denominators: Any,
    n_boot: int = 10_000,
    alpha: float = 0.05,
    seed: Any = 0,
    weights: np.ndarray | None = None,
) -> Interval:
    """Frame-clustered percentile interval for a ratio of sums, sum(num) / sum(den).

    Frames (e.g. documents) are resampled with replacement; a frame's numerator and
    denominator move together. The rate of correct tokens over counted tokens is the usual use.
    ``numerators`` may be 2-D (statistics x frames): the result is then the interval of the
    first row minus the second (a paired difference on the same resampled frames)."""
    alpha = check_alpha(alpha)
    num = finite_array(numerators, "numerators")
    den = finite_array(denominators, "denominators")
    if num.shape != den.shape or num.ndim not in (1, 2) or (num.ndim == 2 and num.shape[0] != 2):
        raise DataError(
            f"numerators {num.shape} and denominators {den.shape}: pass two equal 1-D arrays (one value "
            "per frame), or two (2 x frames) arrays for a paired difference"
        )
    if (den.sum(axis=-1) <= 0).any():
        raise DataError("the denominators sum to zero; there is nothing to take a rate of")
    w = frame_weights(num.shape[-1], n_boot, seed) if weights is None else weights
    if w.shape[1] != num.shape[-1]:
        raise DataError(f"weights cover {w.shape[1]} frames but the data has {num.shape[-1]}")
    with np.errstate(invalid="ignore", divide="ignore"):
        if num.ndim == 1:
            est = num.sum() / den.sum()
            reps = (w @ num) / (w @ den)
        else:
            est = num[0].sum() / den[0].sum() - num[1].sum() / den[1].sum()
            reps = (w @ num[0]) / (w @ den[0]) - (w @ num[1]) / (w @ den[1])
    reps = reps[np.isfinite(reps)]  # a replicate that drew only zero-denominator frames
    if reps.size == 0:
        raise DataError("no bootstrap replicate had a non-zero denominator; pass more frames")
    low, high = percentile_bounds(reps, alpha)
    return Interval(float(est), low, high, int(w.shape[0]), alpha)
