"""Figures of the grid report (What Gradients Add Figures 5, 6 and 7), each written as PNG and SVG."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from splitleak.attacks.registry import controls
from splitleak.report.figures import pyplot, recovery_cost_figure, save_png_svg
from splitleak.report.grid_stats import Cell, Config, CostPoint, perturbation_rank, perturbation_text

#: the joint attacker's controls, shown beside its gradient conditions, with their labels (registry)
CONTROLS = controls(of="joint")


def _row_label(cfg: Config, models: int) -> str:
    lab = cfg.attack_text() if cfg.defence == "none" else f"{cfg.attack_text()} | {cfg.defence}"
    return f"{cfg.model}: {lab}" if models > 1 else lab


def perturbation_cells(cells: Sequence[Cell]) -> list[Cell]:
    """The joint attacker's cells without a defence, true and perturbed gradients (training setting)."""
    return [c for c in cells if c.config.attack == "joint" and c.config.defence == "none" and not c.config.inference]


def perturbation_figure(cells: Sequence[Cell], out_stem: str | Path) -> list[Path]:
    """Token recovery of the joint attacker per gradient condition (true gradient, noise σ, b-bit
    rounding, and the two controls when present), one panel per split and copy, one series per k,
    95 % interval bars; dashed lines: the activation-only attacker at the same k."""
    plt = pyplot()
    joint = perturbation_cells(cells)
    conds = sorted({c.condition for c in joint}, key=lambda c: c.sort_key())
    splits = sorted({c.split for c in conds}, key=lambda s: next(c.sort_key() for c in conds if c.split == s))
    copies = sorted({c.copy for c in conds}, key=lambda x: (x != "public", x))
    pert = sorted(
        {(c.config.gradient_noise, c.config.gradient_bits) for c in joint}, key=lambda p: perturbation_rank(*p)
    )
    ctl = [a for a in CONTROLS if any(c.config.attack == a and c.config.defence == "none" for c in cells)]
    xlabels = [perturbation_text(*p) for p in pert] + [CONTROLS[a] for a in ctl]
    ks = sorted({c.config.k for c in joint}, key=lambda k: (k is None, k or 0))
    panel_w = min(5.4, max(3.6, 0.75 * len(xlabels) + 1.2))
    fig, axes = plt.subplots(
        len(splits),
        len(copies),
        figsize=(panel_w * len(copies) + 0.6, 3.3 * len(splits) + 0.9),
        squeeze=False,
        sharey=True,
        constrained_layout=True,
    )
    for i, split in enumerate(splits):
        for j, copy in enumerate(copies):
            ax = axes[i][j]
            here = [
                c
                for c in cells
                if c.condition.split == split
                and c.condition.copy == copy
                and c.config.defence == "none"
                and not c.config.inference
            ]
            _perturbation_panel(ax, here, ks, pert, ctl)
            ax.set_xticks(range(len(xlabels)), xlabels, rotation=25, ha="right")
            ax.set_xlim(-0.6, len(xlabels) - 0.4)
            ax.set_title(f"{split}, {copy} copy")
            ax.grid(axis="y", alpha=0.3)
            if j == 0:
                ax.set_ylabel("token recovery (%)")
    _perturbation_legend(fig, axes, ks)
    return save_png_svg(fig, out_stem, dpi=130)


def _perturbation_panel(ax, here: Sequence[Cell], ks: list, pert: list, ctl: list[str]) -> None:
    """One split and copy: per k, the joint attacker at each gradient condition (filled) and the controls
    (hollow) with their intervals, side by side, and the activation-only attacker as a dashed line."""
    width = 0.75 / max(1, len(ks))
    for n, k in enumerate(ks):
        colour = f"C{n}"
        joint_pts = [
            (
                x,
                next(
                    (
                        c
                        for c in here
                        if c.config.attack == "joint"
                        and c.config.k == k
                        and (c.config.gradient_noise, c.config.gradient_bits) == p
                    ),
                    None,
                ),
            )
            for x, p in enumerate(pert)
        ]
        ctl_pts = [
            (x, next((c for c in here if c.config.attack == a and c.config.k == k), None))
            for x, a in enumerate(ctl, start=len(pert))
        ]
        offset = (n - (len(ks) - 1) / 2) * width
        for pts, hollow in ((joint_pts, False), (ctl_pts, True)):
            found = [(x, c) for x, c in pts if c is not None]
            if not found:
                continue
            y = np.array([100 * c.token.estimate for _, c in found])
            err = np.array([[y[i] - 100 * c.token.low, 100 * c.token.high - y[i]] for i, (_, c) in enumerate(found)]).T
            ax.errorbar(
                np.array([x for x, _ in found]) + offset,
                y,
                yerr=err,
                fmt="o",
                color=colour,
                capsize=3,
                ms=5,
                mfc="white" if hollow else colour,
                label=None if hollow else f"joint k={k}",
            )
        act = next((c for c in here if c.config.attack == "activation" and c.config.k == k), None)
        if act is not None:
            ax.axhline(100 * act.token.estimate, color=colour, ls="--", lw=1, label=f"activation-only k={k}")


