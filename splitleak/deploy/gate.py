"""``splitleak serve`` bounded before the handshake: the connections that have not yet finished their TLS and
WebSocket opening handshakes (pending) are capped in all and per address, and every refusal or failed
handshake is logged once per address, reason and window (no log flood).

The WebSocket server (``websockets.sync.server``) gives every accepted socket a thread that runs the TLS and the
WebSocket handshakes before the session's handler. ``HandshakeGate.wrap`` runs first in that thread: a socket
over a cap is closed at once (its thread ends within microseconds), so the threads that wait on a peer are at
most ``max_pending`` whatever a flood of silent sockets or slow handshakes asks. Each pending socket has
``handshake_seconds`` in all (the server's ``open_timeout``: CPython's TLS handshake keeps one deadline over
all its reads, and websockets gives the WebSocket handshake what is left), so a slow-loris peer that sends a
byte at a time is closed at the deadline too (tested). A session's handler calls ``opened`` when the handshakes
are done; from there the hello deadline and the session caps of ``ServerNode`` hold.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from splitleak.deploy.limits import HANDSHAKE_SECONDS, MAX_PENDING, MAX_PENDING_PER_ADDRESS

log = logging.getLogger("splitleak.serve")

#: refusals of one address are logged once per this many seconds, with the count of those not logged
LOG_WINDOW_SECONDS = 60.0


@dataclass
class _Refusals:
    since: float
    unlogged: int = 0


@dataclass
class HandshakeGate:
    max_pending: int = MAX_PENDING
    max_per_address: int = MAX_PENDING_PER_ADDRESS
    handshake_seconds: float = HANDSHAKE_SECONDS
    log_window: float = LOG_WINDOW_SECONDS
    refused: int = 0  # connections refused before their handshake, in all
    _pending: dict[Any, tuple[str, float]] = field(default_factory=dict)  # socket -> (address, deadline)
    _per_address: dict[str, int] = field(default_factory=dict)
    _logged: dict[tuple[str, str], _Refusals] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def wrap(self, handler: Callable[[Any, Any], None], server: Any) -> Callable[[Any, Any], None]:
        """``handler`` (the WebSocket server's per-socket handler, run in the socket's own thread) behind the
        gate; ``server``: the WebSocket server, whose record of handler threads a refused socket leaves."""

        def gated(sock: Any, addr: Any) -> None:
            address = str(addr[0]) if isinstance(addr, tuple) and addr else "an unknown peer"
            if not self._admit(sock, address):
                _close(sock)
                with server.lock:
                    server.handler_threads.discard(threading.current_thread())
                return
            try:
                handler(sock, addr)
            finally:
                self.opened(sock)  # a handshake that failed or a session that ended: its slot is free

        return gated

    def _admit(self, sock: Any, address: str) -> bool:
        with self._lock:
            over_all = len(self._pending) >= self.max_pending
            over_one = self._per_address.get(address, 0) >= self.max_per_address
            if not (over_all or over_one):
                self._pending[sock] = (address, time.monotonic() + self.handshake_seconds)
                self._per_address[address] = self._per_address.get(address, 0) + 1
                return True
            self.refused += 1
            why = (
                f"{self.max_pending} connections are in their handshakes (`splitleak serve --max-pending`)"
                if over_all
                else f"it has {self.max_per_address} connections in their handshakes "
                "(`splitleak serve --max-pending-per-address`)"
            )
            self._log_refusal(address, why)
            return False

    def _log_refusal(self, address: str, why: str) -> None:
        """Log a refusal of ``address`` once per window, with how many went unlogged since (lock held)."""
        self._log_once((address, "refused"), "refused a connection from %s before its handshake: %s", address, why)

    def log_once(self, key: tuple[str, str], message: str, *args: Any) -> None:
        """Log ``message % args`` once per window for ``key`` (an address and what happened: one line per reason)."""
        with self._lock:
            self._log_once(key, message, *args)

    def _log_once(self, key: tuple[str, str], message: str, *args: Any) -> None:  # lock held
        now = time.monotonic()
        seen = self._logged.get(key)
        if seen is not None and now - seen.since < self.log_window:
            seen.unlogged += 1
            return
        more = f" ({seen.unlogged} more like it since the last line)" if seen is not None and seen.unlogged else ""
        log.warning(message + "%s", *args, more)
        self._logged[key] = _Refusals(now)

    def opened(self, sock: Any) -> None:
        """``sock`` finished its handshakes (or left): no longer pending."""
        with self._lock:
            self._release(sock)

    def _release(self, sock: Any) -> None:  # lock held
        entry = self._pending.pop(sock, None)
        if entry is not None:
            left = self._per_address[entry[0]] - 1
            if left:
                self._per_address[entry[0]] = left
            else:
                del self._per_address[entry[0]]


def _close(sock: Any) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
