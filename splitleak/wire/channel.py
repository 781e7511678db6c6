"""Channels: the only way client and server talk.

A channel sends one frame and returns the reply frame (``request``). The in-process channel
encodes every frame to bytes and decodes it on the other side, exactly as a network transport
would, counts the bytes per direction and hands every decoded frame to its taps (the recorder of
what crosses the split). A TLS transport implements the same two methods.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Protocol

from splitleak.wire.frames import Frame, decode, encode

Tap = Callable[[Frame], None]
CLIENT_TO_SERVER = ("forward", "backward-top")


class Channel(Protocol):
    def request(self, frame: Frame) -> Frame: ...

    def close(self) -> None: ...


class InProcessChannel:
    """Client and server in one process; frames still go through the byte codec."""

    def __init__(self, handler: Callable[[Frame], Frame], taps: list[Tap] | None = None, serialize: bool = True):
        self.handler = handler
        self.taps: list[Tap] = list(taps or [])
        self.serialize = serialize
        self.bytes_by_kind: dict[str, int] = defaultdict(int)
        self.frames_by_kind: dict[str, int] = defaultdict(int)

    def _cross(self, frame: Frame) -> Frame:
        out = decode(encode(frame)) if self.serialize else frame
        self.bytes_by_kind[frame.kind] += frame.wire_bytes()
        self.frames_by_kind[frame.kind] += 1
        for tap in self.taps:
            tap(out)
        return out

    def request(self, frame: Frame) -> Frame:
        reply = self.handler(self._cross(frame))
        return self._cross(reply)

    def bytes_per_direction(self) -> dict[str, int]:
        up = sum(v for k, v in self.bytes_by_kind.items() if k in CLIENT_TO_SERVER)
        down = sum(v for k, v in self.bytes_by_kind.items() if k not in CLIENT_TO_SERVER)
        return {"client_to_server": up, "server_to_client": down}

    def reset_counters(self) -> None:
        self.bytes_by_kind.clear()
        self.frames_by_kind.clear()

    def close(self) -> None:
        pass
