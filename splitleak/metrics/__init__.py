"""Scores of a reconstruction: token, whole-document and exact span recovery, per-position
recovery, ROC AUC, the normalised leakage index, and half-up percentage rounding."""

from __future__ import annotations

from splitleak.metrics.auc import leakage_index, roc_auc
from splitleak.metrics.rounding import fmt_pct, pct
from splitleak.metrics.scores import ScoreResult, position_recovery, score_reconstruction

__all__ = [
    "ScoreResult",
    "score_reconstruction",
    "position_recovery",
    "roc_auc",
    "leakage_index",
    "pct",
    "fmt_pct",
]
