"""SIP, the learned inverter (003 App. C.2): a GRU over the frozen Bottom's activations, trained on the
observer's public text."""

from __future__ import annotations

import pytest
import torch

from splitleak.attacks import make_attack_config
from splitleak.attacks.knowledge import load_knowledge, load_traffic
from splitleak.attacks.sip import SipGRU
from splitleak.audit.evaluate import run_attack
from splitleak.errors import ConfigError
from splitleak.training import make_train_config, run_training


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_sip_gru_reads_the_activations_of_a_split_and_of_a_label_shielded_run(tmp_path, seed):
    common = dict(model="tiny-gpt2", n_calib=64, n_train=4, n_eval=16, seed=seed, data_seed=seed)
    runs = {
        "plain": make_train_config(**common, depth=1),
        "shielded": make_train_config(**common, shielded={"bottom": 1, "top": 1}),
    }
    for name, cfg in runs.items():
        run_training(cfg, tmp_path / name, device="cpu")
        sip = run_attack(tmp_path / name, make_attack_config(attack="sip-gru", attack_seed=seed))
        ctl = run_attack(tmp_path / name, make_attack_config(attack="majority"))
        # one block in, the activations still name their tokens: the GRU reads most of them back
        assert sip["token_recovery"] > 0.8 and sip["token_recovery"] > ctl["token_recovery"] + 0.5, name
        assert sip["channels_read"] == ["activations"]


@pytest.mark.integration
def test_sip_gru_is_deterministic_leaves_the_global_generator_and_refuses_bad_arguments(tmp_path):
    run_training(
        make_train_config(model="tiny-gpt2", depth=2, n_calib=8, n_train=2, n_eval=4), tmp_path / "r", device="cpu"
    )
    knowledge, traffic = load_knowledge(tmp_path / "r"), load_traffic(tmp_path / "r")
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    a = SipGRU(hidden=16, epochs=3, seed=4).fit(knowledge).reconstruct(traffic)
    assert torch.equal(torch.random.get_rng_state(), state)
    b = SipGRU(hidden=16, epochs=3, seed=4).fit(knowledge).reconstruct(traffic)
    c = SipGRU(hidden=16, epochs=3, seed=5).fit(knowledge)
    assert torch.equal(a.tokens, b.tokens) and a.extra["train_loss"] == b.extra["train_loss"]
    assert c.losses_ != a.extra["train_loss"]
    assert len(a.extra["train_loss"]) == 3 and a.extra["train_loss"][-1] < a.extra["train_loss"][0]
    for bad, msg in (({"hidden": 0}, "hidden must be an integer >= 1"), ({"lr": "x"}, "lr must be a number")):
        with pytest.raises(ConfigError, match=msg):
            SipGRU(**bad)
