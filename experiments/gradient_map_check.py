"""What the joint attacker's gradient map reads, per run directory (run by hand; the numbers of
experiments/PILOTS.md).

    .venv/bin/python experiments/gradient_map_check.py RUN_DIR [RUN_DIR ...] [--copy public] [--k 32]

For each run directory it prints:
- the activation pseudo-labels' accuracy (the ridge fit's top-1, which labels the gradient map's fit);
- the default ``gradient`` read-out's next-token accuracy at top-1 and top-k/2 (cosine of −gradient
  with the token embeddings; no fit);
- the gradient map's next-token accuracy at top-1 and top-k/2, fitted as the attacks fit it (on the
  pseudo-labels, in-sample), and fitted on the true tokens of the other half of the documents
  (two-fold, held out: an oracle no attacker has; an in-sample fit on true labels overfits badly);
- with ``--public-docs N``: the same map fitted on the public model's own gradients for N public
  documents drawn from the run's data source (their true tokens known), evaluated on the traffic;
- how often the map's top-1 equals the pseudo-label of the same position (what the backward-only
  heuristic inherits from the activations rather than reads from the gradient);
- the share of positions whose candidate list holds the true token: activation-only at k, and the
  joint attacker's merged list (gradient read-out, pseudo-label map, then held-out oracle map).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from splitleak.attacks import load_knowledge, load_traffic, merge_candidates  # noqa: E402
from splitleak.attacks.core import GradientMap, gradient_readout, make_attack  # noqa: E402
from splitleak.runs.manifest import read_manifest  # noqa: E402
from splitleak.runs.truth import read_documents  # noqa: E402


def public_gradients(run: Path, n_docs: int, exclude: set[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients at the cut of the public (pretrained) model for public documents, and their tokens."""
    from splitleak.data import load_documents
    from splitleak.models import load_model
    from splitleak.models.split import SplitModel, next_token_loss
    from splitleak.seeds import model_init_seed

    cfg = read_manifest(run)["config"]
    lm = load_model(
        cfg["model"], precision=cfg["precision"], seed=model_init_seed(cfg["seed"]), model_path=cfg.get("model_path")
    )
    split = SplitModel(lm, depth=cfg["depth"])
    pub = load_documents(
        cfg["data"],
        lm.tokenizer,
        seed=10_000 + cfg["data_seed"],
        n_calib=n_docs,
        n_train=1,
        n_eval=1,
        doc_len=cfg["doc_len"],
        data_path=cfg.get("data_path"),
    ).calibration
    ids = torch.tensor([list(d.token_ids) for d in pub if tuple(d.token_ids) not in exclude])
    grads = []
    for i in range(0, len(ids), 32):
        batch = ids[i : i + 32]
        h_in = split.bottom(batch).detach().requires_grad_(True)
        ctx = split.context(*batch.shape)
        loss = next_token_loss(split.head_logits(split.trunk(h_in, ctx), ctx), batch, reduction="per_doc").sum()
        (g,) = torch.autograd.grad(loss, h_in)
        grads.append(g.detach())
    return torch.cat(grads), ids


def check(run: Path, copy: str, k: int, public_docs: int = 0) -> dict[str, float]:
    knowledge = load_knowledge(run, copy)
    traffic = load_traffic(run, with_gradients=True)
    docs = {d.doc_id: d for d in read_documents(run).evaluation}
    truth = torch.tensor([list(docs[i].token_ids) for i in traffic.doc_ids])
    attack = make_attack("joint", k=k, readout="pseudo-map")
    attack.fit(knowledge)
    emb = knowledge.client.embedding
    grads = traffic.gradients
    act = attack.activation_candidates(traffic, k)
    pseudo = act[..., 0]
    nxt = truth[:, 1:]

    def holds(cands: torch.Tensor, target: torch.Tensor) -> float:
        return (cands == target[..., None]).any(-1).float().mean().item()

    g_direct = gradient_readout(grads, emb, k // 2)
    g_pseudo = GradientMap.fit(grads, pseudo, emb).candidates(grads, emb, k // 2)
    half = len(truth) // 2
    folds = [(slice(half, None), slice(0, half)), (slice(0, half), slice(half, None))]  # (fit, predict)
    g_true = torch.cat([GradientMap.fit(grads[f], truth[f], emb).candidates(grads[p], emb, k // 2) for f, p in folds])
    out = {
        "documents": float(len(traffic)),
        "pseudo-label accuracy": (pseudo == truth).float().mean().item(),
        "gradient read-out top-1": holds(g_direct[..., :1], nxt),
        f"gradient read-out top-{k // 2}": holds(g_direct, nxt),
        "map top-1 (pseudo)": holds(g_pseudo[..., :1], nxt),
        f"map top-{k // 2} (pseudo)": holds(g_pseudo, nxt),
        "map top-1 (held-out oracle)": holds(g_true[..., :1], nxt),
        f"map top-{k // 2} (held-out oracle)": holds(g_true, nxt),
        "map top-1 = pseudo-label": (g_pseudo[..., 0] == pseudo[:, 1:]).float().mean().item(),
        f"activation list holds truth (k={k})": holds(act, truth),
        "joint list holds truth (gradient)": holds(merge_candidates(act, g_direct, k), truth),
        "joint list holds truth (pseudo)": holds(merge_candidates(act, g_pseudo, k), truth),
        "joint list holds truth (oracle)": holds(merge_candidates(act, g_true, k), truth),
    }
    if public_docs:
        pg, pids = public_gradients(run, public_docs, {tuple(d.token_ids) for d in docs.values()})
        g_pub = GradientMap.fit(pg, pids, emb).candidates(grads, emb, k // 2)
        out["public documents used"] = float(len(pids))
        out["map top-1 (public model)"] = holds(g_pub[..., :1], nxt)
        out[f"map top-{k // 2} (public model)"] = holds(g_pub, nxt)
        out["joint list holds truth (public model)"] = holds(merge_candidates(act, g_pub, k), truth)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--copy", default="public")
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--public-docs", type=int, default=0, help="also fit the map on the public model's gradients")
    a = ap.parse_args()
    torch.manual_seed(0)
    for run in a.runs:
        res = check(run, a.copy, a.k, a.public_docs)
        print(f"{run}:")
        for name, v in res.items():
            print(
                f"  {name:40s} {v:.0f}"
                if name.endswith(("documents", "documents used"))
                else f"  {name:40s} {100 * v:6.2f} %"
            )


if __name__ == "__main__":
    main()
