"""Sections 3, 4 and 6 of the grid report, read from the recovery cells (``grid_stats.recovery_cells``):
token, whole-document and span recovery per attack configuration x split x copy (tables), the joint
attacker under observer-side gradient perturbations (figure), and the attack x condition heatmap."""

from __future__ import annotations

from typing import Sequence

from splitleak.data import LABELS
from splitleak.report.document import Document, Figure, Heading, Para, Table
from splitleak.report.grid_common import Ctx, count, interval, num
from splitleak.report.grid_figures import heatmap_figure, perturbation_cells, perturbation_figure
from splitleak.report.grid_stats import Cell

# ------------------------------------------------------------------ 3. recovery tables


def _counts_text(cells: Sequence[Cell]) -> str:
    combos = sorted({(c.n_seeds, c.n_attack_seeds, c.n_docs, c.n_evals) for c in cells})
    if len(combos) == 1:
        s, a, d, n = combos[0]
        return (
            f"Each cell pools {count(n, 'document-level evaluation')} ({count(s, 'victim seed')} × "
            f"{count(a, 'attack seed')} × {count(d, 'document')}{' per seed' if not cells[0].crossed else ''})."
        )
    lo, hi = min(c.n_evals for c in cells), max(c.n_evals for c in cells)
    return f"Cells pool between {num(lo)} and {num(hi)} document-level evaluations (victim seeds × attack seeds × documents)."


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
            r.append("n/a" if e is None else interval(e.estimate, e.low, e.high))
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
            r.append("n/a" if e is None else interval(e.estimate, e.low, e.high))
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
    ns = f"{num(n[0])}" if len(n) == 1 else f"{num(n[0])}–{num(n[-1])}"
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


# ------------------------------------------------------------------ 6. heatmap


def heatmap_section(doc: Document, ctx: Ctx, cells: Sequence[Cell]) -> None:
    """6. Token recovery per attack configuration and condition (annotated heatmap)."""
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
