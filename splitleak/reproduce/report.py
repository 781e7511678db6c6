"""The reproduction's report: a summary per paper on top, then per claim the paper's number beside ours with
its interval, the setting each was measured on, the verdict and its reason, and the power of our test."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Sequence

from splitleak.report.document import Document, Figure, Heading, Para, Table, render_html, render_markdown
from splitleak.report.figures import claims_figure
from splitleak.report.grid_common import pct, pp
from splitleak.reproduce.claims import ClaimsFile
from splitleak.reproduce.judge import ALPHA, TRAIN_METRICS, VERDICTS, Judgement


def _share(x: float | None, signed: bool = False) -> str:
    return pp(x) if signed else pct(x)


def _number(j: Judgement) -> Callable[[float | None], str]:
    """How a claim's numbers read: a ratio as a plain factor, a trained run's metric (nats, perplexity) in its
    own unit, a share in % and a difference of shares in percentage points."""
    st = j.claim.statistic
    kind = st.member if st.kind == "family" else st.kind
    if kind in ("ratio", "offload", "bound"):  # a factor, a partial R², a share of RMSE saved, a bound: plain numbers
        return lambda x: "n/a" if x is None or math.isnan(x) else f"{x:.3f}"
    if kind == "dose" and st.form == "onset":  # a dose (coverage or amplitude); inf: no dose read detects
        return lambda x: "n/a" if x is None or math.isnan(x) else "none" if math.isinf(x) else f"{x:g}"
    if kind in ("gate", "dose"):  # G: a Wilson bound less a rate; a dose's effect: in percentage points
        return lambda x: _share(x, True)
    if st.metric in TRAIN_METRICS:
        form = "{:+.4f}" if kind == "difference" else "{:.4f}"
        return lambda x: "n/a" if x is None or math.isnan(x) else form.format(x)
    return lambda x: _share(x, kind == "difference")


def _interval(j: Judgement, est: float | None, low: float | None, high: float | None) -> str:
    f = _number(j)
    if est is None:
        return "n/a"
    if low is None or high is None or math.isnan(low) or math.isnan(high):
        return f(est)
    return f"{f(est)} [{f(low)}, {f(high)}]"


def paper_cell(j: Judgement) -> str:
    p = j.claim.paper
    if p.estimate is not None:
        return _interval(j, p.estimate, p.low, p.high if p.low is not None else None)
    if p.range is not None:
        return f"{_number(j)(p.range[0])} to {_number(j)(p.range[1])}"
    if j.claim.statistic.papers:
        return f"{len(j.claim.statistic.papers)} of its cells (below)"
    return p.verdict or "no number in the seed text"


def ours_cell(j: Judgement) -> str:
    if j.ours is None:
        return "—"
    m = j.ours
    return _interval(j, m.estimate, m.low, m.high)


def setting_cell(j: Judgement) -> str:
    """The paper's setting and ours, in words (the fields each names)."""
    paper = ", ".join(f"{k} {v}" for k, v in j.claim.setting.items() if not isinstance(v, (dict, list)))
    if j.ours is None:
        return f"paper: {paper or 'not stated'}"
    ours = ", ".join(f"{k} {v}" for k, v in j.ours.setting.items())
    return f"paper: {paper or 'not stated'}; ours: {ours}"


def stronger_cell(j: Judgement) -> str:
    """The claim read by the strongest reader splitleak has for it, where that is not the paper's."""
    s = j.stronger
    if s is None:
        return "—"
    reader = (j.claim.stronger or {}).get("attack", "the stronger reader")
    return f"{reader}: {ours_cell(s)} {s.verdict}" if s.ours is not None else f"{reader}: {s.verdict} ({s.reason})"


def analogue_cell(j: Judgement, name: str) -> str:
    """The claim read on an analogue setting (the claims file's ``analogues``), where the analogue reads it."""
    a = j.analogues.get(name)
    if a is None or a.verdict == "not run":  # the analogue's jobs do not measure it (its own column says why)
        return "—"
    return f"{ours_cell(a)} {a.verdict}" if a.ours is not None else f"{a.verdict} ({a.reason})"


