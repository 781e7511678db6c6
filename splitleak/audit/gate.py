"""The gate, its α, the arm family J and the utility gate, read from the frozen protocol the results are
checked against (Politis & Pappas 2026, §3 Eq. 1, Table 1), and the verdicts that use them.

A protocol declares them as ``thresholds: {gate, alpha, utility_ce_increase_max}`` and its gate test
``tests: [{statistic: gate, arms: J}]`` (``gate_002.yaml``). Where a verdict takes them from:

- ``splitleak protocol analyse FILE`` and a grid's report: the protocol given (``thresholds_of``). A
  protocol that declares no gate (``paper_main``) gets the shipped gate_002's, and every verdict says
  so (``resolve_thresholds``);
- the plain ``splitleak audit`` and ``splitleak tune``, which run on embedded defaults without a
  protocol argument: the shipped ``gate_002.yaml``, loaded from the package with its freeze checked
  (``shipped_thresholds``; an edited shipped file is refused, never silently read).

Every verdict records what it used (``GateThresholds.as_dict``: the values, the protocol's name and
SHA-256, and a note when they are not the checked protocol's own).

**The arm family J.** 002 §3: "J be the nine predeclared probe arms (three probe variants, each scored
at three restarts; Table 1)"; Table 1 names the variants "coordinate plus invariants, invariant only,
and invariant graph", which are splitleak's probe models ``mlp``, ``features`` and ``graph``
(``splitleak.attacks.probes``), and Table 8 reads each view (the gradient arm, the forward arm) as its
own check over its nine. So the protocol's family in the latent battery is, per view, the arms
``VIEW/{mlp,features,graph}/RESTART`` (``FAMILY_MODELS``); the deep probe (Table 6) and any further
model lie outside it and are read only in the battery-wide reading, whose J is every eligible arm it
compared. J is always the number of arms compared: degenerate arms (modal share > 0.99) are excluded
and named, and a view whose measured family differs in size from the declared J (fewer restarts or
models) is read over the arms it has, with J = those arms, and marked as not the protocol's family
(``matches_declared`` false). Such a reading decides the gate only in the direction the family's
structure allows (``view_decision``: fewer arms that already break it, or more arms that hold it), and
is undecided otherwise. Each view is its own check, as in 002 (no correction across views); a run's
verdict names the views that break the gate.

In the plain audit the arms are the audit's attacks less its controls; 002's nine name the probe
battery, not them, so the audit's J is the number of its arms, recorded beside the declared one.

**The utility gate.** ``utility_ce_increase_max``: a configuration whose held-out cross-entropy
exceeds its reference by more than this is not a passing configuration, however well it holds the
privacy gate (002 Table 1: "held-out cross-entropy increase ≤ 0.35 nats passes"). The verdict names
the reference: the undefended twin (or all-local run) for a split, the frozen pretrained model for a
latent arm (002's Δ loss). A protocol that declares no utility gate applies none, and says so.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from splitleak.audit.protocol import SHIPPED, Protocol, load_protocol
from splitleak.errors import ConfigError, DataError
from splitleak.stats import Interval, frame_weights
from splitleak.stats.paired import ArmStats, battery_verdict

#: the protocol whose thresholds the plain audit and the tune use (they take no protocol argument)
DEFAULT_PROTOCOL = SHIPPED / "gate_002.yaml"
#: 002 Table 1's three probe variants, by splitleak's probe model names: coordinates plus invariants,
#: invariants only, the invariant graph. With three restarts each, 002's nine arms per view.
FAMILY_MODELS = ("mlp", "features", "graph")
FAMILY_TEXT = (
    "per view, 002's three probe variants (mlp: coordinates plus invariants; features: invariants only; "
    "graph: the invariant graph) at every restart; each view its own check, as in 002 Table 8"
)


@dataclass(frozen=True)
class GateThresholds:
    """What a verdict is read against, and where it came from."""

    gate: float  # G above this breaks the gate (0.01 = +1.0 pp)
    alpha: float  # family-wise level, split by Bonferroni over the J arms compared
    arms: int | None  # J as the protocol declares it (its gate test's ``arms``)
    utility_ce_increase_max: float | None  # nats; None: the protocol declares no utility gate
    protocol: str  # the protocol's name
    protocol_hash: str
    note: str = ""  # why these are not the checked protocol's own, when they are not

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _number(value: Any, what: str, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ConfigError(f"protocol {path}: {what} is {value!r}; write a finite number")
    return float(value)


def thresholds_of(protocol: Protocol, protocol_hash: str) -> GateThresholds | None:
    """The protocol's gate thresholds, or None when it declares no ``gate``."""
    th = protocol.thresholds
    if "gate" not in th:
        return None
    gate = _number(th["gate"], "thresholds.gate", protocol.name)
    if "alpha" not in th:
        raise ConfigError(f"protocol {protocol.name} declares a gate but no thresholds.alpha; write the level (0.05)")
    alpha = _number(th["alpha"], "thresholds.alpha", protocol.name)
    if not 0 < alpha < 1:
        raise ConfigError(
            f"protocol {protocol.name}: thresholds.alpha is {alpha}; write a level strictly between 0 and 1"
        )
    util = th.get("utility_ce_increase_max")
    declared = [t["arms"] for t in protocol.tests if t.get("statistic") == "gate" and "arms" in t]
    if len(declared) > 1:
        raise ConfigError(f"protocol {protocol.name} has {len(declared)} gate tests with arms; write one")
    arms = None
    if declared:
        a = declared[0]
        if isinstance(a, bool) or not isinstance(a, int) or a < 1:
            raise ConfigError(f"protocol {protocol.name}: the gate test's arms is {a!r}; write a positive integer J")
        arms = int(a)
    return GateThresholds(
        gate,
        alpha,
        arms,
        None if util is None else _number(util, "thresholds.utility_ce_increase_max", protocol.name),
        protocol.name,
        protocol_hash,
    )


