"""Where an attack's result goes: ``--out`` checked before anything runs, and RESULT.json with its
predictions written whole, atomically and under a lock (shared by every kind of attack)."""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa

from splitleak.errors import SplitleakError
from splitleak.files import json_default, parquet_bytes, write_atomic
from splitleak.runs.journal import JOURNAL


def check_result_out(out: Path, force: bool, *runs: str | Path | None) -> None:
    """Refuse, in one line and before an attack runs, an ``--out`` its result cannot go to: one that ends in
    ``.parquet`` (the name of its own predictions, written beside it), lies inside a run (``runs``, or any
    folder with a journal: a file added to a run makes it fail ``verify``), cannot be created (a file where
    a folder belongs), is a folder, or exists already without ``force``."""
    if out.suffix.lower() == ".parquet":
        raise SplitleakError(
            f"--out {out} ends in .parquet, the name the result's own predictions take beside it; give the result a "
            ".json name"
        )
    where = out.resolve()
    inside = [Path(r) for r in runs if r is not None and where.is_relative_to(Path(r).resolve())]
    inside += [a for a in where.parents if (a / JOURNAL).exists()]
    if inside:
        raise SplitleakError(
            f"--out {out} lies inside the run {inside[0]}, which holds only what it recorded (a file added there "
            "makes it fail `splitleak verify`); write the result outside it"
        )
    if out.is_dir():
        raise SplitleakError(f"--out {out} is a folder; name the result's file (RESULT.json) in it")
    if (out.exists() or out.is_symlink()) and not force:
        raise SplitleakError(f"{out} already exists; choose another --out or pass --force")
    above = next((a for a in out.absolute().parents if a.exists()), None)
    if above is None or not above.is_dir():
        raise SplitleakError(f"--out {out} cannot be created: {above} is not a folder; choose another --out")


def write_result(
    out_path: Path, result: dict[str, Any], per_doc_rows: list[dict[str, Any]], *, force: bool = True
) -> None:
    """RESULT.json and its predictions (``.parquet`` beside it, with page checksums and a content digest,
    its SHA-256 recorded in RESULT.json as ``predictions_sha256``), each written whole to a temporary
    file of this process, flushed to disk and renamed into place (``write_atomic``), the predictions
    first: a job killed at any point leaves no partial file under either name and no RESULT.json without
    its predictions. Temporary files that a killed writer of the same result left behind are removed;
    they never block a rerun.

    Both files are written under an exclusive lock on their folder (``flock``), so that two attacks with
    the same ``--out`` never mix their files; without ``force`` a RESULT.json that another attack wrote
    meanwhile is refused, and nothing is written."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    pq_path = out_path.with_suffix(".parquet")
    flat = []
    for row in per_doc_rows:
        r = {}
        for k, v in row.items():
            r[k] = json.dumps(v, sort_keys=True) if isinstance(v, dict) else v
        flat.append(r)
    data = parquet_bytes(pa.Table.from_pylist(flat) if flat else pa.table({}))
    result = dict(result)
    result["predictions"] = pq_path.name
    result["predictions_sha256"] = hashlib.sha256(data).hexdigest()
    text = json.dumps(result, indent=2, sort_keys=True, default=json_default) + "\n"  # before any file is written
    fd = os.open(out_path.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # one writer of results in this folder at a time; freed when fd closes
        if not force and (out_path.exists() or out_path.is_symlink()):
            raise SplitleakError(
                f"{out_path} already exists (another attack wrote it while this one ran); nothing was written: "
                "choose another --out, or pass --force to replace it"
            )
        write_atomic(pq_path, data)
        write_atomic(out_path, text.encode())
        for path in (pq_path, out_path):
            _remove_stale_temps(path)
    finally:
        os.close(fd)


def _remove_stale_temps(path: Path) -> None:
    """Delete the temporary files of ``path`` (``.NAME.PID.tmp``, or ``.NAME.tmp`` of earlier versions)
    whose writing process is gone: what a job killed mid-write left behind."""
    stale = [path.with_name(f".{path.name}.tmp")]
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid = tmp.name[len(path.name) + 2 : -len(".tmp")]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            stale.append(tmp)
    for tmp in stale:
        if tmp.is_file() and not tmp.is_symlink():
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True
