"""Gradient Mirage (003) and the baselines it is compared with, as defences of the label-shielded mode.

The label-shielded client (``splitleak.training.roles.ClientRole``) computes one Top forward and two
gradients (dual-track backpropagation): the Top learns from the full loss, and the output gradient it
sends, g_t, derives from the *exposed* loss, sum_l w_l CE_l / N, whose per-target weights w the
``exposed-loss`` defences set. The parts, each usable alone:

- ``sas``: selective autoregressive supervision. Per document, the supervised targets are sorted by the
  Top's predictive entropy and cut into ``groups`` strata (high, medium, low); each step one stratum
  is fully supervised and every other target is kept with probability ``keep``; the last ``last``
  targets are always kept, so that no zero-gradient suffix gives the masking away (003 App. B.1: k=5).
- ``scale-blind``: scale blinding. Each kept target's weight is multiplied by a fresh
  s ~ Unif[m(1-r), m(1+r)] (003: m=1750, r=1/7, i.e. Unif[1500, 2000]); with ``recover`` the client
  divides the gradient it gets back for its Bottom by E[s] = m (Bottom-gradient recovery).
- ``vmf`` (``splitleak.defences.vmf.VMFDirection``): each row of g_t keeps its norm, its direction drawn
  from vMF(kappa).
- ``mirage``: all three, in that order, with recovery.

The baselines act on g_t only (``backward-wire``): ``grad-prune`` (zero the smallest-magnitude share of
each document's coordinates) and ``grad-dropout`` (zero each coordinate with probability p), both in
``splitleak.defences.masking``, and ``seq-dp`` (clip each document's g_t to an L2 norm, add Gaussian noise; its epsilon from the Opacus
accountant splitleak already uses). Top-only training, the last baseline, is a training mode
(``ShieldedConfig.train = "top-only"``): no gradient crosses at all.

Where 003 gives no number, the default is ours and says so: ``keep`` = 0.3, the strata as equal
thirds of the entropy order, the fully supervised stratum drawn per step and document from the wire
context, ``kappa`` = 1000, the pruning share 0.9, the dropout rate 0.5 without rescaling, and
seq-dp's clip 1.0 and noise multiplier 1.0.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch

from splitleak.defences.base import Defence, WireContext, check_bool, check_integer, check_number, register
from splitleak.defences.noise import gaussian_mechanism_epsilon
from splitleak.defences.vmf import U_SHAPE_GAP, VMFDirection
from splitleak.privacy.guarantee import NoiseGuarantee

SHIELDED = ("label-shielded",)
GRADIENT_MODES = ("u-shape", "label-shielded")


def noted_gradient(channels, note: str):
    """The output-gradient channel with ``note`` added (what the defence did to it)."""
    return [
        replace(c, note=f"{c.note}; {note}" if c.note else note) if c.name == "output-gradient" else c for c in channels
    ]


class LabelDefence(Defence):
    """What the label-shielded defences share: the attack built for them is GMA-SL that knows the exposed
    loss (``gma-sl-aware``: the public scale divided out or fitted per target, masked where coordinates are
    zeroed, seq-dp's clip applied); in a U-shape, which has no label attack, they change no
    activation, which the forward-wire attacks read as undefended."""

    adaptive: ClassVar[tuple[str, ...]] = ("gma-sl-aware",)
    adaptive_note: ClassVar[str] = (
        "GMA-SL matched under the exposed loss the defence declares (public scale, masks, noise model); the "
        "activations are not this defence's to protect"
    )

    def adaptive_attacks(self, mode):
        return ("gma-sl-aware",) if mode == "label-shielded" else ()

    def adaptive_gap(self, mode):
        return "" if mode == "label-shielded" else U_SHAPE_GAP.format(name=self.name)


@register
class SelectiveSupervision(LabelDefence):
    """``sas``: one entropy stratum of the supervised targets fully supervised per step, the others kept
    with probability ``keep``, the last ``last`` targets always (see the module docstring)."""

    name = "sas"
    split_modes = SHIELDED
    adaptive: ClassVar[tuple[str, ...]] = ()
    adaptive_note: ClassVar[str] = (
        "no attack is built for sas alone: a target it removes from the exposed loss adds nothing to the output "
        "gradient, so no reader can read its label there, and GMA-SL's full-label model already holds every "
        "selection (a removed target matched by the model's own prediction adds nothing either): knowing keep, "
        "groups and last changes no optimum. GMA-SL is the reader; sas with scale-blind (mirage) has its own"
    )

    def adaptive_attacks(self, mode):
        return ()

    def adaptive_gap(self, mode):
        return self.adaptive_note if mode == "label-shielded" else U_SHAPE_GAP.format(name=self.name)

    def __init__(self, keep: float = 0.3, groups: int = 3, last: int = 5):
        self.keep = check_number("sas", "keep", keep, 0.0, 1.0)
        self.groups = check_integer("sas", "groups", groups, 1)
        self.last = check_integer("sas", "last", last, 0)

    def args(self):
        return {"keep": self.keep, "groups": self.groups, "last": self.last}

    def roles(self):
        return ("exposed-loss",)

    def selection(self, entropy: torch.Tensor, supervised: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """0/1 over one document's targets [T-1]: which the exposed loss keeps."""
        idx = torch.nonzero(supervised, as_tuple=False).flatten()
        keep = torch.zeros(supervised.shape, dtype=torch.float64)
        if idx.numel() == 0:
            return keep
        order = idx[torch.argsort(entropy[idx].double(), descending=True, stable=True)]
        strata = torch.tensor_split(order, min(self.groups, order.numel()))
        full = int(torch.randint(len(strata), (1,), generator=gen))
        coin = torch.rand(idx.numel(), generator=gen, dtype=torch.float64) < self.keep
        keep[idx[coin]] = 1.0
        keep[strata[full]] = 1.0
        if self.last:
            keep[idx[-self.last :]] = 1.0
        return keep

    def exposed_weights(self, w, entropy, supervised, ctx: WireContext):
        out = w.clone()
        for b, doc_id in enumerate(ctx.doc_ids):
            sel = self.selection(entropy[b], supervised[b], ctx.generator("exposed-loss", doc_id))
            out[b] = w[b] * sel.to(w.dtype)
        return out

    def declare(self, channels):
        return noted_gradient(
            channels,
            f"from sas's masked loss (one entropy stratum of {self.groups} and a share {self.keep:g} of the rest, "
            f"the last {self.last} targets always)",
        )


@register
class ScaleBlinding(LabelDefence):
    """``scale-blind``: every target's weight times a fresh s ~ Unif[m(1-r), m(1+r)] (003: m=1750, r=1/7);
    with ``recover`` the client divides its returned Bottom gradient by E[s] = m."""

    name = "scale-blind"
    split_modes = SHIELDED

    def __init__(self, m: float = 1750.0, r: float = 1 / 7, recover: bool = True):
        self.m = check_number("scale-blind", "m", m, 0.0, lo_open=True)
        self.r = check_number("scale-blind", "r", r, 0.0, 1.0)
        self.recover = check_bool("scale-blind", "recover", recover)

    def args(self):
        return {"m": self.m, "r": self.r, "recover": self.recover}

    def roles(self):
        return ("exposed-loss",)

    def exposed_weights(self, w, entropy, supervised, ctx: WireContext):
        out = w.clone()
        lo, hi = self.m * (1 - self.r), self.m * (1 + self.r)
        for b, doc_id in enumerate(ctx.doc_ids):
            u = torch.rand(w.shape[1], generator=ctx.generator("scale", doc_id), dtype=torch.float64)
            out[b] = w[b] * (lo + (hi - lo) * u).to(w.dtype)
        return out

    def recovery(self) -> float:
        return self.m if self.recover else 1.0

    def declare(self, channels):
        return noted_gradient(
            channels, f"each target's term scaled by s ~ Unif[{self.m * (1 - self.r):g}, {self.m * (1 + self.r):g}]"
        )


@register
class Mirage(LabelDefence):
    """``mirage``: Gradient Mirage whole (003 §4): sas, then scale blinding, then vMF on each row of the
    exposed gradient; dual-track backpropagation and Bottom-gradient recovery by E[s]."""

    name = "mirage"
    split_modes = SHIELDED

    def __init__(
        self,
        kappa: float = 1000.0,
        m: float = 1750.0,
        r: float = 1 / 7,
        keep: float = 0.3,
        groups: int = 3,
        last: int = 5,
        recover: bool = True,
    ):
        self.sas = SelectiveSupervision(keep, groups, last)
        self.scale = ScaleBlinding(m, r, recover)
        self.vmf = VMFDirection(kappa)

    def args(self):
        return {**self.vmf.args(), **self.scale.args(), **self.sas.args()}

    def roles(self):
        return ("exposed-loss", "backward-wire")

    def exposed_weights(self, w, entropy, supervised, ctx: WireContext):
        w = self.sas.exposed_weights(w, entropy, supervised, ctx)
        return self.scale.exposed_weights(w, entropy, supervised, ctx)

    def recovery(self) -> float:
        return self.scale.recovery()

    def top_gradient(self, g, ctx: WireContext):
        return self.vmf.top_gradient(g, ctx)

    def declare(self, channels):
        return self.vmf.declare(self.scale.declare(self.sas.declare(channels)))

    def privacy(self) -> dict[str, Any]:
        return self.vmf.privacy()


@register
class SequenceDP(LabelDefence):
    """``seq-dp``: each document's g_t clipped to L2 norm ``clip`` and given N(0, (noise_multiplier·clip)²)
    per coordinate, the Gaussian mechanism at sequence level (003's GradSeq-LDP baseline). ``privacy()``
    gives its (epsilon, delta) per release and over a run's releases (Opacus's RDP accountant)."""

    name = "seq-dp"
    split_modes = GRADIENT_MODES
    adaptive: ClassVar[tuple[str, ...]] = ("gma-sl-aware", "gma-sl-crossings")

    def adaptive_attacks(self, mode):
        """Beside gma-sl-aware, the reader of every training pass: seq-dp draws its noise fresh per crossing."""
        return self.adaptive if mode == "label-shielded" else ()

    def __init__(self, clip: float = 1.0, noise_multiplier: float = 1.0, delta: float = 1e-5):
        self.clip = check_number("seq-dp", "clip", clip, 0.0, lo_open=True)
        self.noise_multiplier = check_number("seq-dp", "noise_multiplier", noise_multiplier, 0.0, lo_open=True)
        self.delta = check_number("seq-dp", "delta", delta, 0.0, 1.0, lo_open=True)

    def args(self):
        return {"clip": self.clip, "noise_multiplier": self.noise_multiplier, "delta": self.delta}

    def roles(self):
        return ("backward-wire",)

    def top_gradient(self, g, ctx):
        out = torch.empty_like(g)
        for i, doc_id in enumerate(ctx.doc_ids):
            norm = float(g[i].double().norm())
            clipped = g[i] * min(1.0, self.clip / norm) if norm > 0 else g[i]
            noise = torch.randn(g[i].shape, generator=ctx.generator("seq-dp", doc_id), dtype=torch.float64)
            out[i] = clipped + (self.noise_multiplier * self.clip * noise).to(g.dtype).to(g.device)
        return out

    def declare(self, channels):
        return noted_gradient(
            channels,
            f"after seq-dp: each document clipped to norm {self.clip:g}, Gaussian noise of std "
            f"{self.noise_multiplier * self.clip:g} per coordinate",
        )

    def privacy(self, releases: int = 1) -> dict[str, Any]:
        return gaussian_mechanism_epsilon(self.noise_multiplier, self.delta, releases)

    def noise_release(self, channel: str, x, ctx):
        """One release of the output gradient as the wire sends it (``splitleak.audit.dp_audit``)."""
        return self.top_gradient(x, ctx)

    def noise_guarantees(self) -> list[NoiseGuarantee]:
        """Each document's output gradient clipped to ``clip`` as a whole, noise ``noise_multiplier`` x ``clip``."""
        return [NoiseGuarantee(self.name, "output-gradient", self.clip, self.noise_multiplier * self.clip, "document")]
