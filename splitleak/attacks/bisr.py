"""BiSR: bidirectional semi-white-box reconstruction (the attack Gradient Mirage defends against; 003 §3,
after Chen et al., "Unveiling the vulnerability of private fine-tuning in split-based frameworks for LLMs").

The chain, each stage starting from the previous one's tokens:

1. **SIP** (``sip-gru``): the learned inverter reads a first guess of every token from h_b, the Bottom's
   output that crosses the forward wire.
2. **Backward matching, BiSR(b)**: GMA-SL (``gma-sl``) from SIP's reading instead of from noise: soft labels
   initialised at SIP's tokens 1 … T-1 are moved until the pretrained Top's gradient for them matches the
   observed g_t. Label-shielded runs only (it reads the trunk output and the output gradient).
3. **Forward matching, BiSR(f)**: relaxed inputs are fitted to h_b through the attacker's copy of the Bottom.
   Each position holds logits Z over the vocabulary; its input embedding is softmax(Z) @ E (E the copy's
   token embeddings), the copy runs on those embeddings, and Adam moves Z until the recomputed
   activations match the observed ones (per position, cosine distance by default). The reading is argmax Z.

Registered as three attacks: ``bisr-b`` (SIP → b), ``bisr-f`` (SIP → f; it reads the forward wire only, so
it runs on every split mode) and ``bisr`` (SIP → b → f, both directions).

Ours, not 003's (its summary gives no numbers for these): forward matching with Adam at ``f_lr=0.05`` for
at most ``f_steps=200`` steps per chunk of ``batch`` documents, stopped when the chunk's distance improved
by less than ``tol=1e-4`` (relative) over ``patience=20`` steps; the cosine distance averaged over positions
(``f_distance="l2"``: the squared error over the squared norm of the observation); a token-id start that
puts probability 0.9 on the token (``gma.INIT_TOKEN_PROB``); and a guard: a document keeps its start
wherever the argmax of the relaxed solution recomputes to activations *farther* from the observation than
the start's (the relaxation can settle between tokens); ``info`` counts how often the guard fired. The
backward stage takes GMA-SL's defaults (l2, its stopping rule); SIP's are ``sip-gru``'s.
"""

from __future__ import annotations

import math
import time
from typing import Any, ClassVar

import torch

from splitleak.attacks.base import Attack, Reconstruction
from splitleak.attacks.gma import DISTANCES, GMASL, INIT_TOKEN_PROB
from splitleak.attacks.sip import SipGRU
from splitleak.errors import ConfigError
from splitleak.progress import Progress, Silent
from splitleak.runtime import fused_optimizer

F_DISTANCES = ("cos", "l2")


def _forward_distance(a: torch.Tensor, b: torch.Tensor, distance: str) -> torch.Tensor:
    """Per-document distance between activations [m, T, d] (float32 result [m])."""
    a, b = a.float(), b.float()
    if distance == "cos":
        return (1.0 - torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=1e-12)).mean(-1)
    return (a - b).pow(2).sum((1, 2)) / b.pow(2).sum((1, 2)).clamp_min(1e-30)


