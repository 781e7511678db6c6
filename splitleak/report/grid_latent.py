"""The grid report's section on the decoy system (002): the support partition, the probe battery with
its shuffled-label twins and its seed-level pooling, and the utility of each latent arm, beside the
paper's numbers.

``latent_summary`` turns store rows into plain numbers (tested); ``latent_section`` writes them. Each
battery run is read again under the grid's protocol (``splitleak.audit.gate``: its gate, α, the family of
J arms per view, and the utility gate on the arm's held-out CE over the pretrained model), so the
verdicts are the protocol's, not the job's.
Rows are the latent mode's when their ``defence_name`` is ``latent`` (the ``defence`` column holds
the arm's label: ``open``, ``fix``, ``naked`` in the shipped spec).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from scipy.stats import norm

from splitleak.attacks.registry import REGISTRY
from splitleak.audit.gate import GateThresholds, passes, reread_probes, shipped_thresholds, utility_gate
from splitleak.report.document import Document, Heading, Para, Table
from splitleak.stats import leave_one_out, random_effects

LATENT_DEFENCE = "latent"  # the same word as splitleak.experiments.jobs.LATENT_DEFENCE (kept torch-free here)

#: the paper's numbers the reproduction is read against (Politis & Pappas 2026, 002), with where they stand
PAPER = {
    "partition_open": "4,096 / 4,096 frames exact, row agreement 1.000, on each of nine seeds (§5, Table 8)",
    "partition_fix": "0 / 1,024 frames exact, row agreement 0.400 = 32/80 (§5.3, Table 9)",
    "probes_naked": "deep probe +24 pp over its control on the naked boundary (Table 6); gradient-only probes "
    "≈ 28–32 % top-1, the joint view ≈ 51 % (Table 9)",
    "probes_defended": "frequent-token gradient arm +0.92 pp [0.74, 1.09] pooled over nine seeds (τ = 0.23, "
    "I² = 77 %); every shuffled-label control at floor (§5)",
    "fix_cost": "≈ 0.01 nats of held-out cross-entropy (0.010–0.015; §5.3)",
    "setting": "Qwen3-0.6B (28 blocks) split 14/26 (11 delegated) and 21/26 for the mitigation runs; WikiText-2 "
    "(and a second corpus); 2,000-step diagnostics to 40k-step runs; 4,096 frames per run (2,048 probe-train "
    "+ 2,048 evaluation), 1,024 in the mitigation runs",
}


def is_latent(row: dict[str, Any]) -> bool:
    return row.get("defence_name") == LATENT_DEFENCE


def _result(row: dict[str, Any]) -> dict[str, Any]:
    return json.loads(row["result_json"]) if row.get("result_json") else {}


def _per_job(rows: Sequence[dict[str, Any]], attack: str) -> list[dict[str, Any]]:
    """One row per job (the first of its frames) of ``attack``."""
    seen: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r.get("attack") == attack and r.get("kind") == "attack" and r["key"] not in seen:
            seen[r["key"]] = r
    return list(seen.values())


def _params(row: dict[str, Any]) -> str:
    p = json.loads(row["params"]) if row.get("params") else {}
    return ", ".join(f"{k}={v}" for k, v in sorted(p.items())) or "defaults"


@dataclass
class PartitionCell:
    model: str
    arm: str
    params: str
    seeds: list[int]
    frames: int
    frames_exact: int
    agreement: float  # row agreement over every frame of every seed
    aucs: list[float | None]
    attack: str = "support-partition"
    rows: int = 0  # the rows the agreement is over

    @property
    def auc(self) -> float | None:
        known = [a for a in self.aucs if a is not None]
        return float(np.mean(known)) if known else None


@dataclass
class ProbeRun:
    model: str
    arm: str
    params: str
    seed: int
    verdict: dict[str, Any]
    twin: dict[str, Any] | None
    twin_of_best: float | None
    constant: float
    arms: list[dict[str, Any]]
    #: the run read under the grid's protocol (splitleak.audit.gate.latent_verdict)
    protocol: dict[str, Any] | None = None
    #: the battery's threat model; "oracle" (and every battery run before threat models) gives no verdict
    threat: str = "oracle"
    #: every arm of its shuffled-label twin (name, paired effect and interval), or None where it ran none
    twin_arms: list[dict[str, Any]] | None = None


@dataclass
class Pooled:
    """One probe arm pooled over seeds (DerSimonian–Laird): per-seed effects with SEs from their 95 %
    frame-bootstrap intervals, the pooled mean at alpha / J (Bonferroni over the J arms pooled)."""

    model: str
    arm: str
    params: str
    probe_arm: str
    seeds: list[int]
    estimate: float
    low: float
    high: float
    tau: float
    i2: float
    arms_pooled: int
    leave_one_out: tuple[float, float] | None
    note: str = ""
    threat: str = "oracle"  # the battery's threat model (ProbeRun.threat)


@dataclass
class UtilityCell:
    model: str
    arm: str
    seeds: list[int]
    steps: int | None
    heldout_ce: float
    pretrained_ce: float
    epsilon: float | None
    cost: dict[str, Any] | None = None  # against the arm it differs from only in the output gradient
    utility_gate: dict[str, Any] | None = None  # the mean CE increase over the pretrained model, at the protocol's gate


@dataclass
class LatentSummary:
    partition: list[PartitionCell] = field(default_factory=list)
    probes: list[ProbeRun] = field(default_factory=list)
    pooled: list[Pooled] = field(default_factory=list)
    utility: list[UtilityCell] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    thresholds: GateThresholds | None = None

    def __bool__(self) -> bool:
        return bool(self.partition or self.probes or self.utility)


def partition_attacks() -> list[str]:
    """The registered attacks that partition latent frames, in the registry's order."""
    return [n for n, a in REGISTRY.items() if a.output == "partition" and "latent" in a.modes]


