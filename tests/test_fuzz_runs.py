"""Property-based fuzzing of what `splitleak attack` and `splitleak experiment plan` read (issue 17).

Each example damages one file of a finished tiny run (truncate, flip, insert or delete bytes, empty it,
put a directory or a link out of the run in its place) or one key or value of a spec, and runs the
command in-process. The property: it exits non-zero with the project's one-line error (no traceback),
or succeeds on content that is still valid; it writes nothing into the run, nothing beside it, and no
result file when it fails. With ``--no-verify`` the readers themselves are what stands between the
damage and a traceback."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from splitleak.cli import app
from splitleak.training import make_train_config, run_training

RUN_FILES = (
    "manifest.json",
    "journal.jsonl",
    "documents.json",
    "metrics.json",
    "training.json",
    "client_layers.safetensors",
    "wire/capture-00000.safetensors",
    "wire/capture-ledger.json",
)
OPS = ("truncate", "flip", "insert", "delete", "empty", "directory", "link-out")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("fuzz") / "run"
    run_training(make_train_config(model="tiny-gpt2", depth=1, n_calib=8, n_train=2, n_eval=4, doc_len=16), run)
    return run


def _damage(path: Path, op: str, at: float, byte: int, outside: Path) -> None:
    data = path.read_bytes()
    i = min(len(data) - 1, int(at * len(data)))
    if op == "truncate":
        path.write_bytes(data[:i])
    elif op == "flip":
        path.write_bytes(data[:i] + bytes([data[i] ^ (byte or 1)]) + data[i + 1 :])
    elif op == "insert":
        path.write_bytes(data[:i] + bytes([byte]) + data[i:])
    elif op == "delete":
        path.write_bytes(data[:i] + data[i + 1 :])
    elif op == "empty":
        path.write_bytes(b"")
    elif op == "directory":
        path.unlink()
        path.mkdir()
    elif op == "link-out":
        target = outside / ("elsewhere" + path.suffix)
        target.write_bytes(data)
        path.unlink()
        path.symlink_to(target)


def _digests(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


def _one_line_error(result) -> None:
    assert isinstance(result.exception, SystemExit), f"{type(result.exception).__name__}: {result.output}"
    assert "Traceback" not in result.output
    assert result.output.lstrip().startswith("error:"), result.output


@pytest.mark.integration
@settings(
    max_examples=80,
    deadline=None,
    derandomize=True,  # the same examples on every run and machine
    phases=[Phase.explicit, Phase.generate],  # no shrinking: each example is a whole attack run
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    rel=st.sampled_from(RUN_FILES),
    op=st.sampled_from(OPS),
    at=st.floats(0, 1),
    byte=st.integers(0, 255),
    verify=st.booleans(),
    copy=st.sampled_from(["public", "trained"]),
)
def test_attack_on_a_damaged_run_fails_in_one_line_and_touches_nothing(pristine, rel, op, at, byte, verify, copy):
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        run, outside = tmp / "run", tmp / "outside"
        shutil.copytree(pristine, run)
        outside.mkdir()
        _damage(run / rel, op, at, byte, outside)
        before_run, before_outside = _digests(run), _digests(outside)
        out = tmp / "result.json"
        args = ["attack", str(run), "--attack", "vmi", "--copy", copy, "--out", str(out), "--quiet", "--threads", "1"]
        result = CliRunner().invoke(app, args + ([] if verify else ["--no-verify"]))
        if result.exit_code == 0:
            # content that still parses (a character of a document's text, a file the attack does not read),
            # and only without verify; never a file it reads taken from outside the run
            assert not verify and out.is_file(), result.output
            read = {"manifest.json", "journal.jsonl", "documents.json", "wire/capture-00000.safetensors"}
            assert not (
                op == "link-out" and (rel in read or (rel == "client_layers.safetensors" and copy == "trained"))
            )
        else:
            _one_line_error(result)
            assert not out.exists()
            if verify:  # the journal check comes first and names the run
                assert "does not verify" in result.output or "journal" in result.output
        assert _digests(run) == before_run and _digests(outside) == before_outside
        assert sorted(p.name for p in tmp.iterdir()) == sorted(
            ["run", "outside"] + (["result.json", "result.parquet"] if result.exit_code == 0 else [])
        )


@pytest.mark.integration
@pytest.mark.parametrize(
    "rel, change, words",
    [
        ("manifest.json", lambda b: b[:40], "manifest.json is not valid JSON (line"),
        ("manifest.json", lambda b: b.replace(b'"split"', b'"splot"', 1), "manifest.json: split: Field required"),
        (
            "documents.json",
            lambda b: b.replace(b'"token_ids"', b'"tokens"', 1),
            "documents.json: DocumentSets JSON is missing or mistypes a field (KeyError",
        ),
        ("documents.json", lambda b: b"[]", "documents.json holds a JSON list, not an object"),
        ("wire/capture-00000.safetensors", lambda b: b[:-1] + bytes([b[-1] ^ 1]), "does not match its recorded sha256"),
        ("journal.jsonl", lambda b: b + b"garbage\n", "journal.jsonl has a line that is not JSON"),
    ],
)
def test_without_verify_the_readers_name_the_damaged_file(pristine, tmp_path, rel, change, words):
    run = tmp_path / "run"
    shutil.copytree(pristine, run)
    (run / rel).write_bytes(change((run / rel).read_bytes()))
    args = ["attack", str(run), "--attack", "vmi", "--out", str(tmp_path / "r.json"), "--quiet"]
    verified = CliRunner().invoke(app, args)
    _one_line_error(verified)
    assert "does not verify" in " ".join(verified.output.split())
    unverified = CliRunner().invoke(app, args + ["--no-verify"])
    _one_line_error(unverified)
    assert words in " ".join(unverified.output.split()).replace("/ ", "/")


SPEC = """\
name: fuzz
protocol: shipped:mirage_003
models: [tiny-gpt2]
shielded:
  - {label: none, bottom: 1, top: 1}
  - {label: mirage, bottom: 1, top: 1, chain: {name: mirage, args: {m: 10}}}
victim_seeds: [0, 1]
documents: {n_calib: 8, n_train: 8, n_eval: 8, doc_len: 32}
steps: 8
data: {source: instructions}
attacks:
  - {attack: gma-sl, params: {steps: 50}}
"""


@pytest.mark.unit
@settings(max_examples=60, deadline=None, derandomize=True)
@given(at=st.floats(0, 1), op=st.sampled_from(["truncate", "flip", "insert", "delete"]), byte=st.integers(0, 127))
def test_a_damaged_spec_is_planned_or_refused_in_one_line(at, op, byte):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.yaml"
        path.write_text(SPEC)
        _damage(path, op, at, byte, Path(tmp))
        result = CliRunner().invoke(app, ["experiment", "plan", str(path)])
        if result.exit_code != 0:
            _one_line_error(result)
        assert sorted(p.name for p in Path(tmp).iterdir()) == ["fuzz.yaml"]  # planning writes nothing
