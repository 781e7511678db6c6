"""Turning traffic into text or facts: ridge fit, VMI, beam-search attackers, controls, SipIt,
property inference, mixup-unmix — one file per attack family (``vmi``, ``beam``, ``sipit``,
``property``, ``mixup_unmix``) on the shape of ``base``. Attacks see only ``Knowledge`` (a client-layer copy, calibration
documents) and ``Traffic`` (what crossed the split). What each attack is lives in the torch-free
``splitleak.attacks.registry``; the names below load lazily, so that importing the registry (for
help text, reports, selectors) does not import torch."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "splitleak.attacks.core": (
        "ATTACKS",
        "ActivationBeam",
        "Attack",
        "BackwardOnly",
        "JointBeam",
        "Majority",
        "PropertyInference",
        "RandomCandidate",
        "Reconstruction",
        "ShuffledGradient",
        "SipIt",
        "VMI",
        "choose_property_tokens",
        "make_attack",
        "merge_candidates",
    ),
    "splitleak.attacks.knowledge": ("ClientCopy", "Knowledge", "Traffic", "load_knowledge", "load_traffic"),
    "splitleak.attacks.ridge": ("RidgeMap", "cosine_topk"),
    "splitleak.attacks.config": ("AttackConfig", "make_attack_config", "perturb_gradients"),
    "splitleak.attacks.search": ("SearchResult", "beam_search", "beam_search_naive", "sipit"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'splitleak.attacks' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
