"""The untrusted node as a process: ``splitleak serve`` (``ServerNode``), one ``Session`` per connection.

Each connection is one session with its own state. The client's hello names the server's part of the
configuration (``ServerConfig``: no run seed, no data); the server loads the same preset, checks the
pretrained model's fingerprint, the split and the defence chain against the client's, and refuses a
mismatch naming both values (the welcome echoes them, and the client checks them too). It then frees the
weights it never reads (``SplitModel.release_client_side``) and answers frames with a ``ServerRole``
(``splitleak.training.roles``), exactly as in one process, and, given a capture folder, records everything
it receives and sends in a capture store of its own (``session-NNNN/``: manifest, ``wire/`` shards and
ledgers, every message's envelope, the server's trained layers, its loss log, the hash-chained journal;
``splitleak verify`` works on it unchanged). Given a checkpoint folder, a session checkpoints its side
every so many steps, and a later session resumes from such a checkpoint (``splitleak.training.checkpoint``).
The client's channel is ``splitleak.wire.client``.

Every message is checked before allocation (``splitleak.wire.transport``); a replayed nonce, an
out-of-window sequence number, a backward with no pending forward, a frame after close, NaN/Inf, an
unknown kind or a lying header ends the session with the reason logged.

**A hostile client** (one holding a valid certificate) cannot take the server down: every size a
hello may ask is capped by the server (``max_rows``, ``max_tokens``, their product
``max_frame_tokens``, ``max_frame_bytes``; a hello over one is refused naming the value, the maximum
and the ``serve`` flag that raises it), and the WebSocket layer refuses a message larger than the
session's frame limit plus its envelope before reading it (only a header-sized message before the
welcome); at most ``PENDING_WINDOW`` forwards await their backward-top per session; at most
``max_concurrent`` sessions run at once (a connection over the cap is told so, and no model is loaded
for it); the hello must arrive within ``hello_seconds``, and the model loads only after a valid hello;
a phase only goes forward (train, then capture); every message after the welcome carries the session id
the welcome gave, so a message recorded in one session is refused in another; a failed TLS handshake is
logged with the peer's address and the reason.

**Anyone who can reach the port** (no certificate needed) cannot exhaust it either: at most ``max_pending``
connections are in their TLS and WebSocket handshakes at once, at most ``max_pending_per_address`` from one
address, each within ``handshake_seconds`` in all (``splitleak.deploy.gate``: a socket over a cap is closed at
once, a slow handshake ends at its deadline; refusals and failed handshakes are logged once per address,
reason and minute). Whatever raises, a session's capture ends closed
(complete, or failed with the reason and the last step).
"""

from __future__ import annotations

import ipaddress
import logging
import ssl
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from websockets.sync.server import Server, serve

from splitleak.deploy.gate import HandshakeGate
from splitleak.deploy.limits import (
    HANDSHAKE_SECONDS,
    HELLO_SECONDS,
    MAX_CONCURRENT,
    MAX_FRAME_MIB,
    MAX_FRAME_TOKENS,
    MAX_PENDING,
    MAX_PENDING_PER_ADDRESS,
    MAX_ROWS,
    MAX_TOKENS,
)
from splitleak.deploy.session import Session, SessionRecord, peer_address
from splitleak.errors import ConfigError
from splitleak.wire.client import cap_messages
from splitleak.wire.tls import server_context
from splitleak.wire.transport import (
    ENVELOPE_BYTES,
    HANDSHAKE_MESSAGE_BYTES,
    new_nonce,
    pack,
)

log = logging.getLogger("splitleak.serve")
IDLE_SECONDS = 300.0


class _LoggedSSLSocket(ssl.SSLSocket):
    """The server's TLS sockets: a handshake that fails is logged with the peer's address and why, once per
    address, reason and window (``gate``: the node's ``HandshakeGate``, set on the node's own subclass)."""

    gate: HandshakeGate | None = None

    def do_handshake(self, block: bool = False) -> None:
        try:
            peer = "{}:{}".format(*self.getpeername()[:2])  # before the handshake: a refused peer may leave at once
        except OSError:
            peer = "an unknown peer"
        try:
            super().do_handshake(block)
        except Exception as exc:
            if self.gate is None:
                log.warning("TLS handshake with %s failed: %s", peer, _tls_reason(exc))
            else:
                why = _tls_reason(exc)
                self.gate.log_once((peer.rsplit(":", 1)[0], why), "TLS handshake with %s failed: %s", peer, why)
            raise


def _tls_reason(exc: BaseException) -> str:
    """Why the server refused a TLS handshake, in words, with OpenSSL's own reason."""
    reason = getattr(exc, "reason", None) or type(exc).__name__
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (
            f"the client's certificate is not signed by this server's CA ({exc.verify_message}; {reason}): "
            "a certificate from another `splitleak tls init`"
        )
    if reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE":
        return f"the client sent no certificate ({reason}); mutual TLS needs the client's client.pem"
    if "ALERT" in str(reason):
        return f"the client refused this server's certificate ({reason}): it trusts another CA"
    if isinstance(exc, TimeoutError):
        return "no TLS handshake within the server's --handshake-timeout"
    if reason in ("WRONG_VERSION_NUMBER", "HTTP_REQUEST", "UNSUPPORTED_PROTOCOL"):
        return f"not TLS 1.3 ({reason}): plaintext or an older TLS version"
    return f"{reason} ({exc})"


