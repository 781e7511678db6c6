"""Exhaustive SipIt against its FLOP floor, or budgeted SipIt with ``--budget N`` (run by hand).

    .venv/bin/python benchmarks/sipit_exhaustive.py --run RUN_DIR [--docs 4] [--copy trained] [--budget N] [--record]

RUN_DIR is a run of `splitleak train` (e.g. the `run/` folder that `make audit` writes). The script
1. measures this machine's float32 matmul throughput (GFLOP/s, 2048^3 products), the best of five timings
   before the search and five after (``attack_throughput.MatmulReference``);
2. runs SipIt with ``budget='exhaustive'`` (the default order and rounds: 16, then 16 times wider per
   round) on the first --docs captured documents through the --copy of the client layers, and records
   wall time, checks per position, the share certified and token recovery;
3. counts the multiply-adds of what it computed: every checked candidate through the client blocks
   (with its attention to the cached prefix), the prefix growth, the gradient steps of the order (a
   forward and a backward of one position per document per round after the first: two forwards, since
   the backward reaches the input embedding only and the copy's weights are frozen; until 2026-12-05 it
   counted three, which put the floor above the work done) and, since 2026-12-05, the order's ranking of
   the vocabulary before each round (one [1, d] x [d, vocab] product per document and round, as the
   whole-attack rows of ``attack_throughput.py`` count the beam attackers' cosine rankings); and reports
   wall time against the floor that FLOPs / measured throughput gives. The count agrees with torch's flop
   counter over the same search to within GPT-2's biases and norms (``tests/test_benchmark_floors.py``).

With ``--budget N`` it runs What Gradients Add's budgeted SipIt instead (rounds of 16, at most N checks per
position, the best checked candidate kept where none matched), counted the same way, and records the row in
the table "Budgeted SipIt against its floor".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import date
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from attack_throughput import MatmulReference, allocator, device_cell, run_identity  # noqa: E402
from train_capture import peak_rss_gib, record  # noqa: E402

from splitleak.attacks import load_knowledge, load_traffic, make_attack  # noqa: E402
from splitleak.attacks.search import round_sizes  # noqa: E402
from splitleak.runs.truth import eval_token_ids  # noqa: E402


def sipit_flops(
    client, checks: torch.Tensor, round_size: int = 16, growth: int = 16, budget: int | None = None
) -> float:
    """Multiply-adds x 2 of what a SipIt search in the gradient order computed, from its checks per (document,
    position); its rounds as ``search.round_sizes`` cuts them (up to ``budget``, None: the vocabulary)."""
    block_params = sum(p.numel() for b in client.blocks for p in b.parameters())
    d = client.embedding.shape[1]
    n_blocks = client.cut
    vocab = client.vocab_size
    n, T = checks.shape
    total = 0.0
    sizes = round_sizes(round_size, growth, client.vocab_size if budget is None else min(budget, client.vocab_size))
    for t in range(T):
        c = checks[:, t].double()
        attn = 2 * 2 * d * (t + 1) * n_blocks  # one new token against t cached positions and itself
        total += float(c.sum()) * (2 * block_params + attn)
        total += n * (2 * block_params + attn)  # the chosen token extends the prefix
        # rounds after the first: one gradient step each, a forward and a backward into the input embedding
        # only (no weight gradients): two forwards of one token (tests/test_benchmark_floors.py)
        for ci in c.tolist():
            done, rounds = 0, 0
            for r in sizes:
                if done >= ci:
                    break
                done += r
                rounds += 1
            total += max(0, rounds - 1) * 2 * (2 * block_params + attn)
            total += rounds * 2 * d * vocab  # the order ranks the vocabulary by cosine before each round
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--copy", default="trained", choices=["trained", "public"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--budget", type=int, default=None, help="checks per position (default: exhaustive)")
    ap.add_argument("--chunk-docs", type=int, default=None, help="documents searched together (default: the attack's)")
    ap.add_argument("--record", action="store_true")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    malloc = allocator()

    reference = MatmulReference()
    kn = load_knowledge(a.run, a.copy)
    traffic = load_traffic(a.run).subset(range(a.docs))
    chunk = {} if a.chunk_docs is None else {"chunk_docs": a.chunk_docs}
    attack = make_attack("sipit", budget=a.budget or "exhaustive", **chunk).fit(kn)
    reference.measure()
    t0 = time.perf_counter()
    rec = attack.reconstruct(traffic)
    wall = time.perf_counter() - t0
    reference.measure()
    gflops = reference.best
    rss = peak_rss_gib()
    truth = torch.tensor(eval_token_ids(a.run, traffic.doc_ids))
    checks = rec.extra["checks"]
    # the attack's own rounds: 16 then 16 times wider (exhaustive), or rounds of 16 up to the budget
    flops = sipit_flops(kn.client, checks, attack.round_size, attack._growth(a.budget), a.budget)
    floor = flops / (gflops * 1e9)
    res = {
        **run_identity(a.run),
        "copy": a.copy,
        "docs": len(traffic),
        "chunk_docs": attack._chunk_docs(traffic.activations.shape[1]),
        "malloc": malloc,
        "positions": int(checks.numel()),
        "matmul_gflops": gflops,
        "matmul_gflops_spread": reference.spread(),
        "wall_s": wall,
        "mean_checks": float(checks.double().mean()),
        "max_checks": int(checks.max()),
        "certified": float(rec.extra["matched"].float().mean()),
        "token_recovery": float((rec.tokens == truth).float().mean()),
        "tflop": flops / 1e12,
        "floor_s": floor,
        "wall_over_floor": wall / floor,
        "peak_rss_gib": rss,
    }
    print(json.dumps(res, indent=2))
    if a.record:
        budget = f" {a.budget} |" if a.budget else ""  # the budgeted table's own column
        row = (
            f"| {date.today().isoformat()} | {res['model']} | {res['cut']} | {a.copy} |{budget} {res['docs']} | "
            f"{device_cell()} | {reference.cell()} | {res['mean_checks']:.1f} | {res['max_checks']} | "
            f"{100 * res['certified']:.2f} | {100 * res['token_recovery']:.2f} | {wall:.0f} | {floor:.0f} | "
            f"{wall / floor:.2f} | {rss:.2f} |"
        )
        record("### Budgeted SipIt against its floor" if a.budget else "## Exhaustive SipIt", row)


if __name__ == "__main__":
    main()
