"""The typed, hashed configuration of one split-training run."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from splitleak.data import DOC_LEN, N_CALIB, N_EVAL, N_TRAIN
from splitleak.defences import DefenceChain, canonical_args
from splitleak.errors import ConfigError
from splitleak.files import config_hash
from splitleak.seeds import model_init_seed, server_seed


class DefenceConfig(BaseModel):
    """One defence of a chain: its registered name and the arguments that differ from its defaults
    (``canonical_args``), so that one configuration has one hash however its arguments were typed."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    args: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _canonical(cls, data):
        if isinstance(data, dict) and isinstance(data.get("name"), str) and isinstance(data.get("args"), dict | None):
            return {**data, "args": canonical_args(data["name"], data.get("args"))}  # ConfigError names a problem
        return data


class LatentConfig(BaseModel):
    """The decoy system's latent split mode (``splitleak.training.latent``; Politis & Pappas 2026, §2,
    Table 1). Defaults are the paper's evaluated configuration, except where marked ours."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    split_after: int = Field(ge=0)  # last block of the trusted prefix (s)
    resume_at: int = Field(ge=1)  # first block of the trusted tail (r); blocks (s, r) are delegated
    width: int = Field(64, ge=2)  # D
    decoys: int = Field(48, ge=0)  # decoy rows per frame (a frame is one document's rows plus these)
    pool: int = Field(8192, ge=1)  # FIFO of released rows the decoys come from
    clip: float = Field(1.0, gt=0)  # per-row L2 clip C on the forward and return wires
    sigma: float = Field(0.35, ge=0)  # Gaussian noise sigma·C per coordinate on both wires
    output_gradient: Literal["open", "clip-noise"] = "open"  # the paper's main study; "clip-noise": its fix
    output_clip: float = Field(0.01, gt=0)
    output_sigma: float = Field(0.35, ge=0)
    scale_gauge: bool = False  # the per-row scale and sign gauge (off for these surrogates, as in the paper)
    # "fresh" (002 Fig. 2 steps 3-5): the decoys, earlier frames' rows before release, are gauged with the real
    # rows and every row is clipped and noised afresh; "verbatim" (weak): released rows re-sent as they were, so
    # each decoy's norm repeats an earlier row's (decoy-history reads it)
    decoy_release: Literal["fresh", "verbatim"] = "fresh"
    # "os" (002 Table 15): a fresh 128-bit master per frame from os.urandom, noise and decoy draws keyed by a
    # per-run secret from os.urandom (kept in the client's run directory only); "derived": all keyed by the run
    # seed, reproducible, and a key search over seeds rebuilds them (gauge-key-search)
    gauge_entropy: Literal["derived", "os"] = "os"
    gauges: bool = True  # ours: False (no rotation, no permutation) only for the naked control
    teacher_weight: float = Field(1.0, ge=0)  # ours: weight of matching the real delegated blocks
    surrogate_layers: int = Field(1, ge=1)  # ours: one layer, ~94 parameters

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


#: the attacks built for the latent mode's defences (Kerckhoffs: they read its public arguments); the audit
#: and grids run them on latent runs beside support-partition and latent-probe
LATENT_ADAPTIVE: tuple[str, ...] = ("decoy-history", "gauge-key-search")
LATENT_ADAPTIVE_NOTE = (
    "decoy-history matches each row against the rows of earlier frames (a verbatim decoy repeats one); "
    "gauge-key-search tries run seeds under the derived key schedule (it fails on OS entropy)"
)


class ShieldedConfig(BaseModel):
    """Label-shielded split fine-tuning (Gradient Mirage, 003 §2): a U-shape whose Bottom (embeddings and
    the first ``bottom`` blocks) and Top (the last ``top`` blocks, final norm, head) stay on the client with
    the inputs, labels and loss, and whose Trunk (every block between) runs on the server. The paper cuts
    6 / rest / 5; SmolLM2 gets the same counts. ``train``: ``all`` (Bottom, Trunk and Top train),
    ``trunk-frozen`` (003 App. C.6: the server's Trunk does not step; Top and Bottom do) or ``top-only``
    (the baseline: only the Top trains and no gradient crosses). ``answer_only``: supervise the answer
    tokens of instruction documents only (the data source ``instructions``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bottom: int = Field(6, ge=1)
    top: int = Field(5, ge=1)
    train: Literal["all", "trunk-frozen", "top-only"] = "all"
    answer_only: bool = False

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class _ModelAndSplit(BaseModel):
    """The fields both nodes know: the model, the split and the defence chain."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = "tiny-gpt2"
    model_path: str | None = None
    precision: Literal["float32", "float64"] = "float32"
    depth: int | None = None
    offload_start: int | None = None
    offload_length: int | None = None
    defences: tuple[DefenceConfig, ...] = (DefenceConfig(name="none"),)
    latent: LatentConfig | None = None  # the decoy system's latent mode instead of a split at --depth
    shielded: ShieldedConfig | None = None  # label-shielded split fine-tuning instead of a split at --depth

    @model_validator(mode="after")
    def _one_mode(self):
        if self.shielded is not None:
            if self.latent is not None:
                raise ValueError("choose one mode: the latent mode or the label-shielded one")
            if self.depth is not None or self.offload_start is not None or self.offload_length is not None:
                raise ValueError(
                    "the label-shielded mode cuts where --bottom-blocks/--top-blocks say; omit --depth and offloading"
                )
        if self.latent is not None:
            if self.depth is not None or self.offload_start is not None or self.offload_length is not None:
                raise ValueError(
                    "the latent mode cuts where --split-after/--resume-at say; omit --depth and offloading"
                )
            if any(d.name != "none" for d in self.defences):
                raise ValueError(
                    "the latent mode brings its own defences (bottleneck, decoys, gauges, clip and noise); "
                    "omit --defence"
                )
            if getattr(self, "draws", None) == "derived" and self.latent.gauge_entropy == "os":
                raise ValueError(
                    "the latent mode keys its gauges, noise and decoy draws by its own gauge_entropy, not by --draws: "
                    "pass --latent-arg gauge_entropy=derived for reproducible draws"
                )
        return self

    def as_dict(self) -> dict[str, Any]:
        d = self.model_dump(mode="json")
        for mode in ("latent", "shielded"):
            if d.get(mode) is None:
                d.pop(mode, None)  # a split run's hash is what it was before these modes existed
        if d.get("draws") == "derived":
            d.pop("draws")  # draws keyed by the run seed: the hash of a run made before the choice existed
        return d

    def hash(self) -> str:
        return config_hash(self.as_dict())


def draws_of(config: dict[str, Any]) -> str:
    """The draws of a configuration as ``TrainConfig.as_dict`` writes it (a manifest's, a grid job's): ``as_dict``
    leaves ``derived`` out, so a dictionary without the key was keyed by the run seed."""
    return str(config.get("draws", "derived"))


class TrainConfig(_ModelAndSplit):
    """Everything that determines a run's numbers. Runtime choices (device, threads, output
    folder) are not part of it and do not change its hash."""

    data: str = "synthetic-pii"
    data_path: str | None = None
    seed: int = 0  # the victim seed: training order, defence randomness, a random model's init
    data_seed: int = 0  # draws the calibration / train / evaluation documents, shared across victim seeds
    steps: int | None = None  # None: one pass over the training documents
    lr: float = 5e-5
    n_calib: int = Field(N_CALIB, ge=1)
    n_train: int = Field(N_TRAIN, ge=1)
    n_eval: int = Field(N_EVAL, ge=1)
    doc_len: int = Field(DOC_LEN, ge=2)
    capture_batch: int = Field(16, ge=1)
    all_local_baseline: bool = True
    #: what keys the client's random draws on the wire (forward noise, mixup's decoys, the label-shielded
    #: defences' scales, masks and directions): "os", a 128-bit secret from OS entropy per run, kept in the
    #: client's own record (``client/draws.json``, never crosses); "derived", the run seed (reproducible bit
    #: for bit, but a seed from a small range is found by trying seeds: the ``seed-search`` attack)
    draws: Literal["os", "derived"] = "os"

    @field_validator("steps")
    @classmethod
    def _steps(cls, v):
        if v is not None and v < 1:
            raise ValueError("steps must be >= 1")
        return v

    @property
    def n_steps(self) -> int:
        return self.steps if self.steps is not None else self.n_train


def split_mode_of(config: "_ModelAndSplit") -> str:
    """The split mode of a configuration: "latent", "label-shielded", "u-shape" or "plain"."""
    if config.latent is not None:
        return "latent"
    if config.shielded is not None:
        return "label-shielded"
    return "u-shape" if config.offload_start is not None else "plain"


def adaptive_attacks_of(config: "_ModelAndSplit") -> dict[str, tuple[str, ...]]:
    """The attacks built for the defences of a configuration (attack name -> the defences it is built for),
    as the audit, grids and ``tune`` run them: the chain's (``DefenceChain.adaptive_attacks``) or, in the
    latent mode, the decoy system's own."""
    mode = split_mode_of(config)
    if mode == "latent":
        return {name: ("latent",) for name in LATENT_ADAPTIVE}
    return DefenceChain.from_specs([d.model_dump() for d in config.defences], seed=0).adaptive_attacks(mode)


#: the fields of a TrainConfig the untrusted server needs (model, split, defences, optimiser, sizes)
SERVER_FIELDS = (
    "model",
    "model_path",
    "precision",
    "depth",
    "offload_start",
    "offload_length",
    "defences",
    "latent",
    "shielded",
    "lr",
    "doc_len",
    "capture_batch",
)


class ServerConfig(_ModelAndSplit):
    """What the trusted node tells the untrusted one in the handshake, and nothing more: the model, the
    split, the defence chain, the learning rate and the frame sizes, with two seeds derived one-way
    from the run seed (``splitleak.seeds``). The run seed itself, the data set and its seed, the
    document counts and the step count never cross."""

    lr: float
    doc_len: int = Field(ge=2)
    capture_batch: int = Field(ge=1)
    server_seed: int = Field(ge=0)  # keys the server-side defences' randomness
    model_init_seed: int | None = Field(None, ge=0)  # a randomly initialised model's init; None: pretrained

    @classmethod
    def of(cls, config: TrainConfig, *, random_init: bool) -> "ServerConfig":
        fields = {k: getattr(config, k) for k in SERVER_FIELDS}
        return cls(
            **fields,
            server_seed=server_seed(config.seed),
            model_init_seed=model_init_seed(config.seed) if random_init else None,
        )


def config_from_record(record: dict[str, Any]) -> TrainConfig:
    """A TrainConfig from its recorded dictionary (``as_dict``: a manifest's, a grid job's): a record without
    ``draws`` was made with draws keyed by the run seed, before the choice existed or with ``draws="derived"``
    (which ``as_dict`` leaves out to keep those hashes), so it reads as ``derived``, not as the default of a
    new configuration (``os``)."""
    return make_train_config(**{"draws": "derived", **record})


def make_train_config(**kwargs) -> TrainConfig:
    """Build a TrainConfig, turning pydantic's errors into one ConfigError with the field named."""
    try:
        return TrainConfig(**kwargs)
    except ValidationError as exc:
        msgs = []
        for e in exc.errors():
            loc = ".".join(str(x) for x in e["loc"]) or "config"
            msg = str(e.get("ctx", {}).get("error", e["msg"]))
            msgs.append(f"{loc}: {msg}")
        raise ConfigError("invalid training configuration: " + "; ".join(msgs)) from None
