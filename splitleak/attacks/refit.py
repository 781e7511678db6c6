"""Refit: the observer re-fits its copy of the client layers to the traffic, then decodes through it.

An observer holds the public pretrained copy f_θ0 of the client layers; the client sends
h = f_θ(x) after fine-tuning, so recomputing candidates through f_θ0 no longer matches h exactly and
the search attacks read less through the public copy than through the trained one (issue #20). This
attack starts from the public copy and the observed activations alone (no labels, no server layers,
no training text, no trained copy) and alternates, for ``rounds`` rounds:

1. **decode**: the ``inner`` decoder (``sipit``: SipIt with ``budget`` checks per token; ``activation``:
   the beam search with ``k`` ridge candidates; ``vmi``: the ridge map's nearest token, cheapest) reads
   pseudo-tokens of ``fit_docs`` documents of the traffic through the current copy (its ridge map
   refitted on the calibration documents through that copy);
2. **fit**: Adam (``lr``, ``steps`` steps of ``batch`` documents) moves the copy's parameters
   (``update``: ``blocks``, every parameter of the client blocks; ``norms``, the blocks' norm weights and
   biases and every bias, the cheap parametrisation; ``all``, the blocks and the embeddings) so that
   the recomputed activations of the pseudo-tokens match the observed ones: per position, the squared
   error over the observation's squared norm, averaged over the positions kept. With ``trim`` < 1, only
   that share of positions with the smallest error under the copy before the fit is kept (those whose
   pseudo-token is likelier right);

then runs the ``decoder`` (``activation`` with ``k`` candidates, or ``sipit`` with ``budget`` checks)
on every document through the re-fitted copy. The copy is the observer's own: the ``Knowledge`` it
was given is not changed.

All of it is ours (not a published attack): the defaults ``rounds=2``, ``steps=64``, ``batch=16``,
``lr=3e-5``, ``update="blocks"``, ``fit_docs=64`` (a seeded draw of the traffic's documents; 0 takes
all of them), ``trim=0.85``, ``inner="sipit"`` with ``budget=32``, and the relative squared error as
the fit's loss. They were chosen on one SmolLM2 run (depth 6, 64 of its evaluation documents;
``experiments/PILOTS.md``): there fine-tuning moved the blocks, not the embeddings, SipIt's pseudo-tokens
were both better and cheaper than the beam search's, and trimming the 15 % worst-matching positions kept
4/5 of the wrong pseudo-tokens out of the fit.

``rec.extra``: ``stage_tokens`` (the pseudo-tokens of each round, ``round0`` through the public
copy; -1 on the documents a round did not decode) and ``summary`` (per round: the mean relative
squared error of the pseudo-tokens' recomputed activations before and after the fit, the share of
pseudo-tokens equal to the previous round's, the positions kept and seconds; at the end, the same
error of the final reading through the public and through the re-fitted copy), all measured on the
traffic alone.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any

import numpy as np
import torch
from pydantic import PositiveInt
from torch import nn

from splitleak.attacks.base import Attack, Budget, Reconstruction
from splitleak.attacks.beam import ActivationBeam
from splitleak.attacks.knowledge import ClientCopy, Knowledge, Traffic
from splitleak.attacks.sipit import SipIt
from splitleak.attacks.vmi import VMI
from splitleak.errors import ConfigError
from splitleak.progress import Progress, Silent
from splitleak.runtime import fused_optimizer

UPDATES = ("blocks", "norms", "all")
INNER = ("sipit", "activation", "vmi")
DECODERS = ("activation", "sipit")


def clone_copy(client: ClientCopy) -> ClientCopy:
    """A copy of the client layers that can be changed without touching ``client`` (the tokenizer is shared)."""
    twin = copy.deepcopy(client, memo={id(client.tokenizer): client.tokenizer})
    twin.embedding = twin.owner.get_input_embeddings().weight.detach()
    return twin


def fit_parameters(client: ClientCopy, which: str) -> list[nn.Parameter]:
    """The parameters the fit moves: ``blocks`` (every parameter of the client blocks), ``norms`` (the
    blocks' norm weights and biases, and every bias of the blocks) or ``all`` (blocks and embeddings)."""
    if which == "all":
        return list(client.owner.parameters())
    if which == "blocks":
        return list(client.blocks.parameters())
    picked: dict[int, nn.Parameter] = {}
    for mod in client.blocks.modules():
        if "norm" in type(mod).__name__.lower():
            picked.update({id(p): p for p in mod.parameters(recurse=False)})
    for name, p in client.blocks.named_parameters():
        if name.endswith("bias"):
            picked[id(p)] = p
    return list(picked.values())


def relative_error(client: ClientCopy, tokens: torch.Tensor, observed: torch.Tensor, batch: int = 64) -> torch.Tensor:
    """Per position, ||f(tokens) - observed||^2 / ||observed||^2 through ``client``: [n, T] float64."""
    h = client.activations(tokens, batch)
    o = observed.to(h.device, h.dtype)
    return ((h - o).double().pow(2).sum(-1) / o.double().pow(2).sum(-1).clamp_min(1e-30)).cpu()


class Refit(Attack):
    """Re-fit the public copy of the client layers to the observed activations on pseudo-tokens, for
    ``rounds`` rounds, then decode through the re-fitted copy (module docstring)."""

    name = "refit"

    def __init__(
        self,
        rounds: int = 2,
        steps: int = 64,
        batch: int = 16,
        lr: float = 3e-5,
        update: str = "blocks",
        fit_docs: int = 64,
        trim: float = 0.85,
        inner: str = "sipit",
        decoder: str = "activation",
        k: int = 32,
        budget: Budget | None = None,
        width: int = 2,
        seed: int = 0,
        chunk_docs: PositiveInt = 64,
    ):
        self.rounds = rounds
        self.steps = steps
        self.batch = batch
        self.lr = lr
        self.update = update
        self.fit_docs = fit_docs
        self.trim = trim
        self.inner = inner
        self.decoder = decoder
        self.k = k
        self.budget = budget
        self.width = width
        self.seed = seed
        self.chunk_docs = chunk_docs
        self._validate()

    def params(self) -> dict[str, Any]:
        p: dict[str, Any] = {
            "rounds": self.rounds,
            "steps": self.steps,
            "batch": self.batch,
            "lr": self.lr,
            "update": self.update,
            "fit_docs": self.fit_docs,
            "trim": self.trim,
            "inner": self.inner,
            "decoder": self.decoder,
            "k": self.k,
            "width": self.width,
            "seed": self.seed,
        }
        if "sipit" in (self.inner, self.decoder):
            p["budget"] = self._budget()
        return p

    def _budget(self) -> Budget:
        return 32 if self.budget is None else self.budget

    def _validate(self) -> None:
        def count(name: str, v: Any, least: int) -> None:
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ConfigError(f"{self.name}: {name} must be an integer >= {least}, got {v!r}")

        count("rounds", self.rounds, 0)
        count("steps", self.steps, 0)
        count("batch", self.batch, 1)
        count("fit_docs", self.fit_docs, 0)
        count("k", self.k, max(2, self.width))
        count("width", self.width, 1)
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise ConfigError(f"{self.name}: lr must be a number > 0, got {self.lr!r}")
        if isinstance(self.trim, bool) or not isinstance(self.trim, (int, float)) or not 0 < self.trim <= 1:
            raise ConfigError(f"{self.name}: trim (the share of positions the fit keeps) must lie in (0, 1]")
        for arg, value, known in (("update", self.update, UPDATES), ("inner", self.inner, INNER)):
            if value not in known:
                raise ConfigError(f"{self.name}: unknown {arg} {value!r}; known: {', '.join(known)}")
        if self.decoder not in DECODERS:
            raise ConfigError(f"{self.name}: unknown decoder {self.decoder!r}; known: {', '.join(DECODERS)}")
        if self.budget is not None and "sipit" not in (self.inner, self.decoder):
            raise ConfigError(f"{self.name}: budget is SipIt's, and neither inner nor decoder is sipit; drop it")
        if self.budget is not None and self.budget != "exhaustive":
            count("budget", self.budget, 1)

    # ------------------------------------------------------------------ the two steps of a round
    def _through(self, client: ClientCopy) -> Knowledge:
        return dataclasses.replace(self.knowledge_, client=client)

    def _decode(self, how: str, client: ClientCopy, traffic: Traffic, progress: Progress | None) -> torch.Tensor:
        attack: Attack
        if how == "vmi":
            attack = VMI(seed=self.seed)
        elif how == "sipit":
            attack = SipIt(budget=self._budget(), seed=self.seed, chunk_docs=self.chunk_docs)
        else:
            attack = ActivationBeam(k=self.k, width=self.width, seed=self.seed, chunk_docs=self.chunk_docs)
        tokens = attack.fit(self._through(client)).reconstruct(traffic, progress).tokens
        assert tokens is not None  # token attacks
        return tokens

    def _fit_copy(
        self, client: ClientCopy, tokens: torch.Tensor, observed: torch.Tensor, keep: torch.Tensor, round_: int
    ) -> None:
        """Adam on the chosen parameters of ``client`` (in place): ``steps`` steps of ``batch`` documents
        (a seeded order, reshuffled each pass), loss: the kept positions' mean relative squared error."""
        params = fit_parameters(client, self.update)
        for p in params:
            p.requires_grad_(True)
        opt = fused_optimizer(torch.optim.Adam, params, lr=self.lr)
        gen = torch.Generator().manual_seed(int(self.seed) * 1_000_003 + 7919 * round_ + 11)
        n = tokens.shape[0]
        order = torch.randperm(n, generator=gen)
        at = 0
        try:
            with torch.enable_grad():
                for _ in range(self.steps):
                    if at >= n:
                        order, at = torch.randperm(n, generator=gen), 0
                    rows = order[at : at + self.batch]
                    at += self.batch
                    h = client.owner(input_ids=tokens[rows].to(client.device), use_cache=False).last_hidden_state
                    o = observed[rows].to(h.device, h.dtype)
                    err = (h - o).pow(2).sum(-1) / o.pow(2).sum(-1).clamp_min(1e-30)
                    w = keep[rows].to(h.device, h.dtype)
                    loss = (err * w).sum() / w.sum().clamp_min(1.0)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
        finally:
            for p in params:
                p.requires_grad_(False)
                p.grad = None
        client.owner.eval()
        client.embedding = client.owner.get_input_embeddings().weight.detach()

    # ------------------------------------------------------------------ the attack
    def reconstruct(self, traffic: Traffic, progress: Progress | None = None) -> Reconstruction:
        self._check(traffic)
        self._validate()
        progress = progress or Silent()
        public = self.knowledge_.client
        client = clone_copy(public)
        n, T = traffic.activations.shape[:2]
        m = n if self.fit_docs == 0 or self.fit_docs >= n else self.fit_docs
        rng = np.random.default_rng([int(self.seed), 0x5EF1])
        rows = sorted(rng.choice(n, size=m, replace=False).tolist()) if m < n else list(range(n))
        sub = traffic.subset(rows)
        observed = sub.activations
        stage_tokens: dict[str, torch.Tensor] = {}
        rounds: list[dict[str, Any]] = []
        previous: torch.Tensor | None = None
        for r in range(self.rounds):
            t0 = time.perf_counter()
            pseudo = self._decode(self.inner, client, sub, progress)
            full = torch.full((n, T), -1, dtype=torch.long)
            full[rows] = pseudo
            stage_tokens[f"round{r}"] = full
            t1 = time.perf_counter()
            before = relative_error(client, pseudo, observed, self.chunk_docs)
            keep = torch.ones_like(before, dtype=torch.bool)
            if self.trim < 1:
                keep = before <= torch.quantile(before.flatten(), float(self.trim))
            task = progress.start(f"refit round {r + 1}/{self.rounds}: fit the copy ({self.steps} steps)", 1)
            self._fit_copy(client, pseudo, observed, keep, r)
            progress.advance(task, 1)
            progress.finish(task)
            after = relative_error(client, pseudo, observed, self.chunk_docs)
            rounds.append(
                {
                    "round": r,
                    "documents": m,
                    "error_before_fit": float(before.mean()),
                    "error_after_fit": float(after.mean()),
                    "kept_positions": float(keep.double().mean()),
                    "agreement_with_previous_round": (
                        None if previous is None else float((pseudo == previous).double().mean())
                    ),
                    "seconds_decode": t1 - t0,
                    "seconds_fit": time.perf_counter() - t1,
                }
            )
            previous = pseudo
        t0 = time.perf_counter()
        tokens = self._decode(self.decoder, client, traffic, progress)
        seconds_final = time.perf_counter() - t0
        final_public = relative_error(public, tokens, traffic.activations, self.chunk_docs)
        final_refit = relative_error(client, tokens, traffic.activations, self.chunk_docs)
        summary: dict[str, Any] = {
            "fit_rows": rows,
            "rounds": rounds,
            "final_error_public_copy": float(final_public.mean()),
            "final_error_refit_copy": float(final_refit.mean()),
            "final_agreement_with_last_round": (
                None if previous is None else float((tokens[rows] == previous).double().mean())
            ),
            "seconds_final_decode": seconds_final,
            "error": "mean over positions of ||recomputed - observed||^2 / ||observed||^2 (traffic only)",
        }
        self.client_ = client
        return Reconstruction(tokens, {"stage_tokens": stage_tokens, "summary": summary})
