"""Nothing lost or clobbered (issue 33): ``--force`` deletes only what splitleak wrote, never a foreign
folder, a link's target or the run that ``--resume`` reads; attack results are written whole and once;
the store's lock holds one driver under a race; an interrupted stage says it stopped."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from splitleak.cli import app
from splitleak.errors import SplitleakError
from splitleak.runs.store import RunStore
from splitleak.runs.verify import verify_run

TINY_RUN = dict(model="tiny-gpt2", depth=2, n_calib=4, n_train=6, n_eval=12, seed=0, all_local_baseline=False)
TINY = ["--model", "tiny-gpt2", "--depth", "2", "--n-calib", "4", "--n-train", "4", "--n-eval", "4"]
TINY += ["--doc-len", "16", "--steps", "4", "--threads", "1", "--device", "cpu", "--quiet"]
ATTACK = ["--attack", "vmi", "--threads", "1", "--device", "cpu", "--quiet"]
runner = CliRunner()


def _one_line_error(result, *words: str) -> str:
    out = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and out.startswith("error:") and out.count("error:") == 1, result.output
    for w in words:
        assert w in out, out
    return out


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _a_run(root: Path) -> Path:
    store = RunStore.create(root)
    store.add_json("manifest", "manifest.json", {"note": "a run"})
    store.close(True)
    return root


# ------------------------------------------------------------------ --force


@pytest.mark.unit
def test_force_deletes_a_run_but_never_a_foreign_folder_or_the_target_of_a_link(tmp_path):
    foreign = tmp_path / "photos"
    (foreign / "2025").mkdir(parents=True)
    (foreign / "2025" / "beach.jpg").write_bytes(b"\xff\xd8 not a run")
    (foreign / "notes.txt").write_text("mine")
    before = _files(foreign)
    with pytest.raises(SplitleakError, match=r"not a splitleak run.*choose another --out") as exc:
        RunStore.create(foreign, force=True)
    assert "\n" not in str(exc.value)
    assert _files(foreign) == before

    run = _a_run(tmp_path / "run")
    link = tmp_path / "link"
    link.symlink_to(run, target_is_directory=True)
    kept = _files(run)
    with pytest.raises(SplitleakError, match=r"is a link .*pass the folder itself"):
        RunStore.create(link, force=True)
    assert _files(run) == kept and link.is_symlink()

    # a run splitleak wrote is deleted and started again, and so is one killed before its first entry
    RunStore.create(run, force=True).close(True)
    assert sorted(p.name for p in run.iterdir()) == ["journal.jsonl"] and verify_run(run).ok
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / "manifest.json").write_text("{}")
    RunStore.create(killed, force=True)
    assert list(killed.iterdir()) == []


@pytest.mark.e2e
def test_train_force_on_a_link_or_a_foreign_folder_is_refused_in_one_line(tmp_path):
    run = _a_run(tmp_path / "run")
    link = tmp_path / "link"
    link.symlink_to(run, target_is_directory=True)
    kept = _files(run)
    r = runner.invoke(app, ["train", *TINY, "--out", str(link), "--force"])
    _one_line_error(r, str(link), "link")
    assert _files(run) == kept
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work")
    r = runner.invoke(app, ["train", *TINY, "--out", str(foreign), "--force"])
    _one_line_error(r, "not a splitleak run")
    assert (foreign / "thesis.tex").read_text() == "years of work"


@pytest.mark.e2e
def test_resume_with_its_own_run_as_out_is_refused_before_anything_is_deleted(tmp_path, shared_run):
    run = tmp_path / "run"
    shutil.copytree(shared_run(**TINY_RUN), run)
    kept = _files(run)
    tls = tmp_path / "tls"
    tls.mkdir()
    args = ["train", "--resume", str(run), "--out", str(run), "--force", "--connect", "127.0.0.1:9"]
    r = runner.invoke(app, [*args, "--tls-dir", str(tls), "--quiet"])
    _one_line_error(r, "--resume", "--out", "another --out")
    assert _files(run) == kept
    r = runner.invoke(app, [*args[:3], "--out", str(run / "inner"), *args[5:], "--tls-dir", str(tls), "--quiet"])
    _one_line_error(r, "--resume", "--out")
    assert _files(run) == kept


@pytest.mark.unit
def test_audit_force_deletes_an_audit_folder_but_never_a_foreign_one(tmp_path, monkeypatch):
    import splitleak.audit.run as audit_run
    from splitleak.report.audit_prose import audit_words

    def reached(*a, **k):
        raise RuntimeError("training started")

    monkeypatch.setattr(audit_run, "run_training", reached)
    foreign = tmp_path / "data"
    foreign.mkdir()
    (foreign / "corpus.txt").write_text("irreplaceable")
    with pytest.raises(SplitleakError, match="not an audit folder") as exc:
        audit_run.run_audit(foreign, model="tiny-gpt2", words=audit_words, force=True)
    assert "\n" not in str(exc.value)
    assert (foreign / "corpus.txt").read_text() == "irreplaceable"
    link = tmp_path / "link"
    link.symlink_to(foreign, target_is_directory=True)
    with pytest.raises(SplitleakError, match="is a link"):
        audit_run.run_audit(link, model="tiny-gpt2", words=audit_words, force=True)
    assert (foreign / "corpus.txt").read_text() == "irreplaceable"
    # an audit folder splitleak wrote (its run, its report) is deleted and written again
    audit = tmp_path / "audit"
    _a_run(audit / "run")
    (audit / "attacks").mkdir()
    (audit / "report.json").write_text("{}")
    with pytest.raises(RuntimeError, match="training started"):
        audit_run.run_audit(audit, model="tiny-gpt2", words=audit_words, force=True)
    # all of it deleted; what is there now is the new audit's record of where it stopped (for --resume)
    assert [p.name for p in audit.iterdir()] == ["stages.json"]
    assert json.loads((audit / "stages.json").read_text())["stages"] == {}


# ------------------------------------------------------------------ attack results


@pytest.mark.e2e
def test_an_attack_out_that_would_clobber_is_refused_before_the_attack_runs(tmp_path, shared_run, monkeypatch):
    import splitleak.audit.evaluate as evaluate

    def reached(*a, **k):
        raise RuntimeError("the attack ran")

    monkeypatch.setattr(evaluate, "make_attack", reached)
    run = tmp_path / "run"
    shutil.copytree(shared_run(**TINY_RUN), run)
    kept = _files(run)
    (tmp_path / "afile").write_text("x")
    cases = {
        str(tmp_path / "preds.parquet"): ".parquet",
        str(run / "result.json"): "inside the run",
        str(run / "wire" / "r.json"): "inside the run",
        str(tmp_path / "afile" / "r.json"): "cannot be created",
    }
    for out, words in cases.items():
        r = runner.invoke(app, ["attack", str(run), *ATTACK, "--out", out])
        _one_line_error(r, words)
        assert _files(run) == kept
    assert (tmp_path / "afile").read_text() == "x" and not (tmp_path / "preds.parquet").exists()


ATTACK_CHILD = """
import sys, time
start = float(sys.argv[1])
time.sleep(max(0.0, start - time.time()))
from splitleak.cli import app
sys.argv = ["splitleak", *sys.argv[2:]]
app()
"""


@pytest.mark.e2e
def test_two_attacks_with_one_out_write_one_whole_result_and_the_other_is_refused(tmp_path, shared_run):
    run = shared_run(**TINY_RUN)
    out = tmp_path / "res" / "vmi.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.time() + 8  # both import first, then start together
    args = [sys.executable, "-c", ATTACK_CHILD, str(start), "attack", str(run), *ATTACK, "--out", str(out)]
    procs = [subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in "ab"]
    results = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=240)
            results.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    codes = sorted(rc for rc, _, _ in results)
    assert codes == [0, 2], results
    refused = next(r for r in results if r[0] == 2)
    err = " ".join(refused[2].split())
    assert err.startswith("error:") and "Traceback" not in refused[2] and "already exists" in err, refused[2]
    result = json.loads(out.read_text())
    pq = out.with_suffix(".parquet")
    assert result["predictions_sha256"] == hashlib.sha256(pq.read_bytes()).hexdigest()
    assert sorted(p.name for p in out.parent.iterdir()) == ["vmi.json", "vmi.parquet"]


# ------------------------------------------------------------------ the store's lock

DRIVERS, SECONDS = 4, 2.0  # 4 s gave 7,537 overlaps on the code before the flock fix
LOCK_CHILD = """
import os, sys, time
go, store, log = sys.argv[1], sys.argv[2], sys.argv[3]
from splitleak.errors import SplitleakError
from splitleak.experiments.store import ResultsStore
rs = ResultsStore(store)
inside = os.path.join(store, "inside")
held = refused = overlaps = 0
open(f"{go}.{os.getpid()}", "w").close()  # ready
while not os.path.exists(go):
    time.sleep(0.001)
