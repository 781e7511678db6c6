"""Paired effects over the constant baseline, mis-paired negative controls, the gate, and the
verdict words of Politis & Pappas (2026) §3.

Every arm's score is a top-1 token accuracy. The *constant baseline* always guesses the single
most frequent token of the evaluation set. For document (frame) f,
``Δ_f(q) = acc_f(q) − acc_f(constant)``; the arm's paired effect is ``A = mean_f Δ_f(arm)``.

Its *negative control* ``N`` is a twin of the arm that can fail. The audit's attacks fit nothing on
the victim's labels (they fit on public calibration text), so a twin fitted on shuffled labels would
be the arm itself; instead the twin is the same fitted attack run on traffic *paired with the wrong
documents* (``mispairing``: a seeded derangement of a seeded sample of documents, whole capture
frames where the traffic records them, so a loss normalised over its frame keeps its frame): row j of
the twin's traffic is document ``given[j]``'s traffic, labelled as document ``rows[j]``. The twin is
scored exactly as the arm, against the labels of the documents it is labelled as, and its floor is
the arm's own reading of the same traffic scored against those labels:
``N = mean_j [acc(twin_j, truth[rows[j]]) − acc(arm[given[j]], truth[rows[j]])]``.
An attack that reads only the traffic reads the same document either way (N = 0 exactly for one that
treats documents independently, and noise about 0 for one that pools over documents); an attack or
a pipeline that reaches the evaluation text by the document's identity — the file, the ids, a cache
keyed by them — reads the document it is labelled as, and N is *detected*. (The shuffled-label
statistic this replaces scored the arm's own predictions against permuted labels: chance agreement,
at or below floor by construction, so it could not fail.) The probe battery, which does fit on the
victim's labels, keeps its twin fitted and scored on shuffled labels
(``splitleak.audit.latent_attacks.run_probe_attack``).

Intervals resample documents (frame-clustered bootstrap). Verdict words, exactly as Politis & Pappas 2026, §3:
**detected** when the lower end of the interval is above zero; **at floor** when the interval
includes zero (and *below floor* when it lies wholly below zero, which Politis & Pappas 2026 do not name); an arm set
**breaks the gate** when ``G = max_j U^Bonf_0.95(p_j) − p_const > gate`` (Eq. 1), the gate and α
read from the protocol (``splitleak.audit.gate``; 002's +1.0 pp).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike
from scipy.stats import ttest_1samp

from splitleak.audit.defaults import CONTROL_BOOT, CONTROL_DOCS  # noqa: F401  (CONTROL_DOCS re-exported)
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

#: what the control is, for reports
MISPAIRED_CONTROL = (
    "mis-paired twin: the same fitted attack run on the traffic of other documents (a seeded derangement), "
    "scored against the labels of the documents it is labelled as, minus the arm's own reading of that traffic "
    "scored against the same labels"
)


@dataclass(frozen=True)
class ConstantBaseline:
    token_id: int
    rate: float


@dataclass(frozen=True)
class ArmEffect:
    """One arm's accuracy, its paired effect over the constant baseline (A) and its mis-paired negative
    control (N; None where no twin ran), each with a frame-clustered interval."""

    name: str
    accuracy: float
    successes: int
    n: int
    effect: Interval  # A
    control: Interval | None  # N
    verdict: str  # detected / at floor / below floor
    control_verdict: str  # the same words, or "not measured"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def constant_baseline(truth: np.ndarray) -> ConstantBaseline:
    """The most frequent token of the evaluation labels (ties: the lower id) and its rate."""
    t = np.asarray(truth).reshape(-1)
    if t.size == 0:
        raise DataError("no labels to take a constant baseline of")
    tok = most_frequent([t])
    return ConstantBaseline(tok, float((t == tok).mean()))


def mispairing(n_docs: int, frames: Sequence[int] | None, control_docs: int, seed: int) -> tuple[list[int], list[int]]:
    """The twin's documents: ``(rows, given)``, row j of the twin's traffic is document ``given[j]``'s,
    labelled (and scored) as document ``rows[j]``, with ``given[j] != rows[j]``. At least ``control_docs``
    documents (all when there are fewer), drawn from ``seed``: whole frames where ``frames`` (each
    document's capture frame) is given, so that every frame the twin reads is complete. The derangement is
    a cyclic shift of a random order of the drawn documents."""
    if n_docs < 2:
        raise DataError(f"a mis-paired control needs at least 2 documents, got {n_docs}")
    if control_docs < 2:
        raise DataError(f"control_docs must be at least 2 (or 0 for no control), got {control_docs}")
    rng = np.random.default_rng([int(seed), 0xC0DE])
    if frames is None:
        units = [[i] for i in range(n_docs)]
    else:
        by_frame: dict[int, list[int]] = {}
        for i, f in enumerate(frames):
            by_frame.setdefault(int(f), []).append(i)
        units = list(by_frame.values())
    rows: list[int] = []
    for u in rng.permutation(len(units)):
        if len(rows) >= control_docs:
            break
        rows += units[int(u)]
    if len(rows) < 2:  # one frame of one document: take a second one
        rows += next(u for u in units if u[0] not in rows)
    order = [rows[int(i)] for i in rng.permutation(len(rows))]
    given = order[1:] + order[:1]
    return order, given


def control_delta(
    twin: ArrayLike, arm: ArrayLike, truth: np.ndarray, rows: Sequence[int], given: Sequence[int]
) -> np.ndarray:
    """Per twin document j: its token accuracy against ``truth[rows[j]]`` minus that of the arm's reading of
    the traffic it was given (``arm[given[j]]``) against the same labels (see the module docstring)."""
    twin, arm, truth = (np.asarray(x, dtype=np.int64) for x in (twin, arm, truth))
    labels = truth[list(rows)]
    if twin.shape != labels.shape:
        raise DataError(f"the twin's predictions have shape {twin.shape} but its labels {labels.shape}")
    return (twin == labels).mean(axis=1) - (arm[list(given)] == labels).mean(axis=1)


def control_interval(delta: ArrayLike, *, n_boot: int = 10_000, alpha: float = 0.05, seed: int = 0) -> Interval:
    """N with a document-bootstrap interval (its own resampling of the twin's documents)."""
    delta = np.asarray(delta, dtype=np.float64)
    return paired_interval(delta, frame_weights(len(delta), n_boot, np.random.default_rng([int(seed), 0xC7])), alpha)


def control_p_value(delta: ArrayLike) -> float:
    """One-sided p-value of "the twin reads the documents it is labelled as better than the traffic it was
    given": a one-sample t-test of the per-document differences against 0 (``greater``); differences that
    are all equal give 0 when positive and 1 otherwise (no spread to test against). For families too large
    for bootstrap percentiles (a grid's jobs, Bonferroni over thousands)."""
    d = np.asarray(delta, dtype=np.float64)
    if d.size == 0:
        raise DataError("no control differences to test")
    if np.ptp(d) == 0:
        return 0.0 if d[0] > 0 else 1.0
    return float(ttest_1samp(d, 0.0, alternative="greater").pvalue)


def arm_effects(
    predictions: Mapping[str, ArrayLike],
    truth: np.ndarray,
    *,
    controls: Mapping[str, ArrayLike] | None = None,
    n_boot: int = 10_000,
    alpha: float = 0.05,
    seed: int = 0,
) -> tuple[ConstantBaseline, list[ArmEffect]]:
    """A and N for every arm (``predictions[name]`` is ``[docs, T]`` like ``truth``; ``controls[name]``
    the per-document differences of its mis-paired twin, ``control_delta``; an arm without one reads
    "not measured").

    One resampling of the documents is shared by all arms, so their intervals are paired; the controls
    share one resampling of the twin's documents. The controls are one family: each N's interval is at
    level ``1 - alpha / J`` (Bonferroni over the J arms with a control), so that an attack whose reading
    varies with the batch it is read in (a seeded start per chunk of documents) does not stop a verdict by
    chance once in twenty arms."""
    truth = np.asarray(truth, dtype=np.int64)
    if truth.ndim != 2:
        raise DataError(f"truth has shape {truth.shape}; pass [documents, positions] token ids")
    controls = controls or {}
    unknown = set(controls) - set(predictions)
    if unknown:
        raise DataError(f"controls for arms that have no predictions: {sorted(unknown)}")
    base = constant_baseline(truth)
    const_acc = (truth == base.token_id).mean(axis=1)
    w = frame_weights(truth.shape[0], n_boot, seed)
    out = []
    for name, pred in predictions.items():
        pred = np.asarray(pred, dtype=np.int64)
        if pred.shape != truth.shape:
            raise DataError(f"arm {name!r}: predictions have shape {pred.shape} but the labels {truth.shape}")
        right = pred == truth
        a = paired_interval(right.mean(axis=1) - const_acc, w, alpha)
        n = None
        if name in controls:
            n = control_interval(controls[name], n_boot=n_boot, alpha=alpha / len(controls), seed=seed)
        out.append(
            ArmEffect(
                name,
                float(right.mean()),
                int(right.sum()),
                int(right.size),
                a,
                n,
                effect_verdict(a),
                "not measured" if n is None else effect_verdict(n),
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


def arm_gate(arms: Sequence[ArmEffect], base: ConstantBaseline, alpha: float, gate: float) -> GateResult:
    """Politis & Pappas 2026, Eq. (1) over the given arms: Bonferroni over arms, Wilson upper bound, minus p_const.
    ``alpha`` and ``gate`` are the protocol's (``splitleak.audit.gate``: the plain audit reads the shipped
    gate_002's)."""
    if not arms:
        raise DataError("no arms to form the gate statistic over")
    return gate_statistic([a.successes for a in arms], [a.n for a in arms], base.rate, alpha, gate)


# ------------------------------------------------------------------ the twin over every crossing of a document


def mispaired_documents(traffic: Any, seed: int, control_docs: int | None = None) -> tuple[list[int], list[int], Any]:
    """The whole-traffic twin (``mispairing`` over documents): ``rows[j]`` and ``given[j]`` index the documents in
    order of first crossing; every crossing row of document ``given[j]`` is labelled as document ``rows[j]``. A
    document's rows stay together, so a reader that groups the rows by document (``crossings-aware``) reads
    another document's crossings as one, under this document's id. ``control_docs``: how many documents (None:
    all)."""
    docs = list(dict.fromkeys(int(d) for d in traffic.doc_ids))
    rows, given = mispairing(len(docs), None, control_docs or len(docs), seed)
    picked, labels = [], []
    for r, g in zip(rows, given):
        for i, d in enumerate(traffic.doc_ids):
            if int(d) == docs[g]:
                picked.append(i)
                labels.append(docs[r])
    return rows, given, traffic.subset(picked).replace(doc_ids=tuple(labels))


def document_control(
    arm: list[dict[str, Any]],
    twin: list[dict[str, Any]],
    docs: list[int],
    truth: np.ndarray,
    rows: list[int],
    given: list[int],
    output: str,
    seed: int,
) -> dict[str, Any]:
    """The whole-traffic control from the reader's per-row results on the traffic (``arm``) and on its twin
    (``mispaired_documents``): per twin document j, the share of document ``rows[j]``'s tokens (a label attack's
    from token 1) the twin read from document ``given[j]``'s crossings, minus the share the reader's own reading of
    those crossings has of the same tokens; N with its document-bootstrap interval and verdict."""
    first = 1 if output == "labels" else 0
    labelled = truth[list(rows)]
    twin_read = document_scores(twin, [docs[r] for r in rows], labelled, output)
    floor = np.array([_share(arm, docs[g], labelled[j], first) for j, g in enumerate(given)], dtype=np.float64)
    delta = twin_read.mean(1) - floor
    n = control_interval(delta, n_boot=CONTROL_BOOT, seed=seed)
    return {
        "type": "mis-paired documents: every crossing of another training document, labelled as this one",
        "doc_ids": [docs[r] for r in rows],
        "given_doc_ids": [docs[g] for g in given],
        "per_doc_delta": [float(x) for x in delta],
        "effect": dataclasses.asdict(n),
        "verdict": effect_verdict(n),
    }


def _share(per_row: list[dict[str, Any]], doc: int, labels: np.ndarray, first: int) -> float:
    """The share of positions (from ``first``) of document ``doc``'s crossing rows read as ``labels``."""
    hits = [
        float(np.mean(np.asarray(r["predicted"], dtype=np.int64)[first:] == labels[first:]))
        for r in per_row
        if int(r["doc_id"]) == doc
    ]
    return float(np.mean(hits))


def document_scores(per_row: list[dict[str, Any]], docs: list[int], truth: np.ndarray, output: str) -> np.ndarray:
    """[documents, positions]: per position, the share of a document's crossing rows whose reading is right
    (a label attack's from token 1 on: token 0 is no label)."""
    first = 1 if output == "labels" else 0
    sums = np.zeros((len(docs), truth.shape[1] - first), dtype=np.float64)
    counts = np.zeros(len(docs), dtype=np.int64)
    where = {d: i for i, d in enumerate(docs)}
    for row in per_row:
        i = where[int(row["doc_id"])]
        sums[i] += np.asarray(row["predicted"], dtype=np.int64)[first:] == truth[i, first:]
        counts[i] += 1
    return sums / counts[:, None]
