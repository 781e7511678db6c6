"""The decoy system's claims (002) read from a store's latent rows, through the grid report's own summary
(``report.grid_latent.latent_summary``), so that a reproduction and ``experiment report`` read one number.

A claim's arms name, in the latent vocabulary: ``attack`` (``support-partition`` or ``latent-probe``), the
latent ``arm`` (the spec's label: open, fix, naked), and for a partition its ``rule``, for a probe battery its
``view`` (forward, real-rows, gradient, joint, cross-gram), ``probe`` model and ``threat`` model.

- A partition's row agreement: over every row of every seed's frames, with its Wilson interval over the rows.
- A probe's paired effect over the most-frequent-token control: per seed the best non-degenerate arm of the
  named view (and probe model) — or, with ``control: shuffled-label``, its shuffled-label twin's arm — its
  frame-bootstrap interval at α unadjusted (one seed), or the mean over seeds with Student's t over them
  (several; where the seeds read exactly alike, their frame-bootstrap intervals averaged).
- Two views of one arm (a difference whose control is another ``latent-probe`` reading, 002's gradient arm over
  its forward arm): per seed the one view's best arm less the other's, Student's t over the seeds (one seed has
  no interval: the battery keeps each arm's frame-bootstrap interval, not its frames).
- A view's heterogeneity over seeds (``kind: level``, ``form: heterogeneity``): I² of the DerSimonian-Laird pool
  of the view's arm that pools highest, as the grid report pools the battery; no interval.
- A gate (002 Eq. 1, statistic ``kind: gate``): per seed the gate statistic G of the named view as the
  protocol reads the battery (``audit.gate.latent_verdict``: the largest Bonferroni-Wilson upper bound of the
  family's arms minus the constant's rate) with its decision (breaks, holds, or undecided where the battery ran
  fewer family arms than the protocol declares and holds the gate); with a ``probe`` outside the family (002's
  deep probe) G of that probe's arms alone. A gate claim that names no arm reads the protocol's threshold itself.
"""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

import numpy as np
from scipy import stats

from splitleak.errors import ConfigError
from splitleak.report.grid_common import pp
from splitleak.reproduce.claims import Claim
from splitleak.stats.binomial import gate_statistic, wilson_interval
from splitleak.stats.power import t_half_width

LATENT_ATTACKS = ("support-partition", "latent-probe")
KEYS = {
    "support-partition": {"attack", "arm", "rule"},
    "latent-probe": {"attack", "arm", "view", "probe", "threat", "control"},
}
#: a probe claim's ``control: shuffled-label`` reads the battery's shuffled-label twin (its negative control)
TWIN = "shuffled-label"
#: a level claim of this form reads the between-seed heterogeneity I² of a view (002 §5.3)
HETEROGENEITY = "heterogeneity"
CONSTANT = "most-frequent-token constant baseline"
#: the slack of a threshold's comparison with the paper's (float rounding only)
EPS = 1e-9


def is_latent(claim: Claim) -> bool:
    t = claim.statistic.treatment or {}
    return t.get("attack") in LATENT_ATTACKS


def why_not_latent(claim: Claim) -> str:
    """Why the latent reader does not measure ``claim`` ("" where it does)."""
    st = claim.statistic
    if st.kind == "other":
        return f"no reader of this statistic is built yet ({st.form or st.metric})"
    t = st.treatment or {}
    if st.kind == "gate":
        if t["attack"] != "latent-probe":
            return "a gate is read from a probe battery (attack: latent-probe)"
        if t.get("control") is not None:
            return "a gate is read on the battery itself, not on its twin"
        if ("arm" in t) != ("view" in t):
            return "a gate names both its arm and its view, or neither (the protocol's threshold)"
    unknown = sorted(set(t) - KEYS[t["attack"]])
    if unknown:
        return f"it selects by {', '.join(unknown)}, which the latent reader does not read"
    c = st.control or {}
    if st.kind == "difference" and _two_views(c):
        differs = sorted(k for k in set(t) | set(c) if t.get(k) != c.get(k))
        if differs != ["view"]:
            return (
                "a difference of two probe readings compares two views of one arm and threat model (it differs in "
                f"{', '.join(differs) or 'nothing'})"
            )
    elif st.kind == "difference" and c.get("predictor") != CONSTANT:
        return "its control is not the most-frequent-token control the probe battery measures against"
    if t.get("control") not in (None, TWIN):
        return f"its twin {t['control']!r} is not the shuffled-label twin the probe battery runs"
    if st.kind == "level" and st.form == HETEROGENEITY:
        if t["attack"] != "latent-probe" or "view" not in t or t.get("control") is not None:
            return "a heterogeneity is read of one view of a probe battery over seeds (attack: latent-probe, a view)"
    elif st.kind == "level" and t["attack"] != "support-partition" and t.get("control") != TWIN:
        return "a probe battery's level is read against its control (a difference), or of its shuffled-label twin"
    return ""


