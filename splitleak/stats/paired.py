"""Paired advantage over the most-frequent-token control (Politis & Pappas 2026, §3, Eq. 2–3).

Each arm names a token for every known row of every evaluation frame. The constant control names the
single most frequent evaluation token everywhere. For frame f, Δ_f = acc_f(arm) − acc_f(constant);
the arm's paired effect A is the mean of Δ_f over frames, with a percentile bootstrap over frames
(a frame is one document: one corpus block, the cluster). The same resampling weights serve every
arm and its shuffled-label twin, so their intervals are paired.

An arm whose predictions are almost all one token (modal share > 0.99) is *degenerate*: it is the
constant control in disguise, and its paired effect measures nothing. It is excluded from the
verdict (the paper found three such cells pinning its floor). The verdict takes the best eligible
arm by point effect and reads its interval at α / J, J the number of eligible arms (Bonferroni), and
reports the gate statistic G (Eq. 1) over the same arms. The gate and α are the protocol's
(``splitleak.audit.gate``, which also chooses the arms of 002's family).

Labels are ragged here (one array per frame, -1 for a row not scored), as the latent frames are;
``splitleak.audit.verdicts`` scores the main study's [documents, positions] arms with the same
control and interval (``most_frequent``, ``paired_interval``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from splitleak.errors import DataError
from splitleak.stats._checks import check_alpha, percentile_bounds
from splitleak.stats.binomial import effect_verdict, gate_statistic
from splitleak.stats.bootstrap import Interval, frame_weights

DEGENERATE_SHARE = 0.99


def most_frequent(labels: Sequence[np.ndarray]) -> int:
    """The most frequent known token (>= 0) over the frames; ties go to the smallest id."""
    flat = np.concatenate([np.asarray(x) for x in labels]) if len(labels) else np.zeros(0, dtype=np.int64)
    flat = flat[flat >= 0]
    if not len(flat):
        raise DataError("no known row to score: every label is negative")
    values, counts = np.unique(flat, return_counts=True)
    return int(values[np.argmax(counts)])


def frame_accuracy(predictions: Sequence[np.ndarray], labels: Sequence[np.ndarray]) -> tuple[np.ndarray, int, int]:
    """Per frame, the share of its known rows (label >= 0) named right; and the totals (right, known).
    A frame with no known row is an error (it would carry no weight and no meaning)."""
    if len(predictions) != len(labels):
        raise DataError(f"{len(predictions)} frames of predictions for {len(labels)} frames of labels")
    acc, right, known = np.empty(len(labels)), 0, 0
    for i, (p, y) in enumerate(zip(predictions, labels)):
        p, y = np.asarray(p), np.asarray(y)
        if p.shape != y.shape:
            raise DataError(f"frame {i}: {p.shape} predictions for {y.shape} labels")
        m = y >= 0
        if not m.any():
            raise DataError(f"frame {i} has no known row to score")
        hits = int((p[m] == y[m]).sum())
        acc[i] = hits / int(m.sum())
        right, known = right + hits, known + int(m.sum())
    return acc, right, known


def modal_share(predictions: Sequence[np.ndarray], labels: Sequence[np.ndarray]) -> float:
    """The share of the known rows' predictions that are the arm's most common prediction."""
    flat = np.concatenate([np.asarray(p)[np.asarray(y) >= 0] for p, y in zip(predictions, labels)])
    if not len(flat):
        raise DataError("no known row to score")
    return float(np.unique(flat, return_counts=True)[1].max() / len(flat))


def paired_interval(delta: np.ndarray, weights: np.ndarray, alpha: float) -> Interval:
    """The mean of per-frame differences and its percentile interval under ``weights``
    ((n_boot, frames) resampling counts from ``frame_weights``)."""
    delta = np.asarray(delta, dtype=np.float64)
    if weights.shape[1] != len(delta):
        raise DataError(f"weights cover {weights.shape[1]} frames, the differences {len(delta)}")
    reps = weights @ delta / weights.sum(1)
    low, high = percentile_bounds(reps, alpha)
    return Interval(float(delta.mean()), low, high, int(weights.shape[0]), alpha)


@dataclass
class ArmStats:
    name: str
    accuracy: float
    right: int
    known: int
    modal_share: float
    degenerate: bool
    effect: Interval  # A, at alpha (unadjusted)
    frame_delta: np.ndarray

    def as_dict(self) -> dict[str, Any]:
        return {
            "arm": self.name,
            "accuracy": self.accuracy,
            "right": self.right,
            "known": self.known,
            "modal_share": self.modal_share,
            "degenerate": self.degenerate,
            "paired_effect": self.effect.estimate,
            "paired_low": self.effect.low,
            "paired_high": self.effect.high,
        }


def score_arms(
    arms: dict[str, Sequence[np.ndarray]],
    labels: Sequence[np.ndarray],
    *,
    constant: int | None = None,
    n_boot: int = 10_000,
    alpha: float = 0.05,
    seed: Any = 0,
) -> tuple[list[ArmStats], dict[str, Any]]:
    """Each arm's accuracy, modal share and paired effect over the constant control (the most frequent
    evaluation token unless ``constant`` is given), all under one set of frame resampling weights."""
    alpha = check_alpha(alpha)
    if not arms:
        raise DataError("no arm to score")
    const = most_frequent(labels) if constant is None else int(constant)
    const_acc, const_right, known = frame_accuracy([np.full(len(y), const) for y in labels], labels)
    weights = frame_weights(len(labels), n_boot, seed)
    out = []
    for name, preds in arms.items():
        acc, right, k = frame_accuracy(preds, labels)
        share = modal_share(preds, labels)
        delta = acc - const_acc
        out.append(
            ArmStats(
                name,
                right / k,
                right,
                k,
                share,
                share > DEGENERATE_SHARE,
                paired_interval(delta, weights, alpha),
                delta,
            )
        )
    control = {"token": const, "accuracy": const_right / known, "known_rows": known, "frames": len(labels)}
    return out, {"constant": control, "weights": weights}


def battery_verdict(
    arms: list[ArmStats],
    weights: np.ndarray,
    constant_rate: float,
    *,
    alpha: float,
    gate: float,
    declared: int | None = None,
) -> dict[str, Any]:
    """The verdict from the best eligible (non-degenerate) arm: its paired effect read at α / J
    (Bonferroni over the J eligible arms), and the gate statistic G over the same arms.

    ``alpha`` and ``gate`` come from the protocol (``splitleak.audit.gate``); ``declared`` is the
    family size the protocol declares. J is always the number of arms compared, never ``declared``:
    when the arms given differ in number from ``declared`` the verdict says so (``matches_declared``
    false, and ``family_correction`` names both counts)."""
    alpha = check_alpha(alpha)
    eligible = [a for a in arms if not a.degenerate]
    excluded = [a.name for a in arms if a.degenerate]
    family: dict[str, Any] = {
        "alpha": alpha,
        "gate": gate,
        "family_measured": len(arms),
        "declared_J": declared,
        "matches_declared": None if declared is None else len(arms) == declared,
    }
    if not eligible:
        return {
            "verdict": "no eligible arm",
            "eligible": 0,
            "J": 0,
            "arms_compared": [],
            "excluded_degenerate": excluded,
            "family_correction": "none: every arm was degenerate (modal share > 0.99)",
            **family,
        }
    j = len(eligible)
    best = max(eligible, key=lambda a: a.effect.estimate)
    adjusted = paired_interval(best.frame_delta, weights, alpha / j)
    g = gate_statistic([a.right for a in eligible], [a.known for a in eligible], constant_rate, alpha, gate)
    text = f"Bonferroni over the {j} eligible arms (alpha {alpha:g} / {j})"
    if excluded:
        text += f"; {len(excluded)} degenerate arm(s) of {len(arms)} excluded"
    if declared is not None and len(arms) != declared:
        text += f"; the protocol declares J = {declared}, {len(arms)} measured: not the protocol's family"
    return {
        "verdict": effect_verdict(adjusted),
        "best_arm": best.name,
        "paired_effect": adjusted.estimate,
        "paired_low": adjusted.low,
        "paired_high": adjusted.high,
        "eligible": j,
        "J": j,
        "arms_compared": [a.name for a in eligible],
        "excluded_degenerate": excluded,
        "family_correction": text,
        "gate_statistic": g.G,
        "breaks_gate": g.breaks,
        **family,
    }
