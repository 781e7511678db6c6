import json

import numpy as np
import pytest
import torch

from splitleak.attacks import (
    ATTACKS,
    ClientCopy,
    Knowledge,
    beam_search,
    beam_search_naive,
    choose_property_tokens,
    load_knowledge,
    load_traffic,
    make_attack_config,
    merge_candidates,
    perturb_gradients,
)
from splitleak.attacks.core import derangement, random_fill
from splitleak.attacks.ridge import RidgeMap, cosine_topk
from splitleak.audit.evaluate import run_attack
from splitleak.defences import quantize_symmetric
from splitleak.errors import ConfigError
from splitleak.models import load_model
from splitleak.training import make_train_config, run_training


def _run(path, seed, depth=3, n_calib=2, defence="none", n_eval=64):
    # each seed draws its own documents too: three independent set-ups (the measured claims below)
    cfg = make_train_config(
        model="tiny-gpt2",
        depth=depth,
        n_calib=n_calib,
        n_train=16,
        n_eval=n_eval,
        seed=seed,
        data_seed=seed,
        all_local_baseline=False,
        defences=[{"name": defence}],
    )
    run_training(cfg, path, device="cpu")
    return path


@pytest.fixture(scope="module")
def weak_runs(tmp_path_factory):
    """Depth 3, two calibration documents: the ridge fit is weak, so candidates matter."""
    root = tmp_path_factory.mktemp("weak")
    return [_run(root / f"s{seed}", seed) for seed in (0, 1, 2)]


@pytest.fixture(scope="module")
def easy_run(tmp_path_factory):
    """Depth 1, 32 calibration documents: nearly invertible."""
    return _run(tmp_path_factory.mktemp("easy") / "run", seed=4, depth=1, n_calib=32, n_eval=48)


def _score(run, attack, **kw):
    return run_attack(run, make_attack_config(attack=attack, **kw))


@pytest.mark.integration
def test_ridge_activation_attacker_recovers_most_tokens_at_a_shallow_cut(easy_run):
    act = _score(easy_run, "activation", k=8)
    maj = _score(easy_run, "majority")
    # measured on seeds 0-4: 1.00 token recovery at depth 1 with 32 calibration documents
    assert act["token_recovery"] >= 0.95 and maj["token_recovery"] < 0.25
    assert act["doc_recovery"] >= 0.5
    assert act["n_docs"] == 48 and act["n_tokens"] == 48 * 32


@pytest.mark.integration
def test_joint_beats_activation_and_controls_do_not(weak_runs):
    """Where the gradient carries the next token (cut after 3 of 4 blocks: one on the server), the
    joint attacker gains; the controls, which remove the gradient's information, do not beat
    activation-only. Measured on seeds 0-4 with the default gradient read-out: joint - activation =
    +16.9 to +24.3 points (+4.7 to +8.8 with the pseudo-label map); controls 6-10 points below."""
    for i, run in enumerate(weak_runs):
        act = _score(run, "activation", k=4, attack_seed=i)
        joint = _score(run, "joint", k=4, attack_seed=i)
        shuf = _score(run, "shuffled-gradient", k=4, attack_seed=i)
        rand = _score(run, "random-candidate", k=4, attack_seed=i)
        assert joint["token_recovery"] - act["token_recovery"] > 0.02, (
            i,
            joint["token_recovery"],
            act["token_recovery"],
        )
        assert shuf["token_recovery"] <= act["token_recovery"] + 0.01
        assert rand["token_recovery"] <= act["token_recovery"] + 0.01


@pytest.mark.integration
def test_gradient_readout_names_the_next_token_from_the_gradient_alone(weak_runs):
    """The default read-out (cosine of −gradient with the token embeddings) reads the next token
    from each run's own gradient, and from nothing else: another document's gradient reads at
    about chance, and the backward-only heuristic's answer does not move when the activations are
    swapped between documents. With the pseudo-label map it does: the map learns the activations'
    answers. Measured on seeds 0-4 (one server block): top-1 next-token accuracy 1.00 with the
    run's own gradient, 0.03-0.07 with a deranged one."""
    from splitleak.attacks import Traffic
    from splitleak.attacks.core import BackwardOnly, derangement, gradient_readout

    for i, run in enumerate(weak_runs):
        kn, tr = load_knowledge(run, "public"), load_traffic(run)
        truth = torch.tensor([d["token_ids"] for d in json.loads((run / "documents.json").read_text())["evaluation"]])
        emb = kn.client.embedding
        own = (gradient_readout(tr.gradients, emb, 1)[..., 0] == truth[:, 1:]).float().mean().item()
        p = torch.from_numpy(derangement(len(tr), seed=i))
        other = (gradient_readout(tr.gradients[p], emb, 1)[..., 0] == truth[:, 1:]).float().mean().item()
        assert own > 0.9 and other < 0.15, (i, own, other)

        swapped = Traffic(tr.doc_ids, tr.activations[p], tr.gradients)
        for readout, moves in (("gradient", False), ("pseudo-map", True)):
            att = BackwardOnly(seed=i, readout=readout).fit(kn)
            a, b = att.reconstruct(tr).tokens, att.reconstruct(swapped).tokens
            assert torch.equal(a[:, 1:], b[:, 1:]) != moves, (i, readout)


