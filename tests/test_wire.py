import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitleak.defences import DefenceChain, WireContext, build_defence, clip_per_document, quantize_symmetric
from splitleak.defences.base import gaussian_noise_rms
from splitleak.errors import ConfigError, IntegrityError
from splitleak.wire import Frame, decode, encode

pytestmark = pytest.mark.unit


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    bits=st.sampled_from([4, 8]),
    scale=st.floats(1e-4, 1e4),
    docs=st.integers(1, 4),
)
def test_quantiser_rounds_within_half_a_step_onto_the_grid(seed, bits, scale, docs):
    x = torch.randn(docs, 6, 5, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale
    q = quantize_symmetric(x, bits)
    qmax = 2 ** (bits - 1) - 1
    step = x.abs().amax(dim=(1, 2), keepdim=True) / qmax
    assert ((q - x).abs() <= step / 2 + 1e-12 * scale).all()
    k = q / step
    assert torch.allclose(k, k.round(), atol=1e-9)
    assert (k.abs() <= qmax + 1e-9).all()
    # the largest entry of each document is exactly representable
    idx = x.abs().flatten(1).argmax(dim=1)
    assert torch.allclose(q.flatten(1).gather(1, idx[:, None]), x.flatten(1).gather(1, idx[:, None]))


def test_quantiser_scale_is_per_document_and_zero_stays_zero():
    x = torch.zeros(2, 3, 4)
    x[1] = torch.linspace(-1, 1, 12).view(3, 4) * 100
    q = quantize_symmetric(x, 8)
    assert torch.equal(q[0], torch.zeros(3, 4))
    assert q[1].abs().max() == 100
    assert len(torch.unique(quantize_symmetric(x, 4)[1])) <= 15


def _ctx(doc_ids, step=3):
    return WireContext(seed=11, phase="train", step=step, doc_ids=tuple(doc_ids), position=0)


def test_quant4_noisy_applies_clip_then_noise_then_round():
    g = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 5
    ctx = _ctx([10, 11, 12])
    d = build_defence("quant4-noisy")
    got = d.backward(g, ctx)
    expected = quantize_symmetric(gaussian_noise_rms(clip_per_document(g, 1.0), 0.1, ctx, "backward"), 4)
    assert torch.equal(got, expected)
    # a different order gives a different result, so the test above can fail
    other = clip_per_document(quantize_symmetric(gaussian_noise_rms(g, 0.1, ctx, "backward"), 4), 1.0)
    assert not torch.allclose(got, other)
    # clipping bounds each document's norm before noise; noise is 0.1 x RMS of the clipped gradient
    clipped = clip_per_document(g, 1.0)
    assert torch.allclose(clipped.flatten(1).norm(dim=1), torch.ones(3, dtype=torch.float64))
    noise = gaussian_noise_rms(clipped, 0.1, ctx, "backward") - clipped
    rms = clipped.pow(2).mean(dim=(1, 2)).sqrt()
    ratio = noise.pow(2).mean(dim=(1, 2)).sqrt() / rms
    assert ((ratio > 0.08) & (ratio < 0.12)).all()


def test_forward_of_quant4_noisy_is_plain_4_bit():
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(2))
    assert torch.equal(build_defence("quant4-noisy").forward(x, _ctx([1, 2])), quantize_symmetric(x, 4))


@pytest.mark.parametrize("seed", [0, 5])
def test_noise_depends_on_document_not_batching(seed):
    g = torch.randn(4, 5, 6, generator=torch.Generator().manual_seed(seed))
    chain = DefenceChain([build_defence("quant4-noisy")], seed=seed)
    whole = chain.backward(g, "train", 2, (7, 8, 9, 10))
    parts = torch.cat([chain.backward(g[i : i + 1], "train", 2, (7 + i,)) for i in range(4)])
    assert torch.equal(whole, parts)
    assert not torch.equal(whole, chain.backward(g, "train", 3, (7, 8, 9, 10)))  # another step, other noise


def test_chain_composes_in_order_and_none_is_identity():
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(3)) * 3
    assert torch.equal(DefenceChain.from_specs([{"name": "none"}], 0).forward(x, "train", 0, (0, 1)), x)
    chain = DefenceChain.from_specs([{"name": "quant8"}, {"name": "quant4"}], 0)
    assert torch.equal(chain.forward(x, "train", 0, (0, 1)), quantize_symmetric(quantize_symmetric(x, 8), 4))
    assert chain.payload_bits("forward", 32) == 4


