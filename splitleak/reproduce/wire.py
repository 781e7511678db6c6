"""Claims about what a defence puts on the wire in every realization (003's vMF bounds, App. A.3; SAS's last-k
rule, App. B.1), read from each label-shielded run's own record of its output gradient before and after the
defences (``shielded/output_gradients.safetensors``: ``raw``, the gradient of the full loss, and ``sent``, what
crossed, over the capture frame's documents; the client's record, which no attack reads).

Per run, over every row (position) of every document:

- ``asnr_min``: the smallest ‖g‖ / ‖n‖ of a row (g its raw gradient, n = sent − g), over the rows whose raw
  gradient is not zero and that the defence changed;
- ``noise_ratio_max``: the largest ‖n‖ / ‖g‖ of such a row;
- ``zero_suffix_share``: the share of documents whose last row with a raw gradient was sent as zero, the
  detectable zero-gradient suffix that SAS's last-k rule prevents;
- ``vmf_cosine_z`` (a run of the vMF mechanism alone): how far the sent rows' mean cosine to their raw direction
  lies from vMF(κ)'s, A_d(κ) = I_{d/2}(κ) / I_{d/2-1}(κ) at the run's κ and width d, in standard errors of that
  mean over the rows. 003's metric-DP theorems (ε = κ per unit distance between directions) are about vMF(κ)
  draws around each row's direction; this reads whether the mechanism that ran draws them (the norm is released,
  as the theorems' scope says).

A claim of such a bound is ``kind: bound``: ours is the extreme over every row (or document) of every run of its
arm, judged against the paper's bound (``agreement``: ``qualitative``, its ``direction`` and ``threshold``,
inclusive). A bound over realizations is refuted by one realization and never proved by any number of them, so
an agreement says that none of the rows read broke it, and says how many were read.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import torch

from splitleak.errors import ConfigError, DataError
from splitleak.reproduce.claims import Claim

RECORD = "shielded/output_gradients.safetensors"
#: the slack of a bound's comparison (float rounding only)
EPS = 1e-9
#: metric -> (what it is, how runs combine: min or max)
WIRE_METRICS = {
    "asnr_min": ("the smallest per-row ASNR ‖g‖/‖n‖", min),
    "noise_ratio_max": ("the largest per-row ‖n‖/‖g‖", max),
    "zero_suffix_share": ("the share of documents sent with a zero-gradient suffix", max),
    "vmf_cosine_z": ("the sent directions' mean cosine from vMF(kappa)'s, in standard errors", max),
}


def wire_values(raw: torch.Tensor, sent: torch.Tensor) -> dict[str, Any]:
    """The run's values of ``WIRE_METRICS`` from its output gradients (documents x positions x width), with the
    rows and documents they were read over."""
    if raw.shape != sent.shape or raw.dim() != 3:
        raise DataError(
            f"the output gradients raw {tuple(raw.shape)} and sent {tuple(sent.shape)} are not two tensors of "
            "documents x positions x width; the run's record is damaged: train the run again"
        )
    g, r = raw.double(), sent.double()
    if not (torch.isfinite(g).all() and torch.isfinite(r).all()):
        raise DataError("the run's output gradients hold NaN or Inf; train the run again")
    gn, nn = g.norm(dim=-1), (r - g).norm(dim=-1)
    live = (gn > 0) & (nn > 0)
    ratio = gn[live] / nn[live]
    has = gn > 0  # rows that a supervised target reaches under the full loss
    suffix = []
    for d in range(g.shape[0]):
        rows = torch.nonzero(has[d]).flatten()
        if rows.numel():
            suffix.append(bool((r[d, rows[-1]] == 0).all()))
    return {
        "asnr_min": float(ratio.min()) if ratio.numel() else math.inf,
        "noise_ratio_max": float((1 / ratio).max()) if ratio.numel() else 0.0,
        "zero_suffix_share": sum(suffix) / len(suffix) if suffix else math.nan,
        "wire_rows": int(live.sum()),
        "wire_docs": len(suffix),
    }


def vmf_fit(raw: torch.Tensor, sent: torch.Tensor, kappa: float) -> dict[str, Any]:
    """How the sent directions of the rows with a raw gradient sit around their raw ones against vMF(``kappa``):
    the mean cosine, vMF's A_d(kappa), and their gap in standard errors of the mean (``vmf_cosine_z``)."""
    # lazy: scipy's Bessel functions, for the runs of the vMF mechanism only
    from scipy.special import ive

    g, r = raw.double().reshape(-1, raw.shape[-1]), sent.double().reshape(-1, raw.shape[-1])
    live = g.norm(dim=-1) > 0
    cos = torch.nn.functional.cosine_similarity(g[live], r[live], dim=-1).numpy()
    d = raw.shape[-1]
    expected = float(ive(d / 2, kappa) / ive(d / 2 - 1, kappa))
    if len(cos) < 2:
        return {"vmf_cosine_z": math.nan}
    se = float(cos.std(ddof=1)) / math.sqrt(len(cos))
    gap = abs(float(cos.mean()) - expected)
    z = gap / se if se > 0 else (0.0 if gap == 0 else math.inf)
    return {"vmf_cosine_z": z, "vmf_mean_cosine": float(cos.mean()), "vmf_expected_cosine": expected}


