"""000 §5's claims (partial offloading: where the server-trained blocks start) read from a store's runs, through
the grid report's own rows (``report.grid.offload_run_rows``) and the protocol's own tests
(``audit.analysis.analyse_partial_offloading`` under the shipped ``partial_offloading`` protocol), so that a
reproduction and ``experiment report`` read one number.

A claim's statistic is ``kind: offload`` with a ``form``, and its treatment names the tests: ``outcome``
(``delta_u``, ``leakage_index``) and ``defence`` (``quant8``, ``quant4-noisy``), each one value or a list (every
combination is a test).

- ``variance``: the permutation test of the start's partial R² beyond the length. The paper's verdict (its
  ``verdict`` word, pass or fail) against ours per test, by the protocol's rule (partial R² at least its
  minimum and the permutation p under its bound). Where ours fails a test the paper passes with a partial R²
  at the mark but a permutation p above its bound, the test had too few seeds to decide: underpowered, not
  disagreeing (the partial R² of twelve placement cells over three is biased up with few seeds, so the p
  decides); with a partial R² below the mark it disagrees.
- ``heldout``: the held-out-seed RMSE check (descriptive, as the paper's: no interval). The paper's pass per
  outcome is read from its two RMSEs (``paper.also``: the reduction against the protocol's 10 %); ours from the
  protocol's held-out seeds present in the store.
- ``placement``: the pattern of the per-placement means over seeds (000 Table 10, whose body the seed text does
  not give): under the defence of the first test, at every length the last start has the largest ΔU, at least
  ``agreement.threshold`` times the earlier starts' largest, and the smallest leakage index; under the second,
  every placement's VMI excess within ``agreement.tolerance`` of zero (Student's t over seeds; straddling is
  underpowered). Both numbers are ours.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Sequence

import numpy as np

from splitleak.errors import ConfigError
from splitleak.reproduce.claims import Claim
from splitleak.stats.power import t_half_width

FORMS = ("variance", "heldout", "placement")
OUTCOMES = ("delta_u", "leakage_index")
ALPHA = 0.05


def is_offload(claim: Claim) -> bool:
    return claim.statistic.kind == "offload"


def _values(arm: dict[str, Any], key: str) -> list[Any]:
    v = arm.get(key)
    return list(v) if isinstance(v, (list, tuple)) else [v]


def tests_of(claim: Claim) -> list[dict[str, str]]:
    """The (outcome, defence) tests the claim's treatment names, in order."""
    t = claim.statistic.treatment or {}
    if claim.statistic.form == "placement":
        return [{"defence": d} for d in _values(t, "defence")]
    return [{"outcome": o, "defence": d} for d, o in itertools.product(_values(t, "defence"), _values(t, "outcome"))]


def why_not_offload(claim: Claim) -> str:
    """Why the partial-offloading reader does not measure ``claim`` ("" where it does)."""
    st = claim.statistic
    if st.form not in FORMS:
        return f"the partial-offloading reader reads the forms {', '.join(FORMS)}, not {st.form!r}"
    t = st.treatment or {}
    allowed = {"defence"} if st.form == "placement" else {"defence", "outcome"}
    unknown = sorted(set(t) - allowed)
    if unknown or not t.get("defence"):
        return f"a {st.form} claim names its tests by {' and '.join(sorted(allowed))} only (it names {sorted(t)})"
    if st.form != "placement":
        bad = [o for o in _values(t, "outcome") if o not in OUTCOMES]
        if bad or not t.get("outcome"):
            return f"its outcome {bad or None} is not one the protocol tests ({', '.join(OUTCOMES)})"
    if st.form == "placement" and len(_values(t, "defence")) != 2:
        return "a placement claim names two defences: the one whose pattern of ΔU and leakage it reads, then the one whose VMI excess"
    return ""


