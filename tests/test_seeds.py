"""Seeds derived from the run seed: frozen values (runs stay reproducible across versions), one per
purpose, and none of them the run seed."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitleak.seeds import derive_seed, model_init_seed, server_seed

pytestmark = pytest.mark.unit


def test_derived_seeds_are_frozen():
    # SHA-256("splitleak|PURPOSE|SEED"), first 8 bytes little-endian, top bit cleared
    assert server_seed(0) == 300340784240547127
    assert model_init_seed(0) == 6439487381048378538
    assert server_seed(4) == 1702282596909219442
    assert model_init_seed(4) == 1057049092343118071


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=2**63 - 1))
def test_each_purpose_gets_its_own_63_bit_seed(seed):
    a, b = server_seed(seed), model_init_seed(seed)
    assert a != b and seed not in (a, b)
    assert 0 <= a < 2**63 and 0 <= b < 2**63


def test_an_unknown_purpose_is_refused():
    with pytest.raises(ValueError, match="unknown seed purpose 'order'"):
        derive_seed(1, "order")


def test_the_os_draws_of_a_tests_run_are_replayable_from_the_sessions_printed_seed(tmp_path, request):
    """Every OS secret (``splitleak.seeds.entropy``) a test's run draws is a function of the session's
    SPLITLEAK_TEST_ENTROPY and the test's id (tests/conftest.py), so a failing test under draws=os replays with
    the same draws (outside the suite the secret is ``os.urandom``'s)."""
    from conftest import _Entropy

    from splitleak.training import make_train_config, run_training
    from splitleak.training.run import read_draws_secret

    cfg = make_train_config(
        model="tiny-gpt2", depth=1, n_calib=1, n_train=1, n_eval=2, all_local_baseline=False,
        defences=[{"name": "clip-noise", "args": {"clip": 1.0, "sigma": 0.1}}],
    )  # fmt: skip
    assert cfg.draws == "os"
    run_training(cfg, tmp_path / "a", device="cpu")
    assert read_draws_secret(tmp_path / "a") == _Entropy(request.node.nodeid)(16)
    with _Entropy("another test"):
        run_training(cfg, tmp_path / "b", device="cpu")
    assert read_draws_secret(tmp_path / "b") != read_draws_secret(tmp_path / "a")


def test_a_missing_shared_file_skips_here_and_fails_where_ci_requires_it(tmp_path, monkeypatch):
    """conftest.need_shared: silent on a file that is there; a missing one skips naming where it was looked
    for, and fails instead under SPLITLEAK_REQUIRE_SHARED=1 (set by .ci/run)."""
    from conftest import REQUIRE_SHARED_ENV, need_shared

    (tmp_path / "here").write_text("x")
    need_shared(tmp_path / "here")
    monkeypatch.delenv(REQUIRE_SHARED_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="gone is not here"):
        need_shared(tmp_path / "here", tmp_path / "gone")
    monkeypatch.setenv(REQUIRE_SHARED_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="gone is not here.*SPLITLEAK_REQUIRE_SHARED=1 requires it"):
        need_shared(tmp_path / "gone")
