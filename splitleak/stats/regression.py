"""Partial R^2 of a start-position factor beyond length (What Gradients Add §5), with a restricted
permutation p-value and a seed-level bootstrap interval."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from splitleak.errors import ConfigError, DataError
from splitleak.stats._checks import check_alpha, check_count, finite_array, make_rng

_CHUNK_ELEMENTS = 4_000_000


@dataclass(frozen=True)
class PartialR2:
    """Partial R^2 of C(start) within C(length), its permutation p-value and the
    seed-bootstrap percentile interval [low, high]."""

    partial_r2: float
    p_value: float
    low: float
    high: float


def _codes(x: Any, name: str, n: int) -> tuple[np.ndarray, int]:
    a = np.asarray(x)
    if a.ndim != 1 or a.size != n:
        raise DataError(f"{name} has shape {a.shape}; pass a 1-D sequence with one label per row ({n})")
    if a.dtype.kind == "f" and not np.isfinite(a).all():
        raise DataError(f"{name} holds NaN or infinite labels; pass finite category labels")
    uniq, inv = np.unique(a, return_inverse=True)
    return inv.reshape(-1).astype(np.int64), int(uniq.size)


def permute_within_groups(labels: Any, groups: Any, n_perm: int = 1, seed: Any = 0) -> np.ndarray:
    """``n_perm`` shuffles of ``labels`` (rows of the returned (n_perm, n) array), each a
    uniform random permutation within every group of ``groups`` and never across groups."""
    lab = np.asarray(labels)
    if lab.ndim != 1:
        raise DataError(f"labels have shape {lab.shape}; pass a 1-D sequence")
    g, _ = _codes(groups, "groups", lab.size)
    n_perm = check_count(n_perm, "n_perm")
    rng = make_rng(seed)
    return lab[_within_group_index(g, n_perm, rng)]


def _within_group_index(g: np.ndarray, b: int, rng: np.random.Generator) -> np.ndarray:
    """(b, n) indices: row r maps position i to a random position of the same group."""
    n = g.size
    by_group = np.argsort(g, kind="stable")
    keys = g[None, :] + rng.random((b, n))  # sorts by group, then at random within group
    order = np.argsort(keys, axis=1)
    idx = np.empty((b, n), dtype=np.int64)
    idx[:, by_group] = order
    return idx


def _rss(y: np.ndarray, codes: np.ndarray, ncells: int, weights: np.ndarray | None) -> np.ndarray:
    """Residual sum of squares of cell-mean fits, one per row of ``codes`` (b, n).

    With row weights (duplicated rows), RSS = sum w y^2 - sum_cells (sum w y)^2 / sum w."""
    b, n = codes.shape
    flat = (codes + ncells * np.arange(b)[:, None]).ravel()
    w = np.ones((b, n)) if weights is None else weights
    sw = np.bincount(flat, weights=w.ravel(), minlength=b * ncells).reshape(b, ncells)
    swy = np.bincount(flat, weights=(w * y).ravel(), minlength=b * ncells).reshape(b, ncells)
    with np.errstate(invalid="ignore", divide="ignore"):
        between = np.where(sw > 0, swy**2 / np.where(sw > 0, sw, 1.0), 0.0).sum(axis=1)
    return (w * y**2).sum(axis=1) - between


def _cell_rss(y: np.ndarray, codes: np.ndarray, ncells: int) -> float:
    counts = np.bincount(codes, minlength=ncells)
    means = np.bincount(codes, weights=y, minlength=ncells) / np.maximum(counts, 1)
    return float(((y - means[codes]) ** 2).sum())


def partial_r2_test(
    outcome: Any,
    length: Any,
    start: Any,
    seed_ids: Any,
    n_perm: int = 10_000,
    seed: Any = 0,
    alpha_boot: float = 0.0125,
    n_boot: int = 10_000,
) -> PartialR2:
    """Partial R^2 of ``outcome ~ C(length) x C(start)`` over ``outcome ~ C(length)``.

    partial R^2 = (RSS_reduced - RSS_full) / RSS_reduced, both fits ordinary least squares
    on one-hot categories (the full fit is the cell mean of every (length, start) pair).
    p-value: ``start`` shuffled within each (seed, length) group ``n_perm`` times,
    p = (1 + #{perm >= observed}) / (1 + n_perm). Interval: percentile bootstrap over seeds
    (seed ids drawn with replacement, all rows of a drawn seed kept) at level 1 - alpha_boot
    (98.75 % by default)."""
    y = finite_array(outcome, "outcome", ndim=1)
    n = y.size
    lc, nl = _codes(length, "length", n)
    sc, ns = _codes(start, "start", n)
    kc, nk = _codes(seed_ids, "seed_ids", n)
    n_perm = check_count(n_perm, "n_perm")
    n_boot = check_count(n_boot, "n_boot")
    alpha_boot = check_alpha(alpha_boot, "alpha_boot")
    rng = make_rng(seed)
    y = y - y.mean()  # invariant for both fits; reduces cancellation in the sum formulas
    full_cells = nl * ns

    rss_r = _cell_rss(y, lc, nl)
    if rss_r <= 1e-12 * max(1.0, float((y**2).sum())):
        raise DataError(
            "outcome is constant within every length; the partial R^2 is undefined. Pass "
            "outcomes that vary within length categories"
        )
    rss_f = _cell_rss(y, lc * ns + sc, full_cells)
    observed = (rss_r - rss_f) / rss_r

    # Permutation: RSS_reduced is unchanged by shuffling start, so compare RSS_full.
    groups = kc * nl + lc
    obs_rss_f = _rss(y, (lc * ns + sc)[None, :], full_cells, None)[0]
    tol = 1e-10 * rss_r
    hits = 0
    chunk = max(1, _CHUNK_ELEMENTS // n)
    for s0 in range(0, n_perm, chunk):
        b = min(chunk, n_perm - s0)
        perm_start = sc[_within_group_index(groups, b, rng)]
        rss_perm = _rss(y, lc[None, :] * ns + perm_start, full_cells, None)
        hits += int((rss_perm <= obs_rss_f + tol).sum())
    p_value = (1 + hits) / (1 + n_perm)

    # Bootstrap over seeds: a seed drawn c times enters with weight c on each of its rows.
    reps = np.empty(n_boot)
    full_codes = (lc * ns + sc)[None, :]
    for s0 in range(0, n_boot, chunk):
        b = min(chunk, n_boot - s0)
        counts = rng.multinomial(nk, np.full(nk, 1.0 / nk), size=b).astype(np.float64)
        w = counts[:, kc]
        yb = y[None, :]
        r_red = _rss(yb, np.broadcast_to(lc, (b, n)), nl, w)
        r_full = _rss(yb, np.broadcast_to(full_codes, (b, n)), full_cells, w)
        with np.errstate(invalid="ignore", divide="ignore"):
            reps[s0 : s0 + b] = np.where(r_red > tol, (r_red - r_full) / r_red, np.nan)
    if np.isnan(reps).all():
        raise DataError("every seed-bootstrap replicate had no variation within length; pass more seeds")
    low, high = np.nanquantile(reps, [alpha_boot / 2, 1 - alpha_boot / 2])
    return PartialR2(float(observed), float(p_value), float(low), float(high))


@dataclass(frozen=True)
class HeldoutRMSE:
    """Held-out-seed check of What Gradients Add §5: RMSE on held-out seeds of a length-only linear fit and of
    the fit with the start and its interaction added; ``passes`` when the second is lower by at
    least ``required`` (a share: 0.10 = 10 %)."""

    rmse_length: float
    rmse_with_start: float
    reduction: float
    required: float
    passes: bool
    n_train: int
    n_test: int


def _design(
    length: np.ndarray, start: np.ndarray | None, mean: np.ndarray | None = None, scale: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    cols = [length] if start is None else [length, start, length * start]
    x = np.stack(cols, axis=1).astype(np.float64)
    if mean is None:
        mean, scale = x.mean(0), x.std(0)
        scale = np.where(scale > 0, scale, 1.0)
    assert scale is not None  # a caller that passes the training mean passes its scale too
    return (x - mean) / scale, mean, scale


def _ridge_predict(x_tr: np.ndarray, y_tr: np.ndarray, x_te: np.ndarray, lam: float) -> np.ndarray:
    """Ridge with an unpenalised intercept on standardised columns (closed form)."""
    ym = y_tr.mean()
    coef = np.linalg.solve(x_tr.T @ x_tr + lam * np.eye(x_tr.shape[1]), x_tr.T @ (y_tr - ym))
    return x_te @ coef + ym


def heldout_rmse(
    outcome: Any,
    length: Any,
    start: Any,
    seed_ids: Any,
    test_seeds: Any,
    required: float = 0.10,
    ridge: float = 1e-3,
) -> HeldoutRMSE:
    """Fit ridge models on the rows whose seed is not in ``test_seeds`` and report their RMSE on
    the rows whose seed is (What Gradients Add §5: seeds 11-66 train, 77 and 88 test).

    The length-only predictor is linear in the length s; the full one adds the start b and the
    product s*b. Columns are standardised on the training rows; ``ridge`` is the penalty on the
    standardised coefficients (the intercept is not penalised), small by default so the fit is
    essentially least squares but stays defined when a column is constant."""
    y = finite_array(outcome, "outcome", ndim=1)
    s = finite_array(length, "length", ndim=1)
    b = finite_array(start, "start", ndim=1)
    seeds = np.asarray(seed_ids)
    if not (y.size == s.size == b.size == seeds.size):
        raise DataError(
            f"outcome, length, start and seed_ids have {y.size}, {s.size}, {b.size} and {seeds.size} rows; "
            "pass one value per row in each"
        )
    test = np.isin(seeds, np.asarray(list(test_seeds)))
    if test.sum() == 0 or (~test).sum() < 4:
        raise DataError(
            f"{int(test.sum())} held-out and {int((~test).sum())} training rows; name held-out seeds that occur "
            "in seed_ids and keep at least 4 training rows"
        )
    if not 0 <= float(required) < 1:
        raise ConfigError(f"required is {required!r}; pass a share in [0, 1), e.g. 0.10")
    rm = []
    for with_start in (False, True):
        x_tr, mu, sd = _design(s[~test], b[~test] if with_start else None)
        x_te, _, _ = _design(s[test], b[test] if with_start else None, mu, sd)
        pred = _ridge_predict(x_tr, y[~test], x_te, float(ridge))
        rm.append(float(np.sqrt(np.mean((y[test] - pred) ** 2))))
    reduction = (rm[0] - rm[1]) / rm[0] if rm[0] > 0 else 0.0
    return HeldoutRMSE(
        rm[0],
        rm[1],
        float(reduction),
        float(required),
        bool(reduction >= required),
        int((~test).sum()),
        int(test.sum()),
    )
