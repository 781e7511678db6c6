"""``splitleak tune``: the cheapest configuration that passes the gate, and the privacy–utility frontier.

Given a model, documents and a utility budget, the tune searches cut depth × defence chain × strength
for the configurations that hold the gate of Politis & Pappas (2026, Eq. 1) against an attack suite
derived from the audit's, and draws recovery against cost (What Gradients Add, Figure 6 style).

- **Space.** Depths come from a list; the defence is a categorical over chains (``none`` included);
  each defence brings its own searchable arguments and ranges (``Defence.search`` in
  ``splitleak.defences``, every range ours). Strengths are rounded to 3 significant digits, so a
  label stays readable and near-equal proposals share their jobs.
- **Optimiser.** Optuna, two objectives minimised: the utility cost and the gate statistic G. The
  sampler is TPE, re-seeded before every trial from (seed, number of finished trials), so a tune is
  reproducible and a killed tune resumes to the trials an unkilled one would have run. The study lives
  in ``OUT/study.db`` (SQLite, no pickle).
- **Runs.** Each trial is a grid (``splitleak.experiments``): one model, one depth, the undefended
  chain and the trial's chain, one victim seed; its train jobs and the trial chain's attack jobs run
  into ONE store, ``OUT/store``, so the undefended train job of a depth is trained once for all its
  trials, and a rerun finds every job it already ran.
- **Utility.** The relative perplexity change of the defended run against the undefended run at the
  same depth (``rel-ppl``), or the held-out cross-entropy change (``delta-ce``; it equals ΔU because an
  undefended split reproduces the all-local run exactly).
- **Privacy.** Every arm's token top-1 against the constant baseline (``arm_effects``) and the gate G
  over the arms (``arm_gate``): a configuration holds the gate when G <= +1 pp (the gate and α of the
  shipped gate_002 protocol, read from the package; ``splitleak.audit.gate``). We use the gate, not
  "no arm detected", because the gate bounds the leak from above: a suite too small to detect
  anything does not hold it.
- **Early stop.** The suite's first attack runs first. When its paired effect's lower end exceeds
  ``stop_above`` (>= the gate; ours, default +5 pp) the trial stops: with documents of equal length
  A's estimate is the pooled accuracy minus the constant rate, and G >= that (a Wilson upper bound is
  never below its estimate), so the full suite would break the gate too. A trial over the utility
  budget also stops after the first attack. Stopped trials report lower bounds, and are marked.

Outputs: ``OUT/tune.json`` (every trial), ``OUT/frontier.png`` / ``.svg`` and ``OUT/tune.md``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

from splitleak.errors import ConfigError, SplitleakError

UTILITIES = ("rel-ppl", "delta-ce")
#: the default early-stop threshold on the first attack's paired effect (lower end), ours
STOP_ABOVE = 0.05
#: the default suite, cheapest first (the first attack is the early-stop probe); ``adaptive``: the attacks
#: built for the trial's defences (``Defence.adaptive``), on the trained copy, k = 32, 32 checks per position
DEFAULT_ATTACKS = ("vmi", "activation", "sipit-trained", "adaptive")
ADAPTIVE = "adaptive"
STUDY_NAME = "splitleak-tune"
#: significant digits kept of a sampled strength
DIGITS = 3


# ------------------------------------------------------------------ the attack suite


def attack_suite() -> dict[str, dict[str, Any]]:
    """The attacks a tune may run, named as the audit names its results (the attack, ``-trained`` for the
    trained copy), with the audit's parameters (``AUDIT_ATTACKS``) except ``sipit-trained``: a budget of
    32 checks per position, as the audit now uses too, cheap enough for every trial.
    The majority control is left out (it is no reader)."""
    from splitleak.audit.plan import AUDIT_ATTACKS

    out: dict[str, dict[str, Any]] = {}
    for name, params, copy in AUDIT_ATTACKS:
        if name == "majority":
            continue
        stem = name if copy == "public" else f"{name}-{copy}"
        entry: dict[str, Any] = {"attack": name, "client_copy": copy}
        p = dict(params)
        if stem == "sipit-trained":
            p = {"budget": 32}
        for key in ("k", "budget"):
            if key in p:
                entry[key] = p.pop(key)
        if p:
            entry["params"] = p
        out[stem] = entry
    out[ADAPTIVE] = {"attack": ADAPTIVE, "k": 32, "budget": 32, "client_copy": "trained"}
    return out


def resolve_attacks(names: Sequence[str]) -> list[tuple[str, dict[str, Any]]]:
    suite = attack_suite()
    if not names:
        raise ConfigError(f"give at least one attack; known: {', '.join(suite)}")
    unknown = [n for n in names if n not in suite]
    if unknown:
        raise ConfigError(f"unknown tune attack {unknown[0]!r}; choose from {', '.join(suite)} (--attacks vmi,...)")
    if len(set(names)) != len(names):
        raise ConfigError("an attack is listed twice in --attacks; list each once")
    if names[0] == ADAPTIVE:
        raise ConfigError(
            f"{ADAPTIVE!r} cannot come first in --attacks: the first attack is the early-stop probe and must read "
            "every trial, the undefended one too (which has no adaptive attack); put a reader before it"
        )
    return [(n, suite[n]) for n in names]


# ------------------------------------------------------------------ the space


@dataclass(frozen=True)
class Space:
    """What a tune searches: depths, chains (tuples of defence names) and each argument's range."""

    depths: tuple[int, ...]
    chains: tuple[tuple[str, ...], ...]
    ranges: dict[str, dict[str, Any]]  # "clip-noise.sigma" -> SearchRange as a dict

    @staticmethod
    def label(chain: Sequence[str]) -> str:
        return "+".join(chain)

    def as_dict(self) -> dict[str, Any]:
        return {
            "depths": list(self.depths),
            "defences": [self.label(c) for c in self.chains],
            "ranges": self.ranges,
        }


