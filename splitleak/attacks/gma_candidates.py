"""GMA-SL over candidate labels (``candidates=K``, ours): the soft labels of each position live on K tokens
chosen from the traffic alone, so that a step costs the Top's blocks and not its LM head.

Why. With V = 49,152 (SmolLM2) each step of ``gma.match_labels`` multiplies the soft labels by the head's
[V, H] weight twice (the vector-Jacobian product and its derivative): on SmolLM2's audit that is 46 % of a step,
and the V-sized softmax and differences another 11 % (benchmarks/RESULTS.md, "The label-shielded audit's
reader"). The gradient the proxy returns is linear in the soft labels q through the head::

    g(q) = B^T W^T (p - q) / N,

B the Jacobian of the final hidden state x (the blocks and the final norm) at the observed trunk output, W the
head's weight, p the proxy's own prediction. W^T p is computed once over the whole vocabulary; q is kept on K
tokens per position, so W^T q is a sum of K rows of W.

Which K. At the uniform start, the first-order change of the distance when q moves towards token v is
d_a · W_v (d_a the distance's gradient with respect to W^T q, one pass over the whole vocabulary): the K tokens
that lower it most are the candidates. On SmolLM2's two pinned label-shielded runs the true label is among the
first 32 at 99.2 % and 100 % of positions, and first at 85.3 % and 98.0 % (the rest of the audit's frame ranks it
up to 4,843rd, where the full matching does not read it either). The matching itself is ``gma.match_labels``'s:
Adam on the K logits from zero (uniform over the candidates), the same distances, normaliser and stopping rules.

Knowledge: the candidates come from the proxy, the trunk output and the returned gradient, nothing else. The
proxy must expose its body and head (``PublicTop.hidden``, ``PublicTop.head``); a model whose logits are capped
(Gemma's ``final_logit_softcapping``) is refused, as the head is then not linear.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from splitleak.attacks.gma_core import Rules, optimise_soft_labels
from splitleak.errors import ConfigError


def candidate_proxy(top: Any) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.nn.Linear]:
    """The proxy's body (trunk output [b, T, H] -> final hidden state [b, T, H]) and its linear head."""
    hidden, head = getattr(top, "hidden", None), getattr(top, "head", None)
    if not callable(hidden) or not isinstance(head, torch.nn.Linear):
        raise ConfigError(
            "GMA-SL: candidates > 0 needs a proxy Top that exposes its body and linear head (hidden(h) and head, "
            "as splitleak.attacks.knowledge.PublicTop does); pass candidates=0 for any other callable"
        )
    if getattr(top, "softcap", None):
        raise ConfigError(
            "GMA-SL: candidates > 0 needs logits linear in the final hidden state; this model caps its logits "
            "(final_logit_softcapping): use candidates=0"
        )
    return hidden, head


def match_chunk_candidates(
    top: Any,
    h: torch.Tensor,
    g_obs: torch.Tensor,
    active: torch.Tensor,
    N: float,
    k: int,
    rules: Rules,
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """One chunk's labels over its candidates; returns (steps taken, final per-document distance, labels
    [m, T-1] as token ids)."""
    hidden, head = candidate_proxy(top)
    with sdpa_kernel(SDPBackend.MATH), torch.enable_grad():
        h = h.detach().clone().requires_grad_(True)
        x = hidden(h)[:, :-1]  # the body's forward graph, kept for every step's vector-Jacobian product
        W = head.weight.detach().float()
        p = torch.softmax(head(x.detach()).float(), dim=-1)
        a_p = p @ W  # W^T p, once over the whole vocabulary
        cand = _candidates(x, h, (a_p, W), g_obs, active, N, k, rules)
        rows = W[cand]  # [m, T-1, K, H]
        steps_taken, dist, z = optimise_soft_labels(
            x, h, lambda q: ((a_p - torch.einsum("mtk,mtkh->mth", q, rows)) / N).to(x.dtype),
            torch.zeros(cand.shape, dtype=torch.float32), g_obs, active, rules,
        )  # fmt: skip
        labels = cand.gather(-1, z.argmax(-1, keepdim=True)).squeeze(-1)
    # a document with no gradient was not matched: its label is that of uniform logits over the vocabulary
    labels[~active.to(labels.device)] = 0
    return steps_taken, dist, labels.cpu()


def _candidates(
    x: torch.Tensor, h: torch.Tensor, head: tuple[torch.Tensor, torch.Tensor], g_obs: torch.Tensor,
    active: torch.Tensor, N: float, k: int, rules: Rules,
) -> torch.Tensor:  # fmt: skip
    """[m, T-1, K] token ids: per position, the K tokens towards which moving the uniform soft labels lowers the
    chunk's distance most (first order). ``head``: W^T p and the head's weight W."""
    a_p, W = head
    a_u = W.mean(0).expand_as(a_p).clone().requires_grad_(True)  # W^T q at the uniform q
    (g_hat,) = torch.autograd.grad(
        x, h, grad_outputs=((a_p - a_u) / N).to(x.dtype), create_graph=True, retain_graph=True
    )
    weight = active.to(h.device, torch.float32)
    objective = (rules.distance_of(g_hat, g_obs.detach().to(h.device)) * weight).sum()
    (d_a,) = torch.autograd.grad(objective, a_u)
    return (-(d_a @ W.T)).topk(min(k, W.shape[0]), dim=-1).indices
