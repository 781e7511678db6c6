"""``vmf``: von Mises–Fisher directional privatization (Gradient Mirage, 003): keep each row's norm, replace its
direction by a draw from vMF(μ = the row's direction, κ).

``sample_vmf`` is a batched torch sampler (Wood 1994: the component along μ by rejection from a
Beta proposal, the rest uniform on the sphere orthogonal to μ) driven by a ``torch.Generator``, so
a wire context seeds it exactly; the Beta(a, a) proposal is drawn as X / (X + Y) with X, Y
chi-squared with 2a = d − 1 degrees of freedom (sums of squared normals), which needs only normals
from the generator. ``vmf_epsilon`` is the metric-DP guarantee the mechanism gives on directions. ``VMFDirection`` is
the defence that applies it, alone (Mirage uses it too, ``splitleak.defences.mirage``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from splitleak.defences.base import Defence, WireContext, check_number, register
from splitleak.errors import ConfigError

#: the most rejection rounds before giving up (Wood's acceptance rate is above 0.5 for every d and κ)
MAX_ROUNDS = 200


def _wood_w(n: int, d: int, kappa: float, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """n draws of w = μᵀx for x ~ vMF(μ, κ) on the sphere in R^d (Wood 1994, steps 0–4), float64."""
    m = d - 1
    b = m / (2.0 * kappa + math.sqrt(4.0 * kappa * kappa + m * m))  # the stable form of Wood's b
    x0 = (1.0 - b) / (1.0 + b)
    c = kappa * x0 + m * math.log(1.0 - x0 * x0)
    out = torch.empty(n, dtype=torch.float64)
    todo = torch.arange(n)
    for _ in range(MAX_ROUNDS):
        k = int(todo.numel())
        if k == 0:
            return out.to(dtype)
        chi = torch.randn(k, 2, m, generator=gen, dtype=torch.float64).pow(2).sum(-1)
        z = chi[:, 0] / chi.sum(-1)  # Beta(m/2, m/2)
        w = (1.0 - (1.0 + b) * z) / (1.0 - (1.0 - b) * z)
        u = torch.rand(k, generator=gen, dtype=torch.float64)
        ok = kappa * w + m * torch.log1p(-x0 * w) - c >= torch.log(u)
        out[todo[ok]] = w[ok]
        todo = todo[~ok]
    raise RuntimeError(f"vMF rejection sampling did not finish in {MAX_ROUNDS} rounds (d={d}, kappa={kappa})")


def sample_vmf(mu: torch.Tensor, kappa: float, gen: torch.Generator) -> torch.Tensor:
    """One unit vector per row of ``mu`` (shape (n, d), rows of unit norm) drawn from vMF(mu_i, kappa).

    The draw is w·μ + √(1 − w²)·v with w from Wood's rejection sampler and v uniform on the unit
    sphere orthogonal to μ. Deterministic given the generator's state; float64 inside."""
    if mu.ndim != 2 or mu.shape[1] < 2:
        raise ValueError(f"sample_vmf takes rows of dimension >= 2 as an (n, d) tensor, got shape {tuple(mu.shape)}")
    check_number("vmf", "kappa", kappa, 0.0, lo_open=True)
    n, d = mu.shape
    m64 = mu.detach().to("cpu", torch.float64)
    w = _wood_w(n, d, float(kappa), gen, torch.float64).unsqueeze(1)
    v = torch.randn(n, d, generator=gen, dtype=torch.float64)
    v = v - (v * m64).sum(-1, keepdim=True) * m64
    v = v / v.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    x = w * m64 + torch.sqrt(torch.clamp(1.0 - w * w, min=0.0)) * v
    return x.to(mu.dtype).to(mu.device)


