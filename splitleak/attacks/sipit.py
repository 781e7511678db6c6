"""SipIt: per position, check candidate tokens until one's recomputed activation matches."""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import NonNegativeFloat, PositiveFloat, PositiveInt

from splitleak.attacks.base import Budget, Reconstruction, _RidgeAttack
from splitleak.attacks.ridge import cosine_scores, cosine_topk
from splitleak.attacks.search import GradientGuidedOrder, SearchResult, shared_budgets, sipit, sipit_budgets
from splitleak.errors import ConfigError


class _RidgeOrder:
    """Candidate order for SipIt: tokens by cosine to the ridge estimate. The first ``depth`` ranks
    of every (document, position) are computed once; deeper ranks (exhaustive search) are sorted
    lazily for the documents that get there."""

    def __init__(self, estimate: torch.Tensor, embedding: torch.Tensor, depth: int):
        self.estimate = estimate
        self.embedding = embedding
        self.depth = min(depth, embedding.shape[0])
        self.top = cosine_topk(estimate, embedding, self.depth).cpu()  # [n, T, depth]
        self._full: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, rows: torch.Tensor, t: int, start: int, size: int, prefix=None) -> torch.Tensor:
        if start + size <= self.depth:
            return self.top[rows, t, start : start + size]
        out = []
        for row in rows.tolist():
            key = (row, t)
            if key not in self._full:
                sc = cosine_scores(self.estimate[row, t].unsqueeze(0), self.embedding)[0]
                self._full[key] = torch.sort(sc, descending=True, stable=True).indices.cpu()
            out.append(self._full[key][start : start + size])
        return torch.stack(out)


#: the order in which SipIt checks candidates (the class's docstring)
Order = Literal["gradient", "ridge"]

#: documents SipIt searches together when ``chunk_docs`` is left out (ours): the order's gradient steps and
#: vocabulary rankings compute one row per document and read all the client's weights and the whole unit
#: embedding for them, so a wider chunk reads them once for more rows (256 documents in one chunk ran about
#: 5 % faster than in chunks of 64 through a public copy and 20 % faster through the trained copy with the
#: budgets' shared search, benchmarks/RESULTS.md, 2026-12-05)
CHUNK_DOCS = 256
#: and at most this many prefix tokens in a chunk (documents x positions): the prefix cache and each pass's
#: copy of it grow with both (32,768: the former default of 64 documents at 512 tokens)
CHUNK_TOKENS = 32_768


