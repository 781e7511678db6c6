"""Section 7 of the grid report: partial offloading (What Gradients Add Tables 10 and 5): the means per
placement of the server's blocks, the protocol's variance tests of the start b beyond the length s,
and the held-out-seed RMSE."""

from __future__ import annotations

from typing import Any, Sequence

from splitleak.audit.analysis import Analysis, analyse_partial_offloading
from splitleak.report.document import Document, Heading, Para, Table
from splitleak.report.grid_common import Ctx, fixed, pp
from splitleak.report.grid_stats import placement_means


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
    doc.add(Heading(3, "Means per placement"))
    doc.add(_means_table(run_rows))
    doc.add(Heading(3, "Variance tests"))
    if error is not None:
        doc.add(Para(f"The tests could not be evaluated on this store: {error}", "note"))
        return
    if not any("outcome" in t and "defence" in t for t in ctx.used.tests):
        doc.add(Para(f"Omitted: the protocol `{ctx.used.name}` pre-registers no partial-offloading test.", "note"))
        return
    run_models = sorted({r.get("model") for r in run_rows}, key=str)
    per_model = len(run_models) > 1
    trows, hrows = _test_rows(_offload_tests(ctx, run_rows, run_models, analysis), per_model)
    lead_h = ["model"] if per_model else []
    doc.add(_variance_table(ctx, lead_h, trows))
    if hrows:
        doc.add(_heldout_table(lead_h, hrows))
    else:
        doc.add(
            Para(
                "Held-out-seed RMSE omitted: it needs runs on the protocol's last two victim seeds "
                f"({', '.join(map(str, ctx.used.victim_seeds[-2:]))}) and on at least one other seed.",
                "caption",
            )
        )


def _means_table(run_rows: Sequence[dict[str, Any]]) -> Table:
    """Per placement (defence, length s, start b): ΔU, leakage index, VMI excess and perplexity, mean over seeds."""
    means = placement_means(run_rows)
    models = len({m.model for m in means}) > 1
    rows = [
        ([m.model] if models else [])
        + [
            m.defence,
            str(m.length),
            str(m.start),
            str(m.n_seeds),
            fixed(m.delta_u, 4, signed=True),
            fixed(m.leakage_index, 4),
            fixed(m.vmi_excess, 4, signed=True),
            fixed(m.perplexity, 2),
        ]
        for m in means
    ]
    return Table(
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


def _offload_tests(
    ctx: Ctx, run_rows: Sequence[dict[str, Any]], run_models: list[Any], analysis: Analysis | None
) -> list[tuple[str | None, dict[str, Any]]]:
    """The protocol's partial-offloading tests, each with its model: with several models, each model on its own
    (as What Gradients Add Table 5 reports them); with one, the analysis's own."""
    if len(run_models) > 1:
        return [
            (m, e)
            for m in run_models
            for e in analyse_partial_offloading(ctx.used, [r for r in run_rows if r.get("model") == m])
        ]
    return [(None, e) for e in (analysis.partial_offloading if analysis is not None else [])]


def _test_rows(
    entries: Sequence[tuple[str | None, dict[str, Any]]], per_model: bool
) -> tuple[list[list[Any]], list[list[Any]]]:
    """The rows of the variance-test table and of the held-out-seed table, one per test."""
    trows, hrows = [], []
    for m, e in entries:
        lead: list[Any] = [m] if per_model else []
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
            hrows.append(lead + _heldout_cells(e, h))
    return trows, hrows


def _heldout_cells(e: dict[str, Any], h: dict[str, Any]) -> list[str]:
    if "missing" in h:
        return [e["defence"], e["outcome"], "n/a", "n/a", f"missing: {h['missing']}", "", "", ""]
    return [
        e["defence"],
        e["outcome"],
        f"{h['rmse_length']:.4f}",
        f"{h['rmse_with_start']:.4f}",
        pp(h["reduction"]) + " %",
        f"{100 * h['required']:.0f} %",
        "yes" if h["passes"] else "no",
        ", ".join(map(str, h.get("test_seeds", []))) + f" ({h['n_train']} fit / {h['n_test']} held out)",
    ]


def _variance_table(ctx: Ctx, lead_h: list[str], trows: list[list[Any]]) -> Table:
    th = ctx.used.thresholds
    level = float(th.get("bootstrap_level", 0.9875))
    r2_min, p_max = th.get("partial_r2_min", 0.10), th.get("permutation_p_max", 0.0125)
    boots = int(th.get("bootstrap_draws", 10_000))
    return Table(
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


def _heldout_table(lead_h: list[str], hrows: list[list[Any]]) -> Table:
    return Table(
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
