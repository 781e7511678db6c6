"""The truth boundary of the token family: every registered attack that reads a plain split's traffic and names
tokens reads the same when the evaluation documents' tokens the scorer holds are replaced by a permuted copy, and
the scores move, so the copy did reach the scorer (the latent family's is in tests/test_truth_boundary.py)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from splitleak.attacks import make_attack_config
from splitleak.attacks.registry import REGISTRY
from splitleak.audit.evaluate import run_attack

BASE = dict(model="tiny-gpt2", depth=2, n_calib=8, n_train=4, n_eval=6, all_local_baseline=False, draws="derived")
#: small settings: what is tested is each attack's output, not its power
PARAMS = {
    "activation": {"k": 4},
    "joint": {"k": 4},
    "shuffled-gradient": {"k": 4},
    "random-candidate": {"k": 4},
    "joint-adaptive": {"k": 4},
    "sipit": {"budget": 4},
    "sipit-aware": {"budget": 4},
    "activation-aware": {"k": 4},
    "joint-aware": {"k": 4},
    "seed-search": {"budget": 4, "seeds": 4},
    "mixup-unmix": {"k": 4},
    "mixup-history": {"k": 4},
    "sip-gru": {"epochs": 1},
    "refit": {"rounds": 1, "steps": 2, "k": 4, "budget": 4},
    "bisr-f": {"sip_epochs": 1, "f_steps": 2},
}


def token_attacks() -> list[str]:
    return [n for n, a in REGISTRY.items() if a.output == "tokens" and "plain" in a.modes]


def _permuted(run_dir, dest, seed, documents="evaluation"):
    """A copy of the run whose ``documents`` set's tokens (evaluation or train) are permuted within each document
    (read without verifying: the record's hash no longer matches)."""
    shutil.copytree(run_dir, dest)
    path = dest / "documents.json"
    docs = json.loads(path.read_text())
    rng = np.random.default_rng(seed)
    for d in docs[documents]:
        d["token_ids"] = [int(t) for t in rng.permutation(d["token_ids"])]
    path.write_text(json.dumps(docs))
    return dest


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_every_token_attack_reads_the_same_with_permuted_evaluation_tokens(shared_run, tmp_path, seed):
    runs = {
        "plain": shared_run(**BASE, seed=seed, defences=[{"name": "clip-noise", "args": {"clip": 1.0, "sigma": 0.01}}]),
        "mixup": shared_run(**BASE, seed=seed, defences=[{"name": "mixup", "args": {"lambda": 0.5, "warmup": 1}}]),
    }
    permuted = {k: _permuted(v, tmp_path / k, seed) for k, v in runs.items()}
    names = token_attacks()
    assert {"vmi", "activation", "joint", "sipit", "sipit-aware", "joint-aware", "mixup-unmix"} <= set(names)
    moved = []
    for name in names:
        which = "mixup" if name.startswith("mixup") else "plain"
        cfg = make_attack_config(attack=name, attack_seed=seed, params=PARAMS.get(name, {}))
        a = run_attack(runs[which], cfg, verify=False)
        b = run_attack(permuted[which], cfg, verify=False)
        assert [r["predicted"] for r in a["per_doc"]] == [r["predicted"] for r in b["per_doc"]], name
        moved.append(a["token_recovery"] != b["token_recovery"])
    assert sum(moved) >= len(names) - 2, dict(zip(names, moved))  # the majority guess may score alike


SHIELDED = dict(model="tiny-gpt2", n_calib=4, n_train=6, n_eval=6, doc_len=32, lr=1e-3, data="instructions")
#: the label-shielded attacks at small settings
SHIELDED_PARAMS = {
    "gma-sl": {"steps": 20},
    "gma-sl-aware": {"steps": 20},
    "gma-sl-crossings": {"steps": 20},
    "bisr-b": {"sip_epochs": 1, "b_steps": 2},
    "bisr": {"sip_epochs": 1, "b_steps": 2, "f_steps": 2},
}


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_every_label_attack_reads_the_same_with_permuted_evaluation_tokens(shared_run, tmp_path, seed):
    """The label family's truth boundary: the attacks of a label-shielded run (GMA-SL, its aware variant, BiSR)
    read the same labels and tokens when the evaluation documents' tokens are permuted, and the scores move."""
    names = [n for n, a in REGISTRY.items() if "label-shielded" in a.modes and "plain" not in a.modes]
    assert set(names) == set(SHIELDED_PARAMS), names
    run = shared_run(**SHIELDED, shielded={"bottom": 1, "top": 1}, seed=seed, data_seed=seed, capture_batch=3)
    permuted = _permuted(run, tmp_path / "p", seed)
    moved = []
    for name in names:
        cfg = make_attack_config(attack=name, attack_seed=seed, params=SHIELDED_PARAMS[name])
        a = run_attack(run, cfg, verify=False)
        b = run_attack(permuted, cfg, verify=False)
        assert [r["predicted"] for r in a["per_doc"]] == [r["predicted"] for r in b["per_doc"]], name
        moved.append(a["token_recovery"] != b["token_recovery"])
    assert all(moved), dict(zip(names, moved))


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_the_readers_of_every_pass_read_the_same_with_permuted_training_tokens(shared_run, tmp_path, monkeypatch, seed):
    """The truth boundary of the training traffic: every reader of every crossing (``AttackInfo.passes``) reads the
    same crossings when the training documents' tokens the scorer holds are permuted, and the score moves. The
    check can fail: a planted reader that takes the training tokens from the run's documents reads differently."""
    from splitleak.attacks.base import Reconstruction
    from splitleak.attacks.crossings import CrossingsAware

    passes = [n for n, a in REGISTRY.items() if a.passes and "plain" in a.modes]
    assert passes == ["crossings-aware", "joint-crossings"]
    spec = [{"name": "clip-noise", "args": {"clip": 0.1, "sigma": 0.3, "where": "both"}}]
    run = shared_run(**{**BASE, "steps": 3 * BASE["n_train"]}, seed=seed, defences=spec)
    permuted = _permuted(run, tmp_path / "p", seed, "train")
    for name in passes:
        c = make_attack_config(attack=name, attack_seed=seed, params={"k": 4}, phase="train")
        a, b = run_attack(run, c, verify=False), run_attack(permuted, c, verify=False)
        assert len(a["per_doc"]) == 3 * BASE["n_train"]
        assert [r["predicted"] for r in a["per_doc"]] == [r["predicted"] for r in b["per_doc"]], name
        assert a["token_recovery"] != b["token_recovery"]
    cfg = make_attack_config(attack="crossings-aware", attack_seed=seed, params={"k": 4}, phase="train")

    reading = {}  # the run the planted reader is pointed at

    def reads_the_truth(self, traffic, progress=None):  # planted: the training tokens from the run's own record
        record = json.loads((reading["run"] / "documents.json").read_text())["train"]
        docs = {d["doc_id"]: d["token_ids"] for d in record}
        return Reconstruction(torch.tensor([docs[i] for i in traffic.doc_ids]))

    monkeypatch.setattr(CrossingsAware, "reconstruct", reads_the_truth)
    out = []
    for where in (run, permuted):
        reading["run"] = where
        out.append([r["predicted"] for r in run_attack(where, cfg, verify=False)["per_doc"]])
    assert out[0] != out[1]
    # and its mis-paired twin over every crossing catches it: given another document's crossings under this one's
    # id, it reads this one's tokens (the honest readers above read the crossings, whatever the id)
    reading["run"] = run
    caught = run_attack(run, cfg, verify=False, control_docs=4)["control"]
    assert caught["verdict"] == "detected" and caught["effect"]["estimate"] > 0.5, caught
    honest = run_attack(run, make_attack_config(attack="activation-aware", attack_seed=seed, params={"k": 4},
                                                phase="train"), verify=False, control_docs=4)["control"]  # fmt: skip
    assert honest["verdict"] != "detected" and len(honest["doc_ids"]) == 4