class SipIt(_RidgeAttack):
    """SipIt (Nikolaou et al. 2026), as What Gradients Add §2–3 describes it: per position, check candidates until
    one's recomputed activation matches the observed one within tolerance; a budget of checks per
    token returns the best checked candidate when it runs out; ``budget='exhaustive'`` checks the
    whole vocabulary if needed, so every match is certified.

    Order of checks (``order``): ``gradient`` (default) is SipIt's policy — start at the ridge
    estimate of the input embedding, check the nearest unchecked tokens by cosine, then take a
    normalised gradient step on the activation mismatch through the client layers and check the
    nearest unchecked tokens to the new estimate; ``ridge`` checks tokens in plain cosine order
    to the ridge estimate.

    Rounds (``splitleak.attacks.search.sipit``): ``round_size`` candidates first, then ``growth`` times
    more per round. ``growth=None`` (default) keeps What Gradients Add's fixed rounds for a budget and
    widens 16-fold per round for ``exhaustive`` (16 -> 256 -> 4,096 -> the rest: a position that no
    candidate matches, as through a public copy after fine-tuning, costs a few wide rounds instead of
    some 3,000 narrow ones). ``margin`` (ours; off by default) lets an exhaustive search through a copy
    that cannot match exactly stop a position once a whole round comes no closer than (1 + margin) times
    its best distance; such tokens are not certified. ``after_miss`` (ours; off by default) gives a
    position whose previous position found no match only the rounds up to that many checks: with a
    wrong prefix no candidate can match, so an exhaustive search there would check the whole
    vocabulary for nothing. ``chunk_docs``: the documents searched together (None: ``CHUNK_DOCS``, fewer
    where they would hold more than ``CHUNK_TOKENS`` prefix tokens); the chunk only batches the work, but
    a row's float32 result can differ in its last bits with the batch it is computed in."""

    name = "sipit"

    def __init__(
        self,
        budget: Budget = 32,
        tol_rel: NonNegativeFloat = 1e-3,
        round_size: PositiveInt = 16,
        seed: int = 0,
        chunk_docs: PositiveInt | None = None,
        order: Order = "gradient",
        step: PositiveFloat = 0.5,
        growth: PositiveInt | None = None,
        margin: NonNegativeFloat | None = None,
        after_miss: PositiveInt | None = None,
    ):
        self.budget = budget
        self.order = order
        self.step = step
        self.tol_rel = tol_rel
        self.round_size = round_size
        self.seed = seed
        self.chunk_docs = chunk_docs
        self.growth = growth
        self.margin = margin
        self.after_miss = after_miss

    def params(self):
        return {
            "budget": self.budget,
            "tol_rel": self.tol_rel,
            "round_size": self.round_size,
            "seed": self.seed,
            "order": self.order,
            "step": self.step,
            "growth": self.growth,
            "margin": self.margin,
            "after_miss": self.after_miss,
        }

    def reconstruct(self, traffic, progress=None):
        self._check(traffic)
        if self.budget != "exhaustive" and (not isinstance(self.budget, int) or self.budget < 1):
            raise ConfigError(f"SipIt budget must be a positive integer or 'exhaustive', got {self.budget!r}")
        budget = None if self.budget == "exhaustive" else int(self.budget)
        if self.growth is not None and (
            isinstance(self.growth, bool) or not isinstance(self.growth, int) or self.growth < 1
        ):
            raise ConfigError(f"SipIt growth must be a positive integer (1: rounds of one size), got {self.growth!r}")
        if self.margin is not None and not (isinstance(self.margin, (int, float)) and self.margin >= 0):
            raise ConfigError(f"SipIt margin must be a number >= 0 (or left out), got {self.margin!r}")
        if self.after_miss is not None and (
            isinstance(self.after_miss, bool) or not isinstance(self.after_miss, int) or self.after_miss < 1
        ):
            raise ConfigError(
                f"SipIt after_miss must be a positive number of checks (or left out), got {self.after_miss!r}"
            )
        if self.order not in ("gradient", "ridge"):
            raise ConfigError(f"SipIt order must be 'gradient' or 'ridge', got {self.order!r}")
        wire = self.public_wire(traffic)
        # one search serves this budget and its siblings' (``search.sipit_budgets``); without a public wire it is a
        # function of the activations alone, and a twin that holds the same rows in the same order reads it
        # (``Knowledge.memo_content``)
        budgets = self.sibling_budgets() or [budget]
        key = ("sipit", type(self).__name__, self._search_state(), tuple(budgets))
        if wire is None:
            found = self.knowledge_.memo_content(
                key, (traffic.activations,), lambda: self._search(traffic, budgets, wire, progress)
            )
        elif len(budgets) > 1:
            found = self.knowledge_.memo(key, lambda: self._search(traffic, budgets, wire, progress), traffic)
        else:
            found = self._search(traffic, budgets, wire, progress)
        res = found[budget]
        extra = {"matched": res.matched, "checks": res.checks, "distance": res.distance}
        if wire is not None:  # what a match means under the chain (``attacks.aware``)
            extra.update(wire.readout(res))
        return Reconstruction(res.tokens, extra)

    def _chunk_docs(self, positions: int) -> int:
        """The documents per chunk of a search over documents of ``positions`` tokens (``chunk_docs``)."""
        if self.chunk_docs is not None:
            return self.chunk_docs
        return max(1, min(CHUNK_DOCS, CHUNK_TOKENS // max(1, positions)))

    def _growth(self, budget: int | None) -> int:
        return self.growth if self.growth is not None else (16 if budget is None else 1)

    def _search_state(self) -> tuple:
        """Every argument of this search but its budget (``__init__``'s; fitted state ends in ``_``)."""
        return tuple(sorted((k, v) for k, v in vars(self).items() if k != "budget" and not k.endswith("_")))

    def sibling_budgets(self) -> list[int | None]:
        """The budgets (None: exhaustive) of the searches ``Knowledge.planned`` holds that this one can share
        (its class and every other argument the same, rounds that ``search.shared_budgets`` can nest), the
        largest first, this one among them; empty when there is nothing to share. Only in the gradient order:
        the ridge order ranks ``max(budget, round_size)`` candidates at once, and a top-k of another depth may
        order equal scores otherwise."""
        if self.order != "gradient":
            return []
        mine = None if self.budget == "exhaustive" else int(self.budget)
        budgets = {mine}
        for other in self.knowledge_.planned:
            if type(other) is type(self) and other._search_state() == self._search_state():
                theirs = None if other.budget == "exhaustive" else int(other.budget)
                if self._growth(theirs) == self._growth(mine):
                    budgets.add(theirs)
        return shared_budgets(budgets, self.knowledge_.client.vocab_size, self.round_size, self._growth(mine))

    def _search(self, traffic, budgets: list[int | None], wire, progress) -> dict[int | None, SearchResult]:
        """The search at ``budgets`` (one, or those ``sibling_budgets`` gives) of this traffic."""
        client = self.knowledge_.client
        est = self.embed_estimate(traffic)
        growth = self._growth(budgets[0])
        order: Any
        if self.order == "ridge":
            order = _RidgeOrder(est, client.embedding, 256 if budgets[0] is None else max(budgets[0], self.round_size))
        else:
            order = GradientGuidedOrder(
                client, traffic.activations, est, self.step, emulate=None if wire is None else wire.emulate
            )
        obs = traffic.activations
        chunk = self._chunk_docs(obs.shape[1])
        tol = self.tol_rel * obs.double().norm(dim=-1) if wire is None else wire.tolerance(self.tol_rel)
        common = dict(
            progress=progress,
            growth=growth,
            margin=self.margin,
            after_miss=self.after_miss,
            distance=None if wire is None else wire.distance,
        )
        if len(budgets) == 1:
            name = f"SipIt (budget {self.budget})"
            return {budgets[0]: sipit(client, obs, order, budgets[0], tol, self.round_size, chunk, name=name, **common)}
        name = f"SipIt (budgets {', '.join('exhaustive' if b is None else str(b) for b in budgets)})"
        return sipit_budgets(client, obs, order, budgets, tol, self.round_size, chunk, name=name, **common)
