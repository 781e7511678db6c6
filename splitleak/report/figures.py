"""Figure output shared by every stage that draws: matplotlib without a display, PNG + SVG."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    # lazy: matplotlib only for figures, and its Agg backend is chosen before pyplot loads
    import matplotlib

    matplotlib.use("Agg")
    # lazy: pyplot loads after the Agg backend is chosen, and only for figures
    import matplotlib.pyplot as plt

    return plt


def save_png_svg(fig, out_stem: str | Path, dpi: int = 150) -> list[Path]:
    """Write ``fig`` as OUT_STEM.png and OUT_STEM.svg (creating the folder), close it, return both paths."""
    out_stem = Path(out_stem)
    out_stem.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for ext in ("png", "svg"):
        p = out_stem.with_suffix(f".{ext}")
        fig.savefig(p, dpi=dpi)
        paths.append(p)
    pyplot().close(fig)
    return paths


CostPoint = tuple[float, float, str, bool]  # (cost %, recovery %, label, undefended)


def recovery_cost_figure(
    panels: dict[str, list[CostPoint]],
    out_stem: str | Path,
    *,
    xlabel: str,
    ylabel: str = "{title} (%), pooled over attacks",
    dpi: int = 150,
) -> list[Path]:
    """One panel per title: recovery (%) against utility cost (%), one labelled point per run or
    condition, undefended ones in blue. Points closer than the plot can show share one label, and
    labels point inwards so that none runs off the panel. Writes OUT.png and OUT.svg."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.6), constrained_layout=True, squeeze=False)
    for ax, (title, points) in zip(axes[0], panels.items()):
        groups: dict[tuple[float, float], tuple[float, float, list[str], bool]] = {}
        for x, y, name, undefended in points:
            key = (round(x, 2), round(y, 1))
            gx, gy, names, und = groups.get(key, (x, y, [], False))
            groups[key] = (gx, gy, names + [name], und or undefended)
        xs = [g[0] for g in groups.values()] or [0.0]
        mid = (min(xs) + max(xs)) / 2
        for x, y, names, undefended in groups.values():
            ax.scatter([x], [y], s=42, color="C0" if undefended else "C3", zorder=3)
            right = x > mid
            ax.annotate(
                "\n".join(names),
                (x, y),
                textcoords="offset points",
                xytext=(-7 if right else 7, -4),
                fontsize=9,
                va="top",
                ha="right" if right else "left",
            )
        ax.margins(x=0.35)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel.format(title=title))
        ax.set_title(f"{title} against cost")
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
    return save_png_svg(fig, out_stem, dpi=dpi)


#: one claim on a claims figure: (label, the paper's point or None, the paper's range or None, ours: estimate,
#: low, high or None, verdict)
ClaimPoint = tuple[str, float | None, tuple[float, float] | None, tuple[float, float, float] | None, str]
VERDICT_COLOURS = {"agrees": "C2", "disagrees": "C3", "underpowered": "C1", "no number": "C7"}


def claims_figure(panels: dict[str, list[ClaimPoint]], out_stem: str | Path, dpi: int = 150) -> list[Path]:
    """One panel per unit (levels in %, differences in pp), stacked, a row per claim at one spacing: per claim, the
    paper's number (a black cross, or a black bar for a range) beside ours with its 95 % interval, coloured by
    the verdict. Writes OUT.png/.svg."""
    plt = pyplot()
    rows = [len(p) for p in panels.values()]
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(8.0, 0.34 * sum(rows) + 1.0 * len(rows) + 0.6), constrained_layout=True,
        squeeze=False, gridspec_kw={"height_ratios": [r + 1.5 for r in rows]},
    )  # fmt: skip
    for ax, (title, points) in zip(axes[:, 0], panels.items()):
        for i, (_label, paper, span, ours, verdict) in enumerate(points):
            y = len(points) - 1 - i
            if span is not None:
                ax.plot(span, [y + 0.15] * 2, color="black", lw=3, solid_capstyle="butt")
            if paper is not None:
                ax.scatter([paper], [y + 0.15], marker="x", color="black", s=36, zorder=3)
            if ours is not None:
                est, low, high = ours
                colour = VERDICT_COLOURS.get(verdict, "C0")
                if low == low and high == high:  # not NaN: an interval
                    ax.plot([low, high], [y - 0.15] * 2, color=colour, lw=2)
                ax.scatter([est], [y - 0.15], color=colour, s=24, zorder=3)
        ax.set_ylim(-0.8, len(points) - 0.2)
        ax.set_yticks(range(len(points)))
        ax.set_yticklabels([p[0] for p in reversed(points)], fontsize=8)
        ax.set_title(title)
        ax.grid(axis="x", alpha=0.3)
    return save_png_svg(fig, out_stem, dpi=dpi)
