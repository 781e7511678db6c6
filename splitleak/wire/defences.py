"""Defences as wire transforms.

A defence transforms the tensor of a frame in two directions: ``forward`` on the activations the
client sends, ``backward`` on the gradient the server returns. It is pure given its seeded
context: every random draw comes from a generator derived from (run seed, phase, step, direction,
position of the defence in the chain, document id), so the result does not depend on how documents
are batched. Defences compose in a list and apply in the order given, in both directions.

Registry: ``DEFENCES`` maps the name used on the command line and in YAML to the class; adding a
defence is one class and one line there.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from splitleak.errors import ConfigError


@dataclass(frozen=True)
class WireContext:
    """What a defence may know about the frame it transforms. ``secret`` (hex), when set, keys every draw
    instead of the run seed: the client's draws are then fresh to anyone without it (``draws="os"``)."""

    seed: int
    phase: str  # "train" | "capture" | "eval"
    step: int
    doc_ids: tuple[int, ...]
    position: int = 0  # index of the defence in its chain
    secret: str = ""

    @property
    def key(self) -> str:
        """What keys the draws: the secret, or the run seed (``draws="derived"``)."""
        return self.secret or str(self.seed)

    def generator(self, direction: str, doc_id: int, device: torch.device | str = "cpu") -> torch.Generator:
        """A torch generator for one document, derived with SHA-256 from the whole context."""
        key = f"{self.key}|{self.phase}|{self.step}|{direction}|{self.position}|{doc_id}".encode()
        g = torch.Generator(device=device)
        g.manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1))
        return g


#: where a defence acts (``Defence.roles``):
#: - ``client-forward``: transforms the activations the client sends (``forward``);
#: - ``return-wire``: transforms the gradient the server returns at the observation point (``backward``);
#: - ``server``: changes the server side itself (``build_server``);
#: - ``client-after-receipt``: changes what the client does with what it sent and received, with state
#:   of its own across steps (``prepare``, ``receive``, ``after_step``);
#: - ``backward-wire``: the output gradient the client returns in a U-shape (``top_gradient``);
#: - ``exposed-loss``: which loss the returned output gradient derives from, in the label-shielded mode
#:   (``exposed_weights``, per target; the Top still learns from the full loss: dual-track), and by how
#:   much the client divides the gradient it gets back for its Bottom (``recovery``).
ROLES = ("client-forward", "return-wire", "server", "client-after-receipt", "backward-wire", "exposed-loss")
SPLIT_MODES = ("plain", "u-shape", "label-shielded")


@dataclass(frozen=True)
class SearchRange:
    """The range ``splitleak tune`` searches for one argument of a defence (``Defence.search``): a float
    (on a log scale when ``log``) or, with ``integer``, an int from ``low`` to ``high`` inclusive. Every
    range declared here is ours (no paper gives one); ``why`` says what its ends mean."""

    low: float
    high: float
    log: bool = False
    integer: bool = False
    why: str = ""

    def __post_init__(self):
        if not self.low < self.high or (self.log and self.low <= 0):
            raise ValueError(f"a search range needs low < high (and low > 0 on a log scale), got {self}")


