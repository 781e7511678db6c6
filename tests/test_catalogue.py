"""``splitleak defences``, ``splitleak attacks`` and the defence names in ``train --help``: each read from its
registry, so that an entry registered without another edit is listed (issue 34)."""

import pytest
from typer.testing import CliRunner

from splitleak.attacks.registry import REGISTRY, AttackInfo, register, unregister
from splitleak.cli import app
from splitleak.defences import DEFENCES, Defence, build_defence

runner = CliRunner()
WIDE = {"COLUMNS": "400"}  # one table row per line, so that a name is not wrapped across lines


class Halve(Defence):
    """A planted one-argument defence: scales the forward wire by ``factor``."""

    name = "planted-halve"
    adaptive_note = "planted for the listing test"

    def __init__(self, factor: float = 0.5):
        self.factor = factor

    def forward(self, x, ctx):
        return x * self.factor

    def args(self):
        return {"factor": self.factor}


@pytest.fixture
def planted_defence(monkeypatch):
    monkeypatch.setitem(DEFENCES, Halve.name, Halve)
    yield Halve.name


@pytest.mark.unit
@pytest.mark.parametrize("command", ["train", "audit", "tune"])
def test_help_names_every_registered_defence(command, planted_defence):
    r = runner.invoke(app, [command, "--help"], env=WIDE)
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    missing = [n for n in DEFENCES if n not in text]
    assert not missing, f"{command} --help does not name {missing}"
    assert "splitleak defences" in text


@pytest.mark.unit
def test_help_of_other_commands_does_not_load_the_defence_list():
    r = runner.invoke(app, ["verify", "--help"], env=WIDE)
    assert r.exit_code == 0 and "quant4-noisy" not in r.output


@pytest.mark.unit
def test_defences_lists_each_with_its_arguments_modes_and_attacks(planted_defence):
    r = runner.invoke(app, ["defences"], env=WIDE)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    for name, cls in DEFENCES.items():
        row = next((line for line in lines if line.split("│")[1:2] and line.split("│")[1].strip() == name), None)
        assert row is not None, f"{name} not listed"
        rest = "\n".join(lines[lines.index(row) : lines.index(row) + 12])
        for arg, default in build_defence(name).args().items():
            assert f"{arg}={default!r}" in rest, (name, arg)
        for attack in cls.adaptive:
            assert attack in rest, (name, attack)
    row = next(line for line in lines if "planted-halve" in line)
    assert "factor=0.5" in row and "client-forward" in row
    mixup = next(line for line in lines if line.split("│")[1:2] and line.split("│")[1].strip() == "mixup")
    assert "[0.3..0.95]" in mixup and "mixup-unmix" in mixup  # the tune range and the attack built for it


@pytest.mark.unit
def test_attacks_lists_the_registry_and_a_plugin():
    class Planted:
        def __init__(self, seed: int = 0, reach: int = 7):
            self.seed, self.reach = seed, reach

    register(AttackInfo("planted-lister", Planted, "planted: lists itself", reads=("gradients",), control=True))
    try:
        r = runner.invoke(app, ["attacks", "--wide"], env=WIDE)
    finally:
        unregister("planted-lister")
    assert r.exit_code == 0, r.output
    names = {line.split("│")[1].strip() for line in r.output.splitlines() if line.count("│") > 2}
    assert set(REGISTRY) | {"planted-lister"} <= names
    row = next(line for line in r.output.splitlines() if "planted-lister" in line)
    assert "gradients" in row and "control" in row and "reach=7" in row and "seed=" not in row
    sipit = next(
        line for line in r.output.splitlines() if line.split("│")[1:2] and line.split("│")[1].strip() == "sipit-aware"
    )
    assert "built for defences" in sipit
