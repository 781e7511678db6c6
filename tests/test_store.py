import json
import shutil

import pytest
from typer.testing import CliRunner

from splitleak.cli import app
from splitleak.errors import IntegrityError, SplitleakError
from splitleak.runs.captures import load_capture
from splitleak.runs.journal import JOURNAL
from splitleak.runs.store import RunStore
from splitleak.runs.verify import verify_run
from splitleak.training import make_train_config, run_training

runner = CliRunner()


@pytest.fixture(scope="module")
def fresh_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs") / "run"
    cfg = make_train_config(
        model="tiny-gpt2", depth=2, n_calib=4, n_train=6, n_eval=70, seed=0, all_local_baseline=False
    )
    run_training(cfg, root, device="cpu")
    return root


@pytest.fixture
def run_copy(fresh_run, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(fresh_run, dst)
    return dst


def _journal(run):
    return (run / JOURNAL).read_bytes().splitlines(keepends=True)


@pytest.mark.integration
def test_fresh_run_verifies(fresh_run):
    v = verify_run(fresh_run)
    assert v.ok and v.status == "complete", v.message
    files = {p.relative_to(fresh_run).as_posix() for p in fresh_run.rglob("*") if p.is_file()}
    assert {
        "manifest.json",
        "documents.json",
        "metrics.json",
        "training.json",
        "client_layers.safetensors",
        "wire/train-00000.safetensors",
        "wire/train-ledger.json",
        "wire/capture-00000.safetensors",
        "wire/capture-ledger.json",
    } <= files
    assert v.files == len(files) - 1  # everything but the journal itself is recorded
    r = runner.invoke(app, ["verify", str(fresh_run)])
    text = " ".join(r.output.split())
    assert r.exit_code == 0 and "intact" in text
    assert "re-encodes to what crossed (train 12 frames, capture 10 frames)" in text  # 6 steps; 5 batches


@pytest.mark.integration
def test_manifest_records_config_hash_versions_and_fingerprint(fresh_run):
    m = json.loads((fresh_run / "manifest.json").read_text())
    from splitleak.files import config_hash

    assert m["config_hash"] == config_hash(m["config"]) and len(m["config_hash"]) == 64
    assert m["packages"]["torch"] and m["packages"]["transformers"]
    assert len(m["model"]["fingerprint"]) == 64 and m["split"]["cut"] == 2


@pytest.mark.integration
@pytest.mark.parametrize(
    "target", ["wire/capture-00000.safetensors", "wire/train-ledger.json", "manifest.json", "client_layers.safetensors"]
)
def test_one_flipped_byte_is_found(run_copy, target):
    path = run_copy / target
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    v = verify_run(run_copy)
    assert not v.ok and v.message.startswith(target) and "changed" in v.message
    r = runner.invoke(app, ["verify", str(run_copy)])
    assert r.exit_code == 1 and target in r.output
    if target.endswith(".safetensors") and target.startswith("wire"):
        with pytest.raises(IntegrityError, match="does not match its recorded sha256"):
            load_capture(run_copy)


@pytest.mark.integration
@pytest.mark.parametrize("which", ["first", "middle", "last"])
def test_removed_journal_entry_is_found(run_copy, which):
    lines = _journal(run_copy)
    idx = {"first": 0, "middle": len(lines) // 2, "last": len(lines) - 1}[which]
    del lines[idx]
    (run_copy / JOURNAL).write_bytes(b"".join(lines))
    v = verify_run(run_copy)
    assert not v.ok
    expected = {"first": "sequence number", "middle": "sequence number", "last": "closing entry"}[which]
    assert expected in v.message, v.message


@pytest.mark.integration
def test_edited_journal_entry_is_found(run_copy):
    lines = _journal(run_copy)
    entry = json.loads(lines[2])
    entry["info"]["note"] = "edited"
    lines[2] = json.dumps(entry, sort_keys=True, separators=(",", ":")).encode() + b"\n"
    (run_copy / JOURNAL).write_bytes(b"".join(lines))
    v = verify_run(run_copy)
    assert not v.ok and "line 4" in v.message and "previous entry" in v.message


@pytest.mark.integration
def test_unrecorded_file_is_found(run_copy):
    (run_copy / "wire" / "extra.safetensors").write_bytes(b"x")
    v = verify_run(run_copy)
    assert not v.ok and "wire/extra.safetensors" in v.message and "not recorded" in v.message


@pytest.mark.integration
def test_missing_file_and_not_a_run(run_copy, tmp_path):
    (run_copy / "metrics.json").unlink()
    assert "metrics.json: recorded" in verify_run(run_copy).message
    assert not verify_run(tmp_path / "nowhere").ok
    (tmp_path / "empty").mkdir()
    assert "no journal.jsonl" in verify_run(tmp_path / "empty").message


@pytest.mark.unit
def test_store_never_overwrites(tmp_path):
    s = RunStore.create(tmp_path / "r")
    s.add("a", {"x.json": b"{}"})
    with pytest.raises(IntegrityError, match="never overwritten"):
        s.add("b", {"x.json": b"[]"})
    s.close(True)
    with pytest.raises(IntegrityError, match="closed"):
        s.add("c", {"y.json": b"{}"})
    with pytest.raises(SplitleakError, match="--force"):
        RunStore.create(tmp_path / "r")
    assert verify_run(tmp_path / "r").ok
    RunStore.create(tmp_path / "r", force=True)
    assert list((tmp_path / "r").iterdir()) == []


_WRITE_LAYERS = """
import sys, torch
from splitleak.runs.store import RunStore
s = RunStore.create(sys.argv[1])
meta = {"model": "m", "cut": 2, "a": 1, "b": [1, 2], "c": "x", "d": None}
s.add_tensors("layers", "layers.safetensors", {"w": torch.arange(6.0).reshape(2, 3)}, metadata=meta)
s.close(True)
"""


@pytest.mark.integration
def test_a_tensor_file_with_metadata_is_the_same_bytes_in_every_process(tmp_path):
    """safetensors writes several metadata keys in hash order, which differs between processes; the
    store folds them into one canonical key."""
    import subprocess
    import sys

    from safetensors import safe_open

    for name in ("a", "b", "c"):
        subprocess.run([sys.executable, "-c", _WRITE_LAYERS, str(tmp_path / name)], check=True, timeout=120)
    blobs = {(tmp_path / n / "layers.safetensors").read_bytes() for n in ("a", "b", "c")}
    assert len(blobs) == 1
    with safe_open(str(tmp_path / "a" / "layers.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["splitleak"]) == {
            "model": "m",
            "cut": 2,
            "a": 1,
            "b": [1, 2],
            "c": "x",
            "d": None,
        }
