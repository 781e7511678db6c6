"""TLS material for a two-process deployment: a private CA, a server and a client certificate, and
the SSL contexts that pin that CA on both sides.

``init_tls(DIR)`` writes ``ca.pem``, ``server.pem`` / ``server.key`` and ``client.pem`` /
``client.key`` (ECDSA P-256 by default, or Ed25519; keys 0600, never overwritten). The contexts
accept TLS 1.3 only, require a client certificate signed by the pinned CA (mutual TLS), and verify
the server's name. The CA's key is written too (``ca.key``), so that more certificates can be
issued later; keep the folder private and out of any repository.
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from splitleak.errors import ConfigError

FILES = ("ca.pem", "ca.key", "server.pem", "server.key", "client.pem", "client.key")
KEY_TYPES = ("ec", "ed25519")
DEFAULT_NAMES = ("localhost", "127.0.0.1")


@dataclass(frozen=True)
class TLSPaths:
    folder: Path

    @property
    def ca(self) -> Path:
        return self.folder / "ca.pem"

    def cert(self, role: str) -> Path:
        return self.folder / f"{role}.pem"

    def key(self, role: str) -> Path:
        return self.folder / f"{role}.key"


def _new_key(key_type: str):
    if key_type == "ec":
        return ec.generate_private_key(ec.SECP256R1())
    if key_type == "ed25519":
        return ed25519.Ed25519PrivateKey.generate()
    raise ConfigError(f"unknown key type {key_type!r}; use one of {', '.join(KEY_TYPES)}")


def _hash_for(key):
    return None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()


def _san(names: tuple[str, ...]):
    out: list[x509.GeneralName] = []
    for n in names:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            out.append(x509.DNSName(n))
    return x509.SubjectAlternativeName(out)


def init_tls(
    folder: str | Path,
    *,
    names: tuple[str, ...] = DEFAULT_NAMES,
    days: int = 30,
    key_type: str = "ec",
    ca_name: str = "splitleak private CA",
) -> TLSPaths:
    """Write a private CA and a server and client certificate into ``folder`` (created 0700). The
    server certificate is valid for ``names`` (DNS names or IP addresses). Refuses to overwrite."""
    if days < 1:
        raise ConfigError(f"--days must be >= 1, got {days}")
    if not names:
        raise ConfigError("give at least one server name (--name localhost)")
    folder = Path(folder)
    existing = [f for f in FILES if (folder / f).exists()]
    if existing:
        raise ConfigError(
            f"{folder} already holds {', '.join(existing)}; TLS material is never overwritten. Choose another "
            "folder, or delete these files yourself"
        )
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    now = _dt.datetime.now(_dt.timezone.utc) - _dt.timedelta(minutes=5)
    until = now + _dt.timedelta(days=days)

    ca_key = _new_key(key_type)
    ca_subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_subject)
        .issuer_name(ca_subject)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )  # digital signature, cert sign, CRL sign
        .sign(ca_key, _hash_for(ca_key))
    )

    def leaf(role: str, usage, san: tuple[str, ...]):
        key = _new_key(key_type)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"splitleak {role}")]))
            .issuer_name(ca_subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(until)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if san:
            builder = builder.add_extension(_san(san), critical=False)
        return key, builder.sign(ca_key, _hash_for(ca_key))

    server_key, server_cert = leaf("server", ExtendedKeyUsageOID.SERVER_AUTH, tuple(names))
    client_key, client_cert = leaf("client", ExtendedKeyUsageOID.CLIENT_AUTH, ())

    def write(name: str, data: bytes, mode: int) -> None:
        p = folder / name
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(p, mode)

    pem = serialization.Encoding.PEM
    for name, key in (("ca.key", ca_key), ("server.key", server_key), ("client.key", client_key)):
        write(
            name,
            key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
            0o600,
        )
    for name, cert in (("ca.pem", ca_cert), ("server.pem", server_cert), ("client.pem", client_cert)):
        write(name, cert.public_bytes(pem), 0o644)
    return TLSPaths(folder)


def _paths(folder: str | Path, role: str) -> TLSPaths:
    paths = TLSPaths(Path(folder))
    missing = [p.name for p in (paths.ca, paths.cert(role), paths.key(role)) if not p.is_file()]
    if missing:
        raise ConfigError(
            f"TLS folder {paths.folder} lacks {', '.join(missing)}; make one with `splitleak tls init DIR` and "
            "give both sides the same CA"
        )
    return paths


def _context(purpose: ssl.Purpose, folder: str | Path, role: str) -> ssl.SSLContext:
    paths = _paths(folder, role)
    proto = ssl.PROTOCOL_TLS_SERVER if role == "server" else ssl.PROTOCOL_TLS_CLIENT
    ctx = ssl.SSLContext(proto)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3  # plaintext and TLS <= 1.2 are refused
    ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    try:
        ctx.load_verify_locations(cafile=str(paths.ca))  # the pinned CA, and no other
        ctx.load_cert_chain(str(paths.cert(role)), str(paths.key(role)))
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"cannot load the {role} TLS material from {paths.folder}: {exc}") from None
    ctx.verify_mode = ssl.CERT_REQUIRED  # the server refuses a client without a certificate from the CA
    if role == "client":
        ctx.check_hostname = True
    else:
        # No TLS 1.3 session tickets. A client resumes nothing (each connection builds its own context), and
        # tickets sent after the handshake race the client's first write: websockets' sync client reads them in
        # its receiving thread while its main thread writes the opening request on the same OpenSSL object.
        # About once in a hundred connections on two loaded cores, the request never reached the server (its
        # socket and its TLS buffer both empty), which closed the connection after its 30 s opening timeout
        # ("did not receive a valid HTTP response"); none in 700 without tickets. With no ticket, nothing
        # crosses from the server before the client's request.
        ctx.num_tickets = 0
    return ctx


def server_context(folder: str | Path) -> ssl.SSLContext:
    return _context(ssl.Purpose.CLIENT_AUTH, folder, "server")


def client_context(folder: str | Path) -> ssl.SSLContext:
    return _context(ssl.Purpose.SERVER_AUTH, folder, "client")
