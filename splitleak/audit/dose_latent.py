"""The dose ladder of the decoy system's probes (Politis & Pappas 2026, §4, Table 4, Figure 3).

A floor reading certifies nothing unless the same instrument detects a leak planted on purpose.
This plants a known token signal into the captured latent rows at a controlled dose, runs the probe
battery (``splitleak.attacks.probes``) on the dosed frames, reads each metric as the paper does
(``splitleak.stats.paired``), and reports where each metric first detects the leak (its onset).

Injection, per dosed row z carrying token t (real rows only; training and evaluation frames alike,
so that the probe can learn the codewords): z' = ‖z‖ · normalise(√(1 − a²) ẑ + a · c_t), where c_t
is a Haar-random unit codeword per token (a normalised Gaussian vector keyed by the seed and the
token) and a the amplitude.

- ``coordinate`` mode: c_t in the wire's coordinates, the same in every frame;
- ``invariant`` mode: c_t · R_f, through a Haar rotation drawn fresh per frame (as the gauge's
  rotation is): no coordinate carries the codeword, only the rows' relations do.

*Coverage* is the share of real rows dosed, in one seeded order per phase, so the rows dosed at a
coverage are a subset of those dosed at every larger one. ``channel`` doses the forward rows
(``activations``) or the output-gradient rows (``output-gradient``, the gradient channel).

``PAPER_DOSES`` are the 19 doses of the artefact's sweep (``w24_dose_response.json``): coverage 0
to 1 at amplitude 1 and amplitude 0.05 to 0.5 at coverage 1 in coordinate mode, and coverage 0.05 to
1 in invariant mode.

Metrics per dose: ``token_top1``, the best eligible arm's paired effect over the most-frequent-token
control, read at α / J (detected when its lower end is above 0); ``gate``, the gate statistic G
(breaks above +1 pp); ``rare_token_top1``, the best arm's accuracy on rare rows — tokens seen at
most once among the probe's training rows (ours) — detected when its Wilson lower bound is above
the constant control's accuracy on those rows. The paper's token cross-entropy and membership AUC
are not computed here (its §4.1 retired the latter as a channel).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
import torch

from splitleak.attacks.dose import CHANNELS, MODES, PAPER_DOSES
from splitleak.attacks.partition import LatentTraffic, load_latent_traffic
from splitleak.attacks.probes import ProbeBattery
from splitleak.audit.gate import GateThresholds, shipped_thresholds
from splitleak.defences.gauges import derive_master, haar_rotation
from splitleak.errors import ConfigError
from splitleak.progress import Silent
from splitleak.runs.truth import load_row_tokens, load_truth
from splitleak.stats.binomial import wilson_interval
from splitleak.stats.paired import battery_verdict, score_arms

RARE_MAX_COUNT = 1  # ours: a rare token occurs at most once among the probe's training rows


def codeword(token: int, dim: int, seed: int) -> np.ndarray:
    """Token ``token``'s unit codeword: a normalised Gaussian vector keyed by (seed, token)."""
    v = np.random.default_rng([int(seed), 0xC0DE, int(token)]).standard_normal(dim)
    return v / np.linalg.norm(v)


def frame_rotation(frame_id: int, dim: int, seed: int) -> np.ndarray:
    """The invariant mode's Haar rotation of one frame (the gauges' key derivation, its own channel)."""
    return haar_rotation(derive_master(seed, "dose", 0, "invariant-codeword", frame_id), dim)


def dosed_rows(traffic: LatentTraffic, real: dict[int, np.ndarray], coverage: float, seed: int) -> set[tuple[int, int]]:
    """The (frame id, row) of the real rows dosed at ``coverage``: a prefix of one seeded order."""
    if not 0.0 <= coverage <= 1.0:
        raise ConfigError(f"coverage must be in [0, 1], got {coverage}")
    rows = [(f.frame_id, int(r)) for f in traffic.frames for r in np.nonzero(real[f.frame_id])[0]]
    order = np.random.default_rng([int(seed), 0xD05E, len(rows)]).permutation(len(rows))
    return {rows[i] for i in order[: int(round(coverage * len(rows)))]}


