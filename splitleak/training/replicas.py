"""Replica median (000 §4.5, 002): K independent copies of the server's layers.

Every copy receives the same activations (what the observer sees), computes its own loss, returns
its own gradient and trains on it; each starts from the pretrained weights plus a small seeded
perturbation, with its own seed. The client receives the coordinate-wise median of the K returned
gradients, which stays correct while fewer than half of the copies lie. A copy whose relative
deviation from the median, ||g_k − median|| / ||median||, exceeds ``threshold`` is flagged (002
used 0.02). Held-out utility uses the median of the copies' logits.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Callable

import torch

from splitleak.models import LoadedModel, SplitModel
from splitleak.training.roles import ServerRole
from splitleak.wire.defences import DefenceChain
from splitleak.wire.frames import Frame


def perturb_server(split: SplitModel, scale: float, seed: int, replica: int) -> None:
    """Add scale x std(p) x N(0, 1) to every server parameter, from a generator for (seed, replica)."""
    key = hashlib.sha256(f"replica|{seed}|{replica}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & ((1 << 63) - 1))
    with torch.no_grad():
        for p in split.trunk_parameters() + split.top_parameters():
            if p.numel() > 1:
                p.add_(scale * p.std() * torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device))


def make_replicas(split: SplitModel, k: int, scale: float, seed: int) -> list[SplitModel]:
    """K server copies: the first shares the run's model (its server layers), the others are deep
    copies; every copy's server layers get their own seeded perturbation."""
    spec = split.spec
    replicas = [split]
    for r in range(1, k):
        lm = split.lm
        model = copy.deepcopy(lm.model)
        replicas.append(SplitModel(LoadedModel(lm.name, model, lm.tokenizer, lm.precision, lm.source, dict(lm.info)),
                                   depth=spec.cut))
    for r, rep in enumerate(replicas):
        perturb_server(rep, scale, seed, r)
    return replicas


class ReplicaMedianServer:
    """K ServerRoles behind one handler; returns the coordinate-wise median gradient."""

    def __init__(self, replicas: list[SplitModel], chain: DefenceChain, lr: float, threshold: float = 0.02):
        self.replicas = replicas
        self.roles = [ServerRole(rep, DefenceChain([], chain.seed), lr) for rep in replicas]
        self.chain = chain
        self.threshold = threshold
        self.flag_log: list[dict] = []
        #: per replica, a function standing in for its handler (tests make one replica lie)
        self.handlers: list[Callable[[Frame], Frame]] = [role.handle for role in self.roles]

    def handle(self, frame: Frame) -> Frame:
        if frame.kind != "forward":
            raise ValueError("replica-median serves the plain split only")
        replies = [h(frame) for h in self.handlers]
        stack = torch.stack([r.tensor for r in replies])  # [K, docs, tokens, width]
        med = stack.median(dim=0).values
        denom = med.flatten().norm().clamp_min(torch.finfo(med.dtype).tiny)
        dev = [(float((s - med).flatten().norm() / denom)) for s in stack]
        flagged = [i for i, d in enumerate(dev) if d > self.threshold]
        self.flag_log.append({"step": frame.step, "phase": frame.phase, "deviation": dev, "flagged": flagged})
        losses = torch.tensor([r.meta.get("loss", [float("nan")]) for r in replies])
        g = self.chain.backward(med, frame.phase, frame.step, frame.doc_ids)
        return Frame("backward", frame.step, frame.doc_ids, g, frame.mask, frame.phase,
                     payload_bits=self.chain.payload_bits("backward", 8 * g.element_size()),
                     meta={"loss": losses.median(dim=0).values.tolist(), "flagged": flagged})

    @torch.no_grad()
    def median_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        outs = []
        for rep in self.replicas:
            ctx = rep.context(*hidden.shape[:2])
            outs.append(rep.head_logits(rep.trunk(hidden, ctx), ctx))
        return torch.stack(outs).median(dim=0).values