@lru_cache(maxsize=4)
def _shipped(path: str, mtime_ns: int) -> GateThresholds:
    proto, digest = load_protocol(path)
    th = thresholds_of(proto, digest)
    if th is None:
        raise ConfigError(f"{path} declares no gate; it cannot serve as the default protocol")
    return th


def shipped_thresholds() -> GateThresholds:
    """The shipped gate_002's thresholds (its freeze checked), for the audit and the tune."""
    p = Path(DEFAULT_PROTOCOL)
    return _shipped(str(p), p.stat().st_mtime_ns)


def resolve_thresholds(protocol: Protocol, protocol_hash: str) -> GateThresholds:
    """The protocol's own thresholds, or, when it declares no gate, the shipped gate_002's with a note."""
    own = thresholds_of(protocol, protocol_hash)
    if own is not None:
        return own
    d = shipped_thresholds()
    return GateThresholds(
        d.gate,
        d.alpha,
        d.arms,
        d.utility_ce_increase_max,
        d.protocol,
        d.protocol_hash,
        f"protocol {protocol.name} declares no gate; these are the shipped {d.protocol}'s",
    )


# ------------------------------------------------------------------ the utility gate


def utility_gate(ce_increase: float | None, th: GateThresholds, reference: str) -> dict[str, Any]:
    """Whether a configuration's held-out CE increase over ``reference`` is within the protocol's utility
    gate: ``passes`` True / False, or None when unmeasured or when the protocol declares no gate."""
    limit = th.utility_ce_increase_max
    out: dict[str, Any] = {"ce_increase": ce_increase, "max": limit, "reference": reference, "passes": None}
    if limit is None:
        out["text"] = f"protocol {th.protocol} declares no utility gate"
    elif ce_increase is None or not math.isfinite(ce_increase):
        out["text"] = f"utility gate ≤ {limit:g} nats over {reference}: not measured"
    else:
        out["passes"] = bool(ce_increase <= limit)
        out["text"] = (
            f"held-out CE {ce_increase:+.4f} nats over {reference}, "
            f"{'within' if out['passes'] else 'over'} the utility gate of {limit:g} nats"
        )
    return out


def unverified_utility(run_dir: str | Path, why: str | None, th: GateThresholds, reference: str) -> dict[str, Any]:
    """The utility gate of a run that does not verify: not measured (``passes`` None, so the configuration
    cannot be called passing where the protocol declares a utility gate), marked ``unverified`` with why,
    as ``compare`` marks it: what its metrics.json says is not vouched for by its journal."""
    out = utility_gate(None, th, reference)
    out["unverified"] = f"{run_dir}: {why}"
    out["text"] = (
        f"utility unverified: the run {run_dir} does not verify ({why}); its metrics are not read as measured "
        "(`splitleak verify` names what changed: retrain or restore the run)"
    )
    return out


def passes(privacy_holds: bool | None, utility: dict[str, Any] | None) -> bool | None:
    """A configuration passes when it holds the privacy gate and is within the utility gate (an
    unmeasured utility, where the protocol declares a gate, leaves it undecided)."""
    if privacy_holds is None:
        return None
    if not privacy_holds:
        return False
    if utility is None or utility.get("max") is None:
        return True
    return utility.get("passes")


