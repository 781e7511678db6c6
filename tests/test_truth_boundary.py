"""The truth stays with the scorer, by construction, for the partition attacks on the decoy system's frames:
no ``fit`` takes the client's record of real rows; the learned rule fits on the attacker's own shadow frames;
every registered partition attack reads the same when that record is replaced by a permuted copy; and a
planted reader of the record is caught by the partition attacks' mis-paired negative control, which reads
exactly zero for the honest rules."""

from __future__ import annotations

import inspect
import shutil
import textwrap

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from splitleak.attacks import make_attack_config
from splitleak.attacks.registry import REGISTRY
from splitleak.audit.evaluate import run_attack
from splitleak.runs.truth import TRUTH_FILE

TINY = dict(model="tiny-gpt2", n_calib=2, n_train=8, n_eval=8, steps=8, lr=3e-4, capture_batch=4)


def _latent(**kw):
    return dict(split_after=0, resume_at=3, width=16, gauge_entropy="derived", **kw)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from splitleak.training.config import make_train_config
    from splitleak.training.run import run_training

    root = tmp_path_factory.mktemp("boundary")
    out = {}
    for name, extra in {"open": {}, "fix": {"output_gradient": "clip-noise"}}.items():
        cfg = make_train_config(**TINY, seed=5, latent=_latent(**extra))
        out[name] = run_training(cfg, root / name, device="cpu").run_dir
    return out


def partition_configs() -> list[tuple[str, dict]]:
    """Every registered partition attack of the latent mode, the support attack once per rule."""
    from splitleak.attacks.partition import RULES

    out = []
    for name, info in REGISTRY.items():
        if info.output == "partition" and "latent" in info.modes:
            out += [(name, {"rule": r}) for r in RULES] if name == "support-partition" else [(name, {})]
    return out


@pytest.mark.unit
def test_no_partition_attack_is_handed_the_record():
    """What ``fit`` can take is the attacker's: earlier frames, the public arguments, its own shadow frames."""
    names = [n for n, _ in partition_configs()]
    assert {"support-partition", "decoy-history", "gauge-key-search"} <= set(names)
    for name in set(names):
        params = list(inspect.signature(REGISTRY[name].load().fit).parameters)
        assert params == ["self", "history", "public", "shadow"], (name, params)


@pytest.mark.integration
def test_without_decoys_the_classifier_calls_every_row_real(tmp_path):
    """The naked control sends no decoy, as its public arguments say: the attacker's own frames hold real rows
    only, and the classifier calls every row of every frame real (exactly the record), with no fault."""
    from splitleak.training.config import make_train_config
    from splitleak.training.run import run_training

    cfg = make_train_config(**TINY, seed=2, latent=_latent(sigma=0.0, decoys=0, gauges=False))
    run = run_training(cfg, tmp_path / "naked", device="cpu").run_dir
    res = run_attack(run, make_attack_config(attack="support-partition", params={"rule": "classifier"}))
    p = res["partition"]
    assert p["frames_exact"] == p["frames"] == 8 and p["real_row_share"] == 1.0 and p["auc"] is None


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_the_classifier_learns_the_open_partition_from_its_own_shadow_frames(runs, seed):
    """With the output gradient open a decoy row's gradient is exactly zero, in the attacker's own frames as
    in the victim's: fitted on its shadow frames alone, the classifier separates the victim's rows."""
    res = run_attack(
        runs["open"],
        make_attack_config(attack="support-partition", attack_seed=seed, params={"rule": "classifier"}),
        control_docs=8,
    )
    assert res["shadow"] == {"documents": 2, "train_frames": 8, "capture_frames": 2, "steps": 8}
    assert res["partition"]["auc"] > 0.99 and res["partition"]["row_agreement"] > 0.95, res["partition"]
    assert res["control"]["per_doc_delta"] == [0.0] * 8 and res["control"]["verdict"] == "at floor"


def _permute_record(run_dir, dest, seed):
    """A copy of the run whose client record has each frame's rows permuted (real mask and tokens alike)."""
    shutil.copytree(run_dir, dest)
    t = load_file(str(dest / TRUTH_FILE))
    rng = np.random.default_rng(seed)
    real, tokens = t["real"].clone(), t["token"].clone()
    for i, n in enumerate(t["frames"][:, 4].tolist()):
        p = torch.from_numpy(rng.permutation(n))
        real[i, :n], tokens[i, :n] = real[i, :n][p], tokens[i, :n][p]
    save_file({**t, "real": real.contiguous(), "token": tokens.contiguous()}, str(dest / TRUTH_FILE))
    return dest


