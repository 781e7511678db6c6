"""The configuration of one attack evaluation (``AttackConfig``, hashed into a job's key), its typed
parameters (``params_model``: each attack's schema, read from its class's signature and checked when
the configuration is built), its identity in tables of results (``IDENTITY``: the store's columns, the
analysis's fields and selectors, the grid report's rows) and the observer-side perturbation of the
observed gradients. Running and scoring an evaluation is the audit stage's
(``splitleak.audit.evaluate.run_attack``).

Observer-side gradient perturbations (What Gradients Add §4.4) change what the attacker observes, not training:
Gaussian noise σ × the document's gradient RMS, or symmetric signed rounding to b bits with one
max-abs scale per document.
"""

from __future__ import annotations

import functools
import inspect
import json
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)

from splitleak.attacks.core import ATTACKS, DEFAULT_READOUT, make_attack
from splitleak.attacks.registry import Copy
from splitleak.defences import quantize_symmetric
from splitleak.errors import ConfigError
from splitleak.files import config_hash

#: hyperparameters that had their own columns before ``params`` existed; they stay top-level keys of
#: the dump (``k`` and ``budget`` always, the others when set), so that earlier job keys do not change
LEGACY_PARAMS = ("k", "budget", "readout", "gradient_source", "lam")


class _LegacyParams(BaseModel):
    """Type checks of the legacy hyperparameters (the others are checked by the attack's class)."""

    model_config = ConfigDict(extra="ignore")
    k: int | None = Field(None, ge=2)
    budget: int | Literal["exhaustive"] | None = None
    # how a gradient-reading attack turns the gradient into tokens (attacks.core.READOUTS)
    readout: Literal["gradient", "pseudo-map"] | None = None
    # which gradient a gradient-reading attack reads: absent is the gradient at the observation
    # point, "output" the U-shape's output gradient (attacks.core.GRADIENT_SOURCES)
    gradient_source: Literal["output"] | None = None
    # mixup-unmix: λ if the attacker knows it (absent: estimated from the traffic)
    lam: float | None = Field(None, gt=0, le=1)