def searchable_defences() -> list[str]:
    """The defences a tune offers by default: those that declare ``search`` and run on a plain split."""
    from splitleak.defences import DEFENCES

    return [n for n, cls in DEFENCES.items() if cls.search is not None and "plain" in cls.split_modes]


def build_space(depths: Sequence[int], defences: Sequence[str] | None, n_blocks: int | None, model: str) -> Space:
    """The space of a tune; ConfigError for an unknown defence, one that does not run on a plain split, or
    no depth that fits the model (``n_blocks``)."""
    from splitleak.defences import DEFENCES

    if not depths:
        raise ConfigError("give at least one cut depth (--depth 2 --depth 4)")
    if any(int(d) < 1 for d in depths):
        raise ConfigError(f"every depth must be >= 1, got {list(depths)}")
    ds = tuple(dict.fromkeys(int(d) for d in depths))
    if n_blocks is not None:
        fit = tuple(d for d in ds if d < n_blocks)
        if not fit:
            raise ConfigError(
                f"no depth in {list(ds)} fits {model} ({n_blocks} blocks); pass --depth between 1 and {n_blocks - 1}"
            )
        ds = fit
    names = list(defences) if defences else ["none", *(n for n in searchable_defences() if n != "none")]
    chains: list[tuple[str, ...]] = []
    ranges: dict[str, dict[str, Any]] = {}
    for item in names:
        chain = tuple(p.strip() for p in item.split("+") if p.strip())
        if not chain:
            raise ConfigError(f"empty defence {item!r}; name one (e.g. --defence clip-noise)")
        for n in chain:
            if n not in DEFENCES:
                raise ConfigError(
                    f"unknown defence {n!r}; known defences: {', '.join(sorted(DEFENCES))} (chains as quant8+clip-noise)"
                )
            cls = DEFENCES[n]
            if "plain" not in cls.split_modes:
                raise ConfigError(
                    f"defence {n!r} runs on {' and '.join(cls.split_modes)} runs only, and a tune cuts a plain split; "
                    "drop it from --defence"
                )
            for arg, rng in (cls.search or {}).items():
                ranges[f"{n}.{arg}"] = asdict(rng)
        if "none" in chain and len(chain) > 1:
            raise ConfigError(f"{item!r}: none in a chain means nothing; drop it")
        if chain not in chains:
            chains.append(chain)
    return Space(ds, tuple(chains), ranges)


def _round(x: float, digits: int = DIGITS) -> float:
    if x == 0 or not math.isfinite(x):
        return x
    return float(f"{x:.{digits}g}")