@pytest.mark.unit
def test_readout_is_part_of_the_config_of_gradient_attacks_only():
    import inspect

    from splitleak.attacks.core import BackwardOnly, JointBeam, ShuffledGradient
    from splitleak.audit.analysis import DEFAULT_READOUT, READOUT_ATTACKS
    from splitleak.files import config_hash

    takes = sorted(n for n, cls in ATTACKS.items() if "readout" in inspect.signature(cls.__init__).parameters)
    assert takes == sorted(READOUT_ATTACKS)  # analysis keeps its own copy (it does not import torch)
    assert JointBeam().readout == ShuffledGradient().readout == BackwardOnly().readout == DEFAULT_READOUT
    joint = make_attack_config(attack="joint", k=8)
    assert joint.readout == DEFAULT_READOUT and joint.attack_params()["readout"] == DEFAULT_READOUT
    pm = make_attack_config(attack="joint", k=8, readout="pseudo-map")
    assert pm.hash() != joint.hash() and pm.model_dump()["readout"] == "pseudo-map"
    # attacks that read no gradient carry no read-out, in the dump or the hash (their keys are
    # those from before read-outs existed)
    act = make_attack_config(attack="activation", k=8)
    assert "readout" not in act.model_dump(mode="json")
    assert act.hash() == config_hash(
        {
            "attack": "activation",
            "k": 8,
            "client_copy": "public",
            "budget": None,
            "attack_seed": 0,
            "gradient_noise": None,
            "gradient_bits": None,
            "inference": False,
        }
    )
    with pytest.raises(ConfigError, match="reads no gradient"):
        make_attack_config(attack="random-candidate", k=8, readout="gradient")
    with pytest.raises(ConfigError, match="readout"):
        make_attack_config(attack="joint", k=8, readout="psychic")


@pytest.mark.integration
def test_backward_only_and_vmi_beat_the_majority_control(weak_runs):
    run = weak_runs[0]
    maj = _score(run, "majority")["token_recovery"]
    assert _score(run, "backward-only")["token_recovery"] > maj + 0.3
    assert _score(run, "vmi")["token_recovery"] > maj + 0.2


@pytest.mark.integration
def test_exhaustive_sipit_recovers_every_token_with_the_trained_copy(weak_runs):
    res = _score(weak_runs[1], "sipit", budget="exhaustive", client_copy="trained")
    assert res["token_recovery"] == 1.0 and res["doc_recovery"] == 1.0
    assert res["certified_tokens"] == 1.0


@pytest.mark.integration
def test_budgeted_sipit_stops_at_its_budget(weak_runs):
    res = _score(weak_runs[0], "sipit", budget=4, client_copy="public")
    assert 0 < res["mean_checks_per_token"] <= 4
    assert 0 < res["token_recovery"] <= 1


@pytest.mark.unit
def test_sipit_chunks_up_to_256_documents_and_32768_prefix_tokens_unless_told():
    from splitleak.attacks.core import make_attack

    default = make_attack("sipit", budget=32)
    assert [default._chunk_docs(t) for t in (1, 32, 128, 129, 512, 4096, 10**6)] == [256, 256, 256, 254, 64, 8, 1]
    assert make_attack("sipit-aware", budget=32)._chunk_docs(32) == 256
    assert make_attack("sipit", budget=32, chunk_docs=7)._chunk_docs(32) == 7  # told: as told, at any length
    assert make_attack("sipit", budget=32, chunk_docs=512)._chunk_docs(512) == 512


