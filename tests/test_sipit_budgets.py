"""SipIt's budgets from one search (issue 35, ``search.sipit_budgets``): a smaller budget rides along the
largest budget's search until, in a chunk of documents, a position still searches when its checks are spent,
and then goes on alone from a copy of the search's state; every budget's result equals, bit for bit, its
search alone."""

from __future__ import annotations

import pytest
import torch

from splitleak.attacks import load_knowledge, load_traffic
from splitleak.attacks.core import make_attack
from splitleak.attacks.knowledge import ClientCopy, select_cache
from splitleak.attacks.ridge import RidgeMap
from splitleak.attacks.search import GradientGuidedOrder, _subset_cache, shared_budgets, sipit, sipit_budgets
from splitleak.models import load_model

FIELDS = ("tokens", "distance", "checks", "matched", "within")


def _setup(seed: int, n_calib: int, noise: float):
    """A tiny client cut after 2 blocks, six random documents of 10 tokens, their activations (with relative
    ``noise``: some positions then match only deep in the order, or not at all) and the ridge estimate of
    their input embeddings from ``n_calib`` random calibration documents."""
    client = ClientCopy(load_model("tiny-gpt2", seed=seed).model, 2)
    g = torch.Generator().manual_seed(seed)
    calib = torch.randint(0, client.vocab_size, (n_calib, 12), generator=g)
    ev = torch.randint(0, client.vocab_size, (6, 10), generator=g)
    obs = client.activations(ev)
    obs = obs + noise * obs.std() * torch.randn(obs.shape, generator=g)
    x = client.activations(calib)
    rm = RidgeMap.fit(x.reshape(-1, x.shape[-1]), client.embedding[calib].reshape(-1, x.shape[-1]))
    return client, obs, rm(obs)


def _counting(client: ClientCopy, counter: list[int]) -> None:
    """Count the candidate activations the client copy computes (``extend``'s rows)."""
    extend = client.extend

    def counted(cache, candidates, position):
        counter[0] += candidates.numel()
        return extend(cache, candidates, position)

    client.extend = counted  # type: ignore[method-assign]


@pytest.mark.unit
def test_only_budgets_whose_rounds_nest_share_a_search():
    assert shared_budgets([32, 64, 128], 615) == [128, 64, 32]
    assert shared_budgets([128, 32, 32], 615) == [128, 32]
    assert shared_budgets([32, 40, 128], 615) == [128, 32]  # 40: rounds of 16, 16, 8 — not the larger search's
    assert shared_budgets([32], 615) == [] and shared_budgets([], 615) == []
    assert shared_budgets([None, 16], 615, growth=16) == [None, 16]  # the exhaustive search's first round
    assert shared_budgets([None, 32], 615, growth=16) == []  # 16 + 16 is not 16 + 256
    assert shared_budgets([1000, 2000], 615) == [None, 1000] or shared_budgets([1000, 2000], 615) == [1000, 2000]


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    "kw", [{}, {"chunk_docs": 2}, {"chunk_docs": 4, "margin": 0.3}, {"chunk_docs": 3, "after_miss": 16}]
)
def test_budgets_from_one_search_equal_each_search_alone_bit_for_bit(seed, kw):
    client, obs, est = _setup(seed, n_calib=2, noise=0.02)
    tol = 0.5 * obs.double().norm(dim=-1)
    budgets = shared_budgets([16, 32, 64], client.vocab_size)
    work = [0]
    _counting(client, work)
    shared = sipit_budgets(client, obs, GradientGuidedOrder(client, obs, est), budgets, tol, 16, **kw)
    together, work[0] = work[0], 0
    alone = {b: sipit(client, obs, GradientGuidedOrder(client, obs, est), b, tol, 16, **kw) for b in budgets}
    separately, work[0] = work[0], 0
    sipit(client, obs, GradientGuidedOrder(client, obs, est), 64, tol, 16, **kw)
    largest = work[0]
    for b in budgets:
        for f in FIELDS:
            assert torch.equal(getattr(shared[b], f), getattr(alone[b], f)), (b, f)
    assert not bool(alone[16].matched.all()) and bool(alone[64].matched.any())  # the budgets read differently
    assert not torch.equal(alone[16].tokens, alone[64].tokens)
    # less work than the three searches, more than the largest alone: the smaller ones left it somewhere
    assert largest < together < separately, (largest, together, separately)


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_where_every_position_matches_within_the_smallest_budget_the_others_cost_nothing(seed):
    client, obs, est = _setup(seed, n_calib=4, noise=0.0)
    tol = 1e-3 * obs.double().norm(dim=-1)
    work = [0]
    _counting(client, work)
    shared = sipit_budgets(client, obs, GradientGuidedOrder(client, obs, est), [64, 32, 16], tol, 16)
    together, work[0] = work[0], 0
    alone = sipit(client, obs, GradientGuidedOrder(client, obs, est), 16, tol, 16)
    assert bool(alone.matched.all()) and together == work[0]  # one search's work for three budgets
    for f in FIELDS:
        assert torch.equal(getattr(shared[16], f), getattr(alone, f)) and torch.equal(
            getattr(shared[64], f), getattr(alone, f)
        )


