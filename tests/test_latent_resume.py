"""The decoy system's latent mode checkpoints and resumes over TLS (issue 33's last gaps).

- the client's checkpoint holds all it carries from step to step (codec and AdamW, the decoy pool in ring
  order, the frame record, the frame tokens, the next frame id, the log, the secret): a client restored
  from it continues bit for bit;
- ``splitleak train --mode latent --connect`` SIGKILLed at step k and resumed with ``--resume`` ends, under
  ``gauge_entropy="derived"``, with the codec, the surrogate, the losses, the frame record, the capture pass
  and the metrics of an uninterrupted run; under ``"os"`` it resumes, completes, verifies and keys its noise
  and decoy draws with the checkpointed secret;
- a client killed between writing a checkpoint and recording it in its journal resumes from the one
  before, which the server still holds (it keeps two, and cannot have passed the client's newest);
- what cannot be resumed is refused in one line naming the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from served import REPO, Served, ServeProcess, child_env, sessions_ended
from typer.testing import CliRunner

from splitleak.attacks.gauge_keysearch import GaugeKeySearch
from splitleak.attacks.partition import LatentTraffic, latent_traffic, load_latent_traffic
from splitleak.cli import app
from splitleak.errors import ConfigError
from splitleak.runs.chain import read_wire_whole
from splitleak.runs.journal import journal_entries
from splitleak.runs.store import RunStore
from splitleak.runs.verify import verify_run
from splitleak.training import make_train_config, run_training
from splitleak.training.checkpoint import CheckpointDir, checkpoint_folder
from splitleak.wire.tls import init_tls
from splitleak.wire.transport import TransportError

pytestmark = pytest.mark.timeout(600)
runner = CliRunner()
SPLIT = {"split_after": 0, "resume_at": 3, "width": 16}


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return init_tls(tmp_path_factory.mktemp("tls") / "tls").folder


# ------------------------------------------------------------------ the client's state, in one process


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_a_restored_latent_client_continues_bit_for_bit(tmp_path, seed):
    """Three steps, a checkpoint written and read back, two more steps: a fresh client restored from it sends
    and records what the one that went on did. The pool (40 rows) wraps in the third step, so its ring order
    counts; the decoys' origins are what the privacy accounting counts releases from. Under OS entropy (fresh
    gauge masters per frame: no two runs agree) the restored client holds the run's secret, not its own."""
    from splitleak.models import load_model
    from splitleak.training.checkpoint import restore_state, state_tensors
    from splitleak.training.config import LatentConfig
    from splitleak.training.latent import LatentClient, LatentLog, LatentServer, latent_split
    from splitleak.training.latent_checkpoint import latent_state, restore_latent, resumed_log
    from splitleak.wire.channel import InProcessChannel

    cfg = LatentConfig(**SPLIT, decoys=6, pool=40, gauge_entropy="derived")
    lm = load_model("tiny-gpt2", seed=seed)
    split, _ = latent_split(lm, cfg)
    ids = torch.randint(0, lm.model.config.vocab_size, (5, 16), generator=torch.Generator().manual_seed(seed))

    def step(client: LatentClient, log: LatentLog, k: int) -> None:
        (loss,) = client.exchange(ids[k : k + 1], (k,), k, "train")
        log.losses.append(loss)
        log.teacher.append(client.last_teacher)
        log.doc_ids.append(k)

    server = LatentServer(cfg, 1e-2, seed)
    a, log = LatentClient(split, cfg, seed, InProcessChannel(server.handle), 1e-2), LatentLog()
    for k in range(3):
        step(a, log, k)
    assert a.pool.head != 0 and len(a.pool) == 40  # wrapped: three frames of 16 rows in 40 places
    CheckpointDir(tmp_path / "client").save(3, *latent_state(a, log))
    CheckpointDir(tmp_path / "server").save(3, *state_tensors(server.params, server.opt))
    for k in range(3, 5):
        step(a, log, k)

    server_b = LatentServer(cfg, 1e-2, seed)
    restore_state(server_b.params, server_b.opt, *CheckpointDir(tmp_path / "server").load(3)[1:3])
    b = LatentClient(split, cfg, seed, InProcessChannel(server_b.handle), 1e-2)
    _, tensors, record, _ = CheckpointDir(tmp_path / "client").load(3)
    restore_latent(b, tensors, record)
    log_b = resumed_log(record)
    assert b.next_frame == 3 and log_b.losses == log.losses[:3]
    for k in range(3, 5):
        step(b, log_b, k)
    assert log_b.losses == log.losses and log_b.teacher == log.teacher and log_b.doc_ids == log.doc_ids
    for x, y in [(a.state_dict(), b.state_dict()), (a.truth_tensors(), b.truth_tensors())]:
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert torch.equal(a.pool.rows, b.pool.rows) and np.array_equal(a.pool.origins, b.pool.origins)
    assert (a.pool.head, a.pool.size, a.next_frame) == (b.pool.head, b.pool.size, b.next_frame)
    assert a.max_row_releases() == b.max_row_releases() > 1
    assert sorted(b.frame_tokens) == list(range(5))

    under_os = LatentConfig(**SPLIT, decoys=6, pool=40, gauge_entropy="os")
    c, d = (LatentClient(split, under_os, seed, InProcessChannel(server.handle), 1e-2) for _ in range(2))
    assert c.secret is not None and d.secret != c.secret  # each fresh client draws its own
    folder = CheckpointDir(tmp_path / "os")
    folder.save(1, *latent_state(c, LatentLog()))
    restore_latent(d, *folder.load(1)[1:3])
    assert d.secret == c.secret