@dataclass(frozen=True)
class TrialConfig:
    depth: int
    chain: tuple[dict[str, Any], ...]  # [{"name", "args"}]

    @property
    def label(self) -> str:
        from splitleak.experiments.spec import defence_label
        from splitleak.training.config import DefenceConfig

        return defence_label([DefenceConfig(**d) for d in self.chain])

    @property
    def undefended(self) -> bool:
        return all(d["name"] == "none" for d in self.chain)


def sample(trial: Any, space: Space) -> TrialConfig:
    """The trial's configuration from Optuna: depth and defence (categorical), then each argument of the
    chosen chain on its declared range (parameter ``NAME.ARG``; a defence shares it across chains)."""
    depth = trial.suggest_categorical("depth", list(space.depths))
    label = trial.suggest_categorical("defence", [space.label(c) for c in space.chains])
    chain = []
    for name in label.split("+"):
        args = {}
        for key, rng in space.ranges.items():
            n, _, arg = key.partition(".")
            if n != name:
                continue
            if rng["integer"]:
                args[arg] = trial.suggest_int(key, int(rng["low"]), int(rng["high"]), log=rng["log"])
            else:
                args[arg] = _round(trial.suggest_float(key, rng["low"], rng["high"], log=rng["log"]))
        chain.append({"name": name, "args": args})
    return TrialConfig(int(depth), tuple(chain))


def trial_params(depth: int, defence: str, **strengths: float) -> dict[str, Any]:
    """The Optuna parameters of one configuration, for ``enqueue``: ``trial_params(2, "clip-noise",
    sigma=1.0)`` (a chain's arguments as ``NAME.ARG`` keys: ``**{"clip-noise.sigma": 1.0}``)."""
    first = defence.split("+")[0]
    return {
        "depth": depth,
        "defence": defence,
        **{(k if "." in k else f"{first}.{k}"): v for k, v in strengths.items()},
    }


def parse_enqueue(text: str) -> dict[str, Any]:
    """``depth=2,defence=clip-noise,sigma=0.5`` (or ``clip-noise.sigma=0.5``) into Optuna parameters."""
    items: dict[str, str] = {}
    for part in text.split(","):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--enqueue {text!r}: write depth=D,defence=NAME[,ARG=VALUE...]")
        items[key.strip()] = value.strip()
    if "depth" not in items or "defence" not in items:
        raise ConfigError(f"--enqueue {text!r}: give depth= and defence=")
    try:
        depth = int(items.pop("depth"))
        defence = items.pop("defence")
        return trial_params(depth, defence, **{k: float(v) for k, v in items.items()})
    except ValueError:
        raise ConfigError(f"--enqueue {text!r}: depth is an integer and strengths are numbers") from None


def _check_enqueued(params: dict[str, Any], space: Space) -> None:
    labels = [space.label(c) for c in space.chains]
    if params["depth"] not in space.depths:
        raise ConfigError(f"enqueued depth {params['depth']} is not among the tune's depths {list(space.depths)}")
    if params["defence"] not in labels:
        raise ConfigError(f"enqueued defence {params['defence']!r} is not among the tune's: {', '.join(labels)}")
    names = params["defence"].split("+")
    for key, value in params.items():
        if key in ("depth", "defence"):
            continue
        if key not in space.ranges or key.split(".")[0] not in names:
            raise ConfigError(
                f"enqueued {key}={value}: not a searched argument of {params['defence']} "
                f"({', '.join(k for k in space.ranges if k.split('.')[0] in names) or 'none'})"
            )
        rng = space.ranges[key]
        if not rng["low"] <= value <= rng["high"]:
            raise ConfigError(f"enqueued {key}={value} lies outside its range [{rng['low']:g}, {rng['high']:g}]")


# ------------------------------------------------------------------ outcomes


