"""Would pooling the crossings of documents that share a prefix read more than ``crossings-aware``? (run by hand)

    .venv/bin/python experiments/prefix_pooling_check.py [--seeds 0 1 2 3] [--n-train 32] [--passes 4]
        [--model tiny-gpt2] [--data synthetic-pii] [--clip 0.1] [--sigma 0.3] [--out DIR]

Causal attention makes a document's activation row at position t a function of its tokens 0..t alone, so two
training documents with the same first t+1 tokens cross with the same clean row there, each pass with fresh
noise: a reader that knew which documents share a prefix could average their rows too, not only a document's
own crossings. This measures the most that pooling could add: an *oracle* that pools, at every position, the
crossing means of all the training documents whose true prefixes agree up to that position (the truth is used
to group, and only here: no attack may read it), read with ``activation-aware``'s search as ``crossings-aware``
reads its means. Where even the oracle reads no more than ``crossings-aware`` on the tokens that matter (the
annotated names, numbers and identifiers, which documents rarely share), no prefix-pooling reader can, and the
suite need not carry one. Prints, per seed, the share of positions whose prefix another document shares, and the
token and span recovery of both readers on the training documents.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from splitleak.attacks import load_knowledge, load_traffic
from splitleak.attacks.core import make_attack
from splitleak.attacks.crossings import combine_crossings
from splitleak.runs.truth import phase_documents
from splitleak.training import make_train_config, run_training


def pooled_by_prefix(means: torch.Tensor, ids: list[tuple[int, ...]]) -> tuple[torch.Tensor, float]:
    """[n, T, H] crossing means pooled, at each position t, over the documents whose first t+1 tokens equal
    each document's (the oracle's groups); and the share of (document, position) pairs pooled with another."""
    n, T, _ = means.shape
    out = means.clone().double()
    shared = 0
    for t in range(T):
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, toks in enumerate(ids):
            groups.setdefault(toks[: t + 1], []).append(i)
        for members in groups.values():
            if len(members) > 1:
                out[members, t] = means[members, t].double().mean(0)
                shared += len(members)
    return out.to(means.dtype), shared / (n * T)


def span_mask(docs, T: int) -> np.ndarray:
    mask = np.zeros((len(docs), T), dtype=bool)
    for i, d in enumerate(docs):
        for s in d.spans:
            mask[i, s.token_start : s.token_end] = True
    return mask


def one_seed(args, seed: int) -> dict:
    run = Path(args.out) / f"run-{seed}"
    if not run.exists():
        cfg = make_train_config(
            model=args.model, depth=3, n_calib=32, n_train=args.n_train, n_eval=8, steps=args.passes * args.n_train,
            seed=seed, data_seed=seed, data=args.data, all_local_baseline=False, draws="derived",
            defences=[{"name": "clip-noise", "args": {"clip": args.clip, "sigma": args.sigma, "where": "forward"}}],
        )  # fmt: skip
        run_training(cfg, run, device="cpu")
    kn, traffic = load_knowledge(run, "public"), load_traffic(run, phase="train")
    combined, _ = combine_crossings(traffic)
    by_id = {d.doc_id: d for d in phase_documents(run, "train")}
    docs = [by_id[int(i)] for i in combined.doc_ids]
    ids = [tuple(d.token_ids) for d in docs]
    truth = np.array(ids)
    pooled, shared = pooled_by_prefix(combined.activations, ids)
    spans = span_mask(docs, truth.shape[1])
    out = {"seed": seed, "documents": len(docs), "shared_positions": shared, "span_positions": float(spans.mean())}
    for name, acts in (("crossings-aware", combined.activations), ("oracle prefix pooling", pooled)):
        rec = make_attack("activation-aware", k=32, seed=seed).fit(kn).reconstruct(combined.replace(activations=acts))
        hit = rec.tokens.numpy() == truth
        out[name] = {"tokens": float(hit.mean()), "spans": float(hit[spans].mean()) if spans.any() else None}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--n-train", type=int, default=32)
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--model", default="tiny-gpt2")
    ap.add_argument("--data", default="synthetic-pii")
    ap.add_argument("--clip", type=float, default=0.1)
    ap.add_argument("--sigma", type=float, default=0.3)
    ap.add_argument("--out", default="prefix-pooling-runs")
    args = ap.parse_args()
    torch.set_num_threads(2)
    for seed in args.seeds:
        print(json.dumps(one_seed(args, seed)), flush=True)


if __name__ == "__main__":
    main()