def _partition(rows: Sequence[dict[str, Any]]) -> tuple[list[PartitionCell], list[str]]:
    order = partition_attacks()
    groups: dict[tuple[str, int, str, str], list[dict[str, Any]]] = {}
    for k, attack in enumerate(order):
        for r in _per_job(rows, attack):
            groups.setdefault((r["model"], k, r["defence"], _params(r)), []).append(r)
    out: list[PartitionCell] = []
    bare: set[tuple[str, str]] = set()
    for (model, k, arm, params), rs in sorted(groups.items()):
        parts = [_result(r)["partition"] for r in rs]
        if all(p["real_row_share"] == 1.0 for p in parts):  # a frame of real rows only: nothing to find
            bare.add((model, arm))
            continue
        rows_total = sum(p["rows"] for p in parts)
        agreement = sum(p["row_agreement"] * p["rows"] for p in parts) / rows_total if rows_total else float("nan")
        out.append(
            PartitionCell(
                model,
                arm,
                params,
                sorted(int(r["victim_seed"]) for r in rs),
                sum(p["frames"] for p in parts),
                sum(p["frames_exact"] for p in parts),
                float(agreement),
                [p.get("auc") for p in parts],
                order[k],
                int(rows_total),
            )
        )
    notes = [
        f"{model} {arm}: its frames hold no decoy rows, so there is no partition to find; it has no partition row"
        for model, arm in sorted(bare)
    ]
    return out, notes


def _seed_utility(train_rows: Sequence[dict[str, Any]], th: GateThresholds) -> dict[str, dict[str, Any]]:
    """Per latent train job (by key): its held-out CE over the pretrained model at the protocol's utility gate."""
    out = {}
    for t in train_rows:
        if is_latent(t) and t.get("heldout_ce") is not None and t.get("pretrained_ce") is not None:
            out[t["key"]] = utility_gate(float(t["heldout_ce"]) - float(t["pretrained_ce"]), th, PRETRAINED_REFERENCE)
    return out


