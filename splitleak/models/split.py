"""Cut a Hugging Face causal LM into a client bottom, a server trunk and a top.

The cut reuses the model's own forward to prepare what every block needs (position ids, the
attention mask in the form the attention kernel expects, rotary cos/sin, per-layer sliding-window
masks): the block list is swapped for recorders that capture each block's arguments and pass the
hidden state through. The real blocks are then run segment by segment with exactly those arguments,
so the hidden state at the cut equals the uncut model's, whatever the architecture.

Segments (N blocks):

- plain split at depth L: client = embeddings + blocks [0, L); server = blocks [L, N) + final norm
  + LM head (the server holds the labels); observation point after L blocks.
- partial offloading (What Gradients Add §5, U-shape): the server trains the run [b, b+s); the client keeps
  [0, b), [b+s, N), the final norm, the head and the labels. Split software needs at least one
  block on the client, so the observation point is after max(1, b) blocks: for b = 0, block 0 is
  computed on the client but belongs to the trained run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from splitleak.errors import ConfigError, ModelError
from splitleak.models.presets import LoadedModel
from splitleak.models.structure import find_blocks, find_final_norm


class _StopTrace(Exception):
    pass


class _Recorder(nn.Module):
    """Stands in for block i while tracing: records its call, passes the hidden state on."""

    def __init__(self, index: int, sink: "BlockContext", last: int, block: nn.Module):
        super().__init__()
        self.index = index
        self.sink = sink
        self.last = last
        for attr in ("attention_type", "layer_idx", "is_sliding", "sliding_window"):
            if hasattr(block, attr):
                setattr(self, attr, getattr(block, attr))

    def forward(self, hidden_states, *args, **kwargs):
        if self.index == 0:
            self.sink.embedded = hidden_states
        self.sink.calls.append((args, kwargs))
        if self.index == self.last:
            raise _StopTrace
        return hidden_states


@dataclass
class BlockContext:
    """Per-block call arguments for one (batch, length, mask) shape; independent of token values."""

    calls: list[tuple[tuple, dict]] = field(default_factory=list)
    embedded: torch.Tensor | None = None


@dataclass(frozen=True)
class SplitSpec:
    n_blocks: int
    cut: int  # observation point: activations after `cut` blocks cross the wire
    server_start: int  # first block the server computes (== cut)
    server_end: int  # one past the last block the server computes
    trained_start: int  # first block trained under partial offloading (b), else 0
    u_shape: bool  # top (blocks after server_end, norm, head, labels) stays on the client
    label_shielded: bool = False  # a U-shape whose Bottom, Trunk and Top all train (003)

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        if not self.label_shielded:
            d.pop("label_shielded")  # the manifests of the other modes stay as they were
        return d

    @property
    def mode(self) -> str:
        """The split mode: "plain", "u-shape" (partial offloading) or "label-shielded"."""
        return "label-shielded" if self.label_shielded else "u-shape" if self.u_shape else "plain"


def shielded_spec(n_blocks: int, bottom: int, top: int) -> SplitSpec:
    """Label-shielded: the client's Bottom is blocks [0, bottom), its Top the last ``top`` blocks; the
    server's Trunk is every block between, at least one."""
    if bottom < 1 or top < 1 or bottom + top >= n_blocks:
        raise ConfigError(
            f"--bottom-blocks {bottom} and --top-blocks {top} leave no Trunk block of the model's {n_blocks}; "
            f"need both >= 1 and bottom + top <= {n_blocks - 1}"
        )
    return SplitSpec(n_blocks, bottom, bottom, n_blocks - top, 0, True, True)


def make_spec(
    n_blocks: int, depth: int | None = None, offload_start: int | None = None, offload_length: int | None = None
) -> SplitSpec:
    if offload_start is None and offload_length is None:
        if depth is None:
            raise ConfigError("give --depth L (plain split) or --offload-start b --offload-length s")
        if not 1 <= depth < n_blocks:
            raise ConfigError(
                f"depth {depth} is out of range for a model with {n_blocks} blocks; choose 1 <= depth <= {n_blocks - 1}"
            )
        return SplitSpec(n_blocks, depth, depth, n_blocks, 0, False)
    if offload_start is None or offload_length is None:
        raise ConfigError("partial offloading needs both --offload-start b and --offload-length s")
    b, s = offload_start, offload_length
    if b < 0 or s < 1 or b + s > n_blocks:
        raise ConfigError(
            f"offloaded run [b, b+s) = [{b}, {b + s}) does not fit {n_blocks} blocks; "
            f"need b >= 0, s >= 1 and b + s <= {n_blocks}"
        )
    cut = max(1, b)
    if cut >= b + s:
        raise ConfigError(
            f"offloaded run [{b}, {b + s}) leaves no block on the server after the observation point "
            f"max(1, b) = {cut}; use --offload-length >= 2 when --offload-start is 0"
        )
    if depth is not None and depth != cut:
        raise ConfigError(
            f"--depth {depth} contradicts partial offloading, whose observation point is max(1, b) = {cut}; "
            "omit --depth"
        )
    return SplitSpec(n_blocks, cut, cut, b + s, b, True)