def _vmf_kappa(t: dict[str, Any]) -> float | None:
    """The run's kappa where its one defence is the vMF mechanism (None otherwise)."""
    # lazy: the defences (torch), for the runs' configurations only
    from splitleak.defences.vmf import VMFDirection

    config = json.loads(t["train_config"]) if isinstance(t.get("train_config"), str) else t.get("train_config") or {}
    chain = config.get("defences") or []
    if len(chain) != 1 or chain[0].get("name") != "vmf":
        return None
    return float(VMFDirection(**(chain[0].get("args") or {})).kappa)


def with_wire(train_rows: Sequence[dict[str, Any]], store: str | Path) -> list[dict[str, Any]]:
    """``train_rows`` (a store's), each label-shielded run's with its ``wire_values`` (read from the run folder the
    row names in ``store``); the others as they are."""
    # lazy: reading a run's recorded tensors verifies them against its journal (torch, safetensors)
    from splitleak.runs.journal import read_tensors

    out = []
    for t in train_rows:
        t = dict(t)
        folder = Path(store) / str(t.get("run_dir") or "")
        if t.get("run_dir") and (folder / RECORD).is_file():
            grads = read_tensors(folder, RECORD)
            t.update(wire_values(grads["raw"], grads["sent"]))
            kappa = _vmf_kappa(t)
            if kappa is not None:
                t.update(vmf_fit(grads["raw"], grads["sent"], kappa))
        out.append(t)
    return out


def extreme(metric: str, rows: Sequence[dict[str, Any]]) -> tuple[float, int, int, int] | str:
    """(the extreme of ``metric`` over ``rows``' runs, runs, rows, documents read), or why there is none."""
    read = [t for t in rows if t.get(metric) is not None and not math.isnan(float(t[metric]))]
    if not read:
        return f"no run of its arm records its output gradients ({RECORD}), which {metric} is read from"
    pick = WIRE_METRICS[metric][1]
    value = pick(float(t[metric]) for t in read)
    return value, len(read), sum(int(t["wire_rows"]) for t in read), sum(int(t["wire_docs"]) for t in read)


def bound_rule(claim: Claim, value: float, rows: int, docs: int, runs: int) -> tuple[str, str]:
    """A bound the paper proves for every realization: ours, the extreme over every row read, on its side
    (inclusive) agrees; one row past it disagrees."""
    a = claim.agreement
    if a.rule != "qualitative" or a.direction is None or a.threshold is None:
        raise ConfigError(f"claim {claim.id}: a bound is judged by its side of the paper's bound (rule: qualitative)")
    above = a.direction == "above"
    holds = value >= a.threshold - EPS if above else value <= a.threshold + EPS
    said = (
        f"ours: {WIRE_METRICS[claim.statistic.metric][0]} {value:.4g}, over {rows:,} rows of {docs} documents in "
        f"{runs} run(s); the bound: {'at least' if above else 'at most'} {a.threshold:g}"
    )
    held = (
        "within sampling error of vMF(kappa)" if claim.statistic.metric == "vmf_cosine_z" else "no row read breaks it"
    )
    return ("agrees", f"{said} ({held})") if holds else ("disagrees", said)