def match_inputs(
    client,
    h_b: torch.Tensor,
    init: torch.Tensor,
    *,
    steps: int = 200,
    lr: float = 0.05,
    distance: str = "cos",
    tol: float = 1e-4,
    patience: int = 20,
    batch: int = 8,
    progress: Progress | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """BiSR(f): token ids [n, T] whose embeddings, run through ``client`` (a ``ClientCopy``: the attacker's
    Bottom), best reproduce the observed activations ``h_b`` [n, T, d], starting from ``init`` [n, T].

    Returns the tokens and info: ``steps`` per chunk, ``distance`` (the final discrete distance per
    document), ``start_distance`` (the start's), ``kept_start`` (documents whose start recomputed closer
    than the relaxed solution's argmax, and were kept), ``seconds``. Deterministic: nothing is drawn."""
    if distance not in F_DISTANCES:
        raise ConfigError(
            f"bisr forward matching: unknown distance {distance!r}; choose one of {', '.join(F_DISTANCES)}"
        )
    if h_b.dim() != 3 or init.shape != h_b.shape[:2]:
        raise ConfigError(
            f"bisr forward matching: need activations [n, T, d] and start tokens [n, T]; got "
            f"{tuple(h_b.shape)} and {tuple(init.shape)}"
        )
    if not torch.isfinite(h_b).all():
        raise ConfigError("bisr forward matching: the activations contain NaN or Inf; fix the capture first")
    if steps < 0 or not lr > 0 or batch < 1 or patience < 1 or not tol >= 0:
        raise ConfigError(
            f"bisr forward matching: need steps >= 0, lr > 0, batch >= 1, patience >= 1, tol >= 0; got "
            f"steps={steps}, lr={lr}, batch={batch}, patience={patience}, tol={tol}"
        )
    started = time.perf_counter()
    progress = progress or Silent()
    E = client.embedding
    V = E.shape[0]
    if init.numel() and (int(init.min()) < 0 or int(init.max()) >= V):
        raise ConfigError(f"bisr forward matching: start tokens must lie in [0, {V}) (the copy's vocabulary)")
    peak = math.log(INIT_TOKEN_PROB * (V - 1) / (1 - INIT_TOKEN_PROB)) if V > 1 else 0.0

    def recompute(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return client.owner(input_ids=ids.to(client.device), use_cache=False).last_hidden_state

    n = h_b.shape[0]
    out = init.clone().long()
    final = torch.zeros(n)
    start_d = torch.zeros(n)
    kept: list[int] = []
    chunk_steps: list[int] = []
    task = progress.start("BiSR forward matching", n)
    for s in range(0, n, batch):
        e = min(n, s + batch)
        h = h_b[s:e].to(client.device, client.dtype)
        ids0 = init[s:e].long()
        z = torch.zeros(e - s, h.shape[1], V, dtype=torch.float32, device=client.device)
        z.scatter_(-1, ids0.unsqueeze(-1).to(client.device), peak)
        z.requires_grad_(True)
        opt = fused_optimizer(torch.optim.Adam, [z], lr=lr)
        history: list[float] = []
        t = 0
        while True:
            with torch.enable_grad():
                emb = torch.softmax(z, dim=-1).to(E.dtype) @ E
                act = client.owner(inputs_embeds=emb, use_cache=False).last_hidden_state
                value_t = _forward_distance(act, h, distance).sum()
            value = float(value_t.detach())
            history.append(value)
            if t >= steps or (t >= patience and history[-1 - patience] - value <= tol * abs(history[-1 - patience])):
                break
            opt.zero_grad(set_to_none=True)
            value_t.backward()
            opt.step()
            t += 1
        chunk_steps.append(t)
        ids = z.detach().argmax(-1).cpu()
        d_new = _forward_distance(recompute(ids), h, distance).cpu()
        d_old = _forward_distance(recompute(ids0), h, distance).cpu()
        worse = d_new > d_old
        ids[worse] = ids0[worse]
        kept += [s + int(i) for i in torch.nonzero(worse).flatten()]
        out[s:e] = ids
        final[s:e] = torch.minimum(d_new, d_old)
        start_d[s:e] = d_old
        progress.advance(task, e - s)
    progress.finish(task)
    info = {
        "steps": chunk_steps,
        "distance": final.tolist(),
        "start_distance": start_d.tolist(),
        "kept_start": kept,
        "seconds": time.perf_counter() - started,
    }
    return out, info


class _BiSRChain(Attack):
    """SIP, then the stages named by ``stages`` ("b", "f") in that order (see the module docstring)."""

    stages: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        *,
        sip_hidden: int = 256,
        sip_epochs: int = 40,
        b_steps: int = 400,
        b_lr: float = 0.1,
        b_distance: str = "l2",
        f_steps: int = 200,
        f_lr: float = 0.05,
        f_distance: str = "cos",
        batch: int = 8,
        seed: int = 0,
    ):
        super().__init__(seed)
        if "b" in self.stages and b_distance not in DISTANCES:
            raise ConfigError(f"{self.name}: unknown b_distance {b_distance!r}; choose one of {', '.join(DISTANCES)}")
        if "f" in self.stages and f_distance not in F_DISTANCES:
            raise ConfigError(f"{self.name}: unknown f_distance {f_distance!r}; choose one of {', '.join(F_DISTANCES)}")
        for arg, value, lo in (("b_steps", b_steps, 0), ("f_steps", f_steps, 0), ("batch", batch, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ConfigError(f"{self.name}: {arg} must be an integer >= {lo}, got {value!r}")
        for arg, number in (("b_lr", b_lr), ("f_lr", f_lr)):
            if isinstance(number, bool) or not isinstance(number, (int, float)) or not number > 0:
                raise ConfigError(f"{self.name}: {arg} must be a number > 0, got {number!r}")
        self.sip = SipGRU(hidden=sip_hidden, epochs=sip_epochs, seed=seed)  # checks its own arguments
        self.b_steps, self.b_lr, self.b_distance = b_steps, b_lr, b_distance
        self.f_steps, self.f_lr, self.f_distance = f_steps, f_lr, f_distance
        self.batch = batch

    def params(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sip_hidden": self.sip.hidden, "sip_epochs": self.sip.epochs}
        if "b" in self.stages:
            out.update(b_steps=self.b_steps, b_lr=self.b_lr, b_distance=self.b_distance)
        if "f" in self.stages:
            out.update(f_steps=self.f_steps, f_lr=self.f_lr, f_distance=self.f_distance)
        return {**out, "batch": self.batch, "seed": self.seed}

    def fit(self, knowledge, progress: Progress | None = None) -> "_BiSRChain":
        super().fit(knowledge)
        if "b" in self.stages:  # before SIP's training: it refuses knowledge without the pretrained Top
            self.gma_ = GMASL(
                distance=self.b_distance, steps=self.b_steps, lr=self.b_lr, batch=self.batch, seed=self.seed
            ).fit(knowledge)
        self.sip.fit(knowledge, progress)
        return self

    def reconstruct(self, traffic, progress: Progress | None = None) -> Reconstruction:
        self._check(traffic)
        if "b" in self.stages and (traffic.trunk_output is None or traffic.output_gradients is None):
            raise ConfigError(
                f"{self.name}'s backward stage reads the trunk output and the output gradient a label-shielded "
                "client returns; this traffic has none (inference traffic, or top-only training, which sends no "
                "gradient); bisr-f reads the forward wire alone"
            )
        sip = self.sip.reconstruct(traffic).tokens
        assert sip is not None
        tokens = sip.clone()
        stage_tokens = {"sip": sip}
        extra: dict[str, Any] = {}
        if "b" in self.stages:
            labels, distance, steps = self.gma_.match(traffic, init=tokens[:, 1:], progress=progress)
            tokens[:, 1:] = labels
            stage_tokens["b"] = tokens.clone()
            extra.update(b_distance=distance, b_steps=steps)
        if "f" in self.stages:
            tokens, info = match_inputs(
                self.knowledge_.client,
                traffic.activations,
                tokens,
                steps=self.f_steps,
                lr=self.f_lr,
                distance=self.f_distance,
                batch=self.batch,
                progress=progress,
            )
            stage_tokens["f"] = tokens.clone()
            extra.update(f_distance=info["distance"], f_steps=info["steps"], f_kept_start=info["kept_start"])
        # the labels are tokens 1 … T-1: scored like GMA-SL's (ROUGE, METEOR, answer labels)
        return Reconstruction(tokens, {**extra, "labels": tokens[:, 1:], "stage_tokens": stage_tokens})


def _given(args: dict[str, Any]) -> dict[str, Any]:
    """A subclass's own arguments, forwarded by name (each subclass lists only the ones its stages use, so
    that ``make_attack`` and the job keys see exactly those)."""
    return {k: v for k, v in args.items() if k not in ("self", "__class__")}


class BiSRBackward(_BiSRChain):
    """``bisr-b``: SIP, then GMA-SL from SIP's reading (label-shielded runs)."""

    name = "bisr-b"
    stages = ("b",)

    def __init__(
        self,
        sip_hidden: int = 256,
        sip_epochs: int = 40,
        b_steps: int = 400,
        b_lr: float = 0.1,
        b_distance: str = "l2",
        batch: int = 8,
        seed: int = 0,
    ):
        super().__init__(**_given(locals()))


class BiSRForward(_BiSRChain):
    """``bisr-f``: SIP, then forward matching of relaxed inputs to h_b through the attacker's Bottom."""

    name = "bisr-f"
    stages = ("f",)

    def __init__(
        self,
        sip_hidden: int = 256,
        sip_epochs: int = 40,
        f_steps: int = 200,
        f_lr: float = 0.05,
        f_distance: str = "cos",
        batch: int = 8,
        seed: int = 0,
    ):
        super().__init__(**_given(locals()))


class BiSR(_BiSRChain):
    """``bisr``: SIP, then BiSR(b), then BiSR(f) from (b)'s reading (both directions)."""

    name = "bisr"
    stages = ("b", "f")

    def __init__(
        self,
        sip_hidden: int = 256,
        sip_epochs: int = 40,
        b_steps: int = 400,
        b_lr: float = 0.1,
        b_distance: str = "l2",
        f_steps: int = 200,
        f_lr: float = 0.05,
        f_distance: str = "cos",
        batch: int = 8,
        seed: int = 0,
    ):
        super().__init__(**_given(locals()))
