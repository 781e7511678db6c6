"""Adding an attack with a hyperparameter nobody has seen: one class, one registry entry, nothing
else — its parameter travels through the configuration, the job keys, a spec and the store."""

import json

import pytest
import torch

from splitleak.attacks import Attack, Reconstruction, make_attack_config
from splitleak.attacks.registry import AttackInfo, register, unregister
from splitleak.audit.evaluate import run_attack
from splitleak.errors import ConfigError
from splitleak.training import make_train_config, run_training


class RollingMajority(Attack):
    """A toy control: the calibration documents' most frequent token at each position, rolled by
    ``shift`` positions (``shift=0`` is the majority control)."""

    name = "rolling-majority"

    def __init__(self, shift: int = 0, seed: int = 0):
        if not isinstance(shift, int):
            raise ConfigError(f"rolling-majority: shift must be an integer, got {shift!r}")
        self.shift, self.seed = shift, seed

    def params(self):
        return {"shift": self.shift, "seed": self.seed}

    def fit(self, knowledge):
        super().fit(knowledge)
        ids = knowledge.calibration_ids()
        self.tokens_ = torch.mode(ids, dim=0).values.roll(self.shift)
        return self

    def reconstruct(self, traffic, progress=None):
        self._check(traffic)
        return Reconstruction(self.tokens_[: traffic.activations.shape[1]].repeat(len(traffic), 1))


@pytest.fixture
def toy():
    register(
        AttackInfo("rolling-majority", RollingMajority, "toy: the majority control, rolled", reads=(), control=True)
    )
    yield
    unregister("rolling-majority")


@pytest.mark.integration
def test_a_new_attack_and_its_hyperparameter_travel_everywhere(toy, tmp_path):
    run = tmp_path / "run"
    run_training(
        make_train_config(model="tiny-gpt2", depth=2, n_calib=8, n_train=4, n_eval=6, seed=0, all_local_baseline=False),
        run,
        device="cpu",
    )
    a, b = (make_attack_config(attack="rolling-majority", params={"shift": s}) for s in (0, 3))
    assert a.hash() != b.hash() and b.model_dump(mode="json")["params"] == {"shift": 3}
    assert make_attack_config(**b.model_dump(mode="json")).hash() == b.hash()
    ra, rb = run_attack(run, a), run_attack(run, b)
    assert rb["attack_params"] == {"shift": 3, "seed": 0}
    assert [r["predicted"] for r in rb["per_doc"]][0] == list(torch.tensor(ra["per_doc"][0]["predicted"]).roll(3))
    with pytest.raises(ConfigError, match=r"does not take \['width'\]; it takes \['seed', 'shift'\]"):
        make_attack_config(attack="rolling-majority", params={"width": 2})
    with pytest.raises(ConfigError, match="shift must be an integer"):
        make_attack_config(attack="rolling-majority", params={"shift": "two"})


@pytest.mark.unit
def test_a_spec_expands_any_attack_parameter(toy):
    from splitleak.experiments.jobs import _attack_configs, _attack_fields
    from splitleak.experiments.spec import AttackEntry, ExperimentSpec

    spec = ExperimentSpec(protocol="p.yaml", models=["tiny-gpt2"], victim_seeds=[1], depths=[2])
    entry = AttackEntry(attack="rolling-majority", params={"shift": [1, 2, 5]})
    configs = _attack_configs(entry, spec, 0)
    assert [c["params"] for c, _, _ in configs] == [{"shift": 1}, {"shift": 2}, {"shift": 5}]
    fields = _attack_fields(configs[1][0], "none")
    assert json.loads(fields["params"]) == {"shift": 2}
    with pytest.raises(ConfigError, match="attacks\\[0\\] \\(rolling-majority\\).*does not take"):
        _attack_configs(AttackEntry(attack="rolling-majority", params={"shfit": 1}), spec, 0)
    with pytest.raises(ConfigError, match="give k on the attack line"):
        _attack_configs(AttackEntry(attack="activation", params={"k": 8}), spec, 0)
