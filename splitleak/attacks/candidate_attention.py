"""Attention for ``ClientCopy.extend``: k candidate next tokens, each attending to its row's cached prefix
and to itself only.

Through transformers' attention (sdpa or eager) the k candidates are k queries against t + k keys with a 4-D
mask that hides the other candidates: the scores are a [k, t + k] product per head, of which only t + 1
columns per query survive the mask. At the prefix search's wide rounds (SipIt's passes of hundreds of
candidates behind a prefix of at most a few dozen tokens) that masked square costs more than the layers'
projections. Here the same attention is computed from its two parts, linear in k: the scores against the
shared prefix ([k, t] per head, one product) and each candidate's score against its own key (a row-wise dot
product), one softmax over the t + 1 columns, and the weighted sum of the prefix values plus each
candidate's own value. It is the masked attention's arithmetic without the masked entries, so it agrees with
it to float rounding (``tests/test_candidate_attention.py``), not bit for bit.

``extend_attention(position, k)`` turns it on for one forward of a model whose config it switches to
``NAME`` (and back); anything this path does not cover (dropout, a sliding window, soft-capping, attention
sinks, a shape other than [rows, heads, k, dh] against t + k keys) goes to transformers' sdpa with the
4-D mask ``extend`` builds, which gives the same result.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch

#: the name this attention is registered under in transformers' ``AttentionInterface``
NAME = "splitleak_candidates"

#: (prefix length t, candidates k, [calls that took the linear path]) of the forward in progress, or None
_ACTIVE: contextvars.ContextVar[tuple[int, int, list[int]] | None] = contextvars.ContextVar(
    "splitleak_candidate_attention", default=None
)
_UNCOVERED = ("softcap", "sliding_window", "s_aux", "position_bias")


def _sdpa(*args, **kwargs):
    # lazy: transformers only where a model runs: reports and the results store load this module without one
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kwargs)


def candidate_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention signature: query [b, h, k, dh], key and value [b, h_kv, t + k, dh] (the cached
    prefix, then the k candidates' own entries); returns ([b, k, h, dh], None)."""
    state = _ACTIVE.get()
    b, h, q_len, dh = query.shape
    h_kv, kv_len = key.shape[1], key.shape[2]
    covered = state is not None and (
        q_len == state[1]
        and kv_len == state[0] + state[1]
        and h % h_kv == 0
        and not dropout
        and all(kwargs.get(name) is None for name in _UNCOVERED)
    )
    if state is None or not covered:
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    t, k, taken = state
    taken.append(1)
    g = h // h_kv  # query heads per key/value head (grouped-query attention), as transformers' repeat_kv maps them
    scale = dh**-0.5 if scaling is None else scaling
    q = query.reshape(b, h_kv, g, k, dh)
    own = (q * key[:, :, t:].unsqueeze(2)).sum(-1, keepdim=True)  # [b, h_kv, g, k, 1]
    if t:
        prefix = torch.matmul(q.reshape(b, h_kv, g * k, dh), key[:, :, :t].transpose(-1, -2))
        scores = torch.cat([prefix.view(b, h_kv, g, k, t), own], dim=-1)
    else:
        scores = own
    w = torch.softmax(scores * scale, dim=-1, dtype=torch.float32).to(query.dtype)
    out = w[..., t:] * value[:, :, t:].unsqueeze(2)  # each candidate's own value
    if t:
        out = out + torch.matmul(w[..., :t].reshape(b, h_kv, g * k, t), value[:, :, :t]).view(b, h_kv, g, k, dh)
    return out.reshape(b, h, k, dh).transpose(1, 2).contiguous(), None


def _register() -> None:
    # lazy: transformers only where a model runs: reports and the results store load this module without one
    from transformers import AttentionInterface

    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, candidate_attention)


@contextlib.contextmanager
def extend_attention(config, position: int, k: int) -> Iterator[list[int]]:
    """Within: the model of ``config`` attends as ``candidate_attention`` for k candidates behind prefixes of
    ``position`` tokens. Yields the list the linear path appends to once per layer it served."""
    _register()
    before = config._attn_implementation
    taken: list[int] = []
    token = _ACTIVE.set((position, k, taken))
    config._attn_implementation = NAME
    try:
        yield taken
    finally:
        config._attn_implementation = before
        _ACTIVE.reset(token)
