"""Decoy partition detection on the decoy system's latent frames (Politis & Pappas 2026, §5).

The client truncates its loss to the real rows, so a decoy row's output gradient is exactly zero
when that wire crosses open: ``SupportPartition(rule="support")`` calls a row real iff its output
gradient is non-zero — the paper's exact partition (4,096 / 4,096 frames, agreement 1.000). Under
the fix (per-row clip and noise on the output gradient) every row is non-zero and the same rule
calls all rows real (agreement = real rows / frame rows, 32/80 = 0.400).

What the paper did not test, here as further rules, all scored by their ROC AUC over rows and by
a hard partition that calls the T highest-scoring rows of each frame real (T, the rows of one
document, is known to the server from the handshake's frame sizes):

- ``norm``: the output gradient's row norm alone (no training);
- ``classifier``: logistic regression on gauge-invariant row features of all four wires (log norms
  of the forward row, the return row, the output gradient and the input gradient; the cosines
  between the return row and its output gradient and between the forward row and its input
  gradient; the forward row's Gram statistics within its frame), fitted on *shadow frames*: frames
  the attacker makes itself by running the public mechanism on its own documents with its own draws,
  labelled by its own record (``splitleak.attacks.shadow``). It never sees the victim's partition.

An attack reads the frames as the server holds them (``LatentTraffic``) and what its threat model
grants: the run's public latent arguments, the frames of earlier steps, its own shadow frames. The
client's own record of real rows is read by the scorer alone (``splitleak.metrics.partition``); no ``fit``
takes it. Every
partition attack has the shape of ``LatentPartition``; the attacks built for the decoy mix and the
gauges (``decoy-history``, ``gauge-key-search``) live in their own files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterable

import numpy as np
import torch
from pydantic import NonNegativeFloat
from scipy.optimize import minimize

from splitleak.errors import ConfigError, IntegrityError
from splitleak.runs.chain import read_wire_whole
from splitleak.runs.manifest import read_manifest
from splitleak.runs.wire import read_wire
from splitleak.training.config import LatentConfig
from splitleak.wire.frames import Frame

RULES = ("support", "norm", "classifier")
KINDS = {"forward": "x", "forward-return": "ret", "backward-top": "g_out", "backward": "g_in"}


@dataclass
class LatentFrame:
    """One frame as the server holds it: the four wires' rows [n, D], the frame's id and the step its
    header names (-1 in the capture pass)."""

    frame_id: int
    x: torch.Tensor
    ret: torch.Tensor
    g_out: torch.Tensor
    g_in: torch.Tensor
    step: int = -1


@dataclass
class LatentTraffic:
    phase: str
    frames: list[LatentFrame]
    real_rows: int  # T: the rows of one document (known to the server from the frame sizes)

    def __len__(self) -> int:
        return len(self.frames)


def load_latent_traffic(run_dir: str | Path, phase: str, whole: bool = True) -> LatentTraffic:
    """The frames of one phase of a latent run's capture, joined per frame id across the four wires; with
    ``whole``, a resumed run's training phase with the frames of the runs it continues."""
    manifest = read_manifest(run_dir)
    if manifest.get("mode") != "latent" and (manifest.get("config") or {}).get("latent") is None:
        raise ConfigError(f"{run_dir} is not a latent-mode run; partition attacks read the decoy system's frames")
    return latent_traffic(
        phase,
        [rec.frame for rec in (read_wire_whole(run_dir, phase) if whole else read_wire(run_dir, phase))],
        int(manifest["config"]["doc_len"]),
        where=run_dir,
    )


def latent_traffic(phase: str, crossed: Iterable[Frame], real_rows: int, where: Any = "the traffic") -> LatentTraffic:
    """The frames that crossed in one phase (every wire's), joined per frame id across the four wires."""
    parts: dict[int, dict[str, torch.Tensor]] = {}
    steps: dict[int, int] = {}
    for frame in crossed:
        name = KINDS[frame.kind]
        for b, fid in enumerate(frame.doc_ids):
            parts.setdefault(int(fid), {})[name] = frame.tensor[b].detach().double()
            steps[int(fid)] = int(frame.step)
    frames = []
    for fid in sorted(parts):
        p = parts[fid]
        missing = sorted(set(KINDS.values()) - set(p))
        if missing:
            raise IntegrityError(f"frame {fid} of {where} ({phase}) lacks the wire(s) {', '.join(missing)}")
        frames.append(LatentFrame(fid, p["x"], p["ret"], p["g_out"], p["g_in"], steps[fid]))
    return LatentTraffic(phase, frames, int(real_rows))


def row_features(f: LatentFrame) -> np.ndarray:
    """Gauge-invariant features of each row of a frame [n, 10]."""
    eps = 1e-30

    def lognorm(t: torch.Tensor) -> torch.Tensor:
        return torch.log(t.norm(dim=-1) + eps)

    def cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1) + eps)

    u = f.x / (f.x.norm(dim=-1, keepdim=True) + eps)
    g = u @ u.T
    n = len(g)
    off = g.masked_fill(torch.eye(n, dtype=torch.bool), 0.0)
    feats = [
        lognorm(f.x),
        lognorm(f.ret),
        lognorm(f.g_out),
        lognorm(f.g_in),
        cos(f.ret, f.g_out),
        cos(f.x, f.g_in),
        off.sum(-1) / max(1, n - 1),
        (off**2).sum(-1) / max(1, n - 1),
        off.abs().amax(-1),
        torch.full((n,), float(n)),
    ]
    return torch.stack(feats, -1).numpy()


