"""Contract tests driven by the defence registry: every registered defence says where it acts and
which split modes it supports, runs deterministically, composes with quant8, and refuses a split
mode it does not support, naming itself."""

import pytest
import torch

from splitleak.defences import DEFENCES, ROLES, SPLIT_MODES, DefenceChain, build_defence
from splitleak.errors import ConfigError
from splitleak.runs.captures import load_capture
from splitleak.training import make_train_config, run_training

SMALL = dict(model="tiny-gpt2", n_calib=4, n_train=6, n_eval=8, seed=2, all_local_baseline=False, draws="derived")
NAMES = [n for n in DEFENCES if n != "none"]


@pytest.mark.unit
@pytest.mark.parametrize("name", list(DEFENCES))
def test_each_defence_declares_its_roles_and_split_modes(name):
    d = build_defence(name)
    assert set(d.roles()) <= set(ROLES) and set(d.split_modes) <= set(SPLIT_MODES) and d.split_modes
    assert (name == "none") == (d.roles() == ())


def _mode_of(name: str) -> dict:
    """A tiny run's split for a defence: plain where it supports it, else U-shape, else label-shielded."""
    modes = DEFENCES[name].split_modes
    if "plain" in modes:
        return {"depth": 2}
    if "u-shape" in modes:
        return {"offload_start": 1, "offload_length": 2}
    return {"shielded": {"bottom": 1, "top": 1}}


@pytest.mark.integration
@pytest.mark.parametrize("name", NAMES)
def test_each_defence_is_deterministic_and_composes_with_quant8(tmp_path, name):
    mode = _mode_of(name)
    chain = [{"name": name}, {"name": "quant8"}] if name != "quant8" else [{"name": "quant8"}]
    caps = []
    for run in ("a", "b"):
        run_training(make_train_config(**SMALL, **mode, defences=chain), tmp_path / run, device="cpu")
        caps.append(load_capture(tmp_path / run))
    assert torch.equal(caps[0].activations, caps[1].activations)
    assert torch.equal(caps[0].gradients, caps[1].gradients)
    from splitleak.defences import quantize_symmetric

    if "client-forward" in build_defence(name).roles() or name == "replica-median":
        assert torch.equal(quantize_symmetric(caps[0].activations, 8), caps[0].activations)  # quant8 applied last


@pytest.mark.integration
@pytest.mark.parametrize("name", [n for n in NAMES if "u-shape" not in DEFENCES[n].split_modes])
def test_a_defence_refuses_a_split_mode_it_does_not_support(tmp_path, name):
    hint = (
        "is implemented for the plain split only"
        if DEFENCES[name].split_modes == ("plain",)
        else "--mode label-shielded"
    )
    with pytest.raises(ConfigError, match=f"{name} .*{hint}"):
        run_training(
            make_train_config(**SMALL, offload_start=1, offload_length=2, defences=[{"name": name}]),
            tmp_path / "r",
            device="cpu",
        )
    assert not (tmp_path / "r").exists()


@pytest.mark.unit
def test_a_chain_takes_one_defence_per_exclusive_role():
    with pytest.raises(ConfigError, match="mixup can appear once"):
        DefenceChain([build_defence("mixup"), build_defence("mixup")], 0)
    with pytest.raises(ConfigError, match="replica-median can appear once"):
        DefenceChain([build_defence("replica-median"), build_defence("replica-median")], 0)


@pytest.mark.unit
@pytest.mark.parametrize(
    "name,args,words",
    [
        ("clip-noise", {"clip": "abc"}, r"clip-noise: clip must be a finite number > 0, got 'abc'"),
        ("quant4-noisy", {"noise": "lots"}, r"quant4-noisy: noise must be a finite number >= 0, got 'lots'"),
        ("dp-forward", {"delta": "x"}, r"dp-forward: delta must be a finite number > 0 and < 1, got 'x'"),
        ("replica-median", {"k": 3.5}, r"replica-median: k must be an integer >= 3 .*, got 3.5"),
        ("quant8", {"bits": 4}, r"does not take argument\(s\) \['bits'\]; it takes no arguments"),
        ("mixup", {"correction": "exact"}, "correction must be one of probe, cached, none"),
    ],
)
def test_bad_arguments_are_refused_with_the_argument_named(name, args, words):
    with pytest.raises(ConfigError, match=words):
        build_defence(name, args)


