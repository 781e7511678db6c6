"""The run's ``wire/`` folder read back: the frames the tap (``splitleak.wire.tap``) recorded, each
shard checked against its journal hash, and the check that they are what crossed.

``read_wire`` returns a phase's frames as ``WireRecord``s (the header the tap wrote and the frame),
ordered by link and sequence number; ``check_wire`` re-encodes every stored frame and matches it
against the channel's ledger (``wire/<phase>-ledger.json``), one to one: nothing missing, nothing
extra, nothing changed. A shard that does not parse as the tap wrote it is refused in one line.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from splitleak.errors import IntegrityError
from splitleak.files import sha256_bytes, sha256_file
from splitleak.runs.journal import inside_run, journal_entries, read_run_json
from splitleak.wire.frames import Frame, _metadata, encode
from splitleak.wire.tap import LEDGER_KIND, WIRE_KIND, ledger_name


@dataclass
class WireRecord:
    header: dict[str, Any]
    frame: Frame

    def rows(self, channel: str) -> torch.Tensor | None:
        span = self.header["channels"].get(channel)
        if span is None:
            return None
        return self.frame.tensor[span[0] : span[1]]


def _journal_files(root: Path, kind: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for entry in journal_entries(root):
        if entry.get("kind") == kind:
            out.update(entry.get("files", {}))
    return out


def wire_phases(run_dir: str | Path) -> list[str]:
    """Phases whose traffic the run recorded on the wire, in order of first appearance."""
    files = _journal_files(Path(run_dir), WIRE_KIND)
    phases: list[str] = []
    for rel in files:
        ph = rel.split("/")[-1].rsplit("-", 1)[0]
        if ph not in phases:
            phases.append(ph)
    return phases


def read_wire(run_dir: str | Path, phase: str) -> list[WireRecord]:
    """Every recorded frame of a phase, each shard checked against its journal hash, ordered by
    link and sequence number."""
    root = Path(run_dir)
    files = {rel: h for rel, h in _journal_files(root, WIRE_KIND).items() if rel.startswith(f"wire/{phase}-")}
    records: list[WireRecord] = []
    for rel in sorted(files):
        path = inside_run(root, rel)
        if not path.is_file():
            raise IntegrityError(f"{rel} is recorded in the journal but missing; run `splitleak verify {root}`")
        blob = path.read_bytes()
        if sha256_bytes(blob) != files[rel]:
            raise IntegrityError(f"{rel} does not match its recorded sha256; run `splitleak verify {root}` for details")
        records.extend(_shard_records(root, rel, blob))
    records.sort(key=lambda r: (r.header["link"], r.header["seq"]))
    return records


#: the fields of a frame header in a shard's metadata, and the types the readers rely on
_HEADER_FIELDS: dict[str, tuple[type, ...]] = {
    "seq": (int,),
    "link": (str,),
    "kind": (str,),
    "step": (int,),
    "phase": (str,),
    "row_ids": (list,),
    "payload_bits": (int,),
    "meta": (dict,),
    "blob_sha256": (str,),
    "blob_bytes": (int,),
    "channels": (dict,),
}


def _header_problem(h: Any) -> str | None:
    """What is wrong with one frame header of a shard's metadata, or None."""
    if not isinstance(h, dict):
        return f"a frame header is a JSON {type(h).__name__}, not an object"
    for name, types in _HEADER_FIELDS.items():
        v = h.get(name)
        if not isinstance(v, types) or isinstance(v, bool):
            return f"a frame header's {name!r} is missing or not a {types[0].__name__}"
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in h["row_ids"]):
        return "a frame header's row_ids are not all integers"
    for name, span in h["channels"].items():
        ok = span is None or (
            isinstance(span, list)
            and len(span) == 2
            and all(isinstance(i, int) and not isinstance(i, bool) for i in span)
        )
        if not ok:
            return f"a frame header's channel {name!r} is not a [start, end] row span"
    return None


