"""Each position's reading, for the claims that count by position: 000's first-token errors (§4.3) and the gross
share of the activation-only errors the gradient corrects (§4.2). A store's attack row keeps the tokens the attack
read (``predicted``) but not which of them are right; the judge sets them against the documents of the row's run,
kept in the store (``ResultsStore.run_dir``). The judge scores here, as ``run_attack`` does: no attack sees them.

A row gets ``correct`` (a list of bools, one per position) where its reading covers every position of its document
(``token_counted`` equals the document's length: a label attack, which counts from token 1, has none), else None.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from splitleak.errors import DataError
from splitleak.runs.truth import phase_documents

#: metrics read position by position (``judge.measure``): the share of documents whose first token is read right
POSITION_METRICS = ("first_token_recovery",)


def with_positions(rows: Sequence[dict[str, Any]], store: str | Path) -> list[dict[str, Any]]:
    """``rows`` (a store's attack rows), each with ``correct`` (module docstring)."""
    runs: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    out = []
    for r in rows:
        r = dict(r)
        r["correct"] = None
        pred, key = r.get("predicted"), r.get("train_key")
        if pred is not None and key and r.get("doc_id") is not None and r.get("token_counted") == len(pred):
            phase = r.get("phase") or "capture"
            if (key, phase) not in runs:
                folder = Path(store) / "runs" / key[:16]
                runs[key, phase] = (
                    {d.doc_id: np.asarray(d.token_ids) for d in phase_documents(folder, phase)}
                    if (folder / "documents.json").is_file()
                    else {}
                )
            truth = runs[key, phase].get(int(r["doc_id"]))
            if truth is not None and len(truth) == len(pred):
                right = np.asarray(pred) == truth
                if int(right.sum()) != r.get("token_correct"):
                    raise DataError(
                        f"attack row {str(r.get('key'))[:12]} (document {r['doc_id']}) counts {r.get('token_correct')} "
                        f"tokens right, but its reading matches {int(right.sum())} of its run's document: the store's "
                        "run folder is not the run it read; move the store aside and run its grid again"
                    )
                r["correct"] = right.tolist()
        out.append(r)
    return out


def first_token_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]] | str:
    """The rows as if each counted its first position only (``token_recovery`` then reads first-token recovery), or
    why not: a row without its positions."""
    if any(r.get("correct") is None for r in rows):
        return "its rows hold no reading per position (a label attack, or rows read without their runs' documents)"
    return [
        {**r, "token_correct": int(r["correct"][0]), "token_counted": 1, "exact": bool(r["correct"][0])} for r in rows
    ]


def gross_matrices(
    t_rows: Sequence[dict[str, Any]], c_rows: Sequence[dict[str, Any]]
) -> tuple[np.ndarray, np.ndarray, list[Any], list[int]] | str:
    """(victim seeds x documents) matrices of the control's misses that the treatment reads right and of the
    control's misses, each position's reading averaged over attack seeds first (a position the control misses
    on one of two seeds counts half); on the seeds and documents both arms hold. Or why not."""
    arms = []
    for rows in (t_rows, c_rows):
        if any(r.get("correct") is None for r in rows):
            return "its rows hold no reading per position (a label attack, or rows read without their runs' documents)"
        cells: dict[tuple[Any, int], list[np.ndarray]] = {}
        for r in rows:
            cells.setdefault((r.get("victim_seed"), int(r["doc_id"])), []).append(np.asarray(r["correct"], float))
        arms.append({k: np.mean(v, axis=0) for k, v in cells.items()})
    t, c = arms
    seeds = sorted({s for s, _ in t} & {s for s, _ in c}, key=str)
    docs = sorted({d for _, d in t} & {d for _, d in c})
    if not seeds or not docs or any((s, d) not in t or (s, d) not in c for s in seeds for d in docs):
        return "treatment and control share no complete grid of victim seeds and documents"
    num = np.array([[float(((1 - c[s, d]) * t[s, d]).sum()) for d in docs] for s in seeds])
    den = np.array([[float((1 - c[s, d]).sum()) for d in docs] for s in seeds])
    return num, den, seeds, docs