def power_cell(j: Judgement) -> str:
    if j.detectable is None:
        return "—"
    m = j.ours
    assert m is not None  # a power is computed from our units
    size = _number(j)(j.detectable).lstrip("+") + ("" if j.claim.statistic.metric in TRAIN_METRICS else " pp")
    text = f"detects {size} at 80 % over {len(m.units)} {m.unit}"
    if j.needed is None:
        return text
    what = (
        "the paper's effect" if "difference" in (j.claim.statistic.kind, j.claim.statistic.member) else "its tolerance"
    )
    return text + f"; {j.needed:,} {m.unit} would resolve {what}"


def counts(judgements: Sequence[Judgement]) -> dict[str, int]:
    return {v: sum(j.verdict == v for j in judgements) for v in VERDICTS}


def figure_points(judgements: Sequence[Judgement]) -> dict[str, list[Any]]:
    """The claims a figure can place: a share's level (%) or a difference of shares (pp) that we measured and
    the paper gives a number or a range for; ratios and a run's own metrics (nats, perplexity) are left to the
    table."""
    panels: dict[str, list[Any]] = {"levels (%)": [], "differences (pp)": []}
    for j in judgements:
        st, p, m = j.claim.statistic, j.claim.paper, j.ours
        kind = st.member if st.kind == "family" else st.kind
        if m is None or st.metric in TRAIN_METRICS or kind not in ("level", "share", "difference"):
            continue
        if p.estimate is None and p.range is None:
            continue
        scale = 100.0
        point = None if p.estimate is None else p.estimate * scale
        span = None if p.range is None else (p.range[0] * scale, p.range[1] * scale)
        ours = (m.estimate * scale, m.low * scale, m.high * scale)
        panels["levels (%)" if kind in ("level", "share") else "differences (pp)"].append(
            (j.claim.id, point, span, ours, j.verdict)
        )
    return {k: v for k, v in panels.items() if v}


def build_document(
    files: Sequence[tuple[ClaimsFile, str]],
    judgements: dict[str, list[Judgement]],
    meta: dict[str, Any],
    figures: dict[str, Path] | None = None,
) -> Document:
    doc = Document("Reproducing the papers")
    doc.add(
        Heading(1, "Reproducing the papers"),
        Para(
            f"Profile {meta['profile']}; every interval is a {100 * (1 - ALPHA):.0f} % crossed-bootstrap interval "
            f"({meta['n_boot']:,} replicates) over victim seeds and documents, attack seeds averaged; shares in %, "
            "differences in percentage points. Regenerate with: " + f"`{meta['command']}`."
        ),
        Para(
            "Verdicts: agrees / disagrees by the claim's rule (the paper's own where it has one; '(rule ours)' "
            "where the rule or its tolerance is splitleak's); underpowered where our interval straddles what would "
            "decide; not run where no reader of the claim's statistic is built yet or no job measured it; no number "
            "where the seed text gives no number to compare with. Power: the paired t-test on the per-unit values "
            "(the smallest effect this run detects at 80 %, and the units that would resolve the paper's effect).",
            "note",
        ),
    )
    rows = []
    for f, digest in files:
        c = counts(judgements[f.paper])
        rows.append([f.paper, str(len(f.claims)), *(str(c[v]) for v in VERDICTS), f"v{f.version} {digest[:12]}"])
    doc.add(Table(["paper", "claims", *VERDICTS, "claims file"], rows, caption="Claims per verdict."))
    for f, digest in files:
        doc.add(Heading(2, f"{f.paper}: {f.title}"))
        doc.add(Para(f"Claims file version {f.version}, sha256 {digest}; read from {f.source}.", "note"))
        if figures and f.paper in figures:
            doc.add(
                Figure(
                    figures[f.paper],
                    f"{f.paper}: the paper's number (black cross; a bar for a range) and ours with its 95 % "
                    "interval, coloured by the verdict (green agrees, red disagrees, orange underpowered); the "
                    "claims in % or pp that both give a number for.",
                )
            )
        for a in f.analogues:
            doc.add(Para(f"Analogue '{a.name}' (spec {a.spec}): {a.note}", "note"))
        names = [a.name for a in f.analogues]
        table = [
            [
                j.claim.id,
                j.claim.where,
                paper_cell(j),
                ours_cell(j),
                j.verdict + (" (rule ours)" if j.claim.agreement.ours else ""),
                j.reason,
                *(analogue_cell(j, n) for n in names),
                stronger_cell(j),
                power_cell(j),
                setting_cell(j),
            ]
            for j in judgements[f.paper]
        ]
        head = ["claim", "where", "paper", "ours [95 %]", "verdict", "why", *names, "strongest reader", "power"]
        doc.add(Table([*head, "setting"], table, numeric=[False, False, True, True] + [False] * (len(head) - 3)))
        for j in judgements[f.paper]:
            if j.claim.statistic.kind == "family" and j.claim.statistic.papers and j.members:
                doc.add(member_table(j))
    return doc


