"""Every channel declared and listed; mixup measured on what crosses; the U-shape's second crossing
and the training steps attackable."""

import json

import pytest
import torch
from typer.testing import CliRunner

from splitleak.attacks import load_knowledge, load_traffic, make_attack, make_attack_config
from splitleak.attacks.mixup_unmix import MixupUnmix
from splitleak.audit.channels import channel_table
from splitleak.audit.evaluate import run_attack
from splitleak.cli import app
from splitleak.errors import ConfigError
from splitleak.training import make_train_config, run_training

runner = CliRunner()
BASE = dict(model="tiny-gpt2", n_calib=16, n_train=12, n_eval=24, all_local_baseline=False)


def _train(path, seed=1, defences=None, draws="os", **split):
    split = split or {"depth": 2}
    config = make_train_config(**BASE, seed=seed, defences=defences or [{"name": "none"}], draws=draws, **split)
    run_training(config, path, device="cpu")
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("channels")
    return {
        "none": _train(root / "none"),
        "mixup": _train(root / "mixup", defences=[{"name": "mixup"}]),
        "cached": _train(root / "cached", defences=[{"name": "mixup", "args": {"correction": "cached"}}]),
        "u": _train(root / "u", offload_start=1, offload_length=2),
    }


@pytest.mark.integration
@pytest.mark.parametrize("lam,seed", [(0.75, 1), (0.6, 4)])
def test_probe_rows_undo_mixup_exactly(tmp_path, lam, seed):
    """With the probe rows that cross, the mixed rows unmix to the trained client's own activations
    of the evaluation documents; λ is estimated from the traffic alone."""
    # draws keyed by the seed: under the default "os" the decoys are fresh entropy, and the estimate's error
    # (about 0.01 at these sizes) would vary from run to run; here each parameter is one reproducible draw
    run = _train(tmp_path / "r", seed=seed, defences=[{"name": "mixup", "args": {"lambda": lam}}], draws="derived")
    traffic = load_traffic(run)
    kn = load_knowledge(run, "trained")
    attack = MixupUnmix(k=4).fit(kn)
    ids = torch.tensor([list(d.token_ids) for d in _eval_docs(run, traffic.doc_ids)])
    clean = kn.client.activations(ids)
    assert not torch.allclose(traffic.activations, clean, atol=1e-2)  # what crossed is mixed
    assert torch.allclose(attack.unmix(traffic, lam).activations, clean, atol=1e-4)
    assert attack.estimate_lambda(traffic) == pytest.approx(lam, abs=0.01)


def _eval_docs(run, doc_ids):
    from splitleak.runs.truth import phase_documents

    by_id = {d.doc_id: d for d in phase_documents(run, "capture")}
    return [by_id[i] for i in doc_ids]


@pytest.mark.integration
def test_mixup_unmix_reads_what_the_undefended_run_gives(runs):
    plain = run_attack(runs["none"], make_attack_config(attack="activation", k=8))
    unmixed = run_attack(runs["mixup"], make_attack_config(attack="mixup-unmix", k=8))
    assert unmixed["token_recovery"] >= plain["token_recovery"] - 0.01
    assert unmixed["channels_read"] == ["activations", "probe-activations"]
    assert 0.7 < unmixed["lambda"] < 0.8 and unmixed["lambda_estimated"]
    # the probe rows are clean rows of earlier training documents: read row by row, and scored against
    # the client's own record of where each decoy came from
    probe = unmixed["probe_rows"]
    assert probe["scored"] and probe["rows"] == 24 * 32 and probe["token_recovery"] > 0.9
    assert 0.3 < probe["training_token_share"] <= 1.0


@pytest.mark.integration
def test_mixup_unmix_needs_probe_rows(runs):
    with pytest.raises(ConfigError, match="correction=cached or none"):
        run_attack(runs["cached"], make_attack_config(attack="mixup-unmix", k=8))
    with pytest.raises(ConfigError, match="no mixup"):
        run_attack(runs["none"], make_attack_config(attack="mixup-unmix", k=8))


