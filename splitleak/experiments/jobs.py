"""A spec expanded into jobs, each keyed by the SHA-256 of its full configuration.

- **train** jobs, one per model x split (depth or placement) x defence chain x victim seed, and one
  per model x latent arm (the decoy system, 002 §2) or label-shielded arm (003 §2, each with its own
  defence chain) x victim seed. The key
  hashes ``{"schema", "kind": "train", "train": TrainConfig}`` (with ``data_path`` as the spec
  writes it, so moving a checkout does not change keys; the job runs with the resolved path).
- **attack** jobs, one per train job x attack configuration (attack, k, budget) x perturbation x
  client copy x attack seed. The key hashes ``{"schema", "kind": "attack", "train_key", "attack":
  AttackConfig, "protocol_hash"}``: it includes its train job's key, and it changes when the
  protocol does (results carry the protocol's hash). An attack job reads its train job's run
  directory (captures, client layers) and never retrains. An attack entry applies to the train jobs
  of the modes its attack reads (``AttackInfo.modes``): the latent attacks (support-partition,
  latent-probe) to the latent arms, the label-shielded ones (gma-sl, bisr) to the shielded arms, the
  others to the splits and the shielded arms; an entry that reads none is refused.
- **reuse** jobs: the inference-setting twin of an activation-only configuration flagged
  ``inference: true``. Its key is the key an inference attack job would have (``AttackConfig.inference
  = True``); it is not computed: the store copies the training-setting measurement (``reuse_of``
  names the source key), since an activation-only attack reads the same activations in both
  settings (What Gradients Add §3, "These 480 evaluations reuse the training measurements").

An attack entry named ``adaptive`` (``ADAPTIVE_ENTRY``) expands, per train job, into the attacks built
for that job's defences (``Defence.adaptive``; the latent mode's own), each with the entry's ``k`` or
``budget`` where it takes one, its copies and seeds; an undefended train job gets none. A job it yields
that another entry lists too is kept once.
"""

from __future__ import annotations

import inspect
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from splitleak.attacks.config import IDENTITY, attack_identity, make_attack_config, store_columns
from splitleak.attacks.core import ATTACKS, DEFAULT_READOUT
from splitleak.attacks.registry import attack_info
from splitleak.audit.defaults import CONTROL_DOCS
from splitleak.defences import DEFENCES
from splitleak.errors import ConfigError
from splitleak.experiments.spec import AttackEntry, ExperimentSpec, defence_label, defence_names
from splitleak.experiments.spec_loading import LoadedSpec
from splitleak.files import config_hash
from splitleak.training import make_train_config
from splitleak.training.config import adaptive_attacks_of

SCHEMA = 1
KINDS = ("train", "attack", "reuse")
#: the ``defence_name`` of a latent-mode train job (its ``defence`` column holds the arm's label)
LATENT_DEFENCE = "latent"
#: the ``defence_name`` of a label-shielded train job (its ``defence`` column holds the arm's label)
SHIELDED_DEFENCE = "label-shielded"
#: the attack entry that stands for each train job's adaptive attacks
ADAPTIVE_ENTRY = "adaptive"


@dataclass(frozen=True)
class Job:
    """One unit of work. ``config`` is exactly what ``key`` hashes; ``fields`` are the flat columns
    the results store writes beside the scores; ``run_config`` is the TrainConfig a train job runs."""

    key: str
    kind: str
    config: dict[str, Any]
    fields: dict[str, Any]
    summary: str
    train_key: str | None = None
    reuse_of: str | None = None
    run_config: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "kind": self.kind,
            "config": self.config,
            "fields": self.fields,
            "summary": self.summary,
            "train_key": self.train_key,
            "reuse_of": self.reuse_of,
            "run_config": self.run_config,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Job":
        return cls(**d)


@dataclass
class Grid:
    """All jobs of one spec (profile and overrides applied), in a stable order."""

    loaded: LoadedSpec
    protocol_hash: str
    jobs: list[Job]
    by_key: dict[str, Job] = field(default_factory=dict)
    dependents: dict[str, list[str]] = field(default_factory=dict)  # key -> keys that wait for it

    def __post_init__(self):
        self.by_key = {j.key: j for j in self.jobs}
        self.dependents = {}
        for j in self.jobs:
            dep = j.reuse_of if j.kind == "reuse" else j.train_key
            if dep is not None:
                self.dependents.setdefault(dep, []).append(j.key)

    def of_kind(self, kind: str) -> list[Job]:
        return [j for j in self.jobs if j.kind == kind]

    def counts(self) -> dict[str, int]:
        return {k: sum(1 for j in self.jobs if j.kind == k) for k in KINDS}


