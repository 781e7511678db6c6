"""Section 2 of the grid report: the protocol's main test and its Bonferroni family of comparisons, as
``splitleak.audit.analysis.analyse`` evaluated them on the grid's results."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from splitleak.audit.analysis import Analysis, ComparisonResult, score_matrix, select
from splitleak.errors import SplitleakError
from splitleak.report.analysis import selection_text
from splitleak.report.document import Document, Heading, Para, Table
from splitleak.report.grid_common import Ctx, count, level, pct, pp


def _arm_rate(rows, selector: dict[str, Any], metric: str) -> str:
    try:
        sel = select(rows, selector)
        if not sel:
            return "n/a (no results)"
        m, seeds, docs = score_matrix(sel, metric)
        return f"{pct(float(np.nanmean(m)))} ({count(len(seeds), 'victim model')} × {count(len(docs), 'document')})"
    except SplitleakError as exc:
        return f"n/a ({exc})"


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
    if p.main_test is not None and analysis.main is not None:
        doc.add(Heading(3, "Main test"))
        doc.add(Para(p.main_test.description))
        doc.add(_main_test_table(ctx, rows, analysis.main))
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
            f"{analysis.family_alpha:.4g} each ({level(analysis.family_alpha)} crossed-bootstrap intervals, "
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


def _main_test_table(ctx: Ctx, rows, c: ComparisonResult) -> Table:
    """The main test's arms, their rates, the difference with its interval, the pass mark and the result."""
    t = ctx.used.main_test
    assert t is not None  # the caller writes this table only for a protocol with a main test
    fixed = ctx.protocol.main_test  # ``used`` is this protocol with n_boot overridden: it has a main test iff this has
    boot_note = (
        f" (overridden with --n-boot; the protocol fixes {fixed.n_boot:,})"
        if ctx.n_boot is not None and fixed is not None
        else ""
    )
    metric = t.metric.replace("_", " ")
    result = ("not evaluated: " + c.missing) if c.missing else ("**PASS**" if c.passes else "**FAIL**")
    return Table(
        ["", "value"],
        [
            ["treatment", f"`{selection_text(c.treatment)}`"],
            ["control", f"`{selection_text(c.control)}`"],
            [f"treatment {metric} (%)", _arm_rate(rows, c.treatment, t.metric)],
            [f"control {metric} (%)", _arm_rate(rows, c.control, t.metric)],
            ["difference, treatment − control (pp)", pp(c.estimate)],
            [
                f"{level(c.alpha)} crossed-bootstrap interval (pp)",
                "n/a" if c.low is None else f"[{pp(c.low)}, {pp(c.high)}]",
            ],
            ["pass mark (pp)", f"lower end above {pp(c.mark)}"],
            [
                "bootstrap",
                f"{t.n_boot:,} replicates{boot_note}, seed {t.bootstrap_seed}"
                + (
                    ""
                    if c.missing
                    else f"; {count(c.n_models, 'victim model')} × "
                    f"{count(c.n_docs, 'document')}, per-document scores averaged over attack seeds"
                ),
            ],
            ["result", result],
        ],
        kv=True,
    )


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
                pp(c.estimate),
                f"[{pp(c.low)}, {pp(c.high)}]",
                f"{c.n_models} × {c.n_docs}",
                "yes" if c.passes else "no",
            ]
        rows.append([str(i)] + cond + [str(c.treatment.get("attack", "")), ctl] + tail)
    return Table(header, rows)