@pytest.mark.integration
def test_a_search_in_chunks_certifies_what_one_chunk_certifies(weak_runs, monkeypatch):
    """The chunk reaches the search, and only batches it: 64 documents in one chunk (the default) and in four
    read the same certified tokens through the trained copy."""
    import splitleak.attacks.sipit as sipit_module
    from splitleak.attacks.core import make_attack

    seen: list[int] = []
    real = sipit_module.sipit
    monkeypatch.setattr(sipit_module, "sipit", lambda *a, **k: seen.append(a[6]) or real(*a, **k))
    kn, tr = load_knowledge(weak_runs[1], "trained"), load_traffic(weak_runs[1])
    whole = make_attack("sipit", budget="exhaustive").fit(kn).reconstruct(tr)
    parts = make_attack("sipit", budget="exhaustive", chunk_docs=16).fit(kn).reconstruct(tr)
    assert seen == [256, 16] and len(tr) == 64
    assert bool(whole.extra["matched"].all()) and bool(parts.extra["matched"].all())
    assert torch.equal(whole.tokens, parts.tokens)


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_batched_and_naive_beam_search_agree_exactly(seed):
    client, ev, obs, est, g = _ridge_setup(seed, n_calib=16, length=12)
    cand = cosine_topk(est, client.embedding, 5)
    # drop the true token from the lists at odd positions: the search must rank wrong candidates there
    odd = torch.arange(12) % 2 == 1
    wrong = torch.randint(0, client.vocab_size, cand.shape, generator=g)
    cand = torch.where(odd.view(1, -1, 1) & (cand == ev.unsqueeze(-1)), wrong, cand)
    fast = beam_search(client, obs, cand, width=2, chunk_docs=2)
    slow = beam_search_naive(client, obs, cand, width=2)
    assert torch.equal(fast.tokens, slow.tokens)
    assert torch.allclose(fast.distance, slow.distance, atol=1e-4)
    assert (fast.tokens != ev).any()  # the observations were imperfect enough to make errors


@pytest.mark.unit
def test_merge_candidates_follows_the_rule():
    act = torch.tensor([[[1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15]]])
    grad = torch.tensor([[[11, 20, 21]]])  # for position 1; 11 overlaps the activation half
    out = merge_candidates(act, grad, 4)
    assert out[0, 0].tolist() == [1, 2, 3, 4]  # position 0: all from the activations
    assert out[0, 1].tolist() == [10, 11, 20, 12]  # k/2 act, new gradient tokens, then refill from act


@pytest.mark.unit
def test_random_fill_and_derangement_are_seeded():
    act = torch.arange(24).view(1, 3, 8)
    a, b = random_fill(act, 8, 100, seed=1), random_fill(act, 8, 100, seed=1)
    assert torch.equal(a, b) and not torch.equal(a, random_fill(act, 8, 100, seed=2))
    for t in (1, 2):
        assert len(set(a[0, t].tolist())) == 8 and set(a[0, t, :4].tolist()) == set(act[0, t, :4].tolist())
    p = derangement(10, 3)
    assert sorted(p) == list(range(10)) and (p != np.arange(10)).all()


@pytest.mark.unit
def test_property_tokens_rule():
    calib = np.array([[1, 2, 3], [1, 2, 4], [1, 5, 6], [1, 7, 8]])
    # shares: 1 -> 1.0, 2 -> 0.5, others 0.25 -> picks 2, then the lowest ids among the 0.25s
    assert choose_property_tokens(calib, 3) == [2, 3, 4]


@pytest.mark.integration
def test_property_inference_matches_sklearn_auc_and_index(weak_runs):
    from sklearn.metrics import roc_auc_score

    run = weak_runs[2]
    res = _score(run, "property")
    traffic = load_traffic(run)
    score = traffic.gradients.double().norm(dim=-1).sum(dim=-1).numpy()
    docs = {d["doc_id"]: d for d in json.loads((run / "documents.json").read_text())["evaluation"]}
    for p in res["properties"]:
        labels = np.array([p["token_id"] in docs[i]["token_ids"] for i in traffic.doc_ids])
        if p["auc"] is not None:
            assert p["auc"] == pytest.approx(roc_auc_score(labels, score), abs=1e-12)
    aucs = [p["auc"] for p in res["properties"] if p["auc"] is not None]
    expected = max(0.0, res["vmi_token_recovery"] - res["majority_token_recovery"], *[2 * abs(a - 0.5) for a in aucs])
    assert res["leakage_index"] == pytest.approx(expected)


@pytest.mark.unit
def test_gradient_perturbations():
    g = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(perturb_gradients(g, None, 8, 0), quantize_symmetric(g, 8))
    n1, n2 = perturb_gradients(g, 0.1, None, 5), perturb_gradients(g, 0.1, None, 5)
    assert torch.equal(n1, n2) and not torch.equal(n1, perturb_gradients(g, 0.1, None, 6))
    rel = (n1 - g).pow(2).mean(dim=(1, 2)).sqrt() / g.pow(2).mean(dim=(1, 2)).sqrt()
    assert ((rel > 0.07) & (rel < 0.13)).all()


