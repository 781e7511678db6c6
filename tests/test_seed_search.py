"""The client's draws on the wire: keyed by the run seed (``draws="derived"``), a key search finds them;
keyed by a per-run OS secret (``draws="os"``, the default), it does not, and the client's own record of
the secret regenerates them (the positive control)."""

import pytest
import torch

from splitleak.attacks import load_traffic
from splitleak.attacks.seedsearch import SeedSearch
from splitleak.defences import WireContext
from splitleak.defences.base import clip_rows
from splitleak.training import make_train_config, run_training
from splitleak.training.run import read_draws_secret

CLIP, SIGMA = 0.5, 0.1  # the tiny model's rows have norm about 0.8: every row is clipped


def _run(tmp_path, name, seed, draws):
    cfg = make_train_config(
        model="tiny-gpt2", depth=2, n_calib=4, n_train=4, n_eval=6, seed=seed, all_local_baseline=False,
        defences=[{"name": "quant8"}, {"name": "clip-noise", "args": {"clip": CLIP, "sigma": SIGMA, "where": "forward"}}],
        draws=draws,
    )  # fmt: skip
    run_training(cfg, tmp_path / name, device="cpu")
    return tmp_path / name


@pytest.mark.integration
@pytest.mark.parametrize("seed", [3, 11])
def test_seed_search_finds_a_run_seed_and_only_the_right_one(tmp_path, seed):
    traffic = load_traffic(_run(tmp_path, "derived", seed, "derived"))
    attack = SeedSearch(seeds=16, confirm=4)
    found = attack.search(traffic, position=1, std=SIGMA * CLIP)
    assert found["key_found"] and found["run_seed"] == seed and found["tried"] == seed + 1
    # the noise it regenerates is the noise that crossed: what is left is the clipped activation
    clean = traffic.activations[0] - attack._noise(seed, traffic, 0, 1, SIGMA * CLIP)
    assert float(clean.norm(dim=-1).max()) <= CLIP * (1 + 1e-5)
    assert float(traffic.activations[0].norm(dim=-1).max()) > CLIP * 1.05
    wrong = attack.statistic(traffic.activations[0], attack._noise(seed + 1, traffic, 0, 1, SIGMA * CLIP), SIGMA * CLIP)
    right = attack.statistic(traffic.activations[0], attack._noise(seed, traffic, 0, 1, SIGMA * CLIP), SIGMA * CLIP)
    assert abs(float(right.mean()) - 1) < 0.3 and abs(float(wrong.mean()) + 1) < 0.3


@pytest.mark.integration
def test_draws_from_os_entropy_defeat_the_search_and_the_clients_record_regenerates_them(tmp_path):
    run = _run(tmp_path, "os", 0, "os")
    traffic = load_traffic(run)
    found = SeedSearch(seeds=64, confirm=4).search(traffic, position=1, std=SIGMA * CLIP)
    assert not found["key_found"] and found["run_seed"] is None and found["best_statistic"] < 0
    secret = read_draws_secret(run)
    assert secret is not None and len(secret) == 16
    assert read_draws_secret(_run(tmp_path, "os2", 0, "os")) != secret  # fresh per run
    row, doc = 0, traffic.doc_ids[0]
    ctx = WireContext(0, "capture", -1, (doc,), 1, secret.hex())
    noise = torch.randn(traffic.activations[row].shape, generator=ctx.generator("forward", doc))
    clean = traffic.activations[row] - SIGMA * CLIP * noise
    assert float(clean.norm(dim=-1).max()) <= CLIP * (1 + 1e-5)  # exactly the clipped rows
    assert torch.allclose(clip_rows(clean, CLIP), clean)
    assert read_draws_secret(_run(tmp_path, "derived", 0, "derived")) is None


@pytest.mark.integration
@pytest.mark.parametrize("seed", [3, 11])
def test_seed_search_removes_the_noise_and_reads_what_the_clip_alone_leaves(tmp_path, seed):
    """With the run seed found the noise is gone: the reading is sipit-aware's on noise-free traffic, far
    above sipit-aware's on the noisy rows; under OS draws it finds nothing and reads as sipit-aware does."""
    from splitleak.attacks import load_knowledge, make_attack_config
    from splitleak.audit.evaluate import run_attack

    heavy = {"clip": CLIP, "sigma": 1.0, "where": "forward"}  # noise of norm 8 C on 64 coordinates
    results = {}
    for draws in ("derived", "os"):
        cfg = make_train_config(
            model="tiny-gpt2", depth=2, n_calib=8, n_train=4, n_eval=8, seed=seed, all_local_baseline=False,
            defences=[{"name": "clip-noise", "args": heavy}], draws=draws,
        )  # fmt: skip
        run = tmp_path / draws
        run_training(cfg, run, device="cpu")
        kn = load_knowledge(run, "trained")
        for attack in ("seed-search", "sipit-aware"):
            acfg = make_attack_config(attack=attack, client_copy="trained", params={"budget": 8})
            results[draws, attack] = run_attack(run, acfg, knowledge=kn)
    found = results["derived", "seed-search"]["attack_summary"]
    assert found["key_found"] and found["run_seed"] == seed
    assert (
        results["derived", "seed-search"]["token_recovery"] >= results["derived", "sipit-aware"]["token_recovery"] + 0.3
    )
    assert results["derived", "seed-search"]["token_recovery"] >= 0.8
    missed = results["os", "seed-search"]
    assert not missed["attack_summary"]["key_found"] and missed["attack_summary"]["draws"] == "os"
    assert missed["token_recovery"] == results["os", "sipit-aware"]["token_recovery"]


@pytest.mark.unit
def test_a_recorded_configuration_keeps_its_draws():
    """``as_dict`` leaves ``draws="derived"`` out (the hashes of runs made before the choice existed), so a record
    read back must mean derived, not the new default; a grid's train job carries the spec's draws to its run."""
    from splitleak.experiments.jobs import expand
    from splitleak.experiments.spec_loading import load_spec
    from splitleak.training import config_from_record

    derived, fresh = make_train_config(draws="derived"), make_train_config()
    assert fresh.draws == "os" and "draws" not in derived.as_dict() and fresh.as_dict()["draws"] == "os"
    assert config_from_record(derived.as_dict()) == derived and config_from_record(fresh.as_dict()) == fresh
    assert make_train_config(**derived.as_dict()).draws == "os"  # what the worker did before: the bug
    grid = expand(load_spec("mirage", "tiny"), "0" * 64)  # the spec says draws: derived
    runs = [config_from_record(j.run_config) for j in grid.jobs if j.kind == "train"]
    assert runs and all(c.draws == "derived" for c in runs)
