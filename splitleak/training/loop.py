"""The step loop of split training, the all-local baseline, held-out utility and traffic capture."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from splitleak.data import Document
from splitleak.defences import DefenceChain
from splitleak.errors import ConfigError
from splitleak.models.split import SplitModel, next_token_loss
from splitleak.progress import Progress, Silent, end
from splitleak.training.checkpoint import restore_state
from splitleak.training.replicas import ReplicaMedianLink
from splitleak.training.roles import FLOAT64_HINT, ClientRole, ServerRole, _grads_finite, make_optimizer
from splitleak.wire.channel import InProcessChannel, Tap
from splitleak.wire.frames import Frame, check_finite


def training_order(n_docs: int, steps: int, seed: int) -> list[int]:
    """Indices of the training documents, one per step: seeded permutations, one per pass."""
    rng = np.random.default_rng([seed, 0x5EED])
    order: list[int] = []
    while len(order) < steps:
        order.extend(int(i) for i in rng.permutation(n_docs))
    return order[:steps]


def ids_tensor(docs: Sequence[Document], device) -> torch.Tensor:
    return torch.tensor([list(d.token_ids) for d in docs], dtype=torch.long, device=device)


def supervision(docs: Sequence[Document], answer_only: bool, device=None) -> torch.Tensor:
    """Which next-token targets [docs, T-1] a loss supervises: all of them, or with ``answer_only`` those
    of the answer tokens (target l predicts token l+1; it is supervised when l+1 >= the answer's start)."""
    t = len(docs[0].token_ids)
    if not answer_only:
        return torch.ones(len(docs), t - 1, dtype=torch.bool, device=device)
    missing = [d.doc_id for d in docs if d.answer_start is None]
    if missing:
        raise ConfigError(
            f"answer-only supervision needs instruction documents (question and answer), and document {missing[0]} "
            "has no answer; use --data instructions, or drop --answer-only"
        )
    starts = torch.tensor([d.answer_start for d in docs], device=device)
    return torch.arange(1, t, device=device).unsqueeze(0) >= starts.unsqueeze(1)


def supervised_loss(logits: torch.Tensor, input_ids: torch.Tensor, supervised: torch.Tensor | None) -> torch.Tensor:
    """Per-document mean next-token CE over the supervised targets (all when ``supervised`` is None)."""
    if supervised is None:
        return next_token_loss(logits, input_ids, reduction="per_doc")
    ce = next_token_loss(logits, input_ids, reduction="none")
    m = supervised.to(ce.dtype)
    return (ce * m).sum(1) / m.sum(1).clamp(min=1)


def _supervision_of(split: SplitModel, docs: Sequence[Document]) -> torch.Tensor | None:
    shielded = getattr(split, "shielded", None)
    return None if shielded is None else supervision(docs, shielded.answer_only, split.device)


def set_trainable(split: SplitModel, all_params: bool = False) -> None:
    """Freeze every parameter, then unfreeze the ones this run trains."""
    for p in split.model.parameters():
        p.requires_grad_(all_params)
    if not all_params:
        client, server = split.trainable_parameters()
        for p in client + server:
            p.requires_grad_(True)


def _release_grads(split: SplitModel) -> None:
    """Gradient buffers are kept between steps for speed; free them once training ends."""
    for p in split.model.parameters():
        p.grad = None


@dataclass
class TrainLog:
    losses: list[float | None] = field(default_factory=list)
    doc_ids: list[int] = field(default_factory=list)
    bytes_per_step: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    tokens: int = 0
    error: str | None = None
    ledgers: list[list[dict]] = field(default_factory=list)  # what crossed, per channel (not in as_dict)

    def as_dict(self) -> dict:
        return {
            "losses": self.losses,
            "doc_ids": self.doc_ids,
            "bytes_per_step": self.bytes_per_step,
            "seconds": self.seconds,
            "tokens": self.tokens,
            "tokens_per_second": self.tokens / self.seconds if self.seconds > 0 else None,
            "error": self.error,
        }


def connect(split: SplitModel, chain_server: DefenceChain, lr: float, taps: list[Tap] | None, server=None):
    """The client's channel to the server side, with ``taps`` on the wire: one ``ServerRole`` on the
    ``main`` link, or, given ``server``, that server (a ``ServerRole``, a ``ReplicaMedianLink``
    whose copies each have their own link, or a ``RemoteServer`` over TLS). Returns (channel, server)."""
    if isinstance(server, ReplicaMedianLink) or getattr(server, "remote", False):
        server.set_taps(taps)  # a new phase on the same link(s): these taps, a fresh ledger
        return server, server
    server = server if server is not None else ServerRole(split, chain_server, lr)
    return InProcessChannel(server.handle, taps), server


def train_split(
    split: SplitModel,
    train_docs: Sequence[Document],
    chain_client: DefenceChain,
    chain_server: DefenceChain,
    *,
    seed: int,
    steps: int,
    lr: float,
    progress: Progress | None = None,
    taps: list[Tap] | None = None,
    log: TrainLog | None = None,
    server=None,
    start: int = 0,
    client_state: tuple[dict, dict] | None = None,
    on_step: Callable[[int, ClientRole], None] | None = None,
) -> TrainLog:
    """AdamW, batch 1, one seeded pass; client and server each step their own parameters.
    Raises NonFiniteError naming the step; ``log`` holds what was done until then. The loss of each
    step is logged where it is computed (server in a plain split, client in a U-shape); it does not
    cross. Under mixup the first ``warmup`` steps cross unmixed and fill the decoy pool.

    Resuming (``splitleak.training.checkpoint``): ``start`` steps are done, ``client_state`` is the
    client's checkpoint after them (parameters and AdamW state), ``log`` holds their losses and
    document ids; the remaining steps of the same seeded order follow. ``on_step(done, client)`` is
    called after each completed step (to write a checkpoint)."""
    progress = progress or Silent()
    log = log if log is not None else TrainLog()
    set_trainable(split)
    channel, server = connect(split, chain_server, lr, taps, server)
    client = ClientRole(split, chain_client, channel, lr)
    if client_state is not None:
        restore_state(client.params, client.opt, *client_state)
    order = training_order(len(train_docs), steps, seed)
    task = progress.start("split training", steps - start)
    t0 = time.perf_counter()
    ok = False
    try:
        for step, i in enumerate(order):
            if step < start:
                continue
            doc = train_docs[i]
            ids = ids_tensor([doc], split.device)
            losses = client.exchange(ids, (doc.doc_id,), step, "train", _supervision_of(split, [doc]))
            if losses is None:
                losses = server.last_losses  # None over TLS: a plain split's loss stays on the server
            log.losses.append(None if losses is None else losses[0])
            log.doc_ids.append(doc.doc_id)
            log.tokens += ids.numel()
            progress.advance(task)
            if on_step is not None:
                on_step(step + 1, client)
        ok = True
    finally:
        log.seconds = time.perf_counter() - t0
        _release_grads(split)
        n = max(1, len(log.losses) - start)
        log.bytes_per_step = {k: v / n for k, v in channel.bytes_per_direction().items()}
        log.ledgers = [channel.ledger]
        end(progress, task, ok)  # "stopped", not "done", when interrupted
    return log


def train_all_local(
    split: SplitModel,
    train_docs: Sequence[Document],
    *,
    seed: int,
    steps: int,
    lr: float,
    progress: Progress | None = None,
    answer_only: bool = False,
) -> TrainLog:
    """The paired baseline: the whole model trained on the client, same order, same optimiser (and, with
    ``answer_only``, the same answer-only supervision)."""
    progress = progress or Silent()
    set_trainable(split, all_params=True)
    params = list(split.model.parameters())
    opt = make_optimizer(params, lr)
    log = TrainLog()
    task = progress.start("all-local baseline", steps)
    t0 = time.perf_counter()
    for step, i in enumerate(training_order(len(train_docs), steps, seed)):
        ids = ids_tensor([train_docs[i]], split.device)
        mask = supervision([train_docs[i]], answer_only, split.device) if answer_only else None
        loss = supervised_loss(split.full_logits(ids), ids, mask).mean()
        check_finite(loss, f"all-local next-token loss at step {step}", FLOAT64_HINT)
        loss.backward()
        _grads_finite(params, "all-local", step)
        opt.step()
        opt.zero_grad(set_to_none=False)
        log.losses.append(float(loss.detach()))
        log.doc_ids.append(train_docs[i].doc_id)
        log.tokens += ids.numel()
        progress.advance(task)
    log.seconds = time.perf_counter() - t0
    progress.finish(task)
    _release_grads(split)
    set_trainable(split, all_params=False)
    return log


@torch.no_grad()
def evaluate_ce(
    split: SplitModel,
    docs: Sequence[Document],
    batch: int = 32,
    progress: Progress | None = None,
    name: str = "held-out loss",
    server_logits=None,
    answer_only: bool = False,
) -> np.ndarray:
    """Per-document mean next-token cross-entropy (nats) of the uncut model; with
    ``server_logits`` (hidden at the cut -> logits), of the client bottom followed by that; with
    ``answer_only``, over each document's answer targets."""
    progress = progress or Silent()
    task = progress.start(name, len(docs))
    out = []
    for s in range(0, len(docs), batch):
        chunk = docs[s : s + batch]
        ids = ids_tensor(chunk, split.device)
        logits = split.full_logits(ids) if server_logits is None else server_logits(split.bottom(ids))
        mask = supervision(chunk, True, split.device) if answer_only else None
        out.append(supervised_loss(logits, ids, mask).double().cpu().numpy())
        progress.advance(task, len(chunk))
    progress.finish(task)
    return np.concatenate(out) if out else np.zeros(0)


def utility(per_doc_ce: np.ndarray) -> dict[str, float]:
    """Held-out cross-entropy (mean over documents of each one's mean loss) and the geometric mean
    of per-document perplexities, exp(that mean)."""
    ce = float(np.mean(per_doc_ce))
    return {"ce": ce, "perplexity": math.exp(ce)}


def capture_traffic(
    split: SplitModel,
    docs: Sequence[Document],
    chain_client: DefenceChain,
    chain_server: DefenceChain,
    *,
    batch: int,
    taps: list[Tap] | None = None,
    progress: Progress | None = None,
    server=None,
    client_side: dict[str, list[torch.Tensor]] | None = None,
) -> tuple[dict[str, Any], list[list[dict]]]:
    """Frozen weights: send every document through the wire once, in batches, with ``taps`` (the
    recorder) on the channel. Returns throughput and the share of all-zero returned-gradient rows of
    the documents, and the channels' ledgers. ``client_side`` (label-shielded): receives, per batch, the
    raw output gradient of the full loss (``raw``) and the one sent (``sent``); they stay on the client."""
    progress = progress or Silent()
    set_trainable(split)
    seen: dict[str, Frame] = {}

    def last_backward(crossing) -> None:
        if crossing.frame.kind == "backward" and crossing.link not in seen:
            seen[crossing.link] = crossing.frame

    if server is None:
        server = ServerRole(split, chain_server, lr=0.0)
    remote = bool(getattr(server, "remote", False))
    for role in server.roles if isinstance(server, ReplicaMedianLink) else [server]:
        role.opt = None
    channel, server = connect(split, chain_server, 0.0, list(taps or []) + [last_backward], server)
    client = ClientRole(split, chain_client, channel, lr=0.0)
    client.opt = None
    task = progress.start("capture", len(docs))
    t0 = time.perf_counter()
    zero_rows = zero_rows_early = total_rows = 0
    per_frame: list[float] = []
    client_losses: list[float] = []
    for s in range(0, len(docs), batch):
        chunk = docs[s : s + batch]
        ids = ids_tensor(chunk, split.device)
        seen.clear()
        losses = client.exchange(ids, tuple(d.doc_id for d in chunk), -1, "capture", _supervision_of(split, chunk))
        if losses is not None:  # U-shape: the client computes the loss of what it sent
            client_losses.extend(losses)
        if client_side is not None and client.last_sent_top_gradient is not None:
            assert client.last_raw_top_gradient is not None  # set with the one sent
            client_side.setdefault("raw", []).append(client.last_raw_top_gradient.cpu())
            client_side.setdefault("sent", []).append(client.last_sent_top_gradient.cpu())
        progress.advance(task, len(chunk))
        if not seen:  # top-only training: no gradient crosses
            continue
        bwd = seen[min(seen)]
        n = len(chunk)  # rows after these are mixup's probe rows
        zero = (bwd.tensor[:n] == 0).all(dim=-1)  # [rows, tokens]: all-zero returned gradient rows
        per_frame.append(float(zero.float().mean()))
        zero_rows += int(zero.sum())
        zero_rows_early += int(zero[:, :-1].sum())
        total_rows += zero.numel()
    secs = time.perf_counter() - t0
    progress.finish(task)
    n_tok = sum(len(d.token_ids) for d in docs)
    stats = {
        "seconds": secs,
        "tokens_per_second": n_tok / secs if secs > 0 else None,
        "zero_gradient_rows": zero_rows,
        "zero_gradient_row_share": zero_rows / max(1, total_rows),
        # the last position has no next-token target, so its gradient is zero by construction;
        # zero rows anywhere else are what an observer could use to discard decoys (Politis & Pappas 2026)
        "zero_gradient_rows_before_last": zero_rows_early,
        "zero_gradient_row_share_per_frame": per_frame,
    }
    if remote:
        # over TLS the client cannot run the uncut model (the server's trained layers stay there); the
        # utility it can see is split inference itself, the loss of the capture pass when it holds the head
        stats["client_losses"] = client_losses or None
    return stats, [channel.ledger]
