"""Gradient masking, the label-shielded baselines of Gradient Mirage (003) that zero coordinates of the output
gradient g_t the client returns (``backward-wire``): ``grad-prune`` and ``grad-dropout``. The attack built for
them is the label-shielded family's (``splitleak.defences.mirage.LabelDefence``)."""

from __future__ import annotations

import torch

from splitleak.defences.base import check_number, register
from splitleak.defences.mirage import GRADIENT_MODES, LabelDefence, noted_gradient


@register
class GradientPruning(LabelDefence):
    """``grad-prune``: per document, zero the ``ratio`` share of g_t's coordinates smallest in magnitude
    (per document is ours)."""

    name = "grad-prune"
    split_modes = GRADIENT_MODES

    def __init__(self, ratio: float = 0.9):
        self.ratio = check_number(
            "grad-prune", "ratio", ratio, 0.0, 1.0, hi_open=True, why=" (1 would send nothing: use top-only training)"
        )

    def args(self):
        return {"ratio": self.ratio}

    def roles(self):
        return ("backward-wire",)

    def top_gradient(self, g, ctx):
        flat = g.reshape(g.shape[0], -1)
        k = int(round(self.ratio * flat.shape[1]))
        if k == 0:
            return g
        idx = flat.abs().argsort(dim=1, stable=True)[:, :k]
        return flat.scatter(1, idx, 0.0).view_as(g)

    def declare(self, channels):
        return noted_gradient(channels, f"after grad-prune: the {self.ratio:g} share of smallest coordinates zeroed")


@register
class GradientDropout(LabelDefence):
    """``grad-dropout``: each coordinate of g_t zeroed with probability ``p``, not rescaled (ours)."""

    name = "grad-dropout"
    split_modes = GRADIENT_MODES

    def __init__(self, p: float = 0.5):
        self.p = check_number(
            "grad-dropout", "p", p, 0.0, 1.0, hi_open=True, why=" (1 would send nothing: use top-only training)"
        )

    def args(self):
        return {"p": self.p}

    def roles(self):
        return ("backward-wire",)

    def top_gradient(self, g, ctx):
        out = g.clone()
        for i, doc_id in enumerate(ctx.doc_ids):
            drop = torch.rand(g[i].shape, generator=ctx.generator("grad-dropout", doc_id)) < self.p
            out[i][drop.to(g.device)] = 0.0
        return out

    def declare(self, channels):
        return noted_gradient(channels, f"after grad-dropout: each coordinate zeroed with probability {self.p:g}")
