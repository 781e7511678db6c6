"""The latent split mode of the decoy system (Politis & Pappas 2026, §2, Figure 2, Table 15).

The trusted node keeps the embeddings and blocks [0, s] (frozen), a private encoder H→D and decoder
D→H, the frozen tail [r, L) with the final norm and head, the labels and the loss. The untrusted node
trains only ``GaugeSurrogate``, a small D-wide module, in place of blocks (s, r). Rows cross
gauged (``splitleak.defences.gauges``): rotated, permuted and mixed with decoys, so whatever the
untrusted node computes must commute with a rotation of the coordinates and a permutation of the
rows. A plain transformer block does not (its weight matrices fix a basis, its position embeddings
an order).

What the surrogate can and cannot learn. By Schur's lemma the only linear maps of the coordinates
that commute with every rotation are multiples of the identity, so the surrogate cannot apply any
fixed linear map to a row's coordinates: it moves each output row along the directions of the
input rows, with weights that are functions of rotation-invariant quantities — the Gram matrix
of the unit rows and the row norms. Concretely, a layer computes

    y_i = x_i + γ·x_i·tanh(a + b·log‖x_i‖)               (radial norm channel)
              + Σ_k gate_ik · α_k · Σ_j softmax_j(β_k·G_ij²) · x_j   (K experts of message passing)

with G the Gram matrix of the unit rows and the gates a small router (MLP) over six Gram statistics
of row i (log norm; mean, std and max off-diagonal of G_i·²; mean of G_i·; the largest |G_ij|
off the diagonal). 94 parameters per layer for K = 3, hidden 8 ("about a hundred", Table 15). It
can learn how strongly rows attract their neighbours in angle and how norms shrink or grow; it
cannot learn anything position- or token-specific, and it mixes each real row with the decoys of
its frame. All coordinate-specific computation sits in the client's private encoder and decoder.
Rows form a set, so there is no causal mask: a position's output may depend on later tokens of its
block, and the latent mode's held-out loss is not a causal LM's loss (the paper's design, noted in
reports). The per-row scale gauge is *not* commuted (its sign flips rows' contributions), which is
why the paper turned it off for these surrogates; ``scale`` stays an option of the gauges.

Splits: the paper cuts Qwen3-0.6B (28 blocks) after block 14 and resumes at 26 (11 delegated), and
for its mitigation runs after 21 resuming at 26 (4 delegated). For SmolLM2-135M (30 blocks) the
presets keep the same tail of two local blocks (resume at L − 2 = 28) and the same position of the
first cut (after block 15, half the depth, as 14 of 28 is for Qwen3: 12 delegated), and the
mitigation split keeps the paper's count of 4 delegated blocks (after 23, resume at 28). The depth ladder of
002 §6 (Table 10: after 13, 17 and 19 on Qwen3, resuming at 26: 12, 8 and 6 delegated) is named ``ladder-N``
by the paper's count; on SmolLM2 it keeps the tail (resume at 28) and, as ``main`` does, the first cut's share
of the depth (after 14, 18, 20: 13, 9 and 7 delegated; keeping the counts instead would make ``ladder-12``
SmolLM2's ``main`` again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from splitleak.errors import ConfigError

#: named latent splits per model: (split_after, resume_at)
LATENT_SPLITS: dict[str, dict[str, tuple[int, int]]] = {
    "qwen3-0.6b": {
        "main": (14, 26),
        "mitigation": (21, 26),
        # 002 §6's depth ladder: 12, 8 and 6 blocks delegated (after 13, 17, 19)
        **{f"ladder-{n}": (25 - n, 26) for n in (12, 8, 6)},
    },
    "smollm2-135m": {
        "main": (15, 28),
        "mitigation": (23, 28),
        "ladder-12": (14, 28),  # the ladder's cuts at Qwen3's share of the depth: 13, 9 and 7 delegated
        "ladder-8": (18, 28),
        "ladder-6": (20, 28),
    },
    "tiny-gpt2": {"main": (0, 3), "mitigation": (1, 3)},
}


@dataclass(frozen=True)
class LatentSpec:
    """Blocks [0, split_after] and [resume_at, n_blocks) stay on the trusted node; the blocks strictly
    between are delegated (replaced by the surrogate) and run locally only as the teacher."""

    n_blocks: int
    split_after: int
    resume_at: int
    width: int  # D

    @property
    def delegated(self) -> tuple[int, int]:
        return self.split_after + 1, self.resume_at

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "delegated": list(self.delegated)}


def latent_spec(n_blocks: int, split_after: int, resume_at: int, width: int) -> LatentSpec:
    if not 0 <= split_after < resume_at - 1:
        raise ConfigError(
            f"latent split after block {split_after}, resuming at {resume_at}, delegates no block; "
            "need 0 <= split-after < resume-at - 1"
        )
    if resume_at > n_blocks:
        raise ConfigError(f"--resume-at {resume_at} is past the model's {n_blocks} blocks")
    if width < 2:
        raise ConfigError(f"the latent width D must be >= 2, got {width}")
    return LatentSpec(n_blocks, split_after, resume_at, width)


def preset_split(model: str, name: str) -> tuple[int, int]:
    table = LATENT_SPLITS.get(model)
    if table is None or name not in table:
        known = ", ".join(f"{m}:{k}" for m, t in LATENT_SPLITS.items() for k in t)
        raise ConfigError(f"no latent split {name!r} for model {model!r}; known: {known}")
    return table[name]


def resolve_split(model: str, split: str) -> tuple[int, int]:
    """``split``: a named split of ``model`` (``preset_split``) or S/R (split after block S, resume at R)."""
    if "/" not in split:
        return preset_split(model, split)
    try:
        s, r = (int(x) for x in split.split("/"))
    except ValueError:
        raise ConfigError(f"--latent-split {split}: write S/R with two block indices, e.g. 15/28") from None
    return s, r


class Encoder(nn.Module):
    """H → D: LayerNorm → Linear(H, 2D) → GELU → Linear(2D, D) → tanh."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(hidden), nn.Linear(hidden, 2 * width), nn.GELU(), nn.Linear(2 * width, width), nn.Tanh()
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.net(h)


