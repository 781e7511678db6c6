"""Secret mixup (What Gradients Add §4.5): every activation row mixed with a decoy row of an earlier step."""

from __future__ import annotations

import hashlib
from typing import Any, ClassVar

import torch

from splitleak.defences.base import Defence, SearchRange, check_choice, check_integer, check_number, register
from splitleak.errors import ConfigError
from splitleak.wire.declare import ChannelDecl


def decoy_generator(seed: int | str, chunk: int) -> torch.Generator:
    """The generator of one chunk's decoy draw: seeded with SHA-256 of (run seed or secret, chunk index)."""
    digest = hashlib.sha256(f"mixup|{seed}|{chunk}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def draw_decoy_indices(pool_size: int, n: int, seed: int | str, chunk: int) -> torch.Tensor:
    """``n`` distinct indices into a pool of ``pool_size`` rows (without replacement)."""
    if n > pool_size:
        raise ConfigError(
            f"mixup needs {n} decoy rows for this chunk but its pool holds {pool_size}; "
            "raise the defence argument warmup (training steps sent unmixed that fill the pool)"
        )
    return torch.randperm(pool_size, generator=decoy_generator(seed, chunk))[:n]


CORRECTIONS = ("probe", "cached", "none")


@register
class SecretMixup(Defence):
    """Secret mixup (What Gradients Add §4.5): every position sends lambda * (true activation) + (1 - lambda) *
    (decoy). Decoys are real activation rows recycled from earlier training steps of the same run
    (rows the client already sent), drawn without replacement per chunk (one chunk = one document's
    rows) by a generator seeded with SHA-256 of (run seed, chunk index). The pool holds only rows of
    steps before the current one: the first ``warmup`` training steps cross *unmixed* (declared)
    and fill it, so no decoy is ever the current or a later document.

    How the client corrects the returned gradient (``correction``):

    - ``probe`` (What Gradients Add's design): the decoys also cross alone, as probe rows after the document rows
      (``meta.probe_rows``); the server returns their gradient g_decoy without training on them and
      the client uses (g - (1 - lambda) g_decoy) / lambda — exact when the gradient is affine in the
      server's input. The probe rows are clean activations of earlier training documents, paired
      with the mixed rows by frame position: whoever sees the frame unmixes it (``mixup-unmix``).
    - ``cached`` (ours): nothing extra crosses; the client reuses the gradient it applied to the
      decoy row when that row's own document was sent (stale by the steps since).
    - ``none`` (ours): nothing extra crosses; the client applies the chain rule through the mix,
      lambda * g.

    Client-side state: the pool of earlier rows with their provenance and applied gradients, the
    chunk counter, and ``draw_log`` (the provenance of every decoy drawn; it never crosses)."""

    name = "mixup"
    split_modes = ("plain",)
    adaptive = ("mixup-unmix", "mixup-history")
    adaptive_note = (
        "with correction=probe the decoys cross alone beside the mixed rows (mixup-unmix); with cached or none "
        "they are earlier activation rows of the run, the first of which crossed unmixed (mixup-history)"
    )
    search = {"lambda": SearchRange(0.3, 0.95, why="ours: from mostly decoy to almost no mixing")}
    #: configurations spell the mixing weight ``lambda`` (the paper's letter, a Python keyword): it is the
    #: parameter ``lam``; ``args()`` and the configuration hash keep ``lambda``
    aliases: ClassVar[dict[str, str]] = {"lambda": "lam"}

    def roles(self):
        return ("client-forward", "client-after-receipt")

    def __init__(self, lam: float = 0.75, warmup: int = 4, pool_rows: int = 8192, correction: str = "probe") -> None:
        self.lam = check_number(self.name, "lambda", lam, 0.0, 1.0, lo_open=True)
        self.warmup = check_integer(self.name, "warmup", warmup, 1)
        self.pool_rows = check_integer(self.name, "pool_rows", pool_rows, 1)
        self.correction = check_choice(self.name, "correction", correction, CORRECTIONS)
        self.seed: int | str = 0
        self.chunk = 0
        self._pool: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []  # rows, gradients, provenance
        self.draw_log: list[dict] = []
        self.steps_seen = 0

    def args(self):
        return {"lambda": self.lam, "warmup": self.warmup, "pool_rows": self.pool_rows, "correction": self.correction}

    # ---------------------------------------------------------------- channels
    def declare(self, channels):
        out = list(channels)
        if self.correction == "probe":
            out += [
                ChannelDecl(
                    "probe-activations",
                    "client->server",
                    "mixup's decoy rows alone, after the document rows: "
                    "clean activations of earlier training documents, paired by position with the mixed rows",
                    "[docs, tokens, width]",
                ),
                ChannelDecl(
                    "probe-gradient",
                    "server->client",
                    "the gradient of the probe rows, returned untrained on",
                    "[docs, tokens, width]",
                ),
                ChannelDecl(
                    "meta:probe_rows", "client->server", "how many rows of the frame are probes", "integer per frame"
                ),
            ]
        return out

    def channel_note(self) -> str:
        return (
            f"mixup: the first {self.warmup} training step(s) cross unmixed (they fill the decoy pool); "
            f"correction={self.correction}"
        )

    # ---------------------------------------------------------------- pool
    def remember(self, h: torch.Tensor, doc_ids, step: int, gradient: torch.Tensor | None = None) -> None:
        """Add the rows [docs, tokens, width] of a training step that has crossed to the pool (FIFO
        of ``pool_rows`` rows), with their provenance (step, document id, position) and, for
        ``correction=cached``, the gradient the client applied to them."""
        n, T, d = h.shape
        prov = torch.tensor([[step, int(doc), t] for doc in doc_ids for t in range(T)], dtype=torch.long)
        g = None if gradient is None else gradient.detach().reshape(-1, d).cpu()
        self._pool.append((h.detach().reshape(-1, d).cpu(), g, prov))
        self.steps_seen += 1
        while sum(p[0].shape[0] for p in self._pool) - self._pool[0][0].shape[0] >= self.pool_rows:
            self._pool.pop(0)

    def pool_size(self) -> int:
        return sum(p[0].shape[0] for p in self._pool)

    def ready(self, tokens: int) -> bool:
        """Whether the warm-up steps are over and the pool can give one document's decoys without
        replacement."""
        return self.steps_seen >= self.warmup and self.pool_size() >= tokens

    def mix(
        self, x: torch.Tensor, doc_ids=(), step: int = -1, phase: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(mixed activations, decoys, the decoys' cached gradients or None), shaped like x
        [docs, tokens, width]. One chunk is one document's rows: each document's decoys are drawn
        without replacement from the pool with the generator of the next chunk index."""
        pool = torch.cat([p[0] for p in self._pool]) if self._pool else torch.zeros(0, x.shape[-1], dtype=x.dtype)
        prov = torch.cat([p[2] for p in self._pool]) if self._pool else torch.zeros(0, 3, dtype=torch.long)
        grads = None
        if self.correction == "cached":
            applied = []
            for _, grad, _ in self._pool:
                assert grad is not None  # correction=cached: after_step pools every row with its applied gradient
                applied.append(grad)
            grads = torch.cat(applied)
        decoys, cached = [], []
        for i in range(x.shape[0]):
            idx = draw_decoy_indices(pool.shape[0], x.shape[1], self.seed, self.chunk)
            self.draw_log.append(
                {
                    "phase": phase,
                    "step": step,
                    "doc_id": int(doc_ids[i]) if len(doc_ids) else None,
                    "chunk": self.chunk,
                    "sources": prov[idx].tolist(),
                }
            )
            self.chunk += 1
            decoys.append(pool[idx])
            if grads is not None:
                cached.append(grads[idx])
        decoy = torch.stack(decoys).to(x.device, x.dtype)
        g_cached = torch.stack(cached).to(x.device, x.dtype) if grads is not None else None
        return self.lam * x + (1 - self.lam) * decoy, decoy, g_cached

    # ---------------------------------------------------------------- the client transform
    def set_seed(self, seed: int | str) -> None:
        """The run seed (``draws="derived"``) or the run's secret (hex) that keys the decoy draws."""
        self.seed = seed

    def check_run(self, steps: int) -> None:
        if steps < self.warmup:
            raise ConfigError(
                f"mixup sends its first {self.warmup} training step(s) unmixed to fill the decoy pool, "
                f"but the run has only {steps} step(s); lower the defence argument warmup or train longer"
            )

    def prepare(self, h: torch.Tensor, input_ids: torch.Tensor, doc_ids, step: int, phase: str):
        """What the client sends instead of its rows h: (rows, row ids, labels, meta, state), or None
        to send h unmixed (the warm-up steps). State is what ``receive`` needs."""
        if not self.ready(input_ids.shape[1]):
            if phase != "train":
                raise ConfigError("mixup's decoy pool is empty: capture needs training steps first (they fill it)")
            return None
        mixed, decoy, g_cached = self.mix(h, doc_ids, step, phase)
        if self.correction != "probe":
            return mixed, tuple(doc_ids), input_ids, {}, g_cached
        # the decoys travel as probe rows after the document rows; their gradient comes back untrained
        # on. Their ids are the decoy draws' chunk numbers: they do not name a document.
        first = self.chunk - len(doc_ids)
        row_ids = tuple(doc_ids) + tuple(-1 - (first + i) for i in range(len(doc_ids)))
        return torch.cat([mixed, decoy]), row_ids, torch.cat([input_ids, input_ids]), {"probe_rows": len(doc_ids)}, None

    def receive(self, g: torch.Tensor, n: int, state) -> torch.Tensor:
        """The gradient the client applies to its n document rows, from the reply to a mixed frame."""
        g_decoy = g[n:] if self.correction == "probe" else state
        return self.correct(g[:n], g_decoy)

    def after_step(self, h: torch.Tensor, doc_ids, step: int, g: torch.Tensor) -> None:
        """After a training step has crossed: its rows join the decoy pool."""
        self.remember(h, doc_ids, step, g if self.correction == "cached" else None)

    def adaptive_attacks(self, mode):
        return ("mixup-unmix",) if self.correction == "probe" else ("mixup-history",)

    def public_forward(self, h, observed):
        """Not emulable: each row is mixed with a decoy drawn by the client's own draw (``mixup-unmix`` and
        ``mixup-history`` unmix it instead)."""
        return None

    def client_record(self) -> tuple[str, Any]:
        """The client's own record, written into the run (it never crosses): where each decoy came from."""
        return "client/mixup_decoys.json", self.draw_log

    def correct(self, g: torch.Tensor, g_decoy: torch.Tensor | None) -> torch.Tensor:
        """The gradient the client applies to its own activations, from the returned gradient g of
        the mixed rows (and the decoys' gradient: probed, or cached)."""
        if self.correction == "none":
            return self.lam * g
        assert g_decoy is not None  # probe: the probe rows' gradient; cached: the pooled rows' gradients
        return (g - (1 - self.lam) * g_decoy) / self.lam