def plan_jobs(claim: Claim, job_rows: Sequence[dict[str, Any]]) -> int:
    """The spec's property jobs on partial-offloading runs under the claim's defences."""
    defences = {d["defence"] for d in tests_of(claim)}
    return sum(
        1
        for r in job_rows
        if r.get("attack") == "property" and r.get("offload_length") is not None and r.get("defence") in defences
    )


def store_runs(
    attack_rows: Sequence[dict[str, Any]], train_rows: Sequence[dict[str, Any]]
) -> tuple[list, Any, dict[str, Any]]:
    """One record per partial-offloading run (the grid report's), the shipped protocol they were measured under,
    and their sizes in words for the setting; ([], None, {}) where the store holds no such run."""
    # lazy: the grid report's module imports every section's statistics; a store without runs needs none
    from splitleak.audit.protocol import SHIPPED, check_results, load_protocol
    from splitleak.report.grid import offload_run_rows

    trains = [t for t in train_rows if t.get("offload_length") is not None]
    if not trains:
        return [], None, {}
    protocol, digest = load_protocol(SHIPPED / "partial_offloading.yaml")
    runs = offload_run_rows(attack_rows, train_rows, digest)
    check_results(runs, digest)  # a run measured under another protocol is refused, never read
    sizes = {}
    for field, words in (("n_train", "training documents"), ("steps", "steps"), ("n_eval", "evaluation documents")):
        values = sorted({str(t[field]) for t in trains if t.get(field) is not None})
        if values:
            sizes[words] = values[0] if len(values) == 1 else values
    return runs, protocol, sizes


def measure_offload(
    claim: Claim, runs: Sequence[dict[str, Any]], protocol: Any, sizes: dict[str, Any] | None = None
) -> tuple | str:
    """(estimate, low, high, per-seed units, seeds, setting, detail) of the claim, or why there is none; the
    detail carries what the rule reads (each test's record, the protocol's thresholds); ``sizes`` join the
    setting."""
    if not runs:
        return "the store holds no partial-offloading run"
    # lazy: the protocol's tests import the permutation and bootstrap machinery
    from splitleak.audit.analysis import analyse_partial_offloading

    form = claim.statistic.form
    models = sorted({str(r.get("model")) for r in runs})
    seeds = sorted({r["victim_seed"] for r in runs}, key=str)
    setting: dict[str, Any] = {"model": models[0] if len(models) == 1 else models, "victim_seeds": len(seeds)}
    setting["placements"] = len({(r["offload_length"], r["offload_start"]) for r in runs})
    setting.update(sizes or {})
    if form == "placement":
        return _placement(claim, runs, seeds, setting)
    if len(models) > 1:
        return f"the store holds partial-offloading runs of {', '.join(models)}: read one model at a time"
    # the protocol's tests as the grid report runs them (each test's permutations and bootstrap seeded by its place
    # in the protocol), then the claim's
    every = {(r["outcome"], r["defence"]): r for r in analyse_partial_offloading(protocol, runs)}
    wanted = [(t["outcome"], t["defence"]) for t in tests_of(claim)]
    absent = [w for w in wanted if w not in every]
    if absent:
        return f"the protocol {protocol.name} pre-registers no test of {absent[0][0]} under {absent[0][1]}"
    records = [every[w] for w in wanted]
    missing = [r for r in records if "missing" in r]
    if missing:
        return f"its test {missing[0]['outcome']} under {missing[0]['defence']}: {missing[0]['missing']}"
    if form == "heldout":
        gone = [r for r in records if "missing" in r.get("heldout", {"missing": "no held-out seed in the store"})]
        if gone:
            h = gone[0].get("heldout", {})
            why = h.get("missing", f"the store holds no run of the held-out seeds {protocol.victim_seeds[-2:]}")
            return f"its held-out check of {gone[0]['outcome']} under {gone[0]['defence']}: {why}"
        reductions = [r["heldout"]["reduction"] for r in records]
        setting["held_out"] = records[0]["heldout"]["test_seeds"]
        detail = {"tests": records, "thresholds": dict(protocol.thresholds)}
        return float(min(reductions)), math.nan, math.nan, np.array([]), seeds, setting, detail
    first = min(records, key=lambda r: r["partial_r2"])  # the estimate: the test farthest from passing
    detail = {"tests": records, "thresholds": dict(protocol.thresholds)}
    return float(first["partial_r2"]), float(first["low"]), float(first["high"]), np.array([]), seeds, setting, detail


