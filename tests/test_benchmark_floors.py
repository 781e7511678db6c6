"""The benchmarks' FLOP floors count what the searches compute: the multiply-adds that
``benchmarks/sipit_exhaustive.py::sipit_flops`` and ``benchmarks/attack_throughput.py::search_flops`` count
agree with torch's flop counter run over the same search. A floor above the work done would flatter the ratio
of wall time to floor: SipIt's order back-propagates into the input embedding only (the copy's weights are
frozen), so its gradient step costs two forwards, not the three counted until 2026-12-05."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from splitleak.attacks.knowledge import ClientCopy
from splitleak.attacks.ridge import RidgeMap
from splitleak.attacks.search import GradientGuidedOrder, beam_search, sipit
from splitleak.models import load_model

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _bench(name: str = "sipit_exhaustive"):
    sys.path.insert(0, str(BENCH))  # the script imports its neighbours as a script would
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
    finally:
        sys.path.remove(str(BENCH))
    return mod


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("noise", [0.0008, 0.02])  # some positions match late / none match: every round runs
@pytest.mark.parametrize("budget,growth", [(64, 1), (None, 16)])
def test_the_floor_counts_what_the_search_computes(seed, noise, budget, growth):
    bench = _bench()
    client = ClientCopy(load_model("tiny-gpt2", seed=seed).model, 2)
    g = torch.Generator().manual_seed(seed)
    calib = torch.randint(0, client.vocab_size, (24, 12), generator=g)
    docs = torch.randint(0, client.vocab_size, (6, 10), generator=g)
    obs = client.activations(docs)
    obs = obs + noise * obs.std() * torch.randn(obs.shape, generator=g)
    x = client.activations(calib)
    est = RidgeMap.fit(x.reshape(-1, x.shape[-1]), client.embedding[calib].reshape(-1, x.shape[-1]))(obs)
    order = GradientGuidedOrder(client, obs, est)
    with FlopCounterMode(display=False) as counter:
        res = sipit(client, obs, order, budget, 1e-3 * obs.double().norm(dim=-1), 16, growth=growth)
    checks = res.checks
    assert checks.double().mean() > 16  # later rounds ran, each after a gradient step
    counted = counter.get_total_flops()
    floor = bench.sipit_flops(client, checks, 16, growth, budget)
    # the count takes every parameter of a block for a multiply-add: GPT-2's biases and layer norms make it
    # about 2 % high here (under 0.1 % on SmolLM2, which has neither biases nor LayerNorm's shifts)
    assert 1.0 <= floor / counted <= 1.03, (floor, counted)


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("k", [4, 8])
def test_the_beam_floor_counts_what_the_beam_search_computes(seed, k):
    bench = _bench("attack_throughput")
    client = ClientCopy(load_model("tiny-gpt2", seed=seed).model, 2)
    g = torch.Generator().manual_seed(seed)
    obs = client.activations(torch.randint(0, client.vocab_size, (6, 10), generator=g))
    candidates = torch.randint(0, client.vocab_size, (6, 10, k), generator=g)
    with FlopCounterMode(display=False) as counter:
        beam_search(client, obs, candidates, 2)
    floor = bench.search_flops(client, 6, 10, k, 2)
    assert 1.0 <= floor / counter.get_total_flops() <= 1.03, (floor, counter.get_total_flops())


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1])
def test_the_op_timer_splits_counted_from_uncounted_work(seed):
    """``op_time.OpTimes`` puts an operation with a FLOP formula (a product) on the counted side with its exact
    FLOPs, and an elementwise one or a reduction on the other; the two sides' seconds add up to what the ops took."""
    op_time = _bench("op_time")
    g = torch.Generator().manual_seed(seed)
    rows, d, f = 16 + 8 * seed, 24, 40
    x, w = torch.randn(rows, d, generator=g), torch.randn(f, d, generator=g)
    with op_time.OpTimes() as ops:
        y = torch.relu(torch.nn.functional.linear(x, w)).sum()
    assert torch.isfinite(y)
    assert ops.counted_flops == 2 * rows * d * f
    assert ops.counted == {"mm"}  # linear without a bias: a transpose (uncounted, no FLOPs) and mm
    assert {"relu", "sum"} <= set(ops.seconds) - ops.counted
    assert ops.calls["mm"] == 1 and ops.calls["relu"] == 1
    assert ops.counted_s + ops.uncounted_s == pytest.approx(sum(ops.seconds.values()))
    assert [name for name, _ in ops.largest_uncounted(10)] == sorted(
        set(ops.seconds) - ops.counted, key=lambda n: -ops.seconds[n]
    )


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_the_op_timer_counts_the_beam_search_as_torch_does(seed):
    """Over a beam search the timer's counted FLOPs equal torch's flop counter's: the split the breakdown reports
    rests on the same formulas as the floor."""
    op_time = _bench("op_time")
    client = ClientCopy(load_model("tiny-gpt2", seed=seed).model, 2)
    g = torch.Generator().manual_seed(seed)
    obs = client.activations(torch.randint(0, client.vocab_size, (4, 8), generator=g))
    candidates = torch.randint(0, client.vocab_size, (4, 8, 6), generator=g)
    with FlopCounterMode(display=False) as counter:
        plain = beam_search(client, obs, candidates, 2)
    with op_time.OpTimes() as ops:
        timed = beam_search(client, obs, candidates, 2)
    assert torch.equal(plain.tokens, timed.tokens)
    assert ops.counted_flops == counter.get_total_flops() > 0
    assert ops.counted_s > 0 and ops.uncounted_s > 0
