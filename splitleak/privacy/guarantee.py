"""The noise guarantees of a defence chain, per channel of the wire.

A defence with a formal guarantee defines ``noise_guarantees()``: for each channel it noises, a
``NoiseGuarantee`` (the clip, per row or per document, and the absolute standard deviation of the Gaussian
noise added to every coordinate after it). A defence whose noise has no formal guarantee says why in
``no_guarantee_note`` (quant4-noisy: its noise scales with the gradient's own RMS, so its scale depends on the
data). A chain credits a noising part only where no part before it transforms the same channel: the rows a
token changes are derived for the rows as the model computes them (a token changes its own row and, through
causal attention, every later row), not for rows an earlier transform mixed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

#: the channels that cross with a guarantee where a defence noises them (``AttackInfo.reads`` vocabulary)
NOISED_CHANNELS = ("activations", "gradient", "output-gradient")


@dataclass(frozen=True)
class NoiseGuarantee:
    """``channel`` crosses clipped to L2 norm ``clip`` (per row, or with ``level="document"`` the document's whole
    tensor) with N(0, ``sigma``²) added to every coordinate, drawn fresh per crossing."""

    defence: str
    channel: str
    clip: float
    sigma: float
    level: str = "row"  # "row" or "document"

    def sensitivity(self, rows_changed: int) -> float:
        """The L2 distance between two neighbouring crossings: 2C per changed row (replace-one: each of the two
        rows lies in the ball of radius C), or 2C for a document clipped as a whole."""
        if self.level == "document":
            return 2.0 * self.clip
        return 2.0 * self.clip * math.sqrt(max(0, int(rows_changed)))

    def mu(self, rows_changed: int) -> float:
        """The Gaussian-DP parameter of one crossing: sensitivity over the noise's standard deviation."""
        s = self.sensitivity(rows_changed)
        if s == 0:
            return 0.0
        return math.inf if self.sigma <= 0 else s / self.sigma


@dataclass
class ChainGuarantee:
    """Per channel, the guarantees the chain's noising parts give (empty where a channel crosses without one),
    and the notes that say why a part gives none."""

    by_channel: dict[str, list[NoiseGuarantee]]
    notes: list[str]

    def of(self, channel: str) -> list[NoiseGuarantee]:
        return self.by_channel.get(channel, [])


def chain_guarantees(defences: Sequence[Any]) -> ChainGuarantee:
    """The guarantees of the defences in chain order (``DefenceChain.defences`` or a list of defences)."""
    by: dict[str, list[NoiseGuarantee]] = {}
    notes: list[str] = []
    touched: dict[str, str] = {}  # channel -> the first defence that transforms it
    for d in defences:
        declared = list(getattr(d, "noise_guarantees", lambda: [])())
        for g in declared:
            if g.channel in touched and touched[g.channel] != d.name:
                notes.append(
                    f"{d.name} noises the {g.channel} after {touched[g.channel]} transformed them: the rows a "
                    "token changes are not derived for transformed rows, so its noise is not credited"
                )
                continue
            by.setdefault(g.channel, []).append(g)
        note = getattr(d, "no_guarantee_note", "")
        if note:
            notes.append(f"{d.name}: {note}")
        for channel in _channels(d):
            touched.setdefault(channel, d.name)
    return ChainGuarantee(by, notes)


def _channels(d: Any) -> set[str]:
    try:
        return set(d.transformed_channels())
    except AttributeError:  # a stand-in without roles
        return {g.channel for g in getattr(d, "noise_guarantees", lambda: [])()}