@pytest.mark.unit
@pytest.mark.parametrize("name", list(DEFENCES))
def test_each_defence_names_the_attacks_built_for_it(name):
    """Kerckhoffs: every defence names registered attacks that know its mechanism, for every split mode it
    supports (``none`` says why none applies), and each of them reads traffic of that mode."""
    from splitleak.attacks.registry import attack_info
    from splitleak.defences import check_adaptive

    cls = DEFENCES[name]
    check_adaptive(cls)
    assert cls.adaptive_note
    if name == "none":
        assert cls.adaptive == ()
        return
    d = build_defence(name)
    for attack in cls.adaptive:
        assert attack_info(attack).adaptive, f"{attack} is named by {name} but not registered as adaptive"
    for mode in cls.split_modes:
        names = d.adaptive_attacks(mode)
        assert set(names) <= set(cls.adaptive)
        assert bool(names) != bool(d.adaptive_gap(mode)), (mode, names)  # an attack, or why none applies
        assert all(mode in attack_info(a).modes for a in names)
        assert set(DefenceChain([d], seed=0).adaptive_attacks(mode)) == set(names)


#: configurations whose declarations differ from the defaults'
CONFIGS = [(name, {}) for name in DEFENCES] + [
    ("clip-noise", {"where": "backward"}),
    ("clip-noise", {"where": "both"}),
    ("mixup", {"correction": "cached"}),
]


@pytest.mark.unit
@pytest.mark.parametrize("name, args", CONFIGS)
def test_every_attack_built_for_a_defence_reads_a_channel_it_transforms(name, args):
    """An attack declared as built for a defence must read a channel that this configuration of the defence
    transforms in that split mode: otherwise knowing the defence changes nothing it reads, and it is the plain
    attack under an adaptive name (as sipit-aware was for replica-median, for clip-noise on the returned
    gradient only, and for the output-gradient defences in a U-shape). Where none applies, the defence says
    why."""
    from splitleak.attacks.registry import attack_info

    d = build_defence(name, args)
    for mode in d.split_modes:
        for attack in d.adaptive_attacks(mode):
            read = set(attack_info(attack).reads)
            assert read & d.transformed_channels(), (name, args, mode, attack, read, d.transformed_channels())
        if not d.adaptive_attacks(mode):
            assert len(d.adaptive_gap(mode)) > 40, (name, args, mode)


@pytest.mark.unit
def test_a_defence_without_an_adaptive_attack_is_refused():
    from splitleak.defences import Defence, check_adaptive

    class Blindfold(Defence):
        name = "blindfold"

    with pytest.raises(ConfigError, match="blindfold.*names no attack built for it"):
        check_adaptive(Blindfold)

    class Partly(Defence):
        name = "partly"
        split_modes = ("plain", "u-shape")
        adaptive = ("sipit-aware",)
        adaptive_note = "x"

        def adaptive_attacks(self, mode):
            return self.adaptive if mode == "plain" else ()

    with pytest.raises(ConfigError, match="partly.*in a u-shape run, nor why none applies"):
        check_adaptive(Partly)

    class Explained(Partly):
        name = "explained"

        def adaptive_gap(self, mode):
            return "" if mode == "plain" else "it acts on nothing a u-shape's attacks read"

    check_adaptive(Explained)  # a mode without an attack is accepted where the defence says why


@pytest.mark.unit
def test_the_chain_names_each_adaptive_attack_once_with_the_defences_it_serves():
    chain = DefenceChain([build_defence("quant8"), build_defence("clip-noise")], seed=0)
    got = chain.adaptive_attacks("plain")
    assert got == {
        "sipit-aware": ("quant8", "clip-noise"),
        "activation-aware": ("quant8", "clip-noise"),
        "joint-aware": ("quant8", "clip-noise"),
        "seed-search": ("clip-noise",),
        "crossings-aware": ("clip-noise",),
        "joint-crossings": ("clip-noise",),
    }
    backward_only = DefenceChain([build_defence("clip-noise", {"where": "backward"})], seed=0)
    # one crossing's read-out ranks as it would unnoised: only the reader of every crossing knows something of use
    assert backward_only.adaptive_attacks("plain") == {"joint-crossings": ("clip-noise",)}
    assert DefenceChain([build_defence("mixup", {"correction": "cached"})], seed=0).adaptive_attacks("plain") == {
        "mixup-history": ("mixup",)
    }
    assert DefenceChain([build_defence("mirage")], seed=0).adaptive_attacks("label-shielded") == {
        "gma-sl-aware": ("mirage",)
    }