# ------------------------------------------------------------------ deployed: two processes

# the client process SIGKILLed: as training step K begins (KILL_WHERE=step: K steps done), or once its
# checkpoint after K steps is written whole, before its journal records it (KILL_WHERE=checkpoint)
KILLED_CLIENT = """
import os, signal, sys
from splitleak.training.checkpoint import CheckpointDir
from splitleak.training.latent import LatentClient

K, WHERE = int(os.environ["KILL_AT"]), os.environ["KILL_WHERE"]
exchange, save = LatentClient.exchange, CheckpointDir.save

def exchange_or_die(self, ids, doc_ids, step, phase):
    if WHERE == "step" and phase == "train" and step == K:
        os.kill(os.getpid(), signal.SIGKILL)
    return exchange(self, ids, doc_ids, step, phase)

def save_and_die(self, done, *args, **kwargs):
    written = save(self, done, *args, **kwargs)
    if WHERE == "checkpoint" and done == K:
        os.kill(os.getpid(), signal.SIGKILL)
    return written

LatentClient.exchange, CheckpointDir.save = exchange_or_die, save_and_die
sys.argv = ["splitleak", *sys.argv[1:]]
from splitleak.cli import main

main()
"""

TRAIN = [
    "--mode", "latent", "--latent-split", "0/3", "--latent-arg", "width=16", "--model", "tiny-gpt2",
    "--seed", "3", "--n-calib", "2", "--n-train", "4", "--n-eval", "4", "--doc-len", "16", "--steps", "6",
    "--threads", "1", "--device", "cpu", "--quiet",
]  # fmt: skip
DERIVED = ["--latent-arg", "gauge_entropy=derived"]


def _train(out: Path, port: int, tls, *extra: str):
    connect = ["--connect", f"127.0.0.1:{port}", "--tls-dir", str(tls), "--checkpoint-every", "2"]
    return runner.invoke(app, ["train", "--out", str(out), *connect, *extra])


def _killed(out: Path, port: int, tls, where: str, k: int, *extra: str) -> None:
    """``splitleak train`` in a process of its own, SIGKILLed (``KILLED_CLIENT``)."""
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_CLIENT, "train", "--out", str(out), "--connect", f"127.0.0.1:{port}",
         "--tls-dir", str(tls), "--checkpoint-every", "2", *TRAIN, *extra],
        env={**child_env(), "KILL_AT": str(k), "KILL_WHERE": where}, cwd=REPO, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert killed.returncode == -9, killed.stderr[-2000:]
    v = verify_run(out)
    assert not v.ok and "without a closing entry" in v.message  # killed: never closed


def _recorded(run: Path) -> list[dict]:
    return [e["info"] for e in journal_entries(run) if e["kind"] == "checkpoint"]