def privatize_rows(g: torch.Tensor, kappa: float, gen: torch.Generator) -> torch.Tensor:
    """Every row of ``g`` (last dim) keeps its norm and gets a vMF(κ) direction around its own; a zero
    row stays zero (it has no direction to keep or hide)."""
    flat = g.reshape(-1, g.shape[-1])
    norms = flat.norm(dim=-1, keepdim=True)
    nonzero = norms.squeeze(1) > 0
    out = torch.zeros_like(flat)
    if bool(nonzero.any()):
        mu = flat[nonzero] / norms[nonzero]
        out[nonzero] = sample_vmf(mu, kappa, gen) * norms[nonzero]
    return out.reshape(g.shape)


def vmf_epsilon(kappa: float) -> dict[str, Any]:
    """The vMF mechanism's metric-DP guarantee on a row's direction: its density is ∝ exp(κ μᵀx), so
    for two directions μ, μ' the log-ratio of densities at any x is κ(μ − μ')ᵀx ≤ κ‖μ − μ'‖₂
    (Weggenmann & Kerschbaum 2021): ε·d₂-privacy with ε = κ per unit of Euclidean distance, and
    2κ between opposite directions (pure ε per row). The norm is released as it is: it is not covered."""
    if not kappa > 0:
        raise ConfigError(f"vmf: kappa must be > 0, got {kappa}")
    return {
        "mechanism": "von Mises-Fisher on each row's direction; the row's norm is released unprotected",
        "metric": "Euclidean distance between unit directions",
        "epsilon_per_unit_distance": float(kappa),
        "epsilon_per_row_worst_case": 2.0 * float(kappa),
    }


#: why a defence of the output gradient has no attack built for it in a U-shape (``adaptive_gap``)
U_SHAPE_GAP = (
    "{name} acts only on the output gradient the client returns in a U-shape: it changes no activation, which the "
    "suite's forward-wire attacks read as undefended, and no attack built for its perturbation of that gradient "
    "exists yet there (the joint attacker reads the gradient as it crossed; GMA-SL, built for it, reads the "
    "label-shielded split)"
)


@register
class VMFDirection(Defence):
    """Gradient Mirage's directional privatization (003), usable alone: every row of the output gradient
    the client returns in a U-shape (the gradient of its loss with respect to the trunk's output) keeps
    its norm and gets a direction drawn from vMF(its own direction, ``kappa``) (``sample_vmf`` above),
    seeded per document from the wire context. The server trains on the privatized gradient. The default
    ``kappa`` = 1000 is ours (003 gives none): on SmolLM2's 576 dimensions its mean cosine to the raw
    direction is about 0.75. ``privacy()`` gives the metric-DP ε on directions it implies."""

    name = "vmf"
    split_modes = ("u-shape", "label-shielded")
    adaptive = ()
    adaptive_note = (
        "no attack is built for vmf alone: it keeps each row's norm and draws its direction around the true one, "
        "so the observed rows are likeliest under the true gradient, which GMA-SL's L2 match already seeks; the "
        "matches built on vMF's likelihood (gma-sl-aware's row-cos, and row-l2) read fewer labels than it on "
        "SmolLM2 (experiments/PILOTS.md). It changes no activation, which the forward-wire attacks read as "
        "undefended"
    )

    def adaptive_attacks(self, mode):
        return ()

    def adaptive_gap(self, mode):
        return self.adaptive_note if mode == "label-shielded" else U_SHAPE_GAP.format(name=self.name)

    def __init__(self, kappa: float = 1000.0):
        self.kappa = check_number(self.name, "kappa", kappa, 0.0, lo_open=True)

    def args(self):
        return {"kappa": self.kappa}

    def roles(self):
        return ("backward-wire",)

    def top_gradient(self, g: torch.Tensor, ctx: WireContext) -> torch.Tensor:
        out = torch.empty_like(g)
        for i, doc_id in enumerate(ctx.doc_ids):
            out[i] = privatize_rows(g[i], self.kappa, ctx.generator("output-gradient", doc_id))
        return out

    def declare(self, channels):
        return [
            replace(c, note=f"after vmf: each row's norm as it was, its direction drawn from vMF(kappa={self.kappa:g})")
            if c.name == "output-gradient"
            else c
            for c in channels
        ]

    def privacy(self) -> dict[str, Any]:
        return vmf_epsilon(self.kappa)
