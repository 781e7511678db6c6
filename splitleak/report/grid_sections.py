"""The sections of the grid report (see ``splitleak.report.grid``), each added to a ``Document``:
header, main test and family, recovery tables, gradient perturbations, leakage against cost,
heatmap, partial offloading. A section whose data the store lacks says why in one line."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from splitleak.audit.analysis import Analysis, ComparisonResult, analyse_partial_offloading, score_matrix, select
from splitleak.audit.protocol import Protocol
from splitleak.data import LABELS
from splitleak.errors import SplitleakError
from splitleak.metrics import fmt_pct
from splitleak.report.analysis import selection_text
from splitleak.report.document import Contents, Document, Figure, Heading, Para, Table
from splitleak.report.grid_stats import Cell, cost_points, placement_means


def protocol_boot_counts(protocol: Protocol) -> list[str]:
    """The protocol's bootstrap replicate counts, as phrases (``main test 100,000``)."""
    out = []
    if protocol.main_test is not None:
        out.append(f"main test {protocol.main_test.n_boot:,}")
    if protocol.family is not None and (protocol.family.comparisons or protocol.family.controls):
        out.append(f"family {protocol.family.n_boot:,}")
    if protocol.tests:
        out.append(f"partial-offloading seed bootstrap {int(protocol.thresholds.get('bootstrap_draws', 10_000)):,}")
    return out


@dataclass
class GridReport:
    """What ``grid_report`` / ``store_report`` wrote, and the analysis behind it."""

    out: Path
    markdown: Path
    html: Path
    figures: list[Path] = field(default_factory=list)
    analysis: Analysis | None = None
    analysis_error: str | None = None
    #: the attack jobs whose mis-paired negative control was detected (``control_faults``)
    control_faults: list[dict[str, Any]] = field(default_factory=list)

    @property
    def paths(self) -> list[Path]:
        return [self.markdown, self.html, *self.figures]


@dataclass
class Ctx:
    """What every section needs: the protocol as fixed and as used, where figures go."""

    protocol: Protocol
    used: Protocol
    protocol_hash: str
    protocol_path: Path
    n_boot: int | None
    descriptive_boot: int
    out: Path
    rep: GridReport


# ------------------------------------------------------------------ formatting helpers