def _params(row: dict[str, Any]) -> dict[str, Any]:
    return json.loads(row["params"]) if row.get("params") else {}


def plan_jobs(claim: Claim, job_rows: Sequence[dict[str, Any]]) -> int:
    """The spec's attack jobs that read the claim's treatment (its attack, arm, rule and threat)."""
    t = claim.statistic.treatment or {}
    n = 0
    for f in job_rows:
        p = _params(f)
        if f.get("attack") != t["attack"] or ("arm" in t and f.get("defence") != t["arm"]):
            continue
        if all(p.get(k, default) == t[k] for k, default in (("rule", "support"), ("threat", "shadow")) if k in t):
            n += 1
    return n


def measure_latent(claim: Claim, summary: Any) -> tuple[float, float, float, np.ndarray, list[int], dict] | str:
    """(estimate, low, high, per-seed values, seeds, setting) of ``claim`` from a ``LatentSummary``, or why none."""
    why = why_not_latent(claim)
    if why:
        return why
    t = claim.statistic.treatment or {}
    if claim.statistic.kind == "gate":
        return _gate(t, summary)
    if t["attack"] == "support-partition":
        return _partition(t, summary)
    c = claim.statistic.control or {}
    if _two_views(c):
        return _view_difference(t, c, summary)
    if claim.statistic.form == HETEROGENEITY:
        return _heterogeneity(t, summary)
    return _probe(t, summary)


def _heterogeneity(t: dict[str, Any], summary: Any):
    """I² of the named view's paired effect over seeds: the DerSimonian-Laird pool of the view's arm that pools
    highest (``stats.random_effects``; each seed's SE from its 95 % frame-bootstrap interval, as the grid
    report's pooling and 002's artefact derive it). No interval is drawn around I² (ours)."""
    # lazy: the random-effects pool is the grid report's statistics
    from splitleak.stats import random_effects

    runs = [r for r in summary.probes if r.arm == t.get("arm", r.arm) and r.threat == t.get("threat", "shadow")]
    by_seed: dict[int, dict[str, dict[str, Any]]] = {}
    for r in runs:
        arms = {a["arm"]: a for a in r.arms if not a.get("degenerate") and a["arm"].split("/")[0] == t["view"]}
        if arms:
            by_seed.setdefault(r.seed, {}).update(arms)
    if len(by_seed) < 2:
        return f"I² needs the {t['view']} view on two seeds or more; the store holds it on {len(by_seed)}"
    seeds = sorted(by_seed)
    z = float(stats.norm.ppf(0.975))
    pools = {}
    for name in set.intersection(*(set(by_seed[s]) for s in seeds)):
        y = np.array([by_seed[s][name]["paired_effect"] for s in seeds], dtype=float)
        v = np.array(
            [((by_seed[s][name]["paired_high"] - by_seed[s][name]["paired_low"]) / (2 * z)) ** 2 for s in seeds]
        )
        if (v > 0).all():
            pools[name] = (random_effects(y, v), y)
    if not pools:
        return f"no arm of the {t['view']} view has a non-degenerate interval on every seed"
    name = max(sorted(pools), key=lambda n: pools[n][0].estimate)
    re, y = pools[name]
    setting = {"arm": t.get("arm"), "threat": t.get("threat", "shadow"), "probe arm": name, "tau (pp)": round(100 * re.tau, 4),
               "Q": round(re.q, 3), "model": runs[0].model, "victim_seeds": len(seeds)}  # fmt: skip
    return re.i2, math.nan, math.nan, y, seeds, setting


def _two_views(control: dict[str, Any]) -> bool:
    """Whether a difference's control is another probe reading rather than the constant (a family's member
    control carries its treatment's fields beside ``predictor``)."""
    return control.get("attack") == "latent-probe" and "predictor" not in control


