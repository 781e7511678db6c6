"""One claim against one store: our number with its interval and power, and the verdict.

Ours is read from the store's attack rows as ``protocol analyse`` reads them (``audit.analysis.select``,
``score_matrix``: victim seeds x documents, attack seeds averaged): a ``difference`` by the paired crossed
bootstrap, a ``level`` by the crossed bootstrap of the treatment's scores, at level ``ALPHA``. A metric recorded
once per job or run (label recovery, ROUGE, held-out loss) is read per victim seed (``measure_per_seed``), the
decoy system's claims through the grid report's latent summary (``reproduce.latent``) and its dose ladder's
records (``reproduce.dose``), 000 §5's partial-offloading claims through the protocol's own tests of the store's
runs (``reproduce.offload``), a defence's bounds from each run's record of its wire (``reproduce.wire``) and a
ranking of attacks by the paired differences of their copy-averaged readings (``reproduce.ranking``). A ratio
whose control reads 0 on every document was measured, and is undefined: underpowered. A family may carry the
paper's number per member (a table's cells, ``Statistic.papers``).

Verdicts: *agrees*, *disagrees*, *underpowered* (our interval straddles what would decide), *not run* (nothing
measured it: no reader of its statistic is built yet, or the store holds none of its jobs) and *no number*
(we measured it, but the seed text does not give the paper's number the rule compares with: 000's table
bodies are missing from it). Power: the paired t-test on the per-unit values (documents, seeds averaged; or
victim seeds; ``stats.power``): the smallest effect this run detects at 80 % power, and the units that would
resolve the paper's effect (a difference) or its tolerance (a level).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from splitleak.audit.analysis import ATTACK_FIELDS, METRICS, RUN_FIELDS, paired_matrices, score_matrix, select
from splitleak.errors import ConfigError, DataError
from splitleak.reproduce.claims import Claim
from splitleak.reproduce.dose import is_dose, measure_dose, onset_rule, why_not_dose
from splitleak.reproduce.latent import gate_rule, is_latent, measure_latent, why_not_latent
from splitleak.reproduce.offload import is_offload, measure_offload, offload_rule, store_runs, why_not_offload
from splitleak.reproduce.positions import POSITION_METRICS, first_token_rows, gross_matrices
from splitleak.reproduce.ranking import is_ranking, measure_ranking, ranking_rule, why_not_ranking
from splitleak.reproduce.spans import SPAN_RECOVERY, span_matrices
from splitleak.reproduce.wire import WIRE_METRICS, bound_rule, extreme
from splitleak.stats.binomial import wilson_interval
from splitleak.stats.bootstrap import Interval, crossed_bootstrap_ci, paired_difference_ci, paired_ratio_ci
from splitleak.stats.power import detectable_effect, t_half_width, units_needed

#: the level of every interval in a reproduction (the papers' 95 %)
ALPHA = 0.05
#: bootstrap replicates per claim (ours: the protocols' 100,000 cost minutes per report over 100 claims)
N_BOOT = 20_000

VERDICTS = ("agrees", "disagrees", "underpowered", "not run", "no number")
#: the slack of the comparisons with a rule's bounds (float rounding only)
EPS = 1e-9
#: readers of kinds of their own: (is it theirs, why they do not read it, measure(claim, rows, n_boot, alpha, seed))
OWN_READERS = ((is_dose, why_not_dose, measure_dose), (is_ranking, why_not_ranking, measure_ranking))


@dataclass
class Measured:
    estimate: float
    low: float
    high: float
    units: np.ndarray  # per document: the difference (or the level), seeds averaged
    seeds: list[Any]
    docs: int
    models: list[str]
    setting: dict[str, Any] = field(default_factory=dict)
    unit: str = "documents"  # what the power's paired test counts
    detail: dict[str, Any] = field(default_factory=dict)  # what a reader's own rule reads (not the setting's words)

    @property
    def sd(self) -> float:
        return float(np.std(self.units, ddof=1)) if len(self.units) > 1 else float("nan")


@dataclass
class Judgement:
    claim: Claim
    verdict: str
    reason: str
    ours: Measured | None = None
    detectable: float | None = None
    needed: int | None = None
    stronger: "Judgement | None" = None  # the same claim read by the strongest reader (``Claim.stronger``)
    members: list["Judgement"] = field(default_factory=list)  # a family's members, each judged by the rule
    analogues: dict[str, "Judgement"] = field(default_factory=dict)  # the claim read on its file's analogues


#: metrics a label attack's job records once over its documents (``result_json``), read per job
JOB_METRICS = (
    "label_recovery",
    "answer_label_recovery",
    "query_label_recovery",
    "answer_minus_query_label_recovery",  # recorded per document only: a job without it has no reading
    "rougeL_f",
    "rouge1_f",
    "rouge2_f",
    "meteor",
)
#: a label attack's metrics of one span of an instruction document's labels (003 App. E), per document
SPAN_METRICS = ("answer_label_recovery", "query_label_recovery", "answer_minus_query_label_recovery")
#: metrics of a trained run (the store's train rows), read per run; their claims name no attack
TRAIN_METRICS = ("heldout_ce", "perplexity", "delta_u", "ce_increase_over_pretrained")
#: a train row's metric derived from two of its columns: a latent run's held-out CE over the frozen pretrained
#: model's (002's Δ loss, the utility gate's reading)
DERIVED = {"ce_increase_over_pretrained": ("heldout_ce", "pretrained_ce")}


def member_claim(claim: Claim, statistic: Any) -> Claim:
    """One member of a family claim: the claim with the member's statistic (its rule and spec kept), and the
    paper's number for that member where the family gives one (``Statistic.papers``), else the claim's."""
    value = claim.statistic.member_paper(statistic) if claim.statistic.kind == "family" else None
    if value is None:
        return claim.model_copy(update={"statistic": statistic})
    paper = claim.paper.model_copy(update={"estimate": value.estimate, "low": None, "high": None, "range": None})
    return claim.model_copy(update={"statistic": statistic, "paper": paper})


def measurable(claim: Claim, member: bool = False) -> str:
    """Why no reader of the store measures ``claim`` ("" where one does); a family is measurable where one of its
    members is. A ``member`` of a family may select a field as null (``k: null``: an attack without a candidate
    budget), which elsewhere means the paper does not give it."""
    st = claim.statistic
    if st.kind == "family":
        whys = [measurable(member_claim(claim, m), member=True) for m in st.members()]
        return "" if not all(whys) else whys[0]
    for mine, why_not, _ in OWN_READERS:
        if mine(claim):
            return why_not(claim)
    if is_latent(claim):
        return why_not_latent(claim)
    if is_offload(claim):
        return why_not_offload(claim)
    if st.kind == "other":
        return f"no reader of this statistic is built yet ({st.form or st.metric})"
    if st.kind == "bound" and st.metric not in WIRE_METRICS:
        return f"a bound is read of {', '.join(WIRE_METRICS)}, not of {st.metric!r}"
    known = (*METRICS, *JOB_METRICS, *TRAIN_METRICS, *POSITION_METRICS, *SPAN_RECOVERY, *WIRE_METRICS)
    if st.metric not in known:
        return f"the store holds no {st.metric!r} (it holds {', '.join(sorted(known))})"
    for arm in (st.treatment, st.control):
        if arm is None:
            continue
        unknown = sorted(set(arm) - set(ATTACK_FIELDS) - set(RUN_FIELDS))
        if unknown:
            return f"it selects by {', '.join(unknown)}, which the store's rows do not hold"
        run_level = st.metric in TRAIN_METRICS or st.metric in WIRE_METRICS  # a run's own reading names no attack
        unset = sorted(k for k, v in arm.items() if v is None and not (k == "attack" and run_level))
        if unset and not member:
            return f"the paper does not give its {', '.join(unset)} and the claim picks none"
    return ""


def measure(
    claim: Claim,
    rows: Sequence[dict[str, Any]],
    n_boot: int = N_BOOT,
    seed: int = 0,
    train_rows: Sequence[dict[str, Any]] = (),
    latent: Any = None,
    alpha: float = ALPHA,
    member: bool = False,
) -> Measured | str:
    """Our reading of ``claim`` from a store's attack ``rows`` (and ``train_rows``; ``latent``: the store's
    ``LatentSummary`` where it holds latent rows) at level ``alpha``, or why there is none. A family is read
    member by member (``judge_family``), not here."""
    if claim.statistic.kind == "family":
        raise ConfigError(f"claim {claim.id} is a family: judge it with judge_family")
    why = measurable(claim, member)
    if why:
        return why
    st = claim.statistic
    assert st.treatment is not None
    for mine, _, reader in OWN_READERS:
        if mine(claim):
            got = reader(claim, rows, n_boot, alpha, seed)
            return got if isinstance(got, str) else Measured(*got)
    if is_latent(claim):
        if latent is None:
            return "the store holds no latent rows"
        got = measure_latent(claim, latent)
        if isinstance(got, str):
            return got
        est, low, high, values, seeds, setting = got
        return Measured(est, low, high, values, seeds, 0, [str(setting.get("model"))], setting, "victim seeds")
    if is_offload(claim):
        read = measure_offload(claim, *store_runs(rows, train_rows))
        if isinstance(read, str):
            return read
        est, low, high, values, seeds, setting, detail = read
        return Measured(est, low, high, values, seeds, 0, [str(setting["model"])], setting, "victim seeds", detail)
    if st.kind == "bound":
        return _bound(st, train_rows)
    if st.metric in JOB_METRICS and not per_document(rows, st):
        return measure_per_seed(claim, rows, alpha)
    if st.metric in SPAN_METRICS:  # a document without the span (no query, or an answer cut off) is no unit of it
        rows = [r for r in rows if not np.isnan(METRICS[st.metric](r))]
    if st.metric in TRAIN_METRICS:
        return measure_per_seed(claim, train_rows, alpha)
    metric = st.metric
    if metric in POSITION_METRICS:  # first-token recovery: token recovery over each document's first position
        firsts = first_token_rows([r for arm in (st.treatment, st.control) if arm for r in select(rows, arm)])
        if isinstance(firsts, str):
            return firsts
        rows, metric = firsts, "token_recovery"
    t_rows = select(rows, st.treatment)
    if not t_rows:
        return "the store holds no result of its treatment " + _arm(st.treatment)
    if metric in SPAN_RECOVERY:
        return _span_level(st, t_rows, n_boot, alpha, seed)
    try:
        if st.kind == "level":
            mt, seeds, docs = score_matrix(t_rows, metric)
            iv = crossed_bootstrap_ci(mt, n_boot=n_boot, alpha=alpha, seed=seed)
            if iv.high == iv.low:  # every cell alike (no document rebuilt, every token right): see _counted
                iv = _counted(t_rows, metric, iv)
            units = mt.mean(axis=0)
        else:
            paired = _paired(st, rows, metric, n_boot, alpha, seed)
            if isinstance(paired, str):
                return paired
            iv, units, seeds, docs = paired
    except (ConfigError, DataError) as exc:
        return f"its rows cannot be read as one configuration: {exc}"
    return Measured(
        iv.estimate,
        iv.low,
        iv.high,
        np.asarray(units, dtype=float),
        list(seeds),
        len(docs),
        sorted({str(r.get("model")) for r in t_rows}),
        _setting(t_rows),
    )


def _bound(st: Any, train_rows: Sequence[dict[str, Any]]) -> Measured | str:
    """The extreme of a wire metric over every row its treatment's runs sent (``reproduce.wire``)."""
    assert st.treatment is not None
    picked = select(train_rows, {k: v for k, v in st.treatment.items() if not (k == "attack" and v is None)})
    if not picked:
        return "the store holds no run of " + _arm(st.treatment)
    got = extreme(st.metric, picked)
    if isinstance(got, str):
        return got
    value, runs, rows, docs = got
    setting = {**_setting(picked), "runs": runs, "rows": rows}
    seeds = sorted({t.get("victim_seed") for t in picked}, key=str)
    models = sorted({str(t.get("model")) for t in picked})
    return Measured(value, math.nan, math.nan, np.array([]), seeds, docs, models, setting, "rows")


