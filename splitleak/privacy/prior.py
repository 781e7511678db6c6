"""The prior success κ a reconstruction bound is read against: what the public model guesses without any
traffic.

- A token at position t ≥ 1: the public model's top-1 probability given the true prefix (the informed adversary
  knows every other token). The first token has no prefix to predict it from: κ = 1 there (counted as guessed;
  the bound is then 1 at that position, so the mean token bound stays an upper bound).
- A whole document: the probability of the public model's greedy continuation of its first token (an estimate
  of its best guess's probability, said so in every report: a sequence's most probable continuation is not
  computable exactly).
"""

from __future__ import annotations

import torch


@torch.no_grad()
def token_priors(model: torch.nn.Module, token_ids: torch.Tensor) -> torch.Tensor:
    """[n, T] κ per position of the documents ``token_ids`` [n, T] (``model``: a causal LM with a head)."""
    ids = token_ids.to(next(model.parameters()).device)
    logits = model(input_ids=ids).logits.float()
    top = torch.softmax(logits[:, :-1], dim=-1).max(dim=-1).values
    return torch.cat([torch.ones_like(top[:, :1]), top], dim=1).cpu()


@torch.no_grad()
def document_priors(model: torch.nn.Module, token_ids: torch.Tensor) -> torch.Tensor:
    """[n] the probability of the public model's greedy continuation of each document's first token, over its
    T - 1 later positions."""
    device = next(model.parameters()).device
    seq = token_ids[:, :1].to(device)
    logp = torch.zeros(seq.shape[0], device=device, dtype=torch.float64)
    for _ in range(token_ids.shape[1] - 1):
        probs = torch.softmax(model(input_ids=seq).logits[:, -1].double(), dim=-1)
        best, nxt = probs.max(dim=-1)
        logp += best.log()
        seq = torch.cat([seq, nxt[:, None]], dim=1)
    return logp.exp().cpu()