def _paper_passes(claim: Claim) -> bool:
    words = (claim.paper.verdict or "").strip().lower()
    if words.startswith("pass"):
        return True
    if words.startswith("fail"):
        return False
    raise ConfigError(
        f"claim {claim.id}: a variance claim's paper.verdict begins with pass or fail (it reads {claim.paper.verdict!r})"
    )


def offload_rule(claim: Claim, detail: dict[str, Any]) -> tuple[str, str]:
    """The verdict of a partial-offloading claim from our reading's ``detail`` (``measure_offload``)."""
    form = claim.statistic.form
    if form == "placement":
        return detail["verdict"], detail["said"]
    thresholds = detail["thresholds"]
    if form == "heldout":
        return _heldout_rule(claim, detail["tests"], float(thresholds.get("heldout_rmse_reduction", 0.10)))
    theirs = _paper_passes(claim)
    r2_min = float(thresholds.get("partial_r2_min", 0.10))
    p_max = float(thresholds.get("permutation_p_max", 0.0125))
    level = float(thresholds.get("bootstrap_level", 0.9875))
    parts, verdicts = [], []
    for r in detail["tests"]:
        ours = bool(r["passes"])
        parts.append(
            f"{r['outcome']} under {r['defence']}: partial R² {r['partial_r2']:.3f} [{r['low']:.3f}, {r['high']:.3f}] "
            f"({100 * level:.4g} % over seeds), p {r['p_value']:.4g}, {'passes' if ours else 'fails'}"
        )
        if ours == theirs:
            verdicts.append("agrees")
        elif theirs and r["partial_r2"] >= r2_min:  # the mark reached, not significance: too few seeds to decide
            verdicts.append("underpowered")
        else:
            verdicts.append("disagrees")
    said = (
        "; ".join(parts) + f"; the paper: {'passes' if theirs else 'fails'} (partial R² ≥ {r2_min:g} and p < {p_max:g})"
    )
    for v in ("disagrees", "underpowered"):
        if v in verdicts:
            return v, said
    return "agrees", said


def _heldout_rule(claim: Claim, records: Sequence[dict[str, Any]], required: float) -> tuple[str, str]:
    parts, agree = [], True
    for r in records:
        h = r["heldout"]
        paper = claim.paper.also.get(r["outcome"])
        if not isinstance(paper, dict) or not {"length_only", "with_start"} <= set(paper):
            raise ConfigError(
                f"claim {claim.id}: paper.also.{r['outcome']} gives the paper's length_only and with_start RMSEs"
            )
        theirs = (paper["length_only"] - paper["with_start"]) / paper["length_only"]
        agree = agree and (theirs >= required) == bool(h["passes"])
        parts.append(
            f"{r['outcome']} under {r['defence']}: RMSE {h['rmse_length']:.4f} -> {h['rmse_with_start']:.4f} "
            f"({100 * h['reduction']:+.1f} %; the paper's {100 * theirs:+.1f} %)"
        )
    said = "; ".join(parts) + f" (descriptive, no interval; the mark: a {100 * required:g} % reduction)"
    return ("agrees" if agree else "disagrees"), said


