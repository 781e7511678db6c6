"""Label-shielded split fine-tuning (003 §2) and Gradient Mirage's defences and baselines (003 §4, §5):
the instruction set and answer-only supervision, the cut, who trains what, dual-track backpropagation,
the exposed loss's weights, Bottom-gradient recovery, what the capture holds and the client keeps."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from splitleak.defences import DefenceChain, WireContext, build_defence
from splitleak.errors import ConfigError, DataError
from splitleak.runs.captures import load_capture
from splitleak.training import make_train_config, run_training

SMALL = dict(model="tiny-gpt2", n_calib=4, n_train=6, n_eval=6, doc_len=32, lr=1e-3)


def _shielded(**kw):
    return {"bottom": 1, "top": 1, **kw}


@pytest.fixture(scope="module")
def tiny():
    from splitleak.models import load_model

    return load_model("tiny-gpt2", seed=0)


# ------------------------------------------------------------------ the instruction set


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 3])
def test_instruction_documents_mark_where_their_answer_begins(tiny, seed):
    from splitleak.data import DocumentSets, load_documents
    from splitleak.data.instructions import QUESTIONS

    sets = load_documents("instructions", tiny.tokenizer, seed=seed, n_calib=3, n_train=6, n_eval=3, doc_len=32)
    questions = {q for qs in QUESTIONS.values() for q in qs}
    for d in sets.train + sets.evaluation:
        assert d.text.startswith("Question: ") and d.text.split("\n")[0][len("Question: ") :] in questions
        assert 4 < d.answer_start < 30  # a short question, then answer tokens to supervise
        before = tiny.tokenizer.decode(list(d.token_ids[: d.answer_start]))
        after = tiny.tokenizer.decode(list(d.token_ids[d.answer_start :]))
        assert before.endswith("\nAnswer:") and after.startswith(" ") and after.strip()
        for span in d.spans:  # the synthetic answer's spans, shifted by the question
            assert span.token_start >= d.answer_start
    assert DocumentSets.from_json(sets.to_json()) == sets
    plain = load_documents("synthetic-pii", tiny.tokenizer, seed=seed, n_calib=1, n_train=1, n_eval=1, doc_len=32)
    assert "answer_start" not in plain.to_json()["train"][0]  # other sources' JSON and fingerprint are unchanged
    with pytest.raises(DataError, match="leaves no answer"):
        load_documents("instructions", tiny.tokenizer, seed=seed, n_calib=1, n_train=1, n_eval=1, doc_len=6)


@pytest.mark.unit
def test_answer_only_supervision_keeps_the_targets_of_answer_tokens(tiny):
    from splitleak.data import load_documents
    from splitleak.training.loop import supervised_loss, supervision

    sets = load_documents("instructions", tiny.tokenizer, seed=1, n_calib=1, n_train=4, n_eval=1, doc_len=32)
    docs = list(sets.train)
    m = supervision(docs, True)
    assert m.shape == (4, 31)
    for row, d in zip(m, docs):
        assert row.tolist() == [l + 1 >= d.answer_start for l in range(31)]
    assert supervision(docs, False).all()
    ids = torch.tensor([d.token_ids for d in docs])
    logits = torch.randn(4, 32, tiny.model.config.vocab_size, generator=torch.Generator().manual_seed(0))
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
    )
    ce = ce.view(4, 31)
    want = torch.stack([ce[i][m[i]].mean() for i in range(4)])
    assert torch.allclose(supervised_loss(logits, ids, m), want)
    wiki = [d.__class__(d.doc_id, d.token_ids, d.text, d.spans, d.source) for d in docs]  # no answer
    with pytest.raises(ConfigError, match="--data instructions"):
        supervision(wiki, True)


# ------------------------------------------------------------------ the cut and who trains


@pytest.mark.unit
def test_the_label_shielded_cut_and_who_trains_what(tiny):
    from splitleak.models.split import SplitModel
    from splitleak.training.config import ShieldedConfig

    for train, client_blocks, server_blocks in (
        ("all", {0, 3}, {1, 2}),
        ("trunk-frozen", {0, 3}, set()),
        ("top-only", {3}, set()),
    ):
        split = SplitModel(tiny, shielded=ShieldedConfig(bottom=1, top=1, train=train))
        assert (split.spec.cut, split.spec.server_end, split.spec.mode) == (1, 3, "label-shielded")
        client, server = split.trainable_parameters()
        ids = {id(p): i for i in range(4) for p in split.blocks[i].parameters()}
        assert {ids[id(p)] for p in client if id(p) in ids} == client_blocks
        assert {ids[id(p)] for p in server if id(p) in ids} == server_blocks
        head = {id(p) for p in split.head.parameters()}
        emb = {id(p) for p in split.model.get_input_embeddings().parameters()}
        assert head <= {id(p) for p in client}  # the Top's head always trains on the client
        assert (emb <= {id(p) for p in client}) == (train != "top-only")
        assert split.sends_no_gradient == (train == "top-only")
    with pytest.raises(ConfigError, match="leave no Trunk block"):
        SplitModel(tiny, shielded=ShieldedConfig(bottom=2, top=2))
    with pytest.raises(ConfigError, match="omit --depth"):
        make_train_config(**SMALL, depth=1, shielded=_shielded())


# ------------------------------------------------------------------ the exposed loss's defences


def _ctx(step=3, docs=(7, 8)):
    return WireContext(seed=11, phase="train", step=step, doc_ids=docs)


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1])
def test_selective_supervision_keeps_one_stratum_the_last_five_and_a_share_of_the_rest(seed):
    sas = build_defence("sas", {"keep": 0.3})
    n, t = 200, 63
    g = torch.Generator().manual_seed(seed)
    entropy = torch.rand(n, t, generator=g)
    supervised = torch.ones(n, t, dtype=torch.bool)
    supervised[:, :10] = False  # a question of 10 targets, never supervised
    w = sas.exposed_weights(supervised.double(), entropy, supervised, _ctx(docs=tuple(range(seed, seed + n))))
    assert set(w.unique().tolist()) <= {0.0, 1.0}
    assert not w[:, :10].any() and w[:, -5:].all()
    for b in range(n):  # one entropy stratum of the 53 supervised targets is wholly kept
        idx = torch.nonzero(supervised[b]).flatten()
        order = idx[torch.argsort(entropy[b][idx], descending=True, stable=True)]
        assert any(bool(w[b][part].all()) for part in torch.tensor_split(order, 3))
    # the rest: about keep = 0.3 of the targets outside the full stratum and the last five
    kept = float(w[:, 10:-5].mean())
    assert 0.3 + (1 - 0.3) / 3 - 0.05 < kept < 0.3 + (1 - 0.3) / 3 + 0.08
    again = sas.exposed_weights(supervised.double(), entropy, supervised, _ctx(docs=tuple(range(seed, seed + n))))
    other = sas.exposed_weights(
        supervised.double(), entropy, supervised, _ctx(step=4, docs=tuple(range(seed, seed + n)))
    )
    assert torch.equal(w, again) and not torch.equal(w, other)  # per step, deterministic under the context


@pytest.mark.unit
@pytest.mark.parametrize("m,r", [(1750.0, 1 / 7), (10.0, 0.5)])
def test_scale_blinding_draws_each_weight_from_its_range_and_recovers_by_its_mean(m, r):
    sb = build_defence("scale-blind", {"m": m, "r": r})
    w0 = torch.ones(400, 31, dtype=torch.float64)
    w0[:, :5] = 0.0
    w = sb.exposed_weights(w0, torch.zeros_like(w0), w0.bool(), _ctx(docs=tuple(range(400))))
    kept = w[:, 5:]
    assert not w[:, :5].any()
    assert kept.min() >= m * (1 - r) and kept.max() <= m * (1 + r)
    assert abs(float(kept.mean()) / m - 1) < 0.01 and kept.std() > 0.5 * (2 * m * r) / 12**0.5
    assert sb.recovery() == m and build_defence("scale-blind", {"recover": False}).recovery() == 1.0
    chain = DefenceChain([build_defence("mirage", {"m": m, "r": r})], seed=0)
    assert chain.exposes_other_loss and chain.recovery() == m


@pytest.mark.unit
def test_the_gradient_baselines_do_what_they_say():
    g = torch.randn(3, 32, 64, generator=torch.Generator().manual_seed(0)) * 5
    ctx = _ctx(docs=(1, 2, 3))
    pruned = build_defence("grad-prune", {"ratio": 0.75}).top_gradient(g, ctx)
    for i in range(3):
        z = pruned[i] == 0
        assert int(z.sum()) == 32 * 64 * 3 // 4
        assert float(g[i][~z].abs().min()) >= float(g[i][z].abs().max())  # the smallest went
    dropped = build_defence("grad-dropout", {"p": 0.4}).top_gradient(g, ctx)
    z = dropped == 0
    assert abs(float(z.float().mean()) - 0.4) < 0.02 and torch.equal(dropped[~z], g[~z])
    dp = build_defence("seq-dp", {"clip": 1.0, "noise_multiplier": 1e-6})
    out = dp.top_gradient(g, ctx)
    assert torch.allclose(out.flatten(1).norm(dim=1), torch.ones(3), atol=1e-3)  # clipped to 1, tiny noise
    loud = build_defence("seq-dp", {"clip": 1.0, "noise_multiplier": 2.0}).top_gradient(g, ctx)
    assert abs(float((loud - out).std()) - 2.0) < 0.05
    from splitleak.defences.noise import gaussian_mechanism_epsilon

    assert dp.privacy(10) == gaussian_mechanism_epsilon(1e-6, 1e-5, 10)
    for name, args, msg in (
        ("grad-prune", {"ratio": 1.0}, "ratio must be a finite number >= 0 and < 1"),
        ("grad-dropout", {"p": "x"}, "p must be a finite number"),
        ("sas", {"groups": 0}, "groups must be an integer"),
        ("scale-blind", {"m": -1}, "m must be a finite number > 0"),
        ("mirage", {"kappa": 0}, "kappa must be a finite number > 0"),
    ):
        with pytest.raises(ConfigError, match=msg):
            build_defence(name, args)


@pytest.mark.unit
def test_the_exposed_loss_defences_need_the_label_shielded_mode():
    for name in ("sas", "scale-blind", "mirage"):
        chain = DefenceChain([build_defence(name)], seed=0)
        for mode in ("plain", "u-shape"):
            with pytest.raises(ConfigError, match="--mode label-shielded"):
                chain.check_split_mode(mode)
        chain.check_split_mode("label-shielded")
    for name in ("vmf", "grad-prune", "grad-dropout", "seq-dp"):
        chain = DefenceChain([build_defence(name)], seed=0)
        chain.check_split_mode("u-shape")
        chain.check_split_mode("label-shielded")
        with pytest.raises(ConfigError, match="partial offloading"):
            chain.check_split_mode("plain")


# ------------------------------------------------------------------ one exchange: dual track, recovery


def _exchange(tiny, defences, answer_only=True, seed=0):
    """One training exchange of the label-shielded client (optimiser off), recording what crossed."""
    import copy

    from splitleak.data import load_documents
    from splitleak.models import LoadedModel
    from splitleak.models.split import SplitModel
    from splitleak.training.config import ShieldedConfig
    from splitleak.training.loop import connect, set_trainable, supervision
    from splitleak.training.roles import ClientRole

    lm = LoadedModel(tiny.name, copy.deepcopy(tiny.model), tiny.tokenizer, tiny.precision, tiny.source, dict(tiny.info))
    split = SplitModel(lm, shielded=ShieldedConfig(bottom=1, top=1, answer_only=answer_only))
    set_trainable(split)
    docs = list(
        load_documents("instructions", tiny.tokenizer, seed=seed, n_calib=1, n_train=2, n_eval=1, doc_len=32).train
    )
    frames = []
    chain = DefenceChain([build_defence(n, a) for n, a in defences], seed=5)
    channel, _ = connect(split, chain, 0.0, [lambda c: frames.append(c.frame)])
    client = ClientRole(split, chain, channel, 0.0)
    client.opt = None
    ids = torch.tensor([d.token_ids for d in docs])
    client.exchange(ids, tuple(d.doc_id for d in docs), 0, "train", supervision(docs, answer_only))
    top = {
        n: p.grad.clone()
        for n, p in split.model.named_parameters()
        if p.grad is not None and p in set(split.top_parameters())
    }
    return split, client, frames, top, docs


@pytest.mark.integration
def test_dual_track_the_top_learns_the_full_loss_and_the_wire_carries_the_exposed_one(tiny):
    _, plain, frames0, top0, docs = _exchange(tiny, [])
    split, mirage, frames1, top1, _ = _exchange(tiny, [("sas", {}), ("scale-blind", {})])
    assert top0.keys() == top1.keys() and top0
    assert all(torch.allclose(top0[k], top1[k]) for k in top0)  # the Top's update is the full loss's
    sent0 = next(f.tensor for f in frames0 if f.kind == "backward-top")
    sent1 = next(f.tensor for f in frames1 if f.kind == "backward-top")
    assert torch.equal(plain.last_raw_top_gradient, sent0) and torch.equal(mirage.last_raw_top_gradient, sent0)
    # the exposed gradient is ~m times larger, another direction, and zero on the question's targets it
    # never supervises; its norm ratio to the raw one is near E[s] = 1750
    ratio = float(sent1.norm() / sent0.norm())
    assert 300 < ratio < 3000
    cos = torch.nn.functional.cosine_similarity(sent0.flatten(), sent1.flatten(), dim=0)
    assert float(cos) < 0.99
    # recovery: the client applies the Bottom gradient the server returned, divided by m
    returned = next(f.tensor for f in frames1 if f.kind == "backward")
    assert torch.allclose(mirage.last_gradient, returned / 1750.0)
    _, unrecovered, frames2, _, _ = _exchange(tiny, [("sas", {}), ("scale-blind", {"recover": False})])
    assert torch.equal(unrecovered.last_gradient, next(f.tensor for f in frames2 if f.kind == "backward"))
    # row l of the trunk output feeds the targets >= l through the Top's attention: only the last row,
    # which predicts nothing, gets no gradient (the question's rows do, through the answer's targets)
    assert float(sent0[:, -1].abs().max()) == 0.0 and bool((sent0[:, :-1].abs().amax(-1) > 0).all())


# ------------------------------------------------------------------ whole runs


@pytest.mark.integration
def test_undefended_label_shielded_training_is_all_local_training_and_its_capture_holds_the_four(tmp_path):
    cfg = make_train_config(**SMALL, data="instructions", shielded=_shielded(answer_only=True), seed=2)
    res = run_training(cfg, tmp_path / "run", device="cpu")
    m = res.metrics
    # Bottom, Trunk and Top all train with AdamW on the exact gradients: the same as training it whole
    assert m["heldout_ce"] == pytest.approx(m["all_local_ce"], abs=1e-5) and m["heldout_ce"] < m["pretrained_ce"] - 0.05
    cap = load_capture(res.run_dir)
    n, t = 6, 32
    for x in (cap.activations, cap.trunk_output, cap.output_gradients, cap.gradients):
        assert x is not None and x.shape == (n, t, 64)
    assert cap.mask.shape == (n, t)
    own = load_file(res.run_dir / "shielded" / "output_gradients.safetensors")
    order = torch.argsort(cap.doc_ids)  # capture order is the evaluation order
    assert torch.equal(own["sent"], cap.output_gradients) and torch.equal(own["raw"], own["sent"])
    assert order.tolist() == list(range(n))
    assert m["capture"]["gradient_utility"]["mean"]["recall@10"] == 1.0
    manifest = json.loads((res.run_dir / "manifest.json").read_text())
    assert manifest["split"]["label_shielded"] and manifest["config"]["shielded"]["answer_only"]


@pytest.mark.integration
def test_mirage_sends_a_gradient_unlike_the_raw_one_and_top_only_sends_none(tmp_path):
    cfg = make_train_config(
        **SMALL, data="instructions", shielded=_shielded(), defences=[{"name": "mirage"}], seed=1, draws="derived"
    )
    res = run_training(cfg, tmp_path / "mirage", device="cpu")
    cap = load_capture(res.run_dir)
    own = load_file(res.run_dir / "shielded" / "output_gradients.safetensors")
    assert torch.equal(own["sent"], cap.output_gradients)  # the capture is what crossed
    # mutation check: were the raw output gradient sent (cosine 1), or vMF alone (about 0.97 at kappa=1000
    # in 64 dimensions), these fail. Per document the cosine spreads with the draws of selective
    # supervision and scale blinding: 0.63-0.91 over eight runs (four os draws, derived seeds 1-4),
    # means 0.74-0.78; a bound on the largest of six at 0.9 failed once in CI
    raw, sent = own["raw"], cap.output_gradients
    cos = torch.nn.functional.cosine_similarity(raw.flatten(1), sent.flatten(1), dim=1)
    assert float(cos.mean()) < 0.85 and float(cos.max()) < 0.95 and float((sent.norm() / raw.norm())) > 100
    util = res.metrics["capture"]["gradient_utility"]["mean"]
    assert util["recall@10"] < 1.0 and util["asnr"] < 0.01
    assert abs(res.metrics["heldout_ce"] - res.metrics["all_local_ce"]) < 0.2  # still trains

    cfg = make_train_config(**SMALL, data="instructions", shielded=_shielded(train="top-only"), seed=1)
    res = run_training(cfg, tmp_path / "top", device="cpu")
    cap = load_capture(res.run_dir)
    assert cap.gradients is None and cap.output_gradients is None and cap.trunk_output is not None
    declared = {c["name"] for c in json.loads((res.run_dir / "manifest.json").read_text())["channels"]["channels"]}
    assert "gradient" not in declared and "output-gradient" not in declared and "trunk-output" in declared
    assert res.metrics["heldout_ce"] < res.metrics["pretrained_ce"]  # the Top alone learns
    assert not (res.run_dir / "shielded").exists()


@pytest.mark.integration
def test_trunk_frozen_training_leaves_the_trunk_and_moves_the_bottom_and_top(tiny):
    import copy

    from splitleak.data import load_documents
    from splitleak.models import LoadedModel
    from splitleak.models.split import SplitModel
    from splitleak.training.config import ShieldedConfig
    from splitleak.training.loop import train_split

    lm = LoadedModel(tiny.name, copy.deepcopy(tiny.model), tiny.tokenizer, tiny.precision, tiny.source, dict(tiny.info))
    split = SplitModel(lm, shielded=ShieldedConfig(bottom=1, top=1, train="trunk-frozen"))
    before = [p.detach().clone() for p in split.model.parameters()]
    docs = load_documents("instructions", tiny.tokenizer, seed=0, n_calib=1, n_train=3, n_eval=1, doc_len=32).train
    chain = DefenceChain([build_defence("mirage")], seed=0)
    train_split(split, docs, chain, chain, seed=0, steps=3, lr=1e-3)
    moved = {id(p) for p, b in zip(split.model.parameters(), before) if not torch.equal(p.detach(), b)}
    assert not moved & {id(p) for p in split.trunk_parameters()}
    assert {id(p) for p in split.top_parameters()} <= moved
    assert {id(p) for p in split.blocks[0].parameters()} <= moved


# ------------------------------------------------------------------ GMA-SL on the capture


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_gma_sl_reads_the_undefended_labels_and_mirage_cuts_them(tmp_path, seed):
    from splitleak.attacks.config import make_attack_config
    from splitleak.audit.evaluate import run_attack

    out = {}
    for name in ("none", "mirage"):
        cfg = make_train_config(
            **SMALL,
            data="instructions",
            shielded=_shielded(),
            defences=[{"name": name}],
            seed=seed,
            data_seed=seed,
            capture_batch=3,
        )
        run_training(cfg, tmp_path / name, device="cpu")
        out[name] = run_attack(
            tmp_path / name, make_attack_config(attack="gma-sl", params={"steps": 150}), out=tmp_path / f"{name}.json"
        )
    none, mirage = out["none"], out["mirage"]
    # undefended, the pretrained Top explains the output gradient: nearly every label comes back
    assert none["label_recovery"] > 0.9 and none["rougeL_f"] > 0.8 and none["answer_label_recovery"] > 0.9
    # Gradient Mirage: far fewer (the mutation check: send the raw output gradient and this fails)
    assert mirage["label_recovery"] < none["label_recovery"] - 0.3 and mirage["rougeL_f"] < 0.5
    assert none["channels_read"] == ["trunk-output", "output-gradient"]
    written = json.loads((tmp_path / "mirage.json").read_text())
    assert written["label_recovery"] == mirage["label_recovery"]


@pytest.mark.integration
def test_gma_sl_refuses_a_run_it_cannot_read(tmp_path):
    from splitleak.attacks.config import make_attack_config
    from splitleak.audit.evaluate import run_attack

    run_training(make_train_config(**SMALL, offload_start=1, offload_length=2), tmp_path / "u", device="cpu")
    with pytest.raises(ConfigError, match="reads the traffic of label-shielded runs"):
        run_attack(tmp_path / "u", make_attack_config(attack="gma-sl"))
    cfg = make_train_config(**SMALL, data="instructions", shielded=_shielded(train="top-only"))
    run_training(cfg, tmp_path / "top", device="cpu")
    with pytest.raises(ConfigError, match="top-only training, which sends no gradient"):
        run_attack(tmp_path / "top", make_attack_config(attack="gma-sl"))


@pytest.mark.integration
@pytest.mark.parametrize(
    "seed,reader",
    [(0, {}), (1, {}), (0, {"start": "uniform", "candidates": 4}), (1, {"start": "uniform", "candidates": 4})],
)
def test_the_twin_reads_gma_sls_frames_once_and_a_reader_that_starts_at_the_truth_is_still_caught(
    tmp_path, seed, reader, monkeypatch
):
    """The mis-paired twin holds the arm's frames with their rows in the arm's order, so GMA-SL matches each
    frame once (``GMASL._read_frame``): the result is the one of matching it again, bit for bit, and an honest
    twin reads exactly the arm's labels (each difference 0). The frame's key holds its initial labels: a reader
    that starts GMA-SL at the true labels of the documents the traffic is labelled with is caught by its twin,
    which starts at another document's. The same over candidates (the audit's reader's kind)."""
    from splitleak.attacks.config import make_attack_config
    from splitleak.attacks.gma import GMASL
    from splitleak.attacks.knowledge import load_knowledge, load_traffic
    from splitleak.audit.evaluate import controlled_read, mispaired_control, run_attack
    from splitleak.runs.truth import phase_documents

    cfg = make_train_config(
        **SMALL, data="instructions", shielded=_shielded(), seed=seed, data_seed=seed, capture_batch=3
    )
    run_training(cfg, tmp_path / "run", device="cpu")
    acfg = make_attack_config(attack="gma-sl", params={"steps": 40, **reader})
    matched: list[int] = []
    plain_match = GMASL._match_frame

    def counted(self, *a, **kw):
        matched.append(1)
        return plain_match(self, *a, **kw)

    monkeypatch.setattr(GMASL, "_match_frame", counted)
    once = run_attack(tmp_path / "run", acfg, control_docs=6)
    assert len(matched) == 2  # two frames of three documents, each matched once for the arm and its twin
    assert once["control"]["per_doc_delta"] == [0.0] * 6 and once["control"]["verdict"] in ("at floor", "below floor")
    # matching every frame again gives the same result, bit for bit
    monkeypatch.setattr(GMASL, "_read_frame", lambda self, *a: counted(self, *a))
    again = run_attack(tmp_path / "run", acfg, control_docs=6)
    assert len(matched) == 2 + 4

    def untimed(d):
        return {k: untimed(v) if isinstance(v, dict) else v for k, v in d.items() if "seconds" not in k}

    assert untimed(once) == untimed(again), [k for k in once if untimed(once).get(k) != untimed(again).get(k)]
    monkeypatch.undo()

    truth = {d.doc_id: list(d.token_ids) for d in phase_documents(tmp_path / "run", "capture")}

    class StartsAtTheTruth(GMASL):
        def reconstruct(self, traffic, progress=None):
            rec = super().reconstruct(traffic, progress)  # noqa: F841  (the honest reading, discarded)
            init = torch.tensor([truth[i][1:] for i in traffic.doc_ids])
            labels, _, _ = self.match(traffic, init=init)
            return type(rec)(torch.cat([rec.tokens[:, :1], labels], dim=1), {"labels": labels})

    knowledge = load_knowledge(tmp_path / "run", "public", with_top=True)
    traffic = load_traffic(tmp_path / "run")
    docs = [d for d in phase_documents(tmp_path / "run", "capture")]
    cheat = StartsAtTheTruth(steps=0, **reader).fit(knowledge)
    arm = controlled_read(cheat.reconstruct(traffic))
    assert float((arm[:, 1:] == torch.tensor([truth[i][1:] for i in traffic.doc_ids])).float().mean()) == 1.0
    control = mispaired_control(cheat, traffic, arm, docs, 6, acfg, None)
    # the twin reads each document's own labels (from its init) where the arm's reading of that traffic reads another's
    # (the instructions share their template tokens: measured 0.03-0.84 apart per document, 0.57-0.68 on average)
    assert control["verdict"] == "detected" and control["twin_token_recovery"] == 1.0, control
    assert control["floor_token_recovery"] < 0.6, control
