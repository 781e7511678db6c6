"""The decoy system's latent mode, trained for real (Politis & Pappas 2026, §2, Figure 2).

One request per step (one training document); the capture pass sends the evaluation documents in
requests of ``capture_batch`` frames. For each frame the trusted node (``LatentClient``):

1. runs the frozen prefix, blocks [0, s], and its private encoder: z = E(h_s), T rows of width D;
2. draws the frame's k decoys from the FIFO pool of earlier frames' encoder rows (before release),
   then adds its own rows to the pool (``splitleak.defences.decoys``);
3. gauges the T + k rows with the frame's rotation and permutation (``splitleak.defences.gauges``), then
   clips every row to C and adds Gaussian noise σ·C afresh (002 Figure 2, steps 3-5: gauge, decoy
   mix, perturb), and sends them: the **forward** frame [frames, T + k, D]. Under
   ``decoy_release="verbatim"`` (the weak variant) the real rows are released first, the decoys are
   rows released earlier re-sent as they were, and the gauge comes last;
4. (the randomness) the gauge masters come fresh per frame from OS entropy, and the noise and decoy
   draws from a per-run 128-bit secret (``gauge_entropy="os"``, kept in ``latent/secret.json``, the
   client's own); under ``"derived"`` all of it is keyed by the run seed, reproducible;
5. receives the surrogate's output (the **return** frame, clipped and noised by the server), undoes
   the gauge, keeps its T real rows, decodes them into the residual, h_r ≈ h_s + Dec(y), runs the
   frozen tail and takes the loss — the task loss plus, in training, matching the real delegated
   blocks run locally as a teacher (after LayerNorm), in the capture pass too, so that its output
   gradient is the training objective's (every real row then has one, the last included);
6. sends the gradient of the loss with respect to the return frame (the **output gradient**): zero
   on every decoy row, because the loss keeps only the real rows, unless the fix clips and noises
   it per row;
7. receives the surrogate's gradient with respect to the rows it was sent (the **input gradient**)
   and backpropagates it through the gauge and the release into the encoder; steps AdamW on the
   encoder and decoder.

The untrusted node (``LatentServer``) holds only the surrogate and its AdamW; it needs no model
weights at all. The capture pass runs the same four crossings with every parameter frozen.
The client's own record of which gauged rows were real (``latent/truth.safetensors``) never crosses;
it is what the partition attacks are scored against. The run that writes all of it into a run directory
is ``splitleak.training.latent_run``.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from splitleak import seeds
from splitleak.data import Document
from splitleak.defences.decoys import DecoyPool, derived_seed, gaussian_row_epsilon, release, torch_generator
from splitleak.defences.gauges import Gauge, frame_gauge
from splitleak.errors import ConfigError
from splitleak.models.latent import Decoder, Encoder, GaugeSurrogate, LatentSpec, check_no_wide_parameters, latent_spec
from splitleak.models.split import SplitModel, next_token_loss
from splitleak.models.structure import find_blocks
from splitleak.progress import Progress, Silent, end
from splitleak.training.config import LatentConfig
from splitleak.training.loop import ids_tensor, training_order
from splitleak.training.roles import _finite, _grads_finite, make_optimizer
from splitleak.wire.channel import Channel
from splitleak.wire.frames import Frame


def latent_split(lm, cfg: LatentConfig) -> tuple[SplitModel, LatentSpec]:
    """The frozen model cut for the latent mode: bottom = blocks [0, s], trunk = the delegated blocks
    (the teacher), top = [r, L) with the norm and head."""
    n_blocks = len(find_blocks(lm.model)[1])
    spec = latent_spec(n_blocks, cfg.split_after, cfg.resume_at, cfg.width)
    s, r = spec.delegated
    split = SplitModel(lm, offload_start=s, offload_length=r - s)
    for p in split.model.parameters():
        p.requires_grad_(False)
    return split, spec


def latent_defence_record(cfg: LatentConfig) -> list[dict[str, Any]]:
    """The latent mode's defence record, as the manifest has it and the handshake checks it."""
    return [{"name": "latent", "args": cfg.as_dict()}]