def _span_level(st: Any, t_rows: Sequence[dict[str, Any]], n_boot: int, alpha: float, seed: int) -> Measured | str:
    """The share of a class's spans the treatment recovers exactly, pooled over spans (``reproduce.spans``)."""
    if st.kind != "level":
        return f"a share of spans is read as a level, not as a {st.kind}"
    try:
        hits, counts, seeds, docs = span_matrices(t_rows, st.metric)
    except (ConfigError, DataError) as exc:
        return f"its rows cannot be read as one configuration: {exc}"
    if counts.sum() == 0:
        return f"no document of its rows holds a {SPAN_RECOVERY[st.metric]} span"
    iv = paired_ratio_ci(hits, counts, n_boot=n_boot, alpha=alpha, seed=seed)
    setting = {**_setting(t_rows), "spans": int(round(counts.sum(axis=1).mean()))}
    models = sorted({str(r.get("model")) for r in t_rows})
    return Measured(iv.estimate, iv.low, iv.high, np.array([]), list(seeds), len(docs), models, setting, "spans")


def _paired(st: Any, rows: Sequence[dict[str, Any]], metric: str, n_boot: int, alpha: float, seed: int):
    """A difference, ratio or share of the treatment over its control, paired by victim seed and document:
    (interval, per-document units for the power, seeds, documents), or why none."""
    assert st.control is not None
    if st.kind == "share" and st.form == "gross":  # the control's misses the treatment reads right, by position
        t_rows, c_rows = select(rows, st.treatment), select(rows, st.control)
        if not c_rows:
            return "the store holds no result of its control " + _arm(st.control)
        for arm_rows in (t_rows, c_rows):
            score_matrix(arm_rows, metric)  # raises where an arm's selector matches several configurations
        got = gross_matrices(t_rows, c_rows)
        if isinstance(got, str):
            return got
        num, den, seeds, docs = got
        if den.sum() == 0:
            return "its control reads every position right: it has no miss to correct"
        return paired_ratio_ci(num, den, n_boot=n_boot, alpha=alpha, seed=seed), np.array([]), seeds, docs
    paired = paired_matrices(rows, st.treatment, st.control, metric)  # as protocol analyse pairs them
    if isinstance(paired, str):
        return paired
    a, b, seeds, docs = paired
    if st.kind == "ratio" and b.mean() == 0:  # 0/0, or a positive reading over 0: measured, and undefined
        return (
            Interval(math.nan if a.mean() == 0 else math.inf, math.nan, math.nan, 0, alpha),
            np.array([]),
            seeds,
            docs,
        )
    if st.kind == "share" and b.mean() == 1:
        return "its control reads every unit right: it has no miss to correct"
    if st.kind == "ratio":  # no paired t-test for a ratio: no power column
        return paired_ratio_ci(a, b, n_boot=n_boot, alpha=alpha, seed=seed), np.array([]), seeds, docs
    if st.kind == "share":  # of the control's misses, the share the treatment gets right (net)
        return paired_ratio_ci(a - b, 1 - b, n_boot=n_boot, alpha=alpha, seed=seed), np.array([]), seeds, docs
    iv = paired_difference_ci(a, b, n_boot=n_boot, alpha=alpha, seed=seed)
    return iv, (a - b).mean(axis=0), seeds, docs


