"""The forward-wire attacks that know the plain split's defences (``sipit-aware``, ``activation-aware``,
``mixup-history``): the defences' public forward, the identity on undefended traffic, the positive controls
(given the defence's secret they read what undefended traffic gives) and what they read beyond the ordinary
attacks."""

import dataclasses
import json

import pytest
import torch

from splitleak.attacks import load_knowledge, load_traffic
from splitleak.attacks.core import make_attack
from splitleak.defences import DefenceChain, WireContext, build_defence, quantize_symmetric
from splitleak.errors import ConfigError


def _truth(run, phase="evaluation"):
    return torch.tensor([d["token_ids"] for d in json.loads((run / "documents.json").read_text())[phase]])


def _run(shared_run, seed, defences, depth=3, n_calib=2, n_train=8, n_eval=16):
    """Depth 3 with two calibration documents (a weak ridge map, as tests/test_attacks.py's weak runs)."""
    return shared_run(
        model="tiny-gpt2",
        depth=depth,
        n_calib=n_calib,
        n_train=n_train,
        n_eval=n_eval,
        seed=seed,
        data_seed=seed,
        all_local_baseline=False,
        defences=defences,
    )


def _read(run, name, copy="trained", traffic=None, knowledge=None, **kw):
    kn = knowledge if knowledge is not None else load_knowledge(run, copy)
    tr = traffic if traffic is not None else load_traffic(run)
    rec = make_attack(name, **kw).fit(kn).reconstruct(tr)
    return float((rec.tokens == _truth(run)[: len(tr)]).float().mean()), rec


# ------------------------------------------------------------------ the defences' public forward


@pytest.mark.unit
@pytest.mark.parametrize("name", ["quant8", "quant4", "quant4-noisy"])
def test_rounding_is_emulated_exactly_at_the_scale_the_frame_reveals(name):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 6, 16, generator=g) * torch.tensor([1.0, 5.0, 0.2]).view(3, 1, 1)
    d = build_defence(name)
    sent = d.forward(h, WireContext(0, "capture", -1, (0, 1, 2)))
    assert torch.equal(d.public_forward(h, sent), sent)
    bits = 8 if name == "quant8" else 4
    assert torch.allclose(d.forward_spacing(sent), h.abs().flatten(1).amax(1) / (2 ** (bits - 1) - 1))
    # another candidate's row differs by at least one level where it rounds elsewhere
    other = d.public_forward(h + 0.6 * d.forward_spacing(sent).view(3, 1, 1), sent)
    assert float((other - sent).norm(dim=-1).min()) >= 0.99 * float(d.forward_spacing(sent).min())
    assert d.forward_noise_std() == 0.0


@pytest.mark.unit
@pytest.mark.parametrize(
    "name,args,std",
    [
        ("clip-noise", {"clip": 0.5, "sigma": 0.2}, 0.1),
        ("clip-noise", {"clip": 0.5, "sigma": 0.2, "where": "forward"}, 0.1),
        ("dp-forward", {"clip": 2.0, "noise_multiplier": 0.5}, 1.0),
    ],
)
def test_clip_and_noise_emulate_the_clip_and_declare_the_noise(name, args, std):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(4, 32, 64, generator=g)  # row norms about 8, far above the clips
    d = build_defence(name, args)
    sent = d.forward(h, WireContext(0, "capture", -1, (0, 1, 2, 3)))
    clipped = d.public_forward(h, sent)
    assert torch.allclose(clipped.norm(dim=-1), torch.full((4, 32), args["clip"]), rtol=1e-5)
    noise = sent - clipped
    assert d.forward_noise_std() == pytest.approx(std)
    assert float(noise.std()) == pytest.approx(std, rel=0.03)  # 8,192 draws
    assert abs(float(noise.mean())) < 0.05 * std


@pytest.mark.unit
def test_a_backward_only_defence_leaves_the_forward_as_it_is():
    d = build_defence("clip-noise", {"where": "backward"})
    h = torch.randn(2, 3, 8)
    assert torch.equal(d.public_forward(h, h), h) and d.forward_noise_std() == 0.0
    chain = DefenceChain([d, build_defence("replica-median")], seed=0)
    assert chain.forward_defences() == [] and torch.equal(chain.public_forward(h, h), h)