def _placement(claim: Claim, runs: Sequence[dict[str, Any]], seeds: list[Any], setting: dict[str, Any]):
    """Module docstring (``placement``): the first defence's ΔU and leakage pattern at every length, and the second's
    VMI excess near zero at every placement; the verdict and its words travel in the setting."""
    # lazy: as in store_runs
    from splitleak.report.grid_stats import placement_means

    a = claim.agreement
    if a.threshold is None or a.tolerance is None:
        raise ConfigError(
            f"claim {claim.id}: a placement claim's agreement gives threshold (the fold of ΔU) and tolerance "
            "(how near zero the VMI excess stays)"
        )
    fold, tol = float(a.threshold), float(a.tolerance)
    first, second = (d["defence"] for d in tests_of(claim))
    means = [m for m in placement_means(runs) if m.defence == first]
    if not means:
        return f"the store holds no partial-offloading run under {first}"
    parts, ok, folds = [], True, []
    for s in sorted({m.length for m in means}):
        row = {m.start: m for m in means if m.length == s}
        last = max(row)
        du = {b: v for b in row if (v := row[b].delta_u) is not None}
        li = {b: v for b in row if (v := row[b].leakage_index) is not None}
        if len(du) < len(row) or len(li) < len(row):
            return f"a placement of length {s} under {first} has no ΔU or no leakage index"
        earlier = max(du[b] for b in row if b != last)
        if earlier > 0:
            folds.append(du[last] / earlier)
        holds = du[last] > 0 and du[last] >= fold * max(earlier, 0.0) and li[last] == min(li.values())
        ok = ok and holds
        parts.append(
            f"s={s}: ΔU at b={last} {du[last]:+.4f} against at most {earlier:+.4f} earlier, I {li[last]:.3f} "
            f"(smallest {min(li.values()):.3f}) {'holds' if holds else 'does not'}"
        )
    near = _near_zero([r for r in runs if r["defence"] == second], tol)
    if isinstance(near, str):
        return near
    verdict = "disagrees" if not ok or near[0] == "disagrees" else near[0]
    said = f"{first}: " + "; ".join(parts) + f" (ΔU at least {fold:g} times, I smallest); {second}: {near[1]}"
    fold = min(folds) if folds else math.nan  # the estimate: the smallest fold of ΔU over the lengths
    return fold, math.nan, math.nan, np.array([]), seeds, setting, {"verdict": verdict, "said": said}


def _near_zero(runs: Sequence[dict[str, Any]], tol: float) -> tuple[str, str] | str:
    """Whether every placement's VMI excess is within ``tol`` of zero: Student's t over seeds per placement."""
    by: dict[tuple[int, int], list[float]] = {}
    for r in runs:
        if r.get("vmi_excess") is not None:
            by.setdefault((int(r["offload_length"]), int(r["offload_start"])), []).append(float(r["vmi_excess"]))
    if not by:
        return "no run under the second defence records its VMI excess"
    verdicts, worst = [], (0.0, 0.0, 0.0, (0, 0))
    for cell, v in sorted(by.items()):
        x = np.asarray(v)
        half = t_half_width(x, ALPHA)
        if half == 0:  # seeds that read exactly alike: Student's t has no width, and claims no certainty
            half = math.nan
        lo, hi = float(x.mean()) - half, float(x.mean()) + half
        verdicts.append("agrees" if -tol <= lo and hi <= tol else "disagrees" if hi < -tol or lo > tol else "under")
        if abs(x.mean()) >= abs(worst[0]):
            worst = (float(x.mean()), lo, hi, cell)
    verdict = "disagrees" if "disagrees" in verdicts else "underpowered" if "under" in verdicts else "agrees"
    m, lo, hi, (s, b) = worst
    said = (
        f"{verdicts.count('agrees')} of {len(verdicts)} placements' VMI excess within ±{tol:g}, "
        f"{verdicts.count('disagrees')} outside (95 % over seeds; seeds that read alike give no interval); the "
        f"farthest s={s} b={b}: {m:+.4f} [{lo:+.4f}, {hi:+.4f}]"
    )
    return verdict, said