def _counted(rows: Sequence[dict[str, Any]], metric: str, iv: Interval) -> Interval:  # at ALPHA
    """A level whose cells are all alike has a bootstrap interval of width 0, which claims a certainty eight
    documents do not give: its Wilson interval over what was counted (the tokens, or the documents) instead."""
    if metric == "token_recovery":
        k, n = sum(int(r["token_correct"]) for r in rows), sum(int(r["token_counted"]) for r in rows)
    else:
        k, n = sum(bool(r["exact"]) for r in rows), len(rows)
    w = wilson_interval(k, n, ALPHA)
    return Interval(iv.estimate, w.low, w.high, iv.n_boot, iv.alpha)


def _per_seed(rows: Sequence[dict[str, Any]], metric: str) -> dict[Any, float]:
    """Victim seed -> the metric, averaged over the seed's jobs (attack seeds): a job-level metric from its
    result, a run's from its train row."""
    by_job: dict[str, tuple[Any, float]] = {}
    for r in rows:
        if r["key"] in by_job:
            continue
        if metric in DERIVED:
            a, b = (r.get(c) for c in DERIVED[metric])
            value = None if a is None or b is None else float(a) - float(b)
        else:
            value = json.loads(r["result_json"]).get(metric) if metric in JOB_METRICS else r.get(metric)
        if value is not None:
            by_job[r["key"]] = (r.get("victim_seed"), float(value))
    seeds: dict[Any, list[float]] = {}
    for s, v in by_job.values():
        seeds.setdefault(s, []).append(v)
    return {s: float(np.mean(v)) for s, v in seeds.items()}


