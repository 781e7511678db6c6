"""``runtime.fused_optimizer``: the attacks' and the trainings' Adam as torch's fused kernel, the same update."""

from __future__ import annotations

import pytest
import torch

from splitleak.runtime import fused_optimizer

pytestmark = pytest.mark.unit


def _run(opt_for, seed: int, steps: int = 25, dtype=torch.float32):
    """Params after ``steps`` steps on seeded gradients (a quadratic pull plus noise, so that the moments vary)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(7, 33, generator=gen, dtype=dtype).requires_grad_(True)
    b = torch.randn(33, generator=gen, dtype=dtype).requires_grad_(True)
    opt = opt_for([w, b])
    for _ in range(steps):
        for p in (w, b):
            p.grad = 0.3 * p.detach() + torch.randn(p.shape, generator=gen, dtype=dtype)
        opt.step()
    return opt, torch.cat([w.detach().flatten(), b.detach().flatten()])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "cls, kwargs",
    [(torch.optim.Adam, {"lr": 0.05}), (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.01})],
    ids=["adam", "adamw"],
)
def test_the_fused_kernel_makes_the_default_kernels_update(seed, cls, kwargs):
    fused, got = _run(lambda ps: fused_optimizer(cls, ps, **kwargs), seed)
    default, want = _run(lambda ps: cls(ps, **kwargs), seed)
    assert fused.defaults["fused"] is True and not default.defaults["fused"]
    assert isinstance(fused, cls)
    # the same update up to float32 rounding: 25 steps of lr 0.05 move each value by up to about 1.25
    moved = (want - _run(lambda ps: cls(ps, **kwargs), seed, steps=0)[1]).abs()
    assert float(moved.median()) > 0.1
    assert torch.allclose(got, want, rtol=0, atol=1e-5), float((got - want).abs().max())


def test_the_arguments_reach_the_optimizer():
    # a different learning rate or weight decay gives a visibly different trajectory
    _, base = _run(lambda ps: fused_optimizer(torch.optim.AdamW, ps, lr=0.05, weight_decay=0.01), 3)
    _, lr = _run(lambda ps: fused_optimizer(torch.optim.AdamW, ps, lr=0.02, weight_decay=0.01), 3)
    _, wd = _run(lambda ps: fused_optimizer(torch.optim.AdamW, ps, lr=0.05, weight_decay=0.5), 3)
    assert float((base - lr).abs().max()) > 0.1
    assert float((base - wd).abs().max()) > 1e-3


def test_params_without_a_fused_kernel_get_the_default_one():
    p = torch.zeros(3, dtype=torch.complex64, requires_grad=True)
    opt = fused_optimizer(torch.optim.Adam, iter([p]), lr=0.1)  # any iterable, as torch's own
    assert not opt.defaults["fused"]
    p.grad = torch.ones_like(p)
    opt.step()
    assert torch.allclose(p.detach().real, torch.full((3,), -0.1))
