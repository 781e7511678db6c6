"""How much of a gradient survives a privatization (Gradient Mirage, 003): per document, with g the raw
gradient, r the released one and n = r − g the noise it added,

- ``asnr``: ‖g‖ / ‖n‖ over the whole document (every row and coordinate);
- ``asnr@10``: the same over the top 10 % coordinates of |g| (the ones an update leans on);
- ``recall@10``: the share of g's top 10 % coordinates by magnitude that are also r's top 10 %;
- ``jaccard@10``: |top(g) ∩ top(r)| / |top(g) ∪ top(r)| over those sets.

The 10 % share is a parameter (``share``); the top set of a document has ceil(share · size) coordinates.
The restriction of ASNR to the top set and the tie rule (``torch.topk``'s order) are ours.
"""

from __future__ import annotations

import math

import torch


def _top(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(x.abs(), k).indices


def gradient_utility(raw: torch.Tensor, released: torch.Tensor, share: float = 0.10) -> list[dict[str, float]]:
    """One dict per document (the first dimension) with ``asnr``, ``asnr@P``, ``recall@P``, ``jaccard@P``
    (P = 100 · share). A document whose released gradient equals the raw one has infinite ASNR."""
    if raw.shape != released.shape:
        raise ValueError(f"raw gradient {tuple(raw.shape)} and released {tuple(released.shape)} differ in shape")
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share}")
    tag = f"{100 * share:g}"
    out = []
    for g, r in zip(raw.reshape(raw.shape[0], -1).double(), released.reshape(raw.shape[0], -1).double()):
        n = r - g
        k = max(1, math.ceil(share * g.numel()))
        tg, tr = _top(g, k), _top(r, k)
        inter = len(set(tg.tolist()) & set(tr.tolist()))

        def ratio(a: torch.Tensor, b: torch.Tensor) -> float:
            nb = float(b.norm())
            return float(a.norm()) / nb if nb > 0 else math.inf

        out.append(
            {
                "asnr": ratio(g, n),
                f"asnr@{tag}": ratio(g[tg], n[tg]),
                f"recall@{tag}": inter / k,
                f"jaccard@{tag}": inter / (2 * k - inter),
            }
        )
    return out