@pytest.mark.integration
def test_gradient_perturbation_reaches_the_attack(weak_runs):
    base = _score(weak_runs[0], "backward-only")
    noisy = _score(weak_runs[0], "backward-only", gradient_noise=5.0)
    assert noisy["token_recovery"] < base["token_recovery"] - 0.1


@pytest.mark.integration
def test_threat_model_knowledge_holds_no_server_layers_or_eval_text(weak_runs):
    kn = load_knowledge(weak_runs[0], "public")
    assert isinstance(kn, Knowledge)
    assert len(kn.client.owner.h) == 3  # blocks after the cut are gone
    assert isinstance(kn.client.owner.ln_f, torch.nn.Identity)  # the final norm belongs to the server
    eval_ids = {d["doc_id"] for d in json.loads((weak_runs[0] / "documents.json").read_text())["evaluation"]}
    assert not eval_ids & {d.doc_id for d in kn.calibration}
    # ``shared`` holds what attacks derive from the rest (ridge fit, candidate lists), empty when loaded
    # Kerckhoffs: besides the copy and public data, the attacker knows the defence chain's public record
    # (names and arguments, no seed or secret), the split mode and how the draws were made, and can load
    # the traffic it observed before (training frames: no evaluation text)
    public = {"defences", "mode", "draws", "history_loader"}
    assert set(vars(kn)) == {"client", "calibration", "copy", "model", "top", "shared", "planned"} | public
    assert kn.shared == {} and kn.planned == ()  # ``planned``: the attacks a grid worker will run on it, none here
    assert kn.mode == "plain" and kn.draws in {"os", "derived"}
    assert all(set(d) <= {"name", "args"} for d in kn.defences)
    assert kn.top is None  # the pretrained Top is loaded only for the attacks that match output gradients


@pytest.mark.integration
def test_trained_copy_differs_from_public_copy(weak_runs):
    pub, tr = load_knowledge(weak_runs[0], "public"), load_knowledge(weak_runs[0], "trained")
    assert not torch.equal(pub.client.embedding, tr.client.embedding)


@pytest.mark.integration
def test_cli_attack_writes_result_and_parquet(weak_runs, tmp_path):
    from typer.testing import CliRunner

    from splitleak.cli import app

    out = tmp_path / "r" / "joint.json"
    r = CliRunner().invoke(
        app, ["attack", str(weak_runs[0]), "--attack", "joint", "--k", "4", "--out", str(out), "--quiet"]
    )
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    for key in (
        "attack",
        "config",
        "config_hash",
        "n_docs",
        "n_tokens",
        "token_recovery",
        "doc_recovery",
        "span_recovery",
    ):
        assert key in res
    import pyarrow.parquet as pq

    table = pq.read_table(out.with_suffix(".parquet"))
    assert table.num_rows == 64 and "predicted" in table.column_names
    r = CliRunner().invoke(app, ["attack", str(weak_runs[0]), "--attack", "joint", "--out", str(out), "--quiet"])
    assert r.exit_code == 2 and "--force" in r.output


@pytest.mark.unit
@pytest.mark.parametrize(
    "kw,words",
    [
        ({"attack": "telepathy"}, "unknown attack"),
        ({"attack": "vmi", "k": 8}, "does not take"),
        ({"attack": "joint", "gradient_noise": 0.1, "gradient_bits": 8}, "not both"),
        ({"attack": "joint", "k": 1}, "k"),
        ({"attack": "sipit", "budget": "lots"}, "budget"),
    ],
)
def test_bad_attack_configs(kw, words):
    with pytest.raises(ConfigError, match=words):
        make_attack_config(**kw)


@pytest.mark.integration
def test_inference_traffic_refuses_gradient_attacks(weak_runs):
    with pytest.raises(ConfigError, match="needs gradients"):
        _score(weak_runs[0], "joint", k=4, inference=True)
    assert _score(weak_runs[0], "activation", k=4, inference=True)["token_recovery"] > 0.5