@dataclass
class Outcome:
    """What one trial measured. ``stopped`` names why the suite stopped early (its numbers are then lower
    bounds); ``error`` why it could not run."""

    depth: int
    defence: str
    chain: list[dict[str, Any]]
    cost: float | None = None  # in the unit of the tune's utility
    rel_ppl: float | None = None
    delta_ce: float | None = None
    perplexity: float | None = None
    undefended_perplexity: float | None = None
    G: float | None = None  # the gate statistic over the arms run (a lower bound when stopped)
    gate_breaks: bool | None = None
    baseline_rate: float | None = None
    arms: list[dict[str, Any]] = field(default_factory=list)
    worst_reader: str | None = None
    worst_token_recovery: float | None = None
    within_budget: bool | None = None
    passes: bool = False
    stopped: str | None = None
    error: str | None = None
    train_keys: list[str] = field(default_factory=list)
    attack_keys: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def pareto_front(points: Sequence[tuple[float, float]], exact: Sequence[bool] | None = None) -> list[int]:
    """Indices of the non-dominated points when both coordinates are minimised: no other point is at
    least as good in both and better in one. Equal points are all kept. In input order.

    ``exact[i]`` False marks a point whose second coordinate is only a lower bound (a trial stopped
    early): it may be dominated, but it neither dominates another point nor lies on the frontier."""
    known = list(exact) if exact is not None else [True] * len(points)
    out = []
    for i, (x, y) in enumerate(points):
        if not known[i]:
            continue
        dominated = any(
            known[j] and (qx <= x and qy <= y) and (qx < x or qy < y) for j, (qx, qy) in enumerate(points) if j != i
        )
        if not dominated:
            out.append(i)
    return out


# ------------------------------------------------------------------ the settings and the grid


@dataclass(frozen=True)
class TuneSettings:
    """Everything a tune's trials depend on (its hash guards a resumed tune)."""

    model: str
    budget: float
    utility: str = "rel-ppl"
    attacks: tuple[str, ...] = DEFAULT_ATTACKS
    seed: int = 0
    victim_seed: int = 1
    data: str = "synthetic-pii"
    data_path: str | None = None
    model_path: str | None = None
    precision: str = "float32"
    n_calib: int = 32
    n_train: int = 128
    n_eval: int = 64
    doc_len: int = 32
    steps: int | None = None
    stop_above: float = STOP_ABOVE

    def check(self) -> None:
        from splitleak.audit.gate import shipped_thresholds

        gate = shipped_thresholds().gate

        if not (isinstance(self.budget, (int, float)) and math.isfinite(self.budget) and self.budget > 0):
            raise ConfigError(
                f"--budget must be a number > 0 (the utility cost allowed, e.g. 0.05 for +5 % perplexity), "
                f"got {self.budget}"
            )
        if self.utility not in UTILITIES:
            raise ConfigError(f"unknown --utility {self.utility!r}; choose {' or '.join(UTILITIES)}")
        if not self.stop_above >= gate:
            raise ConfigError(
                f"--stop-above must be >= the gate ({gate:g}, the shipped gate_002 protocol's): below it an early stop could fail a configuration "
                f"that holds the gate; got {self.stop_above}"
            )
        resolve_attacks(self.attacks)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["attacks"] = list(self.attacks)
        return d


def _json_arg(v: Any) -> str:
    return json.dumps(v, separators=(",", ":"))


def write_base_spec(out: Path, settings: TuneSettings, space: Space) -> Path:
    """``OUT/spec.yaml``: the grid every trial overrides (depths, defences, attacks)."""
    import yaml

    spec = {
        "name": "tune",
        "description": "written by splitleak tune; each trial overrides depths, defences and attacks",
        "protocol": "shipped:paper_main",
        "models": [settings.model],
        "precision": settings.precision,
        "depths": list(space.depths),
        "defences": ["none"],
        "victim_seeds": [settings.victim_seed],
        "attack_seeds": [settings.seed],
        "client_copies": ["public"],
        "documents": {
            "n_calib": settings.n_calib,
            "n_train": settings.n_train,
            "n_eval": settings.n_eval,
            "doc_len": settings.doc_len,
            "seed": 0,
        },
        "steps": settings.steps,
        "data": {"source": settings.data, "path": settings.data_path},
        "all_local_baseline": False,
        "attacks": [],
    }
    if settings.model_path:
        spec["model_path"] = settings.model_path
    path = out / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def trial_spec(spec_path: Path, cfg: TrialConfig, attacks: list[tuple[str, dict[str, Any]]]):
    """The trial's grid: its depth, the undefended chain and its own, and the attacks against its chain only."""
    from splitleak.experiments.spec import load_spec

    chains: list[Any] = ["none"]
    if not cfg.undefended:
        chains.append([dict(d) for d in cfg.chain])
    entries = [{**entry, "defences": [cfg.label]} for _, entry in attacks]
    overrides = [f"depths=[{cfg.depth}]", f"defences={_json_arg(chains)}", f"attacks={_json_arg(entries)}"]
    return load_spec(spec_path, None, overrides)