def _same_tensors(a: Path, b: Path) -> bool:
    x, y = load_file(a), load_file(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture(scope="module")
def reference(tls, tmp_path_factory):
    """An uninterrupted latent run over TLS, checkpointing as the killed ones do (derived keys): its client run
    and its server session. Its checkpoints are gone once it completes, on both sides."""
    tmp = tmp_path_factory.mktemp("reference")
    with ServeProcess(tls, "--capture", tmp / "cap", "--checkpoints", tmp / "ck") as srv:
        r = _train(tmp / "ref", srv.port, tls, *TRAIN, *DERIVED)
        assert r.exit_code == 0, r.output
        sessions_ended(tmp / "cap", 1)
    assert not any((tmp / "ck").iterdir()) and not checkpoint_folder(tmp / "ref").exists()
    return tmp / "ref", tmp / "cap" / "session-0000"


def _same_as_reference(new: Path, session: Path, reference: tuple[Path, Path], after: int) -> None:
    """``new`` (resumed after ``after`` steps) and its server ``session`` end as the uninterrupted run did."""
    ref, ref_session = reference
    assert verify_run(new).status == verify_run(session).status == "complete"
    for rel in ("latent/codec.safetensors", "latent/truth.safetensors"):
        assert _same_tensors(ref / rel, new / rel), rel
    assert _same_tensors(ref_session / "server_layers.safetensors", session / "server_layers.safetensors")
    ref_log, new_log = (json.loads((d / "training.json").read_text()) for d in (ref, new))
    assert len(ref_log["losses"]) == 6 and all(isinstance(x, float) for x in ref_log["losses"])
    for key in ("losses", "teacher_match", "doc_ids"):
        assert new_log[key] == ref_log[key], key
    # every metric but the clocks' and the bytes per step (this run sent steps `after` on, whose frames carry
    # more decoys than the first ones, sent while the pool filled)
    ref_m, new_m = (json.loads((d / "metrics.json").read_text()) for d in (ref, new))
    differ = {k for k in ref_m if ref_m[k] != new_m[k]}
    assert differ == {"train_tokens_per_second", "wire_bytes_per_step", "capture"}, differ
    timed = {"seconds", "tokens_per_second"}
    assert {k: v for k, v in new_m["capture"].items() if k not in timed} == {
        k: v for k, v in ref_m["capture"].items() if k not in timed
    }
    assert ref_m["privacy"]["max_releases_of_a_row"] > 1 and ref_m["heldout_ce"] > 0
    for name in ("capture-00000.safetensors", "capture-ledger.json"):
        assert (new / "wire" / name).read_bytes() == (ref / "wire" / name).read_bytes(), name
    # the train-phase capture holds the frames from the resumed step on, as the manifest says; read whole
    # (with those of the run it continues, on both sides), the training traffic is the uninterrupted run's
    assert sorted({f.step for f in load_latent_traffic(new, "train", whole=False).frames}) == list(range(after, 6))

    def frames(run: Path) -> list:  # a server session has no client manifest: its frames joined as the reader does
        return latent_traffic("train", [r.frame for r in read_wire_whole(run, "train")], 1).frames

    for a, b in [(ref, new), (ref_session, session)]:
        x, y = frames(a), frames(b)
        assert sorted({f.step for f in y}) == list(range(6)) and len(x) == len(y)
        for f, g in zip(x, y):
            assert (f.frame_id, f.step) == (g.frame_id, g.step) and all(
                torch.equal(getattr(f, w), getattr(g, w)) for w in ("x", "ret", "g_out", "g_in")
            )
    assert json.loads((new / "manifest.json").read_text())["resumed_from"]["after_steps"] == after
    assert not checkpoint_folder(new).exists()


@pytest.mark.e2e
@pytest.mark.xdist_group("latent-resume")
def test_a_latent_client_killed_mid_training_resumes_to_the_result_of_an_uninterrupted_run(tls, tmp_path, reference):
    cap, ck, old, new = tmp_path / "cap", tmp_path / "ck", tmp_path / "old", tmp_path / "new"
    with ServeProcess(tls, "--capture", cap, "--checkpoints", ck) as srv:
        _killed(old, srv.port, tls, "step", 3, *DERIVED)  # session 0: three steps done, the checkpoint after two
        sessions_ended(cap, 1)
        token = json.loads((cap / "session-0000" / "manifest.json").read_text())["checkpoints"]["token"]
        assert CheckpointDir(ck / token).steps() == [2]
        (entry,) = _recorded(old)
        assert entry["done"] == 2
        r = _train(new, srv.port, tls, "--resume", str(old), "--threads", "1", "--quiet")  # session 1
        assert r.exit_code == 0, r.output
        sessions_ended(cap, 2)
        assert not (ck / token).exists()  # the resumed session completed: its training's checkpoints are gone
    assert json.loads((new / "manifest.json").read_text())["resumed_from"]["checkpoint_sha256"] == entry["sha256"]
    _same_as_reference(new, cap / "session-0001", reference, after=2)


@pytest.mark.e2e
@pytest.mark.xdist_group("latent-resume")
def test_a_client_killed_between_writing_a_checkpoint_and_recording_it_resumes_from_the_one_before(
    tls, tmp_path, reference
):
    """The server writes its checkpoint after k steps before its reply to step k; the client writes its own
    after that reply, then records it. Killed between the two, the client's journal vouches for the one
    before (k - 2), and the server still holds it: it keeps two, and cannot have written k + 2 before the
    client sent step k + 1."""
    cap, ck, old, new = tmp_path / "cap", tmp_path / "ck", tmp_path / "old", tmp_path / "new"
    with ServeProcess(tls, "--capture", cap, "--checkpoints", ck) as srv:
        _killed(old, srv.port, tls, "checkpoint", 4, *DERIVED)
        sessions_ended(cap, 1)
        # the planted state: the newest client checkpoint written whole and never recorded, the one before kept
        assert CheckpointDir(checkpoint_folder(old)).steps() == [2, 4]
        assert [e["done"] for e in _recorded(old)] == [2]
        token = json.loads((cap / "session-0000" / "manifest.json").read_text())["checkpoints"]["token"]
        assert CheckpointDir(ck / token).steps() == [2, 4]  # not pruned: the client's recorded one is there
        r = _train(new, srv.port, tls, "--resume", str(old), "--threads", "1", "--quiet")
        assert r.exit_code == 0, r.output
        sessions_ended(cap, 2)
    _same_as_reference(new, cap / "session-0001", reference, after=2)


def _keyed_by(traffic: LatentTraffic, key: bytes, public: dict) -> list[bool]:
    """Per frame: whether removing the forward noise ``key`` keys leaves every row inside the clip."""
    check = GaugeKeySearch().fit(public=public)
    return [check.consistent(key, traffic.phase, f, traffic.real_rows) for f in traffic.frames]  # type: ignore[arg-type]


@pytest.mark.e2e
def test_a_latent_client_killed_under_os_entropy_resumes_keyed_by_its_checkpointed_secret(tls, tmp_path):
    """Fresh gauge masters per frame make the run irreproducible by design; what must hold is that it resumes,
    completes, verifies, and draws its noise and decoys after the resume with the run's secret, not a new one."""
    cap, ck, old, new = tmp_path / "cap", tmp_path / "ck", tmp_path / "old", tmp_path / "new"
    with ServeProcess(tls, "--capture", cap, "--checkpoints", ck) as srv:
        _killed(old, srv.port, tls, "step", 3)
        sessions_ended(cap, 1)
        _, _, record, _ = CheckpointDir(checkpoint_folder(old)).load(2)
        secret = bytes.fromhex(record["noise_and_decoy_key"])
        r = _train(new, srv.port, tls, "--resume", str(old), "--threads", "1", "--quiet")
        assert r.exit_code == 0, r.output
        sessions_ended(cap, 2)
    assert verify_run(new).status == verify_run(cap / "session-0001").status == "complete"
    manifest = json.loads((new / "manifest.json").read_text())
    assert manifest["config"]["latent"]["gauge_entropy"] == "os" and manifest["resumed_from"]["after_steps"] == 2
    assert json.loads((new / "latent" / "secret.json").read_text())["noise_and_decoy_key"] == secret.hex()
    public = manifest["config"]["latent"]
    train, capture = load_latent_traffic(new, "train"), load_latent_traffic(new, "capture")
    assert sorted({f.step for f in train.frames}) == list(range(6)) and len(capture.frames) == 4  # read whole
    for traffic in (train, capture):
        assert all(_keyed_by(traffic, secret, public))
        assert not any(_keyed_by(traffic, os.urandom(16), public))  # the check can fail: another key
    # the secret never crossed: nothing the server holds carries it
    for path in [*cap.rglob("*"), *ck.rglob("*")]:
        if path.is_file():
            blob = path.read_bytes()
            assert secret not in blob and secret.hex().encode() not in blob, path


# ------------------------------------------------------------------ refusals, one line each


def _planted_run(tmp_path: Path, cfg, record: dict, name: str = "run") -> Path:
    """A killed run of ``cfg`` as its journal and checkpoint folder leave it: one checkpoint, recorded."""
    run = tmp_path / name
    store = RunStore.create(run)
    store.add_json("manifest", "manifest.json", {"config": cfg.as_dict(), "config_hash": cfg.hash(),
                                                 "checkpoints": {"every": 2}})  # fmt: skip
    folder = CheckpointDir(checkpoint_folder(run), keep=1)
    path, sha = folder.save(2, {"param.0": torch.zeros(2)}, {"config_hash": cfg.hash(), "token": "abc123", **record})
    store.add("checkpoint", None, {"done": 2, "file": path.name, "sha256": sha})
    return run


LATENT = dict(model="tiny-gpt2", n_calib=2, n_train=4, n_eval=4, steps=4, lr=3e-4, capture_batch=2, seed=3)


@pytest.mark.integration
def test_what_cannot_be_resumed_in_the_latent_mode_is_refused_in_one_line(tls, tmp_path):
    latent = make_train_config(**LATENT, latent=SPLIT)  # gauge_entropy="os"
    split = make_train_config(**{**LATENT, "lr": 5e-5}, depth=2)
    addr = {"connect": "127.0.0.1:1", "tls_dir": tls, "device": "cpu"}
    cases = [  # (configuration, run to resume, the line)
        (latent, _planted_run(tmp_path, split, {"mode": "split"}, "split-run"),
         "is a split-mode run and this configuration is of the latent mode; resume it with its own configuration"),
        (split, _planted_run(tmp_path, latent, {"mode": "latent"}, "latent-run"),
         "is a latent-mode run and this configuration is of the split mode; resume it with its own configuration"),
        (latent, _planted_run(tmp_path, latent, {"mode": "latent"}, "no-secret"),
         "keeps no secret of the client's noise and decoy draws; it cannot be resumed under gauge_entropy=os"),
        (latent, _planted_run(tmp_path, latent, {"mode": "split"}, "not-latent"),
         "after 2 steps is not of the latent mode; resume the run that wrote it"),
    ]  # fmt: skip
    for cfg, run, line in cases:
        with pytest.raises(ConfigError) as e:
            run_training(cfg, tmp_path / "new", resume=run, **addr)
        assert line in str(e.value) and len(str(e.value).splitlines()) == 1, str(e.value)
        assert not (tmp_path / "new").exists()
    with pytest.raises(ConfigError, match="checkpoints and --resume are for a deployment: pass --connect"):
        run_training(latent, tmp_path / "new", device="cpu", checkpoint_every=2)

    # a server without --checkpoints: a latent run trains, and its manifest says it cannot be resumed
    with Served(tls) as srv:
        cfg = make_train_config(**LATENT, latent={**SPLIT, "gauge_entropy": "derived"})
        run = run_training(cfg, tmp_path / "a", device="cpu", threads=1, connect=f"127.0.0.1:{srv.port}",
                           tls_dir=tls, checkpoint_every=2)  # fmt: skip
        ck = json.loads((run.run_dir / "manifest.json").read_text())["checkpoints"]
        assert ck == {
            "every": None,
            "not_resumable": "the server keeps no checkpoints (start it with --checkpoints DIR)",
        }
        assert not checkpoint_folder(run.run_dir).exists() and "checkpoint" not in {
            e["kind"] for e in journal_entries(run.run_dir)
        }
        with pytest.raises(TransportError, match="the client asks to resume, but this server keeps no checkpoints"):
            run_training(cfg, tmp_path / "b", device="cpu", threads=1, connect=f"127.0.0.1:{srv.port}", tls_dir=tls,
                         resume=_planted_run(tmp_path, cfg, {"mode": "latent"}, "c"))  # fmt: skip


@pytest.mark.integration
def test_a_latent_hello_that_names_a_split_training_s_checkpoint_is_refused_naming_both_modes(tls, tmp_path):
    from splitleak.training.config import ServerConfig
    from splitleak.training.latent import latent_defence_record
    from splitleak.wire.client import RemoteServer, hello_for

    latent = make_train_config(**LATENT, latent=SPLIT)
    split = make_train_config(**{**LATENT, "lr": 5e-5}, depth=2)
    theirs = ServerConfig.of(split, random_init=True).hash()
    CheckpointDir(tmp_path / "ck" / "abc123").save(2, {"param.0": torch.zeros(2)}, {"config_hash": theirs,
                                                                                   "mode": "split"})  # fmt: skip
    hello = hello_for(
        ServerConfig.of(latent, random_init=True).as_dict(), "f" * 64, {**SPLIT, "hidden": 32},
        latent_defence_record(latent.latent), checkpoint_every=2, resume={"token": "abc123", "done": 2},
    )  # fmt: skip
    with Served(tls, checkpoints=tmp_path / "ck") as srv:
        with pytest.raises(TransportError) as e:
            RemoteServer("127.0.0.1", srv.port, tls, hello)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1, msg
    assert f"checkpoint of that training after 2 steps is of another configuration (split mode, {theirs[:12]}" in msg
    assert "the hello's: latent mode" in msg and "train again without --resume" in msg
