"""The journal of a run directory and the readers of what it records.

``journal.jsonl`` has one JSON object per line::

    {"seq": 3, "kind": "wire", "time": "...", "files": {"wire/capture-00000.safetensors": "<sha256>"},
     "info": {...}, "prev": "<sha256 of the previous line's bytes>"}

The first entry's ``prev`` is 64 zeros (``GENESIS``); a run ends with a closing entry, ``complete``
or ``failed`` (``CLOSING``). The writer is ``splitleak.runs.store.RunStore``; ``verify_run``
(``splitleak.runs.verify``) checks the whole chain. The readers here read one file of a run: each
stays inside the run (no ``..``, no link out of it), and ``read_recorded`` checks a file's bytes
against the digest the journal records before anything is parsed.
"""

from __future__ import annotations

import json
import posixpath
from pathlib import Path
from typing import TYPE_CHECKING, Any

from splitleak.errors import IntegrityError
from splitleak.files import read_json, sha256_bytes

if TYPE_CHECKING:  # torch loads only when a tensor file is read: the JSON readers stay torch-free
    import torch

JOURNAL = "journal.jsonl"
GENESIS = "0" * 64
CLOSING = ("complete", "failed")


def path_problem(root: Path, rel: object) -> str | None:
    """What is wrong with ``rel`` as the name of a file of the run ``root`` (None when nothing): a journal
    records each file by its relative POSIX path in normal form, which stays in the run (``..``, an
    absolute path or a link on the way would let a run's files live elsewhere, unverified)."""
    if not isinstance(rel, str):
        return f"{rel!r} is not a file name"
    parts = rel.split("/")
    if rel.startswith("/") or ".." in parts or "\\" in rel:
        return f"{rel!r} is a path out of the run directory; a run records only its own files"
    if not rel or posixpath.normpath(rel) != rel or "." in parts:
        return f"{rel!r} is not a relative path in normal form (no empty, '.' or '..' parts); the journal was edited"
    where = leads_out(Path(root), Path(root) / rel)
    return f"{rel!r} is {where}" if where else None


def leads_out(root: Path, path: Path) -> str | None:
    """Why ``path`` (under ``root``) does not stay in the run: a link that loops or one that leads out of
    it (at any part of the path); None when it stays in."""
    try:
        inside = path.resolve().is_relative_to(root.resolve())
    except (RuntimeError, OSError):  # a link that loops (Python 3.11 raises RuntimeError, later OSError)
        return "a link that loops (it leads to itself)"
    return None if inside else "a link out of the run directory"


def inside_run(root: Path, rel: str) -> Path:
    """``root / rel``, refused (IntegrityError) when ``rel`` is not a path in normal form that stays in the
    run (``..``, an absolute path), or leads through a link that loops or leads out of the run directory: a
    run is self-contained, and what lies outside it is not what the journal vouches for."""
    root = Path(root)
    problem = path_problem(root, rel)
    if problem:
        raise IntegrityError(
            f"{root}: {problem}; splitleak reads no file of a run from elsewhere: put the file itself there, or "
            f"run `splitleak verify {root}`"
        )
    return root / rel


def read_run_json(root: str | Path, rel: str, *, mapping: bool = True) -> Any:
    """A JSON file of a run directory (``manifest.json``, ``metrics.json``, ``documents.json`` …), or an
    IntegrityError in one line naming the file, what is wrong and the fix: missing, a directory, a link
    out of the run, not UTF-8, not JSON (with line and column), or (``mapping``) not an object."""
    root = Path(root)
    path = inside_run(root, rel)
    fix = f"run `splitleak verify {root}` to see what else changed, or rerun what wrote it"
    return read_json(path, rel, fix, mapping=mapping)


def journal_entries(root: str | Path) -> list[dict[str, Any]]:
    """The journal's entries, parsed, for the readers that look things up in it (``verify_run`` checks the
    chain itself). IntegrityError in one line when the journal is missing, a link out of the run, or has a
    line that is not a JSON object with a ``files`` mapping of names to digests."""
    root = Path(root)
    journal = inside_run(root, JOURNAL)
    if not journal.is_file():
        raise IntegrityError(
            f"{root} has no {JOURNAL} (or it is not a file); pass a run directory written by `splitleak train`"
        )
    out = []
    for n, raw in enumerate(journal.read_bytes().splitlines()):
        try:
            entry = json.loads(raw)
        except ValueError:  # not JSON, or not UTF-8
            raise IntegrityError(f"{journal} has a line that is not JSON; run `splitleak verify {root}`") from None
        files = entry.get("files", {}) if isinstance(entry, dict) else None
        if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
            raise IntegrityError(
                f"{journal} line {n + 1} is not a journal entry (an object whose files map names to digests); "
                f"run `splitleak verify {root}`"
            )
        out.append(entry)
    return out


def recorded_digest(root: str | Path, rel: str) -> str | None:
    """The SHA-256 the journal records for ``rel``, or None when it records none."""
    expected = None
    for entry in journal_entries(root):
        if rel in entry.get("files", {}):
            expected = entry["files"][rel]
    return expected


def read_recorded(root: str | Path, rel: str) -> bytes:
    """The bytes of a recorded file, checked against the journal's SHA-256 first."""
    root = Path(root)
    expected = recorded_digest(root, rel)
    if expected is None:
        raise IntegrityError(f"{rel} is not recorded in {root / JOURNAL}; run `splitleak verify {root}`")
    path = inside_run(root, rel)
    if not path.is_file():
        raise IntegrityError(
            f"{path} is recorded in the journal but missing or not a file; run `splitleak verify {root}`"
        )
    data = path.read_bytes()
    if sha256_bytes(data) != expected:
        raise IntegrityError(f"{rel} does not match its recorded sha256; run `splitleak verify {root}` for details")
    return data


def read_tensors(root: str | Path, rel: str) -> dict[str, torch.Tensor]:
    """Load a recorded safetensors file, checking its sha256 against the journal first."""
    return read_tensors_and_metadata(root, rel)[0]


def read_tensors_and_metadata(root: str | Path, rel: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A recorded safetensors file (its sha256 checked against the journal first): its tensors and the
    metadata ``RunStore.add_tensors`` wrote (``{}`` when it wrote none). IntegrityError in one line when
    the file is not a readable safetensors file or its metadata is not the JSON object it wrote."""
    # lazy: safetensors.torch loads torch, which the JSON readers here (loaded by `splitleak --help`) do without
    from safetensors import SafetensorError
    from safetensors.torch import load

    data = read_recorded(root, rel)
    try:
        tensors = load(data)
        n = int.from_bytes(data[:8], "little")
        meta = (json.loads(data[8 : 8 + n].decode("utf-8")).get("__metadata__") or {}).get("splitleak")
        meta = {} if meta is None else json.loads(meta)
        if not isinstance(meta, dict):
            raise ValueError("its splitleak metadata is not a JSON object")
        return tensors, meta
    except (SafetensorError, ValueError, TypeError, OverflowError, RuntimeError, AttributeError) as exc:
        raise IntegrityError(
            f"{Path(root) / rel} is not a readable safetensors file ({str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__}); "
            f"the file was altered under a journal rewritten to match it: run `splitleak verify {root}`, and retrain "
            "or restore the run"
        ) from None
