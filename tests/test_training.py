import json

import numpy as np
import pytest
import torch

from splitleak.data import load_documents
from splitleak.defences import DefenceChain, quantize_symmetric
from splitleak.errors import ConfigError, NonFiniteError
from splitleak.models import SplitModel, load_model, next_token_loss
from splitleak.runs.captures import load_capture
from splitleak.runs.verify import verify_run
from splitleak.seeds import model_init_seed
from splitleak.training import make_train_config, read_metrics, run_training, train_split, training_order

SMALL = dict(n_calib=4, n_train=12, n_eval=20)


def _cfg(**kw):
    base = dict(model="tiny-gpt2", depth=2, seed=0, **SMALL)
    base.update(kw)
    return make_train_config(**base)


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 3])
def test_undefended_split_training_equals_all_local_training(tmp_path, seed):
    """Client and server step their own AdamW over disjoint parameters: with no defence the split
    run is the all-local run, so ΔU is zero up to float rounding — while training did move the loss."""
    res = run_training(_cfg(seed=seed), tmp_path / "run", device="cpu")
    m = res.metrics
    assert abs(m["delta_u"]) < 1e-6
    assert m["pretrained_ce"] - m["heldout_ce"] > 0.01
    assert m["perplexity"] == pytest.approx(np.exp(m["heldout_ce"]))
    assert set(json.loads((tmp_path / "run" / "metrics.json").read_text())) >= {
        "heldout_ce",
        "perplexity",
        "all_local_ce",
        "delta_u",
    }


@pytest.mark.integration
def test_victim_seeds_share_documents_and_the_data_seed_draws_them(shared_run):
    """Every trained model is scored on the same evaluation documents (What Gradients Add §3), so the crossed
    bootstrap can pair them; the victim seed changes the training, the data seed the documents."""
    docs, runs = {}, {}
    for name, kw in (("a", dict(seed=0)), ("b", dict(seed=1)), ("c", dict(seed=0, data_seed=1))):
        runs[name] = shared_run(_cfg(all_local_baseline=False, **kw))
        docs[name] = json.loads((runs[name] / "documents.json").read_text())
    assert docs["a"] == docs["b"]
    assert docs["a"] != docs["c"]
    ma, mb = (json.loads((runs[n] / "metrics.json").read_text())["heldout_ce"] for n in "ab")
    assert ma != mb  # the victim seed still changes the trained model


@pytest.mark.integration
def test_quantised_training_differs_from_all_local(tmp_path):
    m = run_training(_cfg(defences=[{"name": "quant4-noisy"}]), tmp_path / "run", device="cpu").metrics
    assert abs(m["delta_u"]) > 1e-4


@pytest.mark.integration
def test_wire_bytes_per_step_follow_the_encoding(tmp_path, shared_run):
    m32 = read_metrics(shared_run(_cfg(all_local_baseline=False)))
    m8 = run_training(
        _cfg(all_local_baseline=False, defences=[{"name": "quant8"}]), tmp_path / "b", device="cpu"
    ).metrics
    width, tokens = 64, 32
    mask_bytes, label_bytes = 4, 4 * tokens
    assert m32["wire_bytes_per_step"]["client_to_server"] == tokens * width * 4 + mask_bytes + label_bytes
    assert m32["wire_bytes_per_step"]["server_to_client"] == tokens * width * 4 + mask_bytes
    assert m8["wire_bytes_per_step"]["client_to_server"] == tokens * width + 4 + mask_bytes + label_bytes
    assert m8["wire_bytes_per_step"]["server_to_client"] == tokens * width + 4 + mask_bytes


@pytest.mark.integration
@pytest.mark.parametrize("b,s", [(0, 2), (1, 2), (2, 2)])
def test_partial_offloading_trains_only_the_offloaded_run(b, s):
    lm = load_model("tiny-gpt2", seed=1)
    docs = load_documents("synthetic-pii", lm.tokenizer, seed=1, **SMALL)
    split = SplitModel(lm, offload_start=b, offload_length=s)
    before = {k: v.detach().clone() for k, v in lm.model.named_parameters()}
    chain = DefenceChain([], 1)
    train_split(split, docs.train, chain, chain, seed=1, steps=6, lr=1e-3)
    prefix = "transformer.h."
    for name, p in lm.model.named_parameters():
        inside = name.startswith(prefix) and b <= int(name[len(prefix) :].split(".")[0]) < b + s
        if inside:
            if name.endswith(".weight") and "ln" not in name:
                assert not torch.equal(p, before[name]), f"{name} should have trained"
        else:
            assert torch.equal(p, before[name]), f"{name} is outside [{b}, {b + s}) and changed"


