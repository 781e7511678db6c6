"""The attacks by name: ``ATTACKS`` (a live view of ``attacks.registry``) and ``make_attack``. Each
attack lives in its own file (one per family): ``vmi`` (VMI, the majority control), ``beam``
(activation-only, joint, its controls, backward-only), ``sipit``, ``property``, ``mixup_unmix``, ``sip`` (the GRU inverter), ``gma`` (GMA-SL), ``bisr`` (BiSR);
their names are re-exported here.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

from splitleak.attacks.base import Attack, Reconstruction, _RidgeAttack  # noqa: F401
from splitleak.attacks.beam import (  # noqa: F401
    DEFAULT_GRADIENT_SOURCE,
    DEFAULT_READOUT,
    GRADIENT_SOURCES,
    READOUTS,
    ActivationBeam,
    BackwardOnly,
    GradientMap,
    JointBeam,
    RandomCandidate,
    ShuffledGradient,
    derangement,
    gradient_readout,
    merge_candidates,
    random_fill,
)
from splitleak.attacks.property import PropertyInference, choose_property_tokens  # noqa: F401
from splitleak.attacks.registry import REGISTRY
from splitleak.attacks.sipit import SipIt  # noqa: F401
from splitleak.attacks.vmi import VMI, Majority  # noqa: F401
from splitleak.errors import ConfigError


class _Attacks(Mapping):
    """name -> class, a live view of the registry (attacks.registry is the one list of attacks):
    an attack registered at run time is here too."""

    def __getitem__(self, name: str) -> type[Attack]:
        return REGISTRY[name].load()

    def __iter__(self):
        return iter(list(REGISTRY))

    def __len__(self) -> int:
        return len(REGISTRY)


ATTACKS: Mapping[str, type[Attack]] = _Attacks()


def make_attack(name: str, **params) -> Attack:
    cls = ATTACKS.get(name)
    if cls is None:
        raise ConfigError(f"unknown attack {name!r}; known attacks: {', '.join(ATTACKS)}")

    allowed = set(inspect.signature(cls.__init__).parameters) - {"self"}
    given = {k: v for k, v in params.items() if v is not None}
    extra = set(given) - allowed
    if extra:
        raise ConfigError(f"attack {name!r} does not take {sorted(extra)}; it takes {sorted(allowed)}")
    return cls(**given)