@dataclass
class ServerNode:
    """``splitleak serve``: listens on ``host:port`` (loopback unless ``allow_remote``) with mutual TLS
    from ``tls_dir``; one ``Session`` per connection, at most ``max_sessions`` in all (None: no limit),
    at most ``max_concurrent`` at once. ``max_rows``, ``max_tokens``, ``max_frame_tokens`` (rows x
    tokens), ``max_frame_bytes``: the most a hello may ask (see ``MAX_ROWS`` and the rest); ``hello_seconds``: how soon the hello must come."""

    tls_dir: str | Path
    host: str = "127.0.0.1"
    port: int = 0
    capture: str | Path | None = None
    allow_remote: bool = False
    max_sessions: int | None = None
    idle_seconds: float = IDLE_SECONDS
    checkpoints: str | Path | None = None  # where sessions keep their training checkpoints (to resume)
    max_rows: int = MAX_ROWS
    max_tokens: int = MAX_TOKENS
    max_frame_tokens: int = MAX_FRAME_TOKENS
    max_frame_bytes: int = MAX_FRAME_MIB << 20
    max_concurrent: int = MAX_CONCURRENT
    hello_seconds: float = HELLO_SECONDS
    max_pending: int = MAX_PENDING
    max_pending_per_address: int = MAX_PENDING_PER_ADDRESS
    handshake_seconds: float = HANDSHAKE_SECONDS
    sessions: list[SessionRecord] = field(default_factory=list)
    on_session: Callable[[SessionRecord], None] | None = None

    def __post_init__(self) -> None:
        try:
            loopback = self.host == "localhost" or ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            loopback = False
        if not loopback and not self.allow_remote:
            raise ConfigError(
                f"--listen {self.host} is not a loopback address; pass --allow-remote to serve other machines"
            )
        for flag, value in (
            ("--max-rows", self.max_rows),
            ("--max-tokens", self.max_tokens),
            ("--max-frame-tokens", self.max_frame_tokens),
            ("--max-frame-mib", self.max_frame_bytes),
            ("--max-concurrent", self.max_concurrent),
            ("--max-pending", self.max_pending),
            ("--max-pending-per-address", self.max_pending_per_address),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{flag} must be a positive integer, not {value!r}")
        if not self.hello_seconds > 0:
            raise ConfigError(f"--hello-timeout must be positive, not {self.hello_seconds!r}")
        if not self.handshake_seconds > 0:
            raise ConfigError(f"--handshake-timeout must be positive, not {self.handshake_seconds!r}")
        self.gate = HandshakeGate(self.max_pending, self.max_pending_per_address, self.handshake_seconds)
        self._lock = threading.Lock()
        self._active = 0  # sessions running now
        self._server: Server | None = None
        self._count = 0  # the next session's number
        self._started = 0  # sessions this process started
        if self.capture is not None and Path(self.capture).is_dir():  # a restarted server: number on, never overwrite
            taken = [int(p.name[8:]) for p in Path(self.capture).glob("session-*") if p.name[8:].isdigit()]
            self._count = max(taken, default=-1) + 1

    def max_message_bytes(self) -> int:
        """The WebSocket layer's cap on one message: the largest frame this server allows, in its envelope."""
        return self.max_frame_bytes + ENVELOPE_BYTES

    def _handler(self, conn) -> None:
        self.gate.opened(conn.socket)  # its handshakes are done: from here the hello deadline and the caps hold
        cap_messages(conn, HANDSHAKE_MESSAGE_BYTES)
        with self._lock:
            if self.max_sessions is not None and self._started >= self.max_sessions:
                conn.close()
                return
            busy = self._active >= self.max_concurrent
            if not busy:
                self._active += 1
                self._started += 1
                ordinal = self._started
                index = self._count
                self._count += 1
        if busy:
            self._refuse(conn)
            return
        try:
            session = Session(self, conn, index)
            self.sessions.append(session.rec)
            session.run()
        finally:
            with self._lock:
                self._active -= 1
        if self.on_session is not None:
            self.on_session(session.rec)
        if self.max_sessions is not None and ordinal >= self.max_sessions and self._server is not None:
            threading.Thread(target=self._server.shutdown, daemon=True).start()

    def _refuse(self, conn) -> None:
        """A connection over ``max_concurrent``: told so in one error message, no model loaded. The
        hello is read (header-sized at most, within a second or two) before the close, so that the
        client reads the refusal rather than a connection closed under its hello."""
        peer = peer_address(conn)
        message = (
            f"the server is busy: {self.max_concurrent} sessions are running, its limit "
            "(`splitleak serve --max-concurrent`); try again later"
        )
        log.warning("refused a connection from %s: %s", peer, message)
        try:
            conn.send(pack({"type": "error", "message": message, "seq": 0, "nonce": new_nonce()}))
            conn.recv(timeout=min(2.0, self.hello_seconds))
        except Exception:  # noqa: BLE001 (a silent or vanished peer: closed all the same)
            pass
        try:
            conn.close()
        except Exception:  # noqa: BLE001
            pass

    def start(self) -> int:
        """Bind and return the port (an ephemeral one when ``port`` is 0); serve with ``serve_forever``."""
        ctx = server_context(self.tls_dir)
        # a failed TLS handshake is logged (websockets drops it silently), once per address and window
        ctx.sslsocket_class = type("_NodeSSLSocket", (_LoggedSSLSocket,), {"gate": self.gate})
        self._server = serve(
            self._handler,
            self.host,
            self.port,
            ssl=ctx,
            compression=None,
            max_size=self.max_message_bytes(),
            ping_interval=None,
            server_header=None,
            open_timeout=self.handshake_seconds,
        )
        self._server.handler = self.gate.wrap(self._server.handler, self._server)  # bounded before the handshake
        self.port = int(self._server.socket.getsockname()[1])
        return self.port

    def serve_forever(self) -> None:
        assert self._server is not None, "call start() first"
        self._server.serve_forever()

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