class Defence:
    """Base class. Subclasses set ``name`` and override ``forward``/``backward``; the default
    direction is the identity. A defence says where it acts (``roles``, from ``ROLES``) and which
    split modes it supports (``split_modes``); the training code asks it, not its class."""

    name: ClassVar[str] = ""
    #: bits per element on the wire after this defence, per direction; None leaves it unchanged
    bits: ClassVar[dict[str, int | None]] = {"forward": None, "backward": None}
    split_modes: ClassVar[tuple[str, ...]] = SPLIT_MODES
    #: what ``splitleak tune`` may search: argument -> range (ours); ``{}`` offers the defence with its defaults
    #: and no strength to search; ``None`` (the default) leaves it out of a tune unless named
    search: ClassVar[dict[str, SearchRange] | None] = None
    #: the attacks built for this defence (Kerckhoffs: they know its mechanism and public arguments; only
    #: what it draws fresh per release is secret), by registered attack name, for any configuration and
    #: split mode; ``adaptive_attacks`` picks those that apply to one. The audit, grids and ``tune`` run them
    #: wherever the defence is in the chain. Empty only with ``adaptive_note`` saying why none applies.
    adaptive: ClassVar[tuple[str, ...]] = ()
    #: why an attack built for this defence reads no more than the suite's own (or, with ``adaptive`` empty,
    #: why none applies); shown beside the adaptive reading
    adaptive_note: ClassVar[str] = ""

    def roles(self) -> tuple[str, ...]:
        """Where this configured defence acts: both wire directions unless a subclass says less."""
        return ("client-forward", "return-wire")

    def adaptive_attacks(self, mode: str) -> tuple[str, ...]:
        """The attacks built for this configured defence in a run of split ``mode`` ("plain", "u-shape",
        "label-shielded"); by default every declared one (``DefenceChain.adaptive_attacks`` keeps those
        whose registry entry reads traffic of the mode)."""
        return self.adaptive

    def build_server(self, split, chain: "DefenceChain", lr: float, seed: int):
        """A defence acting on the ``server`` returns the server side the client talks to."""
        raise NotImplementedError(f"defence {self.name!r} does not act on the server")

    def forward(self, x: torch.Tensor, ctx: WireContext) -> torch.Tensor:
        return x

    def backward(self, g: torch.Tensor, ctx: WireContext) -> torch.Tensor:
        return g

    # How the forward wire looks to an attacker who knows the mechanism and its public arguments
    # (Kerckhoffs): the forward-wire attacks built for defences (``sipit-aware``, ``activation-aware``)
    # pass each candidate's recomputed activation through these; ``DefenceChain`` composes them.
    def public_forward(self, h: torch.Tensor, observed: torch.Tensor) -> torch.Tensor | None:
        """What the client would have sent for clean rows ``h`` [n, k, d] (k candidates for each of n
        documents), given those documents' observed frames ``observed`` [n, T, d]: ``forward`` without
        its fresh draws (``forward_noise_std``). None: not emulable. Default: the identity."""
        return h

    def forward_noise_std(self) -> float:
        """The standard deviation of the Gaussian noise ``forward`` adds to each entry after
        ``public_forward`` (0: none)."""
        return 0.0

    def forward_spacing(self, observed: torch.Tensor) -> torch.Tensor | None:
        """The spacing of the values ``forward`` sends, per observed document [n] (rounding: its scale):
        emulated rows closer than half of it are the same row. None where the values are continuous."""
        return None

    def top_gradient(self, g: torch.Tensor, ctx: WireContext) -> torch.Tensor:
        """``backward-wire``: the output gradient the client sends back in a U-shape."""
        return g

    def exposed_weights(
        self, w: torch.Tensor, entropy: torch.Tensor, supervised: torch.Tensor, ctx: WireContext
    ) -> torch.Tensor:
        """``exposed-loss``: the per-target weights [docs, T-1] of the loss whose gradient is sent, from the
        weights so far, the Top's predictive entropy at each target and which targets are supervised."""
        return w

    def recovery(self) -> float:
        """``exposed-loss``: the factor the client divides the returned Bottom gradient by (1: none)."""
        return 1.0

    # ``client-after-receipt``: what the client does around a crossing (``ClientRole.exchange``). A defence
    # acting there overrides these; the defaults change nothing.
    def prepare(
        self, h: torch.Tensor, input_ids: torch.Tensor, doc_ids: tuple[int, ...], step: int, phase: str
    ) -> tuple[torch.Tensor, tuple[int, ...], torch.Tensor, dict[str, Any], Any] | None:
        """What the client sends instead of its rows h: (rows, row ids, labels, meta, state), or None
        to send h as it is."""
        return None

    def receive(self, g: torch.Tensor, n: int, state: Any) -> torch.Tensor:
        """The gradient the client applies to its n document rows, from the reply to a prepared frame."""
        return g

    def after_step(self, h: torch.Tensor, doc_ids: tuple[int, ...], step: int, g: torch.Tensor) -> None:
        """After a training step has crossed (h: the rows before ``prepare``, g: the gradient applied)."""

    def args(self) -> dict[str, Any]:
        return {}

    def __repr__(self) -> str:
        a = ", ".join(f"{k}={v}" for k, v in self.args().items())
        return f"{self.name}({a})"


