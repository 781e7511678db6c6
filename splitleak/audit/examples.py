"""The audit's readers of text, the worst of them, and the evaluation documents the report shows token by
token beside each reader's reconstruction (chosen as typical, not for show)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from splitleak.attacks.registry import attack_info
from splitleak.audit.evaluate import attack_label
from splitleak.runs.truth import phase_documents

#: documents the report shows token by token (those whose scores lie closest to the attacks' means)
EXAMPLE_DOCS = 3


def _reader_results(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The attacks that read text (token outputs, not controls), in the audit's order."""
    return [r for r in results if r.get("token_recovery") is not None and not attack_info(r["attack"]).control]


def worst_reader(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The reader that recovers the most: most whole documents, then most tokens."""
    readers = _reader_results(results)
    return max(readers, key=lambda r: (r["doc_recovery"], r["token_recovery"])) if readers else None


def example_documents(
    run_dir: Path,
    doc_ids,
    results: list[dict[str, Any]],
    predictions: dict[str, list[list[int]]],
    knowledge,
    n: int = EXAMPLE_DOCS,
) -> dict[str, Any]:
    """A few evaluation documents token by token: the true text, its annotated spans, and each
    reader's reconstruction with its wrong tokens. The documents shown are those whose token accuracy
    lies closest to each reader's mean (the mean over readers of |document accuracy − mean accuracy|),
    so that they are typical, not picked for show."""
    readers = _reader_results(results)
    tok = knowledge.client.tokenizer
    if not readers or tok is None:
        return {"documents": [], "how": "no reader of text ran" if not readers else "no tokenizer"}
    by_id = {d.doc_id: d for d in phase_documents(run_dir, "capture")}
    docs = [by_id[int(i)] for i in doc_ids]
    truth = [list(d.token_ids) for d in docs]
    acc = {}
    for r in readers:
        pred = predictions[attack_label(r)]
        acc[attack_label(r)] = [sum(a == b for a, b in zip(pr, tr)) / len(tr) for pr, tr in zip(pred, truth)]
    means = {k: sum(v) / len(v) for k, v in acc.items()}
    spread = [sum(abs(acc[k][i] - means[k]) for k in acc) / len(acc) for i in range(len(docs))]
    chosen = sorted(range(len(docs)), key=lambda i: (spread[i], docs[i].doc_id))[:n]

    def text(ids):
        return [tok.decode([int(t)]) for t in ids]

    shown = []
    for i in chosen:
        d = docs[i]
        spans: list[str | None] = [None] * len(truth[i])
        for s in d.spans:
            for t in range(s.token_start, s.token_end):
                spans[t] = s.label
        readings = []
        for r in readers:
            label = attack_label(r)
            row = predictions[label][i]
            readings.append(
                {
                    "attack": label,
                    "threat_model": r.get("threat_model", "public"),
                    "tokens": text(row),
                    "wrong": [a != b for a, b in zip(row, truth[i])],
                    "accuracy": acc[label][i],
                }
            )
        shown.append({"doc_id": d.doc_id, "tokens": text(truth[i]), "spans": spans, "readings": readings})
    return {
        "documents": shown,
        "how": f"the {len(shown)} of {len(docs)} evaluation documents whose token accuracy lies closest to each "
        "reader's mean (mean over readers of |document accuracy − mean accuracy|)",
        "mean_accuracy": means,
    }
