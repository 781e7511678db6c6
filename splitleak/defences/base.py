"""What every defence shares: the base class, its seeded context, the registry and the chain.

A defence transforms the tensor of a frame in two directions: ``forward`` on the activations the
client sends, ``backward`` on the gradient the server returns. It is pure given its seeded
context: every random draw comes from a generator derived from (run seed, phase, step, direction,
position of the defence in the chain, document id), so the result does not depend on how documents
are batched. Defences compose in a list (``DefenceChain``) and apply in the order given, in both
directions.

Registry: ``DEFENCES`` maps the name used on the command line and in YAML to the class. A family of
defences is one module of this package whose classes carry ``@register``; ``splitleak.defences``
imports every module of the package (``load_family_modules``), so a new defence is one new file.
A defence's arguments are its ``__init__`` signature, checked there with ``check_number``,
``check_choice`` and ``check_bool`` (one message style: the defence, the argument, what is allowed,
the value given).
"""

from __future__ import annotations

import hashlib
import inspect
import math
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

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
#: - ``server``: changes the server side itself (the training side builds it from the defence's public
#:   arguments: ``splitleak.training.replicas.build_server``);
#: - ``client-after-receipt``: changes what the client does with what it sent and received, with state
#:   of its own across steps (``prepare``, ``receive``, ``after_step``);
#: - ``backward-wire``: the output gradient the client returns in a U-shape (``top_gradient``);
#: - ``exposed-loss``: which loss the returned output gradient derives from, in the label-shielded mode
#:   (``exposed_weights``, per target; the Top still learns from the full loss: dual-track), and by how
#:   much the client divides the gradient it gets back for its Bottom (``recovery``).
ROLES = ("client-forward", "return-wire", "server", "client-after-receipt", "backward-wire", "exposed-loss")
#: the channels an attack reads (``AttackInfo.reads``) that each role transforms; an attack built for a defence
#: reads one of them (the contract tests hold every declaration to it), or knowing it changes nothing it reads
ROLE_CHANNELS: dict[str, tuple[str, ...]] = {
    "client-forward": ("activations", "probe-activations"),
    "return-wire": ("gradient",),
    "backward-wire": ("output-gradient",),
    "exposed-loss": ("output-gradient",),
    "server": (),
    "client-after-receipt": (),
}
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
    #: other spellings of an argument a configuration may use -> the ``__init__`` parameter it names (e.g.
    #: mixup's ``lambda``, a Python keyword, is the parameter ``lam``); ``build_defence`` translates them
    aliases: ClassVar[dict[str, str]] = {}

    def roles(self) -> tuple[str, ...]:
        """Where this configured defence acts: both wire directions unless a subclass says less."""
        return ("client-forward", "return-wire")

    def adaptive_attacks(self, mode: str) -> tuple[str, ...]:
        """The attacks built for this configured defence in a run of split ``mode`` ("plain", "u-shape",
        "label-shielded"); by default every declared one (``DefenceChain.adaptive_attacks`` keeps those
        reads traffic of the mode: the contract tests hold every declared one to the attack registry, and to
        reading a channel this configuration transforms). Empty where none applies: ``adaptive_gap`` says why."""
        return self.adaptive

    def adaptive_gap(self, mode: str) -> str:
        """Why no attack is built for this configured defence in a run of split ``mode`` ("" where one is), which
        reports print instead of a plain attack under an adaptive name: by default the note of a defence that names
        none at all; one that names some says for itself where none applies."""
        return "" if self.adaptive or self.adaptive_attacks(mode) else self.adaptive_note

    def transformed_channels(self) -> set[str]:
        """The channels attacks read (``AttackInfo.reads``) that this configured defence transforms."""
        return {c for role in self.roles() for c in ROLE_CHANNELS[role]}

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