@pytest.mark.unit
def test_registry_names_match_cli_contract():
    assert set(ATTACKS) == {
        "vmi",
        "majority",
        "activation",
        "joint",
        "shuffled-gradient",
        "random-candidate",
        "backward-only",
        "joint-adaptive",
        "joint-crossings",
        "sipit",
        "refit",
        "property",
        "mixup-unmix",
        "support-partition",
        "gma-sl",
        "sip-gru",
        "bisr-b",
        "bisr-f",
        "bisr",
        "latent-probe",
        "dose-ladder",
        "decoy-history",
        "gauge-key-search",
        "sipit-aware",
        "activation-aware",
        "crossings-aware",
        "gma-sl-crossings",
        "seed-search",
        "joint-aware",
        "mixup-history",
        "gma-sl-aware",
    }


@pytest.mark.e2e
@pytest.mark.slow
def test_audit_on_smollm2_with_wikitext(tmp_path, smollm2, wikitext_dir):
    from splitleak.audit.run import run_audit
    from splitleak.report.audit_prose import audit_words

    res = run_audit(
        tmp_path / "audit",
        model="smollm2-135m",
        words=audit_words,
        data="wikitext2",
        data_path=str(wikitext_dir),
        n_calib=8,
        n_train=4,
        n_eval=4,
        steps=4,
        seed=0,
        device="cpu",
        certify=8,  # SipIt's checks per position (default 32): the stage runs whole at a fraction of its cost
        control_docs=0,  # no mis-paired twins (a third of this test's time): the tiny audits run them
    )
    by_name = {a["attack"]: a for a in res.attacks}
    assert set(by_name) == {"majority", "vmi", "activation", "joint", "sipit"}
    assert by_name["activation"]["n_docs"] == 4 and by_name["activation"]["n_tokens"] == 4 * 32
    # the public copy barely differs from the client layers after 4 steps: VMI and the beam attacker
    # read most of the text, far above the majority control
    assert by_name["activation"]["token_recovery"] > by_name["majority"]["token_recovery"] + 0.3
    from splitleak.report.audit import write_audit_report

    assert not (tmp_path / "audit" / "report.md").exists()  # rendering is a separate step
    write_audit_report(tmp_path / "audit")
    assert (tmp_path / "audit" / "report.md").read_text().count("|") > 20
    assert "data:image/png;base64," in (tmp_path / "audit" / "report.html").read_text()
    assert "no negative control run (--control-docs 0)" in (tmp_path / "audit" / "report.md").read_text()
    # no defence: the split run stands for the all-local run (it reproduces it exactly), so none is trained
    base = json.loads((tmp_path / "audit" / "report.json").read_text())["utility_baseline"]
    assert res.run.metrics["all_local_ce"] is None and base["delta_u"] == 0.0
    assert base["all_local_ce"] == res.run.metrics["heldout_ce"]


@pytest.mark.integration
@pytest.mark.parametrize("order", ["gradient", "ridge"])
def test_both_sipit_orders_certify_with_the_trained_copy(weak_runs, order):
    from splitleak.attacks import SipIt, load_knowledge, load_traffic

    kn = load_knowledge(weak_runs[0], "trained")
    tr = load_traffic(weak_runs[0]).subset(range(8))
    rec = SipIt(budget="exhaustive", order=order).fit(kn).reconstruct(tr)
    truth = torch.tensor(
        [
            [t for t in d["token_ids"]]
            for d in json.loads((weak_runs[0] / "documents.json").read_text())["evaluation"][:8]
        ]
    )
    assert torch.equal(rec.tokens, truth) and bool(rec.extra["matched"].all())
    with pytest.raises(ConfigError, match="order"):
        SipIt(order="psychic").fit(kn).reconstruct(tr)


@pytest.mark.integration
def test_the_attacker_refuses_a_public_copy_that_is_not_the_runs_starting_model(shared_run):
    """The manifest's fingerprint pins the model the run started from: a tiny model initialised with
    another seed (as splitleak did before it derived the init seed from the run seed) is refused."""
    from splitleak.errors import IntegrityError
    from splitleak.seeds import model_init_seed

    run = shared_run(model="tiny-gpt2", depth=2, n_calib=4, n_train=6, n_eval=12, seed=0, all_local_baseline=False)
    assert load_knowledge(run, "public").copy == "public"  # the derived init: the run's own model
    stale = load_model("tiny-gpt2", seed=0)  # the init seed equal to the run seed, as before
    assert model_init_seed(0) != 0
    with pytest.raises(IntegrityError, match="not the one the run started from"):
        load_knowledge(run, "public", lm=stale)


# ------------------------------------------------------------------ exhaustive SipIt: wide rounds, margin rule


