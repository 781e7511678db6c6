"""Clipping and Gaussian noise on the wire: ``clip-noise`` (per row, either direction) and ``dp-forward``
(the Gaussian mechanism per activation row), with the (epsilon, delta) accounting they and ``seq-dp`` use."""

from __future__ import annotations

from typing import Any

from splitleak.defences.base import (
    FORWARD_AWARE,
    Defence,
    SearchRange,
    check_choice,
    check_number,
    clip_rows,
    gaussian_rows,
    register,
)
from splitleak.errors import ConfigError
from splitleak.privacy.guarantee import NoiseGuarantee

#: the searchable per-row L2 clip norm, shared by the defences that clip activation or gradient rows
ROW_CLIP_RANGE = SearchRange(
    0.1,
    1000.0,
    log=True,
    why="ours: from far below to above the rows' norms (SmolLM2-135M at depth 6: median about 100)",
)


#: why knowing Gaussian noise of a public scale on the returned gradient changes no one-crossing read-out
GRADIENT_NOISE_NOTE = (
    "Gaussian noise of a public scale on the returned gradient leaves the joint attacker's read-out as it is: "
    "the likelihood of a row under 'a positive multiple of this token's direction plus that noise' ranks the "
    "tokens by their cosine with the row whatever the scale, and the per-row clip keeps the direction. What "
    "knowing it buys is combining a document's repeated crossings, which no one-crossing reader sees: "
    "joint-crossings reads the mean of a training document's returned gradients, whose fresh noise is σ/√R"
)

#: why the forward-wire attacks built for clipped and noised activations read them as the client's were
FORWARD_NOTE = (
    "the clip is deterministic and the noise Gaussian with a public scale: a candidate is scored by its "
    "likelihood after the clip; noise keyed by a guessable run seed is found and removed (seed-search)"
)

#: why a reader of every crossing of a document is built for noise drawn fresh per release
CROSSINGS_NOTE = (
    "fresh noise per crossing averages out over a document's passes: crossings-aware reads the mean of a "
    "training document's crossings (the frame headers name them), whose noise is σ/√R"
)


@register
class ClipNoise(Defence):
    """Per-row L2 clip to ``clip`` and Gaussian noise ``sigma`` x ``clip``, on the forward wire,
    the returned gradient, or both (``where``)."""

    name = "clip-noise"
    adaptive = (*FORWARD_AWARE, "seed-search", "crossings-aware", "joint-crossings")
    adaptive_note = f"{FORWARD_NOTE}. {GRADIENT_NOISE_NOTE}. {CROSSINGS_NOTE}"
    search = {
        "clip": ROW_CLIP_RANGE,
        "sigma": SearchRange(
            1e-3,
            3.0,
            log=True,
            why="ours: per-entry noise from 0.1 % of the clip norm C to 3 C (a row of norm C drowns)",
        ),
    }

    def __init__(self, clip: float = 1.0, sigma: float = 0.1, where: str = "both"):
        self.clip = check_number(self.name, "clip", clip, 0.0, lo_open=True)
        self.sigma = check_number(self.name, "sigma", sigma, 0.0)
        self.where = check_choice(self.name, "where", where, ("forward", "backward", "both"))

    def args(self):
        return {"clip": self.clip, "sigma": self.sigma, "where": self.where}

    def roles(self):
        return {
            "forward": ("client-forward",),
            "backward": ("return-wire",),
            "both": ("client-forward", "return-wire"),
        }[self.where]

    def _apply(self, x, ctx, direction):
        return gaussian_rows(clip_rows(x, self.clip), self.sigma * self.clip, ctx, direction)

    def adaptive_attacks(self, mode):
        if self.where == "both":
            return self.adaptive
        if self.where == "forward":  # the returned gradient crosses as it is: no reader of its crossings applies
            return tuple(a for a in self.adaptive if a != "joint-crossings")
        return ("joint-crossings",)  # only the returned gradient is noised

    def adaptive_gap(self, mode):
        if self.where in ("forward", "both"):
            return ""
        return (
            "clip-noise with where=backward clips and noises only the returned gradient: the activations cross as "
            f"they are, which the suite's forward-wire attacks read as undefended. {GRADIENT_NOISE_NOTE}"
        )

    def forward(self, x, ctx):
        return self._apply(x, ctx, "forward") if self.where in ("forward", "both") else x

    def backward(self, g, ctx):
        return self._apply(g, ctx, "backward") if self.where in ("backward", "both") else g

    def public_forward(self, h, observed):
        return clip_rows(h, self.clip) if self.where in ("forward", "both") else h

    def noise_guarantees(self) -> list[NoiseGuarantee]:
        """Each noised row clipped to ``clip`` with noise ``sigma`` x ``clip`` (``splitleak.privacy``)."""
        channels = {"forward": ["activations"], "backward": ["gradient"], "both": ["activations", "gradient"]}
        return [NoiseGuarantee(self.name, c, self.clip, self.sigma * self.clip) for c in channels[self.where]]

    def forward_noise_std(self):
        return self.sigma * self.clip if self.where in ("forward", "both") else 0.0

    def noise_release(self, channel: str, x, ctx):
        """One release of ``channel`` as the wire sends it (``splitleak.audit.dp_audit``)."""
        return self.forward(x, ctx) if channel == "activations" else self.backward(x, ctx)


