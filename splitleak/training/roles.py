"""Client and server roles of split training. They share nothing but frames over a channel.

Plain split: the client runs the bottom and sends activations (and the labels); the server runs
the rest, computes the next-token loss, steps its optimizer and returns the gradient with respect
to the activations it received. U-shape (partial offloading): the server returns its output, the
client's top computes the loss and sends that gradient back, the server backpropagates through its
run and returns the gradient at the observation point. Label-shielded (003): a U-shape whose Bottom,
Trunk and Top all train; the client's loss supervises a mask of targets normalised by their number,
and the output gradient it sends may derive from another, exposed loss (``exposed-loss`` defences,
dual-track backpropagation). The forward defence is applied by the client before it sends; the
backward defence by the server before it returns; the ``backward-wire`` defences by the client on the
output gradient of a U-shape's second crossing.

Nothing crosses that the protocol does not need: the loss stays with the side that computes it
(the server in a plain split, the client in a U-shape), each logging it on its own side
(``last_losses``). Mixup's probe rows carry ids drawn from its chunk counter, which do not name
the document they are paired with.
"""

from __future__ import annotations

from typing import Any

import torch

from splitleak.defences import DefenceChain
from splitleak.errors import ConfigError, NonFiniteError
from splitleak.models.split import BlockContext, SplitModel, next_token_loss
from splitleak.runtime import fused_optimizer
from splitleak.wire.channel import Channel
from splitleak.wire.frames import Frame, check_finite

FLOAT64_HINT = "; if this comes from overflow in float32, rerun with --precision float64"


def _finite(t: torch.Tensor, what: str, step: int) -> None:
    where = f"step {step}" if step >= 0 else "capture"
    check_finite(t, f"{what} at {where}", FLOAT64_HINT)


def _grads_finite(params, what: str, step: int) -> None:
    """One cheap pass: a sum per gradient is NaN/Inf when any entry is (or when it overflows)."""
    sums = [p.grad.sum() for p in params if p.grad is not None]
    if sums and not torch.isfinite(torch.stack(sums)).all():
        raise NonFiniteError(f"{what} parameter gradient at step {step} is not finite (NaN or Inf){FLOAT64_HINT}")


def make_optimizer(params, lr: float):
    """AdamW (torch defaults but lr); the fused kernel where the device supports it."""
    params = [p for p in params if p.requires_grad]
    if not params:
        return None
    return fused_optimizer(torch.optim.AdamW, params, lr=lr)


#: forwards a server session holds at once awaiting their backward-top (each keeps its graph): a client
#: sends one forward and waits for its answer, so a second one before the first is answered is refused
PENDING_WINDOW = 1


