"""Percentages rounded half-up on the decimal form of a share.

``pct(x)`` multiplies the shortest decimal form of ``float(x)`` (its ``repr``) by 100 and
rounds with ``decimal.ROUND_HALF_UP`` (halves go away from zero), so ``pct(0.12345) == 12.35``
where ``round(0.12345 * 100, 2)`` gives 12.34. Compute differences before rounding:
``pct(a - b)``, not ``pct(a) - pct(b)``.
"""

from __future__ import annotations

import math
from decimal import ROUND_HALF_UP, Decimal
from numbers import Real

from splitleak.errors import DataError

__all__ = ["pct", "fmt_pct"]


def _quantized(x: float | Decimal, places: int) -> Decimal:
    if isinstance(places, bool) or not isinstance(places, int) or places < 0:
        raise DataError(f"places must be an integer >= 0, got {places!r}; pass e.g. places=2")
    if isinstance(x, Decimal):
        d = x
        if not d.is_finite():
            raise DataError(f"cannot round {x!r} to a percentage; pass a finite share")
    else:
        if isinstance(x, bool) or not isinstance(x, Real):
            raise DataError(
                f"cannot round {x!r} ({type(x).__name__}) to a percentage; pass a share as a "
                "float, e.g. 0.1234 for 12.34%"
            )
        f = float(x)
        if not math.isfinite(f):
            raise DataError(f"cannot round {x!r} to a percentage; pass a finite share")
        d = Decimal(repr(f))
    q = (d * 100).quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP)
    return q.copy_abs() if q.is_zero() else q


def pct(x: float | Decimal, places: int = 2) -> float:
    """Share ``x`` as a percentage rounded half-up to ``places`` decimals (0.12345 -> 12.35)."""
    return float(_quantized(x, places))


def fmt_pct(x: float | Decimal, places: int = 2) -> str:
    """``pct(x, places)`` as text with exactly ``places`` decimals (0.5 -> "50.00")."""
    return format(_quantized(x, places), "f")
