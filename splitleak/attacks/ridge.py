"""Closed-form ridge maps and cosine candidate lists.

``RidgeMap.fit(X, Y)`` centres both sides and solves ridge through one SVD of X; the penalty λ is
the one on a log grid (relative to the largest squared singular value) with the smallest
leave-one-out mean squared error, computed exactly from the hat matrix: r_loo = r / (1 − h_ii).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitleak.errors import DataError

LAMBDA_GRID = torch.logspace(-9, 1, 31, dtype=torch.float64)


@dataclass
class RidgeMap:
    weight: torch.Tensor  # [d_in, d_out]
    x_mean: torch.Tensor
    y_mean: torch.Tensor
    lam: float
    loo_mse: float

    @classmethod
    def fit(cls, x: torch.Tensor, y: torch.Tensor, grid: torch.Tensor = LAMBDA_GRID) -> "RidgeMap":
        if x.shape[0] != y.shape[0] or x.shape[0] < 3:
            raise DataError(f"ridge fit needs matching rows (>= 3); got {x.shape[0]} inputs and {y.shape[0]} targets")
        if not (torch.isfinite(x).all() and torch.isfinite(y).all()):
            raise DataError("ridge fit: NaN or Inf in the inputs or targets; check the capture with `splitleak verify`")
        dtype = x.dtype
        x64, y64 = x.double(), y.double()
        xm, ym = x64.mean(0), y64.mean(0)
        xc, yc = x64 - xm, y64 - ym
        u, s, vh = torch.linalg.svd(xc, full_matrices=False)
        uty = u.T @ yc  # [r, d_out]
        s2 = s**2
        best: tuple[float, float] | None = None  # (leave-one-out MSE, lambda)
        n = x.shape[0]
        for rel in grid:
            lam = float(rel * s2.max())
            shrink = s2 / (s2 + lam)  # [r]
            fitted = u @ (shrink[:, None] * uty)
            h = (u**2 @ shrink) + 1.0 / n  # diagonal of the hat matrix, with the intercept
            resid = (yc - fitted) / (1.0 - h).clamp_min(1e-12)[:, None]
            mse = float(resid.pow(2).mean())
            if best is None or mse < best[0]:
                best = (mse, lam)
        assert best is not None  # the grid is not empty
        mse, lam = best
        w = vh.T @ ((s / (s2 + lam))[:, None] * uty)
        return cls(w.to(dtype), xm.to(dtype), ym.to(dtype), lam, mse)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.x_mean) @ self.weight + self.y_mean


def cosine_scores(queries: torch.Tensor, embedding: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Cosine similarity of each query row with each embedding row: [m, d] x [V, d] -> [m, V]."""
    e = torch.nn.functional.normalize(embedding, dim=-1)
    q = torch.nn.functional.normalize(queries.to(e.dtype), dim=-1)
    return torch.cat([q[s : s + chunk] @ e.T for s in range(0, q.shape[0], chunk)])


def cosine_topk(queries: torch.Tensor, embedding: torch.Tensor, k: int, chunk: int = 2048) -> torch.Tensor:
    """Indices of the k most cosine-similar embedding rows for each query, best first: [..., d] -> [..., k]."""
    shape = queries.shape[:-1]
    flat = queries.reshape(-1, queries.shape[-1])
    e = torch.nn.functional.normalize(embedding, dim=-1)
    out = []
    for s in range(0, flat.shape[0], chunk):
        q = torch.nn.functional.normalize(flat[s : s + chunk].to(e.dtype), dim=-1)
        out.append(torch.topk(q @ e.T, k, dim=-1).indices)
    return torch.cat(out).reshape(*shape, k)
