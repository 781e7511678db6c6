"""Contract tests driven by the attack registry: every registered attack agrees with its entry, runs
on a tiny run, is deterministic under its seed and round-trips its parameters; everything that lists
attacks derives from the registry."""

import inspect
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from splitleak.attacks import ATTACKS, load_knowledge, load_traffic, make_attack
from splitleak.attacks.registry import REGISTRY, attack_info, controls, readout_attacks
from splitleak.cli import app
from splitleak.errors import ConfigError
from splitleak.training import make_train_config, run_training

BASE = dict(model="tiny-gpt2", depth=2, n_calib=16, n_train=8, n_eval=12, all_local_baseline=False)


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("registry")
    plain, mixed = root / "plain", root / "mixup"
    run_training(make_train_config(**BASE, seed=3), plain, device="cpu")
    run_training(make_train_config(**BASE, seed=3, defences=[{"name": "mixup"}]), mixed, device="cpu")
    return {"plain": plain, "mixup": mixed}


def test_the_registry_is_the_one_list_of_attacks():
    assert list(ATTACKS) == list(REGISTRY)
    from splitleak.audit.analysis import READOUT_ATTACKS
    from splitleak.report.grid_figures import CONTROLS
    from splitleak.report.grid_stats import ATTACK_ORDER

    assert ATTACK_ORDER == tuple(REGISTRY)
    assert READOUT_ATTACKS == readout_attacks() == ("joint", "shuffled-gradient", "backward-only")
    assert CONTROLS == {"shuffled-gradient": "shuffled-gradient control", "random-candidate": "random-candidate control"}
    assert set(controls()) == {"majority", "shuffled-gradient", "random-candidate"}
    help_text = " ".join(CliRunner().invoke(app, ["attack", "--help"]).output.split())
    assert all(name in help_text for name in REGISTRY)
    with pytest.raises(ConfigError, match="known attacks: majority, vmi"):
        attack_info("vmj")


def test_the_registry_imports_no_torch():
    code = "import sys, splitleak.attacks.registry as r; r.help_text(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("name", list(REGISTRY))
def test_each_attack_agrees_with_its_entry(name):
    info, cls = REGISTRY[name], ATTACKS[name]
    assert cls.name == name
    params = inspect.signature(cls.__init__).parameters
    assert info.takes_readout == ("readout" in params)
    assert set(make_attack(name).channels_read()) <= set(info.reads)
    if cls.uses_gradients:
        assert {"gradient", "output-gradient"} & set(info.reads)
    assert info.control == (info.control_of is not None or name == "majority")


@pytest.mark.parametrize("name", list(REGISTRY))
def test_each_attack_runs_on_a_tiny_run_deterministically_and_round_trips_its_params(tiny_runs, name):
    run = tiny_runs["mixup" if "probe-activations" in REGISTRY[name].reads else "plain"]
    knowledge, traffic = load_knowledge(run, "trained"), load_traffic(run)
    small = {"k": 4} if "k" in inspect.signature(ATTACKS[name].__init__).parameters else {}
    if name == "sipit":
        small = {"budget": 4}
    a = make_attack(name, seed=5, **small)
    again = make_attack(name, **a.params())
    assert again.params() == a.params()
    first = a.fit(knowledge).reconstruct(traffic)
    second = again.fit(knowledge).reconstruct(traffic)
    if REGISTRY[name].output == "tokens":
        assert first.tokens.shape == (12, 32) and torch.equal(first.tokens, second.tokens)
    else:
        assert first.tokens is None and (first.extra["scores"] == second.extra["scores"]).all()


@pytest.mark.parametrize("name", [n for n, a in REGISTRY.items() if {"gradient", "probe-activations"} & set(a.reads)
                                  and not set(a.reads) <= {"activations", "output-gradient"}])
def test_an_attack_refuses_traffic_it_cannot_read(tiny_runs, name):
    knowledge = load_knowledge(tiny_runs["plain"], "public")
    inference = load_traffic(tiny_runs["plain"], with_gradients=False)
    small = {"budget": 4} if name == "sipit" else ({"k": 4} if "k" in inspect.signature(ATTACKS[name].__init__).parameters else {})
    with pytest.raises(ConfigError, match="gradient|probe rows"):
        make_attack(name, **small).fit(knowledge).reconstruct(inference)