#: a small battery: what the permuted-record test needs is its predictions, not its power
SMALL_BATTERY = {"views": "forward,real-rows,joint", "models": "mlp", "restarts": 1, "epochs": 3, "control": False}


def latent_configs() -> list[tuple[str, dict]]:
    """Every registered latent attack that may reach a verdict: the partition attacks, and the probe battery
    under each threat model but the oracle (which reads the record by definition and gives no verdict)."""
    from splitleak.attacks.probes import THREATS

    probes = [
        (name, {**SMALL_BATTERY, "threat": t})
        for name, info in REGISTRY.items()
        if info.output == "row-tokens" and "latent" in info.modes
        for t in THREATS
        if t != "oracle"
    ]
    assert probes, "no probe battery registered"
    return partition_configs() + probes


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_every_latent_attack_reads_the_same_with_a_permuted_record(runs, tmp_path, seed):
    """The record is replaced by a permuted copy (read without verifying, as its hash no longer matches): each
    partition attack calls the same rows real and each battery names the same tokens, and the scores move,
    so the copy did reach the scorer. The oracle battery, which reads the record, names other tokens."""
    moved = set()
    for arm in ("open", "fix"):
        permuted = _permute_record(runs[arm], tmp_path / arm, seed)
        for name, params in latent_configs() + [("latent-probe", {**SMALL_BATTERY, "threat": "oracle"})]:
            cfg = make_attack_config(attack=name, attack_seed=seed, params=params)
            a = run_attack(runs[arm], cfg, verify=False)
            b = run_attack(permuted, cfg, verify=False)
            same = [r["predicted"] for r in a["per_doc"]] == [r["predicted"] for r in b["per_doc"]]
            assert same is (params.get("threat") != "oracle"), (arm, name, params)
            if "partition" in a:
                moved.add(a["partition"]["row_agreement"] != b["partition"]["row_agreement"])
            else:
                moved.add([r["paired_delta"] for r in a["per_doc"]] != [r["paired_delta"] for r in b["per_doc"]])
    assert True in moved


@pytest.mark.unit
def test_every_latent_attack_is_checked_blind_or_is_the_dose_ladder():
    """A latent attack added to the registry is either in the permuted-record check above (a reader of the wires
    alone) or is the dose ladder, which plants its leak with the record by definition and says so (below)."""
    checked = {name for name, _ in latent_configs()}
    for name, info in REGISTRY.items():
        if "latent" in info.modes:
            assert name in checked or info.output == "dose", name


@pytest.mark.integration
def test_the_dose_ladder_reads_the_record_and_labels_itself_an_oracle(runs, tmp_path):
    permuted = _permute_record(runs["open"], tmp_path / "open", 0)
    cfg = make_attack_config(attack="dose-ladder", params={"doses": "coverage", "models": "mlp", "epochs": 3})
    a, b = run_attack(runs["open"], cfg, verify=False), run_attack(permuted, cfg, verify=False)
    assert [r["paired_delta"] for r in a["per_doc"]] != [r["paired_delta"] for r in b["per_doc"]]
    assert (
        a["learnt_from"]["threat"] == "oracle"
        and "never what the traffic gives away" in a["learnt_from"]["upper_bound"]
    )


PLANTED = textwrap.dedent(
    """
    from pathlib import Path

    import numpy as np
    from safetensors.torch import load_file

    from splitleak.attacks.partition import LatentPartition
    from splitleak.attacks.registry import AttackInfo, register


    class ReadsTheRecord(LatentPartition):
        \"\"\"Planted: the client's record of real rows, read by frame id from every run under ``root`` (what a
        partition attack must never reach).\"\"\"

        name = "reads-the-record"

        def __init__(self, root: str = ".", seed: int = 0):
            self.root, self.seed = root, seed

        def params(self):
            return {"root": self.root, "seed": self.seed}

        def channels_read(self):
            return ("output-gradient",)

        def partition(self, traffic):
            real = {}
            for path in Path(self.root).rglob("truth.safetensors"):
                t = load_file(str(path))
                for f, r in zip(t["frames"].numpy(), t["real"].numpy()):
                    real[int(f[0])] = r[: int(f[4])].astype(bool)
            return [(real[f.frame_id].astype(float), real[f.frame_id]) for f in traffic.frames]


    register(
        AttackInfo(
            "reads-the-record", ReadsTheRecord, "planted: reads the real rows", reads=("output-gradient",),
            output="partition", modes=("latent",),
        )
    )
    """
)