class AttackConfig(BaseModel):
    """One attack evaluation; hashed into ``config_hash``. ``params`` holds the attack's
    hyperparameters, checked against its class's signature (``make_attack_config``), so that any
    registered attack's parameters travel without new columns; ``k=...`` and the other legacy
    names are accepted at the top level too."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attack: str
    client_copy: Copy = "public"
    attack_seed: int = 0
    gradient_noise: float | None = Field(None, ge=0)
    gradient_bits: int | None = Field(None, ge=2, le=16)
    inference: bool = False  # traffic of inference: activations only
    # which recorded traffic: the capture pass over the evaluation documents, or the training steps
    phase: Literal["capture", "train"] = "capture"
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _gather(cls, data):
        if not isinstance(data, dict):
            return data
        data = dict(data)
        params = dict(data.pop("params", None) or {})
        for key in LEGACY_PARAMS:
            value = data.pop(key, None)
            if value is None:
                continue
            if key in params and params[key] != value:
                raise ValueError(f"{key} is given twice, as {value!r} and in params as {params[key]!r}")
            params[key] = value
        data["params"] = {k: v for k, v in params.items() if v is not None}
        return data

    @field_validator("params")
    @classmethod
    def _typed(cls, v):
        if "seed" in v:
            raise ValueError("the attack's seed is attack_seed, not a parameter")
        _LegacyParams(**v)
        return v

    def __getattr__(self, name: str):  # cfg.k, cfg.budget, ...: the legacy names read from params
        if name in LEGACY_PARAMS:
            return self.params.get(name)
        # pydantic defines BaseModel.__getattr__ under `if not TYPE_CHECKING`, so the checker does not see it
        return super().__getattr__(name)  # type: ignore[misc]

    @model_serializer(mode="plain")
    def _dump(self) -> dict[str, Any]:
        # the layout of the columns before params existed, so that the keys of earlier results do not
        # change: k and budget always, readout, gradient_source, lam and phase only when set
        d: dict[str, Any] = {
            "attack": self.attack,
            "k": self.params.get("k"),
            "client_copy": self.client_copy,
            "budget": self.params.get("budget"),
            "attack_seed": self.attack_seed,
            "gradient_noise": self.gradient_noise,
            "gradient_bits": self.gradient_bits,
            "inference": self.inference,
        }
        for key in ("readout", "gradient_source", "lam"):
            if key in self.params:
                d[key] = self.params[key]
        if self.phase != "capture":
            d["phase"] = self.phase
        rest = {k: v for k, v in self.params.items() if k not in LEGACY_PARAMS}
        if rest:
            d["params"] = dict(sorted(rest.items()))
        return d

    def attack_params(self) -> dict[str, Any]:
        return {"seed": self.attack_seed, **self.params}

    def hash(self) -> str:
        return config_hash(self.model_dump(mode="json"))


def make_attack_config(**kw) -> AttackConfig:
    """An AttackConfig whose parameters the attack's class takes, checked when it is built: names, types
    and ranges against the class's ``__init__`` signature (``check_params``), then what the class's
    ``__init__`` checks itself (across parameters); the read-out is filled with the default for
    gradient-reading attacks. This is the one constructor of AttackConfig: a grid expands its spec
    through it, so a bad value is refused before any job runs."""
    if kw.get("attack") not in ATTACKS:
        raise ConfigError(f"unknown attack {kw.get('attack')!r}; known attacks: {', '.join(ATTACKS)}")
    if kw.get("gradient_noise") is not None and kw.get("gradient_bits") is not None:
        raise ConfigError("give either --gradient-noise or --gradient-bits, not both")
    kw = dict(kw)
    params = dict(kw.pop("params", None) or {})
    for key in LEGACY_PARAMS:
        if kw.get(key) is not None:
            params.setdefault(key, kw[key])
        kw.pop(key, None)
    takes = inspect.signature(ATTACKS[kw["attack"]].__init__).parameters
    if params.get("readout") is not None and "readout" not in takes:
        raise ConfigError(f"attack {kw['attack']!r} reads no gradient, so it takes no gradient read-out; drop readout")
    if params.get("readout") is None and "readout" in takes:
        params["readout"] = DEFAULT_READOUT
    if params.get("gradient_source") == "split":
        params.pop("gradient_source")  # the default
    if params.get("gradient_source") is not None and "gradient_source" not in takes:
        raise ConfigError(f"attack {kw['attack']!r} reads no gradient, so it takes no gradient source; drop it")
    if params.get("lam") is not None and "lam" not in takes:
        raise ConfigError(f"attack {kw['attack']!r} takes no lam (only mixup-unmix does)")
    try:
        check_params(kw["attack"], params)  # names, types and ranges, from the class's signature
    except ConfigError as typed:  # where the class's __init__ refuses them too, its own words say more
        raise _own_refusal(kw["attack"], params) or typed from None
    try:
        cfg = AttackConfig(**kw, params=params)
    except ValidationError as exc:
        raise ConfigError(
            "invalid attack configuration: "
            + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        ) from None
    make_attack(cfg.attack, **cfg.attack_params())  # and what its __init__ checks across parameters (width <= k)
    return cfg


# ------------------------------------------------------------------ the attack's parameters, typed


_PARAMS_MODELS: dict[type, type[BaseModel]] = {}


def params_model(cls: type) -> type[BaseModel]:
    """The typed schema of an attack's parameters, read from its class's ``__init__`` signature (the one
    place an attack's parameters live): each parameter's annotation (ranges as ``Annotated[int,
    Field(ge=1)]`` or pydantic's ``PositiveInt``, choices as ``Literal``) and its default. Strict: a value
    of another type is refused, not coerced (``"5"`` is not 5; an int is a float); no other name,
    unless ``__init__`` takes ``**kwargs``."""
    if cls in _PARAMS_MODELS:
        return _PARAMS_MODELS[cls]
    sig = inspect.signature(cls.__init__)  # type: ignore[misc]  # the class's own, not object's
    try:
        hints = typing.get_type_hints(cls.__init__, include_extras=True)  # type: ignore[misc]
    except (NameError, TypeError, AttributeError):  # an annotation not resolvable at run time: untyped
        hints = {}
    fields: dict[str, Any] = {}
    extra: Literal["allow", "forbid"] = "forbid"
    for name, p in list(sig.parameters.items())[1:]:  # [0] is self
        if p.kind is p.VAR_KEYWORD:
            extra = "allow"
        elif p.kind is not p.VAR_POSITIONAL:
            fields[name] = (hints.get(name, Any), ... if p.default is p.empty else p.default)
    config = ConfigDict(strict=True, extra=extra, arbitrary_types_allowed=True)
    _PARAMS_MODELS[cls] = create_model(f"{cls.__name__}Params", __config__=config, **fields)
    return _PARAMS_MODELS[cls]


def check_params(attack: str, params: Mapping[str, Any]) -> None:
    """Refuse (ConfigError) a parameter that ``attack``'s class does not take, or a value outside the type
    and range its signature declares (``params_model``); the message names the attack, each refused
    parameter, its value and what is allowed. None stands for the class's default, as in ``make_attack``."""
    if attack not in ATTACKS:
        raise ConfigError(f"unknown attack {attack!r}; known attacks: {', '.join(ATTACKS)}")
    model = params_model(ATTACKS[attack])
    given = {k: v for k, v in params.items() if v is not None}
    takes = sorted(model.model_fields)
    unknown = sorted(set(given) - set(takes))
    if unknown and model.model_config.get("extra") == "forbid":
        raise ConfigError(f"attack {attack!r} does not take {unknown}; it takes {takes}")
    try:
        model.model_validate(given)
    except ValidationError as exc:
        bad: dict[str, list[str]] = {}
        for e in exc.errors():
            bad.setdefault(str(e["loc"][0]), []).append(e["msg"])
        raise ConfigError(
            f"attack {attack!r}: " + "; ".join(_refusal(name, given.get(name), msgs) for name, msgs in bad.items())
        ) from None


def _own_refusal(attack: str, params: Mapping[str, Any]) -> ConfigError | None:
    """The refusal of ``params`` by the attack class's own ``__init__`` checks, if it has one."""
    try:
        make_attack(attack, **params)
    except ConfigError as exc:
        return exc
    except (TypeError, ValueError, AttributeError, KeyError):  # a value of a type the class does not expect
        return None
    return None


def _refusal(name: str, value: Any, msgs: list[str]) -> str:
    prefix = "Input should be "
    if all(m.startswith(prefix) for m in msgs):  # pydantic's wording: "Input should be greater than 0"
        return f"{name}={value!r} is not allowed: it should be {' or '.join(dict.fromkeys(m[len(prefix) :] for m in msgs))}"
    return f"{name}={value!r} is not allowed: {'; '.join(dict.fromkeys(msgs))}"


# ------------------------------------------------------------------ the attack's identity in tables of results

#: the hyperparameters with a field of their own in every table of results (a store column, an analysis
#: record's field, a selector); every other parameter travels in the canonical ``params`` string
PARAM_FIELDS = ("k", "budget", "readout")
#: identity fields that vary between replicates of one configuration (pooled over, never part of it)
REPLICATE_FIELDS = ("attack_seed",)
#: identity fields the experiment store has no column for (each row also records the whole configuration in its
#: ``attack_config`` column); none since the store gained ``phase`` (a row file written before reads it as null,
#: ``experiments.store.LATER_COLUMNS``)
UNSTORED_FIELDS: tuple[str, ...] = ()


@dataclass(frozen=True)
class IdentityField:
    """One field of an attack's identity: its name, the type of its column (bool, int, float or str) and
    the value a record that does not name it holds."""

    name: str
    kind: type
    default: Any = None


def _kind(annotation: Any) -> type:
    """The column type of a field's annotation: ``int | None`` -> int, ``Literal["a", "b"]`` -> str, a
    union of kinds (``int | Literal["exhaustive"]``) -> str."""
    kinds: set[type] = set()

    def walk(a: Any) -> None:
        origin = get_origin(a)
        if origin is Annotated:
            walk(get_args(a)[0])
        elif origin in (Union, UnionType):
            for x in get_args(a):
                walk(x)
        elif origin is Literal:
            kinds.update(type(v) for v in get_args(a))
        elif a is not type(None):
            kinds.add(a)

    walk(annotation)
    return kinds.pop() if len(kinds) == 1 else str


def _identity_fields() -> tuple[IdentityField, ...]:
    """AttackConfig's fields, with ``params`` split into ``PARAM_FIELDS`` and the canonical rest."""
    out = []
    for name, info in AttackConfig.model_fields.items():
        if name == "params":
            continue
        default = None if info.is_required() else info.get_default(call_default_factory=True)
        out.append(IdentityField(name, _kind(info.annotation), default))
        if name == "attack":
            out.extend(IdentityField(p, _kind(_LegacyParams.model_fields[p].annotation)) for p in PARAM_FIELDS)
    out.append(IdentityField("params", str))
    return tuple(out)


#: the identity of an attack configuration, derived from ``AttackConfig``: what tells two results of attacks
#: apart everywhere (the store's columns, the analysis's records and selectors, the grid report's rows)
IDENTITY: tuple[IdentityField, ...] = _identity_fields()
IDENTITY_FIELDS: tuple[str, ...] = tuple(f.name for f in IDENTITY)
#: the fields of one configuration: the identity less what varies between its replicates
CONFIG_FIELDS: tuple[str, ...] = tuple(n for n in IDENTITY_FIELDS if n not in REPLICATE_FIELDS)
#: the identity's columns in the experiment store
STORED_FIELDS: tuple[IdentityField, ...] = tuple(f for f in IDENTITY if f.name not in UNSTORED_FIELDS)
#: the value of each identity field that a record does not name
IDENTITY_DEFAULTS: dict[str, Any] = {f.name: f.default for f in IDENTITY}


def canonical_params(value: Any) -> str | None:
    """Parameters as one canonical string (JSON, keys sorted, None values dropped), or None for none:
    a dict, or such a string (the store's ``params`` column) read back, so that equal parameters
    compare equal however they were written."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, Mapping):
        raise ConfigError(f"params must be a mapping of parameter names to values, got {value!r}")
    kept = {k: v for k, v in value.items() if v is not None}
    return json.dumps(kept, sort_keys=True) if kept else None


def canonical(name: str, value: Any) -> Any:
    """One identity field's value in canonical form: None -> the field's default, ``budget`` an int or
    ``"exhaustive"`` (the store writes it as a string), ``inference`` a bool, ``params`` canonical JSON."""
    if name == "params":
        return canonical_params(value)
    if value is None:
        return IDENTITY_DEFAULTS.get(name)
    if name == "budget" and isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    if name == "inference":
        return bool(value)
    return value


def attack_identity(record: AttackConfig | Mapping[str, Any]) -> dict[str, Any]:
    """The identity (``IDENTITY_FIELDS``, canonical values) of an attack configuration: an AttackConfig,
    its JSON dump (a result's ``config``, a job's ``attack``, the store's ``attack_config``), or a flat
    record carrying the identity's fields (a store row, an analysis record). Every parameter without a
    field of its own (``gradient_source``, ``lam``, any other) lands in ``params``."""
    if isinstance(record, AttackConfig):
        record = record.model_dump(mode="json")
    rest = json.loads(canonical_params(record.get("params")) or "{}")
    for key in LEGACY_PARAMS:  # the dump keeps them at the top level
        if key not in IDENTITY_FIELDS and record.get(key) is not None:
            rest.setdefault(key, record[key])
    out = {f.name: canonical(f.name, record.get(f.name)) for f in IDENTITY if f.name != "params"}
    for key in PARAM_FIELDS:
        value = rest.pop(key, None)
        if out[key] is None:
            out[key] = canonical(key, value)
    out["params"] = canonical_params(rest)
    return out


@functools.lru_cache(maxsize=4096)
def _identity_of_json(text: str) -> tuple[tuple[str, Any], ...]:
    return tuple(attack_identity(json.loads(text)).items())


def record_identity(record: Mapping[str, Any]) -> dict[str, Any]:
    """The identity of a store row: from its ``attack_config`` (the whole configuration, as the job was
    keyed) where it has one, so that rows written before a field had a column keep their identity
    complete; else from the row's own fields (a hand-built record)."""
    text = record.get("attack_config")
    if isinstance(text, str) and text:
        return dict(_identity_of_json(text))
    return attack_identity(record)


def store_columns(identity: Mapping[str, Any]) -> dict[str, Any]:
    """An identity as the experiment store's columns (``STORED_FIELDS``; ``budget`` as a string)."""
    return {
        f.name: (str(identity[f.name]) if f.kind is str and identity[f.name] is not None else identity[f.name])
        for f in STORED_FIELDS
    }


def perturb_gradients(grad: torch.Tensor, noise: float | None, bits: int | None, seed: int) -> torch.Tensor:
    """Observer-side perturbation of captured gradients [n, T, d] (What Gradients Add §4.4)."""
    if noise is not None:
        g = torch.Generator().manual_seed(int(seed) * 1_000_003 + 17)
        rms = grad.double().pow(2).mean(dim=(1, 2), keepdim=True).sqrt().to(grad.dtype)
        return grad + noise * rms * torch.randn(grad.shape, generator=g, dtype=grad.dtype)
    if bits is not None:
        return quantize_symmetric(grad, bits)
    return grad
