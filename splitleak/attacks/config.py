"""The configuration of one attack evaluation (``AttackConfig``, hashed into a job's key) and the
observer-side perturbation of the observed gradients. Running and scoring an evaluation is the
audit stage's (``splitleak.audit.evaluate.run_attack``).

Observer-side gradient perturbations (What Gradients Add §4.4) change what the attacker observes, not training:
Gaussian noise σ × the document's gradient RMS, or symmetric signed rounding to b bits with one
max-abs scale per document.
"""

from __future__ import annotations

import inspect
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from splitleak.attacks.core import ATTACKS, DEFAULT_READOUT, make_attack
from splitleak.attacks.registry import Copy
from splitleak.errors import ConfigError
from splitleak.wire.defences import quantize_symmetric
from splitleak.wire.store import config_hash

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
    """An AttackConfig whose parameters the attack's class takes (by name, checked against its
    signature) and whose read-out is filled with the default for gradient-reading attacks."""
    from pydantic import ValidationError

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
        cfg = AttackConfig(**kw, params=params)
    except ValidationError as exc:
        raise ConfigError(
            "invalid attack configuration: "
            + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        ) from None
    make_attack(cfg.attack, **cfg.attack_params())  # parameter names checked here
    return cfg


def perturb_gradients(grad: torch.Tensor, noise: float | None, bits: int | None, seed: int) -> torch.Tensor:
    """Observer-side perturbation of captured gradients [n, T, d] (What Gradients Add §4.4)."""
    if noise is not None:
        g = torch.Generator().manual_seed(int(seed) * 1_000_003 + 17)
        rms = grad.double().pow(2).mean(dim=(1, 2), keepdim=True).sqrt().to(grad.dtype)
        return grad + noise * rms * torch.randn(grad.shape, generator=g, dtype=grad.dtype)
    if bits is not None:
        return quantize_symmetric(grad, bits)
    return grad
