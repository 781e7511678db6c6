"""Local grid workers are forked from a fork server that imported torch, transformers and the attacks once
(``executors.worker_context``), and still run as a spawned worker would: in the environment, working folder and
import path the driver had when it made the pool, not those of the moment the server started."""

import json
import os
import shutil
import sys
import textwrap

import pytest

#: a plug-in attack that records where it ran and reads nothing
WHERE = textwrap.dedent(
    """
    import json, os, sys

    import torch

    from splitleak.attacks import Attack, Reconstruction
    from splitleak.attacks.registry import AttackInfo, register

    PRELOADED = "transformers" in sys.modules  # before any job of this worker imported it


    class WhereItRan(Attack):
        name = "where-it-ran"

        def __init__(self, out: str = "where.json", seed: int = 0):
            self.out, self.seed = out, seed

        def params(self):
            return {"out": self.out, "seed": self.seed}

        def reconstruct(self, traffic, progress=None):
            record = {"mark": os.environ.get("SPLITLEAK_TEST_MARK"), "cwd": os.getcwd(), "ppid": os.getppid(),
                      "preloaded": PRELOADED}
            with open(self.out, "w") as f:
                json.dump(record, f)
            return Reconstruction(torch.zeros(len(traffic), traffic.activations.shape[1], dtype=torch.long))


    register(AttackInfo("where-it-ran", WhereItRan, "test: records where it ran", reads=()))
    """
)

GRID = """\
name: where
protocol: proto.yaml
model: tiny-gpt2
depths: [2]
defences: [none]
victim_seeds: [1]
attack_seeds: [0]
client_copies: [public]
documents: {n_calib: 8, n_train: 4, n_eval: 4, doc_len: 8}
steps: 2
attacks:
"""


@pytest.mark.e2e
def test_a_forked_worker_runs_in_the_driver_s_environment_folder_and_import_path(plant, tmp_path, monkeypatch):
    from splitleak.audit.protocol import SHIPPED
    from splitleak.experiments import run_grid
    from splitleak.experiments.executors import worker_context

    shutil.copy(SHIPPED / "paper_main.yaml", tmp_path / "proto.yaml")
    first = tmp_path / "first.yaml"
    first.write_text(GRID + "  - {attack: vmi}\n")
    # the first grid starts the fork server (unless this process already has one), before any of what follows
    assert run_grid(first, store=tmp_path / "s1", workers=1, threads=1, device="cpu").ok
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.setenv("SPLITLEAK_TEST_MARK", "set after the server started")
    monkeypatch.chdir(here)
    plant("where_it_ran", WHERE, "where-it-ran")  # a folder added to sys.path, and SPLITLEAK_PLUGINS
    second = tmp_path / "second.yaml"
    second.write_text(GRID + "  - {attack: where-it-ran, params: {out: where.json}}\n")
    res = run_grid(second, store=tmp_path / "s2", workers=1, threads=1, device="cpu")
    assert res.ok, res.failures
    record = json.loads((here / "where.json").read_text())  # a relative path, read in the driver's folder
    assert record["mark"] == "set after the server started" and record["cwd"] == str(here)
    if worker_context().get_start_method() == "forkserver":
        assert record["ppid"] != os.getpid() and record["preloaded"]  # forked from the server, torch imported there
    else:  # spawn: a child of the driver that imports everything itself
        assert record["ppid"] == os.getpid() and sys.platform != "linux"
