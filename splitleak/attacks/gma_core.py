"""The optimisation GMA-SL's readers share (``gma``, ``gma_candidates``, ``gma_aware``): the distance between
gradients, the stop on the labels, and Adam on the soft labels' logits through a kept vector-Jacobian product."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from splitleak.errors import ConfigError
from splitleak.runtime import fused_optimizer


def gradient_distance(g_hat: torch.Tensor, g_obs: torch.Tensor, distance: str, tag_alpha: float) -> torch.Tensor:
    """Per-document distance between [m, T, H] gradients, as [m] (float32)."""
    a = g_hat.float().flatten(1)
    b = g_obs.float().flatten(1)
    if distance == "cos":
        dot = (a * b).sum(1)
        norms = a.norm(dim=1) * b.norm(dim=1)
        return 1.0 - dot / norms.clamp_min(1e-30)
    diff = a - b
    l2 = diff.pow(2).sum(1)
    if distance == "l2":
        return l2
    l1 = diff.abs().sum(1)
    if distance == "l1":
        return l1
    return l2 + tag_alpha * l1  # tag


def check_label_patience(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name}: label_patience must be an integer >= 0 (0: off); got {value!r}")
    return value


class LabelWatch:
    """The stopping rule on the labels: a chunk has settled once the argmax of its Z has not changed for
    ``patience`` steps in a row (0: never, the rule is off)."""

    def __init__(self, patience: int):
        self.patience, self.unchanged = check_label_patience(patience, "GMA-SL"), 0
        self.last: torch.Tensor | None = None

    def settled(self, z: torch.Tensor) -> bool:
        """Called once per step with the chunk's Z before the step."""
        labels = z.detach().argmax(-1)
        same = self.last is not None and torch.equal(labels, self.last)
        self.unchanged = self.unchanged + 1 if same else 0
        self.last = labels
        return self.patience > 0 and self.unchanged >= self.patience


@dataclass(frozen=True)
class Rules:
    """How a chunk's soft labels are matched: the distance (and TAG's weight), Adam's rate, and the stopping rules
    (at most ``steps``; relative improvement below ``tol`` over ``patience`` steps; labels held ``label_patience``
    steps, 0: off)."""

    distance: str
    tag_alpha: float
    steps: int
    lr: float
    tol: float
    patience: int
    label_patience: int

    def distance_of(self, g_hat: torch.Tensor, g_obs: torch.Tensor) -> torch.Tensor:
        return gradient_distance(g_hat, g_obs, self.distance, self.tag_alpha)


def optimise_soft_labels(
    out: torch.Tensor,
    h: torch.Tensor,
    pull: Callable[[torch.Tensor], torch.Tensor],
    z0: torch.Tensor,
    g_obs: torch.Tensor,
    active: torch.Tensor,
    rules: Rules,
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Adam on the soft labels' logits Z (from ``z0``) until a stopping rule holds: each step the gradient the proxy
    returns for them is the vector-Jacobian product of ``out`` (a function of ``h`` in the kept graph) with
    ``pull(softmax(Z))``, matched to ``g_obs`` per document. Returns (steps taken, final per-document distance,
    final Z)."""
    g_obs = g_obs.detach().to(h.device)
    z = z0.to(h.device).clone().requires_grad_(True)
    opt = fused_optimizer(torch.optim.Adam, [z], lr=rules.lr)
    weight = active.to(h.device, torch.float32)
    watch = LabelWatch(rules.label_patience)
    if rules.distance == "cos":
        scale = 1.0
    else:
        ref = rules.distance_of(torch.zeros_like(g_obs), g_obs)
        scale = float((ref * weight).sum()) or 1.0
    history: list[float] = []
    t = 0
    while True:
        q = torch.softmax(z, dim=-1)
        (g_hat,) = torch.autograd.grad(out, h, grad_outputs=pull(q), create_graph=True, retain_graph=True)
        per_doc = rules.distance_of(g_hat, g_obs)
        objective = (per_doc * weight).sum() / scale
        value = float(objective.detach())
        history.append(value)
        if t >= rules.steps or not bool(active.any()):
            break
        if watch.settled(z):
            break
        if t >= rules.patience:
            before = history[-1 - rules.patience]
            if before - value <= rules.tol * abs(before):
                break
        (gz,) = torch.autograd.grad(objective, z)
        opt.zero_grad(set_to_none=True)
        z.grad = gz
        opt.step()
        t += 1
    return t, per_doc.detach().cpu(), z.detach()
