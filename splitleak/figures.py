"""Figure output shared by every stage that draws: matplotlib without a display, PNG + SVG."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
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