def inject(
    traffic: LatentTraffic,
    tokens: dict[int, np.ndarray],
    real: dict[int, np.ndarray],
    *,
    mode: str,
    coverage: float,
    amplitude: float,
    channel: str = "activations",
    seed: int = 0,
) -> LatentTraffic:
    """A copy of ``traffic`` with the dose planted (the input is not changed)."""
    if mode not in MODES:
        raise ConfigError(f"unknown dose mode {mode!r}; use one of {', '.join(MODES)}")
    if channel not in CHANNELS:
        raise ConfigError(f"unknown dosed channel {channel!r}; use one of {', '.join(CHANNELS)}")
    if not 0.0 <= amplitude <= 1.0:
        raise ConfigError(f"amplitude must be in [0, 1], got {amplitude}")
    field = CHANNELS[channel]
    by_frame: dict[int, list[int]] = {}
    for fid, r in sorted(dosed_rows(traffic, real, coverage, seed)):
        by_frame.setdefault(fid, []).append(r)
    frames = []
    for f in traffic.frames:
        rows = by_frame.get(f.frame_id, [])
        if not rows:
            frames.append(f)
            continue
        z = getattr(f, field).clone()
        dim = z.shape[1]
        rot = frame_rotation(f.frame_id, dim, seed) if mode == "invariant" else np.eye(dim)
        for r in rows:
            c = torch.as_tensor(codeword(int(tokens[f.frame_id][r]), dim, seed) @ rot, dtype=z.dtype)
            norm = z[r].norm()
            unit = z[r] / (norm + 1e-30)
            mixed = np.sqrt(1.0 - amplitude**2) * unit + amplitude * c
            z[r] = norm * mixed / (mixed.norm() + 1e-30)
        frames.append(dataclasses.replace(f, **{field: z}))
    return LatentTraffic(traffic.phase, frames, traffic.real_rows)


def _rare_metric(arm_preds: Sequence[np.ndarray], labels: list[np.ndarray], rare: set[int], constant: int):
    mask = [np.isin(y, list(rare)) & (y >= 0) for y in labels]
    known = int(sum(m.sum() for m in mask))
    if not known:
        return {"rows": 0, "accuracy": None, "detected": None}
    right = int(sum((np.asarray(p)[m] == y[m]).sum() for p, y, m in zip(arm_preds, labels, mask)))
    const = int(sum((y[m] == constant).sum() for y, m in zip(labels, mask))) / known
    iv = wilson_interval(right, known)
    return {
        "rows": known, "accuracy": right / known, "low": iv.low, "high": iv.high, "constant": const,
        "detected": iv.low > const,
    }  # fmt: skip


