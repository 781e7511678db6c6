"""The tap: every frame that crosses, recorded as encoded, in the run's capture store.

``WireRecorder`` is a channel tap (``splitleak.wire.channel``). It receives every crossing of a
phase — training steps and the capture pass alike, every frame kind, every row, with its header
(kind, step, row ids, mask, labels where they cross, metadata) — names the channels the frame
carries (``splitleak.wire.declare``), refuses a channel the run did not declare, and writes the
frames in safetensors shards ``wire/<phase>-NNNNN.safetensors``: tensors ``NNNNNN/tensor``,
``NNNNNN/mask`` and ``NNNNNN/labels``, and the headers as JSON in the shard's metadata. Each header
keeps the SHA-256 and length of the blob that crossed; the channel's own ledger of blobs is written
beside them (``wire/<phase>-ledger.json``).

The tap writes through a ``RunSink``, an append-only record of files; the run directory's
``splitleak.runs.store.RunStore`` is one. The readers of what it wrote, and the check that it is what
crossed, are in ``splitleak.runs.wire``.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import torch
from safetensors.torch import save as st_save

from splitleak.errors import IntegrityError
from splitleak.wire.channel import Crossing
from splitleak.wire.declare import Declaration, check_declared
from splitleak.wire.frames import Frame

WIRE_KIND = "wire"
LEDGER_KIND = "wire-ledger"
SHARD_BYTES = 32 << 20


def shard_name(phase: str, n: int) -> str:
    return f"wire/{phase}-{n:05d}.safetensors"


def ledger_name(phase: str) -> str:
    return f"wire/{phase}-ledger.json"


class RunSink(Protocol):
    """Where the tap writes: an append-only record of files, each added once under a kind and its info
    (``splitleak.runs.store.RunStore``, which journals them)."""

    def add(self, kind: str, files: dict[str, bytes] | None = None, info: dict[str, Any] | None = None) -> Any: ...

    def add_json(self, kind: str, rel: str, obj: Any, info: dict[str, Any] | None = None) -> Any: ...


class WireRecorder:
    """A tap that writes every crossing of one phase into ``store``. ``close(ledgers)`` flushes the
    last shard and writes the channels' ledgers."""

    def __init__(self, store: RunSink, phase: str, declaration: Declaration, shard_bytes: int = SHARD_BYTES):
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
