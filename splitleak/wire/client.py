"""The trusted node's side of the two-process deployment: the TLS client channel to ``splitleak serve``.

``RemoteServer`` (``splitleak train --connect``) sends the same encoded frames the in-process channel
would, over WebSockets on mutual TLS 1.3, and keeps the same ledger and taps, so the client's run
directory is the same in one process and over TLS. ``hello_for`` writes the hello (the server's part of
the configuration; the run seed and the data never cross). Every reply is checked before allocation
(``splitleak.wire.transport``); a TLS handshake that fails is explained (which certificate, why).
Compression is off: message sizes must not depend on the content. The server is
``splitleak.deploy.server``.
"""

from __future__ import annotations

import logging
import socket
import ssl
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from cryptography import x509
from websockets.exceptions import ConnectionClosed, InvalidMessage
from websockets.sync.client import connect

from splitleak.errors import ConfigError
from splitleak.wire.channel import MAIN_LINK, WireLedger
from splitleak.wire.frames import Frame, decode, encode
from splitleak.wire.tls import client_context
from splitleak.wire.transport import (
    HANDSHAKE_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Limits,
    ReplayGuard,
    TransportError,
    frame_header,
    new_nonce,
    pack,
    receive_frame,
    unpack,
)

log = logging.getLogger("splitleak.client")
CLIENT_KINDS = ("forward", "backward-top")
SERVER_KINDS = ("backward", "forward-return")
#: the client's ceiling on one message whatever a server's welcome says (a session's own cap is lower)
MAX_MESSAGE_BYTES = 512 << 20
OPEN_ATTEMPTS = 3  # the client's attempts at an opening handshake the server closed before answering


def parse_address(text: str, *, what: str = "--connect") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"{what} {text!r} is not HOST:PORT (for example 127.0.0.1:8443)")
    return host.strip("[]"), int(port)


def hello_for(
    server_config: dict[str, Any],
    fingerprint: str,
    split: dict[str, Any],
    defences: list[dict],
    *,
    checkpoint_every: int | None = None,
    resume: dict[str, Any] | None = None,
) -> dict:
    """The client's hello: the protocol version, the server's part of the configuration
    (``ServerConfig``: model, split, defences, learning rate, frame sizes and the two seeds derived
    one-way from the run seed), the pretrained model's fingerprint, the split and the defence chain
    for the server to check. It crosses as the declared ``handshake`` channel; the run seed, the
    data set and the document counts are not in it. ``checkpoint_every``: the server checkpoints its
    side every so many steps (if it keeps checkpoints); ``resume``: ``{"token", "done"}`` of the
    checkpoint to continue from."""
    return {
        "type": "hello",
        "protocol": PROTOCOL_VERSION,
        "config": server_config,
        "fingerprint": fingerprint,
        "split": split,
        "defences": defences,
        "checkpoint_every": checkpoint_every,
        "resume": resume,
    }


def cap_messages(conn, n: int) -> None:
    """Set the largest message the WebSocket layer reads on ``conn`` (a larger one is refused from its
    frame header, unread, and the connection closed with code 1009)."""
    conn.protocol.max_message_size = n


