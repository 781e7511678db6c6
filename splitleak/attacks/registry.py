"""What each attack *is*, in one torch-free place.

Every attack registers here with what the rest of the code needs to know about it: the channels it
can read (``splitleak.wire.declare``), what it outputs, whether it is a control, whether it takes a
gradient read-out, its display label and its place in tables, one line of description, and where
its class lives (imported only when the attack runs). The CLI help, the analysis's selectors, the
report's order and the figures' control styling are derived from this table, never from a second
list. It imports no torch, so reports and help text stay light.

Adding an attack: write its class (one file under ``attacks/``), add one ``AttackInfo`` here (or
``register`` it at run time, as a plug-in does); the contract tests check that the two agree
(``tests/test_registry.py``).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Literal, get_args

from splitleak.errors import ConfigError

Output = Literal["tokens", "doc-score", "partition", "labels", "row-tokens", "dose"]
#: the attacker's copy of the client layers: the public pretrained weights, or the run's trained ones
Copy = Literal["public", "trained"]
COPIES: tuple[str, ...] = get_args(Copy)


@dataclass(frozen=True)
class AttackInfo:
    name: str
    cls: str | type  # "module:Class" (loaded when the attack runs), or the class itself
    summary: str
    reads: tuple[str, ...]  # channels it can read; a configured instance may read fewer
    output: Output = "tokens"
    control: bool = False  # a control: reads no signal of the victim's text, or the wrong one on purpose
    control_of: str | None = None  # the attack whose signal this control replaces (None: a control of all)
    takes_readout: bool = False  # takes ``readout`` (the gradient read-out of attacks.core.READOUTS)
    label: str = ""  # display label where it differs from the name (figures)
    #: the split modes whose traffic it reads ("latent": the decoy system; "label-shielded": 003's U-shape)
    modes: tuple[str, ...] = ("plain", "u-shape", "label-shielded")
    needs_top: bool = False  # fits on the pretrained Top (``Knowledge.top``) as well as the client-layer copy
    #: built for defences (``Defence.adaptive`` names it): reads their public arguments (``Knowledge.defences``)
    adaptive: bool = False
    #: for an adaptive attack, the attack it adds its knowledge of the defence to: on a positive control the two
    #: must read differently (``tests/test_adaptive_contract.py``)
    adapts: str | None = None
    #: its reading depends on the attack seed (a seeded draw); False: the same reading under every seed, so
    #: that the jobs of one run and copy that differ only in their seed compute it once (``audit.evaluate``;
    #: ``tests/test_registry.py`` checks the claim on every such attack)
    seeded: bool = True
    #: it reads every crossing of a document at once (the training passes): on traffic where each document
    #: crossed once it is the attack it adapts, so the audit and the grids run it on the training traffic only
    passes: bool = False

    @property
    def display(self) -> str:
        return self.label or self.name

    def load(self) -> type:
        if isinstance(self.cls, type):
            return self.cls
        module, _, attr = self.cls.partition(":")
        return getattr(importlib.import_module(module), attr)


_A = "splitleak.attacks"
#: in the order tables list them
REGISTRY: dict[str, AttackInfo] = {
    a.name: a
    for a in (
        AttackInfo(
            "majority",
            f"{_A}.vmi:Majority",
            "control: the calibration documents' most frequent token at each position",
            reads=(),
            control=True,
            seeded=False,
        ),
        AttackInfo(
            "vmi",
            f"{_A}.vmi:VMI",
            "ridge map from activation to input embedding, nearest token by cosine",
            reads=("activations",),
            seeded=False,
        ),
        AttackInfo(
            "activation",
            f"{_A}.beam:ActivationBeam",
            "k ridge/cosine candidates per position, beam search over recomputed activations",
            reads=("activations",),
            seeded=False,
        ),
        AttackInfo(
            "sipit",
            f"{_A}.sipit:SipIt",
            "per position, check candidates until one's recomputed activation matches",
            reads=("activations",),
            seeded=False,
        ),
        AttackInfo(
            "sipit-aware",
            f"{_A}.aware:AwareSipIt",
            "SipIt that passes each candidate's recomputed activation through the defence chain's public forward "
            "transforms (rounding at the frame's own scale, the row clip) and ranks it by the chain's noise model",
            reads=("activations",),
            adaptive=True,
            adapts="sipit",
            label="SipIt (defence-aware)",
        ),
        AttackInfo(
            "activation-aware",
            f"{_A}.aware:AwareActivationBeam",
            "the activation attacker whose beam scores candidates as sipit-aware checks them",
            reads=("activations",),
            adaptive=True,
            adapts="activation",
            label="activation (defence-aware)",
        ),
        AttackInfo(
            "crossings-aware",
            f"{_A}.crossings:CrossingsAware",
            "activation-aware on the mean of every crossing of each document (the training passes, which the frame "
            "headers name), whose noise the mean divides by the square root of their count; read it with --phase train",
            reads=("activations",),
            adaptive=True,
            adapts="activation-aware",
            label="activation (defence-aware, all crossings)",
            passes=True,
        ),
        AttackInfo(
            "seed-search",
            f"{_A}.seedsearch:SeedSearch",
            "tries run seeds until the forward noise they key leaves every row inside the clip, removes that "
            "noise, then reads as sipit-aware",
            reads=("activations",),
            adaptive=True,
            adapts="sipit-aware",
        ),
        AttackInfo(
            "refit",
            f"{_A}.refit:Refit",
            "the public copy re-fitted to the activations on its own pseudo-tokens, then decoded through it",
            reads=("activations",),
        ),
        AttackInfo(
            "joint",
            f"{_A}.beam:JointBeam",
            "as activation, with half the candidates from the gradient",
            reads=("activations", "gradient", "output-gradient"),
            takes_readout=True,
            seeded=False,
        ),
        AttackInfo(
            "shuffled-gradient",
            f"{_A}.beam:ShuffledGradient",
            "control: the joint attacker given another document's gradient",
            reads=("activations", "gradient", "output-gradient"),
            control=True,
            control_of="joint",
            takes_readout=True,
            label="shuffled-gradient control",
        ),
        AttackInfo(
            "random-candidate",
            f"{_A}.beam:RandomCandidate",
            "control: random tokens for the joint attacker's gradient half",
            reads=("activations",),
            control=True,
            control_of="joint",
            label="random-candidate control",
        ),
        AttackInfo(
            "backward-only",
            f"{_A}.beam:BackwardOnly",
            "the gradient at t-1 alone names token t",
            reads=("gradient", "output-gradient"),
            takes_readout=True,
            seeded=False,
        ),
        AttackInfo(
            "joint-adaptive",
            f"{_A}.adaptive:AdaptiveJointBeam",
            "as joint, with gradient candidates only where their precision, estimated on the traffic, "
            "beats the activation candidates they displace",
            reads=("activations", "gradient", "output-gradient"),
            seeded=False,
        ),
        AttackInfo(
            "joint-aware",
            f"{_A}.joint_aware:AwareJointBeam",
            "as joint on the aware forward (activation-aware), with the activation candidates kept where the "
            "return wire's declared rounding or noise left the gradient row nothing to read",
            reads=("activations", "gradient", "output-gradient"),
            takes_readout=True,
            adaptive=True,
            adapts="joint",
            label="joint (defence-aware)",
        ),
        AttackInfo(
            "joint-crossings",
            f"{_A}.crossings:CrossingsJoint",
            "joint-aware on the mean of every crossing of each document: the returned gradients' fresh noise divided "
            "by the square root of their count; read it with --phase train",
            reads=("activations", "gradient", "output-gradient"),
            takes_readout=True,
            adaptive=True,
            adapts="joint-aware",
            label="joint (defence-aware, all crossings)",
            passes=True,
        ),
        AttackInfo(
            "mixup-history",
            f"{_A}.mixup_history:MixupHistory",
            "mixup without probe rows: unmix each row against the earlier activation rows the server saw "
            "(warm-up rows in clear, then rows it unmixed itself), then the activation attacker",
            reads=("activations",),
            modes=("plain",),
            adaptive=True,
            adapts="activation",
        ),
        AttackInfo(
            "property",
            f"{_A}.property:PropertyInference",
            "per document, gradient norms predict property tokens (ROC AUC) and the leakage index",
            reads=("gradient",),
            output="doc-score",
        ),
        AttackInfo(
            "mixup-unmix",
            f"{_A}.mixup_unmix:MixupUnmix",
            "undo mixup from its probe rows, then the activation attacker",
            reads=("activations", "probe-activations"),
            adaptive=True,
            adapts="activation",
            seeded=False,
        ),
        AttackInfo(
            "support-partition",
            f"{_A}.partition:PartitionAttack",
            "decoy system: a row is real iff its output gradient is non-zero (or: by norm, by a classifier fitted on "
            "the attacker's own shadow frames)",
            reads=("output-gradient", "activations", "trunk-output", "gradient"),
            output="partition",
            modes=("latent",),
        ),
        AttackInfo(
            "latent-probe",
            f"{_A}.probes:ProbeBattery",
            "decoy system: probes trained on known frames name each released row's token (five views x four "
            "models), scored against the most-frequent-token control, with their shuffled-label twins",
            reads=("activations", "output-gradient"),
            output="row-tokens",
            modes=("latent",),
        ),
        AttackInfo(
            "dose-ladder",
            f"{_A}.dose:DoseLadder",
            "decoy system, positive control: a known token leak planted in the captured rows at rising dose (002 "
            "Table 4) and read by probes trained with the client's record; where each metric first detects it (an "
            "instrument check, never a verdict)",
            reads=("activations", "output-gradient"),
            output="dose",
            modes=("latent",),
        ),
        AttackInfo(
            "decoy-history",
            f"{_A}.decoy_history:DecoyHistory",
            "decoy system: a row that matches a row of an earlier frame (its norm, its pairs' Gram triples, the row "
            "itself where ungauged) is called a decoy",
            reads=("activations",),
            output="partition",
            modes=("latent",),
            adaptive=True,
        ),
        AttackInfo(
            "gauge-key-search",
            f"{_A}.gauge_keysearch:GaugeKeySearch",
            "decoy system: tries run seeds until the forward noise they key leaves every row inside the clip, then "
            "rebuilds each frame's gauge (exact partition); fails on OS entropy",
            reads=("activations", "row-ids", "shapes"),
            output="partition",
            modes=("latent",),
            adaptive=True,
        ),
        AttackInfo(
            "sip-gru",
            f"{_A}.sip:SipGRU",
            "a GRU trained on the observer's public text maps each activation sequence to its tokens (SIP)",
            reads=("activations",),
            label="SIP (GRU)",
        ),
        AttackInfo(
            "gma-sl",
            f"{_A}.gma:GMASL",
            "label-shielded: soft labels matched so that the pretrained Top's gradient explains the output gradient",
            reads=("trunk-output", "output-gradient"),
            output="labels",
            modes=("label-shielded",),
            needs_top=True,
            label="GMA-SL",
        ),
        AttackInfo(
            "gma-sl-aware",
            f"{_A}.gma_aware:AwareGMASL",
            "label-shielded: GMA-SL under the exposed loss the defence chain declares (its public scale divided "
            "out or fitted per target, zeroed coordinates masked, seq-dp's clip applied)",
            reads=("trunk-output", "output-gradient"),
            output="labels",
            modes=("label-shielded",),
            needs_top=True,
            adaptive=True,
            adapts="gma-sl",
            label="GMA-SL (defence-aware)",
        ),
        AttackInfo(
            "gma-sl-crossings",
            f"{_A}.crossings:CrossingsGMASL",
            "label-shielded: gma-sl-aware on the mean of every crossing of each document (its trunk outputs and "
            "output gradients over the training passes), whose fresh noise the mean divides; read it with --phase train",
            reads=("trunk-output", "output-gradient"),
            output="labels",
            modes=("label-shielded",),
            needs_top=True,
            adaptive=True,
            adapts="gma-sl-aware",
            label="GMA-SL (defence-aware, all crossings)",
            passes=True,
        ),
        AttackInfo(
            "bisr-b",
            f"{_A}.bisr:BiSRBackward",
            "label-shielded: SIP's reading, then GMA-SL's gradient matching from it (BiSR(b))",
            reads=("activations", "trunk-output", "output-gradient"),
            modes=("label-shielded",),
            needs_top=True,
            label="BiSR(b)",
        ),
        AttackInfo(
            "bisr-f",
            f"{_A}.bisr:BiSRForward",
            "SIP's reading, then relaxed inputs fitted so that the Bottom's copy reproduces the activations (BiSR(f))",
            reads=("activations",),
            label="BiSR(f)",
        ),
        AttackInfo(
            "bisr",
            f"{_A}.bisr:BiSR",
            "label-shielded: SIP, then backward (gradient) matching, then forward (activation) matching (BiSR)",
            reads=("activations", "trunk-output", "output-gradient"),
            modes=("label-shielded",),
            needs_top=True,
            label="BiSR(b+f)",
        ),
    )
}


def register(info: AttackInfo) -> None:
    """Add an attack at run time (a plug-in, or a toy attack in a test); the name must be new."""
    if info.name in REGISTRY:
        raise ConfigError(f"an attack named {info.name!r} is already registered")
    REGISTRY[info.name] = info


def unregister(name: str) -> None:
    REGISTRY.pop(name, None)


#: comma-separated modules that register attacks when imported (plug-ins); the command line, a grid's driver
#: and every grid worker (a local worker process or a Ray task, which start without the driver's registrations)
#: import them before they look an attack up
PLUGINS_ENV = "SPLITLEAK_PLUGINS"


def load_plugins(names: str | None = None) -> list[str]:
    """Import the plug-in modules named in ``names`` (default: the ``SPLITLEAK_PLUGINS`` variable); a module
    already imported is not imported again, so its ``register`` calls run once per process."""
    wanted = [n.strip() for n in (os.environ.get(PLUGINS_ENV, "") if names is None else names).split(",") if n.strip()]
    for name in wanted:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(
                f"{PLUGINS_ENV} names the module {name!r}, which cannot be imported ({exc}); put its folder on "
                f"PYTHONPATH or remove it from {PLUGINS_ENV}"
            ) from exc
    return wanted


def attack_names() -> list[str]:
    return list(REGISTRY)


def attack_info(name: str) -> AttackInfo:
    info = REGISTRY.get(name)
    if info is None:
        raise ConfigError(f"unknown attack {name!r}; known attacks: {', '.join(REGISTRY)}")
    return info


def attacks_for_mode(mode: str) -> list[str]:
    """The attacks that read traffic of a split mode ("plain", "u-shape", "label-shielded" or "latent")."""
    return [n for n, a in REGISTRY.items() if mode in a.modes]


def readout_attacks() -> tuple[str, ...]:
    return tuple(n for n, a in REGISTRY.items() if a.takes_readout)


def adaptive_attacks() -> list[str]:
    """The attacks built for a defence (``AttackInfo.adaptive``)."""
    return [n for n, a in REGISTRY.items() if a.adaptive]


def controls(of: str | None = None) -> dict[str, str]:
    """The control attacks (of one attack, when ``of`` is given) and their display labels."""
    return {n: a.display for n, a in REGISTRY.items() if a.control and (of is None or a.control_of == of)}


def attacks_reading(channel: str) -> list[str]:
    return [n for n, a in REGISTRY.items() if channel in a.reads]


def help_text() -> str:
    return ", ".join(REGISTRY)
