"""Replica median (What Gradients Add §4.5; Politis & Pappas 2026): K independent copies of the server's layers, each its own server.

Every copy receives the same activations over its own link (``replica-K``: what the observer at
that copy sees), computes its own loss, returns its own gradient (after the backward defences,
applied by each copy) and trains on it; each starts from the pretrained weights plus a small seeded
perturbation, with its own seed. The client takes the coordinate-wise median of the K returned
gradients, which stays correct while fewer than half of the copies lie; the median is computed on
the client and never crosses. A copy whose relative deviation from the median,
||g_k − median|| / ||median||, exceeds ``threshold`` is flagged (Politis & Pappas 2026 used 0.02). Held-out utility
uses the median of the copies' logits.
"""

from __future__ import annotations

import copy
import hashlib

import torch

from splitleak.defences import DefenceChain
from splitleak.models import LoadedModel, SplitModel
from splitleak.training.roles import ServerRole
from splitleak.wire.channel import InProcessChannel, Tap
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
    for _ in range(1, k):
        lm = split.lm
        model = copy.deepcopy(lm.model)
        replicas.append(
            SplitModel(
                LoadedModel(lm.name, model, lm.tokenizer, lm.precision, lm.source, dict(lm.info)), depth=spec.cut
            )
        )
    for r, rep in enumerate(replicas):
        perturb_server(rep, scale, seed, r)
    return replicas


class ReplicaMedianLink:
    """The client's connection to K server copies: one channel per copy (``replica-K``), the same
    forward frame on each, the coordinate-wise median of the K replies. Use it as the client's
    channel; ``channels`` are the per-copy links (each with its taps and ledger)."""

    def __init__(
        self,
        replicas: list[SplitModel],
        chain: DefenceChain,
        lr: float,
        threshold: float = 0.02,
        taps: list[Tap] | None = None,
    ):
        self.replicas = replicas
        self.roles = [ServerRole(rep, chain, lr) for rep in replicas]
        self.channels = [InProcessChannel(role.handle, taps, link=f"replica-{r}") for r, role in enumerate(self.roles)]
        self.threshold = threshold
        self.flag_log: list[dict] = []
        self.last_losses: list[float] | None = None

    def request(self, frame: Frame) -> Frame:
        if frame.kind != "forward":
            raise ValueError("replica-median serves the plain split only")
        replies = [ch.request(frame) for ch in self.channels]
        stack = torch.stack([r.tensor for r in replies])  # [K, docs, tokens, width]
        med = stack.median(dim=0).values
        denom = med.flatten().norm().clamp_min(torch.finfo(med.dtype).tiny)
        dev = [(float((s - med).flatten().norm() / denom)) for s in stack]
        flagged = [i for i, d in enumerate(dev) if d > self.threshold]
        self.flag_log.append({"step": frame.step, "phase": frame.phase, "deviation": dev, "flagged": flagged})
        losses = [role.last_losses for role in self.roles]
        if all(x is not None for x in losses):
            self.last_losses = torch.tensor(losses).median(dim=0).values.tolist()
        # the median is the client's own: it does not cross, so it is not a frame on any channel
        return Frame(
            "backward", frame.step, frame.doc_ids, med, frame.mask, frame.phase, payload_bits=replies[0].payload_bits
        )

    def set_taps(self, taps: list[Tap] | None) -> None:
        for ch in self.channels:
            ch.taps = list(taps or [])

    @property
    def ledger(self) -> list[dict]:
        return [e for ch in self.channels for e in ch.ledger]

    def bytes_per_direction(self) -> dict[str, int]:
        out = {"client_to_server": 0, "server_to_client": 0}
        for ch in self.channels:
            for k, v in ch.bytes_per_direction().items():
                out[k] += v
        return out

    def close(self) -> None:
        pass

    @torch.no_grad()
    def median_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        outs = []
        for rep in self.replicas:
            ctx = rep.context(*hidden.shape[:2])
            outs.append(rep.head_logits(rep.trunk(hidden, ctx), ctx))
        return torch.stack(outs).median(dim=0).values


def build_server(chain: DefenceChain, split: SplitModel, lr: float) -> ReplicaMedianLink | None:
    """The server side the chain's defence acting on the ``server`` (``chain.server_defence``) asks for, built
    here from its public arguments (the defence package does not import training), or None: one
    ``ServerRole``. Today that defence is ``replica-median``: its ``k`` copies, perturbed by ``perturbation``
    with the chain's seed, their replies compared against ``threshold``."""
    d = chain.server_defence
    if d is None:
        return None
    if d.name != "replica-median":
        raise NotImplementedError(f"no server side is built for defence {d.name!r} (splitleak.training.replicas)")
    a = d.args()
    return ReplicaMedianLink(make_replicas(split, a["k"], a["perturbation"], chain.seed), chain, lr, a["threshold"])