@pytest.mark.unit
def test_the_chain_composes_in_order_and_refuses_what_it_cannot_emulate():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(2, 5, 16, generator=g) * 3
    chain = DefenceChain.from_specs(
        [{"name": "clip-noise", "args": {"clip": 1.0, "sigma": 0.0}}, {"name": "quant8"}], 0
    )
    sent = chain.forward(h, "capture", -1, (0, 1))
    assert torch.equal(chain.public_forward(h, sent), sent)  # the clip, then rounding at the revealed scale
    assert torch.equal(chain.forward_spacing(sent), sent.abs().flatten(1).amax(1) / 127)
    with pytest.raises(ConfigError, match="clip-noise transforms the rows after quant8"):
        DefenceChain.from_specs([{"name": "quant8"}, {"name": "clip-noise"}], 0).public_forward(h, sent)
    with pytest.raises(ConfigError, match="mixup's forward cannot be emulated.*mixup-history"):
        DefenceChain.from_specs([{"name": "mixup", "args": {"correction": "cached"}}], 0).public_forward(h, h)
    assert quantize_symmetric(sent, 8).equal(sent)


# ------------------------------------------------------------------ undefended: the ordinary attacks, bit for bit


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_on_undefended_traffic_the_aware_attacks_are_the_ordinary_ones_bit_for_bit(shared_run, seed):
    run = _run(shared_run, seed, [{"name": "none"}])
    kn = load_knowledge(run, "public")
    tr = load_traffic(run).subset(range(8))
    plain = make_attack("sipit", budget=16).fit(kn).reconstruct(tr)
    aware = make_attack("sipit-aware", budget=16).fit(kn).reconstruct(tr)
    for key in ("matched", "checks", "distance"):
        assert torch.equal(plain.extra[key], aware.extra[key]), key
    assert torch.equal(plain.tokens, aware.tokens) and "summary" not in aware.extra
    plain = make_attack("activation", k=8).fit(kn).reconstruct(tr)
    aware = make_attack("activation-aware", k=8).fit(kn).reconstruct(tr)
    assert torch.equal(plain.tokens, aware.tokens) and torch.equal(plain.extra["distance"], aware.extra["distance"])
    assert float((plain.tokens == _truth(run)[:8]).float().mean()) < 1.0  # a reading that could differ


