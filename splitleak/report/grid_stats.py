"""The numbers of the grid report, recomputed from the rows of a results store.

- ``recovery_cells``: token, whole-document and span recovery per attack configuration x split x
  copy, pooled over victim seeds, attack seeds and documents, with 95 % bootstrap intervals.
  Per-document scores are averaged over attack seeds first; the victim-seed x document matrix is
  then resampled by the crossed bootstrap when every seed was scored on the same documents, and
  by the hierarchical bootstrap (seeds, then documents within seed) when each seed has its own
  evaluation documents. Span recovery is a rate of sums (spans recovered / spans present), with
  the same resampling applied to both sums.
- ``cost_points``: leakage against the relative perplexity change of each defence.
- ``placement_means``: partial-offloading means per placement and defence.

Every function takes store rows (dicts, as ``read_results(..., as_rows=True)`` gives them).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from splitleak.attacks.config import CONFIG_FIELDS, IDENTITY_DEFAULTS, record_identity
from splitleak.attacks.registry import attack_names
from splitleak.audit.analysis import DEFAULT_READOUT, effective_readout
from splitleak.data import LABELS
from splitleak.stats import crossed_bootstrap_ci, crossed_replicates, hierarchical_bootstrap_ci, hierarchical_replicates

#: the order attacks are listed in: the registry's (others follow alphabetically)
ATTACK_ORDER = tuple(attack_names())


# ------------------------------------------------------------------ configurations and conditions


#: the attack's fields of a table's row: its configuration (``attacks.config.CONFIG_FIELDS``: the identity less
#: the attack seed, which the cells pool over) less the attack, named apart, and its copy, which is the
#: column's (``Condition``)
TABLE_FIELDS = tuple(f for f in CONFIG_FIELDS if f not in ("attack", "client_copy"))
#: the fields that the row's text and order name together, after the others
_LAST = ("gradient_noise", "gradient_bits", "inference")


def _rank(value: Any) -> tuple:
    """Sort key of one field's value: absent first, then numbers, then words (``budget``: 64 before exhaustive)."""
    if value is None:
        return (0, 0.0, "")
    if isinstance(value, (bool, int, float)):
        return (1, float(value), "")
    return (2, 0.0, str(value))


@dataclass(frozen=True)
class Config:
    """An attack configuration against one kind of trained model (the rows of the tables): the model,
    the data, the defence, the attack, and the values of the rest of its configuration
    (``TABLE_FIELDS``, read by name: ``c.k``, ``c.budget``, ``c.params``, ``c.gradient_noise``, ...)."""

    model: str | None  # None: a row that does not say (sort_key orders it first)
    data: str | None
    defence: str
    attack: str
    values: tuple[Any, ...] = ()  # of TABLE_FIELDS, canonical (``attacks.config.canonical``)

    @classmethod
    def of(cls, r: dict[str, Any]) -> "Config":
        ident = record_identity(r)
        ident["readout"] = effective_readout(ident)  # a gradient-reading attack recorded before read-outs: pseudo-map
        values = tuple(ident[f] for f in TABLE_FIELDS)
        return cls(r.get("model"), r.get("data"), r.get("defence") or "none", ident["attack"], values)

    def __getattr__(self, name: str) -> Any:  # the configuration's fields by name
        if name in TABLE_FIELDS:
            return self.values[TABLE_FIELDS.index(name)]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def perturbation(self) -> str:
        return perturbation_text(self.gradient_noise, self.gradient_bits)

    def attack_text(self) -> str:
        """``joint k=32``, ``sipit budget=64``, ``joint k=32, noise σ=0.1``, ``activation k=8 (inference)``:
        every field that differs from its default (``params`` one parameter at a time)."""
        s = self.attack
        for name, value in zip(TABLE_FIELDS, self.values):
            if name in _LAST:
                continue
            if name == "params":
                s += "".join(f" {k}={v}" for k, v in json.loads(value or "{}").items())
            elif value != IDENTITY_DEFAULTS.get(name) and not (name == "readout" and value == DEFAULT_READOUT):
                s += f" {name}={value}"
        if self.gradient_noise is not None or self.gradient_bits is not None:
            s += f", {self.perturbation}"
        if self.inference:
            s += " (inference)"
        return s

    def sort_key(self) -> tuple:
        a = ATTACK_ORDER.index(self.attack) if self.attack in ATTACK_ORDER else len(ATTACK_ORDER)
        return (
            self.model or "",
            self.data or "",
            self.defence != "none",
            self.defence,
            a,
            self.attack,
            *(_rank(v) for name, v in zip(TABLE_FIELDS, self.values) if name not in _LAST),
            perturbation_rank(self.gradient_noise, self.gradient_bits),
            self.inference,
        )


