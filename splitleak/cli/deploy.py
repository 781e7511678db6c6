"""``splitleak tls init`` and ``splitleak serve``: the two-process deployment over mutual TLS."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer

from splitleak.cli.common import ThreadsOpt, app, console, err, user_errors
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

tls_app = typer.Typer(help="TLS material for `serve` and `train --connect`: a private CA and two certificates.")
app.add_typer(tls_app, name="tls")


@tls_app.command("init")
def tls_init_cmd(
    folder: Path = typer.Argument(..., help="folder to write (created 0700; existing files are never overwritten)"),
    name: list[str] = typer.Option(
        ["localhost", "127.0.0.1"], "--name", help="a DNS name or IP address the server certificate is valid for"
    ),
    days: int = typer.Option(30, "--days", help="lifetime of the CA and both certificates"),
    key_type: str = typer.Option("ec", "--key-type", help="ec (ECDSA P-256) or ed25519"),
) -> None:
    """Write a private CA (ca.pem, ca.key) and a server and a client certificate signed by it. Give the
    server ca.pem + server.*, the client ca.pem + client.*; keep the folder out of any repository."""
    # lazy: torch stays out of `splitleak --help`
    from splitleak.wire.tls import init_tls

    with user_errors():
        paths = init_tls(folder, names=tuple(name), days=days, key_type=key_type)
        console.print(f"TLS material in {paths.folder}: ca.pem, server.pem/.key ({', '.join(name)}), client.pem/.key")


@app.command("serve")
def serve_cmd(
    listen: str = typer.Option("127.0.0.1:8443", "--listen", help="HOST:PORT to bind (port 0: any free port)"),
    tls_dir: Path = typer.Option(..., "--tls-dir", help="the folder `splitleak tls init` wrote"),
    capture: Optional[Path] = typer.Option(
        None, "--capture", help="record every session's traffic here (session-NNNN/, a verifiable capture store)"
    ),
    checkpoints: Optional[Path] = typer.Option(
        None,
        "--checkpoints",
        help="keep each session's training checkpoints here (what `train --resume` needs after this server dies); "
        "a finished session's are deleted",
    ),
    allow_remote: bool = typer.Option(False, "--allow-remote", help="allow binding a non-loopback address"),
    max_sessions: Optional[int] = typer.Option(None, "--max-sessions", help="exit after this many sessions"),
    idle: float = typer.Option(300.0, "--idle-timeout", help="seconds a session may stay silent"),
    max_concurrent: int = typer.Option(
        MAX_CONCURRENT,
        "--max-concurrent",
        help="sessions at once (each holds its own model copy); a connection over it is refused with a message",
    ),
    hello_timeout: float = typer.Option(
        HELLO_SECONDS, "--hello-timeout", help="seconds a new connection has to send its hello (no model before it)"
    ),
    max_pending: int = typer.Option(
        MAX_PENDING,
        "--max-pending",
        help="connections in their TLS and WebSocket handshakes at once; one over it is closed at once",
    ),
    max_pending_per_address: int = typer.Option(
        MAX_PENDING_PER_ADDRESS, "--max-pending-per-address", help="connections in their handshakes from one address"
    ),
    handshake_timeout: float = typer.Option(
        HANDSHAKE_SECONDS,
        "--handshake-timeout",
        help="seconds a connection has for its TLS and WebSocket handshakes, in all (a slow one is closed)",
    ),
    max_rows: int = typer.Option(
        MAX_ROWS,
        "--max-rows",
        help="most rows of one frame a hello may ask: the client's capture_batch (its configuration) x 2 for "
        "mixup's probe rows; the latent mode: capture_batch",
    ),
    max_tokens: int = typer.Option(
        MAX_TOKENS, "--max-tokens", help="most tokens per row a hello may ask: --doc-len (latent: + decoys)"
    ),
    max_frame_tokens: int = typer.Option(
        MAX_FRAME_TOKENS,
        "--max-frame-tokens",
        help="most rows x tokens of one frame a hello may ask: what the server's logits and their gradient grow with",
    ),
    max_frame_mib: int = typer.Option(
        MAX_FRAME_MIB,
        "--max-frame-mib",
        help="most MiB of one frame; the WebSocket layer refuses a larger message unread",
    ),
    threads: Optional[int] = ThreadsOpt,
) -> None:
    """Run the untrusted node: it receives its part of the configuration in the handshake, loads the same
    preset, trains the layers it is given and answers the client's frames. Prints the port it
    listens on, then one line per session.

    A client holding a valid certificate cannot take it down: a hello that asks for more rows, tokens
    or frame bytes than the --max-* flags allow is refused naming the flag, before a model loads; at
    most --max-concurrent sessions run at once, each must say hello within --hello-timeout, and each
    holds at most one unanswered forward. Anyone who can reach the port, certificate or not, is bounded
    before the handshake: at most --max-pending connections (--max-pending-per-address from one address)
    in their TLS and WebSocket handshakes, each within --handshake-timeout in all. The defaults cover the study's settings (32-token documents,
    capture batches of 16, 48 decoys) with room to spare and bound the server's memory to about
    --max-concurrent x (model + one forward of --max-frame-tokens rows x tokens, whose logits over the
    vocabulary are what costs; measured in benchmarks/RESULTS.md); raise them for longer documents or
    larger batches, lower --max-concurrent for a large model."""
    # lazy: torch stays out of `splitleak --help`
    from splitleak.deploy.server import ServerNode
    from splitleak.runtime import apply_threads
    from splitleak.wire.client import parse_address

    logging.basicConfig(level=logging.WARNING, format="serve: %(message)s")
    with user_errors():
        apply_threads(threads)
        host, port = parse_address(listen, what="--listen")

        def report(rec) -> None:
            line = f"session {rec.index} from {rec.peer}: {rec.status}, {rec.frames} frames"
            line += f"; {rec.reason}" if rec.reason else ""
            line += f"; capture {rec.capture}" if rec.capture else ""
            (console if rec.status == "complete" else err).print(line, highlight=False, markup=False)

        node = ServerNode(
            tls_dir,
            host,
            port,
            capture=capture,
            checkpoints=checkpoints,
            allow_remote=allow_remote,
            max_sessions=max_sessions,
            idle_seconds=idle,
            max_concurrent=max_concurrent,
            hello_seconds=hello_timeout,
            max_pending=max_pending,
            max_pending_per_address=max_pending_per_address,
            handshake_seconds=handshake_timeout,
            max_rows=max_rows,
            max_tokens=max_tokens,
            max_frame_tokens=max_frame_tokens,
            max_frame_bytes=max_frame_mib << 20,
            on_session=report,
        )
        bound = node.start()
        console.print(f"listening on {host}:{bound}", highlight=False)
        try:
            node.serve_forever()
        except KeyboardInterrupt:
            node.shutdown()
