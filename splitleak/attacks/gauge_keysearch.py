"""Key search on the decoy system's derived keys (ours, built for the gauges and noise of Politis &
Pappas 2026, §2 and Table 15).

Under ``gauge_entropy="derived"`` every gauge master, every row's noise and every decoy draw is a
SHA-256 of the run seed and of what crosses in the frame header (phase, step, frame id); only the run
seed is secret, and a run seed is a small integer. The attack tries seeds 0 … ``seeds``−1 and checks
each against the traffic: it regenerates the forward noise the seed keys and removes it, which with
the right seed leaves every row inside the clip norm C (the rows were clipped before the noise) and
with a wrong one leaves rows of norm about σC√(2D) (it checks two frames). Fresh decoys are noised in
the wire's coordinates, so no gauge is needed to check; verbatim ones were noised before the gauge,
which the seed's gauge then undoes. With the seed found, each frame's gauge gives the exact partition
(the first T rows in the client's order are real). Under ``gauge_entropy="os"`` (the default) nothing
is keyed by the seed, no seed passes, and the attack says so and calls T rows of each frame real at
random (equal scores: AUC 0.5); it never guesses a seed it has not verified.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from splitleak.attacks.partition import LatentFrame, LatentPartition, LatentTraffic, public_latent
from splitleak.defences.decoys import torch_generator
from splitleak.defences.gauges import Gauge, frame_gauge
from splitleak.errors import ConfigError

#: a row within C·(1 + TOL) of the clip counts as inside it (float32 rounding of the wire)
TOL = 1e-4


class GaugeKeySearch(LatentPartition):
    name: ClassVar[str] = "gauge-key-search"
    uses_gradients: ClassVar[bool] = False

    def __init__(self, seeds: int = 4096, seed: int = 0):
        if int(seeds) < 1:
            raise ConfigError(f"gauge-key-search: seeds must be >= 1 (how many run seeds to try), got {seeds}")
        self.seeds, self.seed = int(seeds), seed

    def params(self) -> dict[str, Any]:
        return {"seeds": self.seeds, "seed": self.seed}

    def channels_read(self) -> tuple[str, ...]:
        return ("activations", "row-ids", "shapes")

    def fit(self, history=None, public: dict[str, Any] | None = None, shadow=None):
        """Keep the run's public latent arguments (clip, sigma, decoy release, gauges, width)."""
        self.cfg_ = public_latent(public)
        return self

    def _gauge(self, seed: int, phase: str, f: LatentFrame):
        n, dim = f.x.shape
        if not self.cfg_.gauges:
            return Gauge(np.eye(dim), np.arange(n), None)
        return frame_gauge(seed, phase, f.step, f.frame_id, n, dim, scale=self.cfg_.scale_gauge, entropy="derived")

    def consistent(self, seed: int, phase: str, f: LatentFrame, real_rows: int) -> bool:
        """Whether removing the forward noise ``seed`` keys leaves the frame's released rows inside C."""
        cfg = self.cfg_
        x = f.x.double()
        if cfg.decoy_release == "verbatim":  # noised in the client's coordinates, before the gauge
            x = self._gauge(seed, phase, f).inverse(x)[: min(real_rows, len(x))]
        gen = torch_generator(seed, phase, f.step, "forward", f.frame_id)
        noise = torch.randn(x.shape, generator=gen, dtype=torch.float64)
        return bool(((x - cfg.sigma * cfg.clip * noise).norm(dim=-1) <= cfg.clip * (1 + TOL)).all())

    def partition(self, traffic: LatentTraffic) -> list[tuple[np.ndarray, np.ndarray]]:
        if not hasattr(self, "cfg_"):
            raise ConfigError("call fit(public=the run's latent configuration) before partition")
        cfg, t = self.cfg_, traffic.real_rows
        checks = [f for f in traffic.frames if len(f.x)][:2]
        found = None
        why = ""
        if cfg.sigma <= 0:
            why = "sigma = 0: no forward noise to check a seed against"
        elif not checks:
            why = "no frames to check a seed against"
        else:
            found = next(
                (s for s in range(self.seeds) if all(self.consistent(s, traffic.phase, f, t) for f in checks)), None
            )
            if found is None:
                why = f"no run seed in 0 … {self.seeds - 1} leaves the rows inside the clip once its noise is removed"
        out = []
        rng = np.random.default_rng(self.seed)
        for f in traffic.frames:
            n = len(f.x)
            if found is not None:
                real = self._gauge(found, traffic.phase, f).perm < t
                out.append((real.astype(np.float64), real))
            else:  # uninformative: equal scores, T rows at random
                pred = np.zeros(n, dtype=bool)
                pred[rng.choice(n, size=min(t, n), replace=False)] = True
                out.append((np.full(n, 0.5), pred))
        self.report_ = {
            "found": found is not None,
            "seed": found,
            "seeds_tried": self.seeds if found is None else found + 1,
            "checked_frames": [f.frame_id for f in checks],
            "key_schedule": cfg.gauge_entropy,
            **({"why_not": why} if found is None else {}),
        }
        return out

    def report(self) -> dict[str, Any]:
        return getattr(self, "report_", {})