#: latent settings a run made before they existed used, and what they mean there (the manifest lacks them)
LEGACY_LATENT = {"decoy_release": "verbatim", "gauge_entropy": "derived"}


def public_latent(public: dict[str, Any] | None):
    """The run's public latent configuration (the manifest's ``config.latent``, which the server holds
    from the handshake) as a ``LatentConfig``; settings a run predates take what that run did."""
    if public is None:
        raise ConfigError(
            "this attack reads the latent mode's public arguments: pass the run manifest's config.latent as public"
        )
    return LatentConfig(**{**LEGACY_LATENT, **public})


def top_rows(scores: np.ndarray, real_rows: int) -> np.ndarray:
    """The hard partition: the ``real_rows`` highest-scoring rows of a frame called real."""
    pred = np.zeros(len(scores), dtype=bool)
    pred[np.argsort(-scores, kind="stable")[:real_rows]] = True
    return pred


class LatentPartition:
    """scikit-learn's shape for partition attacks on latent frames: parameters in ``__init__``;
    ``fit(history, public, shadow)`` takes what the attacker holds (the training-phase frames when
    ``reads_history``, the run's public latent arguments, and its own shadow frames when ``needs_shadow``);
    ``partition(traffic)`` returns per frame a score per row (higher: more likely real) and the hard
    partition; ``report()`` what the attack found on the traffic alone. No argument carries the victim's
    record of real rows: the scorer alone reads it."""

    name: ClassVar[str]
    uses_gradients: ClassVar[bool] = False

    def needs_shadow(self) -> bool:
        """Learns from labelled frames the attacker makes itself (``splitleak.attacks.shadow``)."""
        return False

    def reads_history(self) -> bool:
        """Reads the training-phase frames, what the server saw before the frames it scores."""
        return False

    def fit(self, history=None, public=None, shadow=None):
        return self

    def partition(self, traffic: LatentTraffic) -> list[tuple[np.ndarray, np.ndarray]]:
        raise NotImplementedError

    def report(self) -> dict[str, Any]:
        return {}


class PartitionAttack(LatentPartition):
    """The support, norm and classifier rules (see the module's docstring)."""

    name: ClassVar[str] = "support-partition"
    uses_gradients: ClassVar[bool] = True

    def __init__(self, rule: str = "support", tol: NonNegativeFloat = 0.0, seed: int = 0):
        if rule not in RULES:
            raise ConfigError(f"unknown partition rule {rule!r}; use one of {', '.join(RULES)}")
        self.rule, self.tol, self.seed = rule, tol, seed

    def params(self) -> dict[str, Any]:
        return {"rule": self.rule, "tol": self.tol, "seed": self.seed}

    def channels_read(self) -> tuple[str, ...]:
        if self.rule == "classifier":
            return ("activations", "trunk-output", "output-gradient", "gradient")
        return ("output-gradient",)

    def needs_shadow(self) -> bool:
        return self.rule == "classifier"

    def fit(self, history=None, public=None, shadow=None):
        if self.rule != "classifier":
            return self
        if shadow is None or not shadow.frames:
            raise ConfigError(
                "the classifier rule learns from the attacker's own labelled frames: pass its shadow frames "
                "(splitleak.attacks.shadow.make_shadow)"
            )
        x = np.concatenate([row_features(f) for f in shadow.frames])
        y = np.concatenate([shadow.real[f.frame_id] for f in shadow.frames]).astype(np.float64)
        if not y.sum():
            raise ConfigError("the shadow frames hold no real row; the classifier has nothing to learn")
        self.mean_, self.std_ = x.mean(0), x.std(0) + 1e-12
        # no decoy in the attacker's own frames (the public arguments send none): every row is real, as it knows
        self.w_ = None if y.all() else _logistic((x - self.mean_) / self.std_, y, seed=self.seed)
        return self

    def scores(self, f: LatentFrame) -> np.ndarray:
        if self.rule == "classifier":
            if not hasattr(self, "w_"):
                raise ConfigError(
                    "call fit(shadow=the attacker's shadow frames) before partition with the classifier rule"
                )
            if self.w_ is None:
                return np.ones(len(f.x))
            z = (row_features(f) - self.mean_) / self.std_
            return z @ self.w_[:-1] + self.w_[-1]
        return f.g_out.norm(dim=-1).numpy()

    def partition(self, traffic: LatentTraffic) -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        for f in traffic.frames:
            s = self.scores(f)
            out.append((s, s > self.tol if self.rule == "support" else top_rows(s, traffic.real_rows)))
        return out


def _logistic(x: np.ndarray, y: np.ndarray, seed: int, l2: float = 1e-3) -> np.ndarray:
    """L2-regularised logistic regression by L-BFGS (scipy); weights then bias."""
    xb = np.concatenate([x, np.ones((len(x), 1))], axis=1)

    def loss(w: np.ndarray) -> tuple[float, np.ndarray]:
        z = xb @ w
        p = 1.0 / (1.0 + np.exp(-z))
        ll = np.logaddexp(0.0, z) - y * z
        reg = 0.5 * l2 * (w[:-1] ** 2).sum()
        grad = xb.T @ (p - y) / len(y)
        grad[:-1] += l2 * w[:-1]
        return float(ll.mean() + reg), grad

    w0 = np.random.default_rng(seed).normal(scale=1e-3, size=xb.shape[1])
    return minimize(loss, w0, jac=True, method="L-BFGS-B").x
