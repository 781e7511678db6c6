"""How much of a grid task's beam work is the same work (run by hand; nothing in splitleak uses it).

    .venv/bin/python benchmarks/beam_overlap.py --run RUN_DIR [--docs 8] [--copy public] [--threads 1]

RUN_DIR is a run of `splitleak train` (e.g. the `run/` folder that `make audit` writes). On its first --docs
captured documents and the --copy of the client layers, the script runs, through the attacks' own code, the
beam searches that one paper_main grid task runs on an undefended run: the activation-only attacker, the joint
attacker under each of the five gradient perturbations of 000 §4.4 (none, noise 0.1 and 1.0 x RMS with attack
seed 0, 8- and 4-bit rounding), the shuffled-gradient and the random-candidate controls, each at k = 8, 16
and 32 (width 2). It follows ``ClientCopy.extend`` and ``select_cache`` to know the prefix behind every
candidate row the searches compute, and prints how many rows they compute in all, how many distinct
(prefix, candidate) pairs those are (a row's activation depends on nothing else), and how many distinct
prefixes the searches hold per position: the most that a cache of candidate rows shared by the task could
save. Nothing is timed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import splitleak.attacks.search as search  # noqa: E402
from splitleak.attacks import load_knowledge, load_traffic, make_attack  # noqa: E402
from splitleak.attacks.config import perturb_gradients  # noqa: E402

PERTURBATIONS = [(None, None), (0.1, None), (1.0, None), (None, 8), (None, 4)]


class Recorder:
    """The (prefix, candidate) pair of every row ``extend`` computes, the prefixes followed through
    ``select_cache``."""

    def __init__(self, client):
        self.pairs: set[tuple[tuple[int, ...], int]] = set()
        self.per_position: dict[int, set[tuple[int, ...]]] = {}
        self.rows = 0
        extend, select = client.extend, search.select_cache

        def recorded_extend(cache, candidates, position):
            # each cache carries the prefix of each of its rows and the candidates of its last extend
            rows = getattr(cache, "_overlap_prefixes", [()] * candidates.shape[0])
            assert len(rows) == candidates.shape[0] and all(len(p) == position for p in rows)
            for prefix, cands in zip(rows, candidates.tolist()):
                self.pairs.update((prefix, c) for c in cands)
                self.per_position.setdefault(position, set()).add(prefix)
            self.rows += candidates.numel()
            cache._overlap_prefixes, cache._overlap_last = rows, candidates.cpu()
            return extend(cache, candidates, position)

        def recorded_select(cache, position, parent, choice):
            rows, cands = cache._overlap_prefixes, cache._overlap_last
            cache._overlap_prefixes = [
                rows[p] if choice is None else rows[p] + (int(cands[p, c]),)
                for p, c in zip(parent.tolist(), (choice if choice is not None else parent).tolist())
            ]
            return select(cache, position, parent, choice)

        client.extend = recorded_extend
        search.select_cache = recorded_select


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--copy", default="public")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    kn = load_knowledge(a.run, a.copy)
    traffic = load_traffic(a.run).subset(range(a.docs))
    if traffic.gradients is None:
        raise SystemExit(
            f"{a.run} holds no returned gradients: the joint attacker and its controls need a training run"
        )
    rec = Recorder(kn.client)
    for k in (8, 16, 32):
        runs = [("activation", {}, traffic)]
        for noise, bits in PERTURBATIONS:
            perturbed = traffic.replace(gradients=perturb_gradients(traffic.gradients, noise, bits, 0))
            runs.append((f"joint (noise {noise}, bits {bits})", {}, perturbed))
        runs += [("shuffled-gradient", {"seed": 0}, traffic), ("random-candidate", {"seed": 0}, traffic)]
        for label, params, tr in runs:
            name = label.split(" ")[0]
            make_attack(name, k=k, **params).fit(kn).reconstruct(tr)
            print(f"k={k:>2} {label:<32} rows so far {rec.rows:>9,}  distinct {len(rec.pairs):>9,}", flush=True)
    prefixes = [len(v) for _, v in sorted(rec.per_position.items())]
    print(
        f"\n{rec.rows:,} candidate rows computed, {len(rec.pairs):,} distinct (prefix, candidate) pairs: "
        f"{rec.rows / len(rec.pairs):.2f} times fewer; distinct prefixes per position: "
        f"mean {sum(prefixes) / len(prefixes):.1f}, max {max(prefixes)} ({a.docs} documents, copy {a.copy}, "
        f"cut {kn.client.cut})"
    )


if __name__ == "__main__":
    main()