def _perturbation_legend(fig, axes, ks: list) -> None:
    """One legend column per k (filled column by column): the joint attacker above its activation-only line."""
    items: dict[str, Any] = {}  # legend label -> artist
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            items.setdefault(lab, h)
    labels = [lab for k in ks for lab in (f"joint k={k}", f"activation-only k={k}") if lab in items]
    if labels:
        fig.legend(
            [items[lab] for lab in labels],
            labels,
            loc="outside lower center",
            ncols=max(1, len(ks)),
            fontsize=9,
            frameon=False,
        )


def cost_figure(points: Sequence[CostPoint], out_stem: str | Path) -> list[Path]:
    """Token and whole-document recovery against the relative perplexity change, one labelled point
    per (model, split, defence) (the same figure as ``splitleak compare`` draws)."""
    pts = [p for p in points if p.rel_ppl_change is not None and p.token is not None]
    models = len({p.model for p in pts})

    def panel(what: str) -> list[tuple[float, float, str, bool]]:
        out = []
        for p in pts:
            assert p.rel_ppl_change is not None  # pts keeps the points with a cost
            out.append(
                (
                    100 * p.rel_ppl_change,
                    100 * getattr(p, what),
                    f"{p.defence}, {p.split}" + (f" ({p.model})" if models > 1 else ""),
                    p.defence == "none",
                )
            )
        return out

    return recovery_cost_figure(
        {"token recovery": panel("token"), "whole-document recovery": panel("doc")},
        out_stem,
        xlabel="cost: held-out perplexity change vs. undefended (%)",
        dpi=130,
    )


def heatmap_figure(cells: Sequence[Cell], out_stem: str | Path) -> list[Path]:
    """Token recovery (%) per attack configuration (rows) and (split, copy) (columns), annotated."""
    plt = pyplot()
    configs = sorted({c.config for c in cells}, key=lambda c: c.sort_key())
    conds = sorted({c.condition for c in cells}, key=lambda c: c.sort_key())
    models = len({c.model for c in configs})
    m = np.full((len(configs), len(conds)), np.nan)
    ci = {c: i for i, c in enumerate(configs)}
    cj = {c: j for j, c in enumerate(conds)}
    for c in cells:
        m[ci[c.config], cj[c.condition]] = 100 * c.token.estimate
    labels = [_row_label(c, models) for c in configs]
    h = max(2.6, 0.28 * len(configs) + 1.2)
    w = 0.9 + 0.062 * max(len(s) for s in labels) + 1.05 * len(conds) + 1.3  # labels, cells, colour bar
    fig, ax = plt.subplots(figsize=(w, h), constrained_layout=True)
    cmap = plt.get_cmap("viridis").with_extremes(bad="#dddddd")
    im = ax.imshow(np.ma.masked_invalid(m), cmap=cmap, vmin=0, vmax=100, aspect="auto")
    for i in range(m.shape[0]):
        for j in range(m.shape[1]):
            v = m[i, j]
            txt = "n/a" if np.isnan(v) else f"{v:.1f}"
            ax.text(
                j, i, txt, ha="center", va="center", fontsize=8.5, color="black" if np.isnan(v) or v > 60 else "white"
            )
    ax.set_xticks(range(len(conds)), [c.text() for c in conds])
    ax.xaxis.tick_top()
    ax.set_yticks(range(len(configs)), labels, fontsize=9)
    undefended = [i for i, c in enumerate(configs) if c.defence == "none"]
    if undefended and len(undefended) < len(configs):
        ax.axhline(max(undefended) + 0.5, color="white", lw=3)
    fig.colorbar(im, ax=ax, label="token recovery (%)", shrink=min(1.0, 6 / h + 0.3))
    return save_png_svg(fig, out_stem, dpi=130)
