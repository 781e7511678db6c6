"""What the audit runs: the split of each ``--mode``, and its attacks (``audit_attacks``): the suite in
the main setting of What Gradients Add under two threat models, the exact-inversion check's bound, the
defence-aware readers the traffic calls for and the attacks built for the run's defences."""

from __future__ import annotations

from typing import Any

from splitleak.attacks.registry import attack_info
from splitleak.errors import ConfigError
from splitleak.models import preset_available

DEFAULT_MODEL = "smollm2-135m"
FALLBACK_MODEL = "tiny-gpt2"
DEFAULT_DEPTH = 6
#: checks per position of the audit's exact-inversion check on the trained copy (two rounds of 16)
CERTIFY_CHECKS = 32
#: the attacks the audit runs, (name, parameters, copy), in the main setting of What Gradients Add
#: (k = 32; SipIt with 32 checks per token). Two threat models (What Gradients Add §3): an observer
#: with the public pretrained copy of the client layers, and an attacker holding the client's trained
#: layers. On the trained copy, SipIt is also the exact-inversion check: a position whose recomputed
#: activation matches the observed one is certified (the cut is injective there). The audit bounds it
#: at What Gradients Add's 32 checks per position by default (``certify``): where the candidate order
#: ranks the true token deeper the position is read but not certified, and so are the positions after
#: it (their prefix is then wrong), and the report says within how many checks. Without the bound
#: (``--certify exhaustive``) every position is searched until it matches, at a cost that grows with how
#: deep the candidate order ranks the true tokens (measured in benchmarks/RESULTS.md, "Exhaustive SipIt").
AUDIT_ATTACKS: tuple[tuple[str, dict[str, Any], str], ...] = (
    ("majority", {}, "public"),
    ("vmi", {}, "public"),
    ("activation", {"k": 32}, "public"),
    ("joint", {"k": 32}, "public"),
    ("sipit", {"budget": 32}, "public"),
    ("sipit", {"budget": CERTIFY_CHECKS}, "trained"),
)
#: defence-aware attacks the audit adds when the traffic carries the channel they read
CONDITIONAL_ATTACKS = (("probe_activations", "mixup-unmix", {"k": 32}, "public"),)
#: the audit's settings of the attacks built for a defence (``Defence.adaptive``), as the suite's own: k = 32
#: candidates, 32 checks per position; an attack not listed runs with its defaults
ADAPTIVE_PARAMS: dict[str, dict[str, Any]] = {
    "sipit-aware": {"budget": 32},
    "activation-aware": {"k": 32},
    "seed-search": {"budget": 32},
    "mixup-unmix": {"k": 32},
    "mixup-history": {"k": 32},
    "joint-aware": {"k": 32},
    "crossings-aware": {"k": 32},
}
#: the splits the audit runs in (``--mode``): where the labels go is what changes the server's reading
AUDIT_MODES = ("plain", "u-shape", "label-shielded")
#: the label-shielded audit's Top: 003's five blocks, or as many as leave the Trunk one block (ours)
SHIELDED_TOP = 5
#: the audit's GMA-SL (ours): from uniform logits over 32 candidates per position (gma_candidates), Adam at lr 1.0,
#: chunks of 4 documents, each stopped once its labels have held for 10 steps. On SmolLM2 (16 documents of each
#: of two pinned runs) as many labels right as the reader over the whole vocabulary at lr 0.1 (chunks of 8, 20
#: steps), in 12-16 % of its time: benchmarks/RESULTS.md, "The label-shielded audit's reader"
SHIELDED_READER: dict[str, Any] = {"start": "uniform", "label_patience": 10, "lr": 1.0, "batch": 4, "candidates": 32}
#: readers the audit adds in a split mode: in the label-shielded split the labels are read through the output
#: gradient (GMA-SL, 003 §3)
MODE_ATTACKS: dict[str, tuple[tuple[str, dict[str, Any], str], ...]] = {
    "label-shielded": (("gma-sl", SHIELDED_READER, "public"),)
}


def split_fields(mode: str, depth: int, n_blocks: int) -> dict[str, Any]:
    """The training configuration's split fields for an audit ``mode`` cut after ``depth`` blocks."""
    rest = n_blocks - depth - 1  # blocks between the cut and the client's last one
    if mode == "plain":
        return {"depth": depth}
    if rest < 1:
        raise ConfigError(
            f"--mode {mode} needs at least one server block between the client's first {depth} and its last one; "
            f"the model has {n_blocks} blocks: pass a smaller --depth"
        )
    if mode == "u-shape":
        return {"offload_start": depth, "offload_length": rest}
    return {"shielded": {"bottom": depth, "top": min(SHIELDED_TOP, rest)}}


def check_certify(certify: int | str) -> None:
    if certify != "exhaustive" and (isinstance(certify, bool) or not isinstance(certify, int) or certify < 1):
        raise ConfigError(f"--certify takes a number of checks per position (>= 1) or 'exhaustive', got {certify!r}")


def audit_attacks(
    traffic,
    certify: int | str = CERTIFY_CHECKS,
    adaptive: dict[str, tuple[str, ...]] | None = None,
    mode: str = "plain",
) -> list[tuple[str, dict[str, Any], str]]:
    """``AUDIT_ATTACKS`` with the exact-inversion check's bound (``certify``: checks per position, or
    ``exhaustive``), plus each defence-aware attack whose channel the traffic carries, plus the attacks built
    for the run's defences (``adaptive``: name -> the defences it is built for) on the public copy (but the
    readers of every crossing, ``AttackInfo.passes``, which read the training traffic), and
    ``sipit-aware`` on the trained copy too, where it is the exact-inversion check through the defence."""
    check_certify(certify)
    base = [
        (name, {**params, "budget": certify}, copy) if (name, copy) == ("sipit", "trained") else (name, params, copy)
        for name, params, copy in AUDIT_ATTACKS
    ]
    extra = [
        (name, params, copy) for field, name, params, copy in CONDITIONAL_ATTACKS if getattr(traffic, field) is not None
    ] + list(MODE_ATTACKS.get(mode, ()))
    built = []
    for name in adaptive or {}:
        if attack_info(name).passes:  # read on the training traffic (splitleak.audit.passes)
            continue
        built.append((name, dict(ADAPTIVE_PARAMS.get(name, {})), "public"))
        if name == "sipit-aware":
            built.append((name, {**ADAPTIVE_PARAMS[name], "budget": certify}, "trained"))
    out: list[tuple[str, dict[str, Any], str]] = []
    for item in base + extra + built:
        if not any((item[0], item[2]) == (n, c) for n, _, c in out):
            out.append(item)
    return out


def choose_default_model() -> tuple[str, str]:
    ok, where = preset_available(DEFAULT_MODEL)
    if ok:
        return DEFAULT_MODEL, f"the default real model, from {where}"
    return FALLBACK_MODEL, f"{DEFAULT_MODEL} is not available ({where}); falling back to the tiny random model"
