"""``verify`` and the run readers cannot be walked around (issue 33): a journal path that leads out of the
run, a link that loops, a safetensors shard or frame header damaged under a journal forged to match it,
and the readers that must read only verified runs."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest
from damage import fuzz, one_line_error
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from splitleak.cli import app
from splitleak.errors import IntegrityError, SplitleakError
from splitleak.files import canonical_json
from splitleak.runs.journal import inside_run, read_recorded
from splitleak.runs.verify import verify_run
from splitleak.runs.wire import verify_wire

TINY = dict(model="tiny-gpt2", depth=1, n_calib=8, n_train=2, n_eval=4, doc_len=16)
SHARD = "wire/capture-00000.safetensors"


def forge(run: Path, rename: dict[str, str] | None = None) -> None:
    """Rewrite the journal of ``run`` to match its files as they are now: every recorded file re-hashed
    (a name in ``rename`` recorded under its new name), the chain recomputed. What a forger does."""
    rename = rename or {}
    lines = (run / "journal.jsonl").read_bytes().splitlines()
    prev, out = "0" * 64, []
    for raw in lines:
        entry = json.loads(raw)
        files = {}
        for rel in entry["files"]:
            rel = rename.get(rel, rel)
            files[rel] = hashlib.sha256((run / rel).read_bytes()).hexdigest()
        entry["files"], entry["prev"] = files, prev
        line = canonical_json(entry) + b"\n"
        out.append(line)
        prev = hashlib.sha256(line).hexdigest()
    (run / "journal.jsonl").write_bytes(b"".join(out))


@pytest.fixture
def run(shared_run, tmp_path) -> Path:
    """A private copy of a tiny complete run (the shared one is read only)."""
    copy = tmp_path / "run"
    shutil.copytree(shared_run(**TINY), copy, symlinks=True)
    assert verify_run(copy).ok
    return copy


def _verify(run: Path):
    return CliRunner().invoke(app, ["verify", str(run)])


def _attack(run: Path, *extra: str):
    out = run.parent / "result.json"
    return CliRunner().invoke(
        app, ["attack", str(run), "--attack", "vmi", "--out", str(out), "--quiet", "--threads", "1", *extra]
    )


# ---------------------------------------------------------------- journal paths out of the run


@pytest.mark.integration
@pytest.mark.parametrize("name", ["../outside.json", "wire/../../outside.json", "/OUTSIDE/outside.json"])
def test_a_journal_path_out_of_the_run_does_not_verify_and_is_not_read(run, name):
    outside = run.parent / "outside.json"
    (run / "manifest.json").rename(outside)
    name = name.replace("/OUTSIDE", str(run.parent))
    forge(run, {"manifest.json": name})
    res = verify_run(run)
    assert not res.ok and name in res.message and "out of the run" in res.message, res.message
    with pytest.raises(IntegrityError, match="out of the run"):
        read_recorded(run, name)
    with pytest.raises(IntegrityError, match="out of the run"):
        inside_run(run, name)


@pytest.mark.unit
@pytest.mark.parametrize("name", ["wire/./capture-00000.safetensors", "wire//capture-00000.safetensors"])
def test_a_journal_path_not_in_normal_form_does_not_verify(run, name):
    forge(run, {SHARD: name})
    res = verify_run(run)
    assert not res.ok, res.message
    assert "normal form" in res.message or "out of the run" in res.message, res.message


# ---------------------------------------------------------------- links that loop


@pytest.mark.integration
def test_a_link_that_loops_fails_verify_and_attack_in_one_line(run):
    (run / "loop").symlink_to(run / "loop")
    result = _verify(run)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "loop" in result.output
    (run / "loop").unlink()
    (run / "manifest.json").unlink()
    (run / "manifest.json").symlink_to(run / "manifest.json")
    assert not verify_run(run).ok
    one_line_error(_attack(run, "--no-verify"))
    one_line_error(_attack(run))


# ---------------------------------------------------------------- damaged shards under a forged journal


def _header(blob: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def _shard(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def _offsets_past_the_end(blob: bytes) -> bytes:
    header, body = _header(blob)
    key = next(k for k in header if k != "__metadata__")
    header[key]["data_offsets"] = [len(body) - 4, len(body) + 4096]
    return _shard(header, body)


def _frames(change):
    def edit(blob: bytes) -> bytes:
        header, body = _header(blob)
        frames = json.loads(header["__metadata__"]["frames"])
        header["__metadata__"]["frames"] = json.dumps(change(frames))
        return _shard(header, body)

    return edit


def _no_frames(blob: bytes) -> bytes:
    header, body = _header(blob)
    del header["__metadata__"]["frames"]
    return _shard(header, body)


DAMAGES = {
    "offsets past the end": _offsets_past_the_end,
    "a 2^62 header length": lambda b: struct.pack("<Q", 1 << 62) + b[8:],
    "no frames metadata": _no_frames,
    "a frame without step": _frames(lambda fs: [{k: v for k, v in f.items() if k != "step"} for f in fs]),
    "frames not a list": _frames(lambda fs: {"0": fs[0]}),
    "a frame's channels a list": _frames(lambda fs: [{**f, "channels": [1, 2]} for f in fs]),
}


@pytest.mark.integration
@pytest.mark.parametrize("what", list(DAMAGES))
def test_a_damaged_shard_under_a_forged_journal_fails_verify_and_attack_in_one_line(run, what):
    (run / SHARD).write_bytes(DAMAGES[what]((run / SHARD).read_bytes()))
    forge(run)
    assert verify_run(run).ok  # the journal matches: only the shard's own reader can tell
    result = _verify(run)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "FAILED" in result.output and SHARD in " ".join(result.output.split()).replace("/ ", "/"), result.output
    one_line_error(_attack(run))
    one_line_error(_attack(run, "--no-verify"))


@pytest.mark.integration
def test_damaged_client_layers_under_a_forged_journal_fail_the_trained_copy_in_one_line(run):
    rel = "client_layers.safetensors"
    (run / rel).write_bytes(_offsets_past_the_end((run / rel).read_bytes()))
    forge(run)
    result = _attack(run, "--copy", "trained")
    one_line_error(result)
    assert rel in result.output


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def fuzz_run(tmp_path_factory) -> Path:
    from splitleak.training import make_train_config, run_training

    run = tmp_path_factory.mktemp("walk") / "run"
    run_training(make_train_config(**TINY), run, device="cpu")
    return run


@pytest.mark.integration
@fuzz(120)
@given(
    where=st.sampled_from(["length", "header", "tensor", "metadata", "frame"]),
    key=st.sampled_from(
        ["dtype", "shape", "data_offsets", "frames", "step", "kind", "seq", "link", "row_ids", "channels", "meta"]
    ),
    value=_JSON,
    length=st.integers(0, 2**64 - 1),
)
def test_a_fuzzed_shard_header_or_frame_metadata_is_read_or_refused_in_one_line(fuzz_run, where, key, value, length):
    """The safetensors header and the frame metadata of a capture shard, changed under a forged journal:
    ``verify_wire`` (what `verify` and `attack` run) returns or raises the project's IntegrityError, never
    another exception."""
    blob = (fuzz_run / SHARD).read_bytes()
    header, body = _header(blob)
    if where == "length":
        new = struct.pack("<Q", length) + blob[8:]
    else:
        frames = json.loads(header["__metadata__"]["frames"])
        if where == "header":
            header[key] = value
        elif where == "tensor":
            header[next(k for k in header if k != "__metadata__")][key] = value
        elif where == "metadata":
            header["__metadata__"][key] = value if isinstance(value, str) else json.dumps(value)
        else:
            frames[0][key] = value
            header["__metadata__"]["frames"] = json.dumps(frames)
        try:
            new = _shard(header, body)
        except ValueError:  # NaN, out of range: not JSON a forger could write either
            return
    (fuzz_run / SHARD).write_bytes(new)
    try:
        forge(fuzz_run)
        try:
            verify_wire(fuzz_run)
        except SplitleakError as exc:
            assert "\n" not in str(exc)
    finally:
        (fuzz_run / SHARD).write_bytes(blob)
        forge(fuzz_run)


# ---------------------------------------------------------------- compare reads only verified runs


@pytest.mark.integration
@pytest.mark.parametrize("value", [0.123, float("nan")])
def test_compare_marks_a_run_whose_metrics_were_edited_as_unverified(run, value):
    metrics = json.loads((run / "metrics.json").read_text())
    metrics["heldout_ce"] = value
    (run / "metrics.json").write_text(json.dumps(metrics))
    result = CliRunner().invoke(app, ["compare", str(run)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "unverified" in text, result.output
    assert "0.1230" not in text and "nan" not in text.lower(), result.output


@pytest.mark.integration
def test_compare_prints_a_verified_run_s_measured_loss(run):
    from splitleak.report.compare import compare_runs, table_rows

    ce = json.loads((run / "metrics.json").read_text())["heldout_ce"]
    [summary] = compare_runs([run])
    assert summary.unverified is None
    _, rows = table_rows([summary])
    assert rows[0][4] == f"{ce:.4f}" and "unverified" not in " ".join(rows[0])


# ---------------------------------------------------------------- another run's client layers


@pytest.mark.integration
def test_client_layers_of_another_run_under_a_rehashed_journal_are_refused_naming_the_run(run, shared_run):
    other = shared_run(**{**TINY, "seed": 1})
    rel = "client_layers.safetensors"
    assert (other / rel).read_bytes() != (run / rel).read_bytes()
    shutil.copyfile(other / rel, run / rel)
    forge(run)
    assert verify_run(run).ok  # the journal matches the copied file: only the binding to the run can tell
    for extra in ([], ["--no-verify"]):
        result = _attack(run, "--copy", "trained", *extra)
        one_line_error(result)
        text = " ".join(result.output.split()).replace("/ ", "/")
        assert str(run) in text and "another run" in text, result.output
    assert _attack(run, "--copy", "public").exit_code == 0  # the public copy does not read them


# ---------------------------------------------------------------- places that cannot be folders


LONG = "a" * 300


@pytest.mark.integration
def test_a_name_too_long_or_a_path_under_a_file_is_refused_in_one_line(shared_run, tmp_path):
    src = shared_run(**TINY)
    afile = tmp_path / "afile"
    afile.write_text("x")
    verify = CliRunner().invoke(app, ["verify", str(tmp_path / LONG)])
    assert verify.exit_code == 1 and "Traceback" not in verify.output, verify.output
    assert "too long" in " ".join(verify.output.split()), verify.output
    one_line_error(CliRunner().invoke(app, ["compare", str(tmp_path / LONG)]))
    for out in (afile / "r.json", tmp_path / f"{LONG}.json"):
        result = CliRunner().invoke(app, ["attack", str(src), "--attack", "vmi", "--out", str(out), "--quiet"])
        one_line_error(result)
    train = ["train", "--model", "tiny-gpt2", "--depth", "1", "--n-calib", "8", "--n-train", "2", "--n-eval", "4"]
    for out in (afile / "run", tmp_path / LONG):
        result = CliRunner().invoke(app, [*train, "--quiet", "--device", "cpu", "--out", str(out)])
        one_line_error(result)
    assert afile.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
