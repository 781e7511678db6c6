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
