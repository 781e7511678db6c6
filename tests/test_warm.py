"""The warm worker (``splitleak worker``, ``splitleak.warm``): an attack command it runs reads what the same command
reads in a fresh process, bit for bit; a worker started from other code or settings is not used; nothing is handed
over where it should not be."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from splitleak import warm
from splitleak.training import make_train_config, run_training

EXE = str(Path(sys.executable).parent / "splitleak")
BASE = dict(model="tiny-gpt2", depth=2, n_calib=16, n_train=8, n_eval=6, all_local_baseline=False)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("warm") / "run"
    run_training(make_train_config(**BASE, seed=5), run, device="cpu")
    return run


def _cli(args, env, cwd=None, timeout=180):
    return subprocess.run([EXE, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def short_dir():
    """A folder with a short path for a worker's socket (a Unix socket's path holds at most 107 bytes; tmp_path can
    be longer on another machine), removed after the test."""
    path = Path(tempfile.mkdtemp(prefix="slw-", dir="/tmp"))
    yield path / "w"
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def worker(short_dir):
    """A worker of its own, stopped (or killed) after the test."""
    env = {**os.environ, "SPLITLEAK_WORKER": "on", warm.DIR_ENV: str(short_dir)}
    started = _cli(["worker", "start", "--idle", "120"], env)
    assert started.returncode == 0, started.stdout + started.stderr
    pid = int(started.stdout.split()[2])
    yield env, short_dir / "worker.log"
    _cli(["worker", "stop"], env, timeout=60)
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


def _same_result(a: Path, b: Path) -> None:
    ra, rb = json.loads(a.read_text()), json.loads(b.read_text())
    for r in (ra, rb):  # what differs between two runs of one command: its clock, and the file it was told to write
        r.pop("seconds")
        r.pop("predictions")
        r["control"].pop("seconds")
    assert ra == rb
    assert pq.read_table(a.with_suffix(".parquet")).equals(pq.read_table(b.with_suffix(".parquet")))


@pytest.mark.integration
def test_an_attack_in_the_warm_worker_reads_what_a_fresh_process_reads(tiny_run, worker, tmp_path):
    env, log = worker
    args = ["attack", str(tiny_run), "--attack", "joint", "--k", "8", "--quiet"]
    fresh = _cli([*args, "--out", str(tmp_path / "fresh.json")], {**env, "SPLITLEAK_WORKER": "off"})
    assert fresh.returncode == 0, fresh.stderr
    assert "'attack " not in log.read_text()  # the fresh process did not reach the worker
    # the first command loads the model, the second (after one on one thread) reads the kept copy; a relative --out
    # lands in the command's own folder
    for name, extra in (("w1.json", []), ("one.json", ["--threads", "1"]), ("w2.json", [])):
        got = _cli([*args, "--out", name, *extra], env, cwd=tmp_path)
        assert got.returncode == 0, got.stderr
    ran = [line for line in log.read_text().splitlines() if "'attack " in line]
    assert len(ran) == 3 and all(": exit 0 in " in line for line in ran)
    for name in ("w1.json", "one.json", "w2.json"):
        _same_result(tmp_path / "fresh.json", tmp_path / name)
    status = _cli(["worker", "status"], env)
    assert status.returncode == 0 and "3 commands" in status.stdout and "tiny-gpt2 (float32)" in status.stdout
    # a refused command: the same exit status and message as in a fresh process, and the worker goes on
    bad = [*args[:3], "--attack", "jiont", "--out", str(tmp_path / "bad.json")]
    here, there = _cli(bad, {**env, "SPLITLEAK_WORKER": "off"}), _cli(bad, env)
    assert (there.returncode, there.stderr) == (here.returncode, here.stderr) and here.returncode == 2
    assert "jiont" in here.stderr and not (tmp_path / "bad.json").exists()
    assert _cli(["worker", "status"], env).returncode == 0


@pytest.mark.integration
def test_a_worker_started_from_other_settings_stops_and_the_command_runs_here(tiny_run, worker, tmp_path):
    env, log = worker
    other = {**env, "PYTHONHASHSEED": "7"}  # read once at a process's start: the worker's is unset
    got = _cli(
        ["attack", str(tiny_run), "--attack", "activation", "--k", "8", "--out", "r.json", "--quiet"], other, tmp_path
    )
    assert got.returncode == 0, got.stderr
    said = f"stderr: {got.stderr}\nlog: {log.read_text()}"
    assert "started from other code or settings" in got.stderr and (tmp_path / "r.json").is_file(), said
    assert "stale" in log.read_text() and "'attack " not in log.read_text(), said
    status = _cli(["worker", "status"], env)
    assert status.returncode == 1, f"{said}\nstatus: {status.stdout}"  # it stopped


@pytest.mark.integration
def test_a_busy_worker_is_neither_replaced_nor_held_by_a_silent_client(worker, tmp_path):
    import socket

    env, log = worker
    hold = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hold.connect(str(log.parent / "worker.sock"))  # connects and says nothing: the worker waits for it, busy
    try:
        again = _cli(["worker", "start"], env)
        assert again.returncode == 0 and "runs already" in again.stdout, again.stdout + again.stderr
    finally:
        hold.close()
    status = _cli(["worker", "status"], env)
    assert status.returncode == 0 and "0 commands" in status.stdout
    assert log.read_text().count("listening on") == 1  # no second worker took the socket over


@pytest.mark.integration
def test_a_worker_loads_the_models_it_is_asked_to_before_the_first_command(short_dir):
    """While it imports and loads, `start`'s pings time out and go away unanswered: the worker outlives them (it
    once exited on the first answer it could not send)."""
    env = {**os.environ, "SPLITLEAK_WORKER": "on", warm.DIR_ENV: str(short_dir)}
    zero = _cli(["worker", "start", "--idle", "0"], env)
    assert zero.returncode == 2 and "--idle must be > 0" in zero.stderr
    too_long = _cli(["worker", "start"], {**env, warm.DIR_ENV: str(short_dir / ("d" * 100))})
    assert too_long.returncode == 1 and warm.DIR_ENV in too_long.stderr  # the log's last line names the fix
    bad = _cli(["worker", "start", "--preload", "no-such-model"], env)
    assert bad.returncode == 1 and "no-such-model" in bad.stderr  # the log's last line: the loader's error
    assert _cli(["worker", "status"], env).returncode == 1
    started = _cli(["worker", "start", "--preload", "tiny-gpt2"], env)
    try:
        assert started.returncode == 0, started.stderr
        status = _cli(["worker", "status"], env)
        assert "0 commands" in status.stdout and "models kept: tiny-gpt2 (float32)" in status.stdout
    finally:
        assert "stopped" in _cli(["worker", "stop"], env).stdout


@pytest.mark.unit
def test_only_attack_commands_are_handed_over_and_only_to_a_private_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(warm.DIR_ENV, str(tmp_path / "w"))
    monkeypatch.setenv(warm.WORKER_ENV, "on")
    assert warm.hand_over(["attack", "run", "--attack", "joint"]) is None  # no worker listens
    (tmp_path / "w").mkdir(mode=0o755)
    (tmp_path / "w").chmod(0o755)
    assert warm.connect() is None  # a folder others can enter is not trusted
    monkeypatch.setenv(warm.WORKER_ENV, "off")
    assert warm.hand_over(["attack", "run"]) is None
    monkeypatch.setenv(warm.WORKER_ENV, "on")
    assert warm.hand_over(["train", "--out", "x"]) is None and warm.hand_over(["attack", "--help"]) is None
    assert warm.hand_over([]) is None


@pytest.mark.unit
def test_the_code_digest_follows_the_package_files_and_the_start_settings(monkeypatch, tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "sub" / "m.py").write_text("x = 1\n")
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    first = warm.code_digest(package)
    assert warm.code_digest(package) == first and warm.code_digest() != first
    monkeypatch.setenv("PYTHONHASHSEED", "3")
    assert warm.code_digest(package) != first
    monkeypatch.delenv("PYTHONHASHSEED")
    (package / "sub" / "m.py").write_text("x = 22\n")  # another size
    assert warm.code_digest(package) != first
    (package / "sub" / "m.py").write_text("x = 1\n")
    st = (package / "sub" / "m.py").stat()
    os.utime(package / "sub" / "m.py", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the same size, rewritten later
    second = warm.code_digest(package)
    assert second != first
    (package / "sub" / "__pycache__").mkdir()
    (package / "sub" / "__pycache__" / "m.pyc").write_bytes(b"compiled")  # not source
    assert warm.code_digest(package) == second


@pytest.mark.unit
def test_kept_models_hand_out_pristine_copies_with_their_fingerprint_as_loaded():
    import torch

    from splitleak.experiments import worker
    from splitleak.models.presets import keep_models, kept_models, load_model

    keep_models(1)
    try:
        a, b = load_model("tiny-gpt2", seed=4), load_model("tiny-gpt2", seed=4)
        assert a.model is not b.model and kept_models() == ["tiny-gpt2 (float32)"]
        assert a.loaded_fingerprint == b.loaded_fingerprint == a.fingerprint() == b.fingerprint()
        assert load_model("tiny-gpt2", seed=5).fingerprint() != a.fingerprint()  # another seed, another model
        with torch.no_grad():
            next(a.model.parameters()).add_(1.0)  # a command changes its copy
        assert a.fingerprint() != a.fingerprint(as_loaded=True)
        assert load_model("tiny-gpt2", seed=4).fingerprint() == b.fingerprint()  # not the kept one
    finally:
        keep_models(0)
    assert kept_models() == [] and load_model("tiny-gpt2", seed=4).loaded_fingerprint is None
    # a grid worker keeps its own: its copies carry the fingerprint too; a model taken to be trained does not, and
    # the next copy is loaded afresh
    worker._MODELS.resize(0)
    worker._MODELS.resize(3)
    c, d = worker.cached_model("tiny-gpt2", "float32", 3, None), worker.cached_model("tiny-gpt2", "float32", 3, None)
    assert c.model is not d.model and c.loaded_fingerprint == d.fingerprint() == c.fingerprint()
    assert worker._MODELS.names() == ["tiny-gpt2 (float32)"] and kept_models() == []  # not the process's keep
    taken = worker.cached_model("tiny-gpt2", "float32", 3, None, take=True)
    assert taken.loaded_fingerprint is None and worker._MODELS.names() == []
    worker._MODELS.resize(0)
    worker._MODELS.resize(3)


@pytest.mark.unit
def test_a_message_sent_whole_with_its_descriptors_is_not_sent_again(monkeypatch):
    """The worker may answer and close as soon as the request is in: nothing may be sent after it (an empty second
    send once failed there with a broken pipe, and the command ran without the worker, silently)."""
    import socket

    client, worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    real = socket.send_fds

    def send_then_close(sock, buffers, fds):
        sent = real(sock, buffers, fds)
        got, fds_in = warm.receive(worker, max_fds=3)
        assert got == {"op": "run", "argv": ["attack"]} and len(fds_in) == 3
        warm.send(worker, {"stale": True})
        worker.close()
        for fd in fds_in:
            os.close(fd)
        return sent

    monkeypatch.setattr(socket, "send_fds", send_then_close)
    with client:
        warm.send(client, {"op": "run", "argv": ["attack"]}, [0, 1, 2])  # before: BrokenPipeError
        assert warm.receive(client) == ({"stale": True}, [])