def _train_fields(cfg: dict[str, Any], label: str, names: str) -> dict[str, Any]:
    return {
        "model": cfg["model"],
        "precision": cfg["precision"],
        "depth": cfg["depth"],
        "offload_start": cfg["offload_start"],
        "offload_length": cfg["offload_length"],
        "defence": label,
        "defence_name": names,
        "victim_seed": cfg["seed"],
        "data": cfg["data"],
        "steps": cfg["steps"],
        "n_calib": cfg["n_calib"],
        "n_train": cfg["n_train"],
        "n_eval": cfg["n_eval"],
        "doc_len": cfg["doc_len"],
        "data_seed": cfg["data_seed"],
    }


def _train_summary(f: dict[str, Any]) -> str:
    if f["defence_name"] in (LATENT_DEFENCE, SHIELDED_DEFENCE):
        return f"{f['model']} {f['defence_name']} {f['defence']} seed {f['victim_seed']}"
    split = f"d{f['depth']}" if f["depth"] is not None else f"s{f['offload_length']} b{f['offload_start']}"
    return f"{f['model']} {split} {f['defence']} seed {f['victim_seed']}"


def _attack_fields(acfg: dict[str, Any], perturbation: str) -> dict[str, Any]:
    """The store's columns of an attack configuration: its identity (``attacks.config.STORED_FIELDS``)
    and the label of its gradient perturbation."""
    return {**store_columns(attack_identity(acfg)), "perturbation": perturbation}


def _attack_summary(f: dict[str, Any]) -> str:
    """``joint k8 readout pseudo-map public a0 noise=0.1``: every identity field that differs from its
    default, in the identity's order (the copy and the seed always, but for the latent attacks, which read
    no copy of the client's layers; the perturbation by its label)."""
    ident = attack_identity(f)
    short = {"k": "k{}", "budget": "budget {}", "readout": "readout {}", "attack_seed": "a{}"}
    parts = [ident["attack"]]
    tail = []
    for spec in IDENTITY[1:]:
        name, value = spec.name, ident[spec.name]
        if name in ("gradient_noise", "gradient_bits", "inference"):
            continue  # the perturbation's label and "inference" close the line
        if name == "params":
            parts.extend(f"{k}={v}" for k, v in json.loads(value or "{}").items())
        elif name == "client_copy":
            if "latent" not in attack_info(ident["attack"]).modes:  # the latent attacks read no copy of the layers
                tail.append(value)
        elif name == "attack_seed":
            tail.append(f"a{value}")
        elif value != spec.default and not (name == "readout" and value == DEFAULT_READOUT):
            parts.append(short.get(name, name + "={}").format(value))
    parts.extend(tail)
    if f["perturbation"] != "none":
        parts.append(f["perturbation"])
    if ident["inference"]:
        parts.append("inference")
    return " ".join(parts)


def _splits(spec: ExperimentSpec) -> list[dict[str, int | None]]:
    out: list[dict[str, int | None]] = [
        {"depth": d, "offload_start": None, "offload_length": None} for d in spec.depths
    ]
    if spec.placements is not None:
        for s in spec.placements.lengths:
            for b in spec.placements.starts:
                out.append({"depth": None, "offload_start": b, "offload_length": s})
    return out


