"""Rounding on the wire: symmetric signed quantisation of activations and gradients (What Gradients Add §5)."""

from __future__ import annotations

from typing import ClassVar

from splitleak.defences.base import (
    FORWARD_AWARE,
    Defence,
    SearchRange,
    check_number,
    clip_per_document,
    gaussian_noise_rms,
    quantize_symmetric,
    register,
    round_at_scale,
)
from splitleak.defences.noise import GRADIENT_NOISE_NOTE


@register
class Quant(Defence):
    """Symmetric signed rounding of activations and gradients (What Gradients Add §5, "8-bit defence")."""

    name = "quant8"
    n_bits: ClassVar[int] = 8
    bits = {"forward": 8, "backward": 8}
    search = {}
    adaptive = FORWARD_AWARE
    adaptive_note = (
        "rounding is deterministic given each document's scale, which crosses with the frame (its largest "
        "level is the scale times the largest integer): a candidate's activation is rounded as the client's was. "
        "On the returned gradient a row whose levels all round to zero carries no read-out: joint-aware keeps the "
        "activation candidates there, where the joint attacker fills half its slots with arbitrary tokens"
    )

    def forward(self, x, ctx):
        return quantize_symmetric(x, self.n_bits)

    def backward(self, g, ctx):
        return quantize_symmetric(g, self.n_bits)

    def public_forward(self, h, observed):
        return round_at_scale(h, self.forward_spacing(observed), self.n_bits)

    def forward_spacing(self, observed):
        """The document's scale: its largest level on the wire is the scale times 2**(bits-1) - 1."""
        return observed.abs().flatten(1).amax(dim=1) / (2 ** (self.n_bits - 1) - 1)


@register
class Quant4(Quant):
    name = "quant4"
    n_bits = 4
    bits = {"forward": 4, "backward": 4}


@register
class Quant4Noisy(Quant4):
    """What Gradients Add §5 "4-bit noisy defence": 4-bit activations; the returned gradient is clipped to
    L2 norm ``clip`` per document, gets Gaussian noise ``noise`` x its RMS (after clipping), then
    is rounded to 4 bits — in that order."""

    name = "quant4-noisy"
    adaptive_note = f"{Quant.adaptive_note}. {GRADIENT_NOISE_NOTE}"
    #: why ``splitleak.privacy`` credits its noise with no bound
    no_guarantee_note = (
        "its noise is a multiple of the clipped gradient's own RMS, so its scale depends on the data and it is no "
        "Gaussian mechanism of a public scale; the activations cross rounded, without noise: no formal bound"
    )
    search = {
        "noise": SearchRange(0.01, 3.0, log=True, why="ours: from 1 % of the clipped gradient's RMS to 3 times it")
    }

    def __init__(self, clip: float = 1.0, noise: float = 0.1):
        self.clip = check_number(self.name, "clip", clip, 0.0, lo_open=True)
        self.noise = check_number(self.name, "noise", noise, 0.0)

    def args(self):
        return {"clip": self.clip, "noise": self.noise}

    def backward(self, g, ctx):
        g = clip_per_document(g, self.clip)
        g = gaussian_noise_rms(g, self.noise, ctx, "backward")
        return quantize_symmetric(g, self.n_bits)