def surrogate_parameters(cfg: LatentConfig) -> int:
    """How many parameters the untrusted node trains (the global random state is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        return sum(p.numel() for p in GaugeSurrogate(cfg.surrogate_layers).parameters())


class LatentServer:
    """The untrusted node: the surrogate, its optimiser, the return wire's clip and noise."""

    def __init__(self, cfg: LatentConfig, lr: float, seed: int, hidden: int | None = None):
        with torch.random.fork_rng(devices=[]):  # seeded init, the global generator left as it was
            torch.manual_seed(derived_seed(seed, "init", 0, "surrogate", 0))
            self.surrogate = GaugeSurrogate(cfg.surrogate_layers)
        if hidden is not None:
            check_no_wide_parameters(self.surrogate, hidden)
        self.cfg, self.seed = cfg, seed
        self.opt = make_optimizer(self.surrogate.parameters(), lr)
        self.params = list(self.surrogate.parameters())
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.last_losses = None

    def handle(self, frame: Frame) -> Frame:
        if frame.kind == "forward":
            frame.check_finite(f"the server (step {frame.step})")
            x = frame.tensor.detach().clone().requires_grad_(True)
            with torch.set_grad_enabled(True):
                y = self.surrogate(x)
                out = torch.stack(
                    [
                        release(
                            y[b],
                            self.cfg.clip,
                            self.cfg.sigma,
                            torch_generator(self.seed, frame.phase, frame.step, "return", fid),
                        )
                        for b, fid in enumerate(frame.doc_ids)
                    ]
                )
            self._pending[frame.step] = (x, out)
            return Frame("forward-return", frame.step, frame.doc_ids, out.detach(), frame.mask, frame.phase)
        if frame.kind == "backward-top":
            if frame.step not in self._pending:
                raise ConfigError(f"an output gradient for step {frame.step} arrived with no pending forward")
            x, out = self._pending.pop(frame.step)
            g = frame.tensor.to(out.dtype)
            if frame.phase == "train" and self.opt is not None:
                out.backward(g)
                g_in = x.grad
                assert g_in is not None
                _grads_finite(self.params, "surrogate", frame.step)
                self.opt.step()
                self.opt.zero_grad(set_to_none=False)
            else:
                (g_in,) = torch.autograd.grad(out, x, grad_outputs=g)
            _finite(g_in, "input gradient", frame.step)
            return Frame("backward", frame.step, frame.doc_ids, g_in.detach(), frame.mask, frame.phase)
        raise ValueError(f"the latent server cannot handle a {frame.kind!r} frame")


@dataclass
class FrameTruth:
    """The client's own record of one frame (never crosses)."""

    frame_id: int
    phase: str
    step: int
    doc_id: int
    real: np.ndarray  # [n] bool, in the gauged order the server sees
    decoy_origins: np.ndarray  # [k, 2]: (frame id, row) of each decoy, in the client's order
    tokens: np.ndarray  # [n] the token each gauged row carries (a decoy: its origin's), for the probes' scoring
    positions: np.ndarray  # [n] a real row's position in its document, -1 for a decoy


