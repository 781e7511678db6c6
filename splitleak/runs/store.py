"""The writer of a run directory: every file recorded in the hash-chained journal
(``splitleak.runs.journal``).

A file is written to a temporary name, flushed and renamed before its entry is appended, so a crash
leaves either a recorded file or none. A run that ends writes a closing entry, ``complete`` or
``failed`` (a failed run stays verifiable: what it wrote before the failure is intact). The tap
(``splitleak.wire.tap``) writes the frames that crossed through a ``RunStore``, which satisfies its
``RunSink``.
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from splitleak.errors import IntegrityError, SplitleakError
from splitleak.files import canonical_json, sha256_bytes, write_atomic
from splitleak.runs.journal import CLOSING, GENESIS, JOURNAL


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