end = time.time() + float(sys.argv[4])
while time.time() < end:
    try:
        with rs.lock():
            held += 1
            try:  # a marker only the holder of the lock may have: another one's still there means two hold it
                os.close(os.open(inside, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                overlaps += 1
                continue
            time.sleep(0.002)
            os.unlink(inside)
    except SplitleakError:
        refused += 1
fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
os.write(fd, f"{os.getpid()} {held} {refused} {overlaps}\\n".encode())
os.close(fd)
"""


@pytest.mark.integration  # four processes
def test_the_store_lock_has_one_holder_when_several_drivers_race_for_it(tmp_path):
    """Four drivers started together, each taking and freeing the store's lock as fast as it can for a
    few seconds (thousands of races, a stale lock of a dead driver first): each attempt gets the lock or
    is refused, and no two ever hold it at once."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    store, log = tmp_path / "store", tmp_path / "log"
    store.mkdir()
    (store / "run.lock").write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename, "started": "-"}))
    go = tmp_path / "go"
    args = [str(go), str(store), str(log), str(SECONDS)]
    procs = [subprocess.Popen([sys.executable, "-c", LOCK_CHILD, *args], env=env) for _ in range(DRIVERS)]
    try:
        deadline = time.time() + 120
        while len(list(tmp_path.glob("go.*"))) < DRIVERS and time.time() < deadline:
            time.sleep(0.01)  # every driver has imported splitleak: then all start at once
        go.touch()
        for p in procs:
            assert p.wait(timeout=120) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    rows = [[int(x) for x in line.split()] for line in log.read_text().splitlines()]
    assert len(rows) == DRIVERS, rows
    assert sum(r[3] for r in rows) == 0, f"two drivers held the lock at once (pid, held, refused, overlaps): {rows}"
    assert sum(r[1] for r in rows) >= DRIVERS and sum(r[2] for r in rows) >= 1, rows  # it was raced for
    assert not (store / "run.lock").exists() and not (store / "inside").exists()


# ------------------------------------------------------------------ an interrupted stage


@pytest.mark.unit
def test_an_interrupted_training_logs_stopped_not_done(tmp_path, monkeypatch):
    from rich.console import Console
    from rich.progress import Progress as RP

    from splitleak.progress import RichProgress
    from splitleak.training import make_train_config, run_training
    from splitleak.training.roles import ClientRole

    real = ClientRole.exchange
    calls = []

    def exchange(self, *a, **k):
        calls.append(a[2])
        if a[3] == "train" and len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(ClientRole, "exchange", exchange)
    cfg = make_train_config(**{**TINY_RUN, "steps": 8})
    out = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        with RP(console=Console(file=out, force_terminal=False, width=200)) as bars:
            run_training(cfg, tmp_path / "run", device="cpu", progress=RichProgress(bars))
    lines = [" ".join(line.split()) for line in out.getvalue().splitlines() if "━" not in line]
    assert "start: split training (8)" in lines, lines
    assert not any(line.startswith("done: split training") for line in lines), lines
    assert any(line.startswith("stopped: split training at 2/8") for line in lines), lines