#: the reference of a latent arm's utility gate (002's Δ loss)
PRETRAINED_REFERENCE = "the frozen pretrained model"


def _probes(
    rows: Sequence[dict[str, Any]], th: GateThresholds, utility: dict[str, dict[str, Any]] | None = None
) -> list[ProbeRun]:
    frames: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("attack") == "latent-probe" and r.get("kind") == "attack":
            frames.setdefault(r["key"], []).append(r)
    out = []
    for r in sorted(
        _per_job(rows, "latent-probe"), key=lambda r: (r["model"], r["defence"], _params(r), r["victim_seed"])
    ):
        res = _result(r)
        probes = res["probes"]
        seed = (res.get("attack_params") or {}).get("seed", 0)
        protocol = reread_probes(probes, frames[r["key"]], seed, th, (utility or {}).get(r.get("train_key", "")))
        twin = probes.get("negative_control")
        out.append(
            ProbeRun(
                r["model"],
                r["defence"],
                _params(r),
                int(r["victim_seed"]),
                probes["verdict"],
                None if twin is None else twin["verdict"],
                probes.get("control_of_best_arm"),
                float(probes["constant"]["accuracy"]),
                probes["arms"],
                protocol,
                (res.get("attack_params") or {}).get("threat", "oracle"),
                None if twin is None else twin.get("arms"),
            )
        )
    return out


def pool_probe_runs(runs: Sequence[ProbeRun], alpha: float = 0.05) -> tuple[list[Pooled], list[str]]:
    """Per (model, latent arm, battery): each probe arm's per-seed paired effect pooled over the seeds
    (``stats.random_effects``; SE = 95 % interval width / (2 · 1.96), as the paper's artefact derives
    it), and the arm with the highest pooled mean reported at alpha / J, J the arms pooled."""
    z = float(norm.ppf(1 - alpha / 2))
    groups: dict[tuple[str, str, str], list[ProbeRun]] = {}
    for run in runs:
        groups.setdefault((run.model, run.arm, run.params), []).append(run)
    pooled, notes = [], []
    for (model, arm, params), rs in sorted(groups.items()):
        if len(rs) < 2:
            continue
        names = set.intersection(*({a["arm"] for a in run.arms if not a["degenerate"]} for run in rs))
        per_arm = {}
        for name in sorted(names):
            vals = [next(a for a in run.arms if a["arm"] == name) for run in rs]
            y = np.array([a["paired_effect"] for a in vals], dtype=float)
            v = np.array([((a["paired_high"] - a["paired_low"]) / (2 * z)) ** 2 for a in vals], dtype=float)
            if (v > 0).all():
                per_arm[name] = (y, v)
        if not per_arm:
            notes.append(
                f"{model} {arm} ({params}): no probe arm has a non-degenerate interval on every seed; not pooled"
            )
            continue
        j = len(per_arm)
        best = max(per_arm, key=lambda n: random_effects(*per_arm[n], alpha=alpha).estimate)
        y, v = per_arm[best]
        re = random_effects(y, v, alpha=alpha / j)
        loo = None
        if len(y) >= 3:
            means = [x.estimate for x in leave_one_out(y, v, alpha=alpha / j)]
            loo = (min(means), max(means))
        pooled.append(
            Pooled(
                model, arm, params, best, sorted(run.seed for run in rs),
                re.estimate, re.low, re.high, re.tau, re.i2, j, loo, threat=rs[0].threat,
            )
        )  # fmt: skip
    return pooled, notes