@pytest.mark.unit
def test_rounds_widen_geometrically_and_end_at_the_limit():
    from splitleak.attacks.search import round_sizes

    assert round_sizes(16, 16, 49152) == [16, 256, 4096, 44784]
    assert round_sizes(16, 1, 40) == [16, 16, 8]
    assert round_sizes(16, 16, 32) == [16, 16]  # a budget of 32 checks the same two rounds either way
    assert sum(round_sizes(16, 16, 615)) == 615


def _ridge_setup(seed: int, n_calib: int, length: int):
    """A tiny client cut after 2 blocks, three random documents of ``length`` tokens, their activations,
    the ridge estimate of their input embeddings fitted on ``n_calib`` random calibration documents of 12
    tokens, and the generator (to draw more from, in the same order on every run)."""
    lm = load_model("tiny-gpt2", seed=seed)
    client = ClientCopy(lm.model, 2)
    g = torch.Generator().manual_seed(seed)
    calib = torch.randint(0, client.vocab_size, (n_calib, 12), generator=g)
    ev = torch.randint(0, client.vocab_size, (3, length), generator=g)
    obs = client.activations(ev)
    x = client.activations(calib)
    rm = RidgeMap.fit(x.reshape(-1, x.shape[-1]), client.embedding[calib].reshape(-1, x.shape[-1]))
    return client, ev, obs, rm(obs), g


def _weak_search(seed: int):
    """A ridge order from two calibration documents: a weak order, so that many positions need a deep
    search."""
    from splitleak.attacks.sipit import _RidgeOrder

    client, ev, obs, est, g = _ridge_setup(seed, n_calib=2, length=10)
    return client, ev, obs, lambda c: _RidgeOrder(est, c.embedding, 256), g


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_wide_exhaustive_rounds_certify_the_same_tokens_in_far_fewer_rounds(seed):
    from splitleak.attacks.search import round_sizes, sipit

    client, ev, obs, order, _ = _weak_search(seed)
    tol = 1e-3 * obs.double().norm(dim=-1)
    res, calls = {}, {}
    for growth in (1, 16):
        inner = order(client)

        def counted(*a, growth=growth, inner=inner, **k):
            calls[growth] = calls.get(growth, 0) + 1
            return inner(*a, **k)

        res[growth] = sipit(client, obs, counted, None, tol, 16, growth=growth)
    for r in res.values():  # exhaustive through the exact copy: every token found and certified
        assert torch.equal(r.tokens, ev) and bool(r.matched.all())
    assert calls[16] * 3 < calls[1]  # measured 21 against 108 and 94 rounds
    cumulative = {sum(round_sizes(16, 16, client.vocab_size)[: i + 1]) for i in range(4)}
    assert set(res[16].checks.flatten().tolist()) <= cumulative
    assert int(res[1].checks.max()) > 16  # some position needed more than one round


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_a_round_split_into_many_passes_reads_what_one_pass_reads(seed):
    """``pass_rows`` bounds the candidate rows of one forward pass; it cuts a wide round into passes and
    must change nothing but the rounding of the products."""
    from splitleak.attacks.search import sipit

    client, ev, obs, order, g = _weak_search(seed)
    other = load_model("tiny-gpt2", seed=seed)  # a copy that cannot match: every position takes every round
    with torch.no_grad():
        for p in other.model.parameters():
            p.add_(0.02 * p.std() * torch.randn(p.shape, generator=g))
    public = ClientCopy(other.model, 2)
    tol = 1e-3 * obs.double().norm(dim=-1)
    passes = []
    extend = public.extend

    def counted(cache, cand, t):
        passes.append(cand.shape)
        return extend(cache, cand, t)

    public.extend = counted
    one = sipit(public, obs, order(public), None, tol, 16, growth=16, pass_rows=4096)
    wide = len(passes)
    many = sipit(public, obs, order(public), None, tol, 16, growth=16, pass_rows=7)
    assert len(passes) - wide > 10 * wide  # 3 documents, at most 2 candidates each per pass
    assert max(a * k for a, k in passes[wide:] if k > 1) <= 7
    assert torch.equal(one.tokens, many.tokens) and torch.equal(one.checks, many.checks)
    torch.testing.assert_close(one.distance, many.distance, rtol=1e-4, atol=1e-4)


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_the_margin_rule_stops_a_copy_that_cannot_match_early_with_the_same_reading(seed):
    """Through a copy that differs from the client's (as the public copy after fine-tuning), nothing ever
    matches, so the plain exhaustive search checks the whole vocabulary at every position; the margin
    rule stops a position once a whole round comes nowhere near its best, and reads the same tokens."""
    from splitleak.attacks.search import sipit

    client, ev, obs, order, g = _weak_search(seed)
    other = load_model("tiny-gpt2", seed=seed)
    with torch.no_grad():
        for p in other.model.parameters():
            p.add_(0.02 * p.std() * torch.randn(p.shape, generator=g))
    public = ClientCopy(other.model, 2)
    tol = 1e-3 * obs.double().norm(dim=-1)
    full = sipit(public, obs, order(public), None, tol, 16, growth=16)
    early = sipit(public, obs, order(public), None, tol, 16, growth=16, margin=0.5)
    assert not bool(full.matched.any()) and not bool(early.matched.any())  # nothing is certified
    assert bool((full.checks == public.vocab_size).all())
    assert float(early.checks.double().mean()) < 0.85 * public.vocab_size  # measured 489 and 478 of 615
    assert bool((early.checks == 272).any())  # stopped after the second round
    assert torch.equal(early.tokens, full.tokens) and float((full.tokens == ev).float().mean()) >= 0.9


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_after_a_miss_the_exhaustive_search_stops_early_and_changes_nothing_where_all_match(seed):
    """A position whose previous one found no match has a prefix that cannot reproduce the observed
    activation, so ``after_miss`` gives it one round instead of the whole vocabulary; through the exact
    copy every position matches, so the rule never acts and the result is the same."""
    from splitleak.attacks.search import sipit

    client, ev, obs, order, g = _weak_search(seed)
    tol = 1e-3 * obs.double().norm(dim=-1)
    plain = sipit(client, obs, order(client), None, tol, 16, growth=16)
    ruled = sipit(client, obs, order(client), None, tol, 16, growth=16, after_miss=16)
    assert bool(ruled.matched.all()) and torch.equal(ruled.tokens, plain.tokens)
    assert torch.equal(ruled.checks, plain.checks)
    other = load_model("tiny-gpt2", seed=seed)
    with torch.no_grad():
        for p in other.model.parameters():
            p.add_(0.02 * p.std() * torch.randn(p.shape, generator=g))
    public = ClientCopy(other.model, 2)
    full = sipit(public, obs, order(public), None, tol, 16, growth=16)
    cut = sipit(public, obs, order(public), None, tol, 16, growth=16, after_miss=16)
    assert not bool(cut.matched.any())
    assert bool((cut.checks[:, 0] == public.vocab_size).all())  # the first position: nothing before it missed
    assert bool((cut.checks[:, 1:] == 16).all()) and bool((full.checks[:, 1:] == public.vocab_size).all())
    assert torch.equal(cut.tokens[:, 0], full.tokens[:, 0])


