"""Kill at every stage (issue 17): `splitleak train` SIGKILLed in each of its stages, `splitleak attack`
killed mid-job, then rerun.

The commands run as subprocesses with their output in a plain log, where ``RichProgress`` prints a
``start:`` and a ``done:`` line for each long stage; the harness polls the log and SIGKILLs the process
group the moment its stage's start line appears ("writing metrics": the all-local loss's end line, or
``all_local.json`` on disk). The runs are small, yet each stage lasts about a tenth of a second or more, so
the kill lands inside it; should it land later (a race), the properties are checked for wherever it landed:

- ``splitleak verify`` fails on every run that has no closing entry, and ``splitleak attack`` refuses such a
  run in one line, writing nothing;
- a rerun without ``--force`` is refused in one line that says the folder holds an unfinished run (with its
  journal's last entry), and changes nothing; with ``--force`` it starts clean and gives the metrics and the
  captured tensors, byte for byte, of an uninterrupted run of the same configuration;
- an attack stopped while it writes its predictions and then killed leaves no RESULT.json and no Parquet
  under their names; the rerun without ``--force`` succeeds, clears the temporary file, and gives the
  result of an uninterrupted attack.

The uninterrupted run and the reruns run in-process; the killed processes all start at once, in one
module fixture (their start-up, mostly imports, is most of their time). What each killed process recorded
before it died is checked against the uninterrupted run too, so the tensors are compared across processes."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
from typer.testing import CliRunner

from splitleak.cli import app
from splitleak.errors import SplitleakError
from splitleak.runs.store import RunStore
from splitleak.runs.verify import verify_run

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 120.0  # the most the harness waits for all its processes together
POLL_S = 0.002
TRAIN = [
    "--model", "tiny-gpt2", "--depth", "2", "--defence", "quant8", "--seed", "3",
    "--n-calib", "4", "--n-train", "8", "--steps", "16", "--n-eval", "64", "--doc-len", "32",
    "--threads", "1", "--device", "cpu",
    "--draws", "derived",  # the killed run and the reference are compared byte for byte: no per-run secret
]  # fmt: skip
ATTACK = ["--attack", "vmi", "--threads", "1", "--device", "cpu"]
# the stage, the log line at which it is killed, and the line that says it ended
STAGES = {
    "pretrained loss": ("start: pretrained loss", "done: pretrained loss"),
    "training steps": ("start: split training", "done: split training"),
    "capture": ("start: capture", "done: capture"),
    "all-local baseline": ("start: all-local baseline", "done: all-local baseline"),
    "writing metrics": ("done: all-local loss", None),  # ends with the journal's closing entry
}
# files a run records whose bytes hold timings or the time of day; every other one must be the same bytes
TIMED = {"manifest.json", "training.json", "all_local.json", "metrics.json"}
# the child of the killed attack: `splitleak attack` whose Parquet writer stops the process once it has
# written half of the predictions' temporary file, so that the harness's SIGKILL lands in the middle of it
ATTACK_CHILD = """
import os, signal, sys
import splitleak.files as files

_write = files.write_atomic

