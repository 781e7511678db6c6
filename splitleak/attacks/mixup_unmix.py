"""``mixup-unmix``: undo secret mixup from what crosses the wire, then run the activation attacker.

Under mixup with ``correction=probe`` (What Gradients Add §4.5 as splitleak first built it), a forward frame carries
the mixed rows x = λh + (1 − λ)d *and* the decoys d alone as probe rows, paired with the documents by
frame position. Whoever sees the frame computes h = (x − (1 − λ)d) / λ: one line of algebra.

λ, when not given (``lam``), is estimated from the traffic alone by least squares, without any
model (``MixupUnmix.estimate_lambda``): each mixed row regresses on its decoy with slope 1 − λ.
Frames that carried no probe rows (mixup's unmixed warm-up steps) are taken as they are.

The probe rows are clean activations of earlier training documents; ``probe_tokens`` in the
reconstruction's extras decodes them row by row (VMI), for the orchestrator to score against the
client's own record of where each decoy came from.
"""

from __future__ import annotations

import torch
from pydantic import PositiveInt

from splitleak.attacks.base import Candidates, Reconstruction, Share
from splitleak.attacks.beam import ActivationBeam
from splitleak.attacks.knowledge import Traffic
from splitleak.attacks.ridge import cosine_topk
from splitleak.errors import ConfigError
from splitleak.progress import Progress


class MixupUnmix(ActivationBeam):
    """Pair probe rows with mixed rows (by frame position, as they cross), estimate λ unless given,
    unmix, and run the activation-only beam search (``k`` candidates) on the result."""

    name = "mixup-unmix"

    def __init__(
        self,
        k: Candidates = 32,
        width: PositiveInt = 2,
        seed: int = 0,
        chunk_docs: PositiveInt = 64,
        lam: Share | None = None,
    ):
        super().__init__(k=k, width=width, seed=seed, chunk_docs=chunk_docs)
        self.lam = lam

    def params(self):
        p = super().params()
        if self.lam is not None:
            p["lam"] = self.lam
        return p

    # ------------------------------------------------------------------ λ
    def estimate_lambda(self, traffic: Traffic) -> float:
        """λ by least squares, with no model. Each coordinate j of a mixed row is
        x_j = λ h_j + (1 − λ) d_j, and a row is independent of the decoy drawn for it, so the
        least-squares slope of x_j on d_j over all rows and positions, Cov(x_j, d_j) / Var(d_j),
        estimates 1 − λ. The median over coordinates resists the few coordinates with massive
        activations that would dominate a pooled fit."""
        rows = self._probed_rows(traffic)
        assert traffic.probe_activations is not None  # _probed_rows refuses traffic without probe rows
        width = traffic.activations.shape[-1]
        x = traffic.activations[rows].double().reshape(-1, width)
        d = traffic.probe_activations[rows].double().reshape(-1, width)
        if x.shape[0] < 3:
            raise ConfigError("mixup-unmix: too few probe rows to estimate λ; pass --lam")
        xc, dc = x - x.mean(0), d - d.mean(0)
        var = dc.pow(2).mean(0)
        keep = var > 0
        if not bool(keep.any()):
            raise ConfigError("mixup-unmix: the probe rows are constant, so λ cannot be estimated; pass --lam")
        slope = (xc * dc).mean(0)[keep] / var[keep]
        return float(torch.clamp(1 - slope.median(), 0.01, 1.0))

    # ------------------------------------------------------------------ unmixing
    @staticmethod
    def _probed_rows(traffic: Traffic) -> list[int]:
        if traffic.probe_activations is None:
            raise ConfigError(
                "mixup-unmix reads mixup's probe rows, and this traffic carries none: the run has no mixup, or "
                "mixup with correction=cached or none (nothing extra crosses); run the ordinary attacks instead"
            )
        present = (
            traffic.probe_present if traffic.probe_present is not None else torch.ones(len(traffic), dtype=torch.bool)
        )
        rows = [i for i, p in enumerate(present.tolist()) if p]
        if not rows:
            raise ConfigError("mixup-unmix: no frame of this traffic carried probe rows")
        return rows

    def unmix(self, traffic: Traffic, lam: float) -> Traffic:
        rows = self._probed_rows(traffic)
        assert traffic.probe_activations is not None  # _probed_rows refuses traffic without probe rows
        act = traffic.activations.clone()
        x, d = act[rows], traffic.probe_activations[rows].to(act.dtype)
        act[rows] = (x - (1 - lam) * d) / lam
        return traffic.replace(activations=act)

    def reconstruct(self, traffic: Traffic, progress: Progress | None = None) -> Reconstruction:
        self._check(traffic)
        rows = self._probed_rows(traffic)
        assert traffic.probe_activations is not None  # _probed_rows refuses traffic without probe rows
        lam = float(self.lam) if self.lam is not None else self.estimate_lambda(traffic)
        if not 0 < lam <= 1:
            raise ConfigError(f"mixup-unmix: lam must be in (0, 1], got {lam}")
        rec: Reconstruction = super().reconstruct(self.unmix(traffic, lam), progress)
        client = self.knowledge_.client
        probe = traffic.probe_activations.to(client.device, client.dtype)
        probe_tokens = cosine_topk(self.ridge_(probe), client.embedding, 1)[..., 0].cpu()
        rec.extra.update(
            {"lambda": lam, "lambda_estimated": self.lam is None, "probe_tokens": probe_tokens, "probed_rows": rows}
        )
        return rec
