"""Does a candidate row's activation depend on the batch it is computed in? (run by hand; nothing in splitleak uses it)

    .venv/bin/python benchmarks/batch_invariance.py --run RUN_DIR [--copy public] [--docs 48] [--prefix 8]
                                                    [--threads 2] [--seed 0]

RUN_DIR is a run of `splitleak train` (e.g. the `run/` folder that `make audit` writes); only its model, cut and
--copy of the client layers are used. The script builds the key/value cache of --docs prefixes of --prefix random
token ids (seeded), draws 32 random candidate tokens per prefix, and computes their activations at the cut with
``ClientCopy.extend`` (the pass every beam and SipIt search runs) once for all documents and all 32 candidates.
It then computes the same (prefix, candidate) pairs again in batches of another composition: fewer candidates
per prefix, fewer or other documents, the documents or the candidates in another order. For each case it prints
how many rows, and how many of the key/value entries the pass appends to the cache, differ in any bit from the
reference, and by how much at most. Then the same for SipIt's gradient-guided order
(``GradientGuidedOrder``): the first 16 picks from the estimate, one gradient step against a random observed
row, and the next 16 picks, for all documents and for subsets: how many documents' estimates after the step
differ in any bit, how many documents' picks differ, and how many documents' ranking scores (the order's
product of the unit embedding with the estimates, here the reference's estimates after the step) differ in any bit.

A cache of candidate rows shared by the searches of one grid task (RESULTS.md, "What a shared cache of
candidate rows could save") is exact only if no row depends on its batch: this measures where that holds on the
machine it runs on. It says nothing of another CPU, BLAS or GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from splitleak.attacks import load_knowledge  # noqa: E402
from splitleak.attacks.search import GradientGuidedOrder, _subset_cache  # noqa: E402
from splitleak.runs.manifest import read_manifest  # noqa: E402

#: candidates per prefix in the reference pass (the beam attackers' largest k)
K = 32


def _pass(client, cache, rows: torch.Tensor, candidates: torch.Tensor, t: int):
    """(activations [r, k, d], appended keys and values [layers, 2, r, heads, k, dh]) of one extend."""
    sub = _subset_cache(client, cache, rows)
    h = client.extend(sub, candidates, t)
    kv = torch.stack([torch.stack([layer.keys[:, :, t:], layer.values[:, :, t:]]) for layer in sub.layers])
    return h, kv


def _order(client, cache, rows: torch.Tensor, observed: torch.Tensor, estimate: torch.Tensor, t: int):
    """SipIt's order for ``rows`` at position t: (first 16 picks, the estimate after one gradient step, the next 16
    picks)."""
    order = GradientGuidedOrder(client, observed, estimate)
    first = order(rows, t, 0, 16, lambda: _subset_cache(client, cache, rows))
    second = order(rows, t, 16, 16, lambda: _subset_cache(client, cache, rows))
    stepped = torch.stack([order._state[(int(r), t)][0] for r in rows.tolist()])
    return first, stepped, second


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True)
    ap.add_argument("--copy", default="public")
    ap.add_argument("--docs", type=int, default=48)
    ap.add_argument("--prefix", type=int, default=8, help="prefix length in tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.docs < 24 or a.prefix < 1:
        raise SystemExit("--docs must be at least 24 and --prefix at least 1 (the cases below take subsets of them)")
    torch.set_num_threads(a.threads)

    client = load_knowledge(a.run, a.copy).client
    g = torch.Generator().manual_seed(a.seed)
    n, t = a.docs, a.prefix
    prefixes = torch.randint(0, client.vocab_size, (n, t), generator=g)
    cache = client.new_cache()
    with torch.no_grad():
        client.owner(input_ids=prefixes, use_cache=True, **{client.cache_keyword: cache})
    cand = torch.randint(0, client.vocab_size, (n, K), generator=g)
    everyone = torch.arange(n)
    ref_h, ref_kv = _pass(client, cache, everyone, cand, t)

    perm = torch.randperm(K, generator=g)
    cases = [(f"k = {k}, all {n} documents", everyone, torch.arange(k)) for k in (16, 8, 4, 2, 1)]
    cases += [
        (f"k = {K}, documents 0-23", torch.arange(24), torch.arange(K)),
        (f"k = {K}, documents 5-20", torch.arange(5, 21), torch.arange(K)),
        (f"k = {K}, documents reversed", everyone.flip(0), torch.arange(K)),
        (f"k = {K}, candidates permuted", everyone, perm),
        ("k = 4, documents 0-3 (16 rows)", torch.arange(4), torch.arange(4)),
        ("k = 2, documents 0-2 (6 rows)", torch.arange(3), torch.arange(2)),
        ("k = 1, documents 0-15 (16 rows)", torch.arange(16), torch.arange(1)),
    ]
    out = []
    print(f"{'case':<34} {'rows':>6} {'rows differ':>12} {'max |diff|':>11} {'cache entries differ':>21}")
    for label, rows, cols in cases:
        h, kv = _pass(client, cache, rows, cand[rows][:, cols], t)
        rh, rkv = ref_h[rows][:, cols], ref_kv[:, :, rows][:, :, :, :, cols]
        row_diff = (h != rh).flatten(2).any(-1)  # [r, k]
        kv_diff = (kv != rkv).any(-1)  # [layers, 2, r, heads, k]
        rec = {
            "case": label,
            "rows": int(row_diff.numel()),
            "rows_differ": int(row_diff.sum()),
            "max_abs_diff": float((h - rh).abs().max()),
            "cache_entries": int(kv_diff.numel()),
            "cache_entries_differ": int(kv_diff.sum()),
        }
        out.append(rec)
        print(
            f"{label:<34} {rec['rows']:>6} {rec['rows_differ']:>12} {rec['max_abs_diff']:>11.3g} "
            f"{rec['cache_entries_differ']:>10} of {rec['cache_entries']:<8}"
        )

    d = client.embedding.shape[1]
    observed, estimate = torch.randn(n, t + 1, d, generator=g), torch.randn(n, t + 1, d, generator=g)
    ref_order = _order(client, cache, everyone, observed, estimate, t)
    unit = torch.nn.functional.normalize(client.embedding, dim=-1)
    ref_scores = unit @ torch.nn.functional.normalize(ref_order[1], dim=-1).T  # [vocabulary, documents]
    order_out = []
    print(
        f"\n{'SipIt order, documents':<34} {'docs':>6} {'estimates differ':>17} {'max |diff|':>11} {'picks differ':>13} "
        f"{'scores differ':>14}"
    )
    for label, rows in [
        ("0-23", torch.arange(24)),
        ("5-20", torch.arange(5, 21)),
        ("all, reversed", everyone.flip(0)),
        ("0-3", torch.arange(4)),
        ("7 alone", torch.tensor([7])),
    ]:
        first, stepped, second = _order(client, cache, rows, observed, estimate, t)
        r_first, r_stepped, r_second = (x[rows] for x in ref_order)
        rec = {
            "documents": label,
            "docs": len(rows),
            "estimates_differ": int((stepped != r_stepped).any(-1).sum()),
            "max_abs_diff": float((stepped - r_stepped).abs().max()),
            "picks_differ": int(((first != r_first).any(-1) | (second != r_second).any(-1)).sum()),
            "scores_differ": int(
                (unit @ torch.nn.functional.normalize(r_stepped, dim=-1).T != ref_scores[:, rows]).any(0).sum()
            ),
        }
        order_out.append(rec)
        print(
            f"{label:<34} {rec['docs']:>6} {rec['estimates_differ']:>17} {rec['max_abs_diff']:>11.3g} "
            f"{rec['picks_differ']:>13} {rec['scores_differ']:>14}"
        )
    print(
        json.dumps(
            {
                "model": read_manifest(a.run)["config"]["model"],
                "cut": client.cut,
                "copy": a.copy,
                "docs": n,
                "prefix": t,
                "threads": a.threads,
                "seed": a.seed,
                "torch": torch.__version__,
                "cases": out,
                "order": order_out,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