@register
class DPForward(Defence):
    """DP-forward (Du et al. 2023 style): clip each activation row to L2 norm ``clip`` and add
    Gaussian noise with standard deviation ``noise_multiplier`` x ``clip``. Each row is one release
    of the Gaussian mechanism with sensitivity ``clip``; ``privacy()`` reports its (epsilon, delta)
    and that of one whole document (``tokens`` releases composed), from Opacus's RDP accountant."""

    name = "dp-forward"
    adaptive = (*FORWARD_AWARE, "seed-search", "crossings-aware")
    adaptive_note = f"{FORWARD_NOTE}. {CROSSINGS_NOTE}"
    search = {
        "clip": ROW_CLIP_RANGE,
        "noise_multiplier": SearchRange(
            0.01, 10.0, log=True, why="ours: from no meaningful (epsilon, delta) to epsilon well under 1 per row"
        ),
    }

    def __init__(self, noise_multiplier: float = 1.0, clip: float = 1.0, delta: float = 1e-5):
        self.noise_multiplier = check_number(self.name, "noise_multiplier", noise_multiplier, 0.0, lo_open=True)
        self.clip = check_number(self.name, "clip", clip, 0.0, lo_open=True)
        self.delta = check_number(self.name, "delta", delta, 0.0, 1.0, lo_open=True, hi_open=True)

    def args(self):
        return {"noise_multiplier": self.noise_multiplier, "clip": self.clip, "delta": self.delta}

    def roles(self):
        return ("client-forward",)

    def forward(self, x, ctx):
        return gaussian_rows(clip_rows(x, self.clip), self.noise_multiplier * self.clip, ctx, "forward")

    def public_forward(self, h, observed):
        return clip_rows(h, self.clip)

    def noise_guarantees(self) -> list[NoiseGuarantee]:
        """Each activation row clipped to ``clip`` with noise ``noise_multiplier`` x ``clip``."""
        return [NoiseGuarantee(self.name, "activations", self.clip, self.noise_multiplier * self.clip)]

    def forward_noise_std(self):
        return self.noise_multiplier * self.clip

    def noise_release(self, channel: str, x, ctx):
        """One release of the activations as the wire sends them (``splitleak.audit.dp_audit``)."""
        return self.forward(x, ctx)

    def privacy(self, tokens: int = 1) -> dict[str, Any]:
        return gaussian_mechanism_epsilon(self.noise_multiplier, self.delta, releases=tokens)


def gaussian_mechanism_epsilon(noise_multiplier: float, delta: float, releases: int = 1) -> dict[str, Any]:
    """(epsilon, delta) of ``releases`` compositions of the Gaussian mechanism with noise multiplier
    ``noise_multiplier`` (sampling rate 1), from Opacus's RDP accountant."""
    try:
        # lazy: opacus takes seconds to import and only dp-forward's privacy report needs it
        from opacus.accountants import RDPAccountant
    except ImportError as exc:  # pragma: no cover - opacus is a dependency
        raise ConfigError("dp-forward's privacy report needs the package opacus (`pip install opacus`)") from exc
    acc = RDPAccountant()
    acc.history = [(float(noise_multiplier), 1.0, int(releases))]
    return {
        "epsilon": float(acc.get_epsilon(delta)),
        "delta": float(delta),
        "releases": int(releases),
        "noise_multiplier": float(noise_multiplier),
        "accountant": "opacus RDP",
    }