# ------------------------------------------------------------------ positive controls


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("quant", ["quant8", "quant4"])
def test_sipit_aware_certifies_quantised_traffic_as_sipit_certifies_undefended(shared_run, seed, quant):
    """Rounding at the scale the frame reveals: through the trained copy every level of the true token's row
    matches, so the exhaustive search certifies every position, as SipIt does on the undefended run of the
    seed; the ordinary SipIt, comparing the unrounded rows, certifies none of the quantised ones."""
    docs = range(4)
    undefended = _run(shared_run, seed, [{"name": "none"}])
    defended = _run(shared_run, seed, [{"name": quant}])
    tr_u, tr_d = load_traffic(undefended).subset(docs), load_traffic(defended).subset(docs)
    acc_u, rec_u = _read(undefended, "sipit", traffic=tr_u, budget="exhaustive")
    acc_a, rec_a = _read(defended, "sipit-aware", traffic=tr_d, budget="exhaustive")
    acc_p, rec_p = _read(defended, "sipit", traffic=tr_d, budget=32)
    cert_u, cert_a = float(rec_u.extra["matched"].float().mean()), float(rec_a.extra["matched"].float().mean())
    assert cert_u == 1.0 and cert_a == cert_u and acc_a >= acc_u == 1.0
    assert float(rec_p.extra["matched"].float().mean()) == 0.0
    assert rec_a.extra["summary"]["match"] == "rounding cell"


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_a_rounding_cell_that_holds_many_candidates_certifies_nothing(shared_run, seed):
    """Rounding is not injective: with one massive entry per document (as SmolLM2's first position has) 4-bit
    levels put every later row at zero, so every candidate lies in the cell. The search stops in its first
    round, but no position after the first counts as matched: all are ambiguous."""
    run = _run(shared_run, seed, [{"name": "none"}])
    tr = load_traffic(run).subset(range(4))
    spiked = tr.activations.clone()
    spiked[:, 0, 0] = 1000 * spiked.abs().max()
    kn = dataclasses.replace(load_knowledge(run, "trained"), defences=({"name": "quant4", "args": {}},))
    frame = tr.replace(activations=quantize_symmetric(spiked, 4))
    assert bool((frame.activations[:, 1:] == 0).all())
    rec = make_attack("sipit-aware", budget=16).fit(kn).reconstruct(frame)
    assert not bool(rec.extra["matched"][:, 1:].any())
    assert rec.extra["summary"]["in_cell_share"] > 0.95 and rec.extra["summary"]["ambiguous_share"] > 0.9
    assert int(rec.extra["checks"][:, 1:].max()) == 16  # stopped after the first round


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_given_the_noise_draws_sipit_aware_reads_clip_noise_traffic_as_sipit_reads_undefended(shared_run, seed):
    """The noise is the defence's secret: regenerated from the client's key and removed, what is left is the
    clip, which the aware search emulates, so it certifies every position through the trained copy, as SipIt
    does undefended. The ordinary SipIt on the same denoised (clipped) rows certifies nothing."""
    from splitleak.training.run import read_draws_secret

    specs = [{"name": "clip-noise", "args": {"clip": 0.1, "sigma": 0.05, "where": "forward"}}]
    run, undefended = _run(shared_run, seed, specs), _run(shared_run, seed, [{"name": "none"}])
    tr = load_traffic(run).subset(range(4))
    chain = DefenceChain.from_specs(specs, seed, read_draws_secret(run))
    noise = chain.forward(torch.zeros_like(tr.activations), "capture", -1, tr.doc_ids)  # clip(0) + the draws
    denoised = tr.replace(activations=tr.activations - noise)
    assert torch.allclose(denoised.activations.norm(dim=-1), torch.full((4, 32), 0.1), rtol=1e-4)
    kn = load_knowledge(run, "trained")
    clip_only = dataclasses.replace(
        kn, defences=({"name": "clip-noise", "args": {"clip": 0.1, "sigma": 0.0, "where": "forward"}},)
    )
    acc_a, rec_a = _read(run, "sipit-aware", traffic=denoised, knowledge=clip_only, budget="exhaustive")
    acc_u, rec_u = _read(undefended, "sipit", traffic=load_traffic(undefended).subset(range(4)), budget="exhaustive")
    acc_p, rec_p = _read(run, "sipit", traffic=denoised, knowledge=kn, budget=32)
    assert acc_a >= acc_u == 1.0 and bool(rec_a.extra["matched"].all())
    assert not bool(rec_p.extra["matched"].any())


# ------------------------------------------------------------------ what knowing the defence adds


@pytest.mark.integration
def test_knowing_clip_and_noise_reads_more_than_the_ordinary_attacks(shared_run):
    """clip-noise with its clip below every row's norm (the rows are about 0.25 long): the ordinary attacks
    compare candidates' unclipped rows with clipped, noised ones. Measured on seeds 0 and 1 (8 documents,
    public copy): sipit 0.67/0.75 -> sipit-aware 1.00/1.00 (budget 32), activation 0.70/0.78 ->
    activation-aware 0.84/0.93 (k 32)."""
    specs = [{"name": "clip-noise", "args": {"clip": 0.1, "sigma": 0.05, "where": "forward"}}]
    for seed in (0, 1):
        run = _run(shared_run, seed, specs)
        tr = load_traffic(run).subset(range(8))
        s, _ = _read(run, "sipit", copy="public", traffic=tr, budget=32)
        s_a, rec = _read(run, "sipit-aware", copy="public", traffic=tr, budget=32)
        a, _ = _read(run, "activation", copy="public", traffic=tr, k=32)
        a_a, _ = _read(run, "activation-aware", copy="public", traffic=tr, k=32)
        assert s_a > s + 0.15 and a_a > a + 0.08, (seed, s, s_a, a, a_a)
        assert rec.extra["summary"]["match"] == "chi-square" and not bool(rec.extra["matched"].any())
        assert float(rec.extra["consistent"].float().mean()) > 0.8  # the likeliest candidates fit the noise