class ServerRole:
    def __init__(self, split: SplitModel, chain: DefenceChain, lr: float):
        self.split = split
        self.chain = chain
        _, self.params = split.trainable_parameters()
        self.opt = make_optimizer(self.params, lr)
        self._ctx_cache: dict[tuple, BlockContext] = {}
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.last_losses: list[float] | None = None  # per document, logged on the server (plain split)

    def _context(self, frame: Frame) -> BlockContext:
        """Block arguments from the frame's shape and mask (no token values), cached per shape."""
        b, t = frame.mask.shape
        if not bool(frame.mask.all()):
            return self.split.context(b, t, frame.mask.to(self.split.device))
        if (b, t) not in self._ctx_cache:
            self._ctx_cache[(b, t)] = self.split.context(b, t)
        return self._ctx_cache[(b, t)]

    def _return_gradient(
        self, frame: Frame, h_in: torch.Tensor, out: torch.Tensor, grad_out, probe: torch.Tensor | None = None
    ) -> Frame:
        if probe is not None:  # probe rows: their gradient is returned, never trained on
            (g_probe,) = torch.autograd.grad(probe, h_in, retain_graph=True)
        if frame.phase == "train":
            out.backward(grad_out)
            g = h_in.grad
            assert g is not None  # h_in requires grad and out was computed from it
        else:  # capture: the gradient only, parameters untouched
            (g,) = torch.autograd.grad(out, h_in, grad_outputs=grad_out)
        if probe is not None:
            g = g + g_probe
        _finite(g, "gradient at the split", frame.step)
        if frame.phase == "train" and self.opt is not None:
            _grads_finite(self.params, "server", frame.step)
            self.opt.step()
            self.opt.zero_grad(set_to_none=False)  # keep the buffers: no re-allocation per step
        g = self.chain.backward(g.detach(), frame.phase, frame.step, frame.doc_ids)
        return Frame(
            "backward",
            frame.step,
            frame.doc_ids,
            g,
            frame.mask,
            frame.phase,
            payload_bits=self.chain.payload_bits("backward", 8 * g.element_size()),
        )

    def handle(self, frame: Frame) -> Frame:
        dev = self.split.device
        if frame.kind == "forward":
            frame.check_finite(f"the server (step {frame.step})")
            h_in = frame.tensor.to(dev).requires_grad_(True)
            ctx = self._context(frame)
            if self.split.spec.u_shape:
                if self.split.sends_no_gradient:  # top-only training: no gradient will come back for it
                    with torch.no_grad():
                        h_out = self.split.trunk(h_in, ctx)
                else:
                    h_out = self.split.trunk(h_in, ctx)
                    self._pending[frame.step] = (h_in, h_out)
                return Frame(
                    "forward-return",
                    frame.step,
                    frame.doc_ids,
                    h_out.detach(),
                    frame.mask,
                    frame.phase,
                    payload_bits=8 * h_out.element_size(),
                )
            logits = self.split.head_logits(self.split.trunk(h_in, ctx), ctx)
            assert frame.labels is not None  # a plain split's forward frame carries the labels
            per_doc = next_token_loss(logits, frame.labels.to(dev), reduction="per_doc")
            _finite(per_doc, "next-token loss", frame.step)
            n_main = len(per_doc) - int(frame.meta.get("probe_rows", 0))
            loss = per_doc[:n_main].sum()  # each document's gradient is that of its own mean loss
            probe = per_doc[n_main:].sum() if n_main < len(per_doc) else None
            self.last_losses = [float(x) for x in per_doc[:n_main].detach()]
            return self._return_gradient(frame, h_in, loss, None, probe)
        if frame.kind == "backward-top":
            h_in, h_out = self._pending.pop(frame.step)
            return self._return_gradient(frame, h_in, h_out, frame.tensor.to(dev))
        raise ValueError(f"server cannot handle a {frame.kind!r} frame")