def _attack_configs(entry: AttackEntry, spec: ExperimentSpec, index: int) -> list[tuple[dict[str, Any], str, bool]]:
    """(AttackConfig dict, perturbation label, counted also in inference) for every combination."""
    where = f"attacks[{index}] ({entry.attack})"
    if entry.attack not in ATTACKS:
        raise ConfigError(f"{where}: unknown attack {entry.attack!r}; known attacks: {', '.join(ATTACKS)}")
    uses_grad = ATTACKS[entry.attack].uses_gradients
    perturbed = [p for p in entry.perturbations if p.label != "none"]
    if entry.inference and uses_grad:
        raise ConfigError(
            f"{where}: attack {entry.attack!r} reads the returned gradients, which inference traffic does not "
            "carry; drop inference for it"
        )
    if entry.inference and perturbed:
        raise ConfigError(f"{where}: gradient perturbations mean nothing in the inference setting; drop one of them")
    phases = entry.phase or ["capture"]
    if entry.inference and "train" in phases:
        raise ConfigError(
            f"{where}: the inference setting reuses a measurement of the capture pass; drop inference or phase train"
        )
    if perturbed and not uses_grad:
        raise ConfigError(
            f"{where}: attack {entry.attack!r} does not read gradients, so the perturbations "
            f"{[p.label for p in perturbed]} would not change it; drop them"
        )
    twice = sorted(set(entry.params) & {"k", "budget", "readout"})
    if twice:
        raise ConfigError(f"{where}: give {', '.join(twice)} on the attack line, not in params")
    names = sorted(entry.params)
    combos = [dict(zip(names, values)) for values in itertools.product(*(entry.params[n] for n in names))]
    out = []
    # None: the entry leaves the list out (or gives it empty), and the attack's default applies
    ks: list[int | None] = [*entry.k] if entry.k else [None]
    budgets: list[int | str | None] = [*entry.budget] if entry.budget else [None]
    readouts: list[str | None] = [*entry.readout] if entry.readout else [None]
    for k in ks:
        for budget, readout, extra in itertools.product(budgets, readouts, combos):
            for pert in entry.perturbations:
                for copy_, phase in itertools.product(entry.client_copy or spec.client_copies, phases):
                    for seed in entry.attack_seeds or spec.attack_seeds:
                        try:
                            cfg = make_attack_config(
                                attack=entry.attack,
                                k=k,
                                budget=budget,
                                readout=readout,
                                client_copy=copy_,
                                attack_seed=seed,
                                gradient_noise=pert.gradient_noise,
                                gradient_bits=pert.gradient_bits,
                                inference=entry.inference == "only",
                                params=extra,
                                phase=phase,
                            )
                        except ConfigError as exc:
                            raise ConfigError(f"{where}: {exc}") from None
                        out.append((cfg.model_dump(mode="json"), pert.label, entry.inference is True))
    return out


#: an attack entry's configurations: (AttackConfig dict, perturbation label, counted also in inference)
AttackConfigs = list[tuple[dict[str, Any], str, bool]]


def expand(loaded: LoadedSpec, protocol_hash: str) -> Grid:
    """Every job of the spec, keys included; raises ConfigError (naming the entry) for unknown
    attacks, defences or arguments, and for a job listed twice."""
    spec = loaded.spec
    chains = [(defence_label(chain), chain) for chain in spec.defences]
    _check_labels(loaded, chains)
    attack_cfgs = [
        (entry, [] if entry.attack == ADAPTIVE_ENTRY else _attack_configs(entry, spec, i))
        for i, entry in enumerate(spec.attacks)
    ]
    _check_split_modes(loaded, chains)
    expansion = _Expansion(loaded, protocol_hash, attack_cfgs)
    for model in spec.models:
        expansion.add_model(model, chains)
    expansion.check_every_entry_used()
    return Grid(loaded, protocol_hash, expansion.jobs)


def _check_labels(loaded: LoadedSpec, chains: list[tuple[str, Any]]) -> None:
    """The defence chains' labels and the arms' labels tell every train job apart, and every defence an
    attack entry names is one of them or a known defence."""
    spec = loaded.spec
    labels = [lab for lab, _ in chains]
    names = {defence_names(chain) for chain in spec.defences}
    dup = sorted({lab for lab in labels if labels.count(lab) > 1})
    if dup:
        raise ConfigError(f"{loaded.path}: the defence chain {dup[0]!r} is listed twice")
    arms = [a.label for a in spec.latent] + [a.label for a in spec.shielded]
    split_labels = set(labels) if _splits(spec) else set()  # the chains label train jobs only where a split runs
    clash = sorted(set(arms) & (split_labels | {LATENT_DEFENCE, SHIELDED_DEFENCE}))
    if clash:
        raise ConfigError(
            f"{loaded.path}: the arm label {clash[0]!r} is also a defence chain's label (or the word "
            f"{LATENT_DEFENCE!r} or {SHIELDED_DEFENCE!r}); relabel the arm, the store's defence column must tell "
            "them apart"
        )
    for i, entry in enumerate(spec.attacks):
        for lab in entry.defences or []:
            if lab in labels or lab in names or lab in arms or lab in (LATENT_DEFENCE, SHIELDED_DEFENCE):
                continue
            unknown = [n for n in (part.split("(")[0] for part in lab.split("+")) if n not in DEFENCES]
            if unknown:  # a typo; a known defence that this grid (profile, overrides) does not train is fine
                raise ConfigError(
                    f"{loaded.path}: attacks[{i}] ({entry.attack}) names defence {lab!r}, which is neither a "
                    f"defence of the spec ({', '.join(labels + arms)}) nor a known defence "
                    f"({', '.join(sorted(DEFENCES))})"
                )