def gate_record(th: GateThresholds, compared: Sequence[str]) -> dict[str, Any]:
    """What a split verdict's gate used: α, the J arms compared (named) beside the protocol's declared J,
    and the protocol (name, SHA-256). 002's declared J names its probe battery; a split's family is the
    arms it ran, so J is their number and the record says so."""
    return {
        "alpha": th.alpha,
        "J": len(compared),
        "declared_J": th.arms,
        "family": "the audit's attacks less its controls (002's declared J names its probe battery, not these)",
        "thresholds": th.as_dict(),
    }


def audit_utility(baseline: dict[str, Any], th: GateThresholds, defended: bool) -> dict[str, Any]:
    """The plain audit's utility gate on ΔU, its held-out CE over the undefended run
    (``splitleak.audit.run.utility_baseline``), with the sentence the verdict carries when it decides
    something: an undefended run is its own reference (ΔU = 0 by construction) and says nothing."""
    u = utility_gate(baseline.get("delta_u"), th, "the undefended run (ΔU)")
    u["sentence"] = ""
    if defended and u["passes"] is False:
        u["sentence"] = (
            f"UTILITY: the defended run fails {th.protocol}'s utility gate ({u['text']}), so it is not a passing "
            "configuration, whatever the attacks read."
        )
    elif defended and u["passes"] is None and u["max"] is not None:
        u["sentence"] = f"UTILITY: {u['text']}, so the run cannot be called passing."
    return u


# ------------------------------------------------------------------ the latent probe battery


def split_arm(name: str) -> tuple[str, str, str]:
    """``VIEW/MODEL/RESTART`` (``splitleak.attacks.probes.ArmPredictions.name``) as its three parts."""
    parts = name.split("/")
    if len(parts) != 3:
        raise DataError(f"probe arm {name!r} is not named VIEW/MODEL/RESTART")
    return parts[0], parts[1], parts[2]


def in_family(name: str) -> bool:
    return split_arm(name)[1] in FAMILY_MODELS


def view_decision(r: dict[str, Any]) -> str:
    """``breaks`` / ``holds`` / ``undecided`` for one view's ``battery_verdict`` under a declared J.

    With the declared number of family arms (or none declared) the gate decides both ways. G only rises
    with J (each arm's Bonferroni-Wilson bound widens as α / J shrinks, and the maximum runs over more
    arms), and a smaller measured family is a subset of the declared one, so: fewer arms than declared
    that already break the gate decide it (the whole family breaks too); more arms than declared that
    hold it decide it (every declared subset holds too); the other two cases are undecided."""
    if "gate_statistic" not in r:
        return "undecided"
    broken = bool(r["breaks_gate"])
    declared, measured = r.get("declared_J"), r.get("family_measured")
    if declared is None or measured == declared:
        return "breaks" if broken else "holds"
    if measured < declared:
        return "breaks" if broken else "undecided"
    return "undecided" if broken else "holds"