def _run(shared_run, seed: int, defences):
    return shared_run(
        model="tiny-gpt2",
        depth=3,
        n_calib=2,
        n_train=8,
        n_eval=6,
        doc_len=12,
        seed=seed,
        data_seed=seed,
        all_local_baseline=False,
        defences=defences,
    )


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name,defences", [("sipit", [{"name": "none"}]), ("sipit-aware", [{"name": "quant8"}])])
def test_sipit_siblings_on_one_knowledge_read_what_each_reads_alone(shared_run, monkeypatch, seed, name, defences):
    """The attacks a grid worker runs on one knowledge (``Knowledge.planned``): SipIt at 16, 32 and 64 checks
    from one search, each reconstruction (tokens and every extra) the one it gives on a knowledge of its own;
    the ridge order and a sibling with another tolerance are not shared."""
    import splitleak.attacks.sipit as sipit_module

    run = _run(shared_run, seed, defences)
    alone = {
        b: make_attack(name, budget=b).fit(load_knowledge(run, "public")).reconstruct(load_traffic(run))
        for b in (16, 32, 64)
    }
    kn, tr = load_knowledge(run, "public"), load_traffic(run)
    kn.planned = (
        *(make_attack(name, budget=b) for b in (64, 16, 32)),
        make_attack(name, budget=128, tol_rel=0.01),
        make_attack(name, budget=48, order="ridge"),
    )
    calls = []
    real = sipit_module.sipit_budgets
    monkeypatch.setattr(sipit_module, "sipit_budgets", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    for b in (16, 32, 64):
        attack = make_attack(name, budget=b).fit(kn)
        assert attack.sibling_budgets() == [64, 32, 16]
        rec = attack.reconstruct(tr)
        assert _same(rec.tokens, alone[b].tokens) and _same(rec.extra, alone[b].extra), b
    assert calls == [[64, 32, 16]]  # one search served the three
    assert make_attack(name, budget=32, order="ridge").fit(kn).sibling_budgets() == []
    assert make_attack(name, budget=128, tol_rel=0.01).fit(kn).sibling_budgets() == []
    assert not torch.equal(alone[16].tokens, alone[64].tokens) or not torch.equal(
        alone[16].extra["checks"], alone[64].extra["checks"]
    )  # the budgets read differently here


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_order_proposes_each_token_once_per_position_the_nearest_unchecked_first(seed):
    """``GradientGuidedOrder`` masks the tokens it proposed before at a position (a few per document, scattered
    into the scores): over rounds that cover the vocabulary every token comes exactly once, and each round's
    picks are the unchecked tokens nearest by cosine to that round's estimate, nearest first."""
    client, obs, est = _setup(seed, 24, 0.3)
    order = GradientGuidedOrder(client, obs, est)
    rows, t, vocab = torch.tensor([4, 1, 3]), 2, client.vocab_size
    cache = client.new_cache()
    for p in range(t):  # a prefix of t tokens per row
        client.extend(cache, torch.tensor([[7], [3], [5]]) + p, p)
        select_cache(cache, p, torch.arange(3), torch.zeros(3, dtype=torch.long))

    def prefix():
        return _subset_cache(client, cache, torch.arange(3))

    sizes = [16, 16, 100, vocab - 132]
    picks, start = [], 0
    for size in sizes:
        p = order(rows, t, start, size, prefix)
        assert p.shape == (3, size)
        es = torch.stack([order._state[(int(r), t)][0] for r in rows])  # the estimate this round ranked by
        unit = torch.nn.functional.normalize(client.embedding, dim=-1)
        sims = (unit @ torch.nn.functional.normalize(es, dim=-1).T).T  # the order's product, so the same bits
        seen = torch.cat(picks, dim=1) if picks else torch.zeros(3, 0, dtype=torch.long)
        sims = sims.scatter(1, seen, float("-inf"))
        assert torch.equal(p, torch.topk(sims, size, dim=1).indices)
        picks.append(p)
        start += size
    every = torch.cat(picks, dim=1)
    assert torch.equal(every.sort(dim=1).values, torch.arange(vocab).expand(3, vocab))
