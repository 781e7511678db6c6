"""Per-request gauges of the decoy system (Setloop decoys paper, §2 and Appendix B).

Each request's frame Z (n rows × D) crosses as Z̃ = Π · diag(s) · Z · R: a Haar rotation R of the
D coordinates, a permutation Π of the rows, and an optional per-row scale and sign s. The client
keeps the gauge and inverts it on the server's reply (``Gauge.inverse``); the server computes on
gauged rows and never learns R, Π or s.

Every draw comes from a counter-mode SHA-256 key derivation, byte for byte as below, so that a
master fixes every number (frozen test vectors in ``tests/test_gauges.py``):

- stream: block t = SHA-256(DOMAIN ‖ master ‖ t as 8 bytes big-endian), t = 0, 1, ...; the blocks
  concatenated and read as big-endian unsigned 64-bit words. Each gauge has its own DOMAIN
  (``DOMAINS``), so the rotation, the permutation and the scale are independent draws;
- uniform in [0, 1): (u64 ≫ 11) · 2⁻⁵³, exact in float64;
- Gaussian: Box–Muller in float64 on consecutive uniform pairs (u₁, u₂):
  √(−2 ln(1 − u₁)) · (cos 2πu₂, sin 2πu₂);
- rotation: QR of a D × D Gaussian matrix (row-major from the stream), Q's columns multiplied by the
  sign of R's diagonal (Haar measure; Mezzadri 2007);
- permutation: Fisher–Yates, i from n−1 down to 1, j uniform in [0, i] by rejection sampling on
  u64 (no modulo bias);
- scale: s = clamp(exp(0.75 · N), 0.2, 5) · (±1), N from the scale stream's Gaussians and the sign
  from the top bit of the next word after them (the sign rule is ours; the paper gives the clamp).

The master (16 bytes) is drawn fresh per frame from OS entropy (``entropy="os"``, the artefact's
128-bit CSPRNG master per draw, 002 Table 15, and the latent mode's default), or derived from the run
seed, the phase, the step, the channel and the frame within the request (``derive_master``,
``entropy="derived"``), so that a run is reproducible. The run seed never crosses
(``splitleak.seeds``), but everything else in ``derive_master`` does, so whoever holds the run seed,
or finds it by trying seeds (``gauge-key-search``), redraws every derived gauge.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from splitleak import seeds
from splitleak.errors import ConfigError

KDF_VERSION = "splitleak/gauge-kdf/v1"
DOMAINS = {
    "rotation": b"splitleak/gauge/rotation/v1\x00",
    "permutation": b"splitleak/gauge/permutation/v1\x00",
    "scale": b"splitleak/gauge/scale/v1\x00",
}
MASTER_BYTES = 16
SCALE_SIGMA = 0.75  # the paper's σ of the log-scale
SCALE_CLAMP = (0.2, 5.0)
ENTROPY = ("derived", "os")


def derive_master(seed: int, phase: str, step: int, channel: str, frame: int = 0) -> bytes:
    """The 128-bit master of one frame's gauges: SHA-256("splitleak/gauge-master/v1|seed|phase|step|
    channel|frame")[:16]. ``channel`` names the wire whose frames the gauge protects (the forward wire
    of the decoy system; a second cloud channel would take another name)."""
    key = f"splitleak/gauge-master/v1|{int(seed)}|{phase}|{int(step)}|{channel}|{int(frame)}".encode()
    return hashlib.sha256(key).digest()[:MASTER_BYTES]


def os_master() -> bytes:
    """A master from OS entropy (the artefact's choice): not reproducible."""
    return seeds.entropy(MASTER_BYTES)


def stream_bytes(domain: bytes, master: bytes, n_bytes: int, start_block: int = 0) -> bytes:
    """``n_bytes`` of the counter-mode stream, from block ``start_block`` on."""
    if len(master) != MASTER_BYTES:
        raise ConfigError(f"a gauge master is {MASTER_BYTES} bytes, got {len(master)}")
    n_blocks = -(-n_bytes // 32)
    out = b"".join(
        hashlib.sha256(domain + master + t.to_bytes(8, "big")).digest()
        for t in range(start_block, start_block + n_blocks)
    )
    return out[:n_bytes]


def words(domain: bytes, master: bytes, n: int) -> np.ndarray:
    """The first ``n`` big-endian u64 words of a stream."""
    return np.frombuffer(stream_bytes(domain, master, 8 * n), dtype=">u8").astype(np.uint64)


def uniforms(w: np.ndarray) -> np.ndarray:
    """(u64 ≫ 11) · 2⁻⁵³: 53 random bits, exact in float64, in [0, 1)."""
    return (w >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _box_muller(u: np.ndarray, n: int) -> np.ndarray:
    """``n`` standard normals from uniforms taken in pairs (u₁, u₂)."""
    u = u.reshape(-1, 2)
    r = np.sqrt(-2.0 * np.log1p(-u[:, 0]))  # 1 − u₁ ∈ (0, 1]: never log 0
    theta = 2.0 * math.pi * u[:, 1]
    return np.stack([r * np.cos(theta), r * np.sin(theta)], axis=1).reshape(-1)[:n]


def gaussians(domain: bytes, master: bytes, n: int) -> np.ndarray:
    """``n`` standard normals by Box–Muller on the stream's uniforms (pairs (u₁, u₂) in order)."""
    return _box_muller(uniforms(words(domain, master, 2 * (-(-n // 2)))), n)


def haar_rotation(master: bytes, dim: int) -> np.ndarray:
    """A Haar-distributed orthogonal dim × dim matrix (float64)."""
    g = gaussians(DOMAINS["rotation"], master, dim * dim).reshape(dim, dim)
    q, r = np.linalg.qr(g)
    signs = np.sign(np.diag(r))
    signs[signs == 0] = 1.0
    return q * signs[None, :]


class _WordStream:
    """Reads the stream one u64 at a time (for rejection sampling), block by block."""

    def __init__(self, domain: bytes, master: bytes):
        self.domain, self.master = domain, master
        self.block, self.buf = 0, np.empty(0, dtype=np.uint64)

    def next(self) -> int:
        if len(self.buf) == 0:
            raw = stream_bytes(self.domain, self.master, 32 * 8, start_block=self.block)  # 32 words at a time
            self.block += 8
            self.buf = np.frombuffer(raw, dtype=">u8").astype(np.uint64)
        v, self.buf = int(self.buf[0]), self.buf[1:]
        return v


def fisher_yates(master: bytes, n: int) -> np.ndarray:
    """A uniform permutation of range(n): Fisher–Yates with unbiased (rejection) draws."""
    perm = np.arange(n)
    src = _WordStream(DOMAINS["permutation"], master)
    for i in range(n - 1, 0, -1):
        m = i + 1
        limit = (1 << 64) - ((1 << 64) % m)
        v = src.next()
        while v >= limit:
            v = src.next()
        j = v % m
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def row_scales(master: bytes, n: int) -> np.ndarray:
    """Per-row scale and sign: clamp(exp(0.75·N), 0.2, 5) · (±1), the signs from the words after the
    Gaussians' (one stream)."""
    pairs = -(-n // 2)
    w = words(DOMAINS["scale"], master, 2 * pairs + n)
    z = _box_muller(uniforms(w[: 2 * pairs]), n)
    signs = np.where((w[2 * pairs :] >> np.uint64(63)) == 1, -1.0, 1.0)
    return np.clip(np.exp(SCALE_SIGMA * z), *SCALE_CLAMP) * signs


@dataclass(frozen=True)
class Gauge:
    """One frame's gauge: Z̃ = Π · diag(s) · Z · R, with (Π Z)[i] = Z[perm[i]]."""

    rotation: np.ndarray  # D × D, orthogonal, float64
    perm: np.ndarray  # n, a permutation of range(n)
    scale: np.ndarray | None  # n, or None (the scale gauge off)

    @classmethod
    def draw(cls, master: bytes, n_rows: int, dim: int, scale: bool = False) -> Gauge:
        return cls(
            haar_rotation(master, dim), fisher_yates(master, n_rows), row_scales(master, n_rows) if scale else None
        )

    def _t(self, a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(a, dtype=like.dtype, device=like.device)

    def apply(self, z: torch.Tensor) -> torch.Tensor:
        """Gauge the rows of ``z`` (n × D); differentiable."""
        if self.scale is not None:
            z = z * self._t(self.scale, z)[:, None]
        z = z @ self._t(self.rotation, z)
        return z[torch.as_tensor(self.perm, device=z.device)]

    def inverse(self, zt: torch.Tensor) -> torch.Tensor:
        """Undo ``apply``: rows back in the client's order and coordinates; differentiable."""
        inv = torch.as_tensor(np.argsort(self.perm), device=zt.device)
        z = zt[inv] @ self._t(self.rotation, zt).T
        if self.scale is not None:
            z = z / self._t(self.scale, z)[:, None]
        return z

    def position_of(self, row: int) -> int:
        """Where row ``row`` of the client's frame sits in the gauged frame."""
        return int(np.nonzero(self.perm == row)[0][0])


def frame_gauge(
    seed: int, phase: str, step: int, frame: int, n_rows: int, dim: int, *, scale: bool, entropy: str = "derived"
) -> Gauge:
    """The gauge of frame ``frame`` of a request of the forward wire."""
    if entropy not in ENTROPY:
        raise ConfigError(f"unknown gauge entropy {entropy!r}; use one of {', '.join(ENTROPY)}")
    master = derive_master(seed, phase, step, "forward", frame) if entropy == "derived" else os_master()
    return Gauge.draw(master, n_rows, dim, scale=scale)
