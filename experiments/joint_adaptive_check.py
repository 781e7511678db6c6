"""Activation-only, fixed-half joint and adaptive joint attackers on the first N evaluation documents of a
run (experiments/PILOTS.md, "The adaptive joint attacker").

The candidate lists, and the adaptive attacker's calibration, are computed on the whole captured traffic,
as `splitleak attack` computes them; only the beam search, which is where the time goes, runs on the first
N documents (`splitleak attack` has no document subset). Public copy of the client layers. The truth is
read only to score.

    .venv/bin/python experiments/joint_adaptive_check.py RUN_DIR [--docs 32] [--k 32] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from splitleak.attacks import load_knowledge, load_traffic, make_attack
from splitleak.attacks.search import beam_search


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    kn, tr = load_knowledge(a.run, "public"), load_traffic(a.run)
    docs = {d["doc_id"]: d["token_ids"] for d in json.loads((a.run / "documents.json").read_text())["evaluation"]}
    truth = torch.tensor([docs[i] for i in tr.doc_ids])
    n = a.docs
    out: dict = {"run": str(a.run), "n_docs": n, "k": a.k}
    per_doc = {}
    for name in ("activation", "joint", "joint-adaptive"):
        t0 = time.time()
        att = make_attack(name, k=a.k).fit(kn)
        if name == "joint-adaptive":
            cand, summary = att.candidates_and_summary(tr)
            summary.pop("slots")
            out["adaptive_summary"] = summary
        else:
            cand = att.candidates(tr)
        res = beam_search(kn.client, tr.activations[:n], cand[:n], 2, 64)
        out[name] = {
            "token_recovery": float((res.tokens == truth[:n]).float().mean()),
            "true_token_in_candidates": float((cand[:n] == truth[:n].unsqueeze(-1)).any(-1).float().mean()),
            "true_token_in_candidates_all_docs": float((cand == truth.unsqueeze(-1)).any(-1).float().mean()),
            "seconds": round(time.time() - t0, 1),
        }
        per_doc[name] = (res.tokens == truth[:n]).double().mean(1).numpy()
        print(name, out[name], flush=True)
    # paired per-document differences, 95 % document bootstrap (10,000 replicates, seed 0)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, n, (10_000, n))
    for name, base in (("joint", "activation"), ("joint-adaptive", "activation"), ("joint-adaptive", "joint")):
        diff = per_doc[name] - per_doc[base]
        lo, hi = np.percentile(diff[idx].mean(1), [2.5, 97.5])
        out[f"{name} - {base}"] = [float(diff.mean()), float(lo), float(hi)]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
