"""The tap: every frame that crosses, recorded as encoded, in the run's capture store.

``WireRecorder`` is a channel tap (``splitleak.wire.channel``). It receives every crossing of a
phase — training steps and the capture pass alike, every frame kind, every row, with its header
(kind, step, row ids, mask, labels where they cross, metadata) — names the channels the frame
carries (``splitleak.wire.declare``), refuses a channel the run did not declare, and writes the
frames in safetensors shards ``wire/<phase>-NNNNN.safetensors``: tensors ``NNNNNN/tensor``,
``NNNNNN/mask`` and ``NNNNNN/labels``, and the headers as JSON in the shard's metadata. Each header
keeps the SHA-256 and length of the blob that crossed; the channel's own ledger of blobs is written
beside them (``wire/<phase>-ledger.json``). ``check_wire`` re-encodes every stored frame and
matches it against the ledger, one to one: nothing missing, nothing extra, nothing changed.

``exchanges`` reads the frames back as the exchanges of one link (a forward frame and everything
that answers it) and splits each frame's rows into its channels.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from splitleak.errors import IntegrityError
from splitleak.wire.channel import Crossing
from splitleak.wire.declare import Declaration, check_declared
from splitleak.wire.frames import Frame, _metadata, encode
from splitleak.wire.store import RunStore, inside_run, journal_entries, read_run_json, sha256_bytes, sha256_file

WIRE_KIND = "wire"
LEDGER_KIND = "wire-ledger"
SHARD_BYTES = 32 << 20


def shard_name(phase: str, n: int) -> str:
    return f"wire/{phase}-{n:05d}.safetensors"


def ledger_name(phase: str) -> str:
    return f"wire/{phase}-ledger.json"


class WireRecorder:
    """A tap that writes every crossing of one phase into ``store``. ``close(ledgers)`` flushes the
    last shard and writes the channels' ledgers."""

    def __init__(self, store: RunStore, phase: str, declaration: Declaration, shard_bytes: int = SHARD_BYTES):
        self.store = store
        self.phase = phase
        self.declaration = declaration
        self.shard_bytes = shard_bytes
        self._buffer: list[tuple[dict[str, Any], Frame]] = []
        self._bytes = 0
        self._shards = 0
        self.frames = 0
        self._probe_rows: dict[str, int] = {}

    def __call__(self, crossing: Crossing) -> None:
        frame = crossing.frame
        if frame.phase != self.phase:
            raise IntegrityError(f"the {self.phase} tap received a frame of phase {frame.phase!r}")
        if frame.kind == "forward":
            self._probe_rows[crossing.link] = int(frame.meta.get("probe_rows", 0))
        probe = self._probe_rows.get(crossing.link, 0) if frame.kind == "backward" else None
        channels = check_declared(frame, self.declaration, crossing.link, probe)
        header = {
            "seq": crossing.seq,
            "link": crossing.link,
            "direction": crossing.direction,
            "kind": frame.kind,
            "step": frame.step,
            "phase": frame.phase,
            "row_ids": list(frame.doc_ids),
            "payload_bits": frame.payload_bits,
            "meta": frame.meta,
            "blob_sha256": crossing.blob_sha256,
            "blob_bytes": crossing.blob_bytes,
            "channels": {k: (list(v) if v is not None else None) for k, v in channels.items()},
        }
        self.frames += 1
        self._buffer.append((header, frame))
        self._bytes += crossing.blob_bytes
        if self._bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        if not self._buffer:
            return
        tensors: dict[str, torch.Tensor] = {}
        headers = []
        for i, (header, frame) in enumerate(self._buffer):
            tensors[f"{i:06d}/tensor"] = frame.tensor.detach().cpu().contiguous()
            tensors[f"{i:06d}/mask"] = frame.mask.cpu().contiguous()
            if frame.labels is not None:
                tensors[f"{i:06d}/labels"] = frame.labels.cpu().contiguous()
            headers.append(header)
        blob = st_save(tensors, metadata={"frames": json.dumps(headers, sort_keys=True)})
        rel = shard_name(self.phase, self._shards)
        self.store.add(WIRE_KIND, {rel: blob}, {"phase": self.phase, "frames": len(headers)})
        self._shards += 1
        self._buffer.clear()
        self._bytes = 0

    def close(self, ledgers: list[list[dict]]) -> None:
        self.flush()
        entries = [e for ledger in ledgers for e in ledger if e["phase"] == self.phase]
        self.store.add_json(LEDGER_KIND, ledger_name(self.phase), entries, {"phase": self.phase})


# -------------------------------------------------------------------- reading


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
    from safetensors import SafetensorError

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


# -------------------------------------------------------------------- exchanges


@dataclass
class Exchange:
    """One forward frame and the frames that answer it, on one link."""

    forward: WireRecord
    replies: list[WireRecord]

    def reply(self, kind: str) -> WireRecord | None:
        return next((r for r in self.replies if r.header["kind"] == kind), None)


def exchanges(records: list[WireRecord], link: str) -> list[Exchange]:
    out: list[Exchange] = []
    for rec in records:
        if rec.header["link"] != link:
            continue
        if rec.header["kind"] == "forward":
            out.append(Exchange(rec, []))
        elif not out:
            raise IntegrityError(f"a {rec.header['kind']!r} frame on link {link} precedes every forward frame")
        else:
            out[-1].replies.append(rec)
    return out


def links_of(records: list[WireRecord]) -> list[str]:
    return sorted({r.header["link"] for r in records})


def stack_channel(
    exs: list[Exchange], kind: str, channel: str, rows_per_exchange: list[int] | None = None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One channel's rows concatenated over exchanges, and a bool mask of the exchanges' rows that
    carry it. Where an exchange does not carry the channel (mixup's unmixed warm-up steps carry no
    probe rows) its rows are zero and the mask False; ``rows_per_exchange`` gives their count (the
    document rows of each exchange). Returns (None, None) when no exchange carries it."""
    parts: list[torch.Tensor | None] = []
    present: list[torch.Tensor] = []
    any_found = False
    for i, ex in enumerate(exs):
        rec = ex.forward if kind == "forward" else ex.reply(kind)
        rows = None if rec is None else rec.rows(channel)
        n = rows_per_exchange[i] if rows_per_exchange is not None else (0 if rows is None else rows.shape[0])
        if rows is None:
            parts.append(None)
            present.append(torch.zeros(n, dtype=torch.bool))
            continue
        if rows.shape[0] != n:
            raise IntegrityError(
                f"channel {channel} carries {rows.shape[0]} rows in an exchange of {n} documents; "
                "its rows cannot be paired with the documents by position"
            )
        any_found = True
        parts.append(rows)
        present.append(torch.ones(n, dtype=torch.bool))
    if not any_found:
        return None, None
    like = next(p for p in parts if p is not None)
    full = [
        p if p is not None else like.new_zeros((n, *like.shape[1:]))
        for p, n in zip(parts, [m.numel() for m in present])
    ]
    return torch.cat(full), torch.cat(present)