class ClientRole:
    def __init__(self, split: SplitModel, chain: DefenceChain, channel: Channel, lr: float):
        self.split = split
        self.chain = chain
        self.channel = channel
        self.params, _ = split.trainable_parameters()
        self.opt = make_optimizer(self.params, lr)
        self.last_gradient: torch.Tensor | None = None  # gradient applied to the bottom's output
        self.last_losses: list[float] | None = None  # per document, when the client computes the loss (U-shape)
        self.last_raw_top_gradient: torch.Tensor | None = None  # label-shielded: g_t of the full loss
        self.last_sent_top_gradient: torch.Tensor | None = None  # label-shielded: g_t as it was sent
        chain.check_split_mode(split.spec.mode)

    def _shielded_top(
        self, h_ret: torch.Tensor, input_ids: torch.Tensor, supervised: torch.Tensor, doc_ids, step: int, phase: str
    ) -> tuple[torch.Tensor | None, list[float]]:
        """Label-shielded Top (003 §2, §4): the loss is the CE of the supervised targets normalised by their
        number N over the batch. One Top forward, two gradients (dual-track) when a defence exposes another
        loss: the full loss sets the Top's parameter gradients, the exposed one the output gradient that is
        sent. Returns (the output gradient to send before the backward-wire defences, or None in top-only
        training; per-document losses); keeps the raw output gradient of the full loss."""
        split, train = self.split, phase == "train"
        logits = split.head_logits(h_ret, split.context(*input_ids.shape))[:, :-1]
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        ce = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1), reduction="none"
        ).view(supervised.shape)
        mask = supervised.to(ce.dtype)
        n = mask.sum()
        if float(n) == 0:
            raise ConfigError(
                f"step {step}: no target of this batch is supervised (answer-only supervision on documents without "
                "answer tokens); use --data instructions with a larger --doc-len, or drop --answer-only"
            )
        full = (ce * mask).sum() / n
        _finite(full, "label-shielded loss", step)
        per_doc = [float(v) for v in ((ce * mask).sum(1) / mask.sum(1).clamp(min=1)).detach()]
        params = [p for p in split.top_parameters() if p.requires_grad] if train else []
        sends = not split.sends_no_gradient
        dual = sends and self.chain.exposes_other_loss
        wanted = params + ([h_ret] if sends else [])
        grads = torch.autograd.grad(full, wanted, retain_graph=dual) if wanted else ()
        for p, gp in zip(params, grads):
            p.grad = gp if p.grad is None else p.grad.copy_(gp)
        if not sends:
            return None, per_doc
        raw = grads[-1]
        self.last_raw_top_gradient = raw.detach()
        if not dual:
            return raw.detach(), per_doc
        with torch.no_grad():
            logp = torch.log_softmax(logits.detach().float(), dim=-1)
            entropy = -(logp.exp() * logp).sum(-1)
        w = self.chain.exposed_weights(mask.detach(), entropy, supervised, phase, step, doc_ids)
        (sent,) = torch.autograd.grad((ce * w).sum() / n, h_ret)
        return sent.detach(), per_doc

    def exchange(
        self,
        input_ids: torch.Tensor,
        doc_ids: tuple[int, ...],
        step: int,
        phase: str,
        supervised: torch.Tensor | None = None,
    ) -> list[float] | None:
        """One forward and backward through the wire; steps the client optimizer in training.
        Returns the per-document next-token loss when the client computes it (U-shape), else None
        (in a plain split the loss stays on the server). ``supervised`` [docs, T-1] bool: which targets the
        label-shielded loss supervises (None: all)."""
        split = self.split
        train = phase == "train"
        with torch.set_grad_enabled(train):
            h = split.bottom(input_ids)
        transform = self.chain.client_transform  # a defence acting on what the client sends and receives
        prepared = transform.prepare(h.detach(), input_ids, doc_ids, step, phase) if transform is not None else None
        reply = self._send_forward(h, input_ids, doc_ids, step, phase, prepared)
        self.last_losses = None
        if reply.kind == "forward-return" and split.spec.label_shielded:
            shielded = self._shielded_return(reply, input_ids, doc_ids, step, phase, supervised)
            if shielded is None:  # top-only training: nothing goes back, the Bottom and the Trunk do not train
                return self.last_losses
            reply = shielded
        elif reply.kind == "forward-return":
            reply = self._top_return(reply, input_ids, doc_ids, step, phase)
        g = self._received_gradient(reply, len(doc_ids), step, prepared)
        if train and transform is not None:
            transform.after_step(h.detach(), doc_ids, step, g)
        self.last_gradient = g
        if train and self.opt is not None:
            h.backward(g)  # straight-through the forward defence
            self._step_optimizer(step)
        return self.last_losses

    def _send_forward(
        self, h: torch.Tensor, input_ids: torch.Tensor, doc_ids, step: int, phase: str, prepared: tuple | None
    ) -> Frame:
        """The forward frame, the forward defences applied (the labels too in a plain split); the reply."""
        meta: dict[str, Any]
        if prepared is None:
            rows, row_ids, labels, meta = h.detach(), tuple(doc_ids), input_ids, {}
        else:
            rows, row_ids, labels, meta, _ = prepared
        mask = torch.ones(labels.shape, dtype=torch.int64)
        x = self.chain.forward(rows, phase, step, row_ids)
        bits = self.chain.payload_bits("forward", 8 * x.element_size())
        fwd = Frame(
            "forward",
            step,
            row_ids,
            x,
            mask,
            phase,
            labels=None if self.split.spec.u_shape else labels.cpu(),
            payload_bits=bits,
            meta=meta,
        )
        return self.channel.request(fwd)

    def _shielded_return(
        self, reply: Frame, input_ids: torch.Tensor, doc_ids, step: int, phase: str, supervised: torch.Tensor | None
    ) -> Frame | None:
        """Label-shielded: the Top's loss on the returned rows, and the output gradient sent back (its reply);
        None in top-only training, where only the Top steps and nothing goes back."""
        split = self.split
        h_ret = reply.tensor.to(split.device).requires_grad_(True)
        if supervised is None:
            supervised = torch.ones(input_ids.shape[0], input_ids.shape[1] - 1, dtype=torch.bool)
        g_top, self.last_losses = self._shielded_top(
            h_ret, input_ids, supervised.to(split.device), doc_ids, step, phase
        )
        if g_top is None:
            if phase == "train" and self.opt is not None:
                self._step_optimizer(step)
            self.last_gradient = None
            return None
        self.last_sent_top_gradient = self.chain.top_gradient(g_top, phase, step, doc_ids)
        return self._send_top_gradient(self.last_sent_top_gradient, h_ret, input_ids, doc_ids, step, phase)

    def _top_return(self, reply: Frame, input_ids: torch.Tensor, doc_ids, step: int, phase: str) -> Frame:
        """U-shape: the client's top takes the loss on the returned rows (logged here; the loss never
        crosses) and sends its gradient with respect to them, the backward-wire defences applied; the reply."""
        split = self.split
        h_ret = reply.tensor.to(split.device).requires_grad_(True)
        ctx = split.context(*input_ids.shape)
        logits = split.head_logits(h_ret, ctx)
        per_doc = next_token_loss(logits, input_ids, reduction="per_doc")
        _finite(per_doc, "next-token loss", step)
        if phase == "train":
            per_doc.sum().backward()
            g_top = h_ret.grad
            assert g_top is not None  # h_ret requires grad and the loss was computed from it
        else:
            (g_top,) = torch.autograd.grad(per_doc.sum(), h_ret)
        self.last_losses = [float(v) for v in per_doc.detach()]  # logged here; the loss never crosses
        sent = self.chain.top_gradient(g_top.detach(), phase, step, doc_ids)
        return self._send_top_gradient(sent, h_ret, input_ids, doc_ids, step, phase)

    def _send_top_gradient(
        self, sent: torch.Tensor, h_ret: torch.Tensor, input_ids: torch.Tensor, doc_ids, step: int, phase: str
    ) -> Frame:
        """The output gradient's crossing (``backward-top``); the reply: the gradient at the observation point."""
        top_mask = torch.ones(input_ids.shape, dtype=torch.int64)
        return self.channel.request(
            Frame("backward-top", step, doc_ids, sent, top_mask, phase, payload_bits=8 * h_ret.element_size())
        )

    def _received_gradient(self, reply: Frame, n_docs: int, step: int, prepared: tuple | None) -> torch.Tensor:
        """The returned gradient, checked, its blinding undone (label-shielded) and its probe rows taken off
        by the client transform that prepared the frame."""
        g = reply.tensor.to(self.split.device)
        _finite(g, "returned gradient", step)
        recovery = self.chain.recovery() if self.split.spec.label_shielded else 1.0
        if recovery != 1.0:
            g = g / recovery  # Bottom-gradient recovery: undo scale blinding's expected amplification
        if prepared is not None:
            transform = self.chain.client_transform
            assert transform is not None  # only a client transform prepares a frame
            g = transform.receive(g, n_docs, prepared[4])
        return g

    def _step_optimizer(self, step: int) -> None:
        _grads_finite(self.params, "client", step)
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)  # keep the buffers: no re-allocation per step