class SplitModel:
    """A causal LM cut into bottom (client), trunk (server) and top, sharing one set of weights.

    The LM head is untied from the input embeddings so that client and server each own their copy.
    """

    def __init__(
        self,
        lm: LoadedModel,
        depth: int | None = None,
        offload_start: int | None = None,
        offload_length: int | None = None,
        shielded: Any = None,
    ):
        """``shielded``: a ``ShieldedConfig`` (label-shielded mode; its bottom and top counts cut the model)."""
        self.lm = lm
        self.shielded = shielded
        self.model = lm.model
        self.owner, self.blocks, self._blocks_attr = find_blocks(self.model)
        self.norm = find_final_norm(self.owner)
        head = self.model.get_output_embeddings()
        if head is None:
            raise ModelError(f"{type(self.model).__name__} has no LM head (get_output_embeddings() is None)")
        self.head = head
        if shielded is not None:
            if depth is not None or offload_start is not None or offload_length is not None:
                raise ConfigError(
                    "the label-shielded mode cuts by its bottom and top counts; omit depth and offloading"
                )
            self.spec = shielded_spec(len(self.blocks), shielded.bottom, shielded.top)
        else:
            self.spec = make_spec(len(self.blocks), depth, offload_start, offload_length)
        self._untie_head()
        self._softcap = getattr(self.model.config, "final_logit_softcapping", None)

    # ------------------------------------------------------------------ structure
    def _untie_head(self) -> None:
        emb = self.model.get_input_embeddings()
        if self.head.weight is emb.weight or self.head.weight.data_ptr() == emb.weight.data_ptr():
            self.head.weight = nn.Parameter(emb.weight.detach().clone())
        if hasattr(self.model.config, "tie_word_embeddings"):
            self.model.config.tie_word_embeddings = False

    @property
    def dtype(self) -> torch.dtype:
        return self.head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def embedding_modules(self) -> list[nn.Module]:
        """Children of the base model other than the blocks and the final norm (wte, wpe, rotary...)."""
        return [m for name, m in self.owner.named_children() if name != self._blocks_attr and m is not self.norm]

    def bottom_parameters(self) -> list[nn.Parameter]:
        ps = [p for m in self.embedding_modules() for p in m.parameters()]
        ps += [p for i in range(self.spec.cut) for p in self.blocks[i].parameters()]
        return ps

    def trunk_parameters(self) -> list[nn.Parameter]:
        return [p for i in range(self.spec.server_start, self.spec.server_end) for p in self.blocks[i].parameters()]

    def top_parameters(self) -> list[nn.Parameter]:
        ps = [p for i in range(self.spec.server_end, self.spec.n_blocks) for p in self.blocks[i].parameters()]
        return ps + list(self.norm.parameters()) + list(self.head.parameters())

    @property
    def sends_no_gradient(self) -> bool:
        """Label-shielded top-only training: the client trains its Top alone and returns no gradient."""
        return self.shielded is not None and self.shielded.train == "top-only"

    def trained_block_range(self) -> tuple[int, int] | None:
        """[b, b+s) under partial offloading; None when every parameter trains (plain split, label-shielded)."""
        return (
            (self.spec.trained_start, self.spec.server_end)
            if self.spec.u_shape and not self.spec.label_shielded
            else None
        )

    def trainable_parameters(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(client-side, server-side) parameters that train; the rest are frozen."""
        if self.spec.label_shielded:
            train = self.shielded.train if self.shielded is not None else "all"
            client = self.top_parameters() if train == "top-only" else self.bottom_parameters() + self.top_parameters()
            return client, self.trunk_parameters() if train == "all" else []
        rng = self.trained_block_range()
        if rng is None:
            client = self.bottom_parameters()
            server = self.trunk_parameters() + self.top_parameters()
            return client, server
        b, end = rng
        client = [p for i in range(b, self.spec.cut) for p in self.blocks[i].parameters()]
        server = self.trunk_parameters()
        return client, server

    def release_client_side(self) -> int:
        """On the server: free the weights it never reads (the token embedding matrix, the blocks
        outside its range, and in a U-shape the LM head, which stays with the client). Their
        parameters keep their place, empty (a width-H matrix keeps its second dimension, which the
        block context reads). Take the model's fingerprint before. Returns the elements freed."""
        keep = {id(p) for i in range(self.spec.server_start, self.spec.server_end) for p in self.blocks[i].parameters()}
        keep |= {id(p) for p in self.norm.parameters()}
        if not self.spec.u_shape:
            keep |= {
                id(p) for i in range(self.spec.server_end, self.spec.n_blocks) for p in self.blocks[i].parameters()
            }
            keep |= {id(p) for p in self.head.parameters()}
        emb = self.model.get_input_embeddings().weight
        drop = [emb] + [p for i in range(self.spec.n_blocks) for p in self.blocks[i].parameters()]
        drop += list(self.head.parameters())
        freed = 0
        for p in drop:
            if id(p) in keep or p.numel() == 0:
                continue
            freed += p.numel()
            shape = (0, p.shape[1]) if p.dim() == 2 and (p is emb or p is self.head.weight) else (0,)
            p.data = torch.empty(shape, dtype=p.dtype, device=p.device)
        return freed

    def client_state_dict(self) -> dict[str, torch.Tensor]:
        """The client's layers as the attacker's 'trained copy': embeddings and blocks [0, cut)."""
        prefix = {id(m): n for n, m in self.model.named_modules()}
        out: dict[str, torch.Tensor] = {}
        mods = self.embedding_modules() + [self.blocks[i] for i in range(self.spec.cut)]
        for m in mods:
            for k, v in m.state_dict().items():
                out[f"{prefix[id(m)]}.{k}"] = v.detach().clone().contiguous()
        return out

    # ------------------------------------------------------------------ forward pieces
    def _trace(self, input_ids=None, inputs_embeds=None, attention_mask=None) -> BlockContext:
        ctx = BlockContext()
        recorders = nn.ModuleList([_Recorder(i, ctx, len(self.blocks) - 1, b) for i, b in enumerate(self.blocks)])
        setattr(self.owner, self._blocks_attr, recorders)
        try:
            self.owner(
                input_ids=input_ids,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                use_cache=False,
            )
        except _StopTrace:
            pass
        finally:
            setattr(self.owner, self._blocks_attr, self.blocks)
        if len(ctx.calls) != len(self.blocks):
            raise ModelError(
                f"{type(self.model).__name__}: traced {len(ctx.calls)} of {len(self.blocks)} block calls; "
                "this architecture does not run its blocks once each in order and cannot be cut here"
            )
        return ctx

    def context(self, batch: int, seq_len: int, attention_mask: torch.Tensor | None = None) -> BlockContext:
        """Block arguments for a shape, computed without token values (what the server can compute)."""
        dim = self.model.get_input_embeddings().weight.shape[1]
        with torch.no_grad():
            zeros = torch.zeros(batch, seq_len, dim, dtype=self.dtype, device=self.device)
            ctx = self._trace(inputs_embeds=zeros, attention_mask=attention_mask)
        ctx.embedded = None
        return ctx

    def embed(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, BlockContext]:
        """Input of block 0 (with gradient to the embeddings) and the block arguments."""
        ctx = self._trace(input_ids=input_ids, attention_mask=attention_mask)
        assert ctx.embedded is not None
        return ctx.embedded, ctx

    def run_blocks(self, hidden: torch.Tensor, start: int, end: int, ctx: BlockContext) -> torch.Tensor:
        for i in range(start, end):
            args, kwargs = ctx.calls[i]
            out = self.blocks[i](hidden, *args, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def bottom(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Client side up to the observation point: activations that cross the wire."""
        h, ctx = self.embed(input_ids, attention_mask)
        return self.run_blocks(h, 0, self.spec.cut, ctx)

    def trunk(self, hidden: torch.Tensor, ctx: BlockContext) -> torch.Tensor:
        return self.run_blocks(hidden, self.spec.server_start, self.spec.server_end, ctx)

    def head_hidden(self, hidden: torch.Tensor, ctx: BlockContext) -> torch.Tensor:
        """Blocks after the server's run and the final norm: what the LM head reads."""
        return self.norm(self.run_blocks(hidden, self.spec.server_end, self.spec.n_blocks, ctx))

    def head_logits(self, hidden: torch.Tensor, ctx: BlockContext) -> torch.Tensor:
        """Blocks after the server's run, final norm, LM head."""
        logits = self.head(self.head_hidden(hidden, ctx))
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    def full_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """All segments in one process (the all-local path)."""
        h, ctx = self.embed(input_ids, attention_mask)
        h = self.run_blocks(h, 0, self.spec.server_end, ctx)
        return self.head_logits(h, ctx)


def next_token_loss(logits: torch.Tensor, input_ids: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of predicting token t+1 from position t, in float32 or wider."""
    logits = logits[:, :-1, :]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    targets = input_ids[:, 1:]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    ).view(targets.shape)
    if reduction == "none":
        return loss
    if reduction == "per_doc":
        return loss.mean(dim=1)
    return loss.mean()
