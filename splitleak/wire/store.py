"""A run directory whose every file is recorded in a hash-chained journal.

``journal.jsonl`` has one JSON object per line::

    {"seq": 3, "kind": "wire", "time": "...", "files": {"wire/capture-00000.safetensors": "<sha256>"},
     "info": {...}, "prev": "<sha256 of the previous line's bytes>"}

The first entry's ``prev`` is 64 zeros. A file is written to a temporary name, flushed and renamed
before its entry is appended, so a crash leaves either a recorded file or none. A run that ends
writes a closing entry, ``complete`` or ``failed`` (a failed run stays verifiable: what it wrote
before the failure is intact). ``verify_run`` re-hashes everything and names the first problem.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import shutil
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from splitleak.errors import IntegrityError, SplitleakError

JOURNAL = "journal.jsonl"
GENESIS = "0" * 64
CLOSING = ("complete", "failed")


def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def config_hash(config: dict[str, Any]) -> str:
    return sha256_bytes(canonical_json(config))


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a hidden temporary file beside ``path`` (named by this process), flush it to
    disk and rename it over ``path``: a reader or a crash sees the whole file or none of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:  # a full disk, a size limit, an interrupt: no half-written file stays behind
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename is None:
            exc.filename = str(path)  # a failed write names no file by itself
        raise


def refuse_clobber(out: Path, keep: str | Path | None = None, what: str = "--out") -> None:
    """Refuse (SplitleakError, one line) an ``out`` that is a link, whatever it leads to (splitleak
    writes and deletes only the folder it is given), or that is, holds or lies inside ``keep``."""
    if out.is_symlink():
        raise SplitleakError(
            f"{what} {out} is a link (to {os.readlink(out)}); splitleak neither writes through a link nor deletes "
            "what it leads to: pass the folder itself, or another " + what
        )
    if keep is not None:
        a, b = out.resolve(), Path(keep).resolve()
        if a == b or a.is_relative_to(b) or b.is_relative_to(a):
            raise SplitleakError(
                f"{what} {out} is or holds the run that --resume reads ({keep}), which a new run there would "
                f"replace; choose another {what}"
            )


def is_run_dir(root: Path) -> bool:
    """Whether ``root`` is a folder that splitleak wrote as a run, which ``--force`` may delete: it holds a
    journal (a file, whole or damaged: ``create``'s refusal says which), or only a manifest and temporary
    files (a run killed before its first entry)."""
    if root.is_symlink() or not root.is_dir():
        return False
    jpath = root / JOURNAL
    if jpath.is_file() and not jpath.is_symlink():
        return True
    names = [p.name for p in root.iterdir()]
    return bool(names) and all(n == "manifest.json" or (n.startswith(".") and n.endswith(".tmp")) for n in names)


class RunStore:
    """Append-only writer of a run directory."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._prev = GENESIS
        self._seq = 0
        self._files: set[str] = set()
        self.closed = False

    @classmethod
    def create(cls, root: str | Path, force: bool = False, keep: str | Path | None = None) -> "RunStore":
        """An empty run directory at ``root``. A folder that exists and is not empty is refused (nothing
        already written is replaced) unless ``force`` deletes it first; the refusal says what the folder
        holds: a complete run, a run that failed, or an unfinished one (killed, or failed before it could
        record it), which ``--force`` starts again from the beginning. ``force`` deletes only a run that
        splitleak wrote (``is_run_dir``): a folder of anything else, a link (whatever it leads to) and
        ``keep`` (the run that ``--resume`` reads) are refused in one line."""
        root = Path(root)
        if cls.check_out(root, force, keep):
            shutil.rmtree(root)
        root.mkdir(parents=True, exist_ok=True)
        return cls(root)

    @classmethod
    def check_out(cls, root: str | Path, force: bool = False, keep: str | Path | None = None) -> bool:
        """``create``'s refusals, without creating or deleting anything (a caller checks before it starts
        work): True when ``root`` holds a run that ``force`` is to delete."""
        root = Path(root)
        refuse_clobber(root, keep)
        if not root.exists() or (root.is_dir() and not any(root.iterdir())):
            return False
        if not force:
            raise SplitleakError(cls._refusal(root))
        if not is_run_dir(root):
            raise SplitleakError(
                f"{root} is not a splitleak run (no {JOURNAL}), and --force deletes only a run that splitleak "
                "wrote; choose another --out, or move what is there yourself"
            )
        return True

    @staticmethod
    def _refusal(root: Path) -> str:
        """``create``'s refusal of a non-empty ``root``, in one line: what the folder holds, read cheaply
        from the end of its journal (no file is re-hashed), and the fix."""
        other = "choose another --out, or pass --force to delete it and write a new run there"
        generic = f"{root} already exists and is not empty; {other}"
        again = (
            "pass --force to delete it and start the run again (nothing there is replaced without it), "
            "or choose another --out"
        )
        try:
            if not root.is_dir():
                return generic
            jpath = root / JOURNAL
            if not jpath.is_file():
                names = [p.name for p in root.iterdir()]
                if all(n == "manifest.json" or (n.startswith(".") and n.endswith(".tmp")) for n in names):
                    return f"{root} holds an unfinished run, killed before its first journal entry; {again}"
                return generic
            raw = jpath.read_bytes()
        except OSError:
            return generic
        lines = raw.split(b"\n")
        cut = lines.pop() != b""  # text after the last newline: an entry cut off mid-write
        entries = []
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                entry = None
            if not isinstance(entry, dict):
                return f"{root} holds a run whose {JOURNAL} does not parse (run `splitleak verify {root}`); {other}"
            entries.append(entry)
        kind = entries[-1].get("kind") if entries else None
        info = entries[-1].get("info") if entries else None
        info = info if isinstance(info, dict) else {}
        if kind == "complete" and not cut:
            return f"{root} already holds a complete run ({len(entries)} journal entries); {other}"
        if kind == "failed" and not cut:
            why = str(info.get("error") or info.get("stage") or "no reason recorded").strip()
            return f"{root} holds a run that failed ({(why.splitlines() or [''])[0][:200]}); {again}"
        last = ""
        if entries:
            where = info.get("phase") or info.get("stage")
            last = f", the last of kind {kind!r}" + (f" ({where})" if where else "")
        return (
            f"{root} holds an unfinished run (killed, or failed before it could record it): its {JOURNAL} has "
            f"{len(entries)} whole entries{last}{', then one cut off mid-write' if cut else ''}, and no closing "
            f"entry; {again}"
        )

    # ---------------------------------------------------------------- writing
    def _write_atomic(self, rel: str, data: bytes) -> str:
        if rel in self._files or rel == JOURNAL:
            raise IntegrityError(f"{rel} is already recorded in this run; files are never overwritten")
        write_atomic(self.root / rel, data)
        self._files.add(rel)
        return sha256_bytes(data)

    def add(self, kind: str, files: dict[str, bytes] | None = None, info: dict[str, Any] | None = None) -> dict:
        """Write ``files`` (relative path -> bytes) and append one journal entry recording them."""
        if self.closed:
            raise IntegrityError(f"run {self.root} is closed; nothing more can be added")
        hashes: dict[str, str] = {}
        try:
            for rel, data in (files or {}).items():
                hashes[rel] = self._write_atomic(rel, data)
        except BaseException:  # a write failed (a full disk): the entry's other files go too, unrecorded
            self._forget(hashes)
            raise
        entry = {
            "seq": self._seq,
            "kind": kind,
            "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "files": hashes,
            "info": info or {},
            "prev": self._prev,
        }
        line = canonical_json(entry) + b"\n"
        fd = os.open(self.root / JOURNAL, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.lseek(fd, 0, os.SEEK_END)
            try:
                view = memoryview(line)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            except BaseException as exc:  # the journal ends at its last whole entry, and this entry's files go
                os.ftruncate(fd, size)
                self._forget(hashes)
                if isinstance(exc, OSError) and exc.filename is None:
                    exc.filename = str(self.root / JOURNAL)
                raise
        finally:
            os.close(fd)
        self._prev = sha256_bytes(line)
        self._seq += 1
        if kind in CLOSING:
            self.closed = True
        return entry

    def _forget(self, written: dict[str, str]) -> None:
        """Remove files an entry wrote before it failed: the run stays as its journal's last whole entry left it."""
        for rel in written:
            (self.root / rel).unlink(missing_ok=True)
            self._files.discard(rel)

    def add_json(self, kind: str, rel: str, obj: Any, info: dict[str, Any] | None = None) -> dict:
        return self.add(kind, {rel: json.dumps(obj, indent=2, sort_keys=True).encode() + b"\n"}, info)

    def add_tensors(
        self,
        kind: str,
        rel: str,
        tensors: dict[str, torch.Tensor],
        info: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> dict:
        """Add one safetensors file. ``metadata`` goes into its header as one key, ``splitleak``, holding
        canonical JSON: safetensors writes several metadata keys in hash order, which changes from
        process to process, and a stored file must be the same bytes each time."""
        meta = None if not metadata else {"splitleak": canonical_json(metadata).decode()}
        blob = save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, metadata=meta)
        return self.add(kind, {rel: blob}, info)

    def close(self, ok: bool, info: dict[str, Any] | None = None) -> dict:
        return self.add("complete" if ok else "failed", None, info)


# -------------------------------------------------------------------- verification


@dataclass
class VerifyResult:
    ok: bool
    message: str
    entries: int = 0
    files: int = 0
    status: str = ""  # "complete" | "failed" | ""

    def __bool__(self) -> bool:
        return self.ok


def verify_run(root: str | Path, *, to_last_entry: bool = False) -> VerifyResult:
    """Re-hash every recorded file, check the chain, and look for unrecorded files.

    ``to_last_entry``: a run that was killed is whole to its journal's last whole entry, and that is what
    is checked (for ``train --resume``, which reads only what those entries record): a last line cut off
    mid-write, the files written for it and temporary files are the kill's and are passed over, and no
    closing entry is needed (``status`` stays ""). Every whole entry, its chain and its files, and links
    out of the run are checked as always."""
    root = Path(root)
    try:
        is_dir = root.is_dir()
    except OSError as exc:  # a name too long for the file system
        return VerifyResult(False, f"{str(root)[:80]}… cannot be read ({exc.strerror}); pass a run directory")
    if not is_dir:
        return VerifyResult(False, f"{root} is not a directory; pass the folder that `splitleak train --out` wrote")
    jpath = root / JOURNAL
    if not jpath.is_file():
        return VerifyResult(False, f"{root} has no {JOURNAL}; it is not a splitleak run or the journal was deleted")
    lines = jpath.read_bytes().split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    elif to_last_entry:
        lines.pop()  # the entry the kill cut off: its files were never recorded
    else:
        return VerifyResult(
            False,
            f"{JOURNAL}: the last line is incomplete (no newline); the run was killed while writing it, or the "
            "journal was cut or edited",
        )
    prev = GENESIS
    recorded: dict[str, str] = {}
    status = ""
    for n, raw in enumerate(lines):
        where = f"{JOURNAL} line {n + 1}"
        try:
            entry = json.loads(raw)
        except ValueError:  # not JSON, or not UTF-8
            return VerifyResult(False, f"{where}: not valid JSON; the journal is corrupt", n)
        if not isinstance(entry, dict) or not isinstance(entry.get("files", {}), dict):
            return VerifyResult(False, f"{where}: not a journal entry (an object with a files mapping)", n)
        if raw + b"\n" != canonical_json(entry) + b"\n":
            return VerifyResult(False, f"{where}: not in canonical form; the entry was edited", n)
        if entry.get("seq") != n:
            return VerifyResult(
                False,
                f"{where}: sequence number {entry.get('seq')} where {n} was expected; an entry was removed or reordered",
                n,
            )
        if entry.get("prev") != prev:
            return VerifyResult(
                False,
                f"{where} (entry {n}, {entry.get('kind')}): hash of the previous entry does not match; "
                "an entry before it was removed or changed",
                n,
            )
        if status:
            return VerifyResult(
                False, f"{where}: entry after the closing '{status}' entry; the journal was appended to", n
            )
        for rel, digest in entry.get("files", {}).items():
            problem = path_problem(root, rel)
            if problem:
                return VerifyResult(False, f"{where}: {problem}", n)
            path = root / rel
            if rel in recorded:
                return VerifyResult(False, f"{where}: {rel} is recorded twice", n)
            if not path.is_file():
                return VerifyResult(False, f"{rel}: recorded in {where} but missing", n)
            if sha256_file(path) != digest:
                return VerifyResult(
                    False, f"{rel}: content differs from the sha256 recorded in {where}; the file was changed", n
                )
            recorded[rel] = digest
        if entry.get("kind") in CLOSING:
            status = entry["kind"]
        prev = sha256_bytes(raw + b"\n")
    if not lines:
        return VerifyResult(False, f"{JOURNAL} is empty")
    leftovers = []  # hidden temporary files of writes a kill cut off (write_atomic's .NAME.PID.tmp)
    for path in sorted(root.rglob("*")):
        if path.is_symlink() and (out := _leads_out(root, path)):
            return VerifyResult(
                False,
                f"{path.relative_to(root).as_posix()}: {out}; a run holds its own files",
                len(lines),
                len(recorded),
            )
        if path.is_file():
            rel = path.relative_to(root).as_posix()
            if not status and path.name.startswith(".") and path.name.endswith(".tmp"):
                leftovers.append(rel)
                continue
            if rel != JOURNAL and rel not in recorded and not (to_last_entry and not status):
                return VerifyResult(
                    False,
                    f"{rel}: present but not recorded in the journal (an entry was removed, or the file was added later)",
                    len(lines),
                    len(recorded),
                )
    if not status and not to_last_entry:
        return VerifyResult(
            False,
            f"{JOURNAL} ends without a closing entry after {len(lines)} entries: the run was killed or stopped by an "
            "error (a full disk) before it finished, or its last entry was removed"
            + (f" (it left {len(leftovers)} half-written temporary file(s), {leftovers[0]})" if leftovers else ""),
            len(lines),
            len(recorded),
        )
    if "manifest.json" in recorded:
        try:
            m = read_run_json(root, "manifest.json")
        except IntegrityError as exc:
            return VerifyResult(False, str(exc), len(lines), len(recorded))
        if "config" in m and m.get("config_hash") != config_hash(m["config"]):
            return VerifyResult(
                False, "manifest.json: config_hash does not match its config", len(lines), len(recorded)
            )
    return VerifyResult(
        True,
        f"intact: {len(lines)} journal entries, {len(recorded)} files, run {status}"
        if status
        else f"whole to its last entry: {len(lines)} journal entries, {len(recorded)} files, no closing entry",
        len(lines),
        len(recorded),
        status,
    )


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
    where = _leads_out(Path(root), Path(root) / rel)
    return f"{rel!r} is {where}" if where else None


def _leads_out(root: Path, path: Path) -> str | None:
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
    from splitleak.files import read_json

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
