"""Moving a job's files between the driver's results store and a Ray node that does not see it.

A Ray task runs its job in a private scratch store on its node (``SPLITLEAK_SCRATCH``, default the
system's temporary folder) and returns what the job wrote there as a parcel: each file's path in the
store, its bytes and its SHA-256. The driver checks the names and the digests and writes the files
into its own store: a train job's run directory whole (a temporary folder, verified, then renamed into
place) before the row file that marks the job done. Nothing is shared on disk, and the store's lock,
claims and exactly-once rule stay with the driver, the only writer of its store.

An attack job reads its run: the driver parcels the run directory and its train job's row file once
per run (the executor ``ray.put``s it), and the task unpacks that into its scratch store and checks it
with ``verify_run`` (the journal's hash chain, every recorded file re-hashed) before reading anything.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from splitleak.errors import IntegrityError
from splitleak.experiments.store import ResultsStore
from splitleak.files import sha256_bytes, write_atomic
from splitleak.runs.journal import path_problem
from splitleak.runs.verify import verify_run

#: where a Ray task makes its private scratch store (default: the system's temporary folder)
SCRATCH_ENV = "SPLITLEAK_SCRATCH"


def scratch_root() -> Path:
    root = Path(os.environ.get(SCRATCH_ENV) or tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    return root


def parcel(root: Path, rels: list[str]) -> dict[str, Any]:
    """The files ``rels`` (paths relative to ``root``) as ``{"files": {rel: bytes}, "sha256": {rel: hex}}``."""
    files = {rel: (root / rel).read_bytes() for rel in rels}
    return {"files": files, "sha256": {rel: sha256_bytes(data) for rel, data in files.items()}}


def opened(p: dict[str, Any], what: str) -> dict[str, bytes]:
    """A parcel's files, each checked against the digest it was sent with (IntegrityError otherwise)."""
    files, digests = p.get("files"), p.get("sha256")
    if not isinstance(files, dict) or not isinstance(digests, dict) or set(files) != set(digests):
        raise IntegrityError(f"{what} arrived without a digest for each of its files")
    for rel, data in files.items():
        if not isinstance(data, bytes) or sha256_bytes(data) != digests[rel]:
            raise IntegrityError(f"{what}: {rel} arrived with another sha256 than it was sent with")
    return files


def _rel(store: ResultsStore, path: Path) -> str:
    return path.relative_to(store.root).as_posix()


def _run_files(store: ResultsStore, train_key: str) -> list[str]:
    """The files of a run directory (temporary files of a cut-off write left out), relative to the store."""
    run_dir = store.run_dir(train_key)
    return sorted(
        _rel(store, p)
        for p in run_dir.rglob("*")
        if p.is_file() and not (p.name.startswith(".") and p.name.endswith(".tmp"))
    )


def _split_run(store: ResultsStore, train_key: str, files: dict[str, bytes], what: str) -> dict[str, bytes]:
    """The run directory's files of a parcel, by their path in the run; a name that is neither a file
    of the run nor its train job's row file is refused."""
    prefix = _rel(store, store.run_dir(train_key)) + "/"
    row = _rel(store, store.path("train", train_key))
    out = {}
    for rel in files:
        if rel == row:
            continue
        sub = rel[len(prefix) :] if rel.startswith(prefix) else None
        if sub is None or path_problem(store.run_dir(train_key), sub):
            raise IntegrityError(f"{what} holds {rel!r}, which is not a file of run {train_key[:12]}")
        out[sub] = files[rel]
    return out


def run_parcel(store: ResultsStore, train_key: str) -> dict[str, Any]:
    """What an attack job of this run reads: the whole run directory and the train job's row file."""
    return parcel(store.root, _run_files(store, train_key) + [_rel(store, store.path("train", train_key))])


def unpack_run(p: dict[str, Any], store: ResultsStore, train_key: str) -> None:
    """Write a run's parcel into a (scratch) store and verify the run directory it holds."""
    what = f"the run parcel of train job {train_key[:12]}"
    files = opened(p, what)
    row = _rel(store, store.path("train", train_key))
    if row not in files:
        raise IntegrityError(f"{what} holds no row file of its train job")
    for sub, data in _split_run(store, train_key, files, what).items():
        write_atomic(store.run_dir(train_key) / sub, data)
    write_atomic(store.path("train", train_key), files[row])
    _check_run(store.run_dir(train_key), f"{what}, unpacked")


def _check_run(run_dir: Path, what: str) -> None:
    v = verify_run(run_dir)
    if not v.ok or v.status != "complete":
        raise IntegrityError(f"{what}: the run directory does not verify ({v.message})")


def outputs_parcel(store: ResultsStore, job: dict[str, Any]) -> dict[str, Any]:
    """What a finished job wrote into its scratch store: its row file (read back first: whole, of the
    job's schema and key), and a train job's run directory."""
    kind = "train" if job["kind"] == "train" else "attack"
    store.read_job(kind, job["key"])
    rels = _run_files(store, job["key"]) if kind == "train" else []
    return parcel(store.root, rels + [_rel(store, store.path(kind, job["key"]))])


def deliver(store: ResultsStore, job: dict[str, Any], p: dict[str, Any]) -> None:
    """Write a job's returned files into the driver's store: a train job's run directory whole and
    verified, then the row file that marks the job done. A job already done keeps its first result."""
    if store.is_done(job):
        return
    kind = "train" if job["kind"] == "train" else "attack"
    what = f"the result of job {job['key'][:12]}"
    files = opened(p, what)
    row = _rel(store, store.path(kind, job["key"]))
    if row not in files:
        raise IntegrityError(f"{what} holds no row file")
    if kind == "train":
        _place_run(store, job["key"], _split_run(store, job["key"], files, what))
    elif set(files) != {row}:
        raise IntegrityError(f"{what} holds files other than its row file: {sorted(set(files) - {row})}")
    write_atomic(store.path(kind, job["key"]), files[row])


def _place_run(store: ResultsStore, train_key: str, files: dict[str, bytes]) -> None:
    """Write a run directory into a hidden temporary folder beside its place, verify it, and rename it
    into place (replacing what a killed earlier attempt left there): the store holds a whole run or none."""
    final = store.run_dir(train_key)
    final.parent.mkdir(parents=True, exist_ok=True)
    for old in final.parent.glob(f".{final.name}.*.tmp"):  # a driver killed while placing this run
        shutil.rmtree(old, ignore_errors=True)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        for sub, data in files.items():
            write_atomic(tmp / sub, data)
        _check_run(tmp, f"the run directory of train job {train_key[:12]}, as it arrived")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
