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


@pytest.mark.unit
def test_the_registry_is_the_one_list_of_attacks():
    assert list(ATTACKS) == list(REGISTRY)
    from splitleak.audit.analysis import READOUT_ATTACKS
    from splitleak.report.grid_figures import CONTROLS
    from splitleak.report.grid_stats import ATTACK_ORDER

    assert ATTACK_ORDER == tuple(REGISTRY)
    assert READOUT_ATTACKS == readout_attacks() == (
        "joint", "shuffled-gradient", "backward-only", "joint-aware", "joint-crossings"
    )  # fmt: skip
    assert CONTROLS == {
        "shuffled-gradient": "shuffled-gradient control",
        "random-candidate": "random-candidate control",
    }
    assert set(controls()) == {"majority", "shuffled-gradient", "random-candidate"}
    help_text = " ".join(CliRunner().invoke(app, ["attack", "--help"]).output.split())
    assert all(name in help_text for name in REGISTRY)
    with pytest.raises(ConfigError, match="known attacks: majority, vmi"):
        attack_info("vmj")


@pytest.mark.unit
def test_the_registry_imports_no_torch():
    code = "import sys, splitleak.attacks.registry as r; r.help_text(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.unit
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


#: fewer iterations for the attacks whose defaults made most of the next test's time (bisr-f 5.8 s, refit 2.8 s,
#: sip-gru 1.8 s of CPU for their two fits): the contract it checks (the same reading twice under one seed, the
#: parameters round-trip, the output's shape) runs the same code however long they optimise
FEWER = {"bisr-f": {"sip_epochs": 2, "f_steps": 40}, "refit": {"steps": 8}, "sip-gru": {"epochs": 2}}


@pytest.mark.integration
@pytest.mark.parametrize("name", [n for n, a in REGISTRY.items() if "plain" in a.modes])
def test_each_attack_runs_on_a_tiny_run_deterministically_and_round_trips_its_params(tiny_runs, name):
    mixup = "probe-activations" in REGISTRY[name].reads or name == "mixup-history"  # reads mixup's traffic only
    run = tiny_runs["mixup" if mixup else "plain"]
    knowledge, traffic = load_knowledge(run, "trained"), load_traffic(run)
    small = {"k": 4} if "k" in inspect.signature(ATTACKS[name].__init__).parameters else {}
    if name == "sipit":
        small = {"budget": 4}
    a = make_attack(name, seed=5, **small, **FEWER.get(name, {}))
    again = make_attack(name, **a.params())
    assert again.params() == a.params()
    first = a.fit(knowledge).reconstruct(traffic)
    second = again.fit(knowledge).reconstruct(traffic)
    if REGISTRY[name].output == "tokens":
        assert first.tokens.shape == (12, 32) and torch.equal(first.tokens, second.tokens)
    else:
        assert first.tokens is None and (first.extra["scores"] == second.extra["scores"]).all()
    if not REGISTRY[name].seeded:  # the claim a grid shares its readings on: another seed reads the same
        other = make_attack(name, **{**a.params(), "seed": 6}).fit(knowledge).reconstruct(traffic)
        assert torch.equal(first.tokens, other.tokens)
        assert first.extra.keys() == other.extra.keys()
        for key, value in first.extra.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other.extra[key]), key


@pytest.mark.integration
@pytest.mark.parametrize(
    "name",
    [
        n
        for n, a in REGISTRY.items()
        if "plain" in a.modes
        and {"gradient", "probe-activations"} & set(a.reads)
        and not set(a.reads) <= {"activations", "output-gradient"}
    ],
)
def test_an_attack_refuses_traffic_it_cannot_read(tiny_runs, name):
    knowledge = load_knowledge(tiny_runs["plain"], "public")
    inference = load_traffic(tiny_runs["plain"], with_gradients=False)
    small = (
        {"budget": 4}
        if name == "sipit"
        else ({"k": 4} if "k" in inspect.signature(ATTACKS[name].__init__).parameters else {})
    )
    with pytest.raises(ConfigError, match="gradient|probe rows"):
        make_attack(name, **small).fit(knowledge).reconstruct(inference)