@dataclass
class LatentClient:
    split: SplitModel
    cfg: LatentConfig
    seed: int
    channel: Channel
    lr: float
    encoder: Encoder = field(init=False)
    decoder: Decoder = field(init=False)
    pool: DecoyPool = field(init=False)
    truth: list[FrameTruth] = field(default_factory=list)
    frame_tokens: dict[int, np.ndarray] = field(default_factory=dict)  # frame id -> its document's tokens
    next_frame: int = 0
    last_losses: list[float] | None = None
    last_teacher: float | None = None
    #: keys the noise and the decoy draws under ``gauge_entropy="os"`` (None: the run seed does)
    secret: bytes | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.cfg.gauge_entropy == "os":
            self.secret = seeds.entropy(SECRET_BYTES)
        hidden = self.split.model.get_input_embeddings().weight.shape[1]
        with torch.random.fork_rng(devices=[]):  # seeded init, the global generator left as it was
            torch.manual_seed(derived_seed(self.seed, "init", 0, "codec", 0))
            self.encoder = Encoder(hidden, self.cfg.width).to(self.split.device, self.split.dtype)
            self.decoder = Decoder(self.cfg.width, hidden).to(self.split.device, self.split.dtype)
        self.params = list(self.encoder.parameters()) + list(self.decoder.parameters())
        self.opt = make_optimizer(self.params, self.lr)
        self.pool = DecoyPool(self.cfg.pool, self.cfg.width, self.split.dtype)

    def exchange(self, input_ids: torch.Tensor, doc_ids: Sequence[int], step: int, phase: str) -> list[float]:
        """The four crossings of one request; steps the encoder and decoder in training. Returns the
        per-document task loss."""
        cfg, split = self.cfg, self.split
        train = phase == "train" and self.opt is not None
        n_frames, t = input_ids.shape
        with torch.no_grad():
            h0, ctx = split.embed(input_ids)
            h_s = split.run_blocks(h0, 0, split.spec.cut, ctx)
            teacher = split.trunk(h_s, ctx) if cfg.teacher_weight > 0 else None  # the objective in both phases
        key = self.key
        fresh = cfg.decoy_release == "fresh"
        with torch.set_grad_enabled(train):
            z = self.encoder(h_s)
            # what the pool keeps of each frame: its rows before release (fresh) or as released (verbatim)
            keep = (
                z
                if fresh
                else torch.stack(
                    [
                        release(
                            z[b], cfg.clip, cfg.sigma, torch_generator(key, phase, step, "forward", self.next_frame + b)
                        )
                        for b in range(n_frames)
                    ]
                )
            )
            frame_ids = tuple(range(self.next_frame, self.next_frame + n_frames))
            self.next_frame += n_frames
            gauges: list[Gauge] = []
            sent = []
            for b, fid in enumerate(frame_ids):
                rng = np.random.default_rng(derived_seed(key, phase, step, "decoys", fid))
                decoys, origins = self.pool.draw(cfg.decoys, rng)
                rows = torch.cat([keep[b], decoys.to(keep.device, keep.dtype)])
                if cfg.gauges:
                    g = frame_gauge(self.seed, phase, step, fid, len(rows), cfg.width, scale=cfg.scale_gauge,
                                    entropy=cfg.gauge_entropy)  # fmt: skip
                else:  # the naked control: rows cross in the client's order and coordinates
                    g = Gauge(np.eye(cfg.width), np.arange(len(rows)), None)
                gauges.append(g)
                if fresh:  # 002 Figure 2: gauge (3) the mixed rows (4), then clip and noise every row (5)
                    gen = torch_generator(key, phase, step, "forward", fid)
                    sent.append(release(g.apply(rows), cfg.clip, cfg.sigma, gen))
                else:
                    sent.append(g.apply(rows))
                own = input_ids[b].detach().cpu().numpy().astype(np.int64)
                self.frame_tokens[fid] = own
                carried = np.concatenate([own, [self.frame_tokens[int(f)][int(r)] for f, r in origins]]).astype(
                    np.int64
                )
                position = np.concatenate([np.arange(t), np.full(len(origins), -1)])
                self.truth.append(
                    FrameTruth(
                        fid, phase, step, int(doc_ids[b]), g.perm < t, origins, carried[g.perm], position[g.perm]
                    )
                )
            x = torch.stack(sent)
        for b, fid in enumerate(frame_ids):  # the frame's own rows join the pool after its decoys were drawn
            self.pool.add(keep[b].detach(), np.stack([np.full(t, fid), np.arange(t)], axis=1))
        mask = torch.ones(x.shape[:2], dtype=torch.int64)
        reply = self.channel.request(Frame("forward", step, frame_ids, x.detach(), mask, phase))
        ret = reply.tensor.to(split.device, split.dtype).requires_grad_(True)
        _finite(ret, "return frame", step)
        y = torch.stack([gauges[b].inverse(ret[b])[:t] for b in range(n_frames)])
        with torch.set_grad_enabled(True):
            h_r = h_s + self.decoder(y)
            logits = split.head_logits(h_r, ctx)
            per_doc = next_token_loss(logits, input_ids, reduction="per_doc")
            _finite(per_doc, "next-token loss", step)
            loss = per_doc.sum()
            self.last_teacher = None
            if teacher is not None:
                match = F.mse_loss(F.layer_norm(h_r, h_r.shape[-1:]), F.layer_norm(teacher, teacher.shape[-1:]))
                self.last_teacher = float(match.detach())
                loss = loss + cfg.teacher_weight * n_frames * match
            if train:
                loss.backward()
                g_out = ret.grad
                assert g_out is not None
            else:
                (g_out,) = torch.autograd.grad(loss, ret)
        if cfg.output_gradient == "clip-noise":
            g_out = torch.stack(
                [
                    release(g_out[b], cfg.output_clip, cfg.output_sigma,
                            torch_generator(key, phase, step, "output-gradient", fid))
                    for b, fid in enumerate(frame_ids)
                ]
            )  # fmt: skip
        back = self.channel.request(Frame("backward-top", step, frame_ids, g_out.detach(), mask, phase))
        g_in = back.tensor.to(split.device, split.dtype)
        _finite(g_in, "input gradient", step)
        if train:
            x.backward(g_in)
            _grads_finite(self.params, "client", step)
            self.opt.step()
            self.opt.zero_grad(set_to_none=False)
        self.last_losses = [float(v) for v in per_doc.detach()]
        return self.last_losses

    @property
    def key(self) -> int | bytes:
        """What keys the client's noise and decoy draws: the per-run secret, or the run seed (derived)."""
        return self.secret if self.secret is not None else self.seed

    def max_row_releases(self) -> int:
        """The most times one document row crossed: as a real row, and (fresh decoys) re-released as a decoy."""
        doc_of = {f.frame_id: f.doc_id for f in self.truth}
        count: Counter[tuple[int, int]] = Counter()
        for f in self.truth:
            for p in f.positions[f.positions >= 0]:
                count[(f.doc_id, int(p))] += 1
            if self.cfg.decoy_release == "fresh":
                for src, r in f.decoy_origins:
                    count[(doc_of[int(src)], int(r))] += 1
        return max(count.values(), default=0)

    def truth_tensors(self) -> dict[str, torch.Tensor]:
        """The client's record as tensors: per frame its id, phase (0 train, 1 capture), step, document,
        number of rows; and per gauged row ([frames, max rows]) whether it is real (-1 past a short
        frame's end), the token it carries (a decoy: its origin's; -1 past the end) and a real row's
        position in its document (-1 for a decoy, -2 past the end)."""
        n_max = max((len(f.real) for f in self.truth), default=0)
        real = np.full((len(self.truth), n_max), -1, dtype=np.int8)
        tokens = np.full((len(self.truth), n_max), -1, dtype=np.int64)
        positions = np.full((len(self.truth), n_max), -2, dtype=np.int64)
        for i, f in enumerate(self.truth):
            real[i, : len(f.real)] = f.real
            tokens[i, : len(f.real)] = f.tokens
            positions[i, : len(f.real)] = f.positions
        cols = np.array(
            [[f.frame_id, 0 if f.phase == "train" else 1, f.step, f.doc_id, len(f.real)] for f in self.truth],
            dtype=np.int64,
        ).reshape(-1, 5)
        return {
            "frames": torch.from_numpy(cols),
            "real": torch.from_numpy(real),
            "token": torch.from_numpy(tokens),
            "position": torch.from_numpy(positions),
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {f"encoder.{k}": v.detach().clone().contiguous() for k, v in self.encoder.state_dict().items()}
        out |= {f"decoder.{k}": v.detach().clone().contiguous() for k, v in self.decoder.state_dict().items()}
        return out


@dataclass
class LatentLog:
    losses: list[float] = field(default_factory=list)
    teacher: list[float | None] = field(default_factory=list)
    doc_ids: list[int] = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "losses": self.losses,
            "teacher_match": self.teacher,
            "doc_ids": self.doc_ids,
            "seconds": self.seconds,
            "tokens": self.tokens,
            "tokens_per_second": self.tokens / self.seconds if self.seconds > 0 else None,
            "error": self.error,
        }