def member_table(j: Judgement) -> Table:
    """A family whose members carry the paper's own numbers (a table's cells): each member beside its number."""
    st = j.claim.statistic
    varied = [k for k in dict.fromkeys(k for m in st.members() for k in (m.treatment or {}))
              if len({repr((m.treatment or {}).get(k)) for m in st.members()}) > 1]  # fmt: skip
    rows = [
        [
            ", ".join(f"{k} {(m.claim.statistic.treatment or {}).get(k)}" for k in varied),
            paper_cell(m) if m.claim.paper.estimate is not None else "—",
            ours_cell(m),
            m.verdict,
            m.reason,
        ]
        for m in j.members
    ]
    return Table(
        ["member", "paper", "ours [95 %]", "verdict", "why"],
        rows,
        caption=f"{j.claim.id}, member by member: the paper's number where its text gives one ({j.claim.where}).",
        numeric=[False, True, True, False, False],
    )


def judgement_record(j: Judgement) -> dict[str, Any]:
    m = j.ours
    return {
        "id": j.claim.id,
        "verdict": j.verdict,
        "reason": j.reason,
        "paper": j.claim.paper.model_dump(),
        "ours": None
        if m is None
        else {"estimate": m.estimate, "low": m.low, "high": m.high, "documents": m.docs, "setting": m.setting},
        "detectable_at_80": j.detectable,
        "units_to_resolve": j.needed,
        "unit": None if m is None else m.unit,
        "stronger": None if j.stronger is None else judgement_record(j.stronger),
        "analogues": {name: judgement_record(a) for name, a in j.analogues.items()},
        "members": [
            {
                "treatment": m.claim.statistic.treatment,
                "control": m.claim.statistic.control,
                "verdict": m.verdict,
                "reason": m.reason,
                "paper": m.claim.paper.estimate,
                "ours": None
                if m.ours is None
                else {"estimate": m.ours.estimate, "low": m.ours.low, "high": m.ours.high},
            }
            for m in j.members
        ],
    }


def write_report(
    out: Path, files: Sequence[tuple[ClaimsFile, str]], judgements: dict[str, list[Judgement]], meta: dict[str, Any]
) -> dict[str, Path]:
    figures = {}
    for f, _ in files:
        panels = figure_points(judgements[f.paper])
        if panels:
            figures[f.paper] = claims_figure(panels, out / f"claims-{f.paper}")[0]
    doc = build_document(files, judgements, meta, figures)
    paths = {"md": out / "report.md", "html": out / "report.html", "json": out / "report.json"}
    paths["md"].write_text(render_markdown(doc, out))
    paths["html"].write_text(render_html(doc))
    record = {
        "meta": meta,
        "papers": {
            f.paper: {"version": f.version, "sha256": d, "claims": [judgement_record(j) for j in judgements[f.paper]]}
            for f, d in files
        },
    }
    paths["json"].write_text(json.dumps(record, indent=2, default=str) + "\n")
    return paths