class GridEvaluator:
    """Runs a trial's jobs through the grid machinery into ``OUT/store`` and scores them."""

    def __init__(
        self,
        out: Path,
        settings: TuneSettings,
        space: Space,
        *,
        threads: int | None = None,
        device: str = "auto",
        reporter=None,
        n_boot: int = 2000,
    ):
        self.out, self.settings, self.space = out, settings, space
        self.spec_path = out / "spec.yaml"
        self.store = out / "store"
        self.attacks = resolve_attacks(settings.attacks)
        self.threads, self.device, self.reporter, self.n_boot = threads, device, reporter, n_boot
        self.jobs_ran = 0

    def check(self) -> None:
        """Expand one grid with every chain at its defaults, so a bad argument or attack fails before any run."""
        from splitleak.experiments.runner import plan_grid
        from splitleak.experiments.spec import load_spec

        chains: list[Any] = [[{"name": n} for n in c] for c in self.space.chains]
        overrides = [
            f"depths={_json_arg(list(self.space.depths))}",
            f"defences={_json_arg(chains)}",
            f"attacks={_json_arg([e for _, e in self.attacks])}",
        ]
        plan_grid(load_spec(self.spec_path, None, overrides))

    def _run(self, cfg: TrialConfig, attacks: list[tuple[str, dict[str, Any]]]):
        from splitleak.experiments.runner import run_grid

        loaded = trial_spec(self.spec_path, cfg, attacks)
        res = run_grid(
            loaded, store=self.store, workers=1, threads=self.threads, device=self.device, reporter=self.reporter
        )
        self.jobs_ran += res.ran
        if res.failures:
            f = res.failures[0]
            raise TrialError(f"{f.kind} job {f.key[:12]} ({f.summary}) failed: {f.error_type}: {f.error}")
        return res.grid

    def _score(self, grid, outcome: Outcome, names: list[str]) -> Any:
        """Arm effects and the gate over the arms ``names`` of the trial's chain; fills ``outcome``."""
        import numpy as np

        from splitleak.attacks.registry import attack_info
        from splitleak.audit.gate import shipped_thresholds
        from splitleak.audit.verdicts import arm_effects, arm_gate
        from splitleak.experiments.store import ResultsStore
        from splitleak.runs.truth import eval_token_ids

        rs = ResultsStore(self.store)
        by_name = dict(self.attacks)
        attack_of = {n: by_name[n]["attack"] for n in names}
        preds: dict[str, Any] = {}
        controls: dict[str, Any] = {}
        doc_ids: list[int] | None = None
        train_key = None
        keys = []
        for job in grid.of_kind("attack"):
            if job.fields["defence"] != outcome.defence:
                continue
            attack, copy = job.fields["attack"], job.fields["client_copy"]
            name = next(
                (n for n in names if by_name[n]["attack"] == attack and by_name[n]["client_copy"] == copy), None
            )
            if name is None and ADAPTIVE in names and attack_info(attack).adaptive:
                name = attack if copy == "public" else f"{attack}-{copy}"  # one of the chain's adaptive attacks
                attack_of[name] = attack
            if name is None:
                continue
            rows = sorted(rs.read_job("attack", job.key).to_pylist(), key=lambda r: r["doc_id"])
            ids = [r["doc_id"] for r in rows]
            if doc_ids is None:
                doc_ids = ids
            elif ids != doc_ids:
                raise TrialError(f"the attacks of {outcome.defence} read different documents")
            preds[name] = np.array([r["predicted"] for r in rows], dtype=np.int64)
            control = json.loads(rows[0]["result_json"]).get("control") if rows and rows[0].get("result_json") else None
            if control is not None:  # the job's mis-paired twin (splitleak.audit.verdicts)
                controls[name] = control["per_doc_delta"]
            train_key = job.train_key
            keys.append(job.key)
        assert doc_ids is not None and train_key is not None
        truth = eval_token_ids(rs.run_dir(train_key), doc_ids)
        th = shipped_thresholds()
        base, arms = arm_effects(
            preds, truth, controls=controls, n_boot=self.n_boot, alpha=th.alpha, seed=self.settings.seed
        )
        faults = [a.name for a in arms if a.control_verdict == "detected"]
        if faults:  # readings that are not readings of the traffic place no configuration on the frontier
            raise TrialError(
                f"instrument fault: the mis-paired negative control of {', '.join(faults)} reads above its floor "
                "(the attack reads the evaluation text by the documents' identity, not through the traffic)"
            )
        readers = [a for a in arms if not attack_info(attack_of[a.name]).control]
        gate = arm_gate(readers, base, th.alpha, th.gate)
        outcome.attack_keys = keys
        outcome.baseline_rate = base.rate
        outcome.arms = [
            {
                "name": a.name,
                "accuracy": a.accuracy,
                "effect": a.effect.estimate,
                "effect_low": a.effect.low,
                "effect_high": a.effect.high,
                "verdict": a.verdict,
                "control_verdict": a.control_verdict,
            }
            for a in arms
        ]
        worst = max(readers, key=lambda a: a.accuracy)
        outcome.worst_reader, outcome.worst_token_recovery = worst.name, worst.accuracy
        outcome.G, outcome.gate_breaks = gate.G, gate.breaks
        return arms

    def _utility(self, grid, outcome: Outcome) -> None:
        from splitleak.experiments.store import ResultsStore

        rs = ResultsStore(self.store)
        rows = {j.fields["defence"]: rs.read_job("train", j.key).to_pylist()[0] for j in grid.of_kind("train")}
        outcome.train_keys = sorted(j.key for j in grid.of_kind("train"))
        mine, ref = rows[outcome.defence], rows["none"]
        if mine["perplexity"] is None or ref["perplexity"] is None:
            raise TrialError("the train job measured no held-out perplexity")
        outcome.perplexity, outcome.undefended_perplexity = mine["perplexity"], ref["perplexity"]
        outcome.rel_ppl = mine["perplexity"] / ref["perplexity"] - 1.0
        outcome.delta_ce = mine["heldout_ce"] - ref["heldout_ce"]
        outcome.cost = outcome.rel_ppl if self.settings.utility == "rel-ppl" else outcome.delta_ce
        outcome.within_budget = outcome.cost <= self.settings.budget

    def __call__(self, cfg: TrialConfig) -> Outcome:
        outcome = Outcome(cfg.depth, cfg.label, [dict(d) for d in cfg.chain])
        names = [n for n, _ in self.attacks]
        first = names[:1]
        grid = self._run(cfg, self.attacks[:1])
        self._utility(grid, outcome)
        arms = self._score(grid, outcome, first)
        probe = arms[0]
        if probe.effect.low > self.settings.stop_above:
            outcome.stopped = (
                f"{probe.name} reads {100 * probe.accuracy:.1f} % of tokens, {100 * probe.effect.low:+.1f} pp above the "
                f"constant baseline at the interval's lower end (> {100 * self.settings.stop_above:.1f} pp), so the "
                "whole suite breaks the gate"
            )
        elif not outcome.within_budget:
            outcome.stopped = f"over the utility budget ({outcome.cost:+.4g} > {self.settings.budget:g})"
        if outcome.stopped is None and len(names) > 1:
            grid = self._run(cfg, self.attacks)
            self._score(grid, outcome, names)
        outcome.passes = bool(outcome.stopped is None and not outcome.gate_breaks and outcome.within_budget)
        return outcome


