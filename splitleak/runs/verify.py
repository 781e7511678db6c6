"""Verifying a run directory: ``verify_run`` re-hashes everything the journal records, checks the
chain, looks for files nobody recorded and names the first problem; ``require_verified`` is the gate
every reader of a run passes (the run verifies, its frames re-encode to what crossed, and it did not
fail)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from splitleak.errors import IntegrityError
from splitleak.files import canonical_json, config_hash, sha256_bytes, sha256_file
from splitleak.runs.journal import CLOSING, GENESIS, JOURNAL, journal_entries, leads_out, path_problem, read_run_json
from splitleak.runs.wire import verify_wire


@dataclass
class VerifyResult:
    ok: bool
    message: str
    entries: int = 0
    files: int = 0
    status: str = ""  # "complete" | "failed" | ""

    def __bool__(self) -> bool:
        return self.ok


class _Broken(Exception):
    """The first problem a step of ``verify_run`` found: its message and how far the check got."""

    def __init__(self, message: str, entries: int = 0, files: int = 0):
        super().__init__(message)
        self.result = VerifyResult(False, message, entries, files)


def verify_run(root: str | Path, *, to_last_entry: bool = False) -> VerifyResult:
    """Re-hash every recorded file, check the chain, and look for unrecorded files.

    ``to_last_entry``: a run that was killed is whole to its journal's last whole entry, and that is what
    is checked (for ``train --resume``, which reads only what those entries record): a last line cut off
    mid-write, the files written for it and temporary files are the kill's and are passed over, and no
    closing entry is needed (``status`` stays ""). Every whole entry, its chain and its files, and links
    out of the run are checked as always."""
    root = Path(root)
    try:
        lines = _journal_lines(root, to_last_entry)
        recorded, status = _check_chain(root, lines)
        if not lines:
            raise _Broken(f"{JOURNAL} is empty")
        leftovers = _check_tree(root, recorded, status, to_last_entry, len(lines))
        if not status and not to_last_entry:
            raise _Broken(
                f"{JOURNAL} ends without a closing entry after {len(lines)} entries: the run was killed or stopped by "
                "an error (a full disk) before it finished, or its last entry was removed"
                + (f" (it left {len(leftovers)} half-written temporary file(s), {leftovers[0]})" if leftovers else ""),
                len(lines),
                len(recorded),
            )
        _check_manifest(root, recorded, len(lines))
    except _Broken as broken:
        return broken.result
    return VerifyResult(
        True,
        f"intact: {len(lines)} journal entries, {len(recorded)} files, run {status}"
        if status
        else f"whole to its last entry: {len(lines)} journal entries, {len(recorded)} files, no closing entry",
        len(lines),
        len(recorded),
        status,
    )


def _journal_lines(root: Path, to_last_entry: bool) -> list[bytes]:
    """The journal's whole lines (without their newlines); with ``to_last_entry`` a last line cut off
    mid-write is dropped, without it refused."""
    try:
        is_dir = root.is_dir()
    except OSError as exc:  # a name too long for the file system
        raise _Broken(f"{str(root)[:80]}… cannot be read ({exc.strerror}); pass a run directory") from None
    if not is_dir:
        raise _Broken(f"{root} is not a directory; pass the folder that `splitleak train --out` wrote")
    jpath = root / JOURNAL
    if not jpath.is_file():
        raise _Broken(f"{root} has no {JOURNAL}; it is not a splitleak run or the journal was deleted")
    lines = jpath.read_bytes().split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    elif to_last_entry:
        lines.pop()  # the entry the kill cut off: its files were never recorded
    else:
        raise _Broken(
            f"{JOURNAL}: the last line is incomplete (no newline); the run was killed while writing it, or the "
            "journal was cut or edited"
        )
    return lines


def _check_chain(root: Path, lines: list[bytes]) -> tuple[dict[str, str], str]:
    """Each entry in canonical form, in sequence, chained to the one before, none after the closing
    entry, and its files whole: the recorded files (name -> digest) and the closing status ("" when none)."""
    prev = GENESIS
    recorded: dict[str, str] = {}
    status = ""
    for n, raw in enumerate(lines):
        where = f"{JOURNAL} line {n + 1}"
        try:
            entry = json.loads(raw)
        except ValueError:  # not JSON, or not UTF-8
            raise _Broken(f"{where}: not valid JSON; the journal is corrupt", n) from None
        if not isinstance(entry, dict) or not isinstance(entry.get("files", {}), dict):
            raise _Broken(f"{where}: not a journal entry (an object with a files mapping)", n)
        if raw + b"\n" != canonical_json(entry) + b"\n":
            raise _Broken(f"{where}: not in canonical form; the entry was edited", n)
        if entry.get("seq") != n:
            raise _Broken(
                f"{where}: sequence number {entry.get('seq')} where {n} was expected; an entry was removed or reordered",
                n,
            )
        if entry.get("prev") != prev:
            raise _Broken(
                f"{where} (entry {n}, {entry.get('kind')}): hash of the previous entry does not match; "
                "an entry before it was removed or changed",
                n,
            )
        if status:
            raise _Broken(f"{where}: entry after the closing '{status}' entry; the journal was appended to", n)
        _check_entry_files(root, entry, where, n, recorded)
        if entry.get("kind") in CLOSING:
            status = entry["kind"]
        prev = sha256_bytes(raw + b"\n")
    return recorded, status


def _check_entry_files(root: Path, entry: dict, where: str, n: int, recorded: dict[str, str]) -> None:
    """The files one entry records: names that stay in the run, each recorded once, present, and
    hashing to its digest; added to ``recorded``."""
    for rel, digest in entry.get("files", {}).items():
        problem = path_problem(root, rel)
        if problem:
            raise _Broken(f"{where}: {problem}", n)
        path = root / rel
        if rel in recorded:
            raise _Broken(f"{where}: {rel} is recorded twice", n)
        if not path.is_file():
            raise _Broken(f"{rel}: recorded in {where} but missing", n)
        if sha256_file(path) != digest:
            raise _Broken(f"{rel}: content differs from the sha256 recorded in {where}; the file was changed", n)
        recorded[rel] = digest


def _check_tree(root: Path, recorded: dict[str, str], status: str, to_last_entry: bool, entries: int) -> list[str]:
    """Every path in the run: no link out of it, and no file the journal does not record (but for the
    journal itself, and what a kill left: hidden temporary files of a run without a closing entry, and
    with ``to_last_entry`` the files of its cut-off entry). Returns the temporary files passed over."""
    leftovers = []  # hidden temporary files of writes a kill cut off (write_atomic's .NAME.PID.tmp)
    for path in sorted(root.rglob("*")):
        if path.is_symlink() and (out := leads_out(root, path)):
            raise _Broken(
                f"{path.relative_to(root).as_posix()}: {out}; a run holds its own files", entries, len(recorded)
            )
        if path.is_file():
            rel = path.relative_to(root).as_posix()
            if not status and path.name.startswith(".") and path.name.endswith(".tmp"):
                leftovers.append(rel)
                continue
            if rel != JOURNAL and rel not in recorded and not (to_last_entry and not status):
                raise _Broken(
                    f"{rel}: present but not recorded in the journal (an entry was removed, or the file was added later)",
                    entries,
                    len(recorded),
                )
    return leftovers


def _check_manifest(root: Path, recorded: dict[str, str], entries: int) -> None:
    """A recorded manifest parses, and its ``config_hash`` is its configuration's."""
    if "manifest.json" not in recorded:
        return
    try:
        m = read_run_json(root, "manifest.json")
    except IntegrityError as exc:
        raise _Broken(str(exc), entries, len(recorded)) from None
    if "config" in m and m.get("config_hash") != config_hash(m["config"]):
        raise _Broken("manifest.json: config_hash does not match its config", entries, len(recorded))


