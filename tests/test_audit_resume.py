"""A killed or failed `splitleak audit` resumes (issue 33): `splitleak audit --out A --resume` continues with
the stages the audit had not finished, reuses the finished ones only once their files check against the
audit's record (``stages.json``), refuses a changed or foreign partial result in one line, and writes the
report an uninterrupted audit writes; `compare` marks an audit that did not finish, naming the attacks it
is missing.

The uninterrupted audit is the session's shared tiny audit (tests/conftest.py, ``--draws derived``, so that
an audit of the same settings trains the same run); one audit stopped by an error in its fourth attack is
made once per module with the same options; each test that writes works on its own copy of it."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY_AUDIT
from typer.testing import CliRunner

import splitleak.audit.run as audit_run
from splitleak.cli import app
from splitleak.errors import SplitleakError
from splitleak.report.audit_prose import audit_words
from splitleak.report.compare import compare_runs, table_rows

pytestmark = pytest.mark.e2e  # whole audits on the tiny model
REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()
#: the shared audit's options (conftest.TINY_AUDIT), in run_audit's words
OPTIONS = dict(
    words=audit_words,
    model="tiny-gpt2",
    n_calib=8,
    n_train=8,
    n_eval=12,
    device="cpu",
    draws="derived",
    threads=1,
    epochs=1,  # as TINY_AUDIT
)
CLI = [*TINY_AUDIT, "--quiet"]
#: what differs between two audits of the same settings: timings, and the folder each lives in
VARIES = {"seconds", "tokens_per_second", "train_tokens_per_second", "dir", "torch_threads"}
MISSING = ["joint k=32", "sipit budget=32", "sipit budget=32, trained copy"]


def same_numbers(report: dict) -> dict:
    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in VARIES}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    return strip(report)


def close(a, b, rel: float = 1e-6) -> bool:
    """``a == b``, but floats within ``rel`` of each other (the loss a run measured in another process)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k], rel) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y, rel) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=rel) or (math.isnan(a) and math.isnan(b))
    return a == b


