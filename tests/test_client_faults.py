"""A client run ends closed whatever raises, and a client killed mid-training resumes (issue 33).

- a fault in any stage of ``run_training`` (an error, Ctrl-C, a full disk, a server that fails at
  ``close``) closes the run as failed, its closing entry naming the stage, the training steps done and the
  cause; what was written before stays;
- ``splitleak train --connect`` SIGKILLed at step k leaves a run with no closing entry; ``train --resume``
  continues it from its last checkpoint on both sides, to the result of an uninterrupted run: the same client
  layers, server layers, losses per step and capture pass; the server's checkpoints of that training are
  removed once the resumed session completes, and a second resume is refused in one line."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from served import REPO, ServeProcess, child_env, sessions_ended
from typer.testing import CliRunner

from splitleak.cli import app
from splitleak.runs.journal import journal_entries
from splitleak.runs.store import RunStore
from splitleak.runs.verify import verify_run
from splitleak.training import make_train_config, run_training
from splitleak.training.checkpoint import checkpoint_folder
from splitleak.wire.tls import init_tls
from splitleak.wire.transport import TransportError

pytestmark = pytest.mark.timeout(600)  # each test carries its tier: a kill and resume of whole runs is e2e
TINY = dict(model="tiny-gpt2", depth=2, n_calib=4, n_train=6, n_eval=6, seed=2, all_local_baseline=False)
runner = CliRunner()


def _closing(run: Path) -> dict:
    v = verify_run(run)
    assert v.ok and v.status == "failed", v.message
    last = journal_entries(run)[-1]
    assert last["kind"] == "failed"
    return last["info"]


def _kinds(run: Path) -> list[str]:
    return [e["kind"] for e in journal_entries(run)]


class Boom(RuntimeError):
    pass


def _fault_in(stage: str, monkeypatch) -> type[BaseException]:
    """Make ``stage`` raise; the exception type it raises."""
    import splitleak.training.run as run_mod
    from splitleak.training.roles import ClientRole

    if stage == "pretrained loss":
        monkeypatch.setattr(run_mod, "evaluate_ce", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
        return KeyboardInterrupt
    if stage == "training":
        real, calls = ClientRole.exchange, []

        def exchange(self, *a, **k):
            if a[3] == "train":
                calls.append(a[2])
                if len(calls) == 3:  # the third step: two done
                    raise Boom("the client's GPU fell off the bus")
            return real(self, *a, **k)

        monkeypatch.setattr(ClientRole, "exchange", exchange)
        return Boom
    if stage == "capture":
        monkeypatch.setattr(run_mod, "capture_traffic", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
        return KeyboardInterrupt
    if stage == "writing the client layers":
        real_t = RunStore.add_tensors

        def add_tensors(self, kind, rel, *a, **k):
            if rel == "client_layers.safetensors":
                raise OSError(errno.ENOSPC, "No space left on device", str(self.root / rel))
            return real_t(self, kind, rel, *a, **k)

        monkeypatch.setattr(RunStore, "add_tensors", add_tensors)
        return OSError
    assert stage == "writing metrics"
    real_j = RunStore.add_json

    def add_json(self, kind, rel, *a, **k):
        if rel == "metrics.json":
            raise ValueError("a metric is not JSON")
        return real_j(self, kind, rel, *a, **k)

    monkeypatch.setattr(RunStore, "add_json", add_json)
    return ValueError


# what each stage has recorded before its fault, and what it has not
BEFORE = {
    "pretrained loss": ({"manifest", "documents"}, {"training", "wire", "client-layers"}),
    "training": ({"manifest", "documents", "wire", "wire-ledger", "training"}, {"client-layers", "metrics"}),
    "capture": ({"training", "wire-ledger"}, {"client-layers", "metrics"}),
    "writing the client layers": ({"training", "wire-ledger"}, {"client-layers", "metrics"}),
    "writing metrics": ({"training", "wire-ledger", "client-layers"}, {"metrics"}),
}


@pytest.mark.integration
@pytest.mark.parametrize("stage", list(BEFORE))
def test_a_fault_in_any_stage_closes_the_run_failed_with_the_stage_the_step_and_the_cause(tmp_path, monkeypatch, stage):
    cfg = make_train_config(**{**TINY, "steps": 4})
    raised = _fault_in(stage, monkeypatch)
    with pytest.raises(raised):
        run_training(cfg, tmp_path / "run", device="cpu", threads=1)
    info = _closing(tmp_path / "run")
    assert info["stage"] == stage
    assert info["steps_done"] == {"pretrained loss": 0, "training": 2}.get(stage, 4)
    assert info["error"].startswith(raised.__name__ if raised is not Boom else "Boom: the client's GPU")
    has, lacks = BEFORE[stage]
    kinds = set(_kinds(tmp_path / "run"))
    assert has <= kinds and not (lacks & kinds), kinds
    if stage == "training":  # the frames of the two whole steps and the one cut off, and their losses
        log = json.loads((tmp_path / "run" / "training.json").read_text())
        assert len(log["losses"]) == 2 and "fell off the bus" in log["error"]
    # the CLI's refusal of the folder names the failure in one line
    with pytest.raises(Exception, match="holds a run that failed"):
        RunStore.check_out(tmp_path / "run")


@pytest.mark.integration
def test_ctrl_c_during_train_says_stopped_and_where_in_one_line(tmp_path, monkeypatch):
    from splitleak.training.roles import ClientRole

    real, calls = ClientRole.exchange, []

    def exchange(self, *a, **k):
        if a[3] == "train":
            calls.append(a[2])
            if len(calls) == 3:
                raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(ClientRole, "exchange", exchange)
    run = tmp_path / "run"
    r = runner.invoke(
        app,
        ["train", "--out", str(run), "--model", "tiny-gpt2", "--depth", "2", "--n-calib", "4", "--n-train", "4",
         "--n-eval", "4", "--doc-len", "16", "--steps", "4", "--threads", "1", "--device", "cpu", "--quiet"],
    )  # fmt: skip
    out = " ".join(r.output.split())
    assert r.exit_code == 130 and "Traceback" not in out, out
    assert "stopped: interrupted; " in out and "is closed as failed in training after 2 training steps" in out
    assert "rerun it with --force" in out and "done" not in out
    assert _closing(run)["error"] == "KeyboardInterrupt"


@pytest.mark.integration
def test_resume_trusts_the_journal_to_its_last_whole_entry_and_the_checkpoint_it_records(tmp_path):
    """What a killed client leaves, written by hand: a journal whose last line was cut off mid-write, a file
    of that entry never recorded, a checkpoint recorded by its digest and a newer one the kill left unrecorded."""
    from splitleak.errors import ConfigError
    from splitleak.training.checkpoint import CheckpointDir, resume_point

    cfg = make_train_config(**TINY)
    run = tmp_path / "run"
    store = RunStore.create(run)
    manifest = {"config": cfg.as_dict(), "config_hash": cfg.hash(), "checkpoints": {"every": 2}}
    store.add_json("manifest", "manifest.json", manifest)
    with pytest.raises(ConfigError, match="stopped before its first checkpoint"):
        resume_point(run, cfg)
    folder = CheckpointDir(checkpoint_folder(run), keep=1)
    record = {"config_hash": cfg.hash(), "token": "abc123", "losses": [1.0, 0.5], "doc_ids": [3, 1]}
    path, sha = folder.save(2, {"param.0": torch.arange(4.0)}, record)
    store.add("checkpoint", None, {"done": 2, "file": path.name, "sha256": sha})
    folder.save(4, {"param.0": torch.arange(4.0) + 1}, record, prune=False)  # killed before its journal entry
    (run / "wire").mkdir()
    (run / "wire" / "train-00000.safetensors").write_bytes(b"written, never recorded")
    with open(run / "journal.jsonl", "ab") as f:
        f.write(b'{"seq": 2, "kind": "wi')  # the entry the kill cut off
    assert not verify_run(run).ok
    v = verify_run(run, to_last_entry=True)
    assert v.ok and v.status == "" and v.entries == 2, v.message
    point = resume_point(run, cfg)
    assert (point.done, point.token, point.sha256) == (2, "abc123", sha)
    assert torch.equal(point.tensors["param.0"], torch.arange(4.0))
    # the checkpoint changed after it was recorded, or a recorded file of the run changed: refused in one line
    folder.save(2, {"param.0": torch.zeros(4)}, record, prune=False)
    with pytest.raises(ConfigError, match="after 2 steps that .* records is changed since it was recorded"):
        resume_point(run, cfg)
    (run / "manifest.json").write_text("{}")
    with pytest.raises(ConfigError, match="does not verify .*manifest.json: content differs"):
        resume_point(run, cfg)


# ------------------------------------------------------------------ deployed: two processes


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return init_tls(tmp_path_factory.mktemp("tls") / "tls").folder


# the client process killed after step K: a tap on its wire SIGKILLs it as the forward of step K crosses
KILLED_CLIENT = """
import os, signal, sys
import splitleak.training.loop as loop