def require_verified(root: str | Path, what: str) -> VerifyResult:
    """``verify_run(root)``, raising IntegrityError when the run does not verify: ``what`` (``the attack``)
    reads nothing from a run whose recorded files, journal or closing entry are not whole."""
    v = verify_run(root)
    if not v.ok:
        raise IntegrityError(
            f"{root} does not verify: {v.message}. {what[0].upper()}{what[1:]} read nothing from it; retrain or restore "
            "the run, or pass --no-verify to read it as it is"
        )
    if v.status == "complete":  # the frames re-encode to what the ledgers say crossed (`splitleak verify` too)
        try:
            verify_wire(root)
        except IntegrityError as exc:
            raise IntegrityError(
                f"{root} does not verify: {exc}. {what[0].upper()}{what[1:]} read nothing from it; retrain or restore "
                "the run, or pass --no-verify to read it as it is"
            ) from None
    if v.status == "failed":
        why = ""
        try:
            info = journal_entries(root)[-1].get("info") or {}
            why = str(info.get("error") or info.get("stage") or "").strip().splitlines()[0][:200] if info else ""
        except (IntegrityError, IndexError):
            pass
        raise IntegrityError(
            f"{root} is intact but the run failed ({why or 'no reason recorded'}): its traffic stops where it failed "
            f"and it has no metrics. {what[0].upper()}{what[1:]} read nothing from it; retrain it, or pass --no-verify "
            "to read what it holds"
        )
    return v
