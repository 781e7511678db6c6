"""The prefix search's candidate attention (``attacks.candidate_attention``): linear in the candidates, the same
activations as recomputing each candidate's whole text, on every architecture the search runs on."""

import contextlib

import pytest
import torch
from test_models import _tiny_gpt2, _tiny_llama, _tiny_qwen3

import splitleak.attacks.candidate_attention as ca
import splitleak.attacks.knowledge as knowledge
from splitleak.attacks.knowledge import ClientCopy
from splitleak.errors import ConfigError


def _qwen3_full(seed=0):
    lm = _tiny_qwen3(seed)
    lm.model.config.layer_types = ["full_attention"] * lm.model.config.num_hidden_layers
    return lm


BUILDERS = {"gpt2": _tiny_gpt2, "llama-gqa": _tiny_llama, "qwen3": _qwen3_full}


def _prefix(client, ids):
    cache = client.new_cache()
    for p in range(ids.shape[1]):
        client.extend(cache, ids[:, p : p + 1], p)
    return cache


@pytest.mark.unit
@pytest.mark.parametrize("arch", sorted(BUILDERS))
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("t,k", [(0, 3), (5, 1), (6, 40)])
def test_extend_gives_each_candidate_the_activation_of_its_whole_text(arch, seed, t, k):
    lm = BUILDERS[arch](seed)
    client = ClientCopy(lm.model, 2)
    gen = torch.Generator().manual_seed(seed)
    n = 3
    ids = torch.randint(0, client.vocab_size, (n, t), generator=gen)
    cand = torch.randint(0, client.vocab_size, (n, k), generator=gen)
    with torch.no_grad():
        cache = _prefix(client, ids)
    fallbacks, served = [], []
    sdpa, switch = ca._sdpa, knowledge.extend_attention

    @contextlib.contextmanager
    def counted(*args):
        with switch(*args) as taken:
            yield taken
        served.append(len(taken))

    ca._sdpa = lambda *a, **kw: fallbacks.append(1) or sdpa(*a, **kw)
    knowledge.extend_attention = counted
    try:
        with torch.no_grad():
            out = client.extend(cache, cand, t)
    finally:
        ca._sdpa, knowledge.extend_attention = sdpa, switch
    assert served == [2] and fallbacks == []  # both blocks attended through the linear path
    with torch.no_grad():
        whole = torch.stack(
            [
                client.owner(
                    input_ids=torch.cat([ids[i : i + 1].expand(k, -1), cand[i].unsqueeze(1)], 1)
                ).last_hidden_state[:, -1]
                for i in range(n)
            ]
        )
    assert out.shape == whole.shape
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-5)
    assert client.owner.config._attn_implementation != ca.NAME  # switched back after the forward


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1])
def test_the_linear_path_equals_transformers_masked_attention_and_leaves_other_calls_to_it(seed):
    gen = torch.Generator().manual_seed(seed)
    b, h_kv, g, t, k, dh = 2, 2, 3, 7, 11, 8
    q = torch.randn(b, h_kv * g, k, dh, generator=gen)
    key = torch.randn(b, h_kv, t + k, dh, generator=gen)
    val = torch.randn(b, h_kv, t + k, dh, generator=gen)
    mask = torch.zeros(b, 1, k, t + k, dtype=torch.bool)
    mask[..., :t] = True
    mask[:, 0, torch.arange(k), t + torch.arange(k)] = True

    class Module(torch.nn.Module):
        num_key_value_groups = g
        is_causal = True

    m = Module()
    ref, _ = ca._sdpa(m, q, key, val, mask, scaling=0.3)
    with ca.extend_attention(type("Config", (), {"_attn_implementation": "sdpa"})(), t, k) as taken:
        fast, _ = ca.candidate_attention(m, q, key, val, None, scaling=0.3)
        # a shape it does not cover (a query per key, as a full forward has) goes to transformers' sdpa
        causal = torch.ones(t + k, t + k, dtype=torch.bool).tril().expand(b, 1, -1, -1)
        q_full = torch.randn(b, h_kv * g, t + k, dh, generator=gen)
        other, _ = ca.candidate_attention(m, q_full, key, val, causal, scaling=0.3)
    assert taken == [1]
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(other, ca._sdpa(m, q_full, key, val, causal, scaling=0.3)[0])
    # outside ``extend_attention`` nothing is linear
    out, _ = ca.candidate_attention(m, q, key, val, mask, scaling=0.3)
    torch.testing.assert_close(out, ref)


@pytest.mark.unit
def test_the_config_is_switched_back_when_the_forward_fails():
    config = type("Config", (), {"_attn_implementation": "eager"})()
    with pytest.raises(RuntimeError, match="boom"):
        with ca.extend_attention(config, 3, 2):
            assert config._attn_implementation == ca.NAME
            raise RuntimeError("boom")
    assert config._attn_implementation == "eager" and ca._ACTIVE.get() is None


@pytest.mark.unit
def test_the_prefix_search_refuses_sliding_window_blocks_by_name():
    lm = _tiny_qwen3(0)  # blocks 2 and up attend through a window of 4 tokens
    client = ClientCopy(lm.model, 4)
    with pytest.raises(ConfigError, match=r"sliding-window attention: blocks \[2, 3\]"):
        client.extend(client.new_cache(), torch.zeros(1, 2, dtype=torch.long), 0)
    shallow = ClientCopy(_tiny_qwen3(0).model, 2)  # before the window: searched as usual
    assert shallow.extend(shallow.new_cache(), torch.zeros(1, 2, dtype=torch.long), 0).shape == (1, 2, 32)
