"""What every section of the grid report (``splitleak.report.grid``) shares: the record of what it
wrote (``GridReport``), the context a section is given (``Ctx``), and the number formats of its
tables and prose."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitleak.audit.analysis import Analysis
from splitleak.audit.protocol import Protocol
from splitleak.metrics import fmt_pct


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
    #: both sides of every defended run (``grid_bound.run_bounds``): the strongest reading, the bound, any fault
    bounds: list[dict[str, Any]] = field(default_factory=list)
    #: the readings of the training traffic per run (``grid_passes.run_passes``), beside the bound over it
    passes: list[dict[str, Any]] = field(default_factory=list)

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


# ------------------------------------------------------------------ number formats


def pct(x: float | None) -> str:
    """A share in percent (``fmt_pct``), ``n/a`` when missing."""
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt_pct(x)


def pp(x: float | None) -> str:
    """A signed difference in percentage points, rounded half-up."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    s = fmt_pct(x)
    return s if s.startswith("-") or float(s) == 0 else "+" + s


def interval(est, lo, hi, signed: bool = False) -> str:
    """``est [lo, hi]`` in percent (signed: in percentage points); the estimate alone without bounds."""
    f = pp if signed else pct
    if est is None:
        return "n/a"
    if lo is None or (isinstance(lo, float) and math.isnan(lo)):
        return f(est)
    return f"{f(est)} [{f(lo)}, {f(hi)}]"


def num(x: int) -> str:
    """An integer with thousands separators."""
    return f"{x:,}"


def count(n: int, word: str) -> str:
    """``1 victim seed``, ``3 victim seeds``."""
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def first_line(text: str | None, limit: int = 200) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def level(alpha: float) -> str:
    """The confidence level of a two-sided test at ``alpha``, in percent."""
    v = 100 * (1 - alpha)
    return f"{v:.4g} %"


def fixed(x: float | None, places: int, signed: bool = False) -> str:
    """``x`` to ``places`` decimals, ``n/a`` when missing."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if signed:
        t = f"{x:+.{places}f}"
        return t if float(t) != 0 else f"{0:.{places}f}"  # no "-0.0000" for a difference that rounds to zero
    return f"{x:.{places}f}"
