"""Where a pass's time goes against its FLOP floor: every ATen operation timed as it runs (run by hand, through
``attack_throughput.py --breakdown``).

The FLOP floors of ``attack_throughput.py`` count the operations that torch's flop counter has a formula for (the
dense products, the attention kernels); every other operation (elementwise work, reductions, copies, sorting,
indexing) counts as free. ``OpTimes`` splits a pass's time the same way: the operations with a formula ("counted",
with their FLOPs by the same formulas) and the rest ("uncounted"). The time of the counted operations over the floor
is the lowest ratio the pass could reach if every uncounted operation took no time at all: where it is over a bound
already, no cut outside the products reaches that bound.

Each operation is timed around its call on the CPU, where a call returns when its work is done, so the split is
exact for the counted operations; the timer's own cost (a few microseconds per call) falls between the calls, so it
shows only in the timed pass's wall, which ``--breakdown`` reports beside the plain pass's.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from torch.utils import flop_counter as fc
from torch.utils._python_dispatch import TorchDispatchMode

from splitleak.experiments.worker import CPU_SDPA_FORMULAS

#: torch's formulas, and the CPU attention kernels its table lacks, as a grid job's FLOPs are counted
FORMULAS: dict[Any, Any] = {**fc.flop_registry, **CPU_SDPA_FORMULAS}


class OpTimes(TorchDispatchMode):
    """Within: every ATen operation's seconds and calls, by name, split into counted (a FLOP formula) and
    uncounted, and the counted operations' FLOPs."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.flops: Counter[str] = Counter()
        self.counted: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        dt = time.perf_counter() - t0
        name = str(func.overloadpacket.__name__)
        self.seconds[name] += dt
        self.calls[name] += 1
        formula = FORMULAS.get(func.overloadpacket) or FORMULAS.get(func)
        if formula is not None:
            self.counted.add(name)
            self.flops[name] += int(formula(*args, **kwargs, out_val=out))
        return out

    @property
    def counted_s(self) -> float:
        return sum(self.seconds[n] for n in self.counted)

    @property
    def uncounted_s(self) -> float:
        return sum(s for n, s in self.seconds.items() if n not in self.counted)

    @property
    def counted_flops(self) -> int:
        return sum(self.flops.values())

    def largest_uncounted(self, n: int = 6) -> list[tuple[str, float]]:
        """The ``n`` uncounted operations that took the most seconds, with their seconds."""
        rest = Counter({k: s for k, s in self.seconds.items() if k not in self.counted})
        return rest.most_common(n)
