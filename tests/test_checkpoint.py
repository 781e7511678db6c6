"""Checkpoints of one side of a split run: AdamW restored exactly, damage refused, the newest kept."""

import pytest
import torch

from splitleak.errors import ConfigError, IntegrityError
from splitleak.training.checkpoint import CheckpointDir, restore_state, state_tensors

pytestmark = pytest.mark.unit


def _model(seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def _step(m, opt, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 4, generator=g)
    opt.zero_grad()
    m(x).pow(2).sum().backward()
    opt.step()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_restored_side_continues_bit_for_bit(tmp_path, seed):
    ref, ref_opt = _model(seed)
    for s in range(5):
        _step(ref, ref_opt, 100 + s)
    a, a_opt = _model(seed)
    for s in range(3):
        _step(a, a_opt, 100 + s)
    folder = CheckpointDir(tmp_path / "ck")
    folder.save(3, *state_tensors(list(a.parameters()), a_opt))
    b, b_opt = _model(seed + 10)  # other initial weights: all of them come from the checkpoint
    done, tensors, record, _ = folder.load()
    restore_state(list(b.parameters()), b_opt, tensors, record)
    for s in range(done, 5):
        _step(b, b_opt, 100 + s)
    assert done == 3 and all(torch.equal(x, y) for x, y in zip(ref.parameters(), b.parameters()))


def test_the_newest_are_kept_and_damage_is_refused(tmp_path):
    m, opt = _model(0)
    folder = CheckpointDir(tmp_path / "ck", keep=2)
    for done in (2, 4, 6):
        _step(m, opt, done)
        folder.save(done, *state_tensors(list(m.parameters()), opt))
    assert folder.steps() == [4, 6]
    with pytest.raises(ConfigError, match="no checkpoint after 2 steps"):
        folder.load(2)
    path = folder.path(6)
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(IntegrityError, match="not a readable checkpoint"):
        folder.load(6)
    _, tensors, record, _ = folder.load(4)
    other, other_opt = torch.nn.Linear(4, 2), None
    with pytest.raises(IntegrityError, match="holds 4 trained parameters, this side trains 2"):
        restore_state(list(other.parameters()), other_opt, tensors, record)
    with pytest.raises(ConfigError, match="holds no checkpoint"):
        CheckpointDir(tmp_path / "empty").load()


def test_a_checkpoint_whose_tensors_changed_is_refused(tmp_path):
    """A byte of a tensor flipped (the safetensors header intact): the digest in the header no longer matches."""
    m, opt = _model(0)
    _step(m, opt, 1)
    folder = CheckpointDir(tmp_path / "ck")
    path, sha = folder.save(1, *state_tensors(list(m.parameters()), opt))
    data = bytearray(path.read_bytes())
    assert folder.load(1)[3] == sha
    data[-3] ^= 0x10  # inside the last tensor's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="its tensors differ from the digest in its header"):
        folder.load(1)


def test_a_checkpoint_is_pruned_only_when_asked(tmp_path):
    """The client records a checkpoint in its run's journal before the previous one goes (``prune=False``)."""
    m, opt = _model(0)
    folder = CheckpointDir(tmp_path / "ck", keep=1)
    folder.save(2, *state_tensors(list(m.parameters()), opt))
    folder.save(4, *state_tensors(list(m.parameters()), opt), prune=False)
    assert folder.steps() == [2, 4]
    folder.prune()
    assert folder.steps() == [4]