def per_document(rows: Sequence[dict[str, Any]], st: Any) -> bool:
    """Whether a job-level metric is recorded per document in every row of the claim's arms (the label
    attacks' ``label_recovery``, ``audit.analysis.METRICS``): then it is read over documents and seeds, as
    token recovery is, and has an interval from one victim seed. A span's metric (``SPAN_METRICS``) needs it in
    every job of the arms: a document without the span has none."""
    if st.metric not in METRICS:
        return False
    arms = [a for a in (st.treatment, st.control) if a is not None]
    picked = [r for a in arms for r in select(rows, a)]
    if st.metric in SPAN_METRICS:
        jobs: dict[str, bool] = {}
        for r in picked:
            jobs[r["key"]] = jobs.get(r["key"], False) or not np.isnan(METRICS[st.metric](r))
        return bool(jobs) and all(jobs.values())
    return bool(picked) and not any(np.isnan(METRICS[st.metric](r)) for r in picked)


def measure_per_seed(claim: Claim, rows: Sequence[dict[str, Any]], alpha: float = ALPHA) -> Measured | str:
    """A metric recorded once per job or run: one value per victim seed (a difference or a ratio paired by seed),
    the interval Student's t over the seeds (none from one seed: the verdict is then underpowered)."""
    st = claim.statistic
    arms = []
    for arm in (st.treatment, st.control):
        if arm is None:
            continue
        sel = {k: v for k, v in arm.items() if not (k == "attack" and v is None)}
        picked = select(rows, sel)
        if not picked:
            return "the store holds no result of " + _arm(arm)
        values = _per_seed(picked, st.metric)
        if not values:
            return f"no row of {_arm(arm)} records its {st.metric}"
        arms.append((picked, values))
    seeds = sorted(set.intersection(*(set(v) for _, v in arms)), key=str)
    if not seeds:
        return "its treatment and control share no victim seed"
    if st.kind == "ratio":
        if any(arms[1][1][s] == 0 for s in seeds):
            return "its control reads 0 on a victim seed: the ratio is undefined"
        units = np.array([arms[0][1][s] / arms[1][1][s] for s in seeds])
    elif st.kind == "share":
        if any(arms[1][1][s] == 1 for s in seeds):
            return "its control reads every unit right on a victim seed: it has no miss to correct"
        units = np.array([(arms[0][1][s] - arms[1][1][s]) / (1 - arms[1][1][s]) for s in seeds])
    else:
        units = np.array([arms[0][1][s] - (arms[1][1][s] if len(arms) > 1 else 0.0) for s in seeds])
    est = float(units.mean())
    half = t_half_width(units, alpha)
    models = sorted({str(r.get("model")) for r in arms[0][0]})
    return Measured(est, est - half, est + half, units, seeds, 0, models, _setting(arms[0][0]), "victim seeds")