def _view_difference(t: dict[str, Any], c: dict[str, Any], summary: Any):
    """One view's paired effect less another's (each the best non-degenerate arm of its view over the constant),
    per seed that ran both; Student's t over the seeds (one seed: no interval, as the per-arm frame bootstrap
    is not kept per frame)."""
    per_view, model = [], None
    for arm in (t, c):
        got = _probe(arm, summary)
        if isinstance(got, str):
            return got
        per_view.append(dict(zip(got[4], got[3])))
        model = got[5]["model"]
    seeds = sorted(set(per_view[0]) & set(per_view[1]))
    if not seeds:
        return f"no seed ran both the {t['view']} and the {c['view']} view"
    values = np.array([per_view[0][s] - per_view[1][s] for s in seeds])
    half = t_half_width(values)
    mean = float(values.mean())
    setting = {"arm": t.get("arm"), "threat": t.get("threat", "shadow"), "views": f"{t['view']} - {c['view']}",
               "model": model, "victim_seeds": len(seeds)}  # fmt: skip
    return mean, mean - half, mean + half, values, seeds, setting


def _gate(t: dict[str, Any], summary: Any):
    """G per seed of the named arm, view (and probe) with its decision in ``setting["decisions"]``; with no arm,
    the threshold of the protocol the summary was read under."""
    th = summary.thresholds
    if th is None:
        return "the store's latent summary was read under no protocol: it has no gate"
    if "arm" not in t:
        setting = {"protocol": th.protocol, "protocol_hash": th.protocol_hash[:12]}
        return th.gate, float("nan"), float("nan"), np.array([th.gate]), [], setting
    view, probe, threat = t["view"], t.get("probe"), t.get("threat", "shadow")
    runs = [r for r in summary.probes if r.arm == t["arm"] and r.threat == threat]
    if not runs:
        return f"the store holds no probe battery of arm {t['arm']} under threat model {threat}"
    per_seed: dict[int, tuple[float, str]] = {}
    for r in runs:
        if probe is None:
            v = ((r.protocol or {}).get("by_view") or {}).get(view)
            if v is not None and "gate_statistic" in v:
                per_seed[r.seed] = (float(v["gate_statistic"]), v["decision"])
            continue
        arms = [a for a in r.arms if not a.get("degenerate") and a["arm"].split("/")[:2] == [view, probe]]
        if arms:  # one probe's arms, Bonferroni over them: not the family, so no declared J to fall short of
            g = gate_statistic([a["right"] for a in arms], [a["known"] for a in arms], r.constant, th.alpha, th.gate)
            per_seed[r.seed] = (float(g.G), "breaks" if g.breaks else "holds")
    if not per_seed:
        what = f"{probe} probe on the {view} view" if probe else f"family arm on the {view} view"
        return f"no battery of arm {t['arm']} under threat model {threat} ran a non-degenerate {what}"
    seeds = sorted(per_seed)
    values = np.array([per_seed[s][0] for s in seeds])
    setting = {"arm": t["arm"], "view": view, "threat": threat, "model": runs[0].model, "victim_seeds": len(seeds)}
    if probe:
        setting["probe"] = probe
    setting["decisions"] = {s: per_seed[s][1] for s in seeds}
    # G is itself a one-sided bound (a Wilson upper bound less a rate): no interval is drawn around it
    return float(values.max()), float("nan"), float("nan"), values, seeds, setting


def _partition(t: dict[str, Any], summary: Any):
    rule = t.get("rule", "support")
    cells = [
        c
        for c in summary.partition
        if c.attack == "support-partition" and c.arm == t.get("arm", c.arm) and f"rule={rule}" in c.params
    ]
    if not cells:
        return f"the store holds no {rule} partition of arm {t.get('arm')}"
    c = cells[0]
    if c.rows:
        iv = wilson_interval(int(round(c.agreement * c.rows)), c.rows)
        low, high = iv.low, iv.high
    else:
        low = high = c.agreement
    setting = {"arm": c.arm, "rule": rule, "model": c.model, "victim_seeds": len(c.seeds), "frames": c.frames}
    return c.agreement, low, high, np.array([c.agreement]), c.seeds, setting