def latent_verdict(
    arms: Sequence[ArmStats],
    weights: np.ndarray,
    constant_rate: float,
    th: GateThresholds,
    utility: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The probe battery read under the protocol: per view, ``battery_verdict`` over the view's arms of
    002's family (module docstring) at the protocol's α and gate, with the declared J checked
    (``view_decision``); the run breaks the gate when a view decidedly breaks it, holds it when every
    view decidedly holds it, and passes when it holds it and meets the utility gate (when given)."""
    views: list[str] = []
    for a in arms:
        v = split_arm(a.name)[0]
        if v not in views:
            views.append(v)
    by_view: dict[str, dict[str, Any]] = {}
    for view in views:
        fam = [a for a in arms if split_arm(a.name)[0] == view and in_family(a.name)]
        if not fam:
            r: dict[str, Any] = {
                "verdict": "no family arm measured",
                "J": 0,
                "family_measured": 0,
                "declared_J": th.arms,
                "matches_declared": False if th.arms is not None else None,
                "family_correction": f"none: the battery ran no {'/'.join(FAMILY_MODELS)} probe on this view",
            }
        else:
            r = battery_verdict(list(fam), weights, constant_rate, alpha=th.alpha, gate=th.gate, declared=th.arms)
        r["decision"] = view_decision(r)
        by_view[view] = r
    outside = [a.name for a in arms if not in_family(a.name)]
    breaking = [v for v, r in by_view.items() if r["decision"] == "breaks"]
    undecided = [v for v, r in by_view.items() if r["decision"] == "undecided"]
    detected = [
        v for v, r in by_view.items() if r.get("verdict") == "detected" and r.get("matches_declared") is not False
    ]
    privacy: bool | None
    if breaking:
        privacy = False
        g = max(by_view[v]["gate_statistic"] for v in breaking)
        words = f"breaks the gate in {', '.join(breaking)} (G up to {100 * g:+.2f} pp > {100 * th.gate:+.2f} pp)"
    elif undecided:
        privacy = None
        words = (
            f"undecided: {', '.join(undecided)} did not measure the declared family of J = {th.arms} arms "
            f"({FAMILY_TEXT}) and its reading does not decide the gate"
        )
        held = [v for v, r in by_view.items() if r["decision"] == "holds"]
        if held:
            words += f"; holds it in {', '.join(held)}"
    else:
        privacy = True
        words = f"holds the gate (+{100 * th.gate:.2f} pp) in every view ({', '.join(views)})"
    ok = passes(privacy, utility)
    if utility is not None and utility.get("passes") is False:
        words += f"; {utility['text']}: not a passing configuration"
    elif utility is not None and (utility.get("max") is not None or utility.get("unverified")):
        words += f"; {utility['text']}"
    js = sorted({int(r["J"]) for r in by_view.values()})
    return {
        "thresholds": th.as_dict(),
        "family": FAMILY_TEXT,
        "J": js[0] if len(js) == 1 else js,
        "by_view": by_view,
        "views_breaking_gate": breaking,
        "views_undecided": undecided,
        "views_detected": detected,
        "outside_family": outside,
        "privacy_holds": privacy,
        "utility": utility,
        "passes": ok,
        "verdict": words,
    }


def probe_stats(arm_rows: Sequence[dict[str, Any]], deltas: dict[str, np.ndarray]) -> list[ArmStats]:
    """The battery's ``ArmStats`` rebuilt from a result's ``probes.arms`` and the per-frame paired
    differences of each arm (``paired_delta`` of its predictions file or store rows, in frame order)."""
    out = []
    for a in arm_rows:
        name = a["arm"]
        if name not in deltas:
            raise DataError(f"probe arm {name} has no per-frame paired differences")
        d = np.asarray(deltas[name], dtype=np.float64)
        iv = Interval(float(a["paired_effect"]), float(a["paired_low"]), float(a["paired_high"]), 0, 0.05)
        out.append(
            ArmStats(
                name,
                float(a["accuracy"]),
                int(a["right"]),
                int(a["known"]),
                float(a["modal_share"]),
                bool(a["degenerate"]),
                iv,
                d,
            )
        )
    return out


def probe_weights(probes: dict[str, Any], n_frames: int, battery_seed: Any) -> np.ndarray:
    """The frame resampling the battery scored with: ``probes.bootstrap`` (n_boot, seed) as recorded, or
    ``score_arms``' defaults (10,000 replicates, the battery's seed) for results that predate the record."""
    boot = probes.get("bootstrap") or {"n_boot": 10_000, "seed": battery_seed}
    return frame_weights(n_frames, int(boot["n_boot"]), boot["seed"])


def reread_probes(
    probes: dict[str, Any],
    frame_rows: Sequence[dict[str, Any]],
    battery_seed: Any,
    th: GateThresholds,
    utility: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A stored battery result read under ``th``: ``probes`` is the result's ``probes`` record,
    ``frame_rows`` its per-(arm, frame) rows (``arm``, ``frame_id`` or ``doc_id``, ``paired_delta``)."""
    per: dict[str, dict[int, float]] = {}
    for r in frame_rows:
        fid = r.get("frame_id", r.get("doc_id"))
        if r.get("arm") is None or fid is None or r.get("paired_delta") is None:
            continue
        per.setdefault(str(r["arm"]), {})[int(fid)] = float(r["paired_delta"])
    frames = sorted({f for d in per.values() for f in d})
    if not frames:
        raise DataError("the battery result has no per-frame paired differences to read")
    deltas = {}
    for arm, d in per.items():
        if set(d) != set(frames):
            raise DataError(f"probe arm {arm} lacks the paired difference of some frames")
        deltas[arm] = np.array([d[f] for f in frames])
    stats = probe_stats(probes["arms"], deltas)
    weights = probe_weights(probes, len(frames), battery_seed)
    return latent_verdict(stats, weights, float(probes["constant"]["accuracy"]), th, utility)


#: how a battery's shuffled-label twin's per-frame differences are named in its predictions file
TWIN_PREFIX = "twin:"