def report_of(out: Path) -> dict:
    return same_numbers(json.loads((out / "report.json").read_text()))


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def whole(tiny_audit) -> Path:
    return tiny_audit("none")


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    """An audit stopped by an error in its fourth attack (joint): the run and three attacks finished."""
    out = tmp_path_factory.mktemp("stopped") / "audit"
    real = audit_run.run_attack

    def failing(run_dir, acfg, **kw):
        if acfg.attack == "joint":
            raise RuntimeError("out of memory in joint")
        return real(run_dir, acfg, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(audit_run, "run_attack", failing)
        with pytest.raises(RuntimeError, match="out of memory"):
            audit_run.run_audit(out, say=lambda _: None, **OPTIONS)
    assert not (out / "report.json").exists()
    return out


@pytest.fixture
def spies(monkeypatch):
    """Count what a resume trains and which attacks it runs."""
    calls: dict[str, list] = {"train": [], "attack": []}
    train, attack = audit_run.run_training, audit_run.run_attack

    def run_training(cfg, out, **kw):
        calls["train"].append(Path(out).name)
        return train(cfg, out, **kw)

    def run_attack(run_dir, acfg, **kw):
        calls["attack"].append(Path(kw["out"]).stem)
        return attack(run_dir, acfg, **kw)

    monkeypatch.setattr(audit_run, "run_training", run_training)
    monkeypatch.setattr(audit_run, "run_attack", run_attack)
    return calls


def test_compare_marks_an_audit_stopped_by_an_error_as_incomplete_naming_the_missing_attacks(stopped, whole):
    runs = compare_runs([whole, stopped])
    assert runs[0].incomplete is None
    assert runs[1].incomplete["missing"] == MISSING and "failed in stage attack joint" in runs[1].incomplete["why"]
    header, rows = table_rows(runs)
    mine = [r for r in rows if r[0] == str(stopped)]
    assert (
        sorted(r[8] for r in mine[:3]) == ["activation k=32", "majority", "vmi"] and [r[8] for r in mine[3:]] == MISSING
    )
    assert [r[9] for r in mine[3:]] == ["incomplete"] * 3 and all(r[9] != "incomplete" for r in mine[:3])
    assert all(r[9] != "incomplete" for r in rows if r[0] == str(whole))
    r = runner.invoke(app, ["compare", str(whole), str(stopped)])
    assert r.exit_code == 0, r.output
    line = next(x for x in r.output.splitlines() if x.startswith("incomplete:"))
    assert str(stopped) in line and "out of memory in joint" in line and ", ".join(MISSING) in line
    assert "--resume" in line and "incomplete:" not in r.output.replace(line, "")


def test_an_audit_stopped_by_an_error_resumes_to_the_uninterrupted_report(stopped, whole, tmp_path, spies):
    out = tmp_path / "audit"
    shutil.copytree(stopped, out)
    kept = _files(out)
    r = runner.invoke(app, ["audit", "--out", str(out), *CLI])  # no --resume: refused, nothing changed
    assert "--resume" in _one_line_error(r) and _files(out) == kept
    r = runner.invoke(app, ["audit", "--out", str(out), "--resume", *CLI])
    assert r.exit_code == 0, r.output
    assert spies["train"] == []  # the finished run is reused, verified
    assert spies["attack"] == ["joint", "sipit", "sipit-trained"]  # only the attacks it had not finished
    for rel in ("attacks/majority.json", "attacks/vmi.parquet", "run/journal.jsonl", "run/metrics.json"):
        assert (out / rel).read_bytes() == kept[rel]
    assert report_of(out) == report_of(whole)
    assert compare_runs([out])[0].incomplete is None
    assert json.loads((out / "stages.json").read_text())["complete"] is True


def _one_line_error(result) -> str:
    """The project's one-line error (the console wraps it; joined back here), no traceback; it may follow the
    audit's note on the depth it chose (the settings are compared once the model gave the depth)."""
    out = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and out.count("error:") == 1, result.output
    assert result.output.lstrip().startswith(("error:", "depth:")), result.output
    return out[out.index("error:") :]


def _refused(args_out: Path, *extra: str) -> str:
    return _one_line_error(runner.invoke(app, ["audit", "--out", str(args_out), "--resume", *CLI, *extra]))


def test_a_resume_refuses_a_changed_or_foreign_partial_result_in_one_line(stopped, tmp_path):
    out = tmp_path / "audit"

    def fresh() -> Path:
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(stopped, out)
        return out

    # a finished attack's result edited after the audit recorded it
    res = json.loads((fresh() / "attacks" / "vmi.json").read_text())
    res["token_recovery"] = 0.01
    (out / "attacks" / "vmi.json").write_text(json.dumps(res))
    before = _files(out)
    line = _refused(out)
    assert "vmi.json" in line and "--force" in line and _files(out) == before
    # the run's metrics edited
    m = json.loads((fresh() / "run" / "metrics.json").read_text())
    (out / "run" / "metrics.json").write_text(json.dumps({**m, "heldout_ce": 0.123}))
    line = _refused(out)
    assert "metrics.json" in line and "does not verify" in line and "--force" in line
    # other settings than the audit was started with
    line = _refused(fresh(), "--seed", "1")
    assert "other settings" in line and "seed" in line and "--force" in line
    # another attack's result put among the audit's
    shutil.copy(fresh() / "attacks" / "vmi.json", out / "attacks" / "foreign.json")
    line = _refused(out)
    assert "foreign.json" in line and "--force" in line
    # the stage record damaged
    (fresh() / "stages.json").write_text("{not json")
    line = _refused(out)
    assert "stages.json" in line and "--force" in line
    # a folder of an older audit, without a stage record
    (fresh() / "stages.json").unlink()
    line = _refused(out)
    assert "stages.json" in line and "--force" in line
    # with --force as well
    line = _refused(fresh(), "--force")
    assert "--resume" in line and "--force" in line


def test_a_resume_on_a_folder_with_no_audit_starts_it(tmp_path, monkeypatch):
    said = []

    def reached(*a, **k):
        raise RuntimeError("training started")

    monkeypatch.setattr(audit_run, "run_training", reached)
    with pytest.raises(RuntimeError, match="training started"):
        audit_run.run_audit(tmp_path / "new", resume=True, say=said.append, **OPTIONS)
    assert any("holds no audit yet" in s for s in said)
    stages = json.loads((tmp_path / "new" / "stages.json").read_text())
    assert stages["stopped"] == {"stage": "run", "error": "training started"} and stages["stages"] == {}
    with pytest.raises(SplitleakError, match="pass --out"):
        r = runner.invoke(app, ["audit", "--resume", *CLI])
        raise SplitleakError(r.output)


def test_a_sigkilled_audit_resumes_to_the_uninterrupted_report(whole, tmp_path, spies):
    out = tmp_path / "audit"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    log = tmp_path / "log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "splitleak.cli", "audit", "--out", str(out), *CLI],
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 300
        while not (out / "attacks" / "vmi.json").exists():  # the run and two attacks written: kill it there
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL and not (out / "report.json").exists()
    state = compare_runs([out])[0].incomplete
    assert "killed" in state["why"] and "sipit budget=32, trained copy" in state["missing"]
    r = runner.invoke(app, ["audit", "--out", str(out), "--resume", *CLI])
    assert r.exit_code == 0, r.output
    assert spies["train"] == [] and "majority" not in spies["attack"] and "sipit-trained" in spies["attack"]
    # the run was trained in another process, whose pretrained loss may differ from this process's in the
    # last digits of a float (seen: 6.40811276 against 6.40811265); every other number is the same
    assert close(report_of(out), report_of(whole))
