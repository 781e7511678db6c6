"""The adaptive joint attacker (ours, issue #20): the joint attacker's gradient candidates, taken only
where the gradient reads well enough to be worth the activation candidates they displace.

The fixed-half joint attacker (``beam.JointBeam``, What Gradients Add §3.1) always gives half of the k
slots per position to the gradient read-out. How much that read-out is worth depends on how many blocks
sit between the cut and the loss: with few server blocks it gains much over the activation-only
attacker, with many it loses a little (measured on SmolLM2 in experiments/PILOTS.md). ``joint-adaptive`` keeps
k candidates per position (so it costs what activation-only costs) and decides per position how many of
them come from the gradient, from estimates it makes on the observed traffic and the attacker's own
calibration documents; no label, server layer, evaluation text or truth enters.

How (every number below is ours; each is a parameter with the default given):

1. Candidates. The activation list A_t (ridge estimate, cosine top-k, as ``activation``) and the
   gradient read-out G_t (the tokens whose input embeddings are most cosine-similar to −gradient at
   t−1, the ``gradient`` read-out of ``beam``), ranked.
2. Confidence of the read-out at a position: the cosine of −gradient with its top-1 token minus that with
   its top-2 (a sharp read-out names one token). Positions are put into ``bins`` (4) equal-count bins of
   this confidence, by quantiles over the traffic's positions 1..T−1.
3. Pseudo-truth. At the ``anchor_share`` (25 %) of positions where the activation decode is most
   confident (the ridge estimate's cosine margin between its top-1 and top-2 tokens), the activation
   top-1 stands in for the truth. In bin b the gradient's precision at rank j, p_G(b, j), is the share
   of these anchors where G_t[j] equals it: pooled over rank blocks [0], [1], [2, 4), [4, 8), ...,
   taken at its Wilson lower bound (``z`` = 1.64, one-sided 95 %), made non-increasing over ranks, and
   zero in a bin with fewer than ``min_anchors`` (16) anchors. This assumes that whether the gradient
   reads a token does not depend on whether the activations read it confidently.
4. The activation list's precision at rank r, p_A(r), comes from the calibration documents: the ridge
   map's exact leave-one-out estimate of each calibration row's input embedding (from the hat matrix of
   the fit the attack already makes), ranked by cosine as the traffic's are; pooled over the same rank
   blocks, (hits + 1/2) / (trials + 1), positions 1..T−1.
5. Gate. In bin b, gradient rank j takes the slot of activation rank r = k−1−j (the least likely
   activation candidates go first), j = 0, 1, ..., while, with the two channels taken as independent,
   what it is expected to add beats ``margin`` (2) times what the displaced candidate is expected to
   lose: p_G(b, j) · (1 − Σ_{r'<r} p_A(r')) > margin · p_A(r) · (1 − Σ_{j'≤j} p_G(b, j')). At most
   ``max_gradient`` (default k/2, the fixed-half joint attacker's share) slots go to the gradient;
   position 0 has no gradient before it and keeps all k activation candidates.
6. The list at a position with s gradient slots: the top k−s activation candidates, then the top s
   gradient candidates not among them, then further activation candidates where the two overlapped
   (with s = k/2 everywhere it is the joint attacker's list, ``beam.merge_candidates``; with s = 0 the
   activation-only list). Beam search of width 2 over recomputed activations, as both attackers.

Where the gradient reads nothing (many server blocks, noise), the anchors rarely agree with it, p_G stays
near zero and the list is the activation-only list; where it reads well (few server blocks) every
position gets slots, as many as the read-out's ranks are worth (a sharp read-out's top-1 is right and its
lower ranks add little: 1-2 slots; a blurred one up to k/2); what it read on SmolLM2 is in
experiments/PILOTS.md. Only the ``gradient`` read-out is used: the ``pseudo-map`` read-out
is fitted on the activation decode itself, so its agreement with that decode says nothing about the
gradient (the attack takes no ``readout``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from pydantic import PositiveInt

from splitleak.attacks.base import Candidates, Reconstruction
from splitleak.attacks.beam import DEFAULT_GRADIENT_SOURCE, ActivationBeam, GradientSource, _GradientReader
from splitleak.attacks.knowledge import Knowledge, Traffic
from splitleak.errors import ConfigError
from splitleak.progress import Progress


def cosine_top(queries: torch.Tensor, embedding: torch.Tensor, k: int, chunk: int = 2048):
    """Cosines and indices of the k most cosine-similar embedding rows, best first: [..., d] -> 2 x [..., k]."""
    shape = queries.shape[:-1]
    flat = queries.reshape(-1, queries.shape[-1])
    e = torch.nn.functional.normalize(embedding, dim=-1)
    vals, idx = [], []
    for s in range(0, flat.shape[0], chunk):
        q = torch.nn.functional.normalize(flat[s : s + chunk].to(e.dtype), dim=-1)
        top = torch.topk(q @ e.T, k, dim=-1)
        vals.append(top.values)
        idx.append(top.indices)
    return torch.cat(vals).reshape(*shape, k).cpu(), torch.cat(idx).reshape(*shape, k).cpu()


def rank_blocks(n: int) -> list[tuple[int, int]]:
    """Ranks 0..n−1 pooled in blocks [0], [1], [2, 4), [4, 8), ... (the last cut at n)."""
    blocks, start, width = [], 0, 1
    while start < n:
        blocks.append((start, min(n, start + width)))
        start += width
        width = 1 if start < 2 else start
    return blocks


def wilson_lower(hits: torch.Tensor, trials: torch.Tensor, z: float) -> torch.Tensor:
    """Wilson score lower bound of a proportion (0 where there are no trials)."""
    n = trials.double().clamp_min(1)
    p = hits.double() / n
    centre = p + z * z / (2 * n)
    spread = z * torch.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    lower = (centre - spread) / (1 + z * z / n)
    return torch.where(trials > 0, lower.clamp_min(0), torch.zeros_like(lower))


def pooled(hits: torch.Tensor, trials: torch.Tensor, rate) -> torch.Tensor:
    """Per-rank rates from per-rank hits [..., R] over ``trials`` [...] draws, pooled over ``rank_blocks``."""
    out = torch.zeros(hits.shape, dtype=torch.float64)
    for a, b in rank_blocks(hits.shape[-1]):
        out[..., a:b] = rate(hits[..., a:b].sum(-1), trials * (b - a)).unsqueeze(-1)
    return out


def gradient_slots(p_grad: torch.Tensor, p_act: torch.Tensor, k: int, max_gradient: int, margin: float) -> torch.Tensor:
    """The gate (step 5 of the module docstring): per confidence bin, how many of the k slots go to the
    gradient. p_grad: [B, >= max_gradient] precision per gradient rank; p_act: [k] per activation rank."""
    p_grad, p_act = p_grad.double(), p_act.double()
    cov_act = torch.cat([torch.zeros(1, dtype=torch.float64), p_act.cumsum(0)])  # cov_act[r]: ranks < r
    slots = torch.zeros(p_grad.shape[0], dtype=torch.long)
    for b in range(p_grad.shape[0]):
        cov_grad = 0.0
        for j in range(min(max_gradient, k - 1, p_grad.shape[1])):
            r = k - 1 - j
            pg = float(p_grad[b, j])
            gain = pg * max(0.0, 1.0 - float(cov_act[r]))
            loss = float(p_act[r]) * max(0.0, 1.0 - cov_grad - pg)
            if pg <= 0 or gain <= margin * loss:
                break
            cov_grad += pg
            slots[b] = j + 1
    return slots


def merge_slots(act: torch.Tensor, grad: torch.Tensor, slots: torch.Tensor, k: int) -> torch.Tensor:
    """Per position, the top k−s activation candidates, the top s gradient candidates not among them,
    then further activation candidates where they overlapped (s = ``slots``; position 0 keeps all k
    activation candidates). act: [n, T, >=k]; grad: [n, T-1, >=max s] for positions 1..; slots: [n, T-1]."""
    n, T, _ = act.shape
    out = act[:, :, :k].clone()
    a, g, s_all = act.tolist(), grad.tolist(), slots.tolist()
    for i in range(n):
        for t in range(1, T):
            s = s_all[i][t - 1]
            if s == 0:
                continue
            chosen = a[i][t][: k - s]
            seen = set(chosen)
            for tok in g[i][t - 1][:s]:
                if tok not in seen:
                    chosen.append(tok)
                    seen.add(tok)
            for tok in a[i][t][k - s :]:
                if len(chosen) >= k:
                    break
                if tok not in seen:
                    chosen.append(tok)
                    seen.add(tok)
            out[i, t] = torch.tensor(chosen[:k])
    return out


def loo_rank_hits(
    x: torch.Tensor, ids: torch.Tensor, embedding: torch.Tensor, lam: float, k: int, score: torch.Tensor
) -> torch.Tensor:
    """Hits per rank [k] of the ridge map's exact leave-one-out estimates of calibration rows x [N, d_in]
    (targets: the input embeddings of ``ids`` [N]), counted over the rows ``score`` [N] bool: row i's
    estimate from the fit on all rows but i, ranked by cosine over the vocabulary; r_loo = r / (1 − h_ii),
    as ``RidgeMap.fit`` chooses λ."""
    x64 = x.double()
    y64 = embedding[ids.to(embedding.device)].double()
    xc, yc = x64 - x64.mean(0), y64 - y64.mean(0)
    u, s, vh = torch.linalg.svd(xc, full_matrices=False)
    shrink = s**2 / (s**2 + lam)
    fitted = u @ (shrink[:, None] * (u.T @ yc))
    h = (u**2 @ shrink) + 1.0 / x.shape[0]
    loo = (y64 - (yc - fitted) / (1.0 - h).clamp_min(1e-12)[:, None])[score.to(x.device)]
    top = torch.topk(
        torch.nn.functional.normalize(loo, dim=-1) @ torch.nn.functional.normalize(embedding.double(), dim=-1).T,
        k,
        dim=-1,
    ).indices.cpu()
    return (top == ids[score].cpu().unsqueeze(-1)).sum(0)


class AdaptiveJointBeam(_GradientReader, ActivationBeam):
    """Joint attacker with a confidence gate (ours): per position, gradient candidates only where their
    estimated precision, calibrated on the traffic, beats that of the activation candidates they would
    displace; k candidates per position as activation-only (module docstring). It reads the gradient at
    the observation point, or with ``gradient_source=output`` the U-shape's output gradient."""

    name = "joint-adaptive"
    uses_gradients = True

    def __init__(
        self,
        k: Candidates = 32,
        width: PositiveInt = 2,
        seed: int = 0,
        chunk_docs: PositiveInt = 64,
        gradient_source: GradientSource = DEFAULT_GRADIENT_SOURCE,
        max_gradient: int | None = None,
        bins: int = 4,
        anchor_share: float = 0.25,
        min_anchors: int = 16,
        z: float = 1.64,
        margin: float = 2.0,
    ):
        super().__init__(k=k, width=width, seed=seed, chunk_docs=chunk_docs)
        self.gradient_source = gradient_source
        self.max_gradient = max_gradient
        self.bins = bins
        self.anchor_share = anchor_share
        self.min_anchors = min_anchors
        self.z = z
        self.margin = margin
        self._checked()

    def params(self):
        p = {
            **super().params(),
            "max_gradient": self.max_gradient,
            "bins": self.bins,
            "anchor_share": self.anchor_share,
            "min_anchors": self.min_anchors,
            "z": self.z,
            "margin": self.margin,
        }
        if self.gradient_source != DEFAULT_GRADIENT_SOURCE:
            p["gradient_source"] = self.gradient_source
        return p

    def channels_read(self):
        return ("activations", self.gradient_channel())

    def _checked(self) -> int:
        """The parameters checked by name; returns the most gradient slots per position."""

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.k) or self.k < 2:
            raise ConfigError(f"{self.name}: k must be an integer >= 2, got {self.k!r}")
        most = self.k // 2 if self.max_gradient is None else self.max_gradient
        if not is_int(most) or not 0 <= most < self.k:
            raise ConfigError(f"{self.name}: max_gradient must be an integer in [0, k), got {self.max_gradient!r}")
        if not is_int(self.bins) or self.bins < 1:
            raise ConfigError(f"{self.name}: bins must be a positive integer, got {self.bins!r}")
        if not isinstance(self.anchor_share, (int, float)) or not 0 < self.anchor_share <= 1:
            raise ConfigError(f"{self.name}: anchor_share must lie in (0, 1], got {self.anchor_share!r}")
        if not is_int(self.min_anchors) or self.min_anchors < 1:
            raise ConfigError(f"{self.name}: min_anchors must be a positive integer, got {self.min_anchors!r}")
        for key in ("z", "margin"):
            v = getattr(self, key)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"{self.name}: {key} must be a number >= 0, got {v!r}")
        return most

    def fit(self, knowledge: Knowledge) -> "AdaptiveJointBeam":
        """The ridge fit (as ``activation``) and the activation list's precision per rank, p_A, from the
        fit's leave-one-out estimates of the calibration rows (positions 1..T−1)."""
        self._checked()
        super().fit(knowledge)
        client = knowledge.client
        ids = knowledge.calibration_ids()
        x = client.activations(ids)  # the rows the ridge map was fitted on (``_RidgeAttack.fit``)
        score = torch.ones(ids.shape, dtype=torch.bool)
        score[:, 0] = False  # position 0 has no gradient before it
        self.act_hits_ = loo_rank_hits(
            x.reshape(-1, x.shape[-1]), ids.reshape(-1), client.embedding, self.ridge_.lam, self.k, score.reshape(-1)
        )
        self.act_trials_ = int(score.sum())
        return self

    def gate(
        self, traffic: Traffic, act: torch.Tensor, act_cos: torch.Tensor, grad: torch.Tensor, grad_cos: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Gradient slots per position 1..T−1 [n, T−1], and what the gate measured (steps 2–5). act,
        act_cos: [n, T, k] activation candidates and their cosines; grad, grad_cos: [n, T−1, m] the
        gradient read-out's for positions 1..T−1."""
        most = self._checked()
        n, T = act.shape[:2]
        conf = grad_cos[..., 0] - grad_cos[..., 1]  # [n, T-1]
        valid = torch.isfinite(conf) & (self.observed_gradients(traffic)[:, :-1].norm(dim=-1) > 0).cpu()
        flat = conf[valid].double()
        if flat.numel() == 0:
            return torch.zeros(n, T - 1, dtype=torch.long), {"gradient_slot_share": 0.0}
        edges = torch.quantile(flat, torch.linspace(0, 1, self.bins + 1, dtype=torch.float64)[1:-1])
        which = torch.bucketize(conf.double().contiguous(), edges)  # [n, T-1] in 0..bins-1
        act_conf = (act_cos[:, 1:, 0] - act_cos[:, 1:, 1]).double()
        cut = torch.quantile(act_conf[valid], 1 - self.anchor_share)
        anchor = valid & (act_conf >= cut)
        pseudo = act[:, 1:, 0]
        agree = grad[..., :most] == pseudo.unsqueeze(-1)  # [n, T-1, most]
        hits = torch.stack([agree[anchor & (which == b)].sum(0) for b in range(self.bins)])
        trials = torch.stack([(anchor & (which == b)).sum() for b in range(self.bins)])
        p_grad = pooled(hits, trials, lambda h, t: wilson_lower(h, t, self.z))
        p_grad = torch.cummin(p_grad, dim=-1).values
        p_grad[trials < self.min_anchors] = 0.0
        p_act = pooled(self.act_hits_, torch.tensor(self.act_trials_), lambda h, t: (h.double() + 0.5) / (t + 1.0))
        per_bin = gradient_slots(p_grad, p_act, self.k, most, self.margin)
        slots = torch.where(valid, per_bin[which], torch.zeros_like(which))
        summary: dict[str, Any] = {
            "gradient_slot_share": float(slots.double().sum() / (n * (T - 1) * self.k)),
            "positions_with_gradient_slots": float((slots > 0).double().mean()),
            "slots_per_bin": per_bin.tolist(),
            "anchors_per_bin": trials.tolist(),
            "gradient_top1_precision_per_bin": [float(v) for v in p_grad[:, 0]] if most else [],
            "activation_precision_at_last_rank": float(p_act[-1]),
        }
        return slots, summary

    def candidates_and_summary(self, traffic: Traffic) -> tuple[torch.Tensor, dict[str, Any]]:
        most = self._checked()
        client = self.knowledge_.client
        act_cos, act = cosine_top(self.embed_estimate(traffic), client.embedding, self.k)
        if most == 0:
            return act, {"gradient_slot_share": 0.0}
        grads = self.observed_gradients(traffic).to(client.device)
        grad_cos, grad = cosine_top(-grads[:, :-1].to(client.embedding.dtype), client.embedding, max(most, 2))
        slots, summary = self.gate(traffic, act, act_cos, grad, grad_cos)
        return merge_slots(act, grad, slots, self.k), {**summary, "slots": slots}

    def candidates(self, traffic: Traffic) -> torch.Tensor:
        return self.candidates_and_summary(traffic)[0]

    def reconstruct(self, traffic: Traffic, progress: Progress | None = None) -> Reconstruction:
        self._check(traffic)
        cand, summary = self.candidates_and_summary(traffic)
        slots = summary.pop("slots", None)
        res = self.run_beam(traffic, cand, None, progress)
        coverage = (cand == res.tokens.unsqueeze(-1)).any(-1)
        extra: dict[str, Any] = {
            "candidates": cand,
            "distance": res.distance,
            "chosen_in_candidates": coverage,
            "summary": summary,
        }
        if slots is not None:
            extra["gradient_slots"] = slots
        return Reconstruction(res.tokens, extra)