def write_atomic(path, data):
    if path.suffix == ".parquet":  # the predictions: half of them written to write_atomic's temporary file
        with open(path.with_name(f".{path.name}.{os.getpid()}.tmp"), "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
        os.kill(os.getpid(), signal.SIGSTOP)  # the harness sees it stopped and SIGKILLs it
    _write(path, data)

files.write_atomic = write_atomic
sys.argv = ["splitleak", *sys.argv[1:]]
from splitleak.cli import main

main()
"""

runner = CliRunner()


@dataclass
class Child:
    name: str
    args: list[str]
    log: Path
    trigger: Callable[["Child"], bool]
    near: str | None = None  # a log line after which the harness polls without pausing (a short stage is next)
    proc: subprocess.Popen | None = None
    killed: bool = False
    extra: dict = field(default_factory=dict)

    def start(self) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
        env.pop("FORCE_COLOR", None)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, *self.args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env=env,
                start_new_session=True,  # its own process group, killed as one
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self) -> str:
        return " | ".join(self.text().strip().splitlines()[-6:])

    def kill(self) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)


def _drive(children: list[Child], meanwhile: Callable[[], list[Child]]) -> None:
    """Start ``children``, run ``meanwhile`` in a thread and start the children it returns when it ends, and
    SIGKILL each child when its trigger fires; every one has ended (killed, or by itself before its trigger)
    when this returns, within WAIT_S."""
    pending = list(children)
    for c in pending:
        c.start()
    later: list = []
    thread = threading.Thread(target=lambda: later.append(_outcome(meanwhile)), daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    try:
        while pending or thread.is_alive() or later:
            if later:
                more = later.pop()
                if isinstance(more, BaseException):
                    raise more
                for c in more:
                    c.start()
                children.extend(more)
                pending.extend(more)
            for c in list(pending):
                assert c.proc is not None
                if c.trigger(c):
                    c.kill()
                    c.killed = True
                    pending.remove(c)
                elif c.proc.poll() is not None:
                    pending.remove(c)
            if time.monotonic() > deadline:
                waiting = [c.name for c in pending] + (["the in-process run"] if thread.is_alive() else [])
                pytest.fail(
                    f"harness: after {WAIT_S:.0f} s still waiting for {', '.join(waiting)}"
                    + (f" (last lines: {pending[0].tail()})" if pending else "")
                )
            if not any(c.near is not None and c.near in c.text() for c in pending):
                time.sleep(POLL_S)
    finally:
        for c in pending:
            if c.proc is not None and c.proc.poll() is None:
                c.kill()


def _outcome(call: Callable[[], list[Child]]) -> list[Child] | BaseException:
    try:
        return call()
    except BaseException as exc:  # noqa: BLE001 - handed to the harness's thread, which raises it
        return exc


def _stage_trigger(stage: str, run: Path) -> Callable[[Child], bool]:
    line = STAGES[stage][0]
    if stage == "writing metrics":
        return lambda c: line in c.text() or ((run / "all_local.json").exists() and not (run / "metrics.json").exists())
    return lambda c: line in c.text()


def _stopped(c: Child) -> bool:
    assert c.proc is not None
    return os.waitid(os.P_PID, c.proc.pid, os.WSTOPPED | os.WNOHANG) is not None


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The uninterrupted run (in-process, while the killed processes start up), and every killed process
    after the harness is done with it."""
    root = tmp_path_factory.mktemp("kill")
    reference = root / "reference"
    cli = ["-m", "splitleak.cli"]
    children: list[Child] = []
    for i, stage in enumerate(STAGES):
        run = root / f"killed-{i}"
        c = Child(
            stage, [*cli, "train", *TRAIN, "--out", str(run)], root / f"killed-{i}.log", _stage_trigger(stage, run)
        )
        if stage == "writing metrics":  # a few milliseconds: from the all-local loss on, poll without pause
            c.near = "start: all-local loss"
        c.extra["run"] = run
        children.append(c)

    def uninterrupted() -> list[Child]:  # then the attack on it, to be killed while it writes its result
        r = runner.invoke(app, ["train", *TRAIN, "--out", str(reference)])
        assert r.exit_code == 0, r.output
        out = root / "attack" / "R.json"
        args = ["-c", ATTACK_CHILD, "attack", str(reference), *ATTACK, "--out", str(out)]
        c = Child("attack", args, root / "attack.log", _stopped)
        c.extra["out"] = out
        return [c]

    _drive(children, uninterrupted)
    return {"reference": reference, **{c.name: c for c in children}}


# ------------------------------------------------------------------ helpers


def _unwrapped(output: str) -> str:
    return " ".join(output.split())  # rich wraps long lines in a plain log


def _one_line_error(result) -> str:
    assert isinstance(result.exception, SystemExit) and result.exit_code == 2, result.output
    assert "Traceback" not in result.output, result.output
    assert result.output.lstrip().startswith("error:") and result.output.count("error:") == 1, result.output
    return _unwrapped(result.output)


def _journal(run: Path) -> tuple[list[dict], bool]:
    """The journal's whole entries, and whether a line was cut off after them."""
    raw = (run / "journal.jsonl").read_bytes() if (run / "journal.jsonl").is_file() else b""
    lines = raw.split(b"\n")
    cut = lines.pop() != b""
    return [json.loads(line) for line in lines], cut


def _files(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _recorded(run: Path) -> dict[str, str]:
    """What the journal records, file by file, without the files that hold timings."""
    entries, _ = _journal(run)
    return {rel: digest for e in entries for rel, digest in e["files"].items() if rel not in TIMED}


def _deterministic(obj):
    """metrics.json without its timings (seconds, throughput)."""
    if isinstance(obj, dict):
        return {k: _deterministic(v) for k, v in obj.items() if not (k.endswith("seconds") or k.endswith("per_second"))}
    return obj


def _metrics(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


# ------------------------------------------------------------------ tests


@pytest.mark.e2e
@pytest.mark.parametrize("stage", list(STAGES))
def test_a_train_killed_in_each_stage_never_verifies_and_its_rerun_starts_clean(killed, stage, tmp_path):
    c, reference = killed[stage], killed["reference"]
    run = c.extra["run"]
    ended = STAGES[stage][1]
    assert c.killed, f"the process ended before the {stage} stage began (rc {c.proc.returncode}): {c.tail()}"
    entries, cut = _journal(run)
    closed = bool(entries) and not cut and entries[-1]["kind"] in ("complete", "failed")
    inside = not closed if ended is None else ended not in c.text()
    print(f"{stage}: killed {'inside the stage' if inside else 'after it ended'}, {len(entries)} journal entries")
    if stage != "writing metrics":  # over half a second of work remains after these stages begin
        assert c.proc.returncode == -signal.SIGKILL and not closed, f"the kill missed the {stage}: {c.tail()}"

    # 0. what the killed process recorded before it died is what the uninterrupted run (another process) wrote
    ref_entries, _ = _journal(reference)
    assert [e["kind"] for e in entries] == [e["kind"] for e in ref_entries[: len(entries)]]
    recorded, ref_recorded = _recorded(run), _recorded(reference)
    assert recorded == {rel: ref_recorded[rel] for rel in recorded}
    assert {rel: d for rel, d in _files(run).items() if rel in recorded} == recorded

    # 1. verify passes a run only when its journal closed, and attack reads nothing from an unfinished one
    v = runner.invoke(app, ["verify", str(run)])
    if closed:
        assert v.exit_code == 0 and "run complete" in v.output, v.output
    else:
        assert v.exit_code == 1 and "FAILED" in v.output, v.output
        assert not verify_run(run).ok
        out = tmp_path / "R.json"
        a = runner.invoke(app, ["attack", str(run), *ATTACK, "--out", str(out)])
        assert "does not verify" in _one_line_error(a)
        assert list(tmp_path.iterdir()) == []

    # 2. a rerun without --force says what the folder holds, and touches nothing
    before = _files(run)
    r = runner.invoke(app, ["train", *TRAIN, "--out", str(run)])
    msg = _one_line_error(r)
    assert "--force" in msg
    if closed:
        assert "already holds a complete run" in msg
    else:
        assert "holds an unfinished run" in msg, msg
        assert f"has {len(entries)} whole entries" in msg, msg
        if entries:
            assert f"the last of kind {entries[-1]['kind']!r}" in msg, msg
        assert ("cut off mid-write" in msg) == cut, msg
    assert _files(run) == before

    # 3. with --force it starts clean: whole, and the numbers and tensors of the uninterrupted run
    r = runner.invoke(app, ["train", *TRAIN, "--out", str(run), "--force"])
    assert r.exit_code == 0, r.output
    v = runner.invoke(app, ["verify", str(run)])
    assert v.exit_code == 0 and "run complete" in v.output, v.output
    want, got = _deterministic(_metrics(reference)), _deterministic(_metrics(run))
    assert {"heldout_ce", "pretrained_ce", "all_local_ce", "delta_u", "capture", "wire_bytes_per_step"} <= set(want)
    assert "zero_gradient_rows" in want["capture"] and "tokens_per_second" not in want["capture"]
    assert got == want
    shards = {"client_layers.safetensors", "wire/train-00000.safetensors", "wire/capture-00000.safetensors"}
    assert shards <= set(ref_recorded)
    assert _recorded(run) == ref_recorded
    assert [e["kind"] for e in _journal(run)[0]] == [e["kind"] for e in ref_entries]


@pytest.mark.e2e
def test_an_attack_killed_while_writing_leaves_no_result_and_its_rerun_gives_the_uninterrupted_one(killed, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    c = killed["attack"]
    out: Path = c.extra["out"]
    ref_run = Path(c.args[c.args.index("attack") + 1])
    assert c.killed and c.proc.returncode == -signal.SIGKILL, f"the attack was not stopped mid-write: {c.tail()}"
    left = sorted(p.name for p in out.parent.iterdir())
    # killed with the predictions' temporary file half written: nothing under the result's names
    assert not out.exists() and not out.with_suffix(".parquet").exists(), left
    assert len(left) == 1 and left[0].startswith(".R.parquet.") and left[0].endswith(".tmp"), left
    stale = out.parent / left[0]
    with pytest.raises(pa.ArrowInvalid):
        pq.read_table(stale)  # half a Parquet file: the kill landed mid-write

    r = runner.invoke(app, ["attack", str(ref_run), *ATTACK, "--out", str(out)])  # no --force
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.parent.iterdir()) == ["R.json", "R.parquet"]  # the stale file is gone

    whole = tmp_path / "whole" / "R.json"
    r = runner.invoke(app, ["attack", str(ref_run), *ATTACK, "--out", str(whole)])
    assert r.exit_code == 0, r.output
    got, want = json.loads(out.read_text()), json.loads(whole.read_text())
    assert 0 < want["token_recovery"] <= 1 and want["n_docs"] == 64
    for key in ("token_recovery", "doc_recovery", "span_recovery", "span_counts", "n_docs", "n_tokens", "config_hash"):
        assert got[key] == want[key], key
    assert got["predictions"] == "R.parquet"
    assert pq.read_table(out.with_suffix(".parquet")).equals(pq.read_table(whole.with_suffix(".parquet")))


@pytest.mark.unit
def test_the_refusal_of_a_used_folder_says_what_it_holds_and_changes_nothing(tmp_path):
    def refusal(root: Path) -> str:
        before = _files(root)
        with pytest.raises(SplitleakError) as exc:
            RunStore.create(root)
        assert _files(root) == before and "--force" in str(exc.value) and "\n" not in str(exc.value)
        return str(exc.value)

    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert "already exists and is not empty" in refusal(other)

    run = tmp_path / "run"
    s = RunStore.create(run)
    s.add_json("manifest", "manifest.json", {"config": {}})
    s.add("wire", {"wire/train-00000.safetensors": b"x"}, {"phase": "train", "frames": 2})
    msg = refusal(run)
    assert "holds an unfinished run" in msg and "has 2 whole entries, the last of kind 'wire' (train)," in msg
    assert "start the run again" in msg and "cut off" not in msg
    with open(run / "journal.jsonl", "ab") as f:
        f.write(b'{"seq": 2, "kind": "trai')  # killed while it appended an entry
    assert "has 2 whole entries, the last of kind 'wire' (train), then one cut off mid-write" in refusal(run)
    assert not verify_run(run).ok

    failed = RunStore.create(tmp_path / "failed")
    failed.add_json("manifest", "manifest.json", {})
    failed.close(False, {"error": "NaN in the loss at step 3\nsecond line", "steps_done": 3})
    assert "holds a run that failed (NaN in the loss at step 3); pass --force" in refusal(failed.root)

    complete = RunStore.create(tmp_path / "complete")
    complete.add_json("manifest", "manifest.json", {})
    complete.close(True)
    assert "already holds a complete run (2 journal entries)" in refusal(complete.root)

    early = tmp_path / "early"  # killed between its first file and its first journal entry
    early.mkdir()
    (early / "manifest.json").write_text("{}")
    (early / ".documents.json.123.tmp").write_text("{")
    assert "unfinished run, killed before its first journal entry" in refusal(early)

    (complete.root / "journal.jsonl").write_bytes(b"not json\n")
    assert "does not parse" in refusal(complete.root)
    RunStore.create(complete.root, force=True)
    assert list(complete.root.iterdir()) == []