class RemoteServer(WireLedger):
    """The trusted node's channel to a ``ServerNode``: ``request(frame)`` sends the encoded frame and
    returns the decoded reply; ledger and taps as in one process. ``last_losses`` stays None: in a
    plain split the loss stays on the server."""

    def __init__(self, host: str, port: int, tls_dir: str | Path, hello: dict[str, Any], timeout: float = 60.0):
        super().__init__(link=MAIN_LINK)
        self.remote = True
        self.where = f"{host}:{port}"
        self.timeout = timeout
        self.last_losses = None
        self.opt = None
        self.guard = ReplayGuard()
        self.seq = 0
        self.closed = False
        self.tls_dir = Path(tls_dir)
        self.session_id: str | None = None  # the welcome's; every later message carries it
        self.messages: list[dict[str, Any]] = []  # every envelope, both ways, as the server's capture has them
        try:
            self.conn = self._open(host, port, tls_dir, timeout)
        except ssl.SSLCertVerificationError as exc:  # the server's certificate (before OSError, of which it is one)
            raise TransportError(
                f"the TLS handshake with {self.where} failed (CERTIFICATE_VERIFY_FAILED): the server's certificate "
                f"does not verify against {self.tls_dir / 'ca.pem'} ({exc.verify_message}); both sides need "
                "certificates from the same CA (`splitleak tls init`)"
            ) from None
        except ssl.SSLError as exc:  # the server's alert: it refused this client's certificate
            raise TransportError(self._refused_certificate(exc)) from None
        except (OSError, TimeoutError) as exc:
            raise TransportError(f"cannot reach the server at {self.where}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 (websockets' handshake errors)
            cause = _ssl_cause(exc)
            # the TLS session broke right after it opened (the server's alert read, or only its closing: TLS 1.3
            # lets the client finish before the server checks the client's certificate, so the alert may be lost)
            if isinstance(cause, ssl.SSLError) or self._certificate_signed_by_own_ca() is False:
                raise TransportError(self._refused_certificate(cause)) from None
            raise TransportError(f"the TLS/WebSocket handshake with {self.where} failed: {exc}") from None
        try:
            try:
                self._send(hello)
            except ConnectionClosed:  # a server that refused at once (busy) has sent why: read it below
                pass
            reply, _ = self._recv("the handshake")
            if reply.get("type") != "welcome":
                raise TransportError(f"the server at {self.where} refused the session: {reply.get('message', reply)}")
            # the client checks the server as well (a latent-mode server holds no weights to fingerprint)
            latent = isinstance(hello.get("config"), dict) and hello["config"].get("latent") is not None
            for key in (
                ("protocol", "split", "defences") if latent else ("protocol", "fingerprint", "split", "defences")
            ):
                if reply.get(key) != hello[key]:
                    raise TransportError(
                        f"the server at {self.where} runs another {key}: it has {reply.get(key)!r}, "
                        f"this client {hello[key]!r}"
                    )
            session = reply.get("session")
            if not (isinstance(session, str) and len(session) == 32):
                raise TransportError(f"the server at {self.where} sent no session id in its welcome ({session!r})")
            self.session_id = self.guard.session = session
            self.limits = Limits(**reply["limits"])
            # the WebSocket layer reads no message larger than the session's largest frame in its envelope
            cap_messages(self.conn, min(self.limits.max_message_bytes(), MAX_MESSAGE_BYTES))
        except BaseException:
            self.abort()
            raise
        self.welcome = reply  # the server's token and checkpoint interval: what a later resume names

    def _certificate_signed_by_own_ca(self) -> bool | None:
        """Whether this client's ``client.pem`` is signed by its own ``ca.pem`` (None: unreadable). A
        client certificate that its own CA did not sign is refused by a server of that CA, whatever the
        server said before it closed."""
        try:
            cert = x509.load_pem_x509_certificate((self.tls_dir / "client.pem").read_bytes())
            ca = x509.load_pem_x509_certificate((self.tls_dir / "ca.pem").read_bytes())
        except (OSError, ValueError):
            return None
        try:
            cert.verify_directly_issued_by(ca)
        except Exception:  # noqa: BLE001 (another issuer, or another key's signature)
            return False
        return True

    def _refused_certificate(self, exc: BaseException | None) -> str:
        """Which certificate the server refused, and why as far as this side can tell."""
        alert = (
            (getattr(exc, "reason", None) or type(exc).__name__)
            if exc is not None
            else "it closed the connection once TLS was up"
        )
        cert_path, ca_path = self.tls_dir / "client.pem", self.tls_dir / "ca.pem"
        head = f"the server at {self.where} refused this client's certificate {cert_path} ({alert})"
        try:
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            ca = x509.load_pem_x509_certificate(ca_path.read_bytes())
        except (OSError, ValueError) as err:
            return f"{head}; it cannot be read here either ({err}); make new material with `splitleak tls init`"
        issuer = cert.issuer.rfc4514_string()
        try:
            cert.verify_directly_issued_by(ca)
            signed = True
        except Exception:  # noqa: BLE001 (another issuer, or another key's signature)
            signed = False
        if not signed:
            other = "another CA of the same name" if cert.issuer == ca.subject else "another CA"
            return (
                f"{head}: it is signed by {other} ({issuer}) than {ca_path}, the CA of the server's certificate; "
                "give the client the client.pem and client.key of the server's `splitleak tls init` folder"
            )
        if cert.not_valid_after_utc < datetime.now(timezone.utc):
            return f"{head}: it expired on {cert.not_valid_after_utc:%Y-%m-%d}; make new material with `splitleak tls init`"
        return (
            f"{head}: it is issued by {issuer}, which this server does not trust; give both sides certificates from "
            "the same `splitleak tls init` folder"
        )

    def _open(self, host: str, port: int, tls_dir: str | Path, timeout: float, attempts: int = OPEN_ATTEMPTS):
        """The WebSocket over TLS. A server that closes the connection before its HTTP answer (a busy
        machine past the server's opening timeout) is asked again, ``attempts`` times in all: nothing
        has crossed yet, so a retry changes nothing but the nonce-free TCP connection."""
        for attempt in range(attempts):
            try:
                return connect(
                    f"wss://{host}:{port}/splitleak",
                    ssl=client_context(tls_dir),
                    compression=None,
                    max_size=HANDSHAKE_MESSAGE_BYTES,  # raised to the session's limits by the welcome
                    open_timeout=timeout,
                    ping_interval=None,
                    proxy=None,
                    close_timeout=5,
                )
            except InvalidMessage as exc:
                if attempt + 1 == attempts or isinstance(_ssl_cause(exc), ssl.SSLError):  # a refusal: say why now
                    raise
                log.warning("the server at %s:%d closed the opening handshake (%s); asking again", host, port, exc)
                time.sleep(0.5 * (attempt + 1))
        raise AssertionError("unreachable")

    def _send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        if self.closed:
            raise TransportError("the session is closed; no frame may follow")
        header = {**header, "seq": self.seq, "nonce": header.get("nonce") or new_nonce()}
        if self.session_id is not None:
            header["session"] = self.session_id
        self.seq += 1
        self.conn.send(pack(header, payload))
        self.messages.append({"direction": "client->server", "bytes": len(payload), "header": header})

    def _recv(self, what: str) -> tuple[dict[str, Any], bytes]:
        try:
            message = self.conn.recv(timeout=self.timeout)
        except ConnectionClosed as exc:
            if self.session_id is None and isinstance(_ssl_cause(exc), ssl.SSLError):
                raise TransportError(self._refused_certificate(_ssl_cause(exc))) from None
            raise TransportError(f"the server at {self.where} closed the connection during {what} ({exc})") from None
        except TimeoutError:
            raise TransportError(
                f"the server at {self.where} did not answer within {self.timeout:g} s during {what}"
            ) from None
        header, payload = unpack(message)
        self.messages.append({"direction": "server->client", "bytes": len(payload), "header": header})
        if header.get("type") == "error":
            raise TransportError(f"the server at {self.where} ended the session during {what}: {header.get('message')}")
        self.guard.check_session(header)
        return header, payload

    def request(self, frame: Frame) -> Frame:
        blob = encode(frame)
        self.record(decode(blob), blob)
        what = f"{frame.phase} step {frame.step}" if frame.step >= 0 else f"the {frame.phase} pass"
        header = {**frame_header(frame, blob, self.seq), "session": self.session_id}
        try:
            self.conn.send(pack(header, blob))
        except ConnectionClosed as exc:
            raise TransportError(f"the server at {self.where} closed the connection during {what} ({exc})") from None
        self.messages.append({"direction": "client->server", "bytes": len(blob), "header": header})
        self.seq += 1
        header, payload = self._recv(what)
        if header.get("type") != "frame":
            raise TransportError(f"the server sent a {header.get('type')!r} message during {what}")
        assert self.limits is not None
        self.guard.check(header)
        reply = receive_frame(header, payload, self.limits, SERVER_KINDS)
        self.record(reply, payload)
        return reply

    @property
    def channel(self) -> RemoteServer:
        return self

    def abort(self) -> None:
        """Drop the connection without a goodbye (the server closes its capture as failed)."""
        self.closed = True
        try:
            self.conn.close()
        except Exception:  # noqa: BLE001 (already gone)
            pass

    def close(self) -> None:
        """Tell the server the session is over and wait for its goodbye (its capture is then closed)."""
        if self.closed:
            return
        try:
            self._send({"type": "close"})
            self._recv("close")
        finally:
            self.closed = True
            self.conn.close()


def _ssl_cause(exc: BaseException) -> BaseException | None:
    """The TLS error under a websockets exception (its cause or context), if any."""
    seen = exc
    for _ in range(4):
        if isinstance(seen, ssl.SSLError):
            return seen
        nxt = seen.__cause__ or seen.__context__
        if nxt is None:
            return None
        seen = nxt
    return None


def wait_port(host: str, port: int, timeout: float = 30.0) -> None:
    """Block until something listens on host:port (for tests and scripts that start ``serve``)."""
    t0 = time.monotonic()
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() - t0 > timeout:
                raise TransportError(f"nothing listens on {host}:{port} after {timeout:g} s") from None
            time.sleep(0.05)
