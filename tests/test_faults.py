"""Full disks and read-only places (issue 17): a write that fails gives one line that names the file and
the fix, and leaves the run or the store as its last whole entry left it.

A full disk is simulated with a file-size limit on the child process (``RLIMIT_FSIZE``: a write past it
fails with EFBIG, as one on a full disk fails with ENOSPC; Python ignores the SIGXFSZ that comes with it).
A read-only place is a folder the child cannot write: mode 0555, and when the tests run as root (whom modes
do not stop) the child drops the capabilities that let root ignore them (CAP_DAC_OVERRIDE and
CAP_DAC_READ_SEARCH leave its bounding set before it runs Python); and a read-only file system, a tmpfs
mounted read-only in a private mount namespace of the child (``unshare -m``), where that is allowed."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from splitleak.audit.protocol import SHIPPED
from splitleak.runs.verify import verify_run

TINY = ["--model", "tiny-gpt2", "--depth", "2", "--n-calib", "4", "--n-train", "4", "--n-eval", "4"]
TINY += ["--doc-len", "16", "--threads", "1", "--quiet"]
PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 24, 1, 2


def _cli(args: list[str], *, fsize: int | None = None, no_override: bool = False, prefix: tuple[str, ...] = ()):
    def limit() -> None:
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        if no_override and os.geteuid() == 0:  # root then obeys file modes like any user
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
                if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                    os._exit(97)

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [*prefix, sys.executable, "-m", "splitleak.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit,
    )


def _one_line(r, *words: str) -> str:
    err = " ".join(r.stderr.split())
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and err.startswith("error:"), r.stderr
    for w in words:
        assert w in err, err
    return err


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.e2e
def test_train_on_a_full_disk_stops_in_one_line_and_leaves_the_run_whole_to_its_last_entry(tmp_path):
    run = tmp_path / "run"
    # 100 KiB: the manifest, documents and wire shards fit (about 40 KiB each); the client layers (about
    # 420 KiB) do not
    r = _cli(["train", "--out", str(run), *TINY], fsize=100 * 1024)
    err = _one_line(r, "cannot write", "client_layers.safetensors", "File too large", "free space on that disk")
    assert str(run) in err
    v = verify_run(run)
    # every entry the journal holds is whole and every file it records is there unchanged, nothing
    # half-written or unrecorded lies beside them, and the run is closed as failed (issue 33), its closing
    # entry naming the stage, the steps done and the cause (the closing line is small enough to fit)
    assert v.ok and v.status == "failed", v.message
    assert v.entries >= 5 and not [p for p in run.rglob("*") if p.name.endswith(".tmp")]
    assert not (run / "client_layers.safetensors").exists()
    recorded = set()
    lines = (run / "journal.jsonl").read_text().splitlines()
    for line in lines:
        recorded |= set(json.loads(line)["files"])
    assert {p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file()} == recorded | {"journal.jsonl"}
    closing = json.loads(lines[-1])["info"]
    assert closing["stage"] == "writing the client layers" and closing["steps_done"] == 4
    assert "File too large" in closing["error"]
    # the disk has room again: the rerun (with --force, after the refusal that names the failed run)
    r = _cli(["train", "--out", str(run), *TINY])
    _one_line(r, "holds a run that failed", "File too large")
    r = _cli(["train", "--out", str(run), *TINY, "--force"])
    assert r.returncode == 0, r.stderr
    assert verify_run(run).ok


@pytest.mark.unit
def test_a_journal_append_cut_by_a_full_disk_is_rolled_back_to_the_last_whole_entry(tmp_path):
    """The journal's own append fails part-way: the journal is truncated back, the entry's files removed."""
    from splitleak.runs.store import RunStore

    code = f"""
import resource, sys
from pathlib import Path
from splitleak.runs.store import RunStore
s = RunStore.create(Path({str(tmp_path / "run")!r}))
s.add_json("manifest", "manifest.json", {{"config": {{}}}})
size = (Path({str(tmp_path / "run")!r}) / "journal.jsonl").stat().st_size
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 40, size + 40))  # the next entry's file fits, its line does not
try:
    s.add_json("documents", "documents.json", {{"x": 1}})
except OSError as exc:
    print("EFBIG" if exc.errno == 27 else exc)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "EFBIG", r.stdout + r.stderr
    run = tmp_path / "run"
    assert sorted(_files(run)) == ["journal.jsonl", "manifest.json"]
    v = verify_run(run)
    assert v.entries == 1 and "ends without a closing entry after 1 entries" in v.message, v.message
    s = RunStore.create(run, force=True)  # and the folder is still an ordinary unfinished run to redo
    assert not any(s.root.iterdir())