def train_latent(
    client: LatentClient,
    docs: Sequence[Document],
    *,
    seed: int,
    steps: int,
    progress: Progress | None = None,
    log: LatentLog | None = None,
    start: int = 0,
    on_step: Callable[[int, LatentClient], None] | None = None,
) -> LatentLog:
    """The training steps, one document each, in the run's seeded order. Resuming
    (``splitleak.training.latent_checkpoint``): ``start`` steps are done, the client and ``log`` restored to
    them; the remaining steps of the same order follow. ``on_step(done, client)`` runs after each step."""
    progress = progress or Silent()
    log = log if log is not None else LatentLog()
    task = progress.start("latent training", steps - start)
    t0 = time.perf_counter()
    ok = False
    try:
        for step, i in enumerate(training_order(len(docs), steps, seed)):
            if step < start:
                continue
            ids = ids_tensor([docs[i]], client.split.device)
            (loss,) = client.exchange(ids, (docs[i].doc_id,), step, "train")
            log.losses.append(loss)
            log.teacher.append(client.last_teacher)
            log.doc_ids.append(docs[i].doc_id)
            log.tokens += ids.numel()
            progress.advance(task)
            if on_step is not None:
                on_step(step + 1, client)
        ok = True
    finally:
        log.seconds = time.perf_counter() - t0
        end(progress, task, ok)  # "stopped", not "done", when interrupted
    return log


