"""The decoy system's dose-ladder claims (002 §4.1, Table 4, Table 5) read from a store's ``dose-ladder`` jobs,
through the grid report's own records (``report.grid_dose.dose_runs``), so that a reproduction and ``experiment
report`` read one number. A claim of this kind is ``kind: dose``; its treatment names the ``attack``
(``dose-ladder``), the latent ``arm`` (the spec's label, e.g. open) and the dosed ``channel``; two forms:

- ``onset``: where ``metric`` (``token_top1``, ``gate`` or ``rare_token_top1``) first detects the planted leak on
  the treatment's ``axis`` (default: coordinate coverage at amplitude 1), per victim seed. Ours is the median
  over seeds, with the seeds' smallest and largest onset (a range, not an interval). The rule (ours): it agrees
  where every seed's onset lies within the paper's onset ± ``tolerance``; it is underpowered where a seed's
  zero-dose cell already detects (the instrument fires without a leak at this size), where the seeds fall on
  both sides of the band, or where every seed detects later than the band but, at the paper's onset dose, a
  seed's interval of the metric's effect still holds the paper's effect there (``paper.also.effect_at_onset``:
  this run cannot tell its effect from the paper's); it disagrees otherwise (every seed earlier than the band,
  or later with the paper's effect outside its interval). A seed on which no dose detects has its onset after
  the axis's last dose.
- ``effect``: ``metric`` ``token_top1``'s point effect over the most-frequent-token constant at the dose the
  treatment names (``mode``, ``coverage``, ``amplitude``): the best arm's per-frame paired differences, a seeds x
  frames matrix read with the crossed bootstrap (the frames are the evaluation documents, shared by the seeds),
  judged by the claim's rule with the power of a paired test over frames.
"""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

import numpy as np

from splitleak.reproduce.claims import Claim
from splitleak.stats.bootstrap import crossed_bootstrap_ci

ATTACK = "dose-ladder"
FORMS = ("onset", "effect")
ONSET_METRICS = ("token_top1", "gate", "rare_token_top1")
DEFAULT_AXIS = "coordinate coverage (amplitude 1)"
KEYS = {"attack", "arm", "channel", "axis", "mode", "coverage", "amplitude"}
#: the slack of the comparisons with the band's edges (float rounding only)
EPS = 1e-9


def is_dose(claim: Claim) -> bool:
    return claim.statistic.kind == "dose"


def why_not_dose(claim: Claim) -> str:
    """Why the dose reader does not measure ``claim`` ("" where it does)."""
    # lazy: the grid report's dose section (and its document model) is needed only for a dose claim
    from splitleak.report.grid_dose import AXES

    st = claim.statistic
    t = st.treatment or {}
    if t.get("attack") != ATTACK:
        return f"a dose claim reads the {ATTACK} job (attack: {ATTACK})"
    unknown = sorted(set(t) - KEYS)
    if unknown:
        return f"it selects by {', '.join(unknown)}, which the dose reader does not read"
    if st.form not in FORMS:
        return f"a dose claim's form is one of {', '.join(FORMS)}, not {st.form!r}"
    if st.form == "onset":
        if st.metric not in ONSET_METRICS:
            return f"an onset is read of {', '.join(ONSET_METRICS)}, not of {st.metric!r}"
        if t.get("axis", DEFAULT_AXIS) not in AXES:
            return f"unknown axis {t.get('axis')!r}; the ladder's axes are {', '.join(AXES)}"
    elif st.metric != "token_top1" or not all(k in t for k in ("mode", "coverage", "amplitude")):
        return "an effect is read of token_top1 at one dose (mode, coverage and amplitude)"
    return ""


def dose_jobs(claim: Claim, job_rows: Sequence[dict[str, Any]]) -> int:
    """The spec's dose-ladder jobs that read the claim's arm and channel."""
    t = claim.statistic.treatment or {}
    n = 0
    for f in job_rows:
        p = json.loads(f["params"]) if f.get("params") else {}
        if f.get("attack") == ATTACK and ("arm" not in t or f.get("defence") == t["arm"]):
            n += p.get("channel", "activations") == t.get("channel", "activations")
    return n


def _runs(t: dict[str, Any], rows: Sequence[dict[str, Any]]):
    # lazy: as in why_not_dose
    from splitleak.report.grid_dose import dose_runs

    return [
        r
        for r in dose_runs(rows)
        if r.channel == t.get("channel", "activations") and ("arm" not in t or r.arm == t["arm"])
    ]


def measure_dose(claim: Claim, rows: Sequence[dict[str, Any]], n_boot: int, alpha: float, seed: int = 0):
    """(estimate, low, high, units, seeds, frames, models, setting, unit, detail) of ``claim``, or why none."""
    why = why_not_dose(claim)
    if why:
        return why
    st = claim.statistic
    t = st.treatment or {}
    runs = _runs(t, rows)
    if not runs:
        return f"the store holds no {ATTACK} job of arm {t.get('arm', 'any')} dosing {t.get('channel', 'activations')}"
    setting = {
        "model": ", ".join(sorted({r.model for r in runs})),
        "arm": ", ".join(sorted({r.arm for r in runs})),
        "channel": runs[0].channel,
        "victim_seeds": len(runs),
        "frames": runs[0].frames,
    }
    models = sorted({r.model for r in runs})
    seeds = [r.seed for r in runs]
    if st.form == "onset":
        return _onset(claim, runs, setting, models, seeds)
    return _effect(t, runs, setting, models, seeds, n_boot, alpha, seed)


