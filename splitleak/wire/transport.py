"""Messages of the two-process deployment, and the checks a receiver makes before it allocates.

A message is ``SLK1`` + a 4-byte little-endian header length + a JSON header + a payload. Frame
messages carry the frame's encoded blob (``splitleak.wire.frames.encode``: itself a length-prefixed
JSON header with dtype, shape and offsets of each tensor, then the raw little-endian tensors), so
the bytes that cross are exactly the bytes the in-process channel hashes into its ledger. The
envelope header names the kind, step, phase, row ids, dtype and shape, a 128-bit random nonce and a
sequence number and, from protocol 2 on, the session id the server's welcome gave (every later
message of either side carries it, and the receiver refuses another: a message recorded in one
session is never accepted in another).

``check_frame_message`` validates all of it against the limits agreed in the handshake *before*
the tensors are decoded: the envelope agrees with the blob's own header, dtypes are allowed, the
width is the model's, rows and tokens are within bounds, the offsets match the payload's length. A
``ReplayGuard`` refuses a nonce seen before and a sequence number outside the sliding window. No
pickle anywhere.
"""

from __future__ import annotations

import json
import math
import secrets
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from splitleak.errors import NonFiniteError, SplitleakError
from splitleak.wire.frames import KINDS, PHASES, Frame, decode

#: 2: every message after the handshake carries the session id of the welcome (``session``)
PROTOCOL_VERSION = 2
MAGIC = b"SLK1"
MAX_HEADER_BYTES = 1 << 20
#: what a message may hold beyond its frame: the prefix, the header length and the largest header
ENVELOPE_BYTES = 8 + MAX_HEADER_BYTES
#: the largest message before the welcome (a hello, a welcome or an error: a header and no payload)
HANDSHAKE_MESSAGE_BYTES = ENVELOPE_BYTES

PROBE_FACTOR = 2  # mixup may add probe rows: at most as many as the real ones

#: safetensors dtype names a frame may carry, and their sizes in bytes
DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
TENSOR_KEYS = ("tensor", "mask", "labels")


class TransportError(SplitleakError):
    """A message that breaks the protocol, or a peer that went away."""


def pack(header: dict[str, Any], payload: bytes = b"") -> bytes:
    h = json.dumps(header, sort_keys=True).encode("utf-8")
    return MAGIC + len(h).to_bytes(4, "little") + h + payload