@pytest.mark.integration
def test_knowing_the_rounding_certifies_but_reads_no_more_on_the_tiny_model(shared_run):
    """On tiny-gpt2 rounding to 4 bits leaves the rows close enough that the ordinary SipIt already reads every
    token (budget 32, trained copy, seeds 0 and 1); knowing the rounding adds certification, not tokens."""
    for seed in (0, 1):
        run = _run(shared_run, seed, [{"name": "quant4"}])
        tr = load_traffic(run).subset(range(8))
        s, rec = _read(run, "sipit", traffic=tr, budget=32)
        s_a, rec_a = _read(run, "sipit-aware", traffic=tr, budget=32)
        assert s == s_a == 1.0
        assert float(rec.extra["matched"].float().mean()) == 0.0
        assert float(rec_a.extra["matched"].float().mean()) == 1.0


# ------------------------------------------------------------------ mixup without probe rows


def _mixup_run(shared_run, seed, correction):
    return _run(
        shared_run,
        seed,
        [{"name": "mixup", "args": {"correction": correction, "lambda": 0.5, "warmup": 3}}],
        n_train=8,
        n_eval=12,
    )


@pytest.mark.integration
@pytest.mark.parametrize("correction", ["cached", "none"])
def test_mixup_history_unmixes_exactly_given_the_decoy_record(shared_run, correction):
    """Positive control: given the client's record of where each decoy came from, the history unmixes the
    capture's rows to the client's own activations (the trained copy's), and the activation attacker reads
    them as it reads those."""
    run = _mixup_run(shared_run, 0, correction)
    kn = load_knowledge(run, "trained")
    tr = load_traffic(run)
    log = json.loads((run / "client" / "mixup_decoys.json").read_text())
    unmixed, info = make_attack("mixup-history").fit(kn).unmix(tr, log=log)
    clean = kn.client.activations(_truth(run))
    assert float((unmixed.activations - clean).norm() / clean.norm()) < 1e-5
    assert float((tr.activations - clean).norm() / clean.norm()) > 0.1  # what crossed was mixed
    assert info["summary"]["history_mixed_rows"] == 5 * 32
    assert (
        _read(run, "activation", traffic=unmixed)[0]
        == _read(run, "activation", traffic=tr.replace(activations=clean))[0]
    )


@pytest.mark.integration
def test_mixup_history_finds_the_decoys_and_reads_more_than_the_activation_attacker(shared_run):
    """Without the record: the decoys it finds are the client's, and unmixing reads more than the activation
    attacker on the mixed rows. Measured (lambda 0.5, trained copy, 12 documents, seeds 0 and 1): decoys right
    0.98/0.96 of rows (identified 0.88/0.83, of which 0.997/0.991 right); tokens 0.98/0.97 against the
    activation attacker's 0.47/0.50."""
    for seed in (0, 1):
        run = _mixup_run(shared_run, seed, "cached")
        log = json.loads((run / "client" / "mixup_decoys.json").read_text())
        truth = torch.tensor([e["sources"] for e in log if e["phase"] == "capture"])
        acc, rec = _read(run, "mixup-history")
        base, _ = _read(run, "activation")
        right = float((rec.extra["decoy_sources"] == truth).all(-1).float().mean())
        ok = rec.extra["decoy_identified"]
        assert right > 0.8 and acc > base + 0.15, (seed, right, acc, base)
        assert float((rec.extra["decoy_sources"] == truth).all(-1)[ok].float().mean()) > 0.9  # identified: right
        assert rec.extra["summary"]["identified"] == int(ok.sum())


@pytest.mark.integration
def test_mixup_history_refuses_traffic_it_does_not_read(shared_run):
    run = _run(shared_run, 0, [{"name": "none"}])
    with pytest.raises(ConfigError, match="no mixup"):
        make_attack("mixup-history").fit(load_knowledge(run)).reconstruct(load_traffic(run))
    kn = dataclasses.replace(load_knowledge(run), defences=({"name": "mixup", "args": {"correction": "cached"}},))
    with pytest.raises(ConfigError, match="training traffic"):
        make_attack("mixup-history").fit(dataclasses.replace(kn, history_loader=None)).reconstruct(load_traffic(run))
    with pytest.raises(ConfigError, match="alpha"):
        make_attack("sipit-aware", alpha=1.5).fit(load_knowledge(run))
    kn = dataclasses.replace(load_knowledge(run), defences=({"name": "mixup", "args": {"correction": "cached"}},))
    with pytest.raises(ConfigError, match="mixup-history"):
        make_attack("sipit-aware").fit(kn)
