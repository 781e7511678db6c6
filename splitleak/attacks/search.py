"""Search over token sequences whose recomputed activations match the observed ones.

Both searches run through the attacker's client-layer copy with a key/value cache: at each
position one forward pass scores every (document, beam, candidate) at once; each candidate
attends to its own beam's cached prefix and itself (``ClientCopy.extend``). ``beam_search_naive``
is the reference that recomputes the whole prefix for every candidate, one document at a time;
the two must return identical tokens.

Distance: the L2 norm between the recomputed and the observed activation at a position; a
partial text's score is the sum of its positions' distances. Ties are broken by a stable sort
(earlier beam, then earlier candidate).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from splitleak.attacks.knowledge import ClientCopy, select_cache
from splitleak.progress import Progress, Silent


@dataclass
class SearchResult:
    tokens: torch.Tensor  # [n, T] long
    distance: torch.Tensor  # [n, T] distance of the chosen token at each position
    checks: torch.Tensor  # [n, T] candidate activations computed per position
    matched: torch.Tensor | None = None  # [n, T] bool, SipIt: the chosen token matched within tolerance
    within: torch.Tensor | None = None  # [n, T] long, SipIt: candidates within tolerance in the round that matched


def _stable_best(scores: torch.Tensor, width: int) -> torch.Tensor:
    """Indices of the ``width`` smallest entries of each row, ties to the earlier index."""
    return torch.sort(scores, dim=-1, stable=True).indices[..., :width]


def beam_search(
    client: ClientCopy,
    observed: torch.Tensor,
    candidates: torch.Tensor,
    width: int = 2,
    chunk_docs: int = 64,
    progress: Progress | None = None,
    name: str = "beam search",
    distance: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None,
) -> SearchResult:
    """Beam search of width ``width`` over per-position candidate lists.

    observed: [n, T, d]; candidates: [n, T, k] token ids. Returns the best beam per document.
    ``distance(h, rows, t)`` (None: the L2 norm to the observed row) scores candidate activations
    h [a, c, d] of documents ``rows`` (indices into ``observed``) at position t: [a, c]."""
    progress = progress or Silent()
    n, T, _ = observed.shape
    k = candidates.shape[-1]
    if k < width:
        raise ValueError(f"beam width {width} needs at least {width} candidates per position, got {k}")
    task = progress.start(name, n * T)
    out_tokens, out_dist = [], []
    for s in range(0, n, chunk_docs):
        obs = observed[s : s + chunk_docs].to(client.device, client.dtype)
        cand = candidates[s : s + chunk_docs].to(client.device)
        m = obs.shape[0]
        cache = client.new_cache()
        # position 0: one empty prefix per document
        h = client.extend(cache, cand[:, 0], 0)  # [m, k, d]
        docs = torch.arange(s, s + m)
        d0 = (h - obs[:, 0:1]).norm(dim=-1) if distance is None else distance(h, docs, 0)  # [m, k]
        pick = _stable_best(d0, width)  # [m, W]
        parent = torch.arange(m, device=client.device).repeat_interleave(width)
        select_cache(cache, 0, parent, pick.reshape(-1))
        hist = torch.gather(cand[:, 0], 1, pick).unsqueeze(-1)  # [m, W, 1]
        step_d = torch.gather(d0, 1, pick).unsqueeze(-1)  # [m, W, 1]
        cum = step_d[..., 0].clone()
        progress.advance(task, m)
        for t in range(1, T):
            c = cand[:, t].repeat_interleave(width, dim=0)  # [m*W, k]
            h = client.extend(cache, c, t).view(m, width, k, -1)
            if distance is None:
                dist = (h - obs[:, t].view(m, 1, 1, -1)).norm(dim=-1)  # [m, W, k]
            else:
                dist = distance(h.view(m, width * k, -1), docs, t).view(m, width, k)
            total = (cum.unsqueeze(-1) + dist).view(m, width * k)
            pick = _stable_best(total, width)  # [m, W] over (beam, candidate)
            beam, j = pick // k, pick % k
            rows = (torch.arange(m, device=client.device).unsqueeze(1) * width + beam).reshape(-1)
            select_cache(cache, t, rows, j.reshape(-1))
            hist = torch.cat(
                [hist[torch.arange(m).unsqueeze(1), beam], torch.gather(cand[:, t], 1, j).unsqueeze(-1)], -1
            )
            step_d = torch.cat(
                [step_d[torch.arange(m).unsqueeze(1), beam], dist.view(m, width * k).gather(1, pick).unsqueeze(-1)], -1
            )
            cum = torch.gather(total, 1, pick)
            progress.advance(task, m)
        best = _stable_best(cum, 1)[:, 0]
        out_tokens.append(hist[torch.arange(m), best].cpu())
        out_dist.append(step_d[torch.arange(m), best].cpu())
    progress.finish(task)
    tokens = torch.cat(out_tokens)
    checks = torch.full((n, T), width * k, dtype=torch.long)
    checks[:, 0] = k
    return SearchResult(tokens, torch.cat(out_dist), checks)


@torch.no_grad()
def beam_search_naive(
    client: ClientCopy, observed: torch.Tensor, candidates: torch.Tensor, width: int = 2
) -> SearchResult:
    """Reference: recompute the full prefix for every candidate, one document at a time."""
    n, T, _ = observed.shape
    k = candidates.shape[-1]
    toks, dists = [], []
    for i in range(n):
        obs = observed[i].to(client.device, client.dtype)
        # a beam: (tokens, per-position distances, cumulative distance as a 0-d tensor)
        beams: list[tuple[list[int], list[float], torch.Tensor]] = [([], [], torch.zeros((), dtype=client.dtype))]
        for t in range(T):
            texts, steps, totals = [], [], []
            for prefix, ds, cum in beams:
                for j in range(k):
                    tok = int(candidates[i, t, j])
                    ids = torch.tensor([prefix + [tok]], device=client.device)
                    h = client.owner(input_ids=ids, use_cache=False).last_hidden_state[0, -1]
                    d = (h - obs[t]).norm()
                    texts.append(prefix + [tok])
                    steps.append(ds + [float(d)])
                    totals.append(cum + d)
            order = _stable_best(torch.stack(totals).unsqueeze(0), width)[0].tolist()
            beams = [(texts[o], steps[o], totals[o]) for o in order]
        best = _stable_best(torch.stack([c for _, _, c in beams]).unsqueeze(0), 1)[0, 0]
        toks.append(beams[best][0])
        dists.append(beams[best][1])
    return SearchResult(
        torch.tensor(toks), torch.tensor(dists, dtype=observed.dtype), torch.zeros(n, T, dtype=torch.long)
    )


def round_sizes(first: int, growth: int, limit: int) -> list[int]:
    """The candidates checked per round until ``limit``: ``first``, then ``growth`` times more each round
    (16 -> 256 -> 4,096 -> the rest, with growth 16), the last round cut to what is left."""
    sizes, start, r = [], 0, first
    while start < limit:
        sizes.append(min(r, limit - start))
        start += sizes[-1]
        r *= max(1, growth)
    return sizes


def sipit(
    client: ClientCopy,
    observed: torch.Tensor,
    order: Callable[..., torch.Tensor],
    budget: int | None,
    tol: float | torch.Tensor,
    round_size: int = 16,
    chunk_docs: int = 64,
    progress: Progress | None = None,
    name: str = "SipIt",
    growth: int = 1,
    pass_rows: int = 2048,
    margin: float | None = None,
    after_miss: int | None = None,
    distance: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None,
) -> SearchResult:
    """Position by position, check candidates in ``order`` until one's recomputed activation lies
    within ``tol`` (L2) of the observed one; keep it. With a ``budget``, stop after that many checks
    and keep the best checked candidate; ``budget=None`` checks the whole vocabulary if needed
    (exhaustive: a match certifies the token).

    Rounds: the first checks ``round_size`` candidates, each later one ``growth`` times more (``growth=1``:
    rounds of one size, What Gradients Add's budgeted SipIt; 16 makes an exhaustive search of a
    position with no exact match a handful of wide rounds instead of thousands of narrow ones). A round
    is recomputed in forward passes of at most ``pass_rows`` candidate rows in all (documents x candidates,
    at least one candidate per document): wide enough for the products to run at speed, small enough to
    bound the passes' memory; the candidates' attention is linear in their number (``ClientCopy.extend``).
    ``margin`` (ours; None: off) stops a position that has no match when a whole round found nothing
    within (1 + margin) times the best distance so far: the order proposes the likeliest candidates first,
    so a round that comes nowhere near says the rest will not either. Such a token is the best checked,
    not certified (``matched`` stays False).
    ``distance`` (None: the L2 norm) scores candidates as in ``beam_search``.
    ``after_miss`` (ours; None: off) bounds the search of a position whose previous position found no
    match: its prefix is then not the true one, so no candidate can reproduce the observed activation
    (the activation at t depends on every token before it) and checking the whole vocabulary there
    buys nothing; it stops after the first round that reaches ``after_miss`` checks.

    ``order(rows, t, start, size, prefix)`` returns, for documents ``rows`` (indices into
    ``observed``), the candidate token ids of ranks [start, start + size) at position ``t``:
    [len(rows), size]; ``prefix()`` gives a fresh cache of those rows' prefixes (None at t = 0)
    for orders that probe the client layers."""
    setup = _Setup(client, observed, tol, pass_rows, margin, after_miss, distance)
    track = _Track.new(observed.shape[:2], round_sizes(round_size, growth, setup.limit(budget)), order)
    progress = progress or Silent()
    task = progress.start(name, observed.shape[0] * observed.shape[1])
    for rows in torch.arange(observed.shape[0]).split(chunk_docs):
        _positions(setup, _Chunk(setup, rows), track, progress, task)
    progress.finish(task)
    return track.result(observed.dtype)


def shared_budgets(budgets, vocab: int, round_size: int = 16, growth: int = 1) -> list[int | None]:
    """The budgets (``None``: exhaustive) that ``sipit_budgets`` can serve from the search of the largest:
    those whose rounds are the first rounds of its (then a search stopped at one is, round for round, the
    start of the larger search). The largest first; fewer than two: nothing to share."""
    limit = {b: vocab if b is None else min(int(b), vocab) for b in set(budgets)}
    ranked = sorted(limit, key=lambda b: (-limit[b], b is not None, b or 0))
    if not ranked:
        return []
    lead = round_sizes(round_size, growth, limit[ranked[0]])
    out = [ranked[0]] + [b for b in ranked[1:] if (s := round_sizes(round_size, growth, limit[b])) == lead[: len(s)]]
    return out if len(out) > 1 else []


def sipit_budgets(
    client: ClientCopy,
    observed: torch.Tensor,
    order: "GradientGuidedOrder",
    budgets: list[int | None],
    tol: float | torch.Tensor,
    round_size: int = 16,
    chunk_docs: int = 64,
    progress: Progress | None = None,
    name: str = "SipIt",
    growth: int = 1,
    pass_rows: int = 2048,
    margin: float | None = None,
    after_miss: int | None = None,
    distance: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None,
) -> dict[int | None, SearchResult]:
    """``sipit`` at each of ``budgets`` (as ``shared_budgets`` gives them, the largest first) from one search,
    each result bit for bit the one ``sipit`` gives at that budget alone (the other arguments the same).

    A search at a smaller budget b is, op for op, the larger search until, in a chunk of documents, a
    position still has documents searching when b checks are spent: up to there both ran the same rounds
    on the same rows from the same state. There b's search leaves the larger one (its state copied: the
    prefix cache, the order's, the results so far) and runs the rest of the chunk alone, as ``sipit``
    would; the next chunk starts afresh in both, so b rides along again. Work is saved on the positions of
    each chunk before the first one where b runs out on any document (where every document matches
    within b checks, all of it; through a copy that cannot match, none). The batch of a chunk is never
    split: a forward pass over other rows could round differently."""
    setup = _Setup(client, observed, tol, pass_rows, margin, after_miss, distance)
    if shared_budgets(budgets, client.vocab_size, round_size, growth) != list(budgets):
        raise ValueError(f"SipIt budgets {budgets} cannot share one search (shared_budgets)")
    shape = observed.shape[:2]
    lead = _Track.new(shape, round_sizes(round_size, growth, setup.limit(budgets[0])), order)
    riders = [_Track.new(shape, round_sizes(round_size, growth, setup.limit(b)), None) for b in budgets[1:]]
    progress = progress or Silent()
    task = progress.start(name, shape[0] * shape[1])
    for rows in torch.arange(shape[0]).split(chunk_docs):
        chunk = _Chunk(setup, rows)
        left: set[int] = set()

        def leave(t: int, spent: int, active: torch.Tensor, chunk=chunk, left=left) -> None:
            for i, rider in enumerate(riders):
                if i not in left and len(active) and spent == rider.limit < lead.limit:
                    left.add(i)
                    rider.take(lead, chunk.rows)
                    rider.order = lead.order.fork()
                    quiet = Silent()
                    _positions(setup, chunk.fork(setup, t), rider, quiet, quiet.start(name, 0), t_from=t, resumed=True)

        _positions(setup, chunk, lead, progress, task, on_round=leave)
        for i, rider in enumerate(riders):
            if i not in left:
                rider.take(lead, chunk.rows)
    progress.finish(task)
    return {b: tr.result(observed.dtype) for b, tr in zip(budgets, [lead, *riders])}


@dataclass
class _Setup:
    """What every SipIt search of one traffic reads."""

    client: ClientCopy
    observed: torch.Tensor
    tol: float | torch.Tensor
    pass_rows: int
    margin: float | None
    after_miss: int | None
    distance: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None
    tolv: torch.Tensor = field(init=False)  # the tolerance per (document, position), float64

    def __post_init__(self):
        n, T = self.observed.shape[:2]
        tol = self.tol
        self.tolv = (
            tol.double().cpu() if isinstance(tol, torch.Tensor) else torch.full((n, T), float(tol), dtype=torch.float64)
        )

    def limit(self, budget: int | None) -> int:
        vocab = self.client.vocab_size
        return vocab if budget is None else min(budget, vocab)


class _Chunk:
    """The documents searched together (one batch) and the cache of their chosen prefixes."""

    def __init__(self, setup: _Setup, rows: torch.Tensor, cache: Any = None):
        self.rows = rows
        self.obs = setup.observed[rows].to(setup.client.device, setup.client.dtype)
        self.cache = setup.client.new_cache() if cache is None else cache

    def fork(self, setup: _Setup, t: int) -> "_Chunk":
        """The same documents with a copy of the prefix cache as it stands while position ``t`` is searched."""
        cache = _subset_cache(setup.client, self.cache, torch.arange(len(self.rows))) if t > 0 else None
        return _Chunk(setup, self.rows, cache)


@dataclass
class _Track:
    """One search (one budget): its rounds, its candidate order, and what it chose so far [n, T]."""

    sizes: list[int]
    order: Any
    tokens: torch.Tensor
    dist: torch.Tensor
    checks: torch.Tensor
    matched: torch.Tensor
    within: torch.Tensor

    @classmethod
    def new(cls, shape, sizes: list[int], order) -> "_Track":
        n, T = shape
        return cls(
            sizes,
            order,
            torch.zeros(n, T, dtype=torch.long),
            torch.full((n, T), float("inf"), dtype=torch.float64),
            torch.zeros(n, T, dtype=torch.long),
            torch.zeros(n, T, dtype=torch.bool),
            torch.zeros(n, T, dtype=torch.long),
        )

    @property
    def limit(self) -> int:
        return sum(self.sizes)

    def take(self, other: "_Track", rows: torch.Tensor) -> None:
        """``other``'s results for ``rows`` as this search's own."""
        for name in ("tokens", "dist", "checks", "matched", "within"):
            getattr(self, name)[rows] = getattr(other, name)[rows]

    def result(self, dtype: torch.dtype) -> SearchResult:
        return SearchResult(self.tokens, self.dist.to(dtype), self.checks, self.matched, self.within)


def _positions(setup: _Setup, chunk: _Chunk, track: _Track, progress, task, on_round=None, t_from=0, resumed=False):
    """Search positions ``t_from`` … T-1 of a chunk, each position's prefix grown by its chosen token; with
    ``resumed``, position ``t_from``'s rounds are already done."""
    client, m = setup.client, len(chunk.rows)
    for t in range(t_from, setup.observed.shape[1]):
        if not (resumed and t == t_from):
            _rounds(setup, chunk, track, t, on_round)
        client.extend(chunk.cache, track.tokens[chunk.rows, t].unsqueeze(1).to(client.device), t)  # grow the prefix
        progress.advance(task, m)


