"""Seed search (ours): the forward noise of ``clip-noise`` and ``dp-forward`` is Gaussian, drawn per document
from a generator keyed by SHA-256 of (key, phase, step, direction, position in the chain, document id)
(``splitleak.defences.WireContext``). Everything but the key crosses with the frame (the phase, the
step, the row ids) or is public (the chain). Under ``draws="derived"`` the key is the run seed, an integer
that is 0 unless the user chose another; trying seeds regenerates the noise, and once it is removed only
the deterministic clip remains, which ``sipit-aware`` reads. Under ``draws="os"`` the key is a 128-bit
secret and the search finds nothing (it says so, and the reading is sipit-aware's on the noisy rows).

A candidate key k is tested on what it predicts: the row x = c + n (c the clipped activation, n the noise)
minus the regenerated n_k. With the right key, ||x||² − ||x − n_k||² = ||n||² + 2<c, n>, about +d(σC)²;
with a wrong one, 2<x, n_k> − ||n_k||², about −d(σC)². The statistic is that difference divided by d(σC)²,
averaged over the rows of a few documents: +1 for the key, −1 for any other. A key is accepted when the
mean minus ``z`` (5) standard errors is above 0, on the screening document and again on ``confirm``
documents; a search over thousands of keys then has no false find in practice.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from splitleak.attacks.base import Attack, Budget, Reconstruction
from splitleak.attacks.core import make_attack
from splitleak.attacks.knowledge import Knowledge, Traffic
from splitleak.defences import WireContext
from splitleak.errors import ConfigError
from splitleak.progress import Progress

#: the defences whose forward noise the search regenerates: name -> (clip, std of the noise) from its arguments
NOISY = {
    "clip-noise": lambda a: (a["clip"], a["sigma"] * a["clip"]) if a.get("where", "both") != "backward" else None,
    "dp-forward": lambda a: (a["clip"], a["noise_multiplier"] * a["clip"]),
}


def noisy_last(chain: list[Any]) -> tuple[int, float, float] | None:
    """(position, clip, noise std) of the chain's last forward-acting defence when it adds Gaussian noise
    after a row clip, else None (the noise of an earlier defence is not removable once a later one acts)."""
    forward = [(i, d) for i, d in enumerate(chain) if "client-forward" in d.roles()]
    if not forward:
        return None
    i, d = forward[-1]
    spec = NOISY.get(d.name)
    got = spec(d.args()) if spec else None
    if got is None or got[1] <= 0:
        return None
    return i, float(got[0]), float(got[1])


class SeedSearch(Attack):
    """Tries the run seeds ``0 … seeds − 1`` as the key of the forward noise; removes the noise of the one
    the traffic confirms, then reads with ``sipit-aware`` (``budget`` checks per position)."""

    name = "seed-search"

    def __init__(self, seeds: int = 4096, budget: Budget = 32, confirm: int = 8, z: float = 5.0, seed: int = 0):
        if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
            raise ConfigError(f"seed-search: seeds (how many run seeds to try) must be an integer >= 1, got {seeds!r}")
        if isinstance(confirm, bool) or not isinstance(confirm, int) or confirm < 1:
            raise ConfigError(f"seed-search: confirm must be an integer >= 1, got {confirm!r}")
        if not (isinstance(z, (int, float)) and z > 0):
            raise ConfigError(f"seed-search: z must be a number > 0, got {z!r}")
        self.seeds, self.budget, self.confirm, self.z, self.seed = seeds, budget, confirm, float(z), seed

    def params(self) -> dict[str, Any]:
        return {"seeds": self.seeds, "budget": self.budget, "confirm": self.confirm, "z": self.z, "seed": self.seed}

    def fit(self, knowledge: Knowledge) -> "SeedSearch":
        super().fit(knowledge)
        self.reader_ = make_attack("sipit-aware", budget=self.budget, seed=self.seed)
        return self

    @staticmethod
    def statistic(x: torch.Tensor, noise: torch.Tensor, std: float) -> torch.Tensor:
        """Per row: (||x||² − ||x − noise||²) / (d std²), about +1 when ``noise`` is the row's, −1 otherwise."""
        x64, n64 = x.double(), noise.double()
        return (2 * (x64 * n64).sum(-1) - n64.pow(2).sum(-1)) / (x.shape[-1] * std**2)

    def _noise(self, key: int, traffic: Traffic, row: int, position: int, std: float) -> torch.Tensor:
        """The noise key ``key`` gives row ``row`` of the traffic (as ``gaussian_rows`` draws it)."""
        step = -1 if traffic.steps is None else traffic.steps[row]
        doc = traffic.doc_ids[row]
        ctx = WireContext(key, traffic.phase, step, (doc,), position)
        x = traffic.activations[row]
        return std * torch.randn(x.shape, generator=ctx.generator("forward", doc), dtype=x.dtype)

    def _accepts(self, key: int, traffic: Traffic, rows: list[int], position: int, std: float) -> tuple[bool, float]:
        s = torch.cat(
            [self.statistic(traffic.activations[r], self._noise(key, traffic, r, position, std), std) for r in rows]
        )
        se = float(s.std()) / max(1.0, len(s)) ** 0.5 if len(s) > 1 else float("inf")
        mean = float(s.mean())
        return mean - self.z * se > 0, mean

    def search(self, traffic: Traffic, position: int, std: float, progress: Progress | None = None) -> dict[str, Any]:
        """The first run seed the screening document and ``confirm`` documents accept, or none."""
        confirm_rows = list(range(min(len(traffic), self.confirm)))
        task = progress.start("seed search", self.seeds) if progress is not None else None
        found, best = None, -float("inf")
        try:
            for key in range(self.seeds):
                ok, mean = self._accepts(key, traffic, [0], position, std)
                best = max(best, mean)
                if progress is not None:
                    progress.advance(task)
                if ok and self._accepts(key, traffic, confirm_rows, position, std)[0]:
                    found = key
                    break
        finally:
            if progress is not None:
                progress.finish(task)
        return {"key_found": found is not None, "run_seed": found, "tried": self.seeds if found is None else found + 1,
                "best_statistic": best}  # fmt: skip

    def reconstruct(self, traffic: Traffic, progress: Progress | None = None) -> Reconstruction:
        if not hasattr(self, "knowledge_"):
            raise ConfigError("seed-search: call fit(knowledge) before reconstruct(traffic)")
        kn = self.knowledge_
        noisy = noisy_last(kn.chain())
        if noisy is None:
            summary: dict[str, Any] = {
                "key_found": False,
                "applies": False,
                "why": "no forward noise last in the chain",
            }
            reader_knowledge, read = kn, traffic
        else:
            position, clip, std = noisy
            summary = {"applies": True, "draws": kn.draws, **self.search(traffic, position, std, progress)}
            reader_knowledge, read = kn, traffic
            if summary["key_found"]:
                clean = torch.stack(
                    [traffic.activations[r] - self._noise(summary["run_seed"], traffic, r, position, std)
                     for r in range(len(traffic))]
                )  # fmt: skip
                read = traffic.replace(activations=clean)
                chain_records = [r for r in kn.defences if r["name"] != "none"]
                # the noise is gone: what is left of that defence is its clip
                chain_records[position] = {
                    "name": "clip-noise",
                    "args": {"clip": clip, "sigma": 0.0, "where": "forward"},
                }
                reader_knowledge = dataclasses.replace(kn, defences=tuple(chain_records))
        self.reader_.fit(reader_knowledge)
        rec = self.reader_.reconstruct(read, progress)
        rec.extra["summary"] = summary
        return rec