@pytest.mark.integration
def test_channels_of_a_mixup_run_and_a_u_shape_run(runs):
    rows = {r["channel"]: r for r in channel_table(runs["mixup"])}
    assert set(rows) == {
        "activations",
        "gradient",
        "row-ids",
        "shapes",
        "timing",
        "labels",
        "probe-activations",
        "probe-gradient",
        "meta:probe_rows",
    }
    assert all(r["captured"] for name, r in rows.items() if name != "timing") and not rows["timing"]["captured"]
    assert rows["probe-activations"]["shape"] == {"train": [1, 32, 64], "capture": [16, 32, 64]}
    assert rows["probe-activations"]["rows"] == {"train": 12 - 4, "capture": 24}  # after 4 unmixed warm-up steps
    assert "mixup-unmix" in rows["probe-activations"]["read_by"]
    # the labels are the text itself: the server reads them with no attack
    assert rows["labels"]["status"] == "in clear" and rows["activations"]["status"] == "not measured"
    u = {r["channel"]: r for r in channel_table(runs["u"])}
    assert {"trunk-output", "output-gradient"} <= set(u) and "labels" not in u
    assert u["trunk-output"]["captured"] and u["output-gradient"]["rows"] == {"train": 12, "capture": 24}
    assert {"joint", "backward-only"} <= set(u["output-gradient"]["read_by"])
    assert u["trunk-output"]["status"] == "no attack"
    r = runner.invoke(app, ["channels", str(runs["u"]), "--json"])
    assert r.exit_code == 0, r.output
    assert {c["channel"] for c in json.loads(r.output)["channels"]} == set(u)
    r = runner.invoke(app, ["channels", str(runs["mixup"])])
    assert r.exit_code == 0 and "probe-activations" in r.output and "unmixed" in r.output


@pytest.mark.integration
def test_joint_and_backward_only_read_the_output_gradient_of_a_u_shape(runs):
    cfg = make_attack_config(attack="backward-only", gradient_source="output")
    out = run_attack(runs["u"], cfg)
    split = run_attack(runs["u"], make_attack_config(attack="backward-only"))
    assert out["channels_read"] == ["output-gradient"] and split["channels_read"] == ["gradient"]
    assert out["token_recovery"] > 0.5 and split["token_recovery"] > 0.5
    # which gradient it reads: scramble the one at the observation point, and only the split read-out moves
    tr = load_traffic(runs["u"])
    scrambled = tr.replace(gradients=torch.randn(tr.gradients.shape, generator=torch.Generator().manual_seed(0)))
    assert run_attack(runs["u"], cfg, traffic=scrambled)["token_recovery"] == out["token_recovery"]
    assert run_attack(runs["u"], make_attack_config(attack="backward-only"), traffic=scrambled)["token_recovery"] < 0.2
    joint = run_attack(runs["u"], make_attack_config(attack="joint", k=4, gradient_source="output"))
    assert joint["channels_read"] == ["activations", "output-gradient"]
    with pytest.raises(ConfigError, match="output gradient"):
        run_attack(runs["none"], cfg)
    with pytest.raises(ConfigError, match="no gradient source"):
        make_attack_config(attack="vmi", gradient_source="output")


@pytest.mark.unit
def test_new_attack_fields_leave_existing_keys_alone():
    a = make_attack_config(attack="joint", k=32)
    b = make_attack_config(attack="joint", k=32, gradient_source="split", phase="capture")
    assert a.hash() == b.hash()
    assert set(a.model_dump(mode="json")) == {
        "attack",
        "k",
        "client_copy",
        "budget",
        "attack_seed",
        "gradient_noise",
        "gradient_bits",
        "inference",
        "readout",
    }
    assert make_attack_config(attack="joint", k=32, phase="train").hash() != a.hash()


@pytest.mark.integration
def test_attack_reads_the_training_steps(runs):
    res = run_attack(runs["none"], make_attack_config(attack="vmi", client_copy="trained", phase="train"))
    order = json.loads((runs["none"] / "training.json").read_text())["doc_ids"]
    assert res["phase"] == "train" and res["n_docs"] == 12
    assert [r["doc_id"] for r in res["per_doc"]] == order and [r["step"] for r in res["per_doc"]] == list(range(12))
    assert res["token_recovery"] > 0.9 and "after as many training steps" in res["weights"]
    r = runner.invoke(
        app, ["attack", str(runs["none"]), "--attack", "majority", "--phase", "training", "--out", "x.json"]
    )
    assert r.exit_code == 2 and "phase" in r.output


@pytest.mark.unit
def test_registered_attacks_declare_what_they_read():
    assert make_attack("vmi").channels_read() == ("activations",)
    assert make_attack("majority").channels_read() == ()
    assert make_attack("joint").channels_read() == ("activations", "gradient")
    assert make_attack("mixup-unmix").channels_read() == ("activations", "probe-activations")