@pytest.fixture
def planted(plant):
    return plant("planted_record", PLANTED, "reads-the-record")


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 2])
def test_the_mispaired_control_catches_a_reader_of_the_record_and_not_the_rules(planted, runs, seed):
    """Alone the planted reader looks like a perfect partition; its twin, given other frames' wires under
    each frame's header, still reads the frame it is labelled as: N detected, an instrument fault. The rules
    read each frame's wires, so their twins read exactly what the arm read of the same wires: N = 0."""
    run = runs["fix"]
    cheat = run_attack(
        run,
        make_attack_config(attack="reads-the-record", attack_seed=seed, params={"root": str(run)}),
        control_docs=8,
    )
    assert cheat["partition"]["frames_exact"] == cheat["partition"]["frames"] == 8
    c = cheat["control"]
    assert len(c["doc_ids"]) == 8 and all(a != b for a, b in zip(c["doc_ids"], c["given_doc_ids"]))
    assert c["verdict"] == "detected" and c["instrument_fault"] and c["effect"]["low"] > 0.2, c
    for rule in ("support", "norm", "classifier"):
        res = run_attack(
            run,
            make_attack_config(attack="support-partition", attack_seed=seed, params={"rule": rule}),
            control_docs=8,
        )
        assert res["control"]["per_doc_delta"] == [0.0] * 8 and not res["control"]["instrument_fault"], rule
    # the attacks built for the decoys and gauges read other frames and the headers' keys; their twins read
    # nothing the arm did not (the key search reads every frame exactly here: derived keys)
    for name in ("decoy-history", "gauge-key-search"):
        res = run_attack(run, make_attack_config(attack=name, attack_seed=seed), control_docs=8)
        assert res["control"]["verdict"] != "detected" and not res["control"]["instrument_fault"], name
    assert run_attack(run, make_attack_config(attack="gauge-key-search"))["partition"]["frames_exact"] == 8
    assert "control" not in run_attack(run, make_attack_config(attack="support-partition"))  # only when asked


PLANTED_PROBE = textwrap.dedent(
    """
    from pathlib import Path

    from safetensors.torch import load_file

    from splitleak.attacks.probes import ArmPredictions, ProbeBattery
    from splitleak.attacks.registry import AttackInfo, register


    class ReadsTheTokens(ProbeBattery):
        \"\"\"Planted: names every evaluation row's token from the client's record under ``ROOT`` (what a
        battery must never reach), whatever it was trained on.\"\"\"

        name = "reads-the-tokens"
        ROOT = "."

        def run(self, train, evaluation, tokens, real, taken=None):
            rec = {}
            for path in Path(self.ROOT).rglob("truth.safetensors"):
                t = load_file(str(path))
                for f, row in zip(t["frames"].numpy(), t["token"].numpy()):
                    rec[int(f[0])] = row[: int(f[4])]
            preds = [rec[f.frame_id] for f in evaluation.frames]
            return [
                ArmPredictions(v, m, r, preds, 100, 0.0)
                for v in self.views for m in self.models for r in range(self.restarts)
            ]


    register(
        AttackInfo(
            "reads-the-tokens", ReadsTheTokens, "planted: reads the tokens", reads=("activations",),
            output="row-tokens", modes=("latent",),
        )
    )
    """
)


@pytest.fixture
def planted_probe(plant):
    return plant("planted_tokens", PLANTED_PROBE, "reads-the-tokens")


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 3])
def test_the_shuffled_twin_catches_a_battery_that_reads_the_record(planted_probe, runs, seed):
    """The planted battery names every real row right; so does its twin, trained on shuffled labels but
    scored against the true ones: detected, an instrument fault. An honest battery's twin reads at floor."""
    planted_probe.ReadsTheTokens.ROOT = str(runs["open"])
    params = {"views": "real-rows,gradient", "models": "mlp", "restarts": 1, "epochs": 3}
    cheat = run_attack(runs["open"], make_attack_config(attack="reads-the-tokens", attack_seed=seed, params=params))
    p = cheat["probes"]
    assert p["verdict"]["verdict"] == "detected" and all(a["accuracy"] == 1.0 for a in p["arms"])
    assert p["instrument_fault"] and p["negative_control"]["detected_in"] == ["real-rows", "gradient"]
    honest = run_attack(runs["open"], make_attack_config(attack="latent-probe", attack_seed=seed, params=params))
    assert not honest["probes"]["instrument_fault"] and honest["probes"]["negative_control"]["detected_in"] == []
