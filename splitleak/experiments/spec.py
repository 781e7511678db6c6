"""Experiment specs: the typed model of a YAML file that names the models, splits, defences, seeds,
attacks and document counts of a grid, the protocol it runs under, and named profiles.

``ExperimentSpec`` and its parts validate one layered spec (unknown keys are refused); the labels of
defence chains (``defence_label``, ``canonical_label``) are how the store's ``defence`` column and an
attack entry's ``defences`` filter name a chain. Reading a spec file, layering its profile and
overrides and explaining a validation error is ``splitleak.experiments.spec_loading``.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic import ValidationError as _VE

from splitleak.attacks.registry import Copy
from splitleak.audit.defaults import CONTROL_DOCS
from splitleak.data import DOC_LEN, N_CALIB, N_EVAL, N_TRAIN
from splitleak.defences import parse_defence_args
from splitleak.errors import ConfigError, SplitleakError
from splitleak.models.latent import preset_split
from splitleak.training.config import DefenceConfig, LatentConfig, ShieldedConfig

PRECISIONS = ("float32", "float64")


def as_list(v: Any) -> Any:
    """A scalar where a list is expected becomes a one-item list (``k: 32`` means ``k: [32]``)."""
    if v is None or isinstance(v, (list, tuple)):
        return v
    return [v]


#: one defence of a chain: the same type as ``TrainConfig.defences`` holds
DefenceItem = DefenceConfig


def defence_label(chain: list[DefenceItem] | tuple[DefenceItem, ...]) -> str:
    """``none``, ``mixup``, ``quant8+clip-noise(clip=2.0,sigma=0.05)``: names joined by ``+``,
    each with its explicit arguments (sorted) in parentheses."""
    parts = []
    for d in chain:
        if d.args:
            parts.append(d.name + "(" + ",".join(f"{k}={d.args[k]}" for k in sorted(d.args)) + ")")
        else:
            parts.append(d.name)
    return "+".join(parts) or "none"


def canonical_label(label: str) -> str:
    """A chain's label as ``defence_label`` writes it for the canonical configuration (``mixup(lambda=0.75)``
    is ``mixup``, ``quant4-noisy(clip=1)`` is ``quant4-noisy``), so that an attack entry's ``defences`` filter
    matches the chain however its arguments were typed. A label that is not a chain of known defences with
    valid arguments (an arm's label, a typo the expansion names) is returned as it is."""
    chain = []
    for part in label.split("+"):
        name, _, rest = part.partition("(")
        if rest and not rest.endswith(")"):
            return label
        try:
            args = parse_defence_args([a for a in rest[:-1].split(",") if a]) if rest else {}
            chain.append(DefenceItem(name=name, args=args))
        except (ValueError, SplitleakError):  # pydantic's ValidationError is a ValueError
            return label
    return defence_label(chain)


def defence_names(chain: list[DefenceItem] | tuple[DefenceItem, ...]) -> str:
    """The chain's names joined by ``+``, without arguments (``mixup``, ``quant8+clip-noise``)."""
    return "+".join(d.name for d in chain) or "none"


class Placements(BaseModel):
    """Partial offloading (What Gradients Add §5): the server trains blocks [b, b + s) for every length s and start b."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    lengths: list[int] = Field(min_length=1)
    starts: list[int] = Field(min_length=1)

    @field_validator("lengths", "starts", mode="before")
    @classmethod
    def _listify(cls, v):
        return as_list(v)

    @field_validator("lengths")
    @classmethod
    def _lengths(cls, v):
        if any(s < 1 for s in v):
            raise ValueError(f"every length must be >= 1, got {v}")
        return v

    @field_validator("starts")
    @classmethod
    def _starts(cls, v):
        if any(b < 0 for b in v):
            raise ValueError(f"every start must be >= 0, got {v}")
        return v


class Perturbation(BaseModel):
    """An observer-side perturbation of the captured gradients (What Gradients Add §4.4): none, Gaussian noise
    ``gradient_noise`` x RMS, or rounding to ``gradient_bits`` bits."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    gradient_noise: float | None = Field(None, ge=0)
    gradient_bits: int | None = Field(None, ge=2, le=16)

    @model_validator(mode="before")
    @classmethod
    def _none_string(cls, v):
        if v is None or v == "none":
            return {}
        return v

    @model_validator(mode="after")
    def _one(self):
        if self.gradient_noise is not None and self.gradient_bits is not None:
            raise ValueError("a perturbation is either gradient_noise or gradient_bits, not both")
        return self

    @property
    def label(self) -> str:
        if self.gradient_noise is not None:
            return f"noise={self.gradient_noise:g}"
        if self.gradient_bits is not None:
            return f"bits={self.gradient_bits}"
        return "none"


class AttackEntry(BaseModel):
    """One line of the attack list; lists (``k``, ``budget``, ``readout``, ``client_copy``,
    ``perturbations``, ``attack_seeds`` and each value of ``params``) expand into one attack
    configuration per combination. ``params`` takes any other hyperparameter of the attack's class
    by name (``params: {lam: [0.6, 0.75]}``); names the class does not take are refused.

    ``phase``: the traffic read, ``capture`` (default) and/or ``train`` (every pass of the training documents;
    under ``adaptive``, ``train`` adds the readers of every crossing, ``AttackInfo.passes``).

    ``inference``: ``false`` counts the configuration in the training setting only; ``true`` also
    counts it in the inference setting, reusing the training measurement (activation-only attacks
    only; What Gradients Add §3); ``only`` runs it on the activations alone, in the inference setting only.
    ``defences`` restricts the entry to train jobs whose defence chain is listed, by label
    (``mixup(lambda=0.6)``, read in its canonical form: ``mixup(lambda=0.75)`` is ``mixup``) or by names
    alone (``mixup``, matching any arguments); default: all.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    attack: str
    k: list[int] | None = None
    budget: list[Union[int, Literal["exhaustive"]]] | None = None
    readout: list[Literal["gradient", "pseudo-map"]] | None = None  # gradient-reading attacks; default: gradient
    client_copy: list[Copy] | None = None  # default: the spec's client_copies
    perturbations: list[Perturbation] = Field(default_factory=lambda: [Perturbation()])
    inference: bool | Literal["only"] = False
    defences: list[str] | None = None
    attack_seeds: list[int] | None = None  # default: the spec's attack_seeds
    #: which traffic: ``capture`` (the evaluation documents, each crossing once; the default) and/or ``train``
    #: (every training step's frames: each training document once per pass, as the server received it)
    phase: list[Literal["capture", "train"]] | None = None
    # any other hyperparameter of the attack's class, by name; a list expands like k does
    params: dict[str, list[Any]] = Field(default_factory=dict)

    @field_validator(
        "k", "budget", "readout", "client_copy", "perturbations", "defences", "attack_seeds", "phase", mode="before"
    )
    @classmethod
    def _listify(cls, v):
        return as_list(v)

    @field_validator("defences", mode="after")
    @classmethod
    def _canonical_labels(cls, v):
        return None if v is None else [canonical_label(lab) for lab in v]

    @field_validator("params", mode="before")
    @classmethod
    def _listify_params(cls, v):
        return {key: as_list(value) for key, value in (v or {}).items()}


#: the decoy system's own learning rate (002 §2: AdamW at 3e-4 on both sides)
LATENT_LR = 3e-4


class LatentArm(BaseModel):
    """One configuration of the decoy system's latent mode (002 §2; ``splitleak train --mode latent``):
    a ``label`` (it names the arm in the store's ``defence`` column and in the report), the ``split``
    (a preset of the model, ``main``, ``mitigation`` or ``ladder-N``, or ``S/R``: split after block S, resume at R),
    ``lr`` (default 3e-4, the paper's) and any other field of ``LatentConfig`` by name
    (``output_gradient: clip-noise``; the naked control: ``sigma: 0, decoys: 0, gauges: false``)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    label: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    split: str = "main"
    lr: float = Field(LATENT_LR, gt=0)

    @model_validator(mode="after")
    def _known_settings(self):
        allowed = set(LatentConfig.model_fields) - {"split_after", "resume_at"}
        unknown = sorted(set(self.model_extra or {}) - allowed)
        if unknown:
            raise ValueError(
                f"the latent arm {self.label!r} sets {', '.join(unknown)}, which the latent mode does not take; "
                f"known: label, split, lr, {', '.join(sorted(allowed))}"
            )
        return self

    @property
    def settings(self) -> dict[str, Any]:
        """The LatentConfig fields this arm sets (besides the split)."""
        return dict(self.model_extra or {})

    def latent_config(self, model: str) -> dict[str, Any]:
        """The ``LatentConfig`` of this arm on ``model`` (as a dict), the split resolved; ConfigError when
        the model has no such preset or a value is out of range."""
        if "/" in self.split:
            try:
                s, r = (int(x) for x in self.split.split("/"))
            except ValueError:
                raise ConfigError(
                    f"latent arm {self.label!r}: split {self.split!r} is not S/R with two block indices, e.g. 15/28"
                ) from None
        else:
            s, r = preset_split(model, self.split)
        try:
            return LatentConfig(split_after=s, resume_at=r, **self.settings).as_dict()
        except _VE as exc:
            msg = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ConfigError(f"latent arm {self.label!r}: {msg}") from None


class ShieldedArm(BaseModel):
    """One configuration of label-shielded split fine-tuning (003 §2; ``splitleak train --mode label-shielded``):
    a ``label`` (it names the arm in the store's ``defence`` column and in the report), the cut (``bottom``
    and ``top`` blocks kept by the client; 003's 6 and 5 by default), who trains (``train``: all,
    trunk-frozen or top-only), ``answer_only`` supervision, the defence ``chain`` on the wire (a name, a
    ``{name, args}`` mapping or a list of those; default none) and an ``lr`` (default: the spec's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    label: str = Field(pattern=r"^[A-Za-z0-9_.=-]+$")
    bottom: int = Field(6, ge=1)
    top: int = Field(5, ge=1)
    train: Literal["all", "trunk-frozen", "top-only"] = "all"
    answer_only: bool = False
    chain: list[DefenceItem] = Field(default_factory=lambda: [DefenceItem(name="none")], min_length=1)
    lr: float | None = Field(None, gt=0)

    @field_validator("chain", mode="before")
    @classmethod
    def _chain_forms(cls, v):
        return [{"name": d} if isinstance(d, str) else d for d in as_list(v)]

    def shielded_config(self) -> dict[str, Any]:
        return ShieldedConfig(
            bottom=self.bottom, top=self.top, train=self.train, answer_only=self.answer_only
        ).as_dict()


class Documents(BaseModel):
    """Document counts and the seed that draws the documents (``TrainConfig.data_seed``): one seed
    for the whole grid, so every victim seed trains and is evaluated on the same documents (What Gradients Add)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    n_calib: int = Field(N_CALIB, ge=1)
    n_train: int = Field(N_TRAIN, ge=1)
    n_eval: int = Field(N_EVAL, ge=1)
    doc_len: int = Field(DOC_LEN, ge=2)
    seed: int = 0

    def train_config_fields(self) -> dict[str, int]:
        return {
            "n_calib": self.n_calib,
            "n_train": self.n_train,
            "n_eval": self.n_eval,
            "doc_len": self.doc_len,
            "data_seed": self.seed,
        }


class DataSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    source: str = "synthetic-pii"
    path: str | None = None  # relative to the spec file


def _public_copy() -> list[Copy]:
    """The default client copy of a spec: the public pretrained weights."""
    return ["public"]


class ExperimentSpec(BaseModel):
    """The typed content of a spec after its profile and overrides are applied."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = None
    description: str = ""
    protocol: str
    models: list[str] = Field(min_length=1)
    model_path: str | None = None  # a local model directory (one model only); relative to the spec file
    precision: str | dict[str, str] = "float32"  # one precision, or per model (default float32)
    depths: list[int] = Field(default_factory=list)
    placements: Placements | None = None
    latent: list[LatentArm] = Field(default_factory=list)  # the decoy system's latent mode (002 §2)
    shielded: list[ShieldedArm] = Field(default_factory=list)  # label-shielded fine-tuning (003 §2)
    defences: list[list[DefenceItem]] = Field(default_factory=lambda: [[DefenceItem(name="none")]])
    victim_seeds: list[int] = Field(min_length=1)
    attack_seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    client_copies: list[Copy] = Field(default_factory=_public_copy, min_length=1)
    attacks: list[AttackEntry] = Field(default_factory=list)
    documents: Documents = Field(default_factory=Documents)
    steps: int | None = Field(None, ge=1)  # None: one pass over the training documents
    lr: float = Field(5e-5, gt=0)
    data: DataSpec = Field(default_factory=DataSpec)
    capture_batch: int = Field(16, ge=1)
    all_local_baseline: bool = True
    #: what keys the client's draws on the wire (``TrainConfig.draws``): os, a fresh secret per run; derived,
    #: the run seed, so that arms of one victim seed share their draws (common random numbers)
    draws: Literal["os", "derived"] = "os"
    #: documents of each token attack's mis-paired twin (``splitleak.audit.verdicts``; at most the evaluation
    #: documents); every token attack of a grid runs one. A value other than the default enters the attack jobs'
    #: keys, so a store measured at the default keeps its keys
    control_docs: int = Field(CONTROL_DOCS, ge=2)
    profiles: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @field_validator("models", "depths", "victim_seeds", "attack_seeds", "client_copies", mode="before")
    @classmethod
    def _listify(cls, v):
        return as_list(v)

    @field_validator("defences", mode="before")
    @classmethod
    def _defence_forms(cls, v):
        # each entry: a name, one {name, args} mapping, or a list of those (a chain)
        if v is None:
            return v
        out = []
        for entry in as_list(v):
            chain = entry if isinstance(entry, (list, tuple)) else [entry]
            out.append([{"name": d} if isinstance(d, str) else d for d in chain])
        return out

    @field_validator("depths")
    @classmethod
    def _depths(cls, v):
        if any(d < 1 for d in v):
            raise ValueError(f"every depth must be >= 1, got {v}")
        return v

    @field_validator("precision")
    @classmethod
    def _precision(cls, v):
        values = v.values() if isinstance(v, dict) else [v]
        bad = [p for p in values if p not in PRECISIONS]
        if bad:
            raise ValueError(f"precision must be float32 or float64, got {bad[0]!r}")
        return v

    @model_validator(mode="after")
    def _splits(self):
        if not self.depths and self.placements is None and not self.latent and not self.shielded:
            raise ValueError(
                "give depths (plain split), placements (partial offloading: lengths, starts), latent "
                "(the decoy system's arms) and/or shielded (label-shielded fine-tuning's arms)"
            )
        labels = [a.label for a in self.latent] + [a.label for a in self.shielded]
        twice = sorted({lab for lab in labels if labels.count(lab) > 1})
        if twice:
            raise ValueError(f"the arm label {twice[0]!r} is used twice; give each arm its own label")
        if self.model_path is not None and len(self.models) != 1:
            raise ValueError("model_path names one local model directory; list exactly one model with it")
        return self

    def precision_of(self, model: str) -> str:
        if isinstance(self.precision, dict):
            return self.precision.get(model, "float32")
        return self.precision
