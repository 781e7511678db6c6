"""Scoring a partition attack against the client's record of real rows (the decoy system's latent frames).

Only the scorer calls these. They take frame ids and arrays, not an attack's traffic, so that the metrics stage
imports no attack module."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from splitleak.errors import IntegrityError
from splitleak.metrics.auc import roc_auc


def agreement(pred: np.ndarray, real: np.ndarray) -> float:
    """The share of a frame's rows whose call (real or decoy) matches the record."""
    pred, real = np.asarray(pred, dtype=bool), np.asarray(real, dtype=bool)
    if pred.shape != real.shape:
        raise IntegrityError(f"a partition of {len(pred)} rows cannot be scored against a record of {len(real)}")
    return float((pred == real).mean())


def score_partition(
    frame_ids: Sequence[int], truth: dict[int, np.ndarray], result: list[tuple[np.ndarray, np.ndarray]]
) -> dict[str, Any]:
    """Frames matched exactly, row agreement, the share of real rows, and the AUC of the scores, for the
    partitions ``result`` (scores, calls) of the frames ``frame_ids`` against the record ``truth``."""
    exact, agree, rows, real = 0, 0, 0, 0
    all_s, all_y = [], []
    for fid, (s, pred) in zip(frame_ids, result):
        y = truth.get(fid)
        if y is None or len(y) != len(pred):
            raise IntegrityError(f"the client's record has no partition for frame {fid} of {len(pred)} rows")
        exact += bool((pred == y).all())
        agree += int((pred == y).sum())
        rows += len(y)
        real += int(y.sum())
        all_s.append(s)
        all_y.append(y)
    s_cat, y_cat = np.concatenate(all_s), np.concatenate(all_y)
    auc = roc_auc(s_cat, y_cat) if 0 < y_cat.sum() < len(y_cat) else None
    return {
        "frames": len(frame_ids),
        "frames_exact": exact,
        "frame_exact_share": exact / max(1, len(frame_ids)),
        "row_agreement": agree / max(1, rows),
        "real_row_share": real / max(1, rows),
        "auc": auc,
        "rows": rows,
    }
