"""A ranking claim (000 §4.2, Table 2: "averaged over the two copies of the client's layers, the joint attacker has
the highest token recovery at both depths"): the treatment reads more than every rival at each condition.

A claim of this kind is ``kind: ranking``. Its ``treatment`` selects the claimed leader, one of its fields given as a
list (``client_copy: [public, trained]``): each arm is averaged over those values; ``controls`` name the rivals,
each replacing the fields it names in the treatment (``{attack: sipit, k: null, budget: 128}``); ``over`` the
conditions at which the ranking must hold (``depth: [3, 6]``).

Per condition and rival: the leader's and the rival's (victim seeds x documents) matrices of ``metric``, each
averaged over the averaged field's values on the seeds and documents every value holds, and the paired difference
leader − rival with its crossed-bootstrap interval at alpha over the number of comparisons (Bonferroni: ours; the
paper states the ranking without a test). It agrees where every difference lies above 0, disagrees where one lies
below 0 (a rival reads more), and is underpowered otherwise. Ours is the closest rival's difference.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import numpy as np

from splitleak.audit.analysis import METRICS, paired_matrices, select
from splitleak.errors import ConfigError, DataError
from splitleak.reproduce.claims import Claim
from splitleak.stats.bootstrap import paired_difference_ci


def is_ranking(claim: Claim) -> bool:
    return claim.statistic.kind == "ranking"


def why_not_ranking(claim: Claim) -> str:
    """Why the ranking reader does not measure ``claim`` ("" where it does)."""
    st = claim.statistic
    t = st.treatment or {}
    if not st.controls:
        return "a ranking names its rivals (controls)"
    if st.metric not in METRICS:
        return f"a ranking is read of a document metric ({', '.join(METRICS)}), not of {st.metric!r}"
    if len([k for k, v in t.items() if isinstance(v, list)]) > 1:
        return "a ranking averages over one field (its treatment gives one list of values)"
    return ""


def arms(st: Any, cond: dict[str, Any], rival: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The (leader, rival) selectors at ``cond``, one pair per value of the averaged field."""
    t = dict(st.treatment)
    key = next((k for k, v in t.items() if isinstance(v, list)), None)
    values = t.pop(key) if key is not None else [None]
    out = []
    for v in values:
        arm = {**t, **cond, **({key: v} if key is not None else {})}
        out.append((arm, {**arm, **rival}))
    return out


def conditions(st: Any) -> list[dict[str, Any]]:
    return [dict(zip(st.over, vs)) for vs in itertools.product(*st.over.values())] if st.over else [{}]


def ranking_jobs(claim: Claim, job_rows: Sequence[dict[str, Any]]) -> int:
    """The spec's jobs a ranking reads (0 where one of its arms has none: the claim is missing jobs)."""
    st = claim.statistic
    keys: set[str] = set()
    for cond, rival in itertools.product(conditions(st), st.controls):
        for pair in arms(st, cond, rival):
            for arm in pair:
                got = select(job_rows, {k: v for k, v in arm.items() if v is not None})
                if not got:
                    return 0
                keys.update(str(r.get("key")) for r in got)
    return len(keys)


def _averaged(st: Any, rows: Sequence[dict[str, Any]], cond: dict[str, Any], rival: dict[str, Any]):
    """(leader, rival, seeds, documents): the two matrices averaged over the averaged field's values, or why not."""
    got = []
    for arm, other in arms(st, cond, rival):
        pair = paired_matrices(rows, arm, other, st.metric)
        if isinstance(pair, str):
            return f"{_words(other)}: {pair}"
        got.append(pair)
    seeds = [s for s in got[0][2] if all(s in g[2] for g in got)]
    docs = [d for d in got[0][3] if all(d in g[3] for g in got)]
    if not seeds or not docs:
        return f"{_words({**cond, **rival})}: the averaged values share no victim seed or document"
    pick = [np.ix_([g[2].index(s) for s in seeds], [g[3].index(d) for d in docs]) for g in got]
    a = np.mean([g[0][ix] for g, ix in zip(got, pick)], axis=0)
    b = np.mean([g[1][ix] for g, ix in zip(got, pick)], axis=0)
    return a, b, seeds, docs


def _words(sel: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sel.items() if v is not None)


def measure_ranking(claim: Claim, rows: Sequence[dict[str, Any]], n_boot: int, alpha: float, seed: int = 0):
    """(estimate, low, high, units, seeds, documents, models, setting, unit, detail) of the closest rival, or why
    there is none."""
    why = why_not_ranking(claim)
    if why:
        return why
    st = claim.statistic
    conds = conditions(st)
    each = alpha / (len(conds) * len(st.controls))
    per: list[dict[str, Any]] = []
    closest = None
    for i, (cond, rival) in enumerate(itertools.product(conds, st.controls)):
        try:
            got = _averaged(st, rows, cond, rival)
        except (ConfigError, DataError) as exc:
            return f"its rows cannot be read as one configuration: {exc}"
        if isinstance(got, str):
            return f"the store holds no reading of {got}"
        a, b, seeds, docs = got
        iv = paired_difference_ci(a, b, n_boot=n_boot, alpha=each, seed=seed * 1000 + i)
        per.append({"condition": cond, "rival": rival, "estimate": iv.estimate, "low": iv.low, "high": iv.high})
        if closest is None or iv.estimate < closest[0].estimate:
            closest = (iv, (a - b).mean(axis=0), seeds, docs)
    assert closest is not None
    iv, units, seeds, docs = closest
    models = sorted({str(r.get("model")) for r in rows if r.get("attack") == (st.treatment or {}).get("attack")})
    setting = {"comparisons": len(per), "alpha each": f"{each:.3g} (Bonferroni, ours)", "documents": len(docs)}
    return iv.estimate, iv.low, iv.high, units, seeds, len(docs), models, setting, "documents", {"per": per}


def ranking_rule(claim: Claim, detail: dict[str, Any]) -> tuple[str, str]:
    """Agrees where the leader reads above every rival at every condition, disagrees where a rival reads above it."""
    per = detail["per"]
    lead = claim.statistic.treatment or {}

    def said(p: dict[str, Any]) -> str:
        return (f"{_words(p['condition'])} against {_words(p['rival'])}: {100 * p['estimate']:+.2f} pp "
                f"[{100 * p['low']:+.2f}, {100 * p['high']:+.2f}]")  # fmt: skip

    below = [p for p in per if p["high"] < 0]
    if below:
        return "disagrees", f"{lead.get('attack')} reads less than a rival: " + "; ".join(said(p) for p in below)
    open_ = [p for p in per if p["low"] <= 0]
    if open_:
        return "underpowered", (
            f"{len(per) - len(open_)} of {len(per)} comparisons above 0; not resolved: "
            + "; ".join(said(p) for p in open_)
        )
    return "agrees", f"{lead.get('attack')} reads above every rival in all {len(per)} comparisons"