def _utility(train_rows: Sequence[dict[str, Any]], th: GateThresholds) -> list[UtilityCell]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for t in train_rows:
        if is_latent(t):
            groups.setdefault((t["model"], t["defence"]), []).append(t)
    cells: dict[tuple[str, str], UtilityCell] = {}
    configs: dict[tuple[str, str], dict[str, Any]] = {}
    by_seed: dict[tuple[str, str], dict[int, float]] = {}
    for (model, arm), ts in sorted(groups.items()):
        eps = [json.loads(t["metrics_json"]).get("privacy", {}).get("epsilon_per_row_one_release") for t in ts]
        cells[(model, arm)] = UtilityCell(
            model,
            arm,
            sorted(int(t["victim_seed"]) for t in ts),
            ts[0].get("steps"),
            float(np.mean([t["heldout_ce"] for t in ts])),
            float(np.mean([t["pretrained_ce"] for t in ts])),
            eps[0] if eps and all(e == eps[0] for e in eps) else None,
        )
        cell = cells[(model, arm)]
        cell.utility_gate = utility_gate(
            cell.heldout_ce - cell.pretrained_ce, th, PRETRAINED_REFERENCE + f", mean of {len(ts)} seed(s)"
        )
        configs[(model, arm)] = json.loads(ts[0]["train_config"])["latent"]
        by_seed[(model, arm)] = {int(t["victim_seed"]): float(t["heldout_ce"]) for t in ts}
    # the output gradient's cost: against the arm with the same configuration and the output gradient open
    skip = ("output_gradient", "output_clip", "output_sigma")
    for (model, arm), cell in cells.items():
        cfg = configs[(model, arm)]
        if cfg["output_gradient"] == "open":
            continue
        same = {k: v for k, v in cfg.items() if k not in skip}
        ref = next(
            (
                a
                for (m, a), c in configs.items()
                if m == model
                and c["output_gradient"] == "open"
                and {k: v for k, v in c.items() if k not in skip} == same
            ),
            None,
        )
        if ref is None:
            continue
        seeds = sorted(set(by_seed[(model, arm)]) & set(by_seed[(model, ref)]))
        if not seeds:
            continue
        d = np.array([by_seed[(model, arm)][s] - by_seed[(model, ref)][s] for s in seeds])
        cell.cost = {
            "against": ref,
            "seeds": seeds,
            "mean": float(d.mean()),
            "min": float(d.min()),
            "max": float(d.max()),
        }
    return list(cells.values())


def latent_summary(
    attack_rows: Sequence[dict[str, Any]],
    train_rows: Sequence[dict[str, Any]],
    thresholds: GateThresholds | None = None,
) -> LatentSummary:
    """Everything the decoy section shows, from the store's latent rows, read at ``thresholds`` (the grid
    protocol's, ``splitleak.audit.gate.resolve_thresholds``; default: the shipped gate_002's)."""
    th = thresholds or shipped_thresholds()
    rows = [r for r in attack_rows if is_latent(r)]
    probes = _probes(rows, th, _seed_utility(train_rows, th))
    partition, bare = _partition(rows)
    pooled, notes = pool_probe_runs(probes, alpha=th.alpha)
    return LatentSummary(partition, probes, pooled, _utility(train_rows, th), bare + notes, th)


def arm_passes(s: LatentSummary) -> list[dict[str, Any]]:
    """Per (model, latent arm, battery): how many seeds hold the protocol's privacy gate in every view of
    its family, and whether the arm is within the utility gate; an arm passes only when every seed holds
    the gate and every seed is within the utility gate (002: "passed both gates")."""
    groups: dict[tuple[str, str, str], list[ProbeRun]] = {}
    for run in s.probes:
        groups.setdefault((run.model, run.arm, run.params), []).append(run)
    out = []
    for (model, arm, params), rs in sorted(groups.items()):
        verdicts = [r.protocol for r in rs if r.protocol is not None]
        privacy = [v["privacy_holds"] for v in verdicts]
        util = [None if v.get("utility") is None else v["utility"].get("passes") for v in verdicts]
        holds = (
            None if not privacy or any(p is None for p in privacy) else all(privacy)
        )  # undecided when a seed's family is not the protocol's
        oracle = any(r.threat == "oracle" for r in rs)
        if oracle:
            holds = None  # an upper bound, read with the client's record: never a verdict
        within = None if not util or any(u is None for u in util) else all(util)
        limit = s.thresholds.utility_ce_increase_max if s.thresholds is not None else None
        out.append(
            {
                "model": model,
                "arm": arm,
                "params": params,
                "seeds": len(rs),
                "seeds_holding_gate": sum(p is True for p in privacy),
                "seeds_breaking_gate": sum(p is False for p in privacy),
                "seeds_within_utility": sum(u is True for u in util),
                "privacy_holds": holds,
                "utility_within": within,
                "passes": passes(holds, None if limit is None else {"max": limit, "passes": within}),
                "oracle": oracle,
            }
        )
    return out