def _range_text(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {lo:g}")
    if hi is not None:
        parts.append(f"{'<' if hi_open else '<='} {hi:g}")
    return " and ".join(parts)


def check_number(
    defence: str,
    arg: str,
    value: Any,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
    why: str = "",
) -> float:
    """``value`` as a float, or ConfigError naming the defence, the argument, the range allowed (a finite
    number; ``lo``/``hi`` inclusive unless ``lo_open``/``hi_open``) and the value given."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (lo is None or (value > lo if lo_open else value >= lo))
    ok = ok and (hi is None or (value < hi if hi_open else value <= hi))
    if not ok:
        rng = _range_text(lo, hi, lo_open, hi_open)
        what = f"a finite number {rng}" if rng else "a finite number"
        raise ConfigError(f"{defence}: {arg} must be {what}{why}, got {value!r}")
    return float(value)


def check_integer(defence: str, arg: str, value: Any, lo: int | None = None, *, why: str = "") -> int:
    """``value`` as an int (not a bool), at least ``lo``, or ConfigError as ``check_number`` words it."""
    if isinstance(value, bool) or not isinstance(value, int) or (lo is not None and value < lo):
        rng = "" if lo is None else f" >= {lo}"
        raise ConfigError(f"{defence}: {arg} must be an integer{rng}{why}, got {value!r}")
    return value


def check_choice(defence: str, arg: str, value: Any, allowed: tuple[str, ...]) -> str:
    """``value`` if it is one of ``allowed``, or ConfigError naming them."""
    if value not in allowed:
        raise ConfigError(f"{defence}: {arg} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def check_bool(defence: str, arg: str, value: Any) -> bool:
    """``value`` if it is a bool, or ConfigError."""
    if not isinstance(value, bool):
        raise ConfigError(f"{defence}: {arg} must be true or false, got {value!r}")
    return value


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


#: the attacks that know the chain's forward: SipIt and beam search that pass each candidate's recomputed
#: activation through its public forward and score it under its noise model; joint-aware also knows the
#: rounding of the returned gradient
FORWARD_AWARE = ("sipit-aware", "activation-aware", "joint-aware")


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


#: the registered defences by name (``@register``); filled as ``splitleak.defences`` imports its modules
DEFENCES: dict[str, type[Defence]] = {}

D = TypeVar("D", bound=type[Defence])


def register(cls: D) -> D:
    """Class decorator: put a defence class in ``DEFENCES`` under its ``name`` once ``check_adaptive``
    accepts it. A name registered twice by two classes is refused."""
    if not cls.name:
        raise ConfigError(f"defence class {cls.__qualname__} has no name")
    known = DEFENCES.get(cls.name)
    if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ConfigError(f"defence {cls.name!r} is registered twice: {known.__module__} and {cls.__module__}")
    check_adaptive(cls)
    DEFENCES[cls.name] = cls
    return cls


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
            if not d.adaptive_attacks(mode) and not d.adaptive_gap(mode):
                raise ConfigError(
                    f"defence {cls.name!r} names no attack built for it in a {mode} run, nor why none applies there "
                    "(adaptive_gap)"
                )


def build_defence(name: str, args: dict[str, Any] | None = None) -> Defence:
    """The defence ``name`` with ``args`` (its ``__init__`` parameters, or their ``aliases``); unknown names,
    unknown arguments and values of the wrong type or out of range are refused with the defence and the
    argument named."""
    args = dict(args or {})
    cls = DEFENCES.get(name)
    if cls is None:
        raise ConfigError(f"unknown defence {name!r}; known defences: {', '.join(sorted(DEFENCES))}")
    for alias, param in cls.aliases.items():
        if alias in args:
            if param in args:
                raise ConfigError(f"defence {name!r}: give {alias} or {param}, not both (they are one argument)")
            args[param] = args.pop(alias)
    params = {} if cls.__init__ is object.__init__ else inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    allowed = [p for p in params if p != "self" and params[p].kind is not params[p].VAR_KEYWORD]
    unknown = sorted(set(args) - set(allowed)) if not takes_any else []
    if unknown:
        spelled = {param: alias for alias, param in cls.aliases.items()}
        takes = [spelled.get(p, p) for p in allowed]
        raise ConfigError(
            f"defence {name!r} does not take argument(s) {unknown}; it takes "
            f"{', '.join(takes) if takes else 'no arguments'}"
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


@register
class NoDefence(Defence):
    name = "none"
    search = {}
    adaptive_note = "no mechanism to adapt to: the suite's attacks are the ones built for undefended traffic"

    def roles(self):
        return ()


class DefenceChain:
    """Defences applied in the order given, in both directions. The training code asks the chain
    where its defences act: ``client_transform`` (at most one defence acting after receipt, with
    state of its own, applied by the client before the other forward transforms), ``server_defence``
    (at most one defence acting on the server, whose server side the training code builds),
    ``check_split_mode``.

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

    def backward_defences(self) -> list[Defence]:
        """The defences acting on the returned gradient, in order."""
        return [d for d in self.defences if "return-wire" in d.roles()]

    def backward_rounds(self) -> bool:
        """Whether a defence rounds the returned gradient (a row of zero levels then carries nothing)."""
        return any(d.bits.get("backward") is not None for d in self.backward_defences())

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
        attacks in the order the chain's defences name them. Each reads traffic of ``mode``: the contract
        tests hold every defence's ``adaptive_attacks`` to the attack registry (the defences stand below
        the attacks and do not import them)."""
        out: dict[str, tuple[str, ...]] = {}
        for d in self.defences:
            for name in d.adaptive_attacks(mode):
                out[name] = (*out.get(name, ()), d.name)
        return out