def _rounds(setup: _Setup, chunk: _Chunk, track: _Track, t: int, on_round=None) -> None:
    """The rounds of position ``t`` for a chunk's documents, until each matches, is stopped or spends its
    budget; ``on_round(t, spent, active)`` after each round (the checks spent per active document so far)."""
    s, client, rows_all = setup, setup.client, chunk.rows
    m = len(rows_all)
    active = torch.arange(m)
    start = 0
    missed = (
        ~track.matched[rows_all, t - 1] if (s.after_miss is not None and t > 0) else torch.zeros(m, dtype=torch.bool)
    )
    for r in track.sizes:
        if not len(active):
            break

        def prefix(act=active):  # called within this iteration only
            return _subset_cache(client, chunk.cache, act) if t > 0 else None

        cand = track.order(rows_all[active], t, start, r, prefix).to(client.device)
        parts = []
        per = max(1, s.pass_rows // len(active))  # candidates per document in one pass
        for c0 in range(0, r, per):  # each pass extends a fresh copy of the prefixes
            sub = prefix() or client.new_cache()
            h = client.extend(sub, cand[:, c0 : c0 + per], t)  # [a, <=per, d]
            if s.distance is None:
                parts.append((h - chunk.obs[active, t].unsqueeze(1)).norm(dim=-1).double().cpu())
            else:
                parts.append(s.distance(h, rows_all[active], t).double().cpu())
        d = torch.cat(parts, dim=1)  # [a, r]
        bd, bj = d.min(dim=1)
        gi = rows_all[active]
        before = track.dist[gi, t].clone()
        better = bd < before
        track.dist[gi[better], t] = bd[better]
        track.tokens[gi[better], t] = cand.cpu()[better, bj[better]]
        track.checks[gi, t] += r
        hit = bd <= s.tolv[gi, t]
        track.matched[gi[hit], t] = True
        track.within[gi[hit], t] = (d[hit] <= s.tolv[gi[hit], t].unsqueeze(1)).sum(dim=1)
        done = hit
        if s.margin is not None:  # nothing in this round came within the margin of the best so far
            done = done | (bd > (1 + s.margin) * before)
        if s.after_miss is not None:  # a prefix without a match: no candidate can match here
            done = done | (missed[active] & (start + r >= s.after_miss))
        active = active[~done]
        start += r
        if on_round is not None:
            on_round(t, start, active)


def _subset_cache(client: ClientCopy, cache, rows: torch.Tensor):
    """A new cache holding only ``rows`` of ``cache`` (the prefixes of the documents still searching)."""
    sub = client.new_cache()
    idx = rows.to(client.device)
    for i, layer in enumerate(cache.layers):
        sub.update(layer.keys[idx], layer.values[idx], i)
    return sub


class GradientGuidedOrder:
    """SipIt's proposal policy: start from an estimate of the input embedding at position t (the
    ridge fit's), check the unchecked tokens nearest to it by cosine, then move the estimate by a
    normalised gradient step on ||f(prefix, e) - h_t||^2 through the client layers and check the
    unchecked tokens nearest to the new estimate, and so on. ``emulate(out, rows, t)`` (None: none) maps
    the recomputed rows [a, 1, d] to what the wire would carry before the mismatch is taken."""

    def __init__(
        self,
        client: ClientCopy,
        observed: torch.Tensor,
        estimate: torch.Tensor,
        step: float = 0.5,
        emulate: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None,
    ):
        self.client = client
        self.emulate = emulate
        self.observed = observed
        self.estimate = estimate
        self.step = step
        self._state: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._unit = torch.nn.functional.normalize(client.embedding, dim=-1)

    def fork(self) -> "GradientGuidedOrder":
        """An order that goes on from where this one stands, apart from it (``sipit_budgets``): its state is
        copied; the tensors in it are never changed in place, only replaced."""
        other = copy.copy(self)
        other._state = dict(self._state)
        return other

    def _grad_step(self, e: torch.Tensor, rows: torch.Tensor, t: int, prefix) -> torch.Tensor:
        c = self.client
        e = e.detach().clone().requires_grad_(True)
        pos = torch.full((len(rows), 1), t, dtype=torch.long, device=c.device)
        with torch.enable_grad():
            out = c.owner(
                inputs_embeds=e.unsqueeze(1),
                position_ids=pos,
                use_cache=t > 0,
                **{c.cache_keyword: prefix() if t > 0 else None},  # transformers 5.17 drops an unknown keyword
            ).last_hidden_state[:, 0]
            if self.emulate is not None:
                out = self.emulate(out.unsqueeze(1), rows, t)[:, 0]
            loss = (out - self.observed[rows, t].to(c.device, c.dtype)).pow(2).sum()
            (g,) = torch.autograd.grad(loss, e)
        g = torch.nn.functional.normalize(g, dim=-1)
        return (e - self.step * e.norm(dim=-1, keepdim=True) * g).detach()

    def __call__(self, rows: torch.Tensor, t: int, start: int, size: int, prefix) -> torch.Tensor:
        c = self.client
        if start == 0:
            for r in rows.tolist():
                self._state.pop((r, t - 1), None)  # the previous position is settled
            es = self.estimate[rows, t].to(c.device, c.dtype)
            checked = torch.zeros(len(rows), 0, dtype=torch.long, device=c.device)
        else:
            es = torch.stack([self._state[(int(r), t)][0] for r in rows])
            checked = torch.stack([self._state[(int(r), t)][1] for r in rows])  # [a, start]
            es = self._grad_step(es, rows, t, prefix)
        # [vocab, a]: in this orientation the product reads the unit embedding once at speed for few rows
        scores = self._unit @ torch.nn.functional.normalize(es, dim=-1).T
        scores = scores.scatter_(0, checked.T, float("-inf"))  # the tokens checked already: a few per row
        pick = torch.topk(scores, size, dim=0).indices.T
        checked = torch.cat([checked, pick], dim=1)
        for i, r in enumerate(rows.tolist()):
            self._state[(r, t)] = (es[i], checked[i])
        return pick.cpu()