# ------------------------------------------------------------------ the section


def _pp(x: float | None, signed: bool = True) -> str:
    if x is None or not np.isfinite(x):
        return "n/a"
    return f"{100 * x:+.2f}" if signed else f"{100 * x:.2f}"


def _f(x: float | None, places: int = 3) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{x:.{places}f}"


_YES_NO = {True: "yes", False: "no", None: "n/a"}


def latent_section(
    doc: Document,
    attack_rows: Sequence[dict[str, Any]],
    train_rows: Sequence[dict[str, Any]],
    thresholds: GateThresholds | None = None,
) -> None:
    """The decoy system (002): omitted when the grid trained no latent arm. ``thresholds``: the grid
    protocol's (``splitleak.audit.gate.resolve_thresholds``)."""
    s = latent_summary(attack_rows, train_rows, thresholds)
    if not s:
        return
    th = s.thresholds or shipped_thresholds()
    doc.add(Heading(2, "The decoy system (002): partition, probes and utility"))
    doc.add(_setting_para(s, attack_rows))
    if s.partition:
        doc.add(Heading(3, "Which rows are real: the partition of each frame"), _partition_table(s.partition))
    if s.probes:
        doc.add(Heading(3, "What the rows say: the probe battery"), _gate_para(th), _probe_table(s.probes))
        verdicts = arm_passes(s)
        if verdicts:
            doc.add(_arm_table(verdicts))
    if s.pooled:
        doc.add(_pooled_table(s.pooled))
    for note in s.notes:
        doc.add(Para(note, "note"))
    if s.utility:
        doc.add(Heading(3, "What the defence costs: held-out loss"), _utility_table(s.utility, th))


def _setting_para(s: LatentSummary, attack_rows: Sequence[dict[str, Any]]) -> Para:
    """Our setting beside the paper's, and which differences in size it explains."""
    steps = sorted({str(u.steps) for u in s.utility})
    frames = sorted({str(r.get("n_docs")) for r in attack_rows if is_latent(r) and r.get("n_docs") is not None})
    return Para(
        f"Ours: {', '.join(sorted({u.model for u in s.utility}))}, {', '.join(steps)} training steps, "
        f"{', '.join(frames)} evaluation frames per run. The paper: {PAPER['setting']}. Differences in size "
        "come from these: fewer evaluation frames widen every interval (at a few dozen frames the Bonferroni "
        "interval of a probe arm is about ±2 pp wide, wider than the paper's whole defended effect), fewer "
        "steps leave the private encoder and decoder far from trained (the held-out loss below), and a "
        "smaller model with another split changes what the boundary carries. Numbers that do not depend on "
        "training, such as the exact partition by zero support, should agree exactly."
    )


def _partition_table(cells: Sequence[PartitionCell]) -> Table:
    rows = [
        [c.model, c.attack, c.arm, c.params, str(len(c.seeds)), f"{c.frames_exact:,} / {c.frames:,}", _f(c.agreement),
         _f(c.auc)]
        for c in cells
    ]  # fmt: skip
    return Table(
        ["model", "attack", "latent arm", "parameters", "seeds", "frames exact", "row agreement", "AUC"],
        rows,
        caption="Support partition: a row is called real iff its returned output gradient is non-zero; the "
        "norm rule and the classifier (fitted on the attacker's own shadow frames, never on the client's record) "
        "read the same frames after the fix, which the paper did not test. "
        f"The paper: open, {PAPER['partition_open']}; with the fix, {PAPER['partition_fix']}. "
        "decoy-history (a row matching an earlier frame's rows is a decoy) and gauge-key-search (run seeds "
        "tried against the derived keys) are built for the decoy mix and the gauges; the paper did not "
        "test them.",
    )


