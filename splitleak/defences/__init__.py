"""Defences: transforms of what crosses the split, one module a family (Opacus-style).

``base`` holds what every defence shares (``Defence``, ``WireContext``, ``SearchRange``, the chain, the
registry ``DEFENCES`` and its decorator ``@register``); every other module of this package is a family
whose classes register themselves, but for the decoy system's transforms of the latent mode's frames
(``gauges``: the per-request rotation, permutation and scale; ``decoys``: the decoy pool, clip and
noise, and their accounting), which its client applies and which register nothing. Importing ``splitleak.defences`` imports every module of the package
(``load_family_modules``), so a new defence is one new file here: it then appears in ``DEFENCES``,
``splitleak defences``, ``train --help``, ``tune``'s search space and the contract tests.
"""

import importlib
import pkgutil
from typing import Any

from splitleak.defences.base import (
    DEFENCES,
    FORWARD_AWARE,
    ROLES,
    SPLIT_MODES,
    Defence,
    DefenceChain,
    SearchRange,
    WireContext,
    build_defence,
    canonical_args,
    check_adaptive,
    clip_per_document,
    quantize_symmetric,
    register,
)
from splitleak.errors import ConfigError

#: the families first imported, in this order: ``DEFENCES`` then lists their defences in the order the registry
#: had before it became a package (``tune`` offers the searchable ones in that order); any other module of the
#: package follows, by name, with no edit here
FAMILY_ORDER = ("base", "quant", "noise", "mixup", "replicas", "vmf", "mirage", "masking")


def load_family_modules() -> list[str]:
    """Import every module of this package (its ``__path__``: ``FAMILY_ORDER`` first, then the others by
    name), so that its defences register; returns the modules' full names in that order. Run when the
    package is imported; a module already imported is not run again."""
    names = []
    found = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
    rank = {name: i for i, name in enumerate(FAMILY_ORDER)}
    for name in sorted(found, key=lambda n: (rank.get(n, len(rank)), n)):
        full = f"{__name__}.{name}"
        importlib.import_module(full)
        names.append(full)
    return names


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


FAMILY_MODULES = load_family_modules()

__all__ = [
    "DEFENCES",
    "FAMILY_MODULES",
    "FAMILY_ORDER",
    "FORWARD_AWARE",
    "ROLES",
    "SPLIT_MODES",
    "Defence",
    "DefenceChain",
    "SearchRange",
    "WireContext",
    "build_defence",
    "canonical_args",
    "check_adaptive",
    "clip_per_document",
    "load_family_modules",
    "parse_defence_args",
    "quantize_symmetric",
    "register",
]