def _pct(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt_pct(x)


def _pp(x: float | None) -> str:
    """A signed difference in percentage points, rounded half-up."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    s = fmt_pct(x)
    return s if s.startswith("-") or float(s) == 0 else "+" + s


def _iv(est, lo, hi, signed: bool = False) -> str:
    f = _pp if signed else _pct
    if est is None:
        return "n/a"
    if lo is None or (isinstance(lo, float) and math.isnan(lo)):
        return f(est)
    return f"{f(est)} [{f(lo)}, {f(hi)}]"


def _n(x: int) -> str:
    return f"{x:,}"


def _count(n: int, word: str) -> str:
    """``1 victim seed``, ``3 victim seeds``."""
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def _first_line(text: str | None, limit: int = 200) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _level(alpha: float) -> str:
    v = 100 * (1 - alpha)
    return f"{v:.4g} %"


# ------------------------------------------------------------------ 1. header


def header(doc: Document, ctx: Ctx, h: dict[str, Any], date: str | None, attack_rows) -> None:
    """1. Title, provenance (spec, protocol, hashes, version, date), job counts, contents."""
    from splitleak import __version__

    date = date or datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    doc.add(Heading(1, h["title"]))
    meta = []
    if h.get("spec"):
        meta += [
            ["spec", f"`{h['spec']}`"],
            ["spec SHA-256", f"`{h['spec_sha256']}`"],
            ["profile", h.get("profile") or "(base)"],
            ["overrides", ", ".join(f"`{o}`" for o in h.get("overrides") or []) or "none"],
        ]
    meta += [
        ["protocol", f"{ctx.protocol.name} (`{ctx.protocol_path}`)"],
        ["protocol SHA-256", f"`{ctx.protocol_hash}` (frozen; every result in this report carries it)"],
        ["results store", f"`{h['store']}`"],
        ["splitleak version", __version__],
        ["generated", date],
    ]
    boots = protocol_boot_counts(ctx.protocol)
    if ctx.n_boot is not None:
        meta.append(
            [
                "bootstrap replicates",
                f"**overridden to {ctx.n_boot:,} (--n-boot)**; the protocol's ({', '.join(boots)}) are what count",
            ]
        )
    elif boots:
        meta.append(["bootstrap replicates", f"as the protocol fixes them ({', '.join(boots)})"])
    meta.append(["descriptive intervals", f"{ctx.descriptive_boot:,} bootstrap replicates, seed 0"])
    doc.add(Table(["", "value"], meta, kv=True))
    if ctx.n_boot is not None:
        doc.add(
            Para(
                f"The bootstrap replicate counts of the protocol were overridden with --n-boot {ctx.n_boot:,} "
                "for a quick look; intervals and pass/fail below may differ from the pre-registered analysis.",
                "note",
            )
        )
    jobs = h["jobs"]
    states = [s for s in ("done", "running", "failed", "pending") if any(s in v for v in jobs.values())]
    jrows = []
    for kind in ("train", "attack", "reuse"):
        v = jobs.get(kind, {})
        jrows.append([kind] + [_n(v.get(s, 0)) for s in states] + [_n(sum(v.get(s, 0) for s in states))])
    tot = [sum(jobs.get(k, {}).get(s, 0) for k in ("train", "attack", "reuse")) for s in states]
    jrows.append(["all"] + [_n(x) for x in tot] + [_n(sum(tot))])
    doc.add(
        Table(
            ["jobs"] + states + ["total"],
            jrows,
            caption="Jobs of the grid in the store (reuse: inference-setting rows that copy a training-setting "
            "measurement).",
        )
    )
    failures = h.get("failures") or []
    real = [f for f in failures if f.get("error_type") != "skipped"]
    if real:
        groups: dict[str, list[dict[str, Any]]] = {}
        for f in real:
            groups.setdefault(f"{f.get('error_type')}: {_first_line(f.get('error'))}", []).append(f)
        rows = []
        for error, fs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            named = "; ".join(f"{f.get('summary', '')} (`{f['key'][:12]}`)" for f in fs[:3])
            rows.append(
                [_count(len(fs), "job"), f"{error} — {named}" + (f"; and {len(fs) - 3} more" if len(fs) > 3 else "")]
            )
        skipped = len(failures) - len(real)
        doc.add(
            Table(
                ["jobs", "error and jobs"],
                rows,
                kv=True,
                caption=(
                    f"{_count(len(real), 'job')} failed"
                    + (
                        f" and {_count(skipped, 'job')} depending on them {'was' if skipped == 1 else 'were'} skipped"
                        if skipped
                        else ""
                    )
                    + "; their results are missing from every section below (tracebacks: `splitleak experiment status`)."
                ),
            )
        )
    if h.get("other_rows"):
        doc.add(
            Para(
                f"{h['other_rows']} further attack job(s) in the store belong to other grids (another profile, "
                "other overrides, or an earlier version of the spec) and are left out.",
                "note",
            )
        )
    doc.add(Contents())


# ------------------------------------------------------------------ 2. main test and family


def _arm_rate(rows, selector: dict[str, Any], metric: str) -> str:
    try:
        sel = select(rows, selector)
        if not sel:
            return "n/a (no results)"
        m, seeds, docs = score_matrix(sel, metric)
        return f"{_pct(float(np.nanmean(m)))} ({_count(len(seeds), 'victim model')} × {_count(len(docs), 'document')})"
    except SplitleakError as exc:
        return f"n/a ({exc})"


#: the family-wise level of a grid's negative controls (Bonferroni over its jobs)
CONTROL_ALPHA = 0.05


def job_controls(attack_rows: Sequence[dict[str, Any]], alpha: float = CONTROL_ALPHA) -> list[dict[str, Any]]:
    """One record per attack job whose result holds a mis-paired negative control
    (``splitleak.audit.verdicts``): its fields, N, the one-sided p-value of its differences
    (``control_p_value``) and ``fault``: detected in the family of the grid's controls, p below ``alpha``
    over the number of jobs with a control (Bonferroni; a grid of thousands of jobs would otherwise flag
    some attack whose reading varies with its batch by chance)."""
    import json

    from splitleak.audit.verdicts import control_p_value

    seen: dict[str, dict[str, Any]] = {}
    for r in attack_rows:
        if r["key"] in seen or not r.get("result_json"):
            continue
        control = json.loads(r["result_json"]).get("control")
        if control is not None:
            seen[r["key"]] = {"row": r, **control, "p": control_p_value(control["per_doc_delta"])}
    out = list(seen.values())
    for c in out:
        c["fault"] = c["p"] < alpha / len(out)
    return out


def control_faults(attack_rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The jobs whose mis-paired control was detected in the grid's family: an attack that read the documents
    it was labelled as from traffic of other documents, so its readings are not readings of the traffic."""
    return [c for c in job_controls(attack_rows) if c["fault"]]


def _job_text(r: dict[str, Any]) -> str:
    parts = [str(r.get("attack"))]
    parts += [
        f"{k}={r[k]}" for k in ("k", "budget", "client_copy", "defence", "depth", "victim_seed") if r.get(k) is not None
    ]
    return " ".join(parts) + f" (job {str(r['key'])[:12]})"


def controls_section(doc: Document, ctx: Ctx, attack_rows: Sequence[dict[str, Any]]) -> None:
    """The mis-paired negative control of every token attack job: per attack and copy, how many jobs ran
    one and how many read above floor; every detected job by name. A detected control is an instrument
    fault: the protocol's tests below are not to be read until it is explained."""
    doc.add(Heading(2, "Negative controls"))
    controls = job_controls(attack_rows)
    if not controls:
        doc.add(Para("Omitted: no attack job of this store ran a mis-paired negative control.", "note"))
        return
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in controls:
        groups.setdefault((str(c["row"].get("attack")), str(c["row"].get("client_copy"))), []).append(c)
    table = []
    for (attack, copy), cs in sorted(groups.items()):
        est = [c["effect"]["estimate"] for c in cs]
        table.append(
            [
                attack,
                copy,
                str(len(cs)),
                str(sum(c["fault"] for c in cs)),
                _pp(float(np.mean(est))),
                _pp(max(c["effect"]["high"] for c in cs)),
            ]
        )
    doc.add(
        Table(["attack", "copy", "jobs", "detected", "mean N (pp)", "largest upper end (pp)"], table),
        Para(
            "N: each job's mis-paired twin, the same fitted attack given the traffic of other documents of its "
            f"run ({len(controls[0]['doc_ids'])} documents, whole frames) and scored against the labels of the "
            "documents it is labelled as, minus the job's own reading of that traffic scored against the same "
            "labels. An attack that reads only the traffic reads 0; one that reaches the evaluation text by the "
            "documents' identity reads above it. Detected: a one-sided t-test of the job's per-document "
            f"differences, p below {CONTROL_ALPHA:g} / {len(controls):,} (Bonferroni over the jobs with a control).",
            "caption",
        ),
    )
    faults = [c for c in controls if c["fault"]]
    if faults:
        ctx.rep.control_faults = faults
        doc.add(
            Para(
                f"**INSTRUMENT FAULT**: the negative control of {_count(len(faults), 'job')} reads above its floor, "
                "so those attacks read the evaluation text by the documents' identity rather than through the "
                "traffic; no test of this report is to be read until that is explained: "
                + "; ".join(
                    f"{_job_text(c['row'])}: N = {_pp(c['effect']['estimate'])} pp, p = {c['p']:.2g}"
                    for c in faults[:20]
                )
                + ("" if len(faults) <= 20 else f"; and {len(faults) - 20} more")
                + ".",
                "note",
            )
        )


def main_section(doc: Document, ctx: Ctx, rows, analysis: Analysis | None, error: str | None) -> None:
    """2. The protocol's main test and its Bonferroni family, from ``analyse``."""
    p = ctx.used
    doc.add(Heading(2, "Main test and comparison family"))
    if ctx.rep.control_faults:
        doc.add(
            Para(
                "Not to be read: a negative control above reads above its floor (instrument fault). The tests "
                "below are computed as the protocol fixes them, on readings that are not readings of the traffic.",
                "note",
            )
        )
    if p.main_test is None and (p.family is None or not (p.family.comparisons or p.family.controls)):
        doc.add(Para(f"Omitted: the protocol `{p.name}` defines no main test and no comparison family.", "note"))
        return
    if error is not None:
        doc.add(Para(f"The protocol's tests could not be evaluated on this store: {error}", "note"))
        return
    assert analysis is not None
    fixed = ctx.protocol.main_test  # ``used`` is this protocol with n_boot overridden: it has a main test iff this has
    boot_note = (
        f" (overridden with --n-boot; the protocol fixes {fixed.n_boot:,})"
        if ctx.n_boot is not None and fixed is not None
        else ""
    )
    if p.main_test is not None and analysis.main is not None:
        t, c = p.main_test, analysis.main
        metric = t.metric.replace("_", " ")
        doc.add(Heading(3, "Main test"))
        doc.add(Para(t.description))
        result = ("not evaluated: " + c.missing) if c.missing else ("**PASS**" if c.passes else "**FAIL**")
        doc.add(
            Table(
                ["", "value"],
                [
                    ["treatment", f"`{selection_text(c.treatment)}`"],
                    ["control", f"`{selection_text(c.control)}`"],
                    [f"treatment {metric} (%)", _arm_rate(rows, c.treatment, t.metric)],
                    [f"control {metric} (%)", _arm_rate(rows, c.control, t.metric)],
                    ["difference, treatment − control (pp)", _pp(c.estimate)],
                    [
                        f"{_level(c.alpha)} crossed-bootstrap interval (pp)",
                        "n/a" if c.low is None else f"[{_pp(c.low)}, {_pp(c.high)}]",
                    ],
                    ["pass mark (pp)", f"lower end above {_pp(c.mark)}"],
                    [
                        "bootstrap",
                        f"{t.n_boot:,} replicates{boot_note}, seed {t.bootstrap_seed}"
                        + (
                            ""
                            if c.missing
                            else f"; {_count(c.n_models, 'victim model')} × "
                            f"{_count(c.n_docs, 'document')}, per-document scores averaged over attack seeds"
                        ),
                    ],
                    ["result", result],
                ],
                kv=True,
            )
        )
    f = p.family
    if f is None or not (f.comparisons or f.controls):
        doc.add(Para("The protocol defines no comparison family.", "caption"))
        return
    fam = analysis.family
    assert analysis.family_alpha is not None  # analyse sets it whenever the protocol has a family
    doc.add(Heading(3, "Comparison family (Bonferroni)"))
    n_pass = sum(x.passes for x in fam)
    n_missing = sum(1 for x in fam if x.missing)
    verdict = "**PASSES**" if analysis.family_passes else "**FAILS**"
    doc.add(
        Para(
            f"{f.description}. {n_pass} of {len(fam)} comparisons pass at α = {f.alpha:g}/{f.size} = "
            f"{analysis.family_alpha:.4g} each ({_level(analysis.family_alpha)} crossed-bootstrap intervals, "
            f"{f.n_boot:,} replicates{' — overridden with --n-boot' if ctx.n_boot is not None else ''}; "
            f"pass: lower end above 0); the family {verdict}"
            + (
                f". {n_missing} comparison(s) have no results in this store and count as not passing."
                if n_missing
                else "."
            )
        )
    )
    doc.add(_family_table(fam))


_COND_NAMES = {"depth": "depth L", "client_copy": "copy", "k": "k", "budget": "budget", "defence": "defence"}


def _family_table(fam: Sequence[ComparisonResult]) -> Table:
    """One row per comparison: the condition (every field but the attack) in its own columns, the
    treatment's and the control's attack, and where the control differs from the condition, how."""
    cond_keys = list(dict.fromkeys(k for c in fam for k in list(c.treatment) + list(c.control) if k != "attack"))
    header = (
        ["#"]
        + [_COND_NAMES.get(k, k) for k in cond_keys]
        + ["treatment", "control", "difference (pp)", "interval (pp)", "models × docs", "passes"]
    )
    rows = []
    for i, c in enumerate(fam, 1):
        cond = [
            "" if c.treatment.get(k, c.control.get(k)) is None else str(c.treatment.get(k, c.control.get(k)))
            for k in cond_keys
        ]
        differs = [
            f"{k}={'none' if c.control[k] is None else c.control[k]}"
            for k in cond_keys
            if k in c.control and c.control[k] != c.treatment.get(k, c.control[k])
        ]
        ctl = str(c.control.get("attack", "")) + (f" ({', '.join(differs)})" if differs else "")
        if c.missing:
            tail = ["n/a", "n/a", "", f"no ({c.missing})"]
        else:
            tail = [
                _pp(c.estimate),
                f"[{_pp(c.low)}, {_pp(c.high)}]",
                f"{c.n_models} × {c.n_docs}",
                "yes" if c.passes else "no",
            ]
        rows.append([str(i)] + cond + [str(c.treatment.get("attack", "")), ctl] + tail)
    return Table(header, rows)


# ------------------------------------------------------------------ 3. recovery tables


def _counts_text(cells: Sequence[Cell]) -> str:
    combos = sorted({(c.n_seeds, c.n_attack_seeds, c.n_docs, c.n_evals) for c in cells})
    if len(combos) == 1:
        s, a, d, n = combos[0]
        return (
            f"Each cell pools {_count(n, 'document-level evaluation')} ({_count(s, 'victim seed')} × "
            f"{_count(a, 'attack seed')} × {_count(d, 'document')}{' per seed' if not cells[0].crossed else ''})."
        )
    lo, hi = min(c.n_evals for c in cells), max(c.n_evals for c in cells)
    return f"Cells pool between {_n(lo)} and {_n(hi)} document-level evaluations (victim seeds × attack seeds × documents)."


def _design_text(cells: Sequence[Cell], n_boot: int) -> str:
    crossed = all(c.crossed for c in cells)
    how = (
        "crossed bootstrap over victim seeds and documents"
        if crossed
        else "crossed bootstrap where every seed saw the same documents, otherwise hierarchical bootstrap "
        "(seeds, then documents within seed)"
    )
    return f"Brackets: 95 % interval, {how}, {n_boot:,} replicates (descriptive, not a test)."


def _wide_table(cells: Sequence[Cell], what: str) -> Table:
    conds = sorted({c.condition for c in cells}, key=lambda c: c.sort_key())
    configs = sorted({c.config for c in cells}, key=lambda c: c.sort_key())
    models = len({c.model for c in configs}) > 1
    by = {(c.config, c.condition): c for c in cells}
    header = (["model"] if models else []) + ["defence", "attack"] + [f"{c.text()} (%)" for c in conds]
    rows = []
    for cfg in configs:
        r = ([cfg.model or ""] if models else []) + [cfg.defence, cfg.attack_text()]
        for cond in conds:
            c = by.get((cfg, cond))
            e = getattr(c, what) if c is not None else None
            r.append("n/a" if e is None else _iv(e.estimate, e.low, e.high))
        rows.append(r)
    return Table(header, rows)


def _span_table(cells: Sequence[Cell]) -> Table:
    models = len({c.config.model for c in cells}) > 1
    header = (
        (["model"] if models else [])
        + ["defence", "attack", "split", "copy"]
        + [f"{lab} (%)" for lab in LABELS]
        + ["spans (" + " / ".join(LABELS) + ")"]
    )
    rows = []
    for c in cells:
        r = ([c.config.model or ""] if models else []) + [
            c.config.defence,
            c.config.attack_text(),
            c.condition.split,
            c.condition.copy,
        ]
        for lab in LABELS:
            e = c.spans[lab]
            r.append("n/a" if e is None else _iv(e.estimate, e.low, e.high))
        r.append(" / ".join(f"{c.span_counts[lab]:g}" for lab in LABELS))
        rows.append(r)
    return Table(header, rows)


def recovery_section(doc: Document, ctx: Ctx, cells: Sequence[Cell], attack_rows) -> None:
    """3. Token, whole-document and span recovery per configuration x split x copy."""
    doc.add(Heading(2, "Token, whole-document and span recovery"))
    if not cells:
        doc.add(
            Para(
                "Omitted: the store holds no attack results with per-token scores (only property inference, "
                "or no attack has finished).",
                "note",
            )
        )
        return
    n_reuse = len({r["key"] for r in attack_rows if r.get("kind") == "reuse"})
    base = _counts_text(cells) + " " + _design_text(cells, ctx.descriptive_boot)
    reuse = (
        f" The {n_reuse} inference-setting job(s) reuse their training-setting measurement (the same numbers) "
        "and are not repeated."
        if n_reuse
        else ""
    )
    doc.add(
        Para(
            "Per attack configuration (rows; L = split depth in blocks, s/b = offloaded length/start) and "
            "condition (columns: split and the attacker's copy of the client layers). Every entry is the mean "
            "over victim seeds and documents of the per-document score, averaged over attack seeds first." + reuse
        )
    )
    doc.add(Heading(3, "Token recovery"))
    t = _wide_table(cells, "token")
    t.caption = "Token recovery (%): share of tokens reconstructed exactly. " + base
    doc.add(t)
    doc.add(Heading(3, "Whole-document recovery"))
    t = _wide_table(cells, "doc")
    t.caption = "Whole-document recovery (%): share of documents reconstructed without a single wrong token. " + base
    doc.add(t)
    doc.add(Heading(3, "Span recovery by class"))
    t = _span_table(cells)
    t.caption = (
        "Exact span recovery (%) per annotated class: spans with every token right over spans present, "
        "pooled over seeds and documents; n/a where the evaluation documents hold no span of the class. "
        "Last column: spans present, summed over victim seeds × documents (mean over attack seeds). "
        + _design_text(cells, ctx.descriptive_boot).replace(
            "Brackets: 95 % interval", "Brackets: 95 % interval (one resample applied to both sums)"
        )
    )
    doc.add(t)


# ------------------------------------------------------------------ 4. gradient perturbations


def perturbation_section(doc: Document, ctx: Ctx, cells: Sequence[Cell]) -> None:
    """4. The joint attacker under observer-side gradient perturbations (figure)."""
    from splitleak.report.grid_figures import perturbation_cells, perturbation_figure

    doc.add(Heading(2, "Gradient perturbations"))
    joint = perturbation_cells(cells)
    if not any(c.config.gradient_noise is not None or c.config.gradient_bits is not None for c in joint):
        doc.add(
            Para(
                "Omitted: the store holds no joint-attacker result under an observer-side gradient perturbation "
                "(noise or rounding) without a defence.",
                "note",
            )
        )
        return
    paths = perturbation_figure(cells, ctx.out / "gradient-perturbations")
    ctx.rep.figures += paths
    n = sorted({c.n_evals for c in joint})
    ns = f"{_n(n[0])}" if len(n) == 1 else f"{_n(n[0])}–{_n(n[-1])}"
    seeds = sorted({c.n_seeds for c in joint})
    docs = sorted({c.n_docs for c in joint})
    present = [
        a
        for a in ("shuffled-gradient", "random-candidate")
        if any(c.config.attack == a and c.config.defence == "none" for c in cells)
    ]
    controls = (
        ""
        if not present
        else ", and the control"
        + ("s " if len(present) > 1 else " ")
        + " and ".join(present)
        + " that remove"
        + ("" if len(present) > 1 else "s")
        + " the gradient's information"
    )
    doc.add(
        Figure(
            paths[0],
            (
                f"Token recovery of the joint attacker (no defence) with the true gradient, with Gaussian noise of σ × the "
                f"gradient's RMS and with b-bit rounding (observer side; training unchanged)"
                f"{controls}, per split and copy and per candidate budget k. Points: mean over "
                f"{'/'.join(map(str, seeds))} victim seed{'s' if seeds != [1] else ''} × attack seeds × "
                f"{'/'.join(map(str, docs))} documents "
                f"({ns} document-level evaluations per point); bars: 95 % bootstrap intervals ({ctx.descriptive_boot:,} "
                f"replicates); dashed lines: the activation-only attacker at the same k. The numbers are the joint rows of the "
                f"token recovery table."
            ),
            alt="joint attacker token recovery per gradient perturbation",
        )
    )


# ------------------------------------------------------------------ 5. leakage against cost


def cost_section(doc: Document, ctx: Ctx, attack_rows, train_rows) -> None:
    """5. Leakage against the utility cost of each defence (table and figure)."""
    from splitleak.report.grid_figures import cost_figure

    doc.add(Heading(2, "Leakage against utility cost"))
    defended = [t for t in train_rows if (t.get("defence_name") or "none") != "none"]
    if not defended:
        doc.add(Para("Omitted: the grid trained no defence, so there is no cost to weigh leakage against.", "note"))
        return
    points, note = cost_points(attack_rows, train_rows)
    models = len({p.model for p in points}) > 1
    leak = any(p.token is not None for p in points)
    header = (
        (["model"] if models else [])
        + ["split", "defence", "seeds", "perplexity", "reference", "Δ perplexity (%)", "ΔU (nats)"]
        + (["token (%)", "whole-doc (%)", "configs", "evaluations"] if leak else [])
    )
    rows = []
    for p in points:
        ref = (
            "n/a"
            if p.reference_perplexity is None
            else f"{_f(p.reference_perplexity, 2)} ({p.reference.replace('undefended run', 'undefended')})"
        )
        rows.append(
            ([p.model] if models else [])
            + [
                p.split,
                p.defence,
                str(len(p.seeds)),
                _f(p.perplexity, 2),
                ref,
                _pp(p.rel_ppl_change),
                _f(p.delta_u, 4, signed=True),
            ]
            + ([_pct(p.token), _pct(p.doc), str(p.n_configs), _n(p.n_evals)] if leak else [])
        )
    if not leak:
        note = (
            "the store holds no attack result with per-token scores for these runs, so the leakage columns are left "
            "out"
            + (
                "; the partial-offloading section gives the leakage index I"
                if any(t.get("offload_length") is not None for t in train_rows)
                else ""
            )
        )
    doc.add(
        Table(
            header,
            rows,
            caption=(
                "Utility cost and leakage per defence. Perplexity: geometric-mean held-out perplexity of the split run, mean "
                "over victim seeds. Reference: the perplexity of the undefended run with the same model, split, seed, data and "
                "document counts, or, where the grid has none, of the run's all-local twin (the whole model trained on the "
                "client). Δ perplexity: (perplexity / reference − 1) per seed, averaged over seeds. ΔU = L_split − L_all-local "
                "in nats. "
                + (
                    "Token and whole-doc: token and whole-document recovery over every document-level evaluation of the pooled "
                    "attack configurations (configs; evaluations); "
                    if leak
                    else ""
                )
                + f"{note}."
            ),
        )
    )
    pts = [p for p in points if p.rel_ppl_change is not None and p.token is not None]
    if not pts:
        doc.add(
            Para(
                "Figure omitted: no defence has both a perplexity reference and attack results with per-token scores.",
                "note",
            )
        )
        return
    paths = cost_figure(points, ctx.out / "leakage-cost")
    ctx.rep.figures += paths
    seeds = sorted({len(p.seeds) for p in pts})
    doc.add(
        Figure(
            paths[0],
            (
                f"Leakage against cost: token recovery (left) and whole-document recovery (right) of each defence at each "
                f"split, pooled over the attack configurations in the table "
                f"({'/'.join(str(n) for n in sorted({p.n_configs for p in pts}))} per point here), against the held-out perplexity change vs. the undefended reference; "
                f"{'/'.join(map(str, seeds))} victim seed{'s' if seeds != [1] else ''} per point, "
                f"{_n(sum(p.n_evals for p in pts))} document-level "
                f"evaluations in all. Blue: no defence; red: defended."
            ),
            alt="leakage against utility cost",
        )
    )


def _f(x: float | None, places: int, signed: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if signed:
        t = f"{x:+.{places}f}"
        return t if float(t) != 0 else f"{0:.{places}f}"  # no "-0.0000" for a difference that rounds to zero
    return f"{x:.{places}f}"


# ------------------------------------------------------------------ 6. heatmap


def heatmap_section(doc: Document, ctx: Ctx, cells: Sequence[Cell]) -> None:
    """6. Token recovery per attack configuration and condition (annotated heatmap)."""
    from splitleak.report.grid_figures import heatmap_figure

    doc.add(Heading(2, "Attack × condition heatmap"))
    if not cells:
        doc.add(Para("Omitted: no attack results with per-token scores.", "note"))
        return
    paths = heatmap_figure(cells, ctx.out / "heatmap")
    ctx.rep.figures += paths
    n_cfg = len({c.config for c in cells})
    n_cond = len({c.condition for c in cells})
    both = len({c.config.defence == "none" for c in cells}) == 2
    doc.add(
        Figure(
            paths[0],
            (
                f"Token recovery (%) of {n_cfg} attack configurations (rows"
                f"{'; undefended above the white line, defended below' if both else ''}) "
                f"in {n_cond} conditions (columns: split and copy). {_counts_text(cells)} Grey: not run. Intervals: the token "
                f"recovery table."
            ),
            alt="token recovery heatmap",
        )
    )


# ------------------------------------------------------------------ 7. partial offloading


def offload_section(doc: Document, ctx: Ctx, run_rows, analysis: Analysis | None, error: str | None) -> None:
    """7. Partial offloading: means per placement, variance tests, held-out-seed RMSE."""
    doc.add(Heading(2, "Partial offloading"))
    if not run_rows:
        doc.add(
            Para(
                "Omitted: the store holds no partial-offloading runs (placements of length s starting at block b).",
                "note",
            )
        )
        return
    means = placement_means(run_rows)
    models = len({m.model for m in means}) > 1
    doc.add(Heading(3, "Means per placement"))
    rows = [
        ([m.model] if models else [])
        + [
            m.defence,
            str(m.length),
            str(m.start),
            str(m.n_seeds),
            _f(m.delta_u, 4, signed=True),
            _f(m.leakage_index, 4),
            _f(m.vmi_excess, 4, signed=True),
            _f(m.perplexity, 2),
        ]
        for m in means
    ]
    doc.add(
        Table(
            (["model"] if models else [])
            + [
                "defence",
                "length s",
                "start b",
                "seeds",
                "ΔU (nats)",
                "leakage index I",
                "VMI excess (share)",
                "perplexity",
            ],
            rows,
            caption=(
                "Means over victim seeds per placement (the server trains blocks [b, b + s)). ΔU = L_split − "
                "L_all-local (nats); I: the normalised leakage index of the property attack (What Gradients Add §5); VMI "
                "excess: VMI token recovery minus the majority control."
            ),
        )
    )
    doc.add(Heading(3, "Variance tests"))
    th = ctx.used.thresholds
    if error is not None:
        doc.add(Para(f"The tests could not be evaluated on this store: {error}", "note"))
        return
    if not any("outcome" in t and "defence" in t for t in ctx.used.tests):
        doc.add(Para(f"Omitted: the protocol `{ctx.used.name}` pre-registers no partial-offloading test.", "note"))
        return
    entries: list[tuple[str | None, dict[str, Any]]]
    run_models = sorted({r.get("model") for r in run_rows}, key=str)
    if len(run_models) > 1:  # each model on its own, as What Gradients Add Table 5 reports them
        entries = [
            (m, e)
            for m in run_models
            for e in analyse_partial_offloading(ctx.used, [r for r in run_rows if r.get("model") == m])
        ]
    else:
        entries = [(None, e) for e in (analysis.partial_offloading if analysis is not None else [])]
    level = float(th.get("bootstrap_level", 0.9875))
    r2_min, p_max = th.get("partial_r2_min", 0.10), th.get("permutation_p_max", 0.0125)
    trows, hrows = [], []
    for m, e in entries:
        lead = [m] if len(run_models) > 1 else []
        if "missing" in e:
            trows.append(lead + [e["defence"], e["outcome"], str(e["runs"]), "n/a", f"missing: {e['missing']}", "", ""])
            continue
        trows.append(
            lead
            + [
                e["defence"],
                e["outcome"],
                str(e["runs"]),
                f"{e['partial_r2']:.4f}",
                f"[{e['low']:.4f}, {e['high']:.4f}]",
                f"{e['p_value']:.4g}",
                "**PASS**" if e["passes"] else "**FAIL**",
            ]
        )
        h = e.get("heldout")
        if h:
            if "missing" in h:
                hrows.append(lead + [e["defence"], e["outcome"], "n/a", "n/a", f"missing: {h['missing']}", "", "", ""])
            else:
                hrows.append(
                    lead
                    + [
                        e["defence"],
                        e["outcome"],
                        f"{h['rmse_length']:.4f}",
                        f"{h['rmse_with_start']:.4f}",
                        _pp(h["reduction"]) + " %",
                        f"{100 * h['required']:.0f} %",
                        "yes" if h["passes"] else "no",
                        ", ".join(map(str, h.get("test_seeds", [])))
                        + f" ({h['n_train']} fit / {h['n_test']} held out)",
                    ]
                )
    lead_h = ["model"] if len(run_models) > 1 else []
    boots = int(th.get("bootstrap_draws", 10_000))
    doc.add(
        Table(
            lead_h
            + [
                "defence",
                "outcome",
                "runs",
                "partial R² of start",
                f"{100 * level:.4g} % seed-bootstrap interval",
                "permutation p",
                "result",
            ],
            trows,
            caption=(
                f"Does the start b explain variation beyond the length s? Partial R² of the start and its interaction with "
                f"the length, permutation p from shuffling the start within seed and length "
                f"({int(th.get('permutations', 10_000)):,} permutations), seed-bootstrap interval ({boots:,} draws"
                f"{', overridden with --n-boot' if ctx.n_boot is not None else ''}). A test passes when partial R² ≥ {r2_min:g} "
                f"and p < {p_max:g}."
            ),
        )
    )
    if hrows:
        doc.add(
            Table(
                lead_h
                + [
                    "defence",
                    "outcome",
                    "RMSE, length only",
                    "RMSE, with start",
                    "reduction",
                    "required",
                    "passes",
                    "held-out seeds",
                ],
                hrows,
                caption=(
                    "Held-out-seed check (descriptive): ridge fits on the other seeds predict the protocol's last two victim "
                    "seeds, from the length alone and with the start; RMSE in the outcome's units."
                ),
            )
        )
    else:
        doc.add(
            Para(
                "Held-out-seed RMSE omitted: it needs runs on the protocol's last two victim seeds "
                f"({', '.join(map(str, ctx.used.victim_seeds[-2:]))}) and on at least one other seed.",
                "caption",
            )
        )