def unpack(message: bytes | str) -> tuple[dict[str, Any], bytes]:
    if isinstance(message, str):
        raise TransportError("a text message arrived; the protocol sends binary messages only")
    if len(message) < 8 or message[:4] != MAGIC:
        raise TransportError("a message without the SLK1 prefix arrived (not a splitleak peer, or a corrupt frame)")
    n = int.from_bytes(message[4:8], "little")
    if n > MAX_HEADER_BYTES or 8 + n > len(message):
        raise TransportError(f"a message header claims {n} bytes but the message holds {len(message) - 8}")
    try:
        header = json.loads(message[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TransportError(f"a message header is not JSON ({exc})") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise TransportError("a message header is not an object with a type")
    return header, bytes(message[8 + n :])


def new_nonce() -> str:
    return secrets.token_hex(16)  # 128 bits


@dataclass(frozen=True)
class Limits:
    """What the receiver accepts, fixed by the handshake. ``max_frame_bytes``: the server's own cap
    on one frame's bytes (``serve --max-frame-mib``), below the bound the rows and tokens give."""

    width: int
    max_tokens: int
    max_rows: int
    float_dtype: str
    max_frame_bytes: int | None = None

    def max_payload_bytes(self) -> int:
        per_row = self.max_tokens * (self.width * DTYPES["F64"] + 2 * DTYPES["I64"])
        bound = self.max_rows * per_row + FRAME_HEADER_SLACK
        return bound if self.max_frame_bytes is None else min(bound, self.max_frame_bytes)

    def max_message_bytes(self) -> int:
        """The largest message of the session: a frame at the limit in its envelope (the WebSocket cap)."""
        return self.max_payload_bytes() + ENVELOPE_BYTES

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "width": self.width,
            "max_tokens": self.max_tokens,
            "max_rows": self.max_rows,
            "float_dtype": self.float_dtype,
        }
        if self.max_frame_bytes is not None:
            out["max_frame_bytes"] = self.max_frame_bytes
        return out


#: room for a frame's own safetensors header (dtypes, shapes, offsets, the frame metadata)
FRAME_HEADER_SLACK = 1 << 16


def frame_bytes(rows: int, tokens: int, width: int, float_dtype: str) -> int:
    """The bytes of the largest frame of ``rows`` x ``tokens`` x ``width`` in ``float_dtype``
    (``torch.float32`` or ``F32``), with its mask, labels and header: what a hello's sizes imply."""
    name = _ST_NAME.get(float_dtype, float_dtype)
    return rows * tokens * (width * DTYPES.get(name, DTYPES["F64"]) + 2 * DTYPES["I64"]) + FRAME_HEADER_SLACK


def frame_header(frame: Frame, blob: bytes, seq: int) -> dict[str, Any]:
    t = frame.tensor
    return {
        "type": "frame",
        "seq": seq,
        "nonce": new_nonce(),
        "kind": frame.kind,
        "step": frame.step,
        "phase": frame.phase,
        "doc_ids": list(frame.doc_ids),
        "dtype": _ST_NAME.get(str(t.dtype), str(t.dtype)),
        "shape": list(t.shape),
        "payload_bytes": len(blob),
    }


_ST_NAME = {
    "torch.float64": "F64",
    "torch.float32": "F32",
    "torch.float16": "F16",
    "torch.bfloat16": "BF16",
    "torch.int64": "I64",
    "torch.int32": "I32",
}


def _int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TransportError(f"{what} is {v!r}, not an integer")
    return v


def check_frame_message(header: dict[str, Any], payload: bytes, limits: Limits, allowed_kinds: tuple[str, ...]):
    """Refuse a frame message that breaks the limits, before any tensor is decoded."""
    kind = header.get("kind")
    if kind not in KINDS:
        raise TransportError(f"unknown frame kind {kind!r}; expected one of {', '.join(KINDS)}")
    if kind not in allowed_kinds:
        raise TransportError(f"a {kind!r} frame may not be sent in this direction")
    if header.get("phase") not in PHASES:
        raise TransportError(f"unknown phase {header.get('phase')!r}")
    _int(header.get("step"), "the step")
    declared = _int(header.get("payload_bytes"), "payload_bytes")
    if declared != len(payload):
        raise TransportError(f"the header says the payload holds {declared} bytes, but {len(payload)} arrived")
    if len(payload) > limits.max_payload_bytes():
        raise TransportError(
            f"a payload of {len(payload)} bytes exceeds the session's limit {limits.max_payload_bytes()}"
        )
    if len(payload) < 8:
        raise TransportError("a truncated frame: the payload is shorter than its own header length")
    n = int.from_bytes(payload[:8], "little")
    if n > MAX_HEADER_BYTES or 8 + n > len(payload):
        raise TransportError(f"a truncated frame: its tensor header claims {n} bytes, {len(payload) - 8} arrived")
    try:
        st_header = json.loads(payload[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TransportError(f"the frame's tensor header is not JSON ({exc})") from None
    if not isinstance(st_header, dict):
        raise TransportError("the frame's tensor header is not an object")
    body = len(payload) - 8 - n
    entries = {k: v for k, v in st_header.items() if k != "__metadata__"}
    unknown = sorted(set(entries) - set(TENSOR_KEYS))
    if unknown or "tensor" not in entries or "mask" not in entries:
        raise TransportError(f"the frame carries tensors {sorted(entries)}; expected tensor, mask and maybe labels")
    end = 0
    shapes: dict[str, list[int]] = {}
    for key, e in entries.items():
        if not isinstance(e, dict):
            raise TransportError(f"the entry of {key!r} in the frame's tensor header is not an object")
        dtype = e.get("dtype")
        if dtype not in DTYPES:
            raise TransportError(f"{key} has dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
        shape = e.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise TransportError(f"{key} has shape {shape!r}, not a list of sizes")
        offsets = e.get("data_offsets")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise TransportError(f"{key} has data_offsets {offsets!r}")
        size = math.prod(shape) * DTYPES[dtype]
        if offsets[1] - offsets[0] != size or offsets[0] < 0 or offsets[1] > body:
            raise TransportError(
                f"{key} of shape {shape} and dtype {dtype} needs {size} bytes at {offsets}, and the payload "
                f"holds {body}: a truncated frame, or a header that lies about its payload"
            )
        end = max(end, offsets[1])
        shapes[key] = shape
    if end != body:
        raise TransportError(f"the frame's tensors end at byte {end} but the payload holds {body}")
    t = shapes["tensor"]
    if len(t) != 3:
        raise TransportError(f"the frame tensor has shape {t}; expected [rows, tokens, width]")
    rows, tokens, width = t
    if width != limits.width:
        raise TransportError(f"the frame tensor has width {width}; the handshake agreed on {limits.width}")
    if rows > limits.max_rows or tokens > limits.max_tokens:
        raise TransportError(
            f"the frame tensor has {rows} rows x {tokens} tokens; the session allows at most "
            f"{limits.max_rows} x {limits.max_tokens}"
        )
    if entries["tensor"]["dtype"] not in FLOAT_DTYPES:
        raise TransportError(f"the frame tensor has dtype {entries['tensor']['dtype']}; expected a float type")
    if shapes["mask"] != [rows, tokens] or ("labels" in shapes and shapes["labels"] != [rows, tokens]):
        raise TransportError(f"mask/labels shapes {shapes.get('mask')} / {shapes.get('labels')} do not match {t}")
    if header.get("shape") != t or header.get("dtype") != entries["tensor"]["dtype"]:
        raise TransportError(
            f"the envelope says {header.get('dtype')} {header.get('shape')} but the frame holds "
            f"{entries['tensor']['dtype']} {t}"
        )
    doc_ids = header.get("doc_ids")
    if not isinstance(doc_ids, list) or len(doc_ids) != rows:
        raise TransportError(f"the envelope names {doc_ids!r} as row ids for {rows} rows")


def receive_frame(header: dict[str, Any], payload: bytes, limits: Limits, allowed_kinds: tuple[str, ...]) -> Frame:
    """What a receiver does with a frame message, in order: the limits (``check_frame_message``, before
    any tensor is decoded), the decode, the envelope's agreement with the frame it carries, and finite
    values. Every refusal is a TransportError, IntegrityError or NonFiniteError in one line."""
    check_frame_message(header, payload, limits, allowed_kinds)
    frame = decode(payload)
    if (frame.kind, frame.step, frame.phase, list(frame.doc_ids)) != (
        header["kind"],
        header["step"],
        header["phase"],
        header["doc_ids"],
    ):
        raise TransportError("the envelope and the frame it carries disagree on kind, step, phase or rows")
    if not bool(torch.isfinite(frame.tensor).all()):
        raise NonFiniteError(f"a {frame.kind} frame at step {frame.step} holds NaN or Inf; refused")
    return frame


def new_session_id() -> str:
    return secrets.token_hex(16)  # 128 bits, fresh for each session: what binds its messages to it


class ReplayGuard:
    """Refuses a nonce seen before in the session, a sequence number outside the sliding window
    (more than ``window`` behind the highest seen, or seen before) and, once ``session`` is set (the
    welcome's session id), a message that does not carry it: a message recorded in another session."""

    def __init__(self, window: int = 64, memory: int = 1 << 16, session: str | None = None):
        self.session = session
        self.window = window
        self.highest = -1
        self._seqs: set[int] = set()
        self._nonces: set[str] = set()
        self._order: deque[str] = deque()
        self.memory = memory

    def check_session(self, header: dict[str, Any]) -> None:
        if self.session is not None and header.get("session") != self.session:
            got = header.get("session")
            raise TransportError(
                f"a {header.get('type')!r} message carries session id {got!r}, not this session's: a message of "
                "another session (a replay), or a client older than protocol 2"
            )

    def check(self, header: dict[str, Any]) -> None:
        self.check_session(header)
        seq = _int(header.get("seq"), "the sequence number")
        nonce = header.get("nonce")
        if not (isinstance(nonce, str) and len(nonce) == 32 and all(c in "0123456789abcdef" for c in nonce)):
            raise TransportError(f"the nonce {nonce!r} is not 128 bits of hex")
        if nonce in self._nonces:
            raise TransportError(f"replayed frame: nonce {nonce} was seen before in this session")
        if seq in self._seqs or seq <= self.highest - self.window or seq < 0:
            raise TransportError(f"replayed or stale frame: sequence number {seq} (highest so far {self.highest})")
        if seq > self.highest + self.window:
            raise TransportError(f"sequence number {seq} jumps beyond the window (highest so far {self.highest})")
        self.highest = max(self.highest, seq)
        self._seqs = {s for s in self._seqs if s > self.highest - self.window} | {seq}
        self._nonces.add(nonce)
        self._order.append(nonce)
        if len(self._order) > self.memory:
            self._nonces.discard(self._order.popleft())
