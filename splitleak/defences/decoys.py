"""Decoy rows, boundary clip and noise, and their privacy accounting (the decoy system, Politis &
Pappas 2026, §2 and Table 15).

- ``DecoyPool``: a FIFO of the last ``capacity`` rows of earlier frames, in the client's own
  coordinates, before any gauge: by default the encoder's rows before release, so that a decoy is
  gauged and clipped and noised afresh with the frame (002 Figure 2, steps 3-5); under
  ``decoy_release="verbatim"`` the rows as released, re-sent as they were (a decoy then repeats a
  row the server has already seen, under another gauge). A frame's decoys are drawn from it without
  replacement *before* the frame's own rows enter it. Each row keeps its origin (frame id, row) for
  the client's own record; origins never cross. While the pool holds fewer rows than a frame wants
  (the first requests of a run), the frame carries all the pool has: those frames are shorter
  and their rows are mostly or all real (our choice; the paper does not say how its pool started).
- ``release``: per-row L2 clip to C and Gaussian noise σ·C per coordinate.
- ``gaussian_row_epsilon``: (ε, δ) per row of the Gaussian mechanism under replace-one adjacency
  (sensitivity 2C) with zero-concentrated DP (Bun & Steinke 2016): ρ = Δ²/(2σ²) per release,
  ρ adds over releases, ε = ρ + 2√(ρ ln(1/δ)).
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

from splitleak.errors import ConfigError


def derived_seed(seed: int | bytes, phase: str, step: int, what: str, frame: int) -> int:
    """A 63-bit seed for one draw, keyed by the run seed or (bytes) by a per-run secret."""
    who = f"secret:{seed.hex()}" if isinstance(seed, bytes) else str(int(seed))
    key = f"splitleak/latent|{who}|{phase}|{int(step)}|{what}|{int(frame)}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1)


def torch_generator(seed: int | bytes, phase: str, step: int, what: str, frame: int) -> torch.Generator:
    return torch.Generator().manual_seed(derived_seed(seed, phase, step, what, frame))


def clip_rows(x: torch.Tensor, c: float) -> torch.Tensor:
    """Scale each row (last dimension) to L2 norm at most ``c``; differentiable."""
    norm = x.norm(dim=-1, keepdim=True)
    return x * torch.clamp(c / norm.clamp_min(1e-12), max=1.0)


def release(x: torch.Tensor, c: float, sigma: float, gen: torch.Generator) -> torch.Tensor:
    """clip_rows(x, c) + N(0, (sigma·c)²) per coordinate; ``sigma`` 0 clips only."""
    out = clip_rows(x, c)
    if sigma > 0:
        noise = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.dtype).to(x.device)
        out = out + sigma * c * noise
    return out


class DecoyPool:
    """FIFO of released rows [capacity, D] with their origins (frame id, row)."""

    def __init__(self, capacity: int, width: int, dtype: torch.dtype = torch.float32):
        if capacity < 1:
            raise ConfigError(f"the decoy pool needs capacity >= 1, got {capacity}")
        self.capacity, self.width = capacity, width
        self.rows = torch.zeros(capacity, width, dtype=dtype)
        self.origins = np.full((capacity, 2), -1, dtype=np.int64)
        self.size = 0
        self.head = 0  # where the next row goes (the oldest row once full)

    def __len__(self) -> int:
        return self.size

    def draw(self, k: int, rng: np.random.Generator) -> tuple[torch.Tensor, np.ndarray]:
        """min(k, len) rows without replacement, uniformly; (rows, origins)."""
        m = min(k, self.size)
        idx = rng.choice(self.size, size=m, replace=False) if m else np.zeros(0, dtype=np.int64)
        return self.rows[idx].clone(), self.origins[idx].copy()

    def add(self, rows: torch.Tensor, origins: np.ndarray) -> None:
        """Append rows; the oldest leave once the pool is full."""
        if rows.shape[-1] != self.width or len(rows) != len(origins):
            raise ValueError(f"pool rows must be [m, {self.width}] with one origin each")
        m = len(rows)
        rows, origins = rows[-self.capacity :], np.asarray(origins)[-self.capacity :]  # more than fit: the newest
        idx = (self.head + (m - len(rows)) + np.arange(len(rows))) % self.capacity
        self.rows[torch.as_tensor(idx)] = rows.detach().to(self.rows.dtype).cpu()
        self.origins[idx] = origins
        self.head = (self.head + m) % self.capacity
        self.size = min(self.size + m, self.capacity)


def gaussian_zcdp(sensitivity: float, noise_std: float) -> float:
    """ρ of one Gaussian release with L2 sensitivity Δ and noise standard deviation σ: Δ²/(2σ²)."""
    if noise_std <= 0:
        return math.inf
    return sensitivity**2 / (2.0 * noise_std**2)


def zcdp_epsilon(rho: float, delta: float) -> float:
    """(ε, δ)-DP implied by ρ-zCDP: ε = ρ + 2√(ρ ln(1/δ)) (Bun & Steinke 2016, Prop. 1.3)."""
    if not 0 < delta < 1:
        raise ConfigError(f"delta must be in (0, 1), got {delta}")
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def gaussian_row_epsilon(clip: float, sigma: float, releases: int = 1, delta: float = 1e-6) -> float:
    """ε per row at ``delta`` after ``releases`` releases of the row, each clipped to ``clip`` with
    noise sigma·clip, under replace-one adjacency (Δ = 2·clip)."""
    return zcdp_epsilon(releases * gaussian_zcdp(2.0 * clip, sigma * clip), delta)