@dataclass(frozen=True)
class Condition:
    """Where the attack sat (split) and what copy of the client layers it held (the columns)."""

    depth: int | None
    offload_start: int | None
    offload_length: int | None
    copy: str

    @classmethod
    def of(cls, r: dict[str, Any]) -> "Condition":
        return cls(r.get("depth"), r.get("offload_start"), r.get("offload_length"), r.get("client_copy") or "public")

    @property
    def split(self) -> str:
        return split_text(self.depth, self.offload_start, self.offload_length)

    def text(self) -> str:
        return f"{self.split} {self.copy}"

    def sort_key(self) -> tuple:
        return (
            self.depth is None,
            self.depth or 0,
            self.offload_length or 0,
            self.offload_start or 0,
            self.copy != "public",
            self.copy,
        )


def split_text(depth, offload_start, offload_length) -> str:
    """``L=6`` for a plain split, ``s=2 b=1`` for partial offloading."""
    if depth is not None:
        return f"L={depth}"
    return f"s={offload_length} b={offload_start}"


def perturbation_text(noise, bits) -> str:
    """``true gradient``, ``noise σ=0.1`` or ``8-bit``."""
    if noise is not None:
        return f"noise σ={noise:g}"
    if bits is not None:
        return f"{bits}-bit"
    return "true gradient"


def perturbation_rank(noise, bits) -> tuple:
    """Sort key: true gradient, then noise by σ, then rounding from most to fewest bits."""
    if noise is not None:
        return (1, float(noise))
    if bits is not None:
        return (2, -int(bits))
    return (0, 0.0)


# ------------------------------------------------------------------ intervals


@dataclass(frozen=True)
class Estimate:
    estimate: float
    low: float
    high: float


def seed_doc_matrices(rows: Sequence[dict[str, Any]], values: dict[str, Any]) -> tuple[dict[str, np.ndarray], int]:
    """(victim seeds x documents) matrices, one per named value function, each cell the mean over
    attack seeds (NaN where a seed was not scored on a document); and the number of attack seeds."""
    cells: dict[tuple[Any, int], dict[str, list[float]]] = {}
    attack_seeds = set()
    for r in rows:
        attack_seeds.add(r.get("attack_seed"))
        c = cells.setdefault((r["victim_seed"], int(r["doc_id"])), {n: [] for n in values})
        for n, fn in values.items():
            c[n].append(float(fn(r)))
    seeds = sorted({s for s, _ in cells}, key=lambda x: (x is None, x))
    docs = sorted({d for _, d in cells})
    si = {s: i for i, s in enumerate(seeds)}
    di = {d: j for j, d in enumerate(docs)}
    out = {n: np.full((len(seeds), len(docs)), np.nan) for n in values}
    for (s, d), c in cells.items():
        for n in values:
            out[n][si[s], di[d]] = float(np.mean(c[n]))
    return out, len(attack_seeds)


def is_crossed(m: np.ndarray) -> bool:
    """Whether every victim seed was scored on every document (a crossed design)."""
    return not np.isnan(m).any()


def _groups(m: np.ndarray) -> list[np.ndarray]:
    return [row[~np.isnan(row)] for row in m if (~np.isnan(row)).any()]


def mean_ci(m: np.ndarray, n_boot: int, seed: int = 0, alpha: float = 0.05) -> Estimate:
    """Mean of a (victim seeds x documents) matrix with its percentile bootstrap interval: crossed when
    the design is crossed, hierarchical (seeds, then documents within seed) when it is nested."""
    if is_crossed(m):
        iv = crossed_bootstrap_ci(m, n_boot=n_boot, alpha=alpha, seed=seed)
    else:
        iv = hierarchical_bootstrap_ci(_groups(m), n_boot=n_boot, alpha=alpha, seed=seed)
    return Estimate(iv.estimate, iv.low, iv.high)