def _arm(sel: dict[str, Any]) -> str:
    return "(" + ", ".join(f"{k}={v}" for k, v in sel.items()) + ")"


def _setting(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in ("model", "depth", "client_copy", "k", "budget", "defence", "steps"):
        vals = sorted({str(r.get(f)) for r in rows if r.get(f) is not None})
        if vals:
            out[f] = vals[0] if len(vals) == 1 else vals
    out["victim_seeds"] = len({r.get("victim_seed") for r in rows})
    out["attack_seeds"] = len({r.get("attack_seed") for r in rows})
    docs = {r.get("doc_id") for r in rows} - {None}
    if docs:
        out["documents"] = len(docs)
    return out


def judge(claim: Claim, ours: Measured | str) -> Judgement:
    """The verdict on ``claim`` given our reading (or why there is none): module docstring."""
    if isinstance(ours, str):
        return Judgement(claim, "not run", ours)
    if claim.statistic.kind == "gate":  # a decision per seed, not an interval: no power either
        return Judgement(claim, *gate_rule(claim, ours), ours)
    if claim.statistic.kind == "offload":  # the protocol's tests' decisions against the paper's
        return Judgement(claim, *offload_rule(claim, ours.detail), ours)
    if claim.statistic.kind == "dose" and claim.statistic.form == "onset":  # a dose per seed: no power
        return Judgement(claim, *onset_rule(claim, ours.detail), ours)
    if claim.statistic.kind == "ranking":  # every comparison's side
        return Judgement(claim, *ranking_rule(claim, ours.detail), ours)
    if claim.statistic.kind == "bound":  # an extreme over realizations: no interval, no power
        return Judgement(
            claim, *bound_rule(claim, ours.estimate, ours.setting["rows"], ours.docs, ours.setting["runs"]), ours
        )
    verdict, reason = _rule(claim, ours)
    j = Judgement(claim, verdict, reason, ours)
    if len(ours.units) >= 2 and ours.sd > 0:
        j.detectable = detectable_effect(ours.sd, len(ours.units), ALPHA)
        target = _target(claim)
        if target:
            j.needed = units_needed(target, ours.sd, ALPHA)
    return j


def judge_family(
    claim: Claim,
    rows: Sequence[dict[str, Any]],
    n_boot: int = N_BOOT,
    train_rows: Sequence[dict[str, Any]] = (),
    latent: Any = None,
) -> Judgement:
    """A family claim: every member measured (at alpha / ``bonferroni`` where the paper corrects) and judged by the
    claim's rule. It disagrees where a member disagrees, agrees where every member agrees, is not run where no
    member was measured, and is underpowered otherwise (a member underpowered, or not run at this profile). Its
    number is the deciding member's: the first that disagrees, else the first short of agreeing, else the
    first."""
    st = claim.statistic
    alpha = ALPHA / (st.bonferroni or 1)
    members = st.members()
    js = []
    for i, m in enumerate(members):
        mc = member_claim(claim, m)
        js.append(
            judge(mc, measure(mc, rows, n_boot, i, train_rows, latent, alpha=alpha, member=True))
        )  # fmt: skip
    tally = ", ".join(f"{n} {v}" for v in VERDICTS if (n := sum(j.verdict == v for j in js)))
    where = f" (each at alpha {alpha:.3g}: Bonferroni over {st.bonferroni})" if st.bonferroni else ""
    if all(j.verdict == "not run" for j in js):
        return Judgement(claim, "not run", f"none of its {len(js)} configurations was measured: {js[0].reason}",
                         members=js)  # fmt: skip
    order = ("disagrees", "underpowered", "not run", "no number", "agrees")
    pick = min(js, key=lambda j: order.index(j.verdict))
    if pick.verdict in ("disagrees", "agrees"):
        verdict = pick.verdict
    else:
        verdict = "no number" if pick.verdict == "no number" else "underpowered"
    reason = f"{tally} of {len(js)} configurations{where}; {_varied(pick, members)}: {pick.reason}"
    return Judgement(claim, verdict, reason, pick.ours, pick.detectable, pick.needed, members=js)


def _varied(j: Judgement, members: Sequence[Any]) -> str:
    """The fields of ``j``'s member that vary across the family, in words."""
    st = j.claim.statistic
    parts = []
    for arm, name in ((st.treatment, "treatment"), (st.control, "control")):
        if arm is None:
            continue
        keys = [k for k in arm if len({repr((getattr(m, name) or {}).get(k)) for m in members}) > 1]
        if keys:
            parts.append(name + " " + _arm({k: arm[k] for k in keys}))
    return ", ".join(parts) or "its one configuration"


def assess(
    claim: Claim,
    rows: Sequence[dict[str, Any]],
    train_rows: Sequence[dict[str, Any]] = (),
    n_boot: int = N_BOOT,
    latent: Any = None,
) -> Judgement:
    """The verdict on any claim (a family member by member) from a store's rows."""
    if claim.statistic.kind == "family":
        return judge_family(claim, rows, n_boot, train_rows, latent)
    return judge(claim, measure(claim, rows, n_boot=n_boot, train_rows=train_rows, latent=latent))


def _target(claim: Claim) -> float | None:
    """The effect a run must resolve: the paper's difference, or a level's tolerance."""
    if claim.statistic.kind == "difference" and claim.paper.estimate:
        return abs(claim.paper.estimate)
    if claim.agreement.tolerance:
        return claim.agreement.tolerance
    return None


def _side(low: float, high: float, threshold: float, direction: str) -> str:
    above = low > threshold if direction == "above" else high < threshold
    below = high < threshold if direction == "above" else low > threshold
    return "agrees" if above else "disagrees" if below else "underpowered"


def _rule(claim: Claim, m: Measured) -> tuple[str, str]:
    a, p = claim.agreement, claim.paper
    if claim.statistic.kind == "ratio" and not math.isfinite(m.estimate):
        what = "0/0" if math.isnan(m.estimate) else "a positive reading over 0"
        return "underpowered", (
            f"its control reads 0 on every one of its {m.docs} documents, so the ratio is undefined ({what}); "
            "more documents would resolve it"
        )
    if math.isnan(m.low) or math.isnan(m.high):
        return (
            "underpowered",
            f"ours {m.estimate:+.4f} from one victim seed (or a reading that draws none): no interval",
        )
    if claim.statistic.kind == "difference" and m.low == m.high and a.rule == "equivalence":
        assert a.tolerance is not None
        # every unit differs by the same amount (0: the arms read alike): no resampling can move it
        inside = abs(m.estimate) <= a.tolerance + EPS
        return ("agrees" if inside else "disagrees"), (
            f"ours {m.estimate:+.4f} on every unit, {'within' if inside else 'outside'} +-{a.tolerance:g}"
        )
    if claim.statistic.kind in ("difference", "ratio", "share") and m.low == m.high:
        return "underpowered", f"ours {m.estimate:+.4f}: no unit differs between the arms, so the interval has no width"
    ours = f"ours {m.estimate:+.4f} [{m.low:+.4f}, {m.high:+.4f}]"
    if a.rule == "pass-mark":
        assert a.pass_mark is not None
        v = _side(m.low, m.high, a.pass_mark, "above")
        return v, f"{ours}; the paper's rule: the lower end above {a.pass_mark:g}"
    if a.rule in ("sign", "qualitative"):
        assert a.direction is not None
        t = a.threshold if a.rule == "qualitative" and a.threshold is not None else 0.0
        v = _side(m.low, m.high, t, a.direction)
        return v, f"{ours}; the claim: {a.direction} {t:g}"
    if a.rule == "tolerance":
        if p.estimate is None:
            return "no number", f"{ours}; the seed text does not give the paper's number"
        assert a.tolerance is not None
        lo, hi = p.estimate - a.tolerance, p.estimate + a.tolerance
    elif a.rule == "equivalence":
        assert a.tolerance is not None
        lo, hi = -a.tolerance, a.tolerance
    elif a.rule == "range":
        if p.range is None:
            return "no number", f"{ours}; the seed text does not give the paper's range"
        assert a.tolerance is not None
        lo, hi = p.range[0] - a.tolerance, p.range[1] + a.tolerance
    else:  # same-sign-overlap
        if p.estimate is None:
            return "no number", f"{ours}; the seed text does not give the paper's number"
        sign = "above" if p.estimate >= 0 else "below"
        v = _side(m.low, m.high, 0.0, sign)
        plo = p.low if p.low is not None else p.estimate
        phi = p.high if p.high is not None else p.estimate
        if v == "agrees" and (m.high < plo or m.low > phi):
            return "disagrees", f"{ours}: the paper's sign, but no overlap with [{plo:+.4f}, {phi:+.4f}]"
        return v, f"{ours}; the paper's sign is {'+' if sign == 'above' else '-'}"
    lo, hi = lo - EPS, hi + EPS  # an interval's float ends (a Wilson bound of 1 - 1e-16) are not outside
    if lo <= m.low and m.high <= hi:
        return "agrees", f"{ours} lies within [{lo:+.4f}, {hi:+.4f}]"
    if m.high < lo or m.low > hi:
        return "disagrees", f"{ours} lies outside [{lo:+.4f}, {hi:+.4f}]"
    return "underpowered", f"{ours} straddles the edge of [{lo:+.4f}, {hi:+.4f}]"
