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
- **The upper side.** Every trial records the bound of its defended run (``splitleak.audit.bounds``: every
  crossing of each evaluation document composed under the chain's noise guarantees; the informed adversary; an
  observer of the activations and gradients, since the server of a plain split reads the labels in clear) and
  plays each noised channel's mechanism against its declaration (a defence that adds less noise than it
  declares is an instrument fault, and the trial an error). With ``bound_below`` a configuration passes only
  where that mean token bound is at most it: what no reader can read, not only what the suite read.
- **Early stop.** The suite's first attack runs first. When its paired effect's lower end exceeds
  ``stop_above`` (>= the gate; ours, default +5 pp) the trial stops: with documents of equal length
  A's estimate is the pooled accuracy minus the constant rate, and G >= that (a Wilson upper bound is
  never below its estimate), so the full suite would break the gate too. A trial over the utility
  budget, or with a bound above ``bound_below`` (or none), also stops after the first attack. Stopped trials
  report lower bounds, and are marked.

Outputs: ``OUT/tune.json`` (every trial), ``OUT/frontier.png`` / ``.svg`` and ``OUT/tune.md``.

This module holds what a tune searches and under what settings (the attack suite, the space, a trial's
configuration, ``TuneSettings``); ``tune_trials`` runs and scores one trial through the grid machinery;
``tune_study`` is the Optuna study, ``tune()`` and ``tune.json``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from splitleak.errors import ConfigError

UTILITIES = ("rel-ppl", "delta-ce")
#: the default early-stop threshold on the first attack's paired effect (lower end), ours
STOP_ABOVE = 0.05
#: the default suite, cheapest first (the first attack is the early-stop probe); ``adaptive``: the attacks
#: built for the trial's defences (``Defence.adaptive``), on the trained copy, k = 32, 32 checks per position
DEFAULT_ATTACKS = ("vmi", "activation", "sipit-trained", "adaptive")
ADAPTIVE = "adaptive"
#: significant digits kept of a sampled strength
DIGITS = 3


# ------------------------------------------------------------------ the attack suite


def attack_suite() -> dict[str, dict[str, Any]]:
    """The attacks a tune may run, named as the audit names its results (the attack, ``-trained`` for the
    trained copy), with the audit's parameters (``AUDIT_ATTACKS``) except ``sipit-trained``: a budget of
    32 checks per position, as the audit now uses too, cheap enough for every trial.
    The majority control is left out (it is no reader)."""
    # lazy: torch stays out of `splitleak --help`, which loads experiments.tune for its defaults
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
    # lazy: torch stays out of `splitleak --help`, which loads experiments.tune for its defaults
    from splitleak.defences import DEFENCES

    return [n for n, cls in DEFENCES.items() if cls.search is not None and "plain" in cls.split_modes]


def build_space(depths: Sequence[int], defences: Sequence[str] | None, n_blocks: int | None, model: str) -> Space:
    """The space of a tune; ConfigError for an unknown defence, one that does not run on a plain split, or
    no depth that fits the model (``n_blocks``)."""
    # lazy: torch stays out of `splitleak --help`, which loads experiments.tune for its defaults
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
        # lazy: torch stays out of `splitleak --help`, which loads experiments.tune for its defaults
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


def check_enqueued(params: dict[str, Any], space: Space) -> None:
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


# ------------------------------------------------------------------ the settings


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
    #: pass only where no reader can read more than this share of tokens (the mean token bound of the defended
    #: run, ``splitleak.audit.bounds``), besides the gate; None: the bound is recorded, not required
    bound_below: float | None = None

    def check(self) -> None:
        # lazy: torch stays out of `splitleak --help`, which loads experiments.tune for its defaults
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

        if self.bound_below is not None and not (
            isinstance(self.bound_below, (int, float)) and 0 < self.bound_below <= 1
        ):
            raise ConfigError(
                f"--bound-below must be a share of tokens in (0, 1] (0.1: no reader can read more than 10 % of "
                f"them), got {self.bound_below}"
            )

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["attacks"] = list(self.attacks)
        return d
