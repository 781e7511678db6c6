"""Pilot: secret mixup's correction variants on SmolLM2-135M, measured with every attack that reads
what crosses (experiments/PILOTS.md, "Mixup, measured on the whole wire").

For each victim seed it trains the undefended run and mixup with ``correction`` = probe, cached
and none (same documents, same order), then attacks the capture pass with the public copy: the
majority control, VMI, activation-only (k), joint (k) and, where probe rows cross, ``mixup-unmix``
(k, λ estimated). It prints one JSON line per (seed, variant, attack) and writes them all to OUT.

    .venv/bin/python experiments/mixup_pilot.py --out runs/mixup-pilot --seeds 0 1
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitleak.attacks import load_knowledge, load_traffic, make_attack_config  # noqa: E402
from splitleak.audit.evaluate import run_attack  # noqa: E402
from splitleak.models import load_model  # noqa: E402
from splitleak.runs.manifest import read_manifest  # noqa: E402
from splitleak.runs.truth import phase_documents  # noqa: E402
from splitleak.runs.verify import verify_run  # noqa: E402
from splitleak.training import make_train_config, run_training  # noqa: E402
from splitleak.training.run import read_metrics  # noqa: E402

VARIANTS = {
    "none": [{"name": "none"}],
    "mixup-probe": [{"name": "mixup", "args": {"correction": "probe"}}],
    "mixup-cached": [{"name": "mixup", "args": {"correction": "cached"}}],
    "mixup-none": [{"name": "mixup", "args": {"correction": "none"}}],
}


def clean_twin(run: Path, lm):
    """The run's capture traffic with the activations replaced by the trained client's own clean
    activations of the same documents: what the defence was meant to hide."""
    import torch

    traffic = load_traffic(run)
    by_id = {d.doc_id: d for d in phase_documents(run)}
    ids = torch.tensor([list(by_id[i].token_ids) for i in traffic.doc_ids])
    clean = load_knowledge(run, "trained", lm=copy.deepcopy(lm)).client.activations(ids)
    return traffic.replace(activations=clean)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--doc-len", type=int, default=32)
    ap.add_argument("--n-train", type=int, default=64)
    ap.add_argument("--n-eval", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reuse", action="store_true", help="attack runs already in OUT with the same configuration")
    a = ap.parse_args()
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in a.seeds:
        lm = load_model(a.model, seed=seed)
        for variant in a.variants:
            cfg = make_train_config(
                model=a.model,
                depth=a.depth,
                n_calib=32,
                n_train=a.n_train,
                n_eval=a.n_eval,
                doc_len=a.doc_len,
                seed=seed,
                all_local_baseline=False,
                defences=VARIANTS[variant],
            )
            run = a.out / f"seed{seed}-{variant}"
            t0 = time.perf_counter()
            if a.reuse and verify_run(run).ok and read_manifest(run)["config_hash"] == cfg.hash():
                metrics = read_metrics(run)  # attack an existing run of the same configuration again
            else:
                metrics = run_training(cfg, run, device="cpu", lm=copy.deepcopy(lm), force=True).metrics
            train_s = time.perf_counter() - t0
            kn = load_knowledge(run, "public", lm=copy.deepcopy(lm))
            attacks = [("majority", {}), ("vmi", {}), ("activation", {"k": a.k}), ("joint", {"k": a.k})]
            if variant == "mixup-probe":
                attacks.append(("mixup-unmix", {"k": a.k}))
            if variant != "none":  # what the same attack reads of this client's clean activations
                attacks.append(("activation-clean-twin", {"k": a.k}))
            for name, kw in attacks:
                traffic = None
                if name == "activation-clean-twin":
                    traffic = clean_twin(run, lm)
                r = run_attack(
                    run,
                    make_attack_config(attack=name.removesuffix("-clean-twin"), **kw),
                    knowledge=kn,
                    traffic=traffic,
                )
                row = {
                    "seed": seed,
                    "variant": variant,
                    "attack": name,
                    **kw,
                    "token_recovery": r["token_recovery"],
                    "doc_recovery": r["doc_recovery"],
                    "span_recovery": r["span_recovery"],
                    "perplexity": metrics["perplexity"],
                    "heldout_ce": metrics["heldout_ce"],
                    "train_seconds": train_s,
                    "attack_seconds": r["seconds"],
                    "lambda": r.get("lambda"),
                    "probe_rows": r.get("probe_rows"),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    (a.out / "pilot.json").write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "rows": rows}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