@pytest.mark.integration
def test_sipit_refuses_a_bad_growth_or_margin_by_name(easy_run):
    from splitleak.attacks.sipit import SipIt

    # refused when the configuration is built (typed from SipIt's signature), before anything runs
    for params, words in (
        ({"growth": 0}, "growth=0"),
        ({"margin": -1}, "margin=-1"),
        ({"after_miss": 0}, "after_miss=0"),
    ):
        with pytest.raises(ConfigError, match=f"attack 'sipit': {words} is not allowed"):
            make_attack_config(attack="sipit", budget="exhaustive", params=params)
    # and by the class itself, built directly, when it runs
    attack = SipIt(budget="exhaustive", growth=0).fit(load_knowledge(easy_run, "public"))
    with pytest.raises(ConfigError, match="SipIt growth must be a positive integer"):
        attack.reconstruct(load_traffic(easy_run))
    assert SipIt(budget="exhaustive").params()["growth"] is None  # auto: 16 for exhaustive, 1 for a budget


@pytest.mark.unit
def test_knowledge_memo_computes_once_per_traffic_and_a_replaced_knowledge_starts_empty():
    import dataclasses
    from types import SimpleNamespace

    from splitleak.attacks.knowledge import MEMO_TRAFFICS, Knowledge, Traffic

    kn = Knowledge(SimpleNamespace(device=torch.device("cpu")), (), "public", "tiny-gpt2")
    calls = []

    def compute(tag):
        calls.append(tag)
        return tag

    a = Traffic((0,), torch.zeros(1, 2, 3), None)
    b = Traffic((0,), torch.zeros(1, 2, 3), None)  # equal values, another capture
    assert kn.memo("ridge", lambda: compute("r")) == "r" and kn.memo("ridge", lambda: compute("r2")) == "r"
    assert kn.memo("cand", lambda: compute("a"), a) == "a" and kn.memo("cand", lambda: compute("a2"), a) == "a"
    shuffled = a.replace(gradients=torch.ones(1, 2, 3))  # the same activations: the same candidates
    assert kn.memo("cand", lambda: compute("s"), shuffled) == "a"
    assert kn.memo("cand", lambda: compute("b"), b) == "b"  # another traffic is computed for itself
    assert kn.memo("cand", lambda: compute("a3"), a) == "a"  # the MEMO_TRAFFICS latest traffics are kept
    more = [Traffic((0,), torch.zeros(1, 2, 3), None) for _ in range(MEMO_TRAFFICS - 1)]
    for i, t in enumerate(more):  # b, the least recently used, is let go for the last of them
        assert kn.memo("cand", lambda i=i: compute(f"m{i}"), t) == f"m{i}"
    assert kn.memo("cand", lambda: compute("a4"), a) == "a"
    assert kn.memo("cand", lambda: compute("b2"), b) == "b2"
    assert calls == ["r", "a", "b", *(f"m{i}" for i in range(MEMO_TRAFFICS - 1)), "b2"]
    # ``whole``: a value of the whole traffic (gradients too) is told apart by the traffic object
    assert kn.memo("twin", lambda: compute("w"), a, whole=True) == "w"
    assert kn.memo("twin", lambda: compute("w2"), shuffled, whole=True) == "w2"
    assert kn.memo("twin", lambda: compute("w3"), a, whole=True) == "w" and calls[-2:] == ["w", "w2"]
    kn.planned = ("an attack",)
    other = dataclasses.replace(kn, copy="trained")
    assert other.shared == {} and kn.shared != {} and other.planned == ()


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1])
def test_the_prefix_cache_is_passed_by_the_keyword_the_installed_transformers_takes(seed):
    """transformers 5.17 takes the key/value cache as ``past_key_values`` and drops an unknown ``cache=``
    without a word (every beam attack then failed on the GPU machine's image); 5.2x takes ``cache``."""
    from splitleak.attacks.knowledge import cache_keyword

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs):
            return input_ids

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kwargs):
            return input_ids

    assert cache_keyword(Old()) == "past_key_values" and cache_keyword(New()) == "cache"
    with pytest.raises(ConfigError, match="no key/value cache"):
        cache_keyword(torch.nn.Linear(2, 2))
    client = ClientCopy(load_model("tiny-gpt2", seed=seed).model, 2)
    cache = client.new_cache()
    ids = torch.randint(0, client.vocab_size, (2, 3), generator=torch.Generator().manual_seed(seed))
    out = client.extend(cache, ids, 0)  # three candidates for each of two empty prefixes
    assert out.shape == (2, 3, client.embedding.shape[1]) and cache.layers[0].keys.shape[-2] == 3
    # the same forward with a keyword the model swallows in **kwargs leaves the cache empty: refused
    client.cache_keyword = "not_the_cache"
    with pytest.raises(RuntimeError, match="did not fill the key/value cache"):
        client.extend(client.new_cache(), ids, 0)