@pytest.mark.unit
def test_training_order_is_a_seeded_pass():
    o = training_order(10, 10, seed=4)
    assert sorted(o) == list(range(10))
    assert o == training_order(10, 10, seed=4) and o != training_order(10, 10, seed=5)
    assert sorted(training_order(10, 25, seed=4)[:20]) == sorted(list(range(10)) * 2)


@pytest.mark.integration
def test_capture_holds_what_crossed_the_wire(tmp_path):
    run = tmp_path / "run"
    res = run_training(_cfg(defences=[{"name": "quant8"}], seed=2), run, device="cpu")
    cap = load_capture(run)
    docs = json.loads((run / "documents.json").read_text())
    eval_ids = [d["doc_id"] for d in docs["evaluation"]]
    assert cap.doc_ids.tolist() == eval_ids
    assert cap.activations.shape == cap.gradients.shape == (20, 32, 64)
    # activations crossed after 8-bit rounding: re-quantising changes nothing
    assert torch.equal(quantize_symmetric(cap.activations, 8), cap.activations)
    assert torch.equal(quantize_symmetric(cap.gradients, 8), cap.gradients)
    # the recomputed activation of the trained client layers rounds to what was captured
    lm = load_model("tiny-gpt2", seed=2)
    split = SplitModel(lm, depth=2)
    from safetensors.torch import load_file

    lm.model.load_state_dict(load_file(run / "client_layers.safetensors"), strict=False)
    ids = torch.tensor([docs["evaluation"][0]["token_ids"]])
    with torch.no_grad():
        h = split.bottom(ids)
    assert torch.equal(quantize_symmetric(h, 8), cap.activations[:1])
    assert res.metrics["capture"]["zero_gradient_row_share"] >= 1 / 32 - 1e-12


@pytest.mark.integration
def test_captured_gradient_is_each_documents_own_loss_gradient(tmp_path):
    """Batched capture returns, per document, d(mean next-token loss of that document)/d(activation)."""
    run = tmp_path / "run"
    run_training(_cfg(seed=5, data_seed=5, capture_batch=8, all_local_baseline=False), run, device="cpu")
    cap = load_capture(run)
    docs = json.loads((run / "documents.json").read_text())
    lm = load_model("tiny-gpt2", seed=model_init_seed(5))  # the model a run with seed 5 builds
    split = SplitModel(lm, depth=2)
    from safetensors.torch import load_file

    # reproduce the trained server from a fresh split training with the same seed
    sets = load_documents("synthetic-pii", lm.tokenizer, seed=5, **SMALL)
    chain = DefenceChain([], 5)
    train_split(split, sets.train, chain, chain, seed=5, steps=12, lr=5e-5)
    assert torch.equal(
        load_file(run / "client_layers.safetensors")["transformer.wte.weight"], lm.model.transformer.wte.weight.detach()
    )
    for i in (0, 9, 19):
        ids = torch.tensor([docs["evaluation"][i]["token_ids"]])
        h = split.bottom(ids).detach().requires_grad_(True)
        ctx = split.context(*ids.shape)
        loss = next_token_loss(split.head_logits(split.trunk(h, ctx), ctx), ids)
        (g,) = torch.autograd.grad(loss, h)
        assert torch.allclose(g, cap.gradients[i : i + 1], atol=1e-7, rtol=1e-5)
        assert torch.equal(cap.gradients[i, -1], torch.zeros(64))  # the last position has no target


@pytest.mark.integration
def test_same_seed_same_captures_bit_for_bit(tmp_path):
    cfg = _cfg(defences=[{"name": "quant4-noisy"}], seed=7, all_local_baseline=False)
    run_training(cfg, tmp_path / "a", device="cpu")
    run_training(cfg, tmp_path / "b", device="cpu")
    a, b = load_capture(tmp_path / "a"), load_capture(tmp_path / "b")
    assert torch.equal(a.activations, b.activations) and torch.equal(a.gradients, b.gradients)
    c = load_capture(
        run_training(
            _cfg(defences=[{"name": "quant4-noisy"}], seed=8, all_local_baseline=False), tmp_path / "c", device="cpu"
        ).run_dir
    )
    assert not torch.equal(a.gradients[:, :5], c.gradients[:, :5])