def ratio_ci(num: np.ndarray, den: np.ndarray, n_boot: int, seed: int = 0, alpha: float = 0.05) -> Estimate | None:
    """sum(num) / sum(den) over a (victim seeds x documents) design with a bootstrap interval in which
    each replicate resamples seeds and documents once and applies the same draw to both sums (the
    replicate functions draw from the seed and the shape alone, so equal seeds give equal draws)."""
    total = float(np.nansum(den))
    if total <= 0:
        return None
    est = float(np.nansum(num)) / total
    if is_crossed(num):
        rn, rd = crossed_replicates(num, n_boot, seed), crossed_replicates(den, n_boot, seed)
    else:
        rn, rd = (
            hierarchical_replicates(_groups(num), n_boot, seed),
            hierarchical_replicates(_groups(den), n_boot, seed),
        )
    with np.errstate(invalid="ignore", divide="ignore"):
        reps = rn / rd
    reps = reps[np.isfinite(reps)]
    if reps.size == 0:
        return Estimate(est, math.nan, math.nan)
    lo, hi = np.quantile(reps, [alpha / 2, 1 - alpha / 2])
    return Estimate(est, float(lo), float(hi))


# ------------------------------------------------------------------ recovery per configuration


def token_rate(r: dict[str, Any]) -> float:
    """A row's share of tokens recovered (NaN when it counted none)."""
    return r["token_correct"] / r["token_counted"] if r["token_counted"] else math.nan


@dataclass
class Cell:
    """Recovery of one attack configuration in one condition, pooled over seeds and documents."""

    config: Config
    condition: Condition
    token: Estimate
    doc: Estimate
    spans: dict[str, Estimate | None]
    span_counts: dict[str, float]  # spans present per evaluation of the set (mean over attack seeds, summed)
    n_evals: int  # document-level evaluations (rows)
    n_seeds: int
    n_attack_seeds: int
    n_docs: int  # distinct documents
    crossed: bool


