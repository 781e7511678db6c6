"""Gradient Mirage's parts (003): the vMF directional privatization (sampler, defence, its ε) and the
gradient-utility metrics (ASNR, Recall and Jaccard over the top coordinates)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from splitleak.errors import ConfigError


def _mean_cosine(d: int, kappa: float, terms: int = 5000) -> float:
    """E[μᵀx] under vMF(μ, κ) on the sphere in R^d: I_{d/2}(κ) / I_{d/2-1}(κ), from Gauss's continued
    fraction I_{ν+1}/I_ν = 1 / (2(ν+1)/κ + 1 / (2(ν+2)/κ + ...)) (the Bessel functions themselves
    underflow at large orders)."""
    nu = d / 2 - 1
    r = 0.0
    for k in range(terms, 0, -1):
        r = 1.0 / (2.0 * (nu + k) / kappa + r)
    return r


@pytest.mark.unit
@pytest.mark.parametrize("d,kappa,seed", [(3, 1.0, 0), (64, 50.0, 1), (576, 1000.0, 2), (576, 20.0, 3)])
def test_the_vmf_sampler_draws_what_scipy_draws(d, kappa, seed):
    from scipy.stats import ks_2samp, vonmises_fisher

    from splitleak.defences.vmf import sample_vmf

    rng = np.random.default_rng(seed)
    mu = rng.normal(size=d)
    mu /= np.linalg.norm(mu)
    n = 3000
    x = sample_vmf(torch.tensor(mu).expand(n, d).contiguous(), kappa, torch.Generator().manual_seed(seed)).numpy()
    ref = vonmises_fisher(mu, kappa).rvs(n, random_state=rng)
    assert np.abs(np.linalg.norm(x, axis=1) - 1).max() < 1e-12
    w, w_ref = x @ mu, ref @ mu
    # the mean cosine is the Bessel ratio (its standard error is below 0.02 at n = 3000 for these)
    assert abs(w.mean() - _mean_cosine(d, kappa)) < 0.02
    assert ks_2samp(w, w_ref).pvalue > 1e-3
    # the part orthogonal to mu is uniform: along a fixed orthogonal direction it has mean zero and
    # the same distribution as scipy's
    e = rng.normal(size=d)
    e -= (e @ mu) * mu
    e /= np.linalg.norm(e)
    assert ks_2samp(x @ e, ref @ e).pvalue > 1e-3
    assert abs((x @ e).mean()) < 4 * (x @ e).std() / math.sqrt(n) + 1e-12


@pytest.mark.unit
def test_the_vmf_sampler_is_deterministic_under_its_generator_and_refuses_bad_kappa():
    from splitleak.defences.vmf import privatize_rows, sample_vmf

    mu = torch.nn.functional.normalize(torch.randn(8, 16, generator=torch.Generator().manual_seed(0)), dim=-1)
    a = sample_vmf(mu, 10.0, torch.Generator().manual_seed(5))
    b = sample_vmf(mu, 10.0, torch.Generator().manual_seed(5))
    c = sample_vmf(mu, 10.0, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ConfigError, match="kappa"):
            sample_vmf(mu, bad, torch.Generator())
    # norms kept, zero rows kept zero
    g = torch.randn(4, 5, 16, dtype=torch.float64)
    g[1, 2] = 0
    out = privatize_rows(g, 3.0, torch.Generator().manual_seed(1))
    assert torch.allclose(out.norm(dim=-1), g.norm(dim=-1), atol=1e-12)
    assert torch.equal(out[1, 2], torch.zeros(16, dtype=torch.float64))
    assert (torch.nn.functional.cosine_similarity(out.reshape(-1, 16), g.reshape(-1, 16)) < 1 - 1e-6).sum() >= 19


@pytest.mark.unit
def test_gradient_utility_metrics_on_known_cases():
    from splitleak.metrics.gradient_utility import gradient_utility

    g = torch.tensor([[[3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]]])
    same = gradient_utility(g, g.clone())[0]
    assert same["asnr"] == math.inf and same["recall@10"] == 1.0 and same["jaccard@10"] == 1.0
    # noise 1 on the last coordinate: the top coordinate (3) untouched, ASNR = sqrt(10) / 1
    r = g.clone()
    r[0, 0, 9] += 1.0
    m = gradient_utility(g, r)[0]
    assert m["asnr"] == pytest.approx(math.sqrt(10.0)) and m["asnr@10"] == math.inf and m["recall@10"] == 1.0
    # noise that makes another coordinate the largest: the top sets differ
    r = g.clone()
    r[0, 0, 5] = 5.0
    m = gradient_utility(g, r)[0]
    assert m["recall@10"] == 0.0 and m["jaccard@10"] == 0.0 and m["asnr@10"] == math.inf
    assert gradient_utility(g, r, share=0.2)[0]["recall@20"] == 0.5  # top 2 of g: {0, 9}; of r: {5, 0}
    with pytest.raises(ValueError, match="shape"):
        gradient_utility(g, g[..., :5])


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vmf_never_brings_the_asnr_below_one_half(seed):
    """‖r − g‖ ≤ ‖r‖ + ‖g‖ = 2‖g‖ row by row when the norm is kept, so ASNR ≥ 1/2 at any kappa."""
    from splitleak.defences.vmf import privatize_rows
    from splitleak.metrics.gradient_utility import gradient_utility

    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(6, 8, 64, generator=gen, dtype=torch.float64) * torch.rand(
        6, 8, 1, generator=gen, dtype=torch.float64
    )
    for kappa in (1e-3, 0.1, 1.0, 10.0, 1e3, 1e5):
        out = gradient_utility(g, privatize_rows(g, kappa, gen))
        assert min(m["asnr"] for m in out) >= 0.5 - 1e-12
    # and it is near 1/2 when the direction is all but random (kappa -> 0), far above when kappa is large
    low = np.mean([m["asnr"] for m in gradient_utility(g, privatize_rows(g, 1e-3, gen))])
    high = np.mean([m["asnr"] for m in gradient_utility(g, privatize_rows(g, 1e5, gen))])
    assert 0.5 <= low < 0.8 and high > 10


@pytest.mark.unit
def test_vmf_epsilon_and_the_defences_arguments():
    from splitleak.defences import build_defence

    d = build_defence("vmf", {"kappa": 250})
    assert d.roles() == ("backward-wire",) and d.split_modes == ("u-shape", "label-shielded")
    eps = d.privacy()
    assert eps["epsilon_per_unit_distance"] == 250.0 and eps["epsilon_per_row_worst_case"] == 500.0
    assert "norm" in eps["mechanism"] and "unprotected" in eps["mechanism"]
    for bad in ({"kappa": 0}, {"kappa": "big"}, {"kappa": -3.0}):
        with pytest.raises(ConfigError, match="kappa"):
            build_defence("vmf", bad)


SMALL = dict(model="tiny-gpt2", n_calib=2, n_train=4, n_eval=4, doc_len=8, steps=2, all_local_baseline=False)


@pytest.mark.integration
def test_vmf_privatizes_the_output_gradient_that_crosses_and_nothing_else(tmp_path):
    from splitleak.runs.captures import load_capture
    from splitleak.training import make_train_config, run_training

    # seeded draws: the vMF directions of 8 rows are compared with their expected mean cosine, which a
    # fresh secret per run would make pass or fail by chance (about one run in twenty at this tolerance)
    u = dict(offload_start=1, offload_length=1, draws="derived")
    run_training(make_train_config(**SMALL, **u), tmp_path / "open", device="cpu")
    kappa = 20.0
    run_training(make_train_config(**SMALL, **u, defences=[{"name": "vmf", "args": {"kappa": kappa}}]), tmp_path / "vmf", device="cpu")  # fmt: skip
    a, b = load_capture(tmp_path / "open", phase="train"), load_capture(tmp_path / "vmf", phase="train")
    assert a.output_gradients is not None and b.output_gradients is not None
    # step 0: the same weights, so the same activations, trunk output and raw output gradient
    first = a.steps == 0
    assert torch.equal(a.activations[first], b.activations[first])
    assert torch.equal(a.trunk_output[first], b.trunk_output[first])
    raw, sent = a.output_gradients[first].double(), b.output_gradients[first].double()
    assert torch.allclose(sent.norm(dim=-1), raw.norm(dim=-1), rtol=1e-5)
    cos = torch.nn.functional.cosine_similarity(sent.reshape(-1, sent.shape[-1]), raw.reshape(-1, raw.shape[-1]))
    d = raw.shape[-1]
    assert abs(float(cos.mean()) - _mean_cosine(d, kappa)) < 0.1 and float(cos.max()) < 0.999
    # the trunk trained on the privatized gradient: at the next step its output differs
    later = a.steps == 1
    assert not torch.equal(a.trunk_output[later], b.trunk_output[later])
    man = (tmp_path / "vmf" / "manifest.json").read_text()
    assert "vMF(kappa=20)" in man


@pytest.mark.integration
def test_vmf_is_refused_on_a_plain_split_naming_the_fix(tmp_path):
    from splitleak.training import make_train_config, run_training

    with pytest.raises(ConfigError, match="vmf acts on the output gradient a U-shape returns.*--offload-start"):
        run_training(make_train_config(**SMALL, depth=2, defences=[{"name": "vmf"}]), tmp_path / "r", device="cpu")
    assert not (tmp_path / "r").exists()