def capture_latent(
    client: LatentClient, docs: Sequence[Document], *, batch: int, progress: Progress | None = None
) -> dict[str, Any]:
    """Every evaluation document once through the four crossings, parameters frozen; returns the
    per-document task loss (the held-out loss as deployed) and the throughput."""
    progress = progress or Silent()
    opt, client.opt = client.opt, None
    task = progress.start("capture", len(docs))
    t0 = time.perf_counter()
    losses: list[float] = []
    ok = False
    try:
        for s in range(0, len(docs), batch):
            chunk = docs[s : s + batch]
            ids = ids_tensor(chunk, client.split.device)
            losses += client.exchange(ids, [d.doc_id for d in chunk], -1, "capture")
            progress.advance(task, len(chunk))
        ok = True
    finally:
        client.opt = opt
        end(progress, task, ok)
    secs = time.perf_counter() - t0
    n_tok = sum(len(d.token_ids) for d in docs)
    return {"seconds": secs, "tokens_per_second": n_tok / secs if secs > 0 else None, "client_losses": losses}


SECRET_FILE = "latent/secret.json"  # the client's own: the per-run secret under gauge_entropy="os"
SECRET_BYTES = 16
CODEC_FILE = "latent/codec.safetensors"
SURROGATE_FILE = "latent/surrogate.safetensors"


def privacy_accounting(cfg: LatentConfig, releases: int, delta: float = 1e-6) -> dict[str, Any]:
    """(ε, δ) per row of the forward wire's Gaussian mechanism (replace-one, Δ = 2C, zCDP), for one
    release and for ``releases`` releases of the same document row. A fresh decoy is one more release
    of its row; a verbatim one re-sends a released row (post-processing: no further cost). The return
    wire protects nothing of the client's input."""
    one = gaussian_row_epsilon(cfg.clip, cfg.sigma, 1, delta) if cfg.sigma > 0 else None
    many = gaussian_row_epsilon(cfg.clip, cfg.sigma, releases, delta) if cfg.sigma > 0 else None
    out: dict[str, Any] = {
        "delta": delta,
        "accountant": "zCDP, replace-one adjacency, sensitivity 2C per row (Bun & Steinke 2016)",
        "epsilon_per_row_one_release": one,
        "max_releases_of_a_row": releases,
        "releases_counted": "as a real row, and as a decoy (each a fresh release)"
        if cfg.decoy_release == "fresh"
        else "as a real row (a verbatim decoy re-sends a released row: post-processing)",
        "epsilon_per_row_all_releases": many,
    }
    if cfg.output_gradient == "clip-noise":
        out["output_gradient_epsilon_per_row_one_release"] = (
            gaussian_row_epsilon(cfg.output_clip, cfg.output_sigma, 1, delta) if cfg.output_sigma > 0 else None
        )
    return out