SPEC = """\
name: disk
protocol: proto.yaml
model: tiny-gpt2
depths: [2]
defences: [none]
victim_seeds: [1]
documents: {n_calib: 4, n_train: 4, n_eval: 4, doc_len: 16}
steps: 2
attacks:
  - {attack: vmi, inference: true}
"""


@pytest.mark.e2e
def test_a_grid_on_a_full_disk_records_the_failure_and_resumes_when_there_is_room(tmp_path):
    from splitleak.experiments import plan_grid, read_results

    spec = tmp_path / "disk.yaml"
    spec.write_text(SPEC)
    shutil.copy(SHIPPED / "paper_main.yaml", tmp_path / "proto.yaml")
    store = tmp_path / "store"
    args = ["experiment", "run", str(spec), "--store", str(store), "--workers", "1", "--threads", "1", "--quiet"]
    r = _cli(args, fsize=100 * 1024)  # the train job's client layers do not fit; its failure row does
    assert r.returncode == 1, r.stdout + r.stderr
    failed = read_results(store, "failed", as_rows=True)
    g = plan_grid(spec)
    train = g.of_kind("train")[0]
    by_key = {f["key"]: f for f in failed}
    assert by_key[train.key]["error_type"] == "OSError" and "File too large" in by_key[train.key]["error"]
    assert {f["error_type"] for k, f in by_key.items() if k != train.key} == {"skipped"}
    assert read_results(store, "train").num_rows == 0 and read_results(store).num_rows == 0
    assert not [p for p in store.rglob("*") if p.name.endswith(".tmp")]
    r = _cli(args)  # room again: the grid resumes and finishes, the failure rows cleared
    assert r.returncode == 0, r.stdout + r.stderr
    assert read_results(store, "train").num_rows == 1 and read_results(store, "failed").num_rows == 0
    assert {row["key"] for row in read_results(store, as_rows=True)} == {j.key for j in g.jobs if j.kind != "train"}


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    """A finished tiny run, a frozen protocol and a grid spec beside it, and an empty folder to make
    read-only."""
    base = tmp_path_factory.mktemp("place")
    run = base / "run"
    r = _cli(["train", "--out", str(run), *TINY])
    assert r.returncode == 0, r.stderr
    shutil.copy(SHIPPED / "paper_main.yaml", base / "proto.yaml")
    assert _cli(["protocol", "freeze", str(base / "proto.yaml")]).returncode == 0  # frozen before, by its owner
    (base / "spec.yaml").write_text(SPEC)
    return base


def _refusals(base: Path, ro: Path, words: tuple[str, ...], *, every_command: bool = True, **kw) -> None:
    run = base / "run"
    before = _files(base)
    _one_line(_cli(["train", "--out", str(ro / "run"), *TINY], **kw), *words)
    if every_command:  # the same guard ends every command; the permission case runs them all
        _one_line(_cli(["attack", str(run), "--attack", "vmi", "--out", str(ro / "r.json"), "--quiet"], **kw), *words)
        _one_line(_cli(["experiment", "run", str(base / "spec.yaml"), "--store", str(ro / "store")], **kw), *words)
    assert _files(base) == before


@pytest.mark.e2e
def test_a_folder_without_write_permission_is_refused_in_one_line_and_nothing_is_written(place, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        probe = _cli(["models"], no_override=True)
        assert probe.returncode == 0, probe.stderr
        _refusals(
            place, ro, ("cannot write", str(ro), "Permission denied", "read-only for this user"), no_override=True
        )
        assert not any(ro.iterdir())
    finally:
        ro.chmod(0o755)


@pytest.mark.e2e
def test_a_read_only_file_system_is_refused_in_one_line_and_nothing_is_written(place, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    mount = ("unshare", "-m", "sh", "-c", f'mount -t tmpfs -o ro none "{ro}" && exec "$0" "$@"')
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here: the read-only file system case needs a private mount namespace")
    probe = subprocess.run([*mount, "true"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs in a private namespace here: {probe.stderr.strip()[-200:]}")
    words = ("cannot write", str(ro), "Read-only file system", "read-only for this user")
    _refusals(place, ro, words, every_command=False, prefix=mount)
    assert not any(ro.iterdir())  # the mount was the child's alone; the folder itself is untouched