@pytest.mark.unit
def test_every_module_of_the_package_is_imported_and_holds_the_classes_it_registers():
    """A new defence is one file: ``import splitleak.defences`` imports every module of the package, and every
    registered class lives in one of them."""
    import pkgutil
    import sys

    import splitleak.defences as pkg

    names = {f"splitleak.defences.{m.name}" for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_")}
    assert names == set(pkg.FAMILY_MODULES) and all(n in sys.modules for n in names)
    assert {cls.__module__ for cls in DEFENCES.values()} <= names


@pytest.mark.unit
def test_a_new_file_in_the_package_registers_its_defence_and_is_offered_everywhere(tmp_path, monkeypatch):
    """A module dropped into the package's path (here a temporary folder added to it) is imported by
    ``load_family_modules``: its defence is built, listed by ``splitleak defences`` and offered to ``tune``."""
    import sys

    import splitleak.defences as pkg
    from splitleak.cli.catalogue import defence_rows
    from splitleak.experiments.tune import searchable_defences

    (tmp_path / "halve_tmp.py").write_text(
        "from splitleak.defences.base import Defence, SearchRange, check_number, register\n\n\n"
        "@register\n"
        "class Halve(Defence):\n"
        "    name = 'halve-tmp'\n"
        "    adaptive_note = 'a test defence'\n"
        "    search = {'factor': SearchRange(0.1, 1.0)}\n\n"
        "    def __init__(self, factor: float = 0.5):\n"
        "        self.factor = check_number(self.name, 'factor', factor, 0.0, 1.0, lo_open=True)\n\n"
        "    def args(self):\n"
        "        return {'factor': self.factor}\n\n"
        "    def forward(self, x, ctx):\n"
        "        return x * self.factor\n"
    )
    before = dict(DEFENCES)
    monkeypatch.setattr(pkg, "__path__", [*pkg.__path__, str(tmp_path)])
    try:
        assert "splitleak.defences.halve_tmp" in pkg.load_family_modules()
        assert build_defence("halve-tmp", {"factor": 0.25}).args() == {"factor": 0.25}
        with pytest.raises(ConfigError, match="halve-tmp: factor must be a finite number > 0 and <= 1, got 2"):
            build_defence("halve-tmp", {"factor": 2})
        assert "halve-tmp" in [r["name"] for r in defence_rows()]
        assert "halve-tmp" in searchable_defences()
    finally:
        DEFENCES.clear()
        DEFENCES.update(before)
        sys.modules.pop("splitleak.defences.halve_tmp", None)


@pytest.mark.unit
def test_the_defence_package_imports_nothing_above_it():
    """The defences stand below training, attacks, audit and the rest: none of their modules imports them."""
    import ast
    from pathlib import Path

    import splitleak.defences as pkg

    above = ("splitleak.training", "splitleak.attacks", "splitleak.audit", "splitleak.experiments", "splitleak.cli")
    for path in Path(pkg.__path__[0]).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith(above), f"{path.name} imports {node.module}"
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith(above) for a in node.names), f"{path.name} imports {node.names}"


@pytest.mark.unit
@pytest.mark.parametrize(
    "defence, args, words",
    [
        ("replica-median", {}, "never crosses"),
        ("clip-noise", {"where": "backward"}, "only the returned gradient"),
    ],
)
def test_the_audit_says_why_no_attack_is_built_for_a_defence(defence, args, words):
    """Where a defence names no attack built for it in the run's split, the audit's sentence says why."""
    from splitleak.report.audit_prose import adaptive_sentence
    from splitleak.training.config import make_train_config

    cfg = make_train_config(model="tiny-gpt2", depth=1, defences=[{"name": defence, "args": args}])
    text = adaptive_sentence([], cfg)
    assert text.startswith(f"No attack built for {defence}") and "Why none applies here" in text and words in text
    quiet = make_train_config(model="tiny-gpt2", depth=1, defences=[{"name": "quant8", "args": {}}])
    assert "Why none applies" not in adaptive_sentence([], quiet)  # quant8 has its attacks: none ran here
