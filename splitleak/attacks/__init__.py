"""Turning traffic into text or facts: ridge fit, VMI, beam-search attackers, controls, SipIt,
property inference. Attacks see only ``Knowledge`` (a client-layer copy, calibration documents)
and ``Traffic`` (what crossed the split)."""

from splitleak.attacks.core import (
    ATTACKS,
    ActivationBeam,
    Attack,
    BackwardOnly,
    JointBeam,
    Majority,
    PropertyInference,
    RandomCandidate,
    Reconstruction,
    ShuffledGradient,
    SipIt,
    VMI,
    choose_property_tokens,
    make_attack,
    merge_candidates,
)
from splitleak.attacks.knowledge import ClientCopy, Knowledge, Traffic, load_knowledge, load_traffic
from splitleak.attacks.ridge import RidgeMap, cosine_topk
from splitleak.attacks.run import AttackConfig, make_attack_config, perturb_gradients, run_attack
from splitleak.attacks.search import SearchResult, beam_search, beam_search_naive, sipit

__all__ = [
    "ATTACKS", "ActivationBeam", "Attack", "AttackConfig", "BackwardOnly", "ClientCopy", "JointBeam",
    "Knowledge", "Majority", "PropertyInference", "RandomCandidate", "Reconstruction", "RidgeMap",
    "SearchResult", "ShuffledGradient", "SipIt", "Traffic", "VMI", "beam_search", "beam_search_naive",
    "choose_property_tokens", "cosine_topk", "load_knowledge", "load_traffic", "make_attack",
    "make_attack_config", "merge_candidates", "perturb_gradients", "run_attack", "sipit",
]