def _shard_records(root: Path, rel: str, blob: bytes) -> list[WireRecord]:
    """The frames of one capture shard (already checked against its journal hash), or IntegrityError in one
    line naming the shard and what is wrong: a safetensors header that does not parse (a length or offsets
    past the end), no ``frames`` metadata, a frame header without a field or of the wrong type, a tensor
    a header names that is not there, or a frame whose tensors do not fit its header."""

    def bad(what: str) -> IntegrityError:
        return IntegrityError(
            f"{rel}: {what}; the shard was altered under a journal rewritten to match it (or written by another "
            f"tool): run `splitleak verify {root}`, and retrain or restore the run"
        )

    try:
        tensors = st_load(blob)
        meta = _metadata(blob)
    except (SafetensorError, ValueError, TypeError, OverflowError, RuntimeError, AttributeError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
        raise bad(f"not a readable safetensors file ({first})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("frames"), str):
        raise bad("no frames metadata (the frame headers) in its safetensors header")
    try:
        headers = json.loads(meta["frames"])
    except (ValueError, RecursionError):
        raise bad("its frames metadata is not JSON") from None
    if not isinstance(headers, list):
        raise bad(f"its frames metadata is a JSON {type(headers).__name__}, not a list of frame headers")
    records = []
    for i, h in enumerate(headers):
        problem = _header_problem(h)
        if problem:
            raise bad(f"frame {i}: {problem}")
        key = f"{i:06d}"
        if f"{key}/tensor" not in tensors or f"{key}/mask" not in tensors:
            raise bad(f"frame {i}: its tensor or mask is not in the shard")
        try:
            frame = Frame(
                h["kind"],
                h["step"],
                tuple(h["row_ids"]),
                tensors[f"{key}/tensor"],
                tensors[f"{key}/mask"],
                h["phase"],
                labels=tensors.get(f"{key}/labels"),
                payload_bits=h["payload_bits"],
                meta=h["meta"],
            )
        except (ValueError, TypeError, IndexError) as exc:
            raise bad(f"frame {i}: {(str(exc).splitlines() or [''])[0][:160]}") from None
        records.append(WireRecord(h, frame))
    return records


def read_ledger(run_dir: str | Path, phase: str) -> list[dict]:
    root = Path(run_dir)
    files = _journal_files(root, LEDGER_KIND)
    rel = ledger_name(phase)
    if rel not in files:
        raise IntegrityError(
            f"{root} records no wire ledger for phase {phase!r}; the run stopped before it was written"
        )
    path = inside_run(root, rel)
    if not path.is_file() or sha256_file(path) != files[rel]:
        raise IntegrityError(f"{rel} does not match its recorded sha256; run `splitleak verify {root}` for details")

    ledger = read_run_json(root, rel, mapping=False)
    fields = {"link": str, "seq": int, "kind": str, "blob_sha256": str, "blob_bytes": int}
    if not isinstance(ledger, list) or not all(
        isinstance(e, dict)
        and all(isinstance(e.get(k), t) and not isinstance(e.get(k), bool) for k, t in fields.items())
        for e in ledger
    ):
        raise IntegrityError(
            f"{rel} is not a wire ledger (a list of entries with {', '.join(fields)}); run `splitleak verify {root}`"
        )
    return ledger


def check_wire(run_dir: str | Path, phase: str) -> dict[str, Any]:
    """Re-encode every recorded frame of a phase and match it with the channel's ledger one to one.
    Raises IntegrityError naming the first frame that is missing, extra or changed; returns counts."""
    records = read_wire(run_dir, phase)
    ledger = read_ledger(run_dir, phase)
    by_key = {(e["link"], e["seq"]): e for e in ledger}
    seen = set()
    for rec in records:
        key = (rec.header["link"], rec.header["seq"])
        where = f"{phase} frame {key[1]} on link {key[0]} ({rec.header['kind']}, step {rec.header['step']})"
        if key in seen:
            raise IntegrityError(f"{where} is recorded twice")
        seen.add(key)
        entry = by_key.get(key)
        if entry is None:
            raise IntegrityError(
                f"{where} is in the capture but not in the channel's ledger: nothing of that kind crossed"
            )
        digest = hashlib.sha256(encode(rec.frame)).hexdigest()
        if digest != entry["blob_sha256"] or digest != rec.header["blob_sha256"]:
            raise IntegrityError(
                f"{where}: the recorded frame does not re-encode to the bytes that crossed "
                "(a row, the header or the metadata differs)"
            )
    missing = [k for k in by_key if k not in seen]
    if missing:
        link, seq = missing[0]
        e = by_key[(link, seq)]
        raise IntegrityError(
            f"{len(missing)} {phase} frame(s) crossed but are not in the capture; the first: "
            f"frame {seq} on link {link} ({e['kind']})"
        )
    return {"frames": len(records), "bytes": sum(e["blob_bytes"] for e in ledger)}


def verify_wire(run_dir: str | Path) -> str:
    """``check_wire`` for every phase the run recorded; a one-line summary, or IntegrityError."""
    phases = wire_phases(run_dir)
    if not phases:
        return "no wire record (a run written before the tap recorded whole frames)"
    parts = []
    for phase in phases:
        counts = check_wire(run_dir, phase)
        parts.append(f"{phase} {counts['frames']} frames")
    return "the capture re-encodes to what crossed (" + ", ".join(parts) + ")"