@pytest.mark.integration
def test_non_finite_loss_stops_with_step_and_hint_and_keeps_run_valid(tmp_path):
    lm = load_model("tiny-gpt2", seed=0)
    with torch.no_grad():
        lm.model.transformer.h[3].mlp.c_fc.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"step 0.*--precision float64"):
        run_training(_cfg(depth=2), tmp_path / "run", device="cpu", lm=lm)
    v = verify_run(tmp_path / "run")
    assert v.ok and v.status == "failed", v.message
    log = json.loads((tmp_path / "run" / "training.json").read_text())
    assert log["losses"] == [] and "step 0" in log["error"]


@pytest.mark.unit
@pytest.mark.parametrize(
    "kw,words",
    [
        (dict(defences=[{"name": "quant9"}]), "unknown defence 'quant9'"),
        (dict(doc_len=1), "doc_len"),
        (dict(precision="float16"), "precision"),
        (dict(unknown_key=3), "unknown_key"),
    ],
)
def test_bad_config_is_refused_before_anything_is_written(kw, words):
    with pytest.raises(ConfigError, match=words):
        _cfg(**kw)


@pytest.mark.integration
def test_bad_depth_and_data_write_nothing(tmp_path):
    with pytest.raises(ConfigError, match="out of range"):
        run_training(_cfg(depth=9), tmp_path / "a", device="cpu")
    assert not (tmp_path / "a").exists()
    from splitleak.errors import DataError

    with pytest.raises(DataError):
        run_training(_cfg(data="wikitext2", data_path=str(tmp_path / "nowhere")), tmp_path / "b", device="cpu")
    assert not (tmp_path / "b").exists()


@pytest.mark.integration
@pytest.mark.slow
def test_smollm2_trains_and_captures_on_wikitext(tmp_path, smollm2, wikitext_dir):
    cfg = make_train_config(
        model="smollm2-135m",
        depth=6,
        data="wikitext2",
        data_path=str(wikitext_dir),
        n_calib=2,
        n_train=4,
        n_eval=4,
        steps=4,
        seed=0,
        all_local_baseline=False,
    )
    res = run_training(cfg, tmp_path / "run", device="cpu")
    cap = load_capture(tmp_path / "run")
    assert cap.activations.shape == (4, 32, 576)
    assert np.isfinite(res.metrics["heldout_ce"]) and res.metrics["heldout_ce"] < 6.0
    assert verify_run(tmp_path / "run").ok


@pytest.mark.integration
@pytest.mark.parametrize("defence", ["none", "replica-median"])
def test_the_all_local_twin_loads_only_after_the_split_phase_is_freed_and_trains_the_same(tmp_path, defence):
    """Memory (issue 17): given a model it alone holds and a factory of pristine weights (a grid worker's
    way), run_training frees the split phase's model (and the server replicas) before it asks for the
    all-local twin's weights, so the two never sit in memory together; the metrics are those of a run that
    copied the weights up front."""
    import gc
    import weakref

    defences = [{"name": defence, "args": {"k": 3}}] if defence != "none" else [{"name": "none"}]
    cfg = make_train_config(
        model="tiny-gpt2", depth=2, n_calib=4, n_train=4, n_eval=4, doc_len=16, seed=5, defences=defences
    )

    def fresh():
        return load_model("tiny-gpt2", precision="float32", seed=model_init_seed(5))

    refs: list = []

    def handed_over():
        lm = fresh()
        refs.append(weakref.ref(lm.model))
        return lm

    freed: list[bool] = []

    def pristine():
        gc.collect()
        freed.append(refs[0]() is None)
        return fresh()

    res = run_training(cfg, tmp_path / "a", device="cpu", lm=handed_over(), pristine=pristine)
    assert freed == [True]  # asked once, and only after the split phase's model was gone
    copied = run_training(cfg, tmp_path / "b", device="cpu", lm=fresh())  # the twin copied before training
    for key in ("heldout_ce", "all_local_ce", "delta_u", "pretrained_ce"):
        assert res.metrics[key] == copied.metrics[key], key