def _gate_para(th: GateThresholds) -> Para:
    """How the battery is read under the protocol: its gate, α, J and utility gate."""
    return Para(
        f"Read under protocol {th.protocol} (sha256 {th.protocol_hash[:12]}"
        + (f"; {th.note}" if th.note else "")
        + f"): gate +{100 * th.gate:.2f} pp, α = {th.alpha:g}, J = {th.arms} arms per view declared "
        "(002's three probe variants, mlp, features and graph, at three restarts; each view its own check), "
        + (
            "no utility gate declared."
            if th.utility_ce_increase_max is None
            else f"utility gate ≤ {th.utility_ce_increase_max:g} nats of held-out cross-entropy over the "
            "pretrained model."
        )
        + " A view whose battery measured another number of family arms is read over the arms it has, with J "
        "= those; it decides the gate only where that cannot mislead (fewer arms that already break it, more "
        "arms that hold it) and is undecided otherwise."
    )


def _probe_row(run: ProbeRun) -> list[str]:
    """One seed's battery under the protocol: the view with the largest gate statistic, the verdicts, and the
    battery-wide best arm with its shuffled-label twin."""
    v = run.verdict
    pv = run.protocol or {}
    views = pv.get("by_view", {})
    decided = [vv for vv in views.values() if vv.get("decision") != "undecided" and "best_arm" in vv]
    top = max(decided, key=lambda vv: vv["gate_statistic"]) if decided else None
    twin = "n/a" if run.twin is None else f"{_pp(run.twin_of_best)} ({run.twin.get('verdict', 'n/a')})"
    util = pv.get("utility") or {}
    return [
        run.model,
        run.arm,
        run.threat + (" (upper bound)" if run.threat == "oracle" else ""),
        str(run.seed),
        _pp(run.constant, signed=False),
        "n/a" if top is None else str(top["best_arm"]),
        "n/a"
        if top is None
        else f"{_pp(top['paired_effect'])} [{_pp(top['paired_low'])}, {_pp(top['paired_high'])}] (J = {top['J']})",
        "n/a" if top is None else _pp(top["gate_statistic"]),
        str(pv.get("verdict", "n/a")),
        _YES_NO[util.get("passes")],
        "no verdict" if run.threat == "oracle" else {True: "yes", False: "no", None: "undecided"}[pv.get("passes")],
        f"{v.get('best_arm', 'n/a')} {_pp(v.get('paired_effect'))} (J = {v.get('J', v.get('eligible'))})",
        twin,
    ]


def _probe_table(runs: Sequence[ProbeRun]) -> Table:
    return Table(
        ["model", "latent arm", "threat model", "seed", "control (%)", "family arm of the view with the largest G", "its paired effect at α/J (pp)", "G (pp)", "verdict under the protocol", "within the utility gate", "passes", "best arm of the whole battery (pp, J)", "shuffled twin (pp)"],
        [_probe_row(run) for run in runs],
        caption="Per seed, under the protocol: each view's family arms (degenerate arms, modal share > 0.99, "
        "excluded from J), the best by paired advantage over the most-frequent-token control read at α/J, "
        "and the gate statistic G; shown for the view with the largest G. A run passes when it holds the gate "
        "in every view and its held-out loss is within the utility gate. The battery-wide reading (every "
        "eligible arm of every view and model, J = their number) and the shuffled-label twin of its best "
        "arm (training labels permuted globally, the battery retrained; under the oracle the evaluation labels "
        "too) are descriptive. Threat models: shadow, the attacker's own frames of the public mechanism; "
        "trained-codec, the same through the victim's trained codec; oracle, the client's record (an upper "
        f"bound, no verdict). The paper: naked, {PAPER['probes_naked']}; defended, {PAPER['probes_defended']}.",
    )  # fmt: skip