def quantize_symmetric(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric signed rounding to ``bits`` bits with one scale per document (dim 0): the levels
    are k * scale for integer |k| <= 2**(bits-1) - 1, scale = max|x| of the document / that bound.
    Round half to even; a document that is all zero stays zero."""
    if x.dim() < 2:
        raise ValueError("quantize_symmetric expects [docs, ...]")
    qmax = 2 ** (bits - 1) - 1
    reduce = tuple(range(1, x.dim()))
    scale = x.abs().amax(dim=reduce, keepdim=True) / qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(x / safe), -qmax, qmax)
    return torch.where(scale > 0, q * safe, torch.zeros_like(x))


def round_at_scale(x: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """``quantize_symmetric``'s rounding of x [n, ...] at a given scale per document [n] (an attacker's
    emulation at the scale the observed frame reveals)."""
    qmax = 2 ** (bits - 1) - 1
    s = scale.to(x.dtype).view(-1, *([1] * (x.dim() - 1)))
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.clamp(torch.round(x / safe), -qmax, qmax)
    return torch.where(s > 0, q * safe, torch.zeros_like(x))


def clip_per_document(g: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale each document's whole gradient [tokens, width] to L2 norm at most ``max_norm``."""
    norms = g.flatten(1).norm(dim=1).view(-1, *([1] * (g.dim() - 1)))
    factor = torch.clamp(max_norm / torch.clamp(norms, min=torch.finfo(g.dtype).tiny), max=1.0)
    return g * factor


def gaussian_noise_rms(g: torch.Tensor, rel_sigma: float, ctx: WireContext, direction: str) -> torch.Tensor:
    """Add N(0, (rel_sigma * RMS_doc)^2) to each document, RMS taken over its tokens and width."""
    out = torch.empty_like(g)
    for i, doc_id in enumerate(ctx.doc_ids):
        rms = g[i].pow(2).mean().sqrt()
        noise = torch.randn(g[i].shape, generator=ctx.generator(direction, doc_id), dtype=g.dtype)
        out[i] = g[i] + rel_sigma * rms * noise.to(g.device)
    return out


#: the forward-wire attacks that know the chain: SipIt and beam search that pass each candidate's recomputed
#: activation through the chain's public forward transforms and score it under the chain's noise model
FORWARD_AWARE = ("sipit-aware", "activation-aware")


class NoDefence(Defence):
    name = "none"
    search = {}
    adaptive_note = "no mechanism to adapt to: the suite's attacks are the ones built for undefended traffic"

    def roles(self):
        return ()