def scored(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows that carry per-token scores (not property inference), measured (not reused)."""
    return [r for r in rows if r.get("token_counted") is not None and r.get("kind") != "reuse"]


def recovery_cells(rows: Sequence[dict[str, Any]], n_boot: int = 2000, seed: int = 0) -> list[Cell]:
    """One ``Cell`` per (configuration, condition) among ``rows`` (store attack rows), sorted."""
    groups: dict[tuple[Config, Condition], list[dict[str, Any]]] = {}
    for r in scored(rows):
        groups.setdefault((Config.of(r), Condition.of(r)), []).append(r)
    values: dict[str, Callable[..., float]] = {"token": token_rate, "doc": lambda r: float(bool(r["exact"]))}
    for lab in LABELS:
        values[f"hits_{lab}"] = lambda r, lab=lab: r.get(f"span_hits_{lab}") or 0
        values[f"counts_{lab}"] = lambda r, lab=lab: r.get(f"span_counts_{lab}") or 0
    out = []
    for (cfg, cond), rs in groups.items():
        ms, n_as = seed_doc_matrices(rs, values)
        spans = {lab: ratio_ci(ms[f"hits_{lab}"], ms[f"counts_{lab}"], n_boot, seed) for lab in LABELS}
        out.append(
            Cell(
                cfg,
                cond,
                mean_ci(ms["token"], n_boot, seed),
                mean_ci(ms["doc"], n_boot, seed),
                spans,
                {lab: float(np.nansum(ms[f"counts_{lab}"])) for lab in LABELS},
                len(rs),
                ms["token"].shape[0],
                n_as,
                ms["token"].shape[1],
                is_crossed(ms["token"]),
            )
        )
    out.sort(key=lambda c: (c.config.sort_key(), c.condition.sort_key()))
    return out


# ------------------------------------------------------------------ leakage against cost

TWIN_FIELDS = (
    "model",
    "precision",
    "depth",
    "offload_start",
    "offload_length",
    "victim_seed",
    "data",
    "steps",
    "n_calib",
    "n_train",
    "n_eval",
    "doc_len",
)


@dataclass
class CostPoint:
    """One defence at one split of one model: utility cost and leakage, over its victim seeds."""

    model: str
    split: str
    defence: str
    seeds: list[Any]
    perplexity: float | None  # mean over seeds; None when no run reports one
    reference_perplexity: float | None
    reference: str  # "undefended run", "all-local twin" or "none"
    rel_ppl_change: float | None  # mean over seeds of perplexity / reference - 1
    delta_u: float | None
    all_local_perplexity: float | None
    token: float | None
    doc: float | None
    n_configs: int
    n_evals: int
    configs: list[str] = field(default_factory=list)


def _mean(xs: Iterable[float | None]) -> float | None:
    v = [float(x) for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(v) / len(v) if v else None


def cost_points(
    attack_rows: Sequence[dict[str, Any]], train_rows: Sequence[dict[str, Any]]
) -> tuple[list[CostPoint], str]:
    """Leakage (token and whole-document recovery) against the relative perplexity change of every
    defence, per model and split, and a sentence saying which attack configurations were pooled.

    The cost of a defended run is its held-out perplexity over that of the undefended run with the
    same model, split, seed, data and document counts, minus one; when the grid has no undefended
    run, the run's own all-local twin (the whole model trained on the client, no protection)
    stands in. Leakage pools, for each model and split, the attack configurations (with client
    copy) run against every defence there, so that each point averages the same attacks."""
    twins = {tuple(t.get(f) for f in TWIN_FIELDS): t for t in train_rows if (t.get("defence_name") or "none") == "none"}
    by_train: dict[str, list[dict[str, Any]]] = {}
    for r in scored(attack_rows):
        by_train.setdefault(r["train_key"], []).append(r)
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for t in train_rows:
        groups.setdefault(
            (t["model"], split_text(t["depth"], t["offload_start"], t["offload_length"]), t.get("defence") or "none"),
            [],
        ).append(t)

    def cfg_of(r):
        return (Config.of(r).attack_text(), r.get("client_copy"))

    configs: dict[tuple[str, str, str], set] = {}
    for g, ts in groups.items():
        configs[g] = {cfg_of(r) for t in ts for r in by_train.get(t["key"], [])}
    common: dict[tuple[str, str], set] = {}
    for (model, split, _d), cs in configs.items():
        if not cs:
            continue
        key = (model, split)
        common[key] = cs if key not in common else common[key] & cs
    fallback = [k for k, cs in common.items() if not cs]
    points = []
    for (model, split, defence), ts in groups.items():
        use = common.get((model, split)) or configs[(model, split, defence)]
        rows = [r for t in ts for r in by_train.get(t["key"], []) if cfg_of(r) in use]
        rels, refs, kinds = [], [], set()
        for t in ts:
            twin = twins.get(tuple(t.get(f) for f in TWIN_FIELDS))
            ref = twin.get("perplexity") if twin is not None else None
            kind = "undefended run"
            if ref is None:
                ref, kind = t.get("all_local_perplexity"), "all-local twin"
            if ref and t.get("perplexity") is not None:
                rels.append(t["perplexity"] / ref - 1.0)
                refs.append(ref)
                kinds.add(kind)
        points.append(
            CostPoint(
                model,
                split,
                defence,
                sorted({t["victim_seed"] for t in ts}),
                _mean(t.get("perplexity") for t in ts),
                _mean(refs),
                " / ".join(sorted(kinds)) or "none",
                _mean(rels),
                _mean(t.get("delta_u") for t in ts),
                _mean(t.get("all_local_perplexity") for t in ts),
                _mean(token_rate(r) for r in rows) if rows else None,
                _mean(float(bool(r["exact"])) for r in rows) if rows else None,
                len({cfg_of(r) for r in rows}),
                len(rows),
                sorted({f"{a} ({c})" for a, c in {cfg_of(r) for r in rows}}),
            )
        )
    points.sort(key=lambda p: (p.model, p.split, p.defence != "none", p.defence))
    if fallback:
        note = (
            "no attack configuration was run against every defence at "
            + ", ".join(f"{m} {s}" for m, s in fallback)
            + "; there each point pools all attacks run against that defence, so points are not like for like"
        )
    else:
        note = "each point pools the attack configurations (with copy) run against every defence at that split"
    return points, note


# ------------------------------------------------------------------ partial offloading


@dataclass
class PlacementMean:
    model: str
    defence: str
    length: int
    start: int
    n_seeds: int
    delta_u: float | None
    leakage_index: float | None
    vmi_excess: float | None
    perplexity: float | None


def placement_means(run_rows: Sequence[dict[str, Any]]) -> list[PlacementMean]:
    """Means over victim seeds per (model, defence, length s, start b) of ΔU, the leakage index I and
    the VMI excess (VMI token recovery minus the majority control)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in run_rows:
        groups.setdefault((r.get("model"), r["defence"], int(r["offload_length"]), int(r["offload_start"])), []).append(
            r
        )
    out = [
        PlacementMean(
            m,
            d,
            s,
            b,
            len({r["victim_seed"] for r in rs}),
            _mean(r.get("delta_u") for r in rs),
            _mean(r.get("leakage_index") for r in rs),
            _mean(r.get("vmi_excess") for r in rs),
            _mean(r.get("perplexity") for r in rs),
        )
        for (m, d, s, b), rs in groups.items()
    ]
    out.sort(key=lambda p: (p.model or "", p.defence, p.length, p.start))
    return out