K = int(os.environ["KILL_AT_STEP"])
_connect = loop.connect

def kill_at(crossing):
    f = crossing.frame
    if f.phase == "train" and f.kind == "forward" and f.step == K:
        os.kill(os.getpid(), signal.SIGKILL)

loop.connect = lambda s, c, lr, taps, server=None: _connect(s, c, lr, [*(taps or []), kill_at], server)
sys.argv = ["splitleak", *sys.argv[1:]]
from splitleak.cli import main

main()
"""

# a U-shape: the loss and the capture pass's loss are the client's, the trunk trains on the server
TRAIN = [
    "--model", "tiny-gpt2", "--offload-start", "1", "--offload-length", "2", "--seed", "7",
    "--n-calib", "4", "--n-train", "6", "--n-eval", "6", "--doc-len", "32", "--steps", "6",
    "--draws", "derived", "--no-baseline", "--threads", "1", "--device", "cpu", "--quiet",
]  # fmt: skip


def _train(out: Path, port: int, tls, *extra: str):
    connect = ["--connect", f"127.0.0.1:{port}", "--tls-dir", str(tls), "--checkpoint-every", "2"]
    return runner.invoke(app, ["train", "--out", str(out), *connect, *extra])


@pytest.mark.e2e
def test_a_client_killed_mid_training_resumes_to_the_result_of_an_uninterrupted_run(tls, tmp_path):
    cap, ck = tmp_path / "cap", tmp_path / "ck"
    with ServeProcess(tls, "--capture", cap, "--checkpoints", ck) as srv:
        r = _train(tmp_path / "ref", srv.port, tls, *TRAIN)  # session 0: uninterrupted
        assert r.exit_code == 0, r.output
        # session 1: the client killed as it sends step 3 (three steps done, the checkpoint after two)
        killed = subprocess.run(
            [sys.executable, "-c", KILLED_CLIENT, "train", "--out", str(tmp_path / "old"),
             "--connect", f"127.0.0.1:{srv.port}", "--tls-dir", str(tls), "--checkpoint-every", "2", *TRAIN],
            env={**child_env(), "KILL_AT_STEP": "3"}, cwd=REPO, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert killed.returncode == -9, killed.stderr[-2000:]
        sessions_ended(cap, 2)
        old = tmp_path / "old"
        v = verify_run(old)
        assert not v.ok and "without a closing entry" in v.message  # killed: never closed
        token = json.loads((cap / "session-0001" / "manifest.json").read_text())["checkpoints"]["token"]
        assert (ck / token / "step-00000002.safetensors").is_file()

        # session 2: resumed from the killed run's checkpoint, the configuration from its manifest
        r = _train(tmp_path / "new", srv.port, tls, "--resume", str(old), "--threads", "1", "--quiet")
        assert r.exit_code == 0, r.output
        # what it trusted: the checkpoint the killed run's journal recorded, by its digest
        (entry,) = [e["info"] for e in journal_entries(old) if e["kind"] == "checkpoint"]
        assert entry["done"] == 2
        resumed_from = json.loads((tmp_path / "new" / "manifest.json").read_text())["resumed_from"]
        assert resumed_from["checkpoint_sha256"] == entry["sha256"]
        sessions_ended(cap, 3)
        assert not (ck / token).exists()  # the resumed session completed: its training's checkpoints are gone
        assert not checkpoint_folder(tmp_path / "new").exists()

        # resumed once more: the server holds nothing of that training any more, and says so in one line
        r = _train(tmp_path / "again", srv.port, tls, "--resume", str(old), "--threads", "1", "--quiet")
        out = " ".join(r.output.split())  # one line, wrapped by the console's width
        assert r.exit_code == 2 and out.count("error:") == 1 and "Traceback" not in out, out
        assert "holds no checkpoint of that training after 2 steps (it holds none" in out
        assert "train the run again without --resume" in out

    ref, new = tmp_path / "ref", tmp_path / "new"
    assert verify_run(ref).status == verify_run(new).status == "complete"
    assert json.loads((new / "manifest.json").read_text())["resumed_from"]["after_steps"] == 2
    # the same trained layers on both sides, bit for bit
    for rel, a, b in [
        ("client_layers.safetensors", ref, new),
        ("server_layers.safetensors", cap / "session-0000", cap / "session-0002"),
    ]:
        x, y = load_file(a / rel), load_file(b / rel)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), rel
    # the same losses per step (the client's, in a U-shape) and the same capture pass and its metrics
    ref_log, new_log = (json.loads((d / "training.json").read_text()) for d in (ref, new))
    assert len(ref_log["losses"]) == 6 and all(isinstance(x, float) for x in ref_log["losses"])
    assert new_log["losses"] == ref_log["losses"] and new_log["doc_ids"] == ref_log["doc_ids"]
    ref_m, new_m = (json.loads((d / "metrics.json").read_text()) for d in (ref, new))
    assert ref_m["heldout_ce"] is not None
    for key in ("heldout_ce", "perplexity", "pretrained_ce"):
        assert new_m[key] == ref_m[key], key
    timed = {"seconds", "tokens_per_second"}
    assert {k: v for k, v in new_m["capture"].items() if k not in timed} == {
        k: v for k, v in ref_m["capture"].items() if k not in timed
    }
    for name in ("capture-00000.safetensors", "capture-ledger.json"):
        assert (new / "wire" / name).read_bytes() == (ref / "wire" / name).read_bytes(), name
    _assert_chain_read_whole(ref, new, tmp_path / "old", cap)


def _assert_chain_read_whole(ref: Path, new: Path, old: Path, cap: Path) -> None:
    """The resumed run's training traffic read whole on both sides, equal to the uninterrupted run's: the
    client killed by SIGKILL had flushed its frames before the checkpoint it resumed from; and a chain with
    its earlier run missing or changed is refused, naming it."""
    from splitleak.errors import IntegrityError
    from splitleak.report.compare import load_summary
    from splitleak.runs.captures import load_capture

    assert load_capture(new, "train", whole=False).steps.tolist() == [2, 3, 4, 5]
    r = runner.invoke(app, ["verify", str(new)])
    assert r.exit_code == 0 and "the training traffic reads whole, 6 steps each once" in " ".join(r.output.split())
    for a, b in [(ref, new), (cap / "session-0000", cap / "session-0002")]:
        x, y = load_capture(a, "train"), load_capture(b, "train")
        assert x.steps.tolist() == y.steps.tolist() == list(range(6))
        assert torch.equal(x.doc_ids, y.doc_ids)
        for name in ("activations", "gradients", "trunk_output", "output_gradients"):
            t, u = getattr(x, name), getattr(y, name)
            assert t is not None and u is not None and torch.equal(t, u), name
    moved = old.with_name("moved")
    old.rename(moved)
    with pytest.raises(IntegrityError, match=r"continues a run that is not found \(looked in .*old"):
        load_capture(new, "train")
    moved.rename(old)
    shard = sorted((old / "wire").glob("train-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-1] + b"x")
    with pytest.raises(IntegrityError, match="continues .*old, which does not verify: .*content differs"):
        load_capture(new, "train")
    r = runner.invoke(app, ["verify", str(new)])
    assert r.exit_code == 1 and "which does not verify" in " ".join(r.output.split())
    assert "which does not verify" in (load_summary(new).unverified or "")


@pytest.mark.integration
def test_a_server_that_fails_at_close_leaves_a_failed_run_that_resumes(tls, tmp_path, monkeypatch):
    """The server fails as it closes the session: the client's run, which trained every step and captured,
    closes as failed ("closing the session", all steps done) with everything it recorded, and resumes."""
    from splitleak.deploy import server as network

    cfg = make_train_config(**{**TINY, "steps": 4, "draws": "derived"})
    finish, failed_once = network.Session._finish, []

    def finish_fails_once(self, ok, reason=""):
        if ok and not failed_once:
            failed_once.append(self.token)
            raise OSError("the server's disk is full")
        return finish(self, ok, reason)

    monkeypatch.setattr(network.Session, "_finish", finish_fails_once)
    node = network.ServerNode(tls, checkpoints=tmp_path / "ck")
    port = node.start()
    thread = threading.Thread(target=node.serve_forever, daemon=True)
    thread.start()
    try:
        addr = f"127.0.0.1:{port}"
        with pytest.raises(TransportError, match="ended the session during close.*disk is full"):
            run_training(cfg, tmp_path / "old", device="cpu", threads=1, connect=addr, tls_dir=tls, checkpoint_every=2)
        info = _closing(tmp_path / "old")
        assert info["stage"] == "closing the session" and info["steps_done"] == 4
        assert "disk is full" in info["error"]
        kinds = _kinds(tmp_path / "old")
        assert {"training", "wire-ledger", "messages", "checkpoint"} <= set(kinds), kinds
        assert (tmp_path / "ck" / failed_once[0]).is_dir()
        new = run_training(
            cfg, tmp_path / "new", device="cpu", threads=1, connect=addr, tls_dir=tls, checkpoint_every=2,
            resume=tmp_path / "old",
        )  # fmt: skip
        assert verify_run(new.run_dir).status == "complete"
        deadline = time.monotonic() + 30
        while (tmp_path / "ck" / failed_once[0]).exists():  # removed as the resumed session completes
            assert time.monotonic() < deadline, "the server kept the checkpoints of a completed training"
            time.sleep(0.05)
    finally:
        node.shutdown()
        thread.join(timeout=10)
    assert not thread.is_alive()


@pytest.mark.integration
def test_a_server_checkpoint_ahead_of_or_behind_the_client_s_is_refused_naming_both(tls, tmp_path):
    from splitleak.defences import DefenceChain
    from splitleak.deploy import ServerNode
    from splitleak.models import SplitModel, load_model
    from splitleak.seeds import model_init_seed
    from splitleak.training.checkpoint import CheckpointDir
    from splitleak.training.config import ServerConfig
    from splitleak.wire.client import RemoteServer, hello_for

    cfg = make_train_config(**TINY)
    lm = load_model(cfg.model, precision=cfg.precision, seed=model_init_seed(cfg.seed))
    split = SplitModel(lm, cfg.depth)
    chain = DefenceChain.from_specs([d.model_dump() for d in cfg.defences], cfg.seed)
    hello = hello_for(ServerConfig.of(cfg, random_init=True).as_dict(), lm.fingerprint(), split.spec.as_dict(),
                      chain.describe())  # fmt: skip
    for done in (4, 6):
        CheckpointDir(tmp_path / "ck" / "abc123").save(done, {"param.0": torch.zeros(2)}, {"config_hash": "x"})
    node = ServerNode(tls, checkpoints=tmp_path / "ck")
    port = node.start()
    thread = threading.Thread(target=node.serve_forever, daemon=True)
    thread.start()
    try:
        for done, where in [(2, "it holds 4, 6: ahead of the client's"), (8, "it holds 4, 6: behind the client's")]:
            with pytest.raises(TransportError) as e:
                RemoteServer("127.0.0.1", port, tls, {**hello, "resume": {"token": "abc123", "done": done}})
            msg = str(e.value)
            assert len(msg.splitlines()) == 1 and f"no checkpoint of that training after {done} steps ({where})" in msg
    finally:
        node.shutdown()
        thread.join(timeout=10)
    assert not thread.is_alive()


LATENT = dict(
    model="tiny-gpt2", n_calib=2, n_train=4, n_eval=4, steps=4, lr=3e-4, capture_batch=2, seed=3,
    latent={"split_after": 0, "resume_at": 3, "width": 16, "gauge_entropy": "derived"},
)  # fmt: skip


@pytest.mark.integration
@pytest.mark.parametrize(
    ("stage", "target"),
    [
        ("pretrained loss", "splitleak.training.latent_run.evaluate_ce"),
        ("training", "splitleak.training.latent.LatentClient.exchange"),
        ("capture", "splitleak.training.latent_run.capture_latent"),
        ("writing the client's records", "splitleak.training.latent.LatentClient.truth_tensors"),
        ("writing metrics", "splitleak.training.latent_run.privacy_accounting"),
    ],
)
def test_a_latent_run_closes_failed_whatever_stage_raises(tmp_path, monkeypatch, stage, target):
    """The latent mode's client ends its run as run_training does (RunEnd): closed as failed with the stage,
    the steps done and the cause, whatever raises; before, a fault after the capture left it unfinished."""

    from splitleak.training.latent import LatentClient

    exchange = LatentClient.exchange

    def boom(*args, **kwargs):
        if stage == "training" and args[3] < 2:  # LatentClient.exchange(self, ids, doc_ids, step, phase): steps 0, 1
            return exchange(*args, **kwargs)
        raise Boom(f"planted in {stage}")

    monkeypatch.setattr(target, boom)
    with pytest.raises(Boom):
        run_training(make_train_config(**LATENT), tmp_path / "run", device="cpu", threads=1)
    info = _closing(tmp_path / "run")
    assert info["stage"] == stage and f"planted in {stage}" in info["error"]
    kinds = _kinds(tmp_path / "run")
    assert info["steps_done"] == {"pretrained loss": 0, "training": 2}.get(stage, 4)
    assert ("training" in kinds) == (stage != "pretrained loss")  # the training log, also of a failed training
    assert "metrics" not in kinds


@pytest.mark.integration
def test_a_latent_run_whose_manifest_cannot_be_built_writes_nothing(tmp_path, monkeypatch):
    """The manifest is built before the run directory is made: a fault there (here in the surrogate's
    parameter count) leaves no unfinished run behind; before, the folder stayed with a journal and no end."""

    def boom(*args, **kwargs):
        raise Boom("planted in the manifest")

    monkeypatch.setattr("splitleak.training.latent_run.surrogate_parameters", boom)
    with pytest.raises(Boom):
        run_training(make_train_config(**LATENT), tmp_path / "run", device="cpu", threads=1)
    assert not (tmp_path / "run").exists()


@pytest.mark.integration
def test_a_latent_server_that_fails_at_close_leaves_the_client_run_closed_failed(tls, tmp_path, monkeypatch):
    from splitleak.deploy import server as network

    finish = network.Session._finish

    def finish_fails(self, ok, reason=""):
        if ok:
            raise OSError("the server's disk is full")
        return finish(self, ok, reason)

    monkeypatch.setattr(network.Session, "_finish", finish_fails)
    node = network.ServerNode(tls)
    port = node.start()
    thread = threading.Thread(target=node.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(TransportError, match="during close.*disk is full"):
            run_training(
                make_train_config(**LATENT), tmp_path / "run", device="cpu", threads=1,
                connect=f"127.0.0.1:{port}", tls_dir=tls,
            )  # fmt: skip
    finally:
        node.shutdown()
        thread.join(timeout=10)
    assert not thread.is_alive()
    info = _closing(tmp_path / "run")
    assert info["stage"] == "closing the session" and info["steps_done"] == 4
    assert {"training", "wire-ledger", "messages"} <= set(_kinds(tmp_path / "run"))
