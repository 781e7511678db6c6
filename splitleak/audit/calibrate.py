"""Injected-leak calibration of the instrument (Politis & Pappas (2026) §4).

A metric can certify that a channel does not leak only if it is shown to detect a leak planted on
purpose. ``calibrate`` plants a known token signal into a chosen share of the captured activation
rows (*coverage*) at a chosen strength (*amplitude*), runs one attack on the dosed frame, and
records for each metric where it first detects the leak.

The planted signal is representation-matched to the attacker (Politis & Pappas 2026, §5: "a positive control must be
representation-matched to the cell under test"): a dosed row becomes
``(1 − a)·row + a·ref`` where ``ref`` is the activation the attacker's own copy of the client layers
computes for the true document at that position. Rows are dosed in one seeded random order, so the
rows dosed at a coverage are a subset of those dosed at every larger coverage.

Metrics (each read as an effect against the zero-dose frame, with a document-clustered bootstrap
interval; *detected* when the interval's lower end is above zero):

- ``token_top1``: the attack's top-1 token accuracy;
- ``rare_token_top1``: the same on rare tokens only, those seen at most once in the attacker's
  calibration documents (a set fixed from the attacker's knowledge, not from the labels);
- ``token_cross_entropy``: mean −log p(true token) under a ridge read-out probe (activation →
  embedding ridge fit on the calibration documents, softmax of cosine similarities with a
  temperature chosen on held-out calibration documents, mixed with 1 % uniform); the effect is
  the drop in CE;
- ``membership_auc``: ROC AUC separating the run's training documents (members) from evaluation
  documents (non-members) by the probe's mean log-likelihood of each document. Both sets are
  recomputed through the run's trained client layers and dosed the same way, so the metric asks
  whether the frame reveals training membership; a token-identity leak should leave it flat
  (Politis & Pappas 2026, §4.1 found the same).

The gate column is Politis & Pappas 2026, Eq. (1) for the single token-top-1 arm: Wilson upper-95 minus the constant
baseline (the evaluation set's most frequent token); it breaks above the gate of the shipped gate_002 protocol (+1.0 pp)
unless the caller passes another (``splitleak.audit.gate``).
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from splitleak.attacks import load_knowledge, load_traffic, make_attack_config
from splitleak.attacks.core import make_attack
from splitleak.attacks.knowledge import Knowledge, Traffic
from splitleak.attacks.ridge import RidgeMap
from splitleak.audit.defaults import DEFAULT_COVERAGES
from splitleak.audit.gate import shipped_thresholds
from splitleak.audit.verdicts import constant_baseline
from splitleak.errors import ConfigError, IntegrityError, SplitleakError
from splitleak.files import read_json, validated
from splitleak.metrics import roc_auc
from splitleak.progress import Progress, Silent
from splitleak.runs.manifest import read_manifest
from splitleak.runs.truth import eval_token_ids, read_documents
from splitleak.stats import Interval, frame_weights, ratio_bootstrap_ci, wilson_upper
from splitleak.stats._checks import percentile_bounds

DEFAULT_AMPLITUDES = (1.0,)
METRICS = ("token_top1", "rare_token_top1", "token_cross_entropy", "membership_auc")
METRIC_TITLES = {
    "token_top1": "token top-1 (pp over zero dose)",
    "rare_token_top1": "rare-token top-1 (pp over zero dose)",
    "token_cross_entropy": "token cross-entropy drop (nats)",
    "membership_auc": "membership AUC change",
}
_TAUS = torch.logspace(-3, 0.5, 29, dtype=torch.float64)
_EPS = 0.01


# ------------------------------------------------------------------ the probe


class TokenProbe:
    """Ridge read-out: activation → distribution over the vocabulary, from the attacker's knowledge.

    ``p(v | h) = (1 − ε)·softmax_v(cos(W h, e_v) / τ) + ε / V`` with ε = 0.01, so that one confident
    miss costs at most log(V / ε) nats instead of growing without bound as τ shrinks. The ridge map is fitted on the first half of the
    calibration documents and τ chosen to minimise cross-entropy on the second half; the map is then
    refitted on all of them (τ kept)."""

    def fit(self, knowledge: Knowledge) -> "TokenProbe":
        client = knowledge.client
        ids = knowledge.calibration_ids()
        if ids.shape[0] < 2:
            raise ConfigError("the probe needs at least 2 calibration documents (pass --n-calib >= 2 when training)")
        x = client.activations(ids)
        emb = client.embedding
        half = ids.shape[0] // 2
        d = x.shape[-1]
        first = RidgeMap.fit(x[:half].reshape(-1, d), emb[ids[:half].reshape(-1).to(client.device)])
        self.embedding_ = emb
        cos = self._cosine(first(x[half:].reshape(-1, d))).double()
        truth = ids[half:].reshape(-1).to(cos.device)
        right = cos.gather(1, truth[:, None])[:, 0]
        best: tuple[float, float] | None = None  # (cross-entropy, tau)
        for tau in _TAUS:  # log-softmax at the true token, without writing the whole [rows, vocabulary] matrix
            ce = float(-self._mix(right / tau - torch.logsumexp(cos / tau, dim=-1)).mean())
            if best is None or ce < best[0]:
                best = (ce, float(tau))
        assert best is not None  # _TAUS is not empty
        self.tau_ = best[1]
        self.ridge_ = RidgeMap.fit(x.reshape(-1, d), emb[ids.reshape(-1).to(client.device)])
        return self

    def _mix(self, logp: torch.Tensor) -> torch.Tensor:
        v = self.embedding_.shape[0]
        floor = torch.full_like(logp, math.log(_EPS / v))
        return torch.logaddexp(logp + math.log1p(-_EPS), floor)

    def _cosine(self, est: torch.Tensor) -> torch.Tensor:
        e = torch.nn.functional.normalize(self.embedding_, dim=-1)
        return torch.nn.functional.normalize(est.to(e.dtype), dim=-1) @ e.T

    @torch.no_grad()
    def log_likelihood(self, activations: torch.Tensor, tokens: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
        """log p(true token) per position: activations [n, T, d], tokens [n, T] -> [n, T] (float64)."""
        n, T, d = activations.shape
        flat = activations.reshape(-1, d).to(self.embedding_.device, self.embedding_.dtype)
        tok = tokens.reshape(-1).to(self.embedding_.device)
        out = []
        for s in range(0, flat.shape[0], chunk):
            logits = self._cosine(self.ridge_(flat[s : s + chunk])).double() / self.tau_
            lp = logits.gather(1, tok[s : s + chunk, None])[:, 0] - torch.logsumexp(logits, dim=-1)
            out.append(self._mix(lp))
        return torch.cat(out).reshape(n, T).cpu()


# ------------------------------------------------------------------ injection


def dose_order(n_rows: int, seed: int) -> np.ndarray:
    """The seeded order in which rows are dosed; coverage c doses its first round(c · n_rows)."""
    return np.random.default_rng([int(seed), 0xD05E]).permutation(n_rows)


def inject_leak(
    activations: torch.Tensor, reference: torch.Tensor, coverage: float, amplitude: float, order: np.ndarray
) -> torch.Tensor:
    """Dose a frame: the first round(coverage · rows) rows of ``order`` (rows = documents × positions)
    become ``(1 − amplitude)·row + amplitude·reference``. Returns a new tensor."""
    if activations.shape != reference.shape:
        raise ConfigError(f"activations {tuple(activations.shape)} and reference {tuple(reference.shape)} differ")
    if not 0.0 <= coverage <= 1.0 or not 0.0 <= amplitude <= 1.0:
        raise ConfigError(f"coverage {coverage} and amplitude {amplitude} must lie in [0, 1]")
    n, T, d = activations.shape
    out = activations.reshape(n * T, d).clone()
    m = int(round(coverage * n * T))
    if m and amplitude:
        rows = torch.as_tensor(order[:m], dtype=torch.long)
        ref = reference.reshape(n * T, d).to(out.dtype)
        out[rows] = (1.0 - amplitude) * out[rows] + amplitude * ref[rows]
    return out.reshape(n, T, d)


def dosed_log_likelihood(
    probe: TokenProbe,
    undosed: torch.Tensor,
    frame: torch.Tensor,
    tokens: torch.Tensor,
    coverage: float,
    amplitude: float,
    order: np.ndarray,
) -> torch.Tensor:
    """``probe.log_likelihood(frame, tokens)`` for a frame dosed by ``inject_leak`` with these arguments,
    recomputed only at the dosed rows: the probe reads each row on its own, so every other row keeps
    ``undosed``, its log-likelihood in the undosed frame. A ladder of doses then costs the rows it doses,
    not a whole frame per dose."""
    n, T, d = frame.shape
    m = int(round(coverage * n * T)) if amplitude else 0
    out = undosed.clone().reshape(n * T)
    if m:
        rows = torch.as_tensor(order[:m], dtype=torch.long)
        out[rows] = probe.log_likelihood(frame.reshape(n * T, 1, d)[rows], tokens.reshape(n * T, 1)[rows])[:, 0]
    return out.reshape(n, T)


# ------------------------------------------------------------------ results


@dataclass
class Dose:
    coverage: float
    amplitude: float

    @property
    def dose(self) -> float:
        return self.coverage * self.amplitude

    def label(self) -> str:
        return f"{self.coverage:g} × {self.amplitude:g}"


@dataclass
class CalibrationResult:
    out: Path | None
    record: dict[str, Any]

    @property
    def onsets(self) -> dict[str, dict[str, float] | None]:
        return self.record["onsets"]


def _auc_weighted(scores_m: np.ndarray, scores_n: np.ndarray, wm: np.ndarray, wn: np.ndarray) -> np.ndarray:
    """Bootstrap replicates of the Mann–Whitney AUC with members/non-members reweighted by counts."""
    cmp = (scores_m[:, None] > scores_n[None, :]).astype(np.float64) + 0.5 * (scores_m[:, None] == scores_n[None, :])
    return np.einsum("bm,mn,bn->b", wm, cmp, wn) / (wm.sum(1) * wn.sum(1))


def _interval(reps: np.ndarray, estimate: float, alpha: float) -> Interval:
    low, high = percentile_bounds(reps, alpha)
    return Interval(float(estimate), low, high, int(reps.size), alpha)


def _iv(iv: Interval) -> dict[str, float]:
    return {"effect": iv.estimate, "low": iv.low, "high": iv.high}


def calibrate(
    run_dir: str | Path,
    attack: str,
    *,
    out: str | Path | None = None,
    coverages: Sequence[float] = DEFAULT_COVERAGES,
    amplitudes: Sequence[float] = DEFAULT_AMPLITUDES,
    client_copy: str = "public",
    k: int | None = None,
    budget: int | str | None = None,
    n_docs: int | None = None,
    seed: int = 0,
    n_boot: int = 2000,
    alpha: float | None = None,
    gate: float | None = None,
    force: bool = False,
    progress: Progress | None = None,
    knowledge: Knowledge | None = None,
    traffic: Traffic | None = None,
    trained: Knowledge | None = None,
) -> CalibrationResult:
    """Sweep the dose ladder (every coverage × every amplitude, plus zero dose) with one attack and
    write ``calibration.json`` to ``out``; ``splitleak.report.calibration.write_calibration_report``
    renders it (``calibration.md``, ``calibration.png`` / ``.svg``). ``knowledge``, ``traffic`` and
    ``trained`` (the trained copy, for the membership frames) may be passed by a caller that holds them.
    ``alpha`` and ``gate`` default to the shipped gate_002 protocol's (``splitleak.audit.gate``); the
    record names the protocol they came from."""
    th = shipped_thresholds()
    alpha = th.alpha if alpha is None else alpha
    gate = th.gate if gate is None else gate
    progress = progress or Silent()
    run_dir = Path(run_dir)
    out_path = Path(out) if out is not None else None
    if out_path is not None and out_path.exists() and any(out_path.iterdir()) and not force:
        raise SplitleakError(f"{out_path} already exists and is not empty; choose another --out or pass --force")
    acfg, att = _calibration_attack(attack, client_copy, seed, k, budget)
    doses = [Dose(0.0, 1.0)] + [Dose(float(c), float(a)) for a in amplitudes for c in coverages]
    for d in doses:
        if not (0.0 <= d.coverage <= 1.0 and 0.0 < d.amplitude <= 1.0):
            raise ConfigError(f"dose {d.label()}: coverages must lie in [0, 1] and amplitudes in (0, 1]")
    manifest = read_manifest(run_dir)
    knowledge = knowledge or load_knowledge(run_dir, client_copy)
    traffic = traffic or load_traffic(run_dir, with_gradients=att.uses_gradients)
    if n_docs is not None:
        if n_docs < 2:
            raise ConfigError("--n-docs must be at least 2")
        traffic = traffic.subset(range(min(n_docs, len(traffic))))
    f = _frames(run_dir, att, knowledge, traffic, trained, client_copy, seed)
    base = constant_baseline(f.truth)
    rows, per_dose = _read_doses(
        f, att, traffic, doses, base.rate, alpha, f"calibration doses ({acfg.attack})", progress
    )
    _dose_effects(f, rows, per_dose, n_boot, seed, alpha, gate)
    gate_hits = sorted((r for r in rows if r["gate_breaks"]), key=lambda r: r["dose"])
    n, T = f.truth.shape
    record = {
        "run": {"dir": str(run_dir), "config_hash": manifest["config_hash"], "cut": manifest["split"]["cut"]},
        "attack": acfg.model_dump(mode="json"),
        "attack_params": att.params(),
        "documents": n,
        "tokens": n * T,
        "rare_tokens": int(f.rare.sum()),
        "members": f.n_mem,
        "constant_baseline": {"token_id": base.token_id, "rate": base.rate},
        "probe_temperature": f.probe.tau_,
        "n_boot": n_boot,
        "alpha": alpha,
        "gate": gate,
        "gate_protocol": {"protocol": th.protocol, "protocol_hash": th.protocol_hash}
        if (alpha, gate) == (th.alpha, th.gate)
        else None,
        "seed": seed,
        "doses": rows,
        "onsets": _onsets(rows),
        "gate_onset": None
        if not gate_hits
        else {"coverage": gate_hits[0]["coverage"], "amplitude": gate_hits[0]["amplitude"]},
        "zero_dose_detects": [m for m in METRICS if rows[0]["effects"][m] and rows[0]["effects"][m]["detected"]],
    }
    result = CalibrationResult(out_path, record)
    if out_path is not None:
        write_calibration(out_path, record, force=force)
    return result


def _calibration_attack(attack: str, client_copy: str, seed: int, k: int | None, budget: int | str | None):
    """The attack the calibration reads each dosed frame with (a token attack), and its configuration."""
    params: dict[str, Any] = {}
    if k is not None:
        params["k"] = k
    if budget is not None:
        params["budget"] = budget
    acfg = make_attack_config(attack=attack, client_copy=client_copy, attack_seed=seed, **params)
    att = make_attack(acfg.attack, **acfg.attack_params())
    if attack == "property":
        raise ConfigError(
            "calibration measures token metrics; the property attack outputs no tokens. "
            "Calibrate a token attack (vmi, activation, joint, sipit, ...)"
        )
    return acfg, att


@dataclass
class _Frames:
    """What every dose reads: the truth, the reference the leak is planted from, the rare tokens, the
    fitted probe, the membership frames (members and non-members through the trained client layers) with
    their references, and the dosing orders."""

    truth: np.ndarray
    truth_t: torch.Tensor
    reference: torch.Tensor
    probe: TokenProbe
    rare: np.ndarray
    n_mem: int
    mem_ids: torch.Tensor
    mem_frames: torch.Tensor
    non_frames: torch.Tensor
    mem_ref: torch.Tensor
    non_ref: torch.Tensor
    same_frames: bool  # the non-member frame is the captured frame (undefended) and needs no dosing of its own
    order: np.ndarray
    order_mem: np.ndarray


def _frames(run_dir: Path, att, knowledge: Knowledge, traffic: Traffic, trained: Knowledge | None, client_copy: str, seed: int) -> _Frames:  # fmt: skip
    """Fit the attack and the probe, and compute what every dose reads (``_Frames``)."""
    truth = eval_token_ids(run_dir, traffic.doc_ids)
    truth_t = torch.as_tensor(truth)
    reference = knowledge.client.activations(truth_t).to(traffic.activations.dtype).cpu()
    att.fit(knowledge)
    probe = TokenProbe().fit(knowledge)
    # rare tokens: seen at most once in the attacker's calibration documents
    cal_counts = np.bincount(knowledge.calibration_ids().numpy().reshape(-1), minlength=knowledge.client.vocab_size)
    rare = cal_counts[truth] <= 1
    # membership frames: training documents (members) and evaluation documents (non-members), both
    # through the run's trained client layers
    docs = read_documents(run_dir)
    if trained is None:
        trained = load_knowledge(run_dir, "trained") if client_copy != "trained" else knowledge
    elif trained.copy != "trained":
        raise ConfigError(
            f"calibrate: trained= takes the trained copy of the client layers, got the {trained.copy} copy"
        )
    n_mem = min(len(docs.train), len(traffic))
    mem_ids = torch.tensor([list(d.token_ids) for d in docs.train[:n_mem]], dtype=torch.long)
    mem_frames = trained.client.activations(mem_ids).cpu()
    non_frames = trained.client.activations(truth_t).cpu()
    mem_ref = knowledge.client.activations(mem_ids).cpu().to(mem_frames.dtype)
    non_ref = reference.to(non_frames.dtype)
    del trained
    same_frames = torch.equal(non_frames, traffic.activations.to(non_frames.dtype)) and torch.equal(
        non_ref, reference.to(non_ref.dtype)
    )
    n, T = truth.shape
    return _Frames(
        truth, truth_t, reference, probe, rare, n_mem, mem_ids, mem_frames, non_frames, mem_ref, non_ref,
        same_frames, dose_order(n * T, seed), dose_order(n_mem * T, seed + 1),
    )  # fmt: skip


def _read_doses(
    f: _Frames, att, traffic: Traffic, doses: list[Dose], base_rate: float, alpha: float, what: str, progress: Progress
) -> tuple[list[dict[str, Any]], list[dict[str, np.ndarray]]]:
    """Each dose planted and read: its row of readings, and its per-document sums for the bootstrap."""
    n, T = f.truth.shape
    rows: list[dict[str, Any]] = []
    per_dose: list[dict[str, np.ndarray]] = []
    ll0 = f.probe.log_likelihood(traffic.activations, f.truth_t)  # each frame's rows before any dose
    ll0_mem = f.probe.log_likelihood(f.mem_frames, f.mem_ids)
    ll0_non = ll0 if f.same_frames else f.probe.log_likelihood(f.non_frames, f.truth_t)
    task = progress.start(what, len(doses))
    for d in doses:
        frame = inject_leak(traffic.activations, f.reference, d.coverage, d.amplitude, f.order)
        dosed = traffic.replace(activations=frame)
        tokens = att.reconstruct(dosed).tokens
        assert tokens is not None  # a token attack: the property attack was refused above
        right = tokens.numpy() == f.truth
        ll = dosed_log_likelihood(f.probe, ll0, frame, f.truth_t, d.coverage, d.amplitude, f.order).numpy()
        mem_dosed = inject_leak(f.mem_frames, f.mem_ref, d.coverage, d.amplitude, f.order_mem)
        ll_mem = dosed_log_likelihood(
            f.probe, ll0_mem, mem_dosed, f.mem_ids, d.coverage, d.amplitude, f.order_mem
        ).numpy()
        # undefended, the captured frame is the trained layers' activations of the same documents, dosed in
        # the same order: the non-member frame is the frame already read
        ll_non = ll if f.same_frames else _non_member_ll(f, ll0_non, d)
        per_dose.append(
            {
                "correct": right.sum(1).astype(float),
                "rare_correct": (right & f.rare).sum(1).astype(float),
                "ce": -ll.mean(1),
                "mem": ll_mem.mean(1),
                "non": ll_non.mean(1),
            }
        )
        labels = np.r_[np.ones(f.n_mem), np.zeros(n)]
        auc = roc_auc(np.r_[per_dose[-1]["mem"], per_dose[-1]["non"]], labels)
        rows.append(
            {
                "coverage": d.coverage,
                "amplitude": d.amplitude,
                "dose": d.dose,
                "dosed_rows": int(round(d.coverage * n * T)) if d.amplitude else 0,
                "token_top1": float(right.mean()),
                "rare_token_top1": float((right & f.rare).sum() / max(1, f.rare.sum())),
                "token_cross_entropy": float(-ll.mean()),
                "membership_auc": float(auc),
                "gate_G": wilson_upper(int(right.sum()), int(right.size), alpha) - base_rate,
            }
        )
        progress.advance(task)
    progress.finish(task)
    return rows, per_dose


def _non_member_ll(f: _Frames, ll0_non: torch.Tensor, d: Dose) -> np.ndarray:
    """The probe's log-likelihood of the dosed non-member frame (evaluation documents through the trained
    client layers), where it is not the captured frame."""
    dosed = inject_leak(f.non_frames, f.non_ref, d.coverage, d.amplitude, f.order)
    return dosed_log_likelihood(f.probe, ll0_non, dosed, f.truth_t, d.coverage, d.amplitude, f.order).numpy()


def _dose_effects(
    f: _Frames, rows: list[dict[str, Any]], per_dose: list[dict[str, np.ndarray]], n_boot: int, seed: int,
    alpha: float, gate: float,
) -> None:  # fmt: skip
    """Each dose's effects against zero dose (documents resampled, one weight matrix for every dose and
    metric), and whether its gate statistic breaks ``gate``; written into ``rows``."""
    n, T = f.truth.shape
    w = frame_weights(n, n_boot, seed)
    wm = frame_weights(f.n_mem, n_boot, seed + 1)
    counted = np.full(n, float(T))
    rare_counted = f.rare.sum(1).astype(float)
    z = per_dose[0]
    for row, pd in zip(rows, per_dose):
        effects = {
            "token_top1": ratio_bootstrap_ci(
                np.stack([pd["correct"], z["correct"]]), np.stack([counted, counted]), alpha=alpha, weights=w
            ),
            "rare_token_top1": (
                ratio_bootstrap_ci(
                    np.stack([pd["rare_correct"], z["rare_correct"]]),
                    np.stack([rare_counted, rare_counted]),
                    alpha=alpha,
                    weights=w,
                )
                if rare_counted.sum() > 0
                else None
            ),
            "token_cross_entropy": _interval(w @ (z["ce"] - pd["ce"]) / n, float(np.mean(z["ce"] - pd["ce"])), alpha),
        }
        a_d = _auc_weighted(pd["mem"], pd["non"], wm, w)
        a_0 = _auc_weighted(z["mem"], z["non"], wm, w)
        effects["membership_auc"] = _interval(a_d - a_0, row["membership_auc"] - rows[0]["membership_auc"], alpha)
        row["effects"] = {}
        for m in METRICS:
            iv = effects[m]
            row["effects"][m] = None if iv is None else {**_iv(iv), "detected": bool(iv.low > 0)}
        row["gate_breaks"] = bool(row["gate_G"] > gate)


def _onsets(rows: list[dict[str, Any]]) -> dict[str, dict[str, float] | None]:
    """Per metric, the smallest dose whose effect it detects (None: none)."""
    onsets: dict[str, dict[str, float] | None] = {}
    for m in METRICS:
        hit = [r for r in rows[1:] if r["effects"][m] is not None and r["effects"][m]["detected"]]
        hit.sort(key=lambda r: (r["dose"], r["coverage"]))
        onsets[m] = (
            None
            if not hit
            else {"coverage": hit[0]["coverage"], "amplitude": hit[0]["amplitude"], "dose": hit[0]["dose"]}
        )
    return onsets


# ------------------------------------------------------------------ output


def write_calibration(out: Path, record: dict[str, Any], force: bool = False) -> None:
    if out.exists() and force:
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".calibration.json.tmp"
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True, default=_num) + "\n")
    tmp.replace(out / "calibration.json")


def _num(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o) if math.isfinite(float(o)) else None
    raise TypeError(type(o).__name__)


class _Effect(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)
    effect: float
    low: float
    high: float
    detected: bool


class _Dose(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)
    coverage: float = Field(ge=0, le=1)
    amplitude: float = Field(ge=0)
    dose: float
    token_top1: float = Field(ge=0, le=1)
    rare_token_top1: float = Field(ge=0, le=1)
    token_cross_entropy: float
    membership_auc: float = Field(ge=0, le=1)
    gate_G: float
    gate_breaks: bool
    effects: dict[str, _Effect | None]


class _Onset(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)
    coverage: float
    amplitude: float


class _CalRun(BaseModel):
    model_config = ConfigDict(extra="allow")
    dir: str
    config_hash: str
    cut: int


class CalibrationRecord(BaseModel):
    """What the calibration report reads from ``calibration.json``; the rest is free."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)
    run: _CalRun
    attack: dict[str, Any]
    documents: int = Field(ge=1)
    tokens: int = Field(ge=1)
    rare_tokens: int = Field(ge=0)
    members: int = Field(ge=0)
    constant_baseline: dict[str, float]
    doses: list[_Dose] = Field(min_length=1)
    onsets: dict[str, _Onset | None]
    #: the gate ``gate_breaks`` was read against (absent in records written before it was recorded)
    gate: float | None = None


def read_calibration(path: str | Path) -> dict[str, Any]:
    """The record of ``splitleak calibrate`` (a folder holding ``calibration.json``, or the file),
    checked: valid JSON with the fields the report reads, of their types, every metric's effect and
    onset present; else an IntegrityError in one line naming the file and the fix."""
    p = Path(path)
    p = p / "calibration.json" if p.is_dir() else p
    if not p.exists():
        raise SplitleakError(f"{p} does not exist; run `splitleak calibrate RUN_DIR --attack NAME` first")
    fix = "rerun `splitleak calibrate` to write it again (with --force over the folder)"
    data = read_json(p, "calibration record", fix)
    rec = validated(CalibrationRecord, data, p, fix)
    missing = [m for m in METRICS if m not in rec.onsets] + [
        f"doses[{i}].effects.{m}" for i, d in enumerate(rec.doses) for m in METRICS if m not in d.effects
    ]
    if missing or "attack" not in rec.attack or "rate" not in rec.constant_baseline:
        what = ", ".join(missing[:3]) if missing else "attack.attack or constant_baseline.rate"
        raise IntegrityError(f"{p}: {what} missing; {fix}")
    return data