class Quant(Defence):
    """Symmetric signed rounding of activations and gradients (What Gradients Add §5, "8-bit defence")."""

    name = "quant8"
    n_bits: ClassVar[int] = 8
    bits = {"forward": 8, "backward": 8}
    search = {}
    adaptive = FORWARD_AWARE
    adaptive_note = (
        "rounding is deterministic given each document's scale, which crosses with the frame (its largest "
        "level is the scale times the largest integer): a candidate's activation is rounded as the client's was"
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


class Quant4(Quant):
    name = "quant4"
    n_bits = 4
    bits = {"forward": 4, "backward": 4}


class Quant4Noisy(Quant4):
    """What Gradients Add §5 "4-bit noisy defence": 4-bit activations; the returned gradient is clipped to
    L2 norm ``clip`` per document, gets Gaussian noise ``noise`` x its RMS (after clipping), then
    is rounded to 4 bits — in that order."""

    name = "quant4-noisy"
    search = {
        "noise": SearchRange(0.01, 3.0, log=True, why="ours: from 1 % of the clipped gradient's RMS to 3 times it")
    }

    def __init__(self, clip: float = 1.0, noise: float = 0.1):
        if not clip > 0:
            raise ConfigError(f"quant4-noisy: clip must be > 0, got {clip}")
        if not noise >= 0:
            raise ConfigError(f"quant4-noisy: noise must be >= 0, got {noise}")
        self.clip = float(clip)
        self.noise = float(noise)

    def args(self):
        return {"clip": self.clip, "noise": self.noise}

    def backward(self, g, ctx):
        g = clip_per_document(g, self.clip)
        g = gaussian_noise_rms(g, self.noise, ctx, "backward")
        return quantize_symmetric(g, self.n_bits)


def clip_rows(x: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale every row (one token's vector, last dim) to L2 norm at most ``max_norm``."""
    norms = x.norm(dim=-1, keepdim=True)
    return x * torch.clamp(max_norm / torch.clamp(norms, min=torch.finfo(x.dtype).tiny), max=1.0)


def gaussian_rows(x: torch.Tensor, std: float, ctx: WireContext, direction: str) -> torch.Tensor:
    """Add N(0, std^2) to every entry, drawn per document from the context's generator."""
    out = torch.empty_like(x)
    for i, doc_id in enumerate(ctx.doc_ids):
        noise = torch.randn(x[i].shape, generator=ctx.generator(direction, doc_id), dtype=x.dtype)
        out[i] = x[i] + std * noise.to(x.device)
    return out


#: the searchable per-row L2 clip norm, shared by the defences that clip activation or gradient rows
ROW_CLIP_RANGE = SearchRange(
    0.1,
    1000.0,
    log=True,
    why="ours: from far below to above the rows' norms (SmolLM2-135M at depth 6: median about 100)",
)


class ClipNoise(Defence):
    """Per-row L2 clip to ``clip`` and Gaussian noise ``sigma`` x ``clip``, on the forward wire,
    the returned gradient, or both (``where``)."""

    name = "clip-noise"
    adaptive = (*FORWARD_AWARE, "seed-search")
    adaptive_note = (
        "the clip is deterministic and the noise Gaussian with a public scale: a candidate is scored by its "
        "likelihood after the clip; noise keyed by a guessable run seed is found and removed (seed-search)"
    )
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
        if not clip > 0:
            raise ConfigError(f"clip-noise: clip must be > 0, got {clip}")
        if not sigma >= 0:
            raise ConfigError(f"clip-noise: sigma must be >= 0, got {sigma}")
        if where not in ("forward", "backward", "both"):
            raise ConfigError(f"clip-noise: where must be forward, backward or both, got {where!r}")
        self.clip, self.sigma, self.where = float(clip), float(sigma), where

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
        return self.adaptive if self.where in ("forward", "both") else FORWARD_AWARE

    def forward(self, x, ctx):
        return self._apply(x, ctx, "forward") if self.where in ("forward", "both") else x

    def backward(self, g, ctx):
        return self._apply(g, ctx, "backward") if self.where in ("backward", "both") else g

    def public_forward(self, h, observed):
        return clip_rows(h, self.clip) if self.where in ("forward", "both") else h

    def forward_noise_std(self):
        return self.sigma * self.clip if self.where in ("forward", "both") else 0.0


class DPForward(Defence):
    """DP-forward (Du et al. 2023 style): clip each activation row to L2 norm ``clip`` and add
    Gaussian noise with standard deviation ``noise_multiplier`` x ``clip``. Each row is one release
    of the Gaussian mechanism with sensitivity ``clip``; ``privacy()`` reports its (epsilon, delta)
    and that of one whole document (``tokens`` releases composed), from Opacus's RDP accountant."""

    name = "dp-forward"
    adaptive = (*FORWARD_AWARE, "seed-search")
    adaptive_note = ClipNoise.adaptive_note
    search = {
        "clip": ROW_CLIP_RANGE,
        "noise_multiplier": SearchRange(
            0.01, 10.0, log=True, why="ours: from no meaningful (epsilon, delta) to epsilon well under 1 per row"
        ),
    }

    def __init__(self, noise_multiplier: float = 1.0, clip: float = 1.0, delta: float = 1e-5):
        if not noise_multiplier > 0:
            raise ConfigError(f"dp-forward: noise_multiplier must be > 0, got {noise_multiplier}")
        if not clip > 0:
            raise ConfigError(f"dp-forward: clip must be > 0, got {clip}")
        if not 0 < delta < 1:
            raise ConfigError(f"dp-forward: delta must be in (0, 1), got {delta}")
        self.noise_multiplier, self.clip, self.delta = float(noise_multiplier), float(clip), float(delta)

    def args(self):
        return {"noise_multiplier": self.noise_multiplier, "clip": self.clip, "delta": self.delta}

    def roles(self):
        return ("client-forward",)

    def forward(self, x, ctx):
        return gaussian_rows(clip_rows(x, self.clip), self.noise_multiplier * self.clip, ctx, "forward")

    def public_forward(self, h, observed):
        return clip_rows(h, self.clip)

    def forward_noise_std(self):
        return self.noise_multiplier * self.clip

    def privacy(self, tokens: int = 1) -> dict[str, Any]:
        return gaussian_mechanism_epsilon(self.noise_multiplier, self.delta, releases=tokens)


def gaussian_mechanism_epsilon(noise_multiplier: float, delta: float, releases: int = 1) -> dict[str, Any]:
    """(epsilon, delta) of ``releases`` compositions of the Gaussian mechanism with noise multiplier
    ``noise_multiplier`` (sampling rate 1), from Opacus's RDP accountant."""
    try:
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

    def roles(self):
        return ("client-forward", "client-after-receipt")

    def __init__(self, **kw: Any) -> None:
        lam = kw.pop("lambda", kw.pop("lam", 0.75))
        warmup = kw.pop("warmup", 4)
        pool_rows = kw.pop("pool_rows", 8192)
        correction = kw.pop("correction", "probe")
        if kw:
            raise ConfigError(
                f"defence 'mixup' does not take argument(s) {sorted(kw)}; it takes lambda, warmup, "
                "pool_rows, correction"
            )
        if not (isinstance(lam, (int, float)) and 0 < lam <= 1):
            raise ConfigError(f"mixup: lambda must be in (0, 1], got {lam!r}")
        if not (isinstance(warmup, int) and warmup >= 1):
            raise ConfigError(f"mixup: warmup must be an integer >= 1, got {warmup!r}")
        if not (isinstance(pool_rows, int) and pool_rows >= 1):
            raise ConfigError(f"mixup: pool_rows must be an integer >= 1, got {pool_rows!r}")
        if correction not in CORRECTIONS:
            raise ConfigError(f"mixup: correction must be one of {', '.join(CORRECTIONS)}, got {correction!r}")
        self.lam, self.warmup, self.pool_rows, self.correction = float(lam), warmup, pool_rows, correction
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
            from splitleak.wire.declare import ChannelDecl

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


class ReplicaMedian(Defence):
    """Replica median (What Gradients Add §4.5): ``k`` >= 3 server copies, each with its own seed and a seeded
    relative weight perturbation ``perturbation``, their returned gradients combined by the
    coordinate-wise median; copies deviating by more than ``threshold`` (relative) are flagged.
    The wire transforms are the identity: this defence changes the server side (see
    ``splitleak.training.replicas``)."""

    name = "replica-median"
    split_modes = ("plain",)
    adaptive = ("sipit-aware",)
    adaptive_note = (
        "the activations cross unchanged to every copy, so the forward-wire attacks read them as undefended; "
        "the defence guards the gradient's integrity, not the text"
    )

    def roles(self):
        return ("server",)

    def build_server(self, split, chain, lr, seed):
        from splitleak.training.replicas import ReplicaMedianLink, make_replicas

        return ReplicaMedianLink(make_replicas(split, self.k, self.perturbation, seed), chain, lr, self.threshold)

    def __init__(self, k: int = 3, perturbation: float = 1e-4, threshold: float = 0.02):
        if not (isinstance(k, int) and k >= 3):
            raise ConfigError(
                f"replica-median: k must be an integer >= 3 (a median of fewer copies cannot outvote a liar), got {k!r}"
            )
        if not perturbation >= 0:
            raise ConfigError(f"replica-median: perturbation must be >= 0, got {perturbation}")
        if not threshold > 0:
            raise ConfigError(f"replica-median: threshold must be > 0, got {threshold}")
        self.k, self.perturbation, self.threshold = k, float(perturbation), float(threshold)

    def args(self):
        return {"k": self.k, "perturbation": self.perturbation, "threshold": self.threshold}

    def links(self) -> list[str]:
        """Each copy is its own server on its own link; the client takes the median of the replies."""
        return [f"replica-{r}" for r in range(self.k)]

    def channel_note(self) -> str:
        return (
            f"replica-median: the activations cross to each of {self.k} server copies and each copy returns "
            "its own gradient; the median is taken on the client and never crosses"
        )


class VMFDirection(Defence):
    """Gradient Mirage's directional privatization (003), usable alone: every row of the output gradient
    the client returns in a U-shape (the gradient of its loss with respect to the trunk's output) keeps
    its norm and gets a direction drawn from vMF(its own direction, ``kappa``) (``splitleak.wire.vmf``),
    seeded per document from the wire context. The server trains on the privatized gradient. The default
    ``kappa`` = 1000 is ours (003 gives none): on SmolLM2's 576 dimensions its mean cosine to the raw
    direction is about 0.75. ``privacy()`` gives the metric-DP ε on directions it implies."""

    name = "vmf"
    split_modes = ("u-shape", "label-shielded")
    adaptive = ("gma-sl-aware", "sipit-aware")
    adaptive_note = (
        "vMF keeps each row's norm and is centred on its direction, so the rows' norms and mean directions survive "
        "for gma-sl-aware to match; it changes no activation, which the forward-wire attacks read as undefended"
    )

    def adaptive_attacks(self, mode):
        return ("gma-sl-aware",) if mode == "label-shielded" else ("sipit-aware",)

    def __init__(self, kappa: float = 1000.0):
        if not (isinstance(kappa, (int, float)) and math.isfinite(kappa) and kappa > 0):
            raise ConfigError(f"vmf: kappa must be a finite number > 0, got {kappa!r}")
        self.kappa = float(kappa)

    def args(self):
        return {"kappa": self.kappa}

    def roles(self):
        return ("backward-wire",)

    def top_gradient(self, g: torch.Tensor, ctx: WireContext) -> torch.Tensor:
        from splitleak.wire.vmf import privatize_rows

        out = torch.empty_like(g)
        for i, doc_id in enumerate(ctx.doc_ids):
            out[i] = privatize_rows(g[i], self.kappa, ctx.generator("output-gradient", doc_id))
        return out

    def declare(self, channels):
        from dataclasses import replace

        return [
            replace(c, note=f"after vmf: each row's norm as it was, its direction drawn from vMF(kappa={self.kappa:g})")
            if c.name == "output-gradient"
            else c
            for c in channels
        ]

    def privacy(self) -> dict[str, Any]:
        from splitleak.wire.vmf import vmf_epsilon

        return vmf_epsilon(self.kappa)


DEFENCES: dict[str, type[Defence]] = {
    cls.name: cls
    for cls in (NoDefence, Quant, Quant4, Quant4Noisy, ClipNoise, DPForward, SecretMixup, ReplicaMedian, VMFDirection)
}


def check_adaptive(cls: type[Defence]) -> None:
    """Refuse a defence class that names no attack built for it (``Defence.adaptive``) without saying why
    (``adaptive_note``), or whose configured defaults name none for a split mode it supports: a verdict
    under it would rest on attacks that do not know it. The names' registration is checked by the
    contract tests, which know the attack registry."""
    if not cls.adaptive and not cls.adaptive_note:
        raise ConfigError(
            f"defence {cls.name!r} names no attack built for it: set `adaptive` to the registered attacks that know "
            "its mechanism, or `adaptive_note` to why none applies"
        )
    if cls.adaptive:
        d = build_defence(cls.name) if cls.name in DEFENCES else cls()
        for mode in cls.split_modes:
            if not d.adaptive_attacks(mode):
                raise ConfigError(f"defence {cls.name!r} names no attack built for it in a {mode} run")


def build_defence(name: str, args: dict[str, Any] | None = None) -> Defence:
    """The defence ``name`` with ``args``; unknown names, unknown arguments and values of the wrong
    type or out of range are refused with the defence and the argument named."""
    import inspect

    args = dict(args or {})
    cls = DEFENCES.get(name)
    if cls is None:
        raise ConfigError(f"unknown defence {name!r}; known defences: {', '.join(sorted(DEFENCES))}")
    params = {} if cls.__init__ is object.__init__ else inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    allowed = [p for p in params if p not in ("self", "kw")]
    unknown = sorted(set(args) - set(allowed)) if not takes_any else []
    if unknown:
        raise ConfigError(
            f"defence {name!r} does not take argument(s) {unknown}; it takes "
            f"{', '.join(allowed) if allowed else 'no arguments'}"
        )
    try:
        return cls(**args)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        given = ", ".join(f"{k}={v!r}" for k, v in args.items())
        raise ConfigError(f"defence {name!r}: an argument has a value of the wrong type ({given}): {exc}") from None


def canonical_args(name: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
    """The arguments that identify a configured defence, as a configuration hashes them: those whose
    value differs from the defence's default, each in its default's type (an int given for a float is a
    float). ``mixup`` and ``mixup(lambda=0.75)`` are one configuration, as are ``quant4-noisy(clip=1)``
    and ``quant4-noisy``; the arguments are checked as ``build_defence`` checks them."""
    given = build_defence(name, args).args()
    default = build_defence(name).args()
    out: dict[str, Any] = {}
    for key, value in given.items():
        base = default.get(key)
        if isinstance(base, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if key not in default or value != base or type(value) is not type(base):
            out[key] = value
    return out


class DefenceChain:
    """Defences applied in the order given, in both directions. The training code asks the chain
    where its defences act: ``client_transform`` (at most one defence acting after receipt, with
    state of its own, applied by the client before the other forward transforms), ``build_server``
    (at most one defence acting on the server), ``check_split_mode``.

    ``secret`` (bytes): what keys the chain's draws instead of ``seed`` (the client's, under
    ``draws="os"``: fresh to whoever lacks it, where a run seed can be found by trying seeds)."""

    def __init__(self, defences: list[Defence], seed: int, secret: bytes | None = None):
        self.defences = [d for d in defences if not isinstance(d, NoDefence)]
        self.seed = seed
        self.secret = secret.hex() if secret else ""
        self.client_transform = self._one("client-after-receipt")
        self.server_defence = self._one("server")
        for d in self.defences:
            seeded = getattr(d, "set_seed", None)
            if seeded is not None:
                seeded(self.secret or seed)

    def _one(self, role: str) -> Defence | None:
        acting = [d for d in self.defences if role in d.roles()]
        if len({d.name for d in acting}) < len(acting):
            raise ConfigError(f"{acting[0].name} can appear once in a defence chain")
        if len(acting) > 1:
            raise ConfigError(
                f"{' and '.join(d.name for d in acting)} both act on the {role.replace('-', ' ')}; "
                "a chain takes one of them"
            )
        return acting[0] if acting else None

    def check_split_mode(self, mode: str) -> None:
        """Refuse a defence that does not support the run's split mode ("plain", "u-shape",
        "label-shielded"), naming it and the modes it supports."""
        for d in self.defences:
            if mode not in d.split_modes:
                if mode == "plain" and "u-shape" in d.split_modes:
                    raise ConfigError(
                        f"{d.name} acts on the output gradient a U-shape returns, which a plain split does not "
                        "have; use partial offloading (--offload-start, --offload-length)"
                    )
                if d.split_modes == ("label-shielded",):
                    raise ConfigError(
                        f"{d.name} changes the loss the label-shielded client exposes; use --mode label-shielded"
                    )
                if d.split_modes == ("plain",):
                    raise ConfigError(
                        f"{d.name} is implemented for the plain split only, not for a {mode} run; use --depth"
                    )
                raise ConfigError(f"{d.name} supports {', '.join(d.split_modes)} runs, not {mode}")

    def check_run(self, steps: int) -> None:
        for d in self.defences:
            check = getattr(d, "check_run", None)
            if check is not None:
                check(steps)

    def build_server(self, split, lr: float):
        """The server side a defence acting on the server builds, or None."""
        if self.server_defence is None:
            return None
        return self.server_defence.build_server(split, self, lr, self.seed)

    @classmethod
    def from_specs(cls, specs: list[dict[str, Any]], seed: int, secret: bytes | None = None) -> "DefenceChain":
        return cls([build_defence(s["name"], s.get("args")) for s in specs], seed, secret)

    def _ctx(self, phase, step, doc_ids, position):
        return WireContext(self.seed, phase, step, tuple(doc_ids), position, self.secret)

    def forward(self, x: torch.Tensor, phase: str, step: int, doc_ids) -> torch.Tensor:
        """The forward transforms in order; the client transform was applied before (ClientRole)."""
        for i, d in enumerate(self.defences):
            if d is not self.client_transform:
                x = d.forward(x, self._ctx(phase, step, doc_ids, i))
        return x

    def forward_defences(self) -> list[Defence]:
        """The defences acting on the client forward, in the order the client applies them (its client
        transform first)."""
        first = [self.client_transform] if self.client_transform is not None else []
        rest = [d for d in self.defences if d is not self.client_transform]
        return [d for d in first + rest if "client-forward" in d.roles()]

    def public_forward(self, h: torch.Tensor, observed: torch.Tensor) -> torch.Tensor:
        """The forward wire as an attacker emulates it (``Defence.public_forward`` composed in order) for
        clean rows h [n, k, d] of documents whose frames were ``observed`` [n, T, d]. Refused where a
        defence is not emulable, or transforms the rows after one that added noise or rounded at the
        frame's scale (the frame then shows neither that scale nor a Gaussian residual)."""
        last = None
        for d in self.forward_defences():
            out = d.public_forward(h, observed)
            if out is None:
                raise ConfigError(
                    f"{d.name}'s forward cannot be emulated from its public arguments; read it with "
                    f"{' or '.join(d.adaptive_attacks('plain'))}"
                )
            if last is not None:
                raise ConfigError(
                    f"{d.name} transforms the rows after {last} added noise or rounded them, so the frame no longer "
                    f"shows what {last} sent: put {last} last in the chain for the forward-wire aware attacks"
                )
            if d.forward_noise_std() > 0 or d.forward_spacing(observed) is not None:
                last = d.name
            h = out
        return h

    def forward_noise_std(self) -> float:
        """The per-entry std of the Gaussian noise on the forward wire after ``public_forward`` (0: none)."""
        return math.sqrt(sum(d.forward_noise_std() ** 2 for d in self.forward_defences()))

    def forward_spacing(self, observed: torch.Tensor) -> torch.Tensor | None:
        """The spacing of the values the last forward defence sends, per observed document [n], or None."""
        acting = self.forward_defences()
        return acting[-1].forward_spacing(observed) if acting else None

    def backward(self, g: torch.Tensor, phase: str, step: int, doc_ids) -> torch.Tensor:
        for i, d in enumerate(self.defences):
            g = d.backward(g, self._ctx(phase, step, doc_ids, i))
        return g

    def top_gradient(self, g: torch.Tensor, phase: str, step: int, doc_ids) -> torch.Tensor:
        """The ``backward-wire`` transforms in order, on the output gradient the client returns (U-shape)."""
        for i, d in enumerate(self.defences):
            if "backward-wire" in d.roles():
                g = d.top_gradient(g, self._ctx(phase, step, doc_ids, i))
        return g

    def exposed_weights(
        self, w: torch.Tensor, entropy: torch.Tensor, supervised: torch.Tensor, phase: str, step: int, doc_ids
    ) -> torch.Tensor:
        """The ``exposed-loss`` defences in order: per-target weights of the loss whose gradient is sent."""
        for i, d in enumerate(self.defences):
            if "exposed-loss" in d.roles():
                w = d.exposed_weights(w, entropy, supervised, self._ctx(phase, step, doc_ids, i))
        return w

    @property
    def exposes_other_loss(self) -> bool:
        """Whether the sent gradient derives from another loss than the one the Top learns from (dual-track)."""
        return any("exposed-loss" in d.roles() for d in self.defences)

    def recovery(self) -> float:
        """What the client divides the returned Bottom gradient by (Bottom-gradient recovery; 1: none)."""
        out = 1.0
        for d in self.defences:
            out *= d.recovery()
        return out

    def payload_bits(self, direction: str, base: int) -> int:
        bits = base
        for d in self.defences:
            b = d.bits.get(direction)
            if b is not None:
                bits = min(bits, b)
        return bits

    def describe(self) -> list[dict[str, Any]]:
        return [{"name": d.name, "args": d.args()} for d in self.defences] or [{"name": "none", "args": {}}]

    def adaptive_attacks(self, mode: str) -> dict[str, tuple[str, ...]]:
        """attack name -> the defences of the chain it is built for, in a run of split ``mode``, the
        attacks in the order the chain's defences name them; only attacks whose registry entry reads
        traffic of ``mode``."""
        from splitleak.attacks.registry import attack_info

        out: dict[str, tuple[str, ...]] = {}
        for d in self.defences:
            for name in d.adaptive_attacks(mode):
                if mode in attack_info(name).modes:
                    out[name] = (*out.get(name, ()), d.name)
        return out


from splitleak.wire.mirage import MIRAGE_DEFENCES  # noqa: E402  (one file; its classes subclass Defence above)

DEFENCES.update(MIRAGE_DEFENCES)


def parse_defence_args(items: list[str]) -> dict[str, Any]:
    """``["lambda=0.75", "k=3"]`` -> ``{"lambda": 0.75, "k": 3}`` (numbers parsed, else strings)."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"defence argument {item!r} is not KEY=VALUE (e.g. --defence-arg lambda=0.75)")
        k, v = item.split("=", 1)
        for conv in (int, float):
            try:
                out[k.strip()] = conv(v)
                break
            except ValueError:
                continue
        else:
            out[k.strip()] = {"true": True, "false": False}.get(v.lower(), v)
    return out