def test_unknown_defence_and_bad_arguments_are_clear():
    with pytest.raises(ConfigError, match="unknown defence 'mixupp'.*quant8"):
        build_defence("mixupp")
    with pytest.raises(ConfigError, match="does not take.*lambda.*clip, noise"):
        build_defence("quant4-noisy", {"lambda": 0.5})
    with pytest.raises(ConfigError, match="clip must be a finite number > 0"):
        build_defence("quant4-noisy", {"clip": 0})


def test_frame_round_trip_and_wire_bytes():
    t = torch.randn(2, 32, 64)
    f = Frame("forward", 5, (3, 4), t, torch.ones(2, 32, dtype=torch.long), labels=torch.zeros(2, 32, dtype=torch.long))
    g = decode(encode(f))
    assert g.kind == "forward" and g.step == 5 and g.doc_ids == (3, 4)
    assert torch.equal(g.tensor, t) and torch.equal(g.labels, f.labels)
    assert f.wire_bytes() == 2 * 32 * 64 * 4 + 8 + 2 * 32 * 4
    f.payload_bits = 8
    assert f.wire_bytes() == 2 * 32 * 64 + 2 * 4 + 8 + 2 * 32 * 4
    with pytest.raises(IntegrityError, match="corrupt"):
        decode(b"\x00" * 16)
    with pytest.raises(ValueError, match="one row per document"):
        Frame("forward", 0, (1,), t, torch.ones(2, 32))


@pytest.mark.parametrize("seed", [0, 3])
def test_clip_noise_bounds_rows_and_adds_the_stated_noise(seed):
    from splitleak.defences.base import clip_rows

    x = torch.randn(3, 16, 32, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 4
    clipped = clip_rows(x, 1.5)
    assert (clipped.norm(dim=-1) <= 1.5 + 1e-12).all()
    small = x / x.norm(dim=-1, keepdim=True) * 0.5  # rows already inside the ball are untouched
    assert torch.equal(clip_rows(small, 1.5), small)
    d = build_defence("clip-noise", {"clip": 1.5, "sigma": 0.2, "where": "forward"})
    ctx = WireContext(seed=seed, phase="train", step=0, doc_ids=(1, 2, 3))
    y = d.forward(x, ctx)
    noise = y - clipped
    assert abs(float(noise.std()) - 0.2 * 1.5) < 0.03
    assert torch.equal(d.backward(x, ctx), x)  # forward only
    both = build_defence("clip-noise", {"clip": 1.5, "sigma": 0.0})
    assert (both.backward(x, ctx).norm(dim=-1) <= 1.5 + 1e-12).all()
    with pytest.raises(ConfigError, match="where"):
        build_defence("clip-noise", {"where": "sideways"})


def test_dp_forward_epsilon_matches_the_accountant():
    from opacus.accountants import RDPAccountant

    d = build_defence("dp-forward", {"noise_multiplier": 1.1, "clip": 2.0, "delta": 1e-5})
    rep = d.privacy(tokens=1)
    acc = RDPAccountant()
    acc.step(noise_multiplier=1.1, sample_rate=1.0)
    assert rep["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
    doc = d.privacy(tokens=32)
    for _ in range(31):
        acc.step(noise_multiplier=1.1, sample_rate=1.0)
    assert doc["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
    assert doc["epsilon"] > rep["epsilon"]
    # more noise, less epsilon
    assert build_defence("dp-forward", {"noise_multiplier": 4.0}).privacy()["epsilon"] < rep["epsilon"]
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0)) * 10
    ctx = WireContext(seed=1, phase="train", step=0, doc_ids=(5, 6))
    y = d.forward(x, ctx)
    assert torch.equal(d.backward(y, ctx), y)
    assert abs(float((y - x / x.norm(dim=-1, keepdim=True) * 2.0).std()) - 2.2) < 0.3


@pytest.mark.parametrize("name", ["quant4", "quant4-noisy", "clip-noise", "dp-forward"])
def test_every_defence_composes_with_quant8(name):
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1))
    chain = DefenceChain.from_specs([{"name": "quant8"}, {"name": name}], seed=2)
    solo = DefenceChain.from_specs([{"name": name}], seed=2)
    first = quantize_symmetric(x, 8)
    # the chain is quant8 followed by the defence, with the defence at position 1 of the chain
    from splitleak.defences import build_defence as bd

    d = bd(name)
    ctx = WireContext(seed=2, phase="train", step=4, doc_ids=(0, 1), position=1)
    assert torch.equal(chain.forward(x, "train", 4, (0, 1)), d.forward(first, ctx))
    assert torch.equal(chain.backward(x, "train", 4, (0, 1)), d.backward(quantize_symmetric(x, 8), ctx))
    assert solo.describe()[0]["name"] == name