def _check_split_modes(loaded: LoadedSpec, chains: list[tuple[str, Any]]) -> None:
    """Every defence of a chain supports the split modes the spec runs it in."""
    spec = loaded.spec
    for split_mode, present, where in (
        ("plain", bool(spec.depths), "a plain split (depths)"),
        ("u-shape", spec.placements is not None, "partial offloading (placements)"),
    ):
        for lab, chain in chains:  # unknown names are refused later, with the defence named
            bad = [d.name for d in chain if d.name in DEFENCES and split_mode not in DEFENCES[d.name].split_modes]
            if present and bad:
                supported = DEFENCES[bad[0]].split_modes
                hint = "a shielded arm's chain" if "label-shielded" in supported else "a spec of its own"
                raise ConfigError(
                    f"{loaded.path}: the defence {lab!r} is implemented for {' and '.join(supported)} runs only, not "
                    f"for {where}; put it in {hint}"
                )


class _Expansion:
    """The jobs of one spec, added train job by train job, each followed by the attack (and reuse) jobs of
    every entry that reads its mode; a job listed twice is refused unless an adaptive entry yields it."""

    def __init__(self, loaded: LoadedSpec, protocol_hash: str, attack_cfgs: list[tuple[AttackEntry, AttackConfigs]]):
        self.loaded, self.spec, self.protocol_hash = loaded, loaded.spec, protocol_hash
        self.attack_cfgs = attack_cfgs
        self.used = [False] * len(attack_cfgs)
        self.jobs: list[Job] = []
        self.seen: dict[str, str] = {}
        self.from_adaptive: set[str] = set()
        self.adaptive_cfgs: dict[tuple[int, str], AttackConfigs] = {}

    def add(self, job: Job, adaptive: bool = False) -> None:
        if job.key in self.seen:
            if adaptive or job.key in self.from_adaptive:
                return  # an adaptive entry and another entry name the same job: it runs once
            raise ConfigError(
                f"{self.loaded.path}: the job {job.summary!r} is listed twice (e.g. two attack entries overlap)"
            )
        self.seen[job.key] = job.summary
        if adaptive:
            self.from_adaptive.add(job.key)
        self.jobs.append(job)

    def add_model(self, model: str, chains: list[tuple[str, Any]]) -> None:
        """The train jobs of one model: its splits x chains, its latent arms, its shielded arms, x victim seeds."""
        spec = self.spec
        for split in _splits(spec):
            for label, chain in chains:
                for seed in spec.victim_seeds:
                    common = dict(
                        **self.shared(model, seed),
                        **split,
                        defences=[d.model_dump() for d in chain],
                        lr=spec.lr,
                        all_local_baseline=spec.all_local_baseline,
                    )
                    mode = "plain" if split["depth"] is not None else "u-shape"
                    self.add_train(common, label, defence_names(chain), mode)
        for arm in spec.latent:
            try:
                latent = arm.latent_config(model)
            except ConfigError as exc:
                raise ConfigError(f"{self.loaded.path}: {exc}") from None
            for seed in spec.victim_seeds:
                # the latent mode has no all-local twin: its reference is the frozen pretrained model
                common = dict(**self.shared(model, seed), latent=latent, lr=arm.lr, all_local_baseline=False)
                self.add_train(common, arm.label, LATENT_DEFENCE, "latent")
        for sarm in spec.shielded:
            for seed in spec.victim_seeds:
                common = dict(
                    **self.shared(model, seed),
                    shielded=sarm.shielded_config(),
                    defences=[d.model_dump() for d in sarm.chain],
                    lr=sarm.lr if sarm.lr is not None else spec.lr,
                    all_local_baseline=spec.all_local_baseline,
                )
                self.add_train(common, sarm.label, SHIELDED_DEFENCE, "label-shielded")

    def shared(self, model: str, seed: int) -> dict[str, Any]:
        """The train configuration's fields that every split and arm shares."""
        spec = self.spec
        return dict(
            model=model,
            precision=spec.precision_of(model),
            data=spec.data.source,
            seed=seed,
            steps=spec.steps,
            capture_batch=spec.capture_batch,
            draws=spec.draws,
            **spec.documents.train_config_fields(),
        )

    def add_train(self, common: dict[str, Any], label: str, names: str, mode: str) -> None:
        """The train job of ``common`` and the attack (and reuse) jobs of every entry that reads its mode."""
        loaded, spec = self.loaded, self.spec
        try:
            key_cfg = make_train_config(**common, data_path=spec.data.path, model_path=spec.model_path)
            run_cfg = make_train_config(
                **common,
                data_path=str(loaded.data_path) if loaded.data_path else None,
                model_path=str(loaded.model_path) if loaded.model_path else None,
            )
        except ConfigError as exc:
            raise ConfigError(f"{loaded.path}: {exc}") from None
        tcfg = key_cfg.as_dict()
        config = {"schema": SCHEMA, "kind": "train", "train": tcfg}
        tkey = config_hash(config)
        tf = _train_fields(tcfg, label, names)
        tsum = _train_summary(tf)
        self.add(Job(tkey, "train", config, tf, tsum, run_config=run_cfg.as_dict()))
        top_only = (common.get("shielded") or {}).get("train") == "top-only"
        for i, (entry, entry_cfgs) in enumerate(self.attack_cfgs):
            if entry.defences is not None and label not in entry.defences and names not in entry.defences:
                continue
            if entry.attack == ADAPTIVE_ENTRY:
                self.used[i] = True
                # a reader of every crossing (AttackInfo.passes) runs where the entry reads the training traffic
                train = "train" in (entry.phase or ())
                built = [
                    a
                    for a in adaptive_attacks_of(run_cfg)
                    if not (top_only and attack_info(a).needs_top) and (train or not attack_info(a).passes)
                ]
                per_attack = [self.adaptive_configs(i, entry, a) for a in built]
            else:
                if mode not in attack_info(entry.attack).modes:
                    continue  # the latent mode's frames, a split's positions, a label-shielded run's four crossings
                if top_only and attack_info(entry.attack).needs_top:
                    continue  # a top-only client sends no gradient: the attacks that match one have nothing to read
                self.used[i] = True
                per_attack = [entry_cfgs]
            for cfgs in per_attack:
                self.add_attacks(cfgs, tkey, tf, tsum, adaptive=entry.attack == ADAPTIVE_ENTRY)

    def adaptive_configs(self, i: int, entry: AttackEntry, name: str) -> AttackConfigs:
        """The configurations of adaptive attack ``name`` that entry ``i`` stands for."""
        if (i, name) not in self.adaptive_cfgs:
            takes = inspect.signature(ATTACKS[name].__init__).parameters
            one = entry.model_copy(
                update={
                    "attack": name,
                    "k": entry.k if "k" in takes else None,
                    "budget": entry.budget if "budget" in takes else None,
                    # a reader of every crossing reads the training traffic only (on the capture pass, where each
                    # document crossed once, it is the attack it adapts)
                    "phase": ["train"] if attack_info(name).passes else entry.phase,
                }
            )
            self.adaptive_cfgs[(i, name)] = _attack_configs(one, self.spec, i)
        return self.adaptive_cfgs[(i, name)]

    def add_attacks(self, cfgs: AttackConfigs, tkey: str, tf: dict[str, Any], tsum: str, adaptive: bool) -> None:
        """The attack (and reuse) jobs of one train job for one attack's configurations."""
        for acfg, pert, also_inference in cfgs:
            aconf = {
                "schema": SCHEMA,
                "kind": "attack",
                "train_key": tkey,
                "attack": acfg,
                "protocol_hash": self.protocol_hash,
            }
            if self.spec.control_docs != CONTROL_DOCS:  # the default stays out of the key (stores keep theirs)
                aconf["control_docs"] = self.spec.control_docs
            akey = config_hash(aconf)
            af = {**tf, **_attack_fields(acfg, pert)}
            self.add(Job(akey, "attack", aconf, af, f"{tsum} | {_attack_summary(af)}", train_key=tkey), adaptive)
            if also_inference:
                icfg = {**acfg, "inference": True}
                iconf = {**aconf, "attack": icfg}
                fi = {**tf, **_attack_fields(icfg, pert)}
                summary = f"{tsum} | {_attack_summary(fi)} (reuses {akey[:12]})"
                self.add(Job(config_hash(iconf), "reuse", iconf, fi, summary, train_key=tkey, reuse_of=akey), adaptive)

    def check_every_entry_used(self) -> None:
        """An attack entry that reads no train job of the grid is refused, naming the modes it reads."""
        for i, (entry, _) in enumerate(self.attack_cfgs):
            if not self.used[i]:
                modes = " or ".join(attack_info(entry.attack).modes)
                raise ConfigError(
                    f"{self.loaded.path}: attacks[{i}] ({entry.attack}) reads {modes} runs and no train job of this "
                    f"grid is one{' among its defences ' + str(entry.defences) if entry.defences else ''}; add them "
                    "(latent: [...] for the decoy system, shielded: [...] for label-shielded fine-tuning, depths or "
                    "placements for a split) or drop the entry"
                )