def _effect(t, runs, setting, models, seeds, n_boot: int, alpha: float, seed: int):
    # lazy: as in why_not_dose
    from splitleak.report.grid_dose import dose_name

    name = dose_name(t["mode"], float(t["coverage"]), float(t["amplitude"]))
    per_seed = [r.frame_delta.get(name) for r in runs]
    if any(not f for f in per_seed):
        return f"a {ATTACK} job did not read the dose {name.rstrip('/')}"
    frames = sorted(per_seed[0])
    if any(sorted(f) != frames for f in per_seed):
        return "the seeds' ladders read different evaluation frames, so their frames cannot be crossed"
    mt = np.array([[f[i] for i in frames] for f in per_seed], dtype=float)
    iv = crossed_bootstrap_ci(mt, n_boot=n_boot, alpha=alpha, seed=seed)
    setting = {**setting, "dose": name.rstrip("/")}
    return iv.estimate, iv.low, iv.high, mt.mean(axis=0), seeds, len(frames), models, setting, "frames", {}


def _onset(claim: Claim, runs, setting, models, seeds):
    st, t = claim.statistic, claim.statistic.treatment or {}
    axis = t.get("axis", DEFAULT_AXIS)
    per_seed = []
    for r in runs:
        doses = r.axis(axis)
        if not doses:
            return f"a {ATTACK} job read no dose on the axis {axis}"
        onset = r.onset(st.metric, axis)
        key = "amplitude" if "amplitude (" in axis else "coverage"
        zero = next((d for d in doses if d[key] == 0.0), None)
        per_seed.append(
            {
                "seed": r.seed,
                "onset": onset,
                "last": doses[-1][key],
                "zero_detects": zero is not None and onset == 0.0,
                "at_paper": _effect_at(r, st.metric, axis, claim.paper.estimate),
            }
        )
    values = np.array([math.inf if s["onset"] is None else s["onset"] for s in per_seed], dtype=float)
    finite = values[np.isfinite(values)]
    est = float(np.median(values)) if len(finite) == len(values) else math.inf
    detail = {"axis": axis, "per_seed": per_seed}
    setting = {**setting, "axis": axis}
    low, high = float(values.min()), float(values.max())
    return est, low, high, values, seeds, setting["frames"], models, setting, "victim seeds", detail


def _effect_at(run, metric: str, axis: str, paper_onset: float | None) -> tuple[float, float] | None:
    """The seed's interval of ``metric``'s effect over the constant at the paper's onset dose (None: not read)."""
    if paper_onset is None:
        return None
    key = "amplitude" if "amplitude (" in axis else "coverage"
    d = next((d for d in run.axis(axis) if abs(d[key] - paper_onset) <= EPS), None)
    if d is None:
        return None
    if metric == "rare_token_top1":
        rare = d["rare_token_top1"]
        if rare.get("accuracy") is None or rare.get("high") is None:
            return None
        return rare["low"] - rare["constant"], rare["high"] - rare["constant"]
    tt = d["token_top1"]
    return tt["paired_low"], tt["paired_high"]


def _first(onset: float | None) -> str:
    return "no dose detects" if onset is None else f"first detects at {onset:g}"


def onset_rule(claim: Claim, detail: dict[str, Any]) -> tuple[str, str]:
    """An onset claim's verdict (module docstring) from ``measure_dose``'s per-seed detail."""
    a, p = claim.agreement, claim.paper
    per_seed = detail["per_seed"]
    said = "ours: " + "; ".join(f"seed {s['seed']} {_first(s['onset'])}" for s in per_seed)
    if p.estimate is None:
        return "no number", f"{said}; the seed text gives no onset"
    if a.tolerance is None:
        return "no number", f"{said}; the claim gives no tolerance around the paper's onset"
    lo, hi = p.estimate - a.tolerance - EPS, p.estimate + a.tolerance + EPS
    band = f"the paper's onset {p.estimate:g} +- {a.tolerance:g}"
    if any(s["zero_detects"] for s in per_seed):
        return "underpowered", f"{said}; the zero-dose cell already detects, so no onset can be read at this size"
    sides = {"within" if s["onset"] is not None and lo <= s["onset"] <= hi else
             "earlier" if s["onset"] is not None and s["onset"] < lo else "later" for s in per_seed}  # fmt: skip
    if sides == {"within"}:
        return "agrees", f"{said}; within {band}"
    if len(sides) > 1:
        return "underpowered", f"{said}; the seeds fall on both sides of the edge of {band}"
    if sides == {"earlier"}:
        return "disagrees", f"{said}; earlier than {band}"
    theirs = (p.also or {}).get("effect_at_onset")
    if theirs is None:
        return "disagrees", f"{said}; later than {band}"
    holds = [s for s in per_seed if s["at_paper"] is not None and s["at_paper"][0] <= theirs <= s["at_paper"][1]]
    unread = [s for s in per_seed if s["at_paper"] is None]
    if unread:
        return "underpowered", f"{said}; later than {band}, and a seed read no effect at the paper's onset dose"
    if holds:
        iv = holds[0]["at_paper"]
        return "underpowered", (
            f"{said}; later than {band}, but at {p.estimate:g} seed {holds[0]['seed']}'s interval "
            f"[{100 * iv[0]:+.2f}, {100 * iv[1]:+.2f}] pp holds the paper's effect there ({100 * theirs:+.2f} pp)"
        )
    return "disagrees", (
        f"{said}; later than {band}, and at {p.estimate:g} the paper's effect ({100 * theirs:+.2f} pp) lies outside "
        "every seed's interval"
    )
