"""The gauges of the decoy system: frozen vectors for the key derivation, and the properties each
gauge must have (Haar rotation, uniform permutation, clamped scale, exact inverse)."""

from __future__ import annotations

import hashlib
import itertools

import numpy as np
import pytest
import torch

from splitleak.defences import gauges as G
from splitleak.errors import ConfigError

pytestmark = pytest.mark.unit
M = bytes(range(16))


def test_frozen_vectors_of_the_key_derivation():
    """Any change to the derivation changes these numbers: a run's gauges are fixed by its seed."""
    assert G.derive_master(0, "train", 0, "forward", 0).hex() == "9ac09dfb7efc7ae64b54c9e34a33f56a"
    # the stream is SHA-256(DOMAIN ‖ master ‖ counter) read as big-endian u64 words
    block0 = hashlib.sha256(G.DOMAINS["rotation"] + M + (0).to_bytes(8, "big")).digest()
    w = G.words(G.DOMAINS["rotation"], M, 3)
    assert int(w[0]) == int.from_bytes(block0[:8], "big") == 0xD2DDC73839D39001
    assert [int(x) for x in w[1:]] == [0x6401D7A88FB2F286, 0x378AB86DA2C8B92B]
    # uniforms are exact: 53 bits times 2^-53
    assert G.uniforms(w).tolist() == [0.8236965667982317, 0.3906531130339308, 0.21696045567185507]
    assert G.uniforms(w)[0] == (0xD2DDC73839D39001 >> 11) / 2**53
    # the permutation is integer arithmetic on the stream: pinned whole
    perm = G.fisher_yates(M, 80)
    assert perm[:12].tolist() == [30, 58, 67, 42, 0, 70, 46, 8, 12, 44, 49, 2]
    digest = hashlib.sha256(np.asarray(perm, dtype="<i8").tobytes()).hexdigest()
    assert digest == "82be62aaceb5417dfd9d8a64c3f51f56ea0b93b90ac5a0cda10557083a29e38f"
    # Gaussians and the QR go through libm / LAPACK: pinned with a tolerance
    np.testing.assert_allclose(
        G.gaussians(G.DOMAINS["rotation"], M, 4),
        [-1.4403953638846505, 1.181676194211587, -0.5316176926071688, 0.45445218694198963],
        rtol=1e-13,
    )
    q = G.haar_rotation(M, 64)
    np.testing.assert_allclose(q[0, :3], [-0.17089468016544274, 0.15324476279989255, -0.08060424212678291], atol=1e-12)
    digest = hashlib.sha256(np.round(q, 6).astype("<f8").tobytes()).hexdigest()
    assert digest == "2009985248401f977b99a03467ceddd4b4616b0c5a1cec54447e26b496f66a81"
    np.testing.assert_allclose(
        G.row_scales(M, 6),
        [0.6933973187894165, -0.6875364410274637, -0.7616409549957643, -1.5145937654348978, -1.9394329106227906,
         1.5238371668698962],
        rtol=1e-13,
    )  # fmt: skip


def test_masters_differ_by_every_field_and_os_entropy_is_not_reproducible():
    masters = {G.derive_master(7, "train", 3, "forward", 0)}
    for alt in [(8, "train", 3, "forward", 0), (7, "capture", 3, "forward", 0), (7, "train", 4, "forward", 0),
                (7, "train", 3, "return", 0), (7, "train", 3, "forward", 1)]:  # fmt: skip
        masters.add(G.derive_master(*alt))
    assert len(masters) == 6
    a = G.frame_gauge(1, "train", 0, 0, 8, 4, scale=False, entropy="os")
    b = G.frame_gauge(1, "train", 0, 0, 8, 4, scale=False, entropy="os")
    assert not np.allclose(a.rotation, b.rotation)
    c = G.frame_gauge(1, "train", 0, 0, 8, 4, scale=False)
    d = G.frame_gauge(1, "train", 0, 0, 8, 4, scale=False)
    assert np.array_equal(c.rotation, d.rotation) and np.array_equal(c.perm, d.perm)
    with pytest.raises(ConfigError, match="unknown gauge entropy"):
        G.frame_gauge(1, "train", 0, 0, 8, 4, scale=False, entropy="urandom")
    with pytest.raises(ConfigError, match="16 bytes"):
        G.stream_bytes(G.DOMAINS["scale"], b"short", 8)


def test_the_rotation_is_haar_only_with_the_sign_fix():
    """E[trace Q] = 0 under the Haar measure on O(D); QR's raw Q is biased (here ≈ −0.75 for D = 4)."""
    fixed, raw = [], []
    for i in range(400):
        m = G.derive_master(i, "test", 0, "forward")
        g = G.gaussians(G.DOMAINS["rotation"], m, 16).reshape(4, 4)
        raw.append(np.trace(np.linalg.qr(g)[0]))
        q = G.haar_rotation(m, 4)
        np.testing.assert_allclose(q @ q.T, np.eye(4), atol=1e-12)
        fixed.append(np.trace(q))
    se = np.std(fixed) / np.sqrt(len(fixed))
    assert abs(np.mean(fixed)) < 3 * se
    assert np.mean(raw) < -0.5


def test_the_permutation_is_uniform():
    """All 24 permutations of 4 rows, equally often (chi-square, 2,400 draws)."""
    counts = {p: 0 for p in itertools.permutations(range(4))}
    for i in range(2400):
        counts[tuple(G.fisher_yates(G.derive_master(i, "test", 0, "forward"), 4).tolist())] += 1
    from scipy.stats import chisquare

    assert chisquare(list(counts.values())).pvalue > 1e-3
    assert sorted(G.fisher_yates(M, 80).tolist()) == list(range(80))


def test_scales_are_clamped_signed_and_log_normal():
    s = np.concatenate([G.row_scales(G.derive_master(i, "test", 0, "forward"), 80) for i in range(50)])
    a = np.abs(s)
    assert a.min() >= 0.2 and a.max() <= 5.0
    assert (a == 0.2).any() and (a == 5.0).any()  # the clamp binds on both sides at σ = 0.75 over 4,000 rows
    assert 0.45 < (s < 0).mean() < 0.55
    inner = np.log(a[(a > 0.2) & (a < 5.0)])
    assert abs(np.median(inner)) < 0.05 and 0.65 < np.std(inner) < 0.8


@pytest.mark.parametrize("scale", [False, True])
def test_inverse_undoes_apply_and_the_gauge_hides_order_and_coordinates(scale):
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(80, 16, generator=gen, dtype=torch.float64)
    g = G.frame_gauge(11, "train", 5, 0, 80, 16, scale=scale)
    zt = g.apply(z)
    torch.testing.assert_close(g.inverse(zt), z, rtol=0, atol=1e-12)
    # rows move as the permutation says, and keep their norms unless scaled
    row = 17
    pos = g.position_of(row)
    want = z[row].norm() * (abs(g.scale[row]) if scale else 1.0)
    torch.testing.assert_close(zt[pos].norm(), torch.as_tensor(want, dtype=torch.float64))
    # the Gram matrix of the rows is what survives a rotation: same up to the permutation (no scale)
    if not scale:
        perm = torch.as_tensor(g.perm)
        torch.testing.assert_close(zt @ zt.T, (z @ z.T)[perm][:, perm])
    # differentiable: the gradient through apply then inverse is the identity
    z.requires_grad_(True)
    g.inverse(g.apply(z)).sum().backward()
    torch.testing.assert_close(z.grad, torch.ones_like(z), rtol=0, atol=1e-12)