class TrialError(SplitleakError):
    """A trial whose jobs could not run (recorded; the tune goes on)."""


# ------------------------------------------------------------------ the study


def sampler_seed(seed: int, n: int) -> int:
    return int.from_bytes(hashlib.sha256(f"splitleak-tune|{seed}|{n}".encode()).digest()[:4], "little")


def open_study(out: Path):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    out.mkdir(parents=True, exist_ok=True)
    return optuna.create_study(
        study_name=STUDY_NAME,
        storage=f"sqlite:///{out / 'study.db'}",
        directions=["minimize", "minimize"],
        load_if_exists=True,
    )


@dataclass
class TuneResult:
    out: Path
    trials: list[dict[str, Any]]
    frontier: list[int]
    passing: list[int]
    ran_trials: int
    jobs_ran: int
    paths: list[Path]


def _settings_hash(settings: TuneSettings, space: Space) -> str:
    blob = json.dumps({"settings": settings.as_dict(), "space": space.as_dict()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def run_study(
    out: Path,
    space: Space,
    evaluate: Callable[[TrialConfig], Outcome],
    *,
    n_trials: int,
    seed: int,
    enqueue: Sequence[dict[str, Any]] = (),
    say: Callable[[str], None] = lambda s: None,
) -> tuple[Any, int]:
    """Ask, evaluate and tell until the study holds ``n_trials`` finished trials. A trial left running by a
    killed tune is marked failed and asked again with the same parameters. Returns (study, trials run)."""
    import optuna
    from optuna.trial import TrialState

    study = open_study(out)
    if not study.trials:
        for params in enqueue:
            _check_enqueued(params, space)
            study.enqueue_trial(params, skip_if_exists=True)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):  # a killed tune's last trial
        study.tell(t.number, state=TrialState.FAIL)  # failed without an outcome: not counted, not reported
        study.enqueue_trial(t.params)
        say(f"trial {t.number} was interrupted; running its configuration again")

    def finished() -> int:
        return sum(
            1
            for t in study.get_trials(deepcopy=False)
            if t.state == TrialState.COMPLETE or (t.state == TrialState.FAIL and "outcome" in t.user_attrs)
        )

    ran = 0
    while (n := finished()) < n_trials:
        study.sampler = optuna.samplers.TPESampler(seed=sampler_seed(seed, n))
        trial = study.ask()
        cfg = sample(trial, space)
        say(f"trial {trial.number}: depth {cfg.depth}, {cfg.label}")
        try:
            outcome = evaluate(cfg)
        except TrialError as exc:
            outcome = Outcome(cfg.depth, cfg.label, [dict(d) for d in cfg.chain], error=str(exc))
            trial.set_user_attr("outcome", outcome.as_dict())
            study.tell(trial, state=TrialState.FAIL)
            say(f"trial {trial.number} failed: {exc}")
            ran += 1
            continue
        trial.set_user_attr("outcome", outcome.as_dict())
        assert outcome.cost is not None and outcome.G is not None
        study.tell(trial, [outcome.cost, outcome.G])
        say(
            f"trial {trial.number}: cost {outcome.cost:+.4g}, G {100 * outcome.G:+.2f} pp, worst reader "
            f"{outcome.worst_reader} {100 * (outcome.worst_token_recovery or 0):.1f} % -> "
            + ("PASS" if outcome.passes else "fail")
            + (f" (stopped: {outcome.stopped})" if outcome.stopped else "")
        )
        ran += 1
    return study, ran


def tune(
    out: str | Path,
    settings: TuneSettings,
    *,
    depths: Sequence[int],
    defences: Sequence[str] | None = None,
    n_trials: int = 20,
    enqueue: Sequence[dict[str, Any]] = (),
    undefended_first: bool = True,
    threads: int | None = None,
    device: str = "auto",
    reporter=None,
    say: Callable[[str], None] = lambda s: None,
    evaluate: Callable[[TrialConfig], Outcome] | None = None,
    n_blocks: int | None = None,
    render: Render | None = None,
) -> TuneResult:
    """Search and record every trial in ``OUT/tune.json`` (see the module docstring); ``render`` draws the
    frontier and writes ``tune.md`` (``splitleak.report.tune.render_tune``, as ``splitleak tune`` does).

    The undefended configuration at each depth is tried first (``undefended_first``), then ``enqueue``
    (Optuna parameters, ``trial_params``), then what the sampler proposes. Rerunning with the same
    settings resumes: finished trials are kept and every job already in ``OUT/store`` is reused."""
    out = Path(out)
    settings.check()
    # the spec lies in OUT, and a relative path in it would resolve against OUT
    if settings.data_path is not None:
        settings = replace(settings, data_path=str(Path(settings.data_path).resolve()))
    if settings.model_path is not None:
        settings = replace(settings, model_path=str(Path(settings.model_path).resolve()))
    if n_trials < 1:
        raise ConfigError(f"--n-trials must be >= 1, got {n_trials}")
    if n_blocks is None and evaluate is None:
        n_blocks = model_blocks(settings)
    space = build_space(depths, defences, n_blocks, settings.model)
    digest = _settings_hash(settings, space)
    record = out / "tune-settings.json"
    if record.exists():
        old = json.loads(record.read_text())
        if old.get("hash") != digest:
            raise ConfigError(
                f"{out} holds a tune of other settings (model, budget, data, attacks, depths or defences differ; "
                f"see {record}); choose another --out, or rerun with the same settings to resume"
            )
    ev: Callable[[TrialConfig], Outcome]
    jobs: Callable[[], int]
    if evaluate is None:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:  # every chain, attack and argument checked before a write
            write_base_spec(Path(tmp), settings, space)
            GridEvaluator(Path(tmp), settings, space).check()
        out.mkdir(parents=True, exist_ok=True)
        write_base_spec(out, settings, space)
        grid_ev = GridEvaluator(out, settings, space, threads=threads, device=device, reporter=reporter)
        ev = grid_ev

        def jobs() -> int:
            return grid_ev.jobs_ran
    else:
        out.mkdir(parents=True, exist_ok=True)
        ev = evaluate

        def jobs() -> int:
            return 0

    if not record.exists():
        record.write_text(
            json.dumps({"hash": digest, "settings": settings.as_dict(), "space": space.as_dict()}, indent=1) + "\n"
        )
    first = [trial_params(d, "none") for d in space.depths] if undefended_first and ("none",) in space.chains else []
    study, ran = run_study(out, space, ev, n_trials=n_trials, seed=settings.seed, enqueue=[*first, *enqueue], say=say)
    trials = collect_trials(study)
    result = write_outputs(out, settings, space, trials, render)
    return TuneResult(out, trials, result["frontier"], result["passing"], ran, jobs(), result["paths"])


def model_blocks(settings: TuneSettings) -> int:
    """The number of blocks of the tune's model (loads it once)."""
    from splitleak.models import load_model

    lm = load_model(settings.model, seed=0, model_path=settings.model_path)
    return int(lm.info["n_blocks"])


def collect_trials(study) -> list[dict[str, Any]]:
    from optuna.trial import TrialState

    out = []
    for t in study.get_trials(deepcopy=False):
        if t.state not in (TrialState.COMPLETE, TrialState.FAIL):
            continue
        o = t.user_attrs.get("outcome")
        if o is None:
            continue
        out.append({"number": t.number, "state": t.state.name.lower(), "params": dict(t.params), **o})
    return out


# ------------------------------------------------------------------ outputs


#: what draws a tune's report: (out, settings, space, trials, passing, frontier numbers) -> the paths written
Render = Callable[[Path, "TuneSettings", "Space", list, list, list], list[Path]]


def write_outputs(
    out: Path, settings: TuneSettings, space: Space, trials: list[dict[str, Any]], render: Render | None = None
) -> dict[str, Any]:
    """``tune.json`` from the trials, and what ``render`` draws from them (the CLI passes
    ``splitleak.report.tune.render_tune``: ``frontier.png`` / ``.svg`` and ``tune.md``)."""
    from splitleak.audit.gate import shipped_thresholds
    from splitleak.files import json_default

    th = shipped_thresholds()
    scored = [t for t in trials if t["error"] is None]
    # a stopped trial's recovery is a lower bound, exact only when it already reads every token
    exact = [t["stopped"] is None or t["worst_token_recovery"] >= 1.0 for t in scored]
    front_idx = pareto_front([(t["cost"], t["worst_token_recovery"]) for t in scored], exact)
    frontier = [scored[i]["number"] for i in front_idx]
    passing = sorted((t for t in trials if t["passes"]), key=lambda t: (t["cost"], t["G"], t["number"]))
    for t in trials:
        t["on_frontier"] = t["number"] in frontier
    record = {
        "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "settings": settings.as_dict(),
        "space": space.as_dict(),
        "privacy": f"the gate of Politis & Pappas 2026 (Eq. 1) over the suite's readers: passes when G <= "
        f"+{100 * th.gate:.2f} pp (α {th.alpha:g}, the {th.protocol} protocol shipped with splitleak)",
        "gate_thresholds": th.as_dict(),
        "utility": settings.utility,
        "budget": settings.budget,
        "frontier": frontier,
        "passing": [t["number"] for t in passing],
        "cheapest_passing": passing[0]["number"] if passing else None,
        "trials": trials,
    }
    (out / "tune.json").write_text(json.dumps(record, indent=1, default=json_default) + "\n")
    paths = [out / "tune.json"]
    if render is not None:  # the frontier figure and tune.md (``splitleak.report.tune.render_tune``)
        paths += render(out, settings, space, trials, passing, frontier)
    return {"frontier": frontier, "passing": [t["number"] for t in passing], "paths": paths}