def dose_ladder(
    run_dir,
    *,
    doses: Sequence[tuple[str, float, float]] = PAPER_DOSES,
    channel: str = "activations",
    battery: dict[str, Any] | None = None,
    seed: int = 0,
    n_boot: int = 2000,
    progress=None,
    thresholds: GateThresholds | None = None,
    truth_dir=None,
) -> dict[str, Any]:
    """Run the probe battery at every dose; returns the per-dose metrics and the onsets. The gate and α
    are ``thresholds``' (``splitleak.audit.gate.GateThresholds``; default: the shipped gate_002's),
    recorded in the output. ``truth_dir``: the folder of the client's record (default ``run_dir``; a
    server's capture holds none). Each dose's row keeps its best arm's per-frame paired differences
    (``frame_delta``, over ``frame_ids``)."""
    progress = progress or Silent()
    th = thresholds or shipped_thresholds()
    views = ("gradient",) if channel == "output-gradient" else ("real-rows",)
    params = {"views": views, "models": ("mlp", "graph"), "restarts": 1, **(battery or {})}
    # the instrument read with the record into which the leak was injected: the oracle threat model
    probe = ProbeBattery(**{**params, "shuffle": False, "control": False, "seed": seed, "threat": "oracle"})
    record = run_dir if truth_dir is None else truth_dir
    real, tokens = load_truth(record), load_row_tokens(record)
    train0, eval0 = load_latent_traffic(run_dir, "train"), load_latent_traffic(run_dir, "capture")
    train_tokens = np.concatenate([tokens[f.frame_id][real[f.frame_id]] for f in train0.frames])
    values, counts = np.unique(train_tokens, return_counts=True)
    rare = {int(v) for v, c in zip(values, counts) if c <= RARE_MAX_COUNT}
    labels = [np.where(real[f.frame_id], tokens[f.frame_id], -1) for f in eval0.frames]
    rows = []
    task = progress.start("dose ladder", len(doses))
    for mode, coverage, amplitude in doses:
        train, evaluation = (
            inject(t, tokens, real, mode=mode, coverage=coverage, amplitude=amplitude, channel=channel, seed=seed)
            for t in (train0, eval0)
        )
        arms = probe.run(train, evaluation, tokens, real)
        stats, extra = score_arms({a.name: a.predictions for a in arms}, labels, seed=seed, n_boot=n_boot)
        v = battery_verdict(stats, extra["weights"], extra["constant"]["accuracy"], alpha=th.alpha, gate=th.gate)
        best = next((a for a in arms if a.name == v.get("best_arm")), arms[0])
        delta = next(st.frame_delta for st in stats if st.name == best.name)
        rows.append(
            {
                "mode": mode,
                "coverage": coverage,
                "amplitude": amplitude,
                "token_top1": {k: v.get(k) for k in ("paired_effect", "paired_low", "paired_high", "verdict")},
                "gate": {"statistic": v.get("gate_statistic"), "breaks": v.get("breaks_gate")},
                "rare_token_top1": _rare_metric(best.predictions, labels, rare, extra["constant"]["token"]),
                "best_arm": v.get("best_arm"),
                "constant": extra["constant"],
                "frame_delta": [float(d) for d in delta],
            }
        )
        progress.advance(task)
    progress.finish(task)
    return {
        "channel": channel,
        "thresholds": th.as_dict(),
        "battery": probe.params(),
        "rare_tokens": {
            "definition": f"seen at most {RARE_MAX_COUNT} time(s) among the probe's training rows (ours)",
            "count": len(rare),
        },  # fmt: skip
        "frame_ids": [int(f.frame_id) for f in eval0.frames],
        "doses": rows,
        "onsets": onsets(rows),
        "not_measured": ["token_cross_entropy", "membership_auc"],
    }


def onsets(rows: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per metric and axis, the smallest dose at which the metric detects the leak (None: never)."""
    axes = {
        "coordinate coverage (amplitude 1)": lambda r: r["mode"] == "coordinate" and r["amplitude"] == 1.0,
        "coordinate amplitude (coverage 1)": lambda r: r["mode"] == "coordinate" and r["coverage"] == 1.0,
        "invariant coverage (amplitude 1)": lambda r: r["mode"] == "invariant",
    }
    detect = {
        "token_top1": lambda r: r["token_top1"]["verdict"] == "detected",
        "gate": lambda r: bool(r["gate"]["breaks"]),
        "rare_token_top1": lambda r: bool(r["rare_token_top1"]["detected"]),
    }
    out: dict[str, dict[str, float | None]] = {}
    for metric, hit in detect.items():
        out[metric] = {}
        for axis, on in axes.items():
            key = "amplitude" if "amplitude (" in axis else "coverage"
            pts = sorted((r[key], hit(r)) for r in rows if on(r))
            out[metric][axis] = next((x for x, h in pts if h), None) if pts else None
    return out
