"""Scoring an attack's extra outputs against the truth the attack never holds: the judge
(``attacks.base.Judge``) a reconstruction's ``result_fields`` asks, over the documents of the traffic's
phase and the client's own records (mixup's decoy record for the probe rows)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from splitleak.attacks.knowledge import Traffic
from splitleak.metrics.text_overlap import meteor, rouge_f
from splitleak.runs.journal import read_recorded, recorded_digest
from splitleak.runs.truth import read_documents


class TruthJudge:
    """The ``Judge`` of one attack's reconstruction: ``docs`` are the traffic's documents in its order,
    ``doc_dir`` the client's run that holds them."""

    def __init__(self, docs, tokenizer, doc_dir: Path, traffic: Traffic):
        self.docs, self.tokenizer, self.doc_dir, self.traffic = docs, tokenizer, doc_dir, traffic

    def _truth(self) -> torch.Tensor:
        return torch.tensor([list(d.token_ids) for d in self.docs])

    def in_candidates(self, candidates: torch.Tensor) -> float:
        return float((candidates == self._truth().unsqueeze(-1)).any(-1).float().mean())

    def stage_recovery(self, stage_tokens: dict[str, torch.Tensor]) -> dict[str, float]:
        truth = self._truth()
        return {k: float((v == truth)[v >= 0].float().mean()) for k, v in stage_tokens.items()}

    def labels(self, labels: torch.Tensor) -> dict[str, Any]:
        return label_scores(labels, self.docs, self.tokenizer)

    def probe_rows(self, probe_tokens: torch.Tensor, rows: list[int]) -> dict[str, Any]:
        return probe_scores(self.doc_dir, self.traffic, probe_tokens, rows)


def probe_scores(run_dir: Path, traffic: Traffic, probe_tokens: torch.Tensor, rows: list[int]) -> dict[str, Any]:
    """What an attack read of mixup's probe rows, scored against the client's own record of where each
    decoy came from (``client/mixup_decoys.json``; it never crossed): per row, the token of the
    earlier training document at the decoy's position. Also how many distinct training tokens the
    probe rows of this traffic exposed."""
    rel = "client/mixup_decoys.json"
    if recorded_digest(run_dir, rel) is None:
        return {"scored": False, "why": f"the run has no {rel}"}
    draws = json.loads(read_recorded(run_dir, rel))
    phase = traffic.phase
    train = {d.doc_id: d for d in read_documents(run_dir).train}
    by_key = {(d["step"], d["doc_id"]): d["sources"] for d in draws if d["phase"] == phase}
    steps = traffic.steps if traffic.steps is not None else (-1,) * len(traffic)
    correct = total = 0
    exposed: set[tuple[int, int]] = set()
    for r in rows:
        sources = by_key.get((steps[r], traffic.doc_ids[r]))
        if sources is None:
            return {"scored": False, "why": f"no decoy record for document {traffic.doc_ids[r]} at step {steps[r]}"}
        for t, (_, src_doc, pos) in enumerate(sources):
            correct += int(probe_tokens[r, t]) == train[src_doc].token_ids[pos]
            total += 1
            exposed.add((src_doc, pos))
    n_train_tokens = sum(len(d.token_ids) for d in train.values())
    return {
        "scored": True,
        "rows": total,
        "token_recovery": correct / max(1, total),
        "distinct_training_tokens": len(exposed),
        "training_token_share": len(exposed) / max(1, n_train_tokens),
        "how": "VMI (ridge map, nearest token) on each probe row; truth from the client's decoy record",
    }


def label_scores(labels: torch.Tensor, docs, tokenizer) -> dict[str, Any]:
    """How much of the labels (tokens 1 … T-1) a label attack recovered: the share of label tokens (and of each
    document's, ``label_recovery_per_doc``), on instruction documents the shares of the answer's and the query's
    labels (overall and per document), and ROUGE-1/2/L F and METEOR of the label text
    (``splitleak.metrics.text_overlap``; METEOR only where nltk's WordNet is installed)."""
    truth = torch.tensor([list(d.token_ids) for d in docs])[:, 1:]
    hit = labels.cpu() == truth
    out: dict[str, Any] = {"label_recovery": float(hit.float().mean())}
    # per document (doc id, share of its labels), so that a reading over documents has an interval
    out["label_recovery_per_doc"] = [[int(d.doc_id), float(h)] for d, h in zip(docs, hit.float().mean(1).tolist())]
    if all(d.answer_start is not None for d in docs):
        answer = (
            torch.arange(1, truth.shape[1] + 1).unsqueeze(0) >= torch.tensor([d.answer_start for d in docs])[:, None]
        )
        for name, span in (("answer", answer), ("query", ~answer)):  # the labels of each span (003 App. E)
            out[f"{name}_label_recovery"] = float(hit[span].float().mean()) if bool(span.any()) else None
            out[f"{name}_label_recovery_per_doc"] = [
                [int(d.doc_id), float(h[m].float().mean())] for d, h, m in zip(docs, hit, span) if bool(m.any())
            ]
    pred_text = [tokenizer.decode(row) for row in labels.tolist()]
    true_text = [tokenizer.decode(row) for row in truth.tolist()]
    rouge = rouge_f(pred_text, true_text)
    out.update({f"{k}_f": rouge[k]["mean"] for k in ("rouge1", "rouge2", "rougeL")})
    m = meteor(pred_text, true_text)
    out["meteor"] = m["mean"] if m["available"] else None
    if not m["available"]:
        out["meteor_note"] = m["reason"]
    return out
