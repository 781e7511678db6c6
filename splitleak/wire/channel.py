"""Channels: the only way client and server talk.

A channel sends one frame and returns the reply frame (``request``). The in-process channel
encodes every frame to bytes and decodes it on the other side, exactly as a network transport
would, counts the bytes per direction, keeps a ledger of every blob that crossed (its SHA-256 and
length) and hands every crossing to its taps (the recorder of what crosses the split,
``splitleak.wire.tap``). The network transport (``splitleak.wire.client`` and ``splitleak.deploy``) implements the same
two methods over WebSockets and TLS, and both of its ends keep the same ledger.

``link`` names the connection: ``main`` for the one server of a split, ``replica-K`` for the K-th
server copy under replica median. The tap sits here, on the wire, not in the roles: what it records
is what was encoded, frame by frame, in both directions.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Protocol

from splitleak.wire.frames import Frame, decode, encode

CLIENT_TO_SERVER = ("forward", "backward-top")
MAIN_LINK = "main"


def direction_of(kind: str) -> str:
    return "client->server" if kind in CLIENT_TO_SERVER else "server->client"


@dataclass(frozen=True)
class Crossing:
    """One frame as it crossed: the decoded frame, the link, the direction and the encoded blob's
    SHA-256 and length (the ledger entry)."""

    seq: int  # order of the crossing on its channel
    link: str
    direction: str
    frame: Frame
    blob_sha256: str
    blob_bytes: int


Tap = Callable[[Crossing], None]


class Channel(Protocol):
    def request(self, frame: Frame) -> Frame: ...

    def close(self) -> None: ...


class WireLedger:
    """What a channel keeps of every frame that crosses it: bytes and frames per kind, the ledger of
    blobs (SHA-256 and length) and the taps that record each crossing. Both ends of a network link
    keep one; in one process the channel keeps one for both ends."""

    def __init__(self, taps: list[Tap] | None = None, link: str = MAIN_LINK):
        self.taps: list[Tap] = list(taps or [])
        self.link = link
        self.bytes_by_kind: dict[str, int] = defaultdict(int)
        self.frames_by_kind: dict[str, int] = defaultdict(int)
        #: every blob that crossed: (seq, link, direction, kind, phase, sha256, bytes)
        self.ledger: list[dict] = []

    def record(self, frame: Frame, blob: bytes) -> None:
        """``frame`` (as decoded from ``blob``) crossed: count it, add it to the ledger, tap it."""
        self.bytes_by_kind[frame.kind] += frame.wire_bytes()
        self.frames_by_kind[frame.kind] += 1
        digest = hashlib.sha256(blob).hexdigest()
        crossing = Crossing(len(self.ledger), self.link, direction_of(frame.kind), frame, digest, len(blob))
        self.ledger.append(
            {
                "seq": crossing.seq,
                "link": self.link,
                "direction": crossing.direction,
                "kind": frame.kind,
                "phase": frame.phase,
                "blob_sha256": digest,
                "blob_bytes": len(blob),
            }
        )
        for tap in self.taps:
            tap(crossing)

    def set_taps(self, taps: list[Tap] | None) -> None:
        """Start a new phase: these taps, an empty ledger and zero counters (as a new channel would)."""
        self.taps = list(taps or [])
        self.ledger = []
        self.reset_counters()

    def bytes_per_direction(self) -> dict[str, int]:
        up = sum(v for k, v in self.bytes_by_kind.items() if k in CLIENT_TO_SERVER)
        down = sum(v for k, v in self.bytes_by_kind.items() if k not in CLIENT_TO_SERVER)
        return {"client_to_server": up, "server_to_client": down}

    def reset_counters(self) -> None:
        self.bytes_by_kind.clear()
        self.frames_by_kind.clear()


class InProcessChannel(WireLedger):
    """Client and server in one process; frames still go through the byte codec."""

    def __init__(
        self,
        handler: Callable[[Frame], Frame],
        taps: list[Tap] | None = None,
        serialize: bool = True,
        link: str = MAIN_LINK,
    ):
        super().__init__(taps, link)
        self.handler = handler
        self.serialize = serialize

    def _cross(self, frame: Frame) -> Frame:
        blob = encode(frame)
        out = decode(blob) if self.serialize else frame
        self.record(out, blob)
        return out

    def request(self, frame: Frame) -> Frame:
        reply = self.handler(self._cross(frame))
        return self._cross(reply)

    def close(self) -> None:
        pass