@pytest.mark.unit
@pytest.mark.parametrize("seed", [0, 1])
def test_sipit_s_gradient_step_attends_to_the_prefix_through_the_keyword_the_client_names(seed):
    """SipIt's gradient step passed its prefix as ``cache=`` whatever the installed transformers takes, so on
    5.17 (which takes ``past_key_values`` and drops an unknown ``cache=``) it stepped as if the position had no
    prefix. Here the model's forward takes the cache as 5.17's did: the step must still read the prefix."""
    from splitleak.attacks.search import GradientGuidedOrder

    client = ClientCopy(load_model("tiny-gpt2", seed=seed).model, 2)
    forward = client.owner.forward

    def forward_517(input_ids=None, past_key_values=None, **kwargs):
        kwargs.pop("cache", None)  # an unknown keyword, dropped without a word
        return forward(input_ids=input_ids, cache=past_key_values, **kwargs)

    client.owner.forward = forward_517
    assert client.cache_keyword == "past_key_values"
    gen = torch.Generator().manual_seed(seed)
    d = client.embedding.shape[1]
    order = GradientGuidedOrder(client, torch.randn(2, 3, d, generator=gen), torch.randn(2, 3, d, generator=gen))
    start = torch.randn(2, d, generator=gen)

    def step(first_tokens):
        cache = client.new_cache()
        client.extend(cache, first_tokens, 0)
        return order._grad_step(start, torch.arange(2), 1, lambda: cache)

    # another prefix, another step: the step read the prefix
    assert not torch.allclose(step(torch.tensor([[1], [2]])), step(torch.tensor([[5], [9]])))
