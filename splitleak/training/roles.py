"""Client and server roles of split training. They share nothing but frames over a channel.

Plain split: the client runs the bottom and sends activations (and the labels); the server runs
the rest, computes the next-token loss, steps its optimizer and returns the gradient with respect
to the activations it received. U-shape (partial offloading): the server returns its output, the
client's top computes the loss and sends that gradient back, the server backpropagates through its
run and returns the gradient at the observation point. The forward defence is applied by the
client before it sends; the backward defence by the server before it returns. Defences act on the
observation-point crossing only (forward / backward), not on the second crossing of a U-shape.
"""

from __future__ import annotations

import torch

from splitleak.errors import NonFiniteError
from splitleak.models.split import BlockContext, SplitModel, next_token_loss
from splitleak.wire.channel import Channel
from splitleak.wire.defences import DefenceChain
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
    try:
        return torch.optim.AdamW(params, lr=lr, fused=True)
    except (RuntimeError, ValueError):  # a device or dtype without the fused kernel
        return torch.optim.AdamW(params, lr=lr)


class ServerRole:
    def __init__(self, split: SplitModel, chain: DefenceChain, lr: float):
        self.split = split
        self.chain = chain
        _, self.params = split.trainable_parameters()
        self.opt = make_optimizer(self.params, lr)
        self._ctx_cache: dict[tuple, BlockContext] = {}
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _context(self, frame: Frame) -> BlockContext:
        """Block arguments from the frame's shape and mask (no token values), cached per shape."""
        b, t = frame.mask.shape
        if not bool(frame.mask.all()):
            return self.split.context(b, t, frame.mask.to(self.split.device))
        if (b, t) not in self._ctx_cache:
            self._ctx_cache[(b, t)] = self.split.context(b, t)
        return self._ctx_cache[(b, t)]

    def _return_gradient(self, frame: Frame, h_in: torch.Tensor, out: torch.Tensor, grad_out, meta: dict) -> Frame:
        if frame.phase == "train":
            out.backward(grad_out)
            g = h_in.grad
        else:  # capture: the gradient only, parameters untouched
            (g,) = torch.autograd.grad(out, h_in, grad_outputs=grad_out)
        _finite(g, "gradient at the split", frame.step)
        if frame.phase == "train" and self.opt is not None:
            _grads_finite(self.params, "server", frame.step)
            self.opt.step()
            self.opt.zero_grad(set_to_none=False)  # keep the buffers: no re-allocation per step
        g = self.chain.backward(g.detach(), frame.phase, frame.step, frame.doc_ids)
        return Frame(
            "backward", frame.step, frame.doc_ids, g, frame.mask, frame.phase,
            payload_bits=self.chain.payload_bits("backward", 8 * g.element_size()), meta=meta,
        )

    def handle(self, frame: Frame) -> Frame:
        dev = self.split.device
        if frame.kind == "forward":
            frame.check_finite(f"the server (step {frame.step})")
            h_in = frame.tensor.to(dev).requires_grad_(True)
            ctx = self._context(frame)
            if self.split.spec.u_shape:
                h_out = self.split.trunk(h_in, ctx)
                self._pending[frame.step] = (h_in, h_out)
                return Frame(
                    "forward-return", frame.step, frame.doc_ids, h_out.detach(), frame.mask, frame.phase,
                    payload_bits=8 * h_out.element_size(),
                )
            logits = self.split.head_logits(self.split.trunk(h_in, ctx), ctx)
            per_doc = next_token_loss(logits, frame.labels.to(dev), reduction="per_doc")
            loss = per_doc.sum()  # each document's gradient is that of its own mean loss
            _finite(loss, "next-token loss", frame.step)
            return self._return_gradient(frame, h_in, loss, None, {"loss": [float(x) for x in per_doc.detach()]})
        if frame.kind == "backward-top":
            h_in, h_out = self._pending.pop(frame.step)
            return self._return_gradient(frame, h_in, h_out, frame.tensor.to(dev), dict(frame.meta))
        raise ValueError(f"server cannot handle a {frame.kind!r} frame")


class ClientRole:
    def __init__(self, split: SplitModel, chain: DefenceChain, channel: Channel, lr: float):
        self.split = split
        self.chain = chain
        self.channel = channel
        self.params, _ = split.trainable_parameters()
        self.opt = make_optimizer(self.params, lr)

    def exchange(self, input_ids: torch.Tensor, doc_ids: tuple[int, ...], step: int, phase: str) -> list[float]:
        """One forward and backward through the wire; steps the client optimizer in training.
        Returns the per-document next-token loss."""
        split = self.split
        mask = torch.ones(input_ids.shape, dtype=torch.int64)
        train = phase == "train"
        with torch.set_grad_enabled(train):
            h = split.bottom(input_ids)
        x = self.chain.forward(h.detach(), phase, step, doc_ids)
        bits = self.chain.payload_bits("forward", 8 * x.element_size())
        fwd = Frame(
            "forward", step, doc_ids, x, mask, phase,
            labels=None if split.spec.u_shape else input_ids.cpu(), payload_bits=bits,
        )
        reply = self.channel.request(fwd)
        if reply.kind == "forward-return":
            h_ret = reply.tensor.to(split.device).requires_grad_(True)
            ctx = split.context(*input_ids.shape)
            logits = split.head_logits(h_ret, ctx)
            per_doc = next_token_loss(logits, input_ids, reduction="per_doc")
            _finite(per_doc, "next-token loss", step)
            if train:
                per_doc.sum().backward()
                g_top = h_ret.grad
            else:
                (g_top,) = torch.autograd.grad(per_doc.sum(), h_ret)
            reply = self.channel.request(
                Frame("backward-top", step, doc_ids, g_top.detach(), mask, phase,
                      payload_bits=8 * h_ret.element_size(), meta={"loss": [float(v) for v in per_doc.detach()]})
            )
        g = reply.tensor.to(split.device)
        _finite(g, "returned gradient", step)
        if train and self.opt is not None:
            h.backward(g)  # straight-through the forward defence
            _grads_finite(self.params, "client", step)
            self.opt.step()
            self.opt.zero_grad(set_to_none=False)  # keep the buffers: no re-allocation per step
        return list(reply.meta.get("loss", []))