class Decoder(nn.Module):
    """D → H: LayerNorm → Linear(D, 2D) → GELU → Linear(2D, H); the caller adds it to the residual.
    The last layer starts small (PyTorch's init times 0.01), so an untrained decoder barely moves the
    residual; not zero, which would make the first step's gradients through it exactly zero."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, hidden)
        )
        last = self.net[-1]
        assert isinstance(last, nn.Linear)
        with torch.no_grad():
            last.weight.mul_(0.01)
            last.bias.mul_(0.01)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.net(y)


N_FEATURES = 6


def gram_features(x: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(G, features) of rows ``x`` [..., n, D]: the unit-row Gram matrix and six invariant statistics
    per row (log norm; mean, std and max off-diagonal of G²; mean of G; max off-diagonal |G|)."""
    norm = x.norm(dim=-1, keepdim=True).clamp_min(eps)
    u = x / norm
    g = u @ u.transpose(-1, -2)
    n = x.shape[-2]
    eye = torch.eye(n, dtype=torch.bool, device=x.device)
    g2 = g * g
    off = g2.masked_fill(eye, float("-inf"))
    abs_off = g.abs().masked_fill(eye, float("-inf"))
    feats = torch.stack(
        [
            norm.squeeze(-1).log(),
            g2.mean(-1),
            g2.std(-1) if n > 1 else torch.zeros_like(g2.mean(-1)),
            off.amax(-1) if n > 1 else torch.zeros_like(g2.mean(-1)),
            g.mean(-1),
            abs_off.amax(-1) if n > 1 else torch.zeros_like(g2.mean(-1)),
        ],
        dim=-1,
    )
    return g, feats


class SurrogateLayer(nn.Module):
    def __init__(self, experts: int = 3, router_hidden: int = 8):
        super().__init__()
        self.router = nn.Sequential(nn.Linear(N_FEATURES, router_hidden), nn.GELU(), nn.Linear(router_hidden, experts))
        self.beta = nn.Parameter(torch.linspace(1.0, 8.0, experts))  # sharpness of each expert's attention
        self.alpha = nn.Parameter(torch.zeros(experts))  # each expert's gain (starts as the identity map)
        self.radial = nn.Parameter(torch.tensor([0.0, 0.0, 0.0]))  # γ, a, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, feats = gram_features(x)
        gates = torch.softmax(self.router(feats), dim=-1)  # [..., n, K]
        out = x
        for k in range(self.beta.shape[0]):
            attn = torch.softmax(self.beta[k] * g * g, dim=-1)
            out = out + (gates[..., k] * self.alpha[k]).unsqueeze(-1) * (attn @ x)
        gamma, a, b = self.radial
        return out + gamma * x * torch.tanh(a + b * feats[..., :1])


class GaugeSurrogate(nn.Module):
    """The untrusted node's model: ``layers`` gauge-equivariant layers on [..., n, D] rows. None of
    its parameters has the model's width H (``check_no_wide_parameters``) or the latent width D."""

    def __init__(self, layers: int = 1, experts: int = 3, router_hidden: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(SurrogateLayer(experts, router_hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def check_no_wide_parameters(module: nn.Module, hidden: int) -> None:
    """Refuse a server-side module with a parameter of the model's width H."""
    for name, p in module.named_parameters():
        if hidden in p.shape:
            raise ConfigError(
                f"the untrusted node's parameter {name} has shape {tuple(p.shape)}, a dimension of the model's "
                f"width {hidden}; it may hold only the gauge-equivariant surrogate"
            )