def _probe(t: dict[str, Any], summary: Any):
    view, probe, threat = t.get("view"), t.get("probe"), t.get("threat", "shadow")
    runs = [r for r in summary.probes if r.arm == t.get("arm", r.arm) and r.threat == threat]
    if not runs:
        return f"the store holds no probe battery of arm {t.get('arm')} under threat model {threat}"
    per_seed: dict[int, dict[str, Any]] = {}
    for r in runs:
        arms = [
            a
            for a in r.arms
            if not a.get("degenerate")
            and (view is None or a["arm"].split("/")[0] == view)
            and (probe is None or a["arm"].split("/")[1] == probe)
        ]
        if arms:
            best = max(arms, key=lambda a: a["paired_effect"])
            if t.get("control") == TWIN:  # the twin of the same arm: fitted and scored on shuffled labels
                best = next((a for a in r.twin_arms or [] if a["arm"] == best["arm"]), None)
                if best is None:
                    continue
            per_seed[r.seed] = best
    if not per_seed:
        twin = " with its shuffled-label twin" if t.get("control") == TWIN else ""
        return f"no battery of arm {t.get('arm')} ran a non-degenerate {view or ''} {probe or ''} arm{twin}".replace(
            "  ", " "
        )
    seeds = sorted(per_seed)
    values = np.array([per_seed[s]["paired_effect"] for s in seeds])
    if len(seeds) == 1:
        low, high = per_seed[seeds[0]]["paired_low"], per_seed[seeds[0]]["paired_high"]
    elif values.std(ddof=1) == 0:
        # seeds that read exactly alike (counts over the same frame count can) give Student's t no width: claim no
        # more than each seed's own frames do, their frame-bootstrap intervals averaged
        low = float(np.mean([per_seed[s]["paired_low"] for s in seeds]))
        high = float(np.mean([per_seed[s]["paired_high"] for s in seeds]))
    else:
        half = t_half_width(values)
        low, high = float(values.mean()) - half, float(values.mean()) + half
    setting = {"arm": t.get("arm"), "threat": threat, "model": runs[0].model, "victim_seeds": len(seeds)}
    setting["best arms"] = sorted({per_seed[s]["arm"] for s in seeds})
    return float(values.mean()), float(low), float(high), values, seeds, setting


def gate_rule(claim: Claim, m: Any) -> tuple[str, str]:
    """A gate claim: the paper's G against its pass mark (above: the gate breaks) and ours per seed, each seed's
    decision as the protocol reads its battery. Agrees where every seed decides the paper's way, disagrees where
    one decides the other way, and is underpowered where a seed's battery cannot decide (fewer family arms than
    declared, holding the gate). A claim of the threshold itself agrees where our protocol's equals the paper's."""
    a, p = claim.agreement, claim.paper
    decisions = m.setting.get("decisions")
    if decisions is None:
        if p.estimate is None:
            return "no number", f"ours: the gate at {pp(m.estimate)} pp; the seed text gives no threshold"
        same = abs(m.estimate - p.estimate) <= EPS
        return ("agrees" if same else "disagrees"), (
            f"our protocol {m.setting['protocol']} breaks the gate above {pp(m.estimate)} pp; the paper's gate is "
            f"{pp(p.estimate)} pp"
        )
    if a.rule != "pass-mark" or a.pass_mark is None:
        raise ConfigError(f"claim {claim.id}: a gate is judged by the paper's pass mark (rule: pass-mark)")
    mark = a.pass_mark
    per_seed = "; ".join(f"seed {s} G {pp(g)} pp {decisions[s]}" for s, g in zip(m.seeds, m.units))
    theirs = [x for x in (p.estimate, p.low, p.high, *(p.range or ())) if x is not None]
    if not theirs:
        return "no number", f"ours: {per_seed}; the seed text gives no G to compare with"
    if all(x > mark for x in theirs):
        side, other = "breaks", "holds"
    elif all(x <= mark for x in theirs):
        side, other = "holds", "breaks"
    else:
        return "no number", f"ours: {per_seed}; the paper's cells fall on both sides of {pp(mark)} pp"
    said = f"ours: {per_seed}; the paper's G {side} the {pp(mark)} pp gate"
    ds = list(decisions.values())
    if other in ds:
        return "disagrees", said
    if all(d == side for d in ds):
        return "agrees", said
    return "underpowered", said + " (a battery of fewer family arms than the protocol declares cannot hold it)"