def _arm_table(verdicts: Sequence[dict[str, Any]]) -> Table:
    yn = {True: "yes", False: "no", None: "undecided"}
    return Table(
        ["model", "latent arm", "battery", "seeds", "hold the gate", "break it", "within the utility gate", "passes"],
        [[a["model"], a["arm"], a["params"], str(a["seeds"]), str(a["seeds_holding_gate"]), str(a["seeds_breaking_gate"]),
          str(a["seeds_within_utility"]),
          "no verdict (oracle: an upper bound)" if a.get("oracle") else yn[a["passes"]]] for a in verdicts],
        caption="Per latent arm, under the protocol: an arm passes only when every seed holds the privacy "
        "gate in every view and is within the utility gate (002: \"passed both gates\"); an arm over the "
        "utility gate is never passing, however little its rows give away. A battery of the oracle threat "
        "model (trained and read with the client's record of tokens and real rows, as 002's known-plaintext "
        "probes) is an upper bound and gives no verdict.",
    )  # fmt: skip


def _pooled_table(pooled: Sequence[Pooled]) -> Table:
    rows = []
    for pool in pooled:
        loo = (
            "n/a (fewer than 3 seeds)"
            if pool.leave_one_out is None
            else f"{_pp(pool.leave_one_out[0])} … {_pp(pool.leave_one_out[1])}"
        )
        rows.append(
            [pool.model, pool.arm, pool.threat, pool.probe_arm, str(len(pool.seeds)), f"{_pp(pool.estimate)} [{_pp(pool.low)}, {_pp(pool.high)}]",
             _pp(pool.tau, signed=False), f"{100 * pool.i2:.1f}", loo]
        )  # fmt: skip
    return Table(
        ["model", "latent arm", "threat model", "probe arm", "seeds", "pooled effect (pp)", "τ (pp)", "I² (%)", "leave-one-out means (pp)"],
        rows,
        caption="Seed-level DerSimonian–Laird pooling of each probe arm (per-seed SE from its 95 % "
        "frame-bootstrap interval); the arm with the highest pooled mean, its interval at α/J over the "
        f"arms pooled. The paper: {PAPER['probes_defended']}.",
    )  # fmt: skip


def _utility_table(utility: Sequence[UtilityCell], th: GateThresholds) -> Table:
    rows = []
    for u in utility:
        cost = "n/a"
        if u.cost is not None:
            uc = u.cost
            cost = (
                f"{uc['mean']:+.4f} [{uc['min']:+.4f}, {uc['max']:+.4f}] vs {uc['against']} ({len(uc['seeds'])} seeds)"
            )
        rows.append(
            [u.model, u.arm, str(len(u.seeds)), str(u.steps), _f(u.heldout_ce), _f(u.pretrained_ce),
             f"{u.heldout_ce - u.pretrained_ce:+.3f}", _f(u.epsilon, 2), cost, _YES_NO[(u.utility_gate or {}).get("passes")]]
        )  # fmt: skip
    return Table(
        ["model", "latent arm", "seeds", "steps", "held-out CE", "pretrained CE", "Δ (nats)", "ε per row, one release", "output-gradient cost (nats): mean [min, max]", "within the utility gate"],
        rows,
        caption="Held-out cross-entropy of the deployed pipeline (noise, decoys, gauges) on the capture pass, "
        "against the frozen pretrained model; the output-gradient cost pairs each seed with the arm that "
        f"differs only in the output gradient. The paper: the fix costs {PAPER['fix_cost']}. "
        + (
            f"The protocol's utility gate ({th.protocol}): ≤ {th.utility_ce_increase_max:g} nats over the "
            "pretrained model; the last column applies it to the mean over seeds."
            if th.utility_ce_increase_max is not None
            else f"Protocol {th.protocol} declares no utility gate."
        ),
    )  # fmt: skip
