"""Section 5 of the grid report: leakage against the utility cost of each defence (What Gradients Add
Figure 6), a table of perplexity change, ΔU and pooled recovery per defence and split, and its figure."""

from __future__ import annotations

from typing import Any, Sequence

from splitleak.report.document import Document, Figure, Heading, Para, Table
from splitleak.report.grid_common import Ctx, fixed, num, pct, pp
from splitleak.report.grid_figures import cost_figure
from splitleak.report.grid_stats import CostPoint, cost_points


def cost_section(doc: Document, ctx: Ctx, attack_rows, train_rows) -> None:
    """5. Leakage against the utility cost of each defence (table and figure)."""
    doc.add(Heading(2, "Leakage against utility cost"))
    defended = [t for t in train_rows if (t.get("defence_name") or "none") != "none"]
    if not defended:
        doc.add(Para("Omitted: the grid trained no defence, so there is no cost to weigh leakage against.", "note"))
        return
    points, note = cost_points(attack_rows, train_rows)
    doc.add(_cost_table(points, note, train_rows))
    pts = [p for p in points if p.rel_ppl_change is not None and p.token is not None]
    if not pts:
        doc.add(
            Para(
                "Figure omitted: no defence has both a perplexity reference and attack results with per-token scores.",
                "note",
            )
        )
        return
    doc.add(_cost_figure(ctx, points, pts))


def _cost_table(points: Sequence[CostPoint], note: str, train_rows: Sequence[dict[str, Any]]) -> Table:
    """Per defence and split: perplexity against its reference, ΔU, and (where attacks scored tokens) the
    pooled token and whole-document recovery."""
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
            else f"{fixed(p.reference_perplexity, 2)} ({p.reference.replace('undefended run', 'undefended')})"
        )
        rows.append(
            ([p.model] if models else [])
            + [
                p.split,
                p.defence,
                str(len(p.seeds)),
                fixed(p.perplexity, 2),
                ref,
                pp(p.rel_ppl_change),
                fixed(p.delta_u, 4, signed=True),
            ]
            + ([pct(p.token), pct(p.doc), str(p.n_configs), num(p.n_evals)] if leak else [])
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
    return Table(
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


def _cost_figure(ctx: Ctx, points: Sequence[CostPoint], pts: Sequence[CostPoint]) -> Figure:
    """Draws the figure of every point into the report's folder; ``pts``, the points with a cost and a
    token recovery, are what its caption counts."""
    paths = cost_figure(points, ctx.out / "leakage-cost")
    ctx.rep.figures += paths
    seeds = sorted({len(p.seeds) for p in pts})
    return Figure(
        paths[0],
        (
            f"Leakage against cost: token recovery (left) and whole-document recovery (right) of each defence at each "
            f"split, pooled over the attack configurations in the table "
            f"({'/'.join(str(n) for n in sorted({p.n_configs for p in pts}))} per point here), against the held-out perplexity change vs. the undefended reference; "
            f"{'/'.join(map(str, seeds))} victim seed{'s' if seeds != [1] else ''} per point, "
            f"{num(sum(p.n_evals for p in pts))} document-level "
            f"evaluations in all. Blue: no defence; red: defended."
        ),
        alt="leakage against utility cost",
    )
