"""Paired effects over the constant baseline, shuffled-label negative controls, the gate, and the
verdict words of Politis & Pappas (2026) §3.

Every arm's score is a top-1 token accuracy. The *constant baseline* always guesses the single
most frequent token of the evaluation set. For document (frame) f,
``Δ_f(q) = acc_f(q) − acc_f(constant)``; the arm's paired effect is ``A = mean_f Δ_f(arm)``, and
its *shuffled-label negative control* is ``N``, the same statistic when the arm's predictions are
scored against labels permuted at random across all (document, position) cells of the frame set
(a seeded permutation, drawn once and shared by every arm). A permutation keeps the label
distribution, so the constant baseline reads the same on the permuted labels, while an arm's
agreement with them falls to chance, ``Σ_v p_pred(v)·p_true(v)``, which never exceeds the
constant rate by more than sampling noise. So N must not be *detected*: it reads at floor, or
below floor when the arm's predictions are more varied than the constant guess (their chance
agreement is then smaller than the constant's rate). A detected N means the scoring pairs
predictions with labels it should not see.

Intervals resample documents (frame-clustered bootstrap). Verdict words, exactly as Politis & Pappas 2026, §3:
**detected** when the lower end of the interval is above zero; **at floor** when the interval
includes zero (and *below floor* when it lies wholly below zero, which Politis & Pappas 2026 do not name); an arm set
**breaks the gate** when ``G = max_j U^Bonf_0.95(p_j) − p_const > gate`` (Eq. 1).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike

from splitleak.errors import DataError
from splitleak.stats import (
    GateResult,
    Interval,
    effect_verdict,
    frame_weights,
    gate_statistic,
    wilson_interval,
)
from splitleak.stats.paired import most_frequent, paired_interval

#: the gate of Politis & Pappas 2026, §3, +1.0 percentage point
GATE = 0.01


@dataclass(frozen=True)
class ConstantBaseline:
    token_id: int
    rate: float


@dataclass(frozen=True)
class ArmEffect:
    """One arm's accuracy, its paired effect over the constant baseline (A) and its
    shuffled-label negative control (N), each with a frame-clustered interval."""

    name: str
    accuracy: float
    successes: int
    n: int
    effect: Interval  # A
    control: Interval  # N
    verdict: str  # detected / at floor / below floor
    control_verdict: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def constant_baseline(truth: np.ndarray) -> ConstantBaseline:
    """The most frequent token of the evaluation labels (ties: the lower id) and its rate."""
    t = np.asarray(truth).reshape(-1)
    if t.size == 0:
        raise DataError("no labels to take a constant baseline of")
    tok = most_frequent([t])
    return ConstantBaseline(tok, float((t == tok).mean()))


def shuffled_labels(truth: np.ndarray, seed: int) -> np.ndarray:
    """The labels permuted uniformly at random across every (document, position) cell."""
    t = np.asarray(truth)
    rng = np.random.default_rng([int(seed), 0x5EED])
    return rng.permutation(t.reshape(-1)).reshape(t.shape)


def arm_effects(
    predictions: Mapping[str, ArrayLike],
    truth: np.ndarray,
    *,
    n_boot: int = 10_000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[ConstantBaseline, list[ArmEffect]]:
    """A and N for every arm (``predictions[name]`` is ``[docs, T]`` like ``truth``).

    One resampling of the documents is shared by all arms and controls, so their intervals are
    paired; one label permutation (from ``seed``) is shared by all controls."""
    truth = np.asarray(truth, dtype=np.int64)
    if truth.ndim != 2:
        raise DataError(f"truth has shape {truth.shape}; pass [documents, positions] token ids")
    base = constant_baseline(truth)
    shuffled = shuffled_labels(truth, seed)
    const_acc = (truth == base.token_id).mean(axis=1)
    const_acc_shuffled = (shuffled == base.token_id).mean(axis=1)
    w = frame_weights(truth.shape[0], n_boot, seed)
    out = []
    for name, pred in predictions.items():
        pred = np.asarray(pred, dtype=np.int64)
        if pred.shape != truth.shape:
            raise DataError(f"arm {name!r}: predictions have shape {pred.shape} but the labels {truth.shape}")
        right = pred == truth
        a = paired_interval(right.mean(axis=1) - const_acc, w, alpha)
        n = paired_interval((pred == shuffled).mean(axis=1) - const_acc_shuffled, w, alpha)
        out.append(
            ArmEffect(
                name, float(right.mean()), int(right.sum()), int(right.size), a, n, effect_verdict(a), effect_verdict(n)
            )
        )
    return base, out


def recovery_intervals(pred: ArrayLike, truth: np.ndarray, weights: np.ndarray, alpha: float = 0.05) -> dict[str, Any]:
    """How precisely the chosen document count pins one reader's recovery: token recovery with a
    percentile interval over resampled documents (``weights`` from ``frame_weights``, shared by the
    readers), whole-document recovery with a Wilson interval over documents."""
    pred, truth = np.asarray(pred, dtype=np.int64), np.asarray(truth, dtype=np.int64)
    if pred.shape != truth.shape:
        raise DataError(f"predictions have shape {pred.shape} but the labels {truth.shape}")
    right = pred == truth
    tok = paired_interval(right.mean(axis=1), weights, alpha)
    doc = wilson_interval(int(right.all(axis=1).sum()), right.shape[0], alpha)
    return {"tokens": asdict(tok), "documents": asdict(doc), "n_docs": int(right.shape[0])}


def arm_gate(arms: Sequence[ArmEffect], base: ConstantBaseline, alpha: float = 0.05, gate: float = GATE) -> GateResult:
    """Politis & Pappas 2026, Eq. (1) over the given arms: Bonferroni over arms, Wilson upper bound, minus p_const."""
    if not arms:
        raise DataError("no arms to form the gate statistic over")
    return gate_statistic([a.successes for a in arms], [a.n for a in arms], base.rate, alpha, gate)