#: job keys of attack configurations as earlier sessions wrote them into results stores (the first
#: twelve computed at b11f2e5, before the tap and the registry; the rest at 9a2cbb2)
PINNED_KEYS = [
    ({"attack": "vmi"}, "92fb2d6223e35ac7f4ff210ac3dd27904e3250135b7f894d37c2aa2c1f741464"),
    (
        {"attack": "majority", "client_copy": "trained", "attack_seed": 3},
        "60eeffeaac220b6b494690ab2cd449fc755666d7de638a0067dfa2a4c422cb21",
    ),
    ({"attack": "activation", "k": 32}, "3e63fc72dec17a550a5e9deed9716cd76dfb08f3de5643c07f482a7f63e4f01d"),
    (
        {"attack": "activation", "k": 8, "inference": True},
        "9e875a805f6028fb287beaaedb6fc000ae1298bdfe7c8cc09fd3f7fbc1592e95",
    ),
    (
        {"attack": "joint", "k": 16, "gradient_noise": 0.1},
        "a9b0d2fe50a03b09aa67223518711c1cc3d730f17cb1634211b194b290052928",
    ),
    (
        {"attack": "joint", "k": 32, "readout": "pseudo-map", "gradient_bits": 8},
        "2befe21c4c3bd080bfc42c8a621f68e776e4410f75db68c9268e5c8aa09fbbfe",
    ),
    ({"attack": "shuffled-gradient", "k": 8}, "fbaa74d7fd76cc222ac91d24dd3ac6d2e93f6e55e2358b61ea02db1bda0491af"),
    (
        {"attack": "random-candidate", "k": 16, "attack_seed": 1},
        "2743ee1cc1475cb733b191c4f62387a45ca240605f8b25758c21b1488c864589",
    ),
    ({"attack": "backward-only"}, "f9ec50f54ce3d0c36267cfca782443ce9a3c1cc9174f953ea526878780d576ac"),
    (
        {"attack": "sipit", "budget": 32, "client_copy": "trained"},
        "b63cd70465275df74fcf9877d48edddc9d32cf7b63644dfdbbe45529590e71c5",
    ),
    ({"attack": "sipit", "budget": "exhaustive"}, "1637eec1b537df8abd59a6555b97d3f89c9077d00aee24d9c056f1a940feab2f"),
    ({"attack": "property", "attack_seed": 17}, "e739ff953e7f83f3e59abb55c586c47f71055c62d7ec936a5243cce3577d6ebc"),
    ({"attack": "mixup-unmix", "k": 32}, "f664242e60b404707c223dbb44e6e034b62e1c7e36daa3743ed863ebefe58345"),
    ({"attack": "mixup-unmix", "k": 8, "lam": 0.6}, "47e56847ff1407494f093442a37a987395948652aa0c4d522e0ce76eb9e0a271"),
    (
        {"attack": "joint", "k": 32, "gradient_source": "output"},
        "12363323328a07b643b9b70e0e1f16c8688811cd676c85bfa897ba0af89b73d1",
    ),
    ({"attack": "vmi", "phase": "train"}, "66e3d99a7b123f758bdbb61c4cbf2c2ce4c2d91022b7bdc5342b861bd2f89a2a"),
]


@pytest.mark.unit
@pytest.mark.parametrize("config,key", PINNED_KEYS)
def test_job_keys_of_existing_attack_configurations_do_not_change(config, key):
    from splitleak.attacks import make_attack_config

    cfg = make_attack_config(**config)
    assert cfg.hash() == key
    assert make_attack_config(**cfg.model_dump(mode="json")).hash() == key  # the store's JSON round-trips
