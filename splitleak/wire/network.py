"""Client and server as two processes: WebSockets over mutual TLS 1.3, the tap on the server's side.

**Server** (``ServerNode``; ``splitleak serve``): the untrusted node. Each connection is one session
with its own state. The client's hello names the server's part of the configuration
(``ServerConfig``: no run seed, no data); the server loads the same preset, checks the pretrained
model's fingerprint, the split and the defence chain against the client's, and refuses a mismatch
naming both values (the welcome echoes them, and the client checks them too). It then frees the
weights it never reads (``SplitModel.release_client_side``) and answers frames with a
``ServerRole`` (``splitleak.training.roles``), exactly as in one process, and, given a capture
folder, records everything it receives and sends in a capture store of its own (``session-NNNN/``:
manifest, ``wire/`` shards and ledgers, every message's envelope, the server's trained layers, its
loss log, the hash-chained journal; ``splitleak verify`` works on it unchanged). A session that
ends badly (the client vanished, a frame broke the protocol) closes its store as failed at the last
whole frame. Given a checkpoint folder, a session checkpoints its side every so many steps, and a
later session resumes from such a checkpoint (``splitleak.training.checkpoint``).

**Client** (``RemoteServer``; ``splitleak train --connect``): the trusted node's channel. It sends
the same encoded frames the in-process channel would, and keeps the same ledger and taps, so the
client's run directory is the same in one process and over TLS.

Every message is checked before allocation (``splitleak.wire.transport``); a replayed nonce, an
out-of-window sequence number, a backward with no pending forward, a frame after close, NaN/Inf,
an unknown kind or a lying header ends the session with the reason logged. Compression is off:
message sizes must not depend on the content.
"""

from __future__ import annotations

import logging
import shutil
import ssl
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from splitleak.errors import ConfigError
from splitleak.wire.channel import MAIN_LINK, WireLedger
from splitleak.wire.declare import MESSAGES_FILE
from splitleak.wire.frames import Frame, decode, encode
from splitleak.wire.transport import (
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

if TYPE_CHECKING:
    from websockets.sync.server import Server

    from splitleak.models import SplitModel
    from splitleak.training.latent import LatentServer
    from splitleak.training.roles import ServerRole
    from splitleak.wire.store import RunStore
    from splitleak.wire.tap import WireRecorder

log = logging.getLogger("splitleak.serve")
CLIENT_KINDS = ("forward", "backward-top")
SERVER_KINDS = ("backward", "forward-return")
MAX_MESSAGE_BYTES = 512 << 20  # the WebSocket layer refuses anything larger before reading it
OPEN_TIMEOUT_S = 30.0  # the server's limit on a connection's TLS and WebSocket opening handshakes
OPEN_ATTEMPTS = 3  # the client's attempts at an opening handshake the server closed before answering
IDLE_SECONDS = 300.0
#: transformers' lazy imports are not thread-safe, and two sessions need not hold two copies at once
#: while loading: sessions load their model one at a time
_LOAD_LOCK = threading.Lock()


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


def _mismatch(what: str, mine: Any, theirs: Any) -> str:
    return f"{what} differs: the server has {mine!r}, the client sent {theirs!r}"


# ====================================================================== server


@dataclass
class SessionRecord:
    index: int
    peer: str
    status: str = "open"
    reason: str = ""
    frames: int = 0
    capture: str | None = None


class Session:
    """One client connection: handshake, frames, close. Owns its model, role, ledger and capture."""

    def __init__(self, node: ServerNode, conn, index: int):
        self.node = node
        self.conn = conn
        self.rec = SessionRecord(index, str(getattr(conn, "remote_address", "?")))
        self.guard = ReplayGuard()
        self.send_seq = 0
        self.ledger = WireLedger(link=MAIN_LINK)
        self.phase: str | None = None
        self.recorder: WireRecorder | None = None
        self.store: RunStore | None = None
        self.role: ServerRole | LatentServer | None = None
        self.split: SplitModel | None = None
        self.fingerprint: str | None = None
        self.split_record: dict[str, Any] = {}
        self.defence_record: list[dict[str, Any]] = []
        self.model_record: dict[str, Any] = {}
        self.completes = "forward"  # the frame kind that ends a training step
        self.loss_on_server = True
        self.freed = 0
        self.limits: Limits | None = None
        self.losses: dict[str, list] = {"train": [], "capture": []}
        self.last_step = -1
        self.messages: list[dict[str, Any]] = []  # every envelope, both ways (the handshake and envelope channels)
        self.token: str | None = None  # names this training's checkpoints, for a later resume
        self.checkpoint_every: int | None = None
        self.resumed: int | None = None

    # ------------------------------------------------------------ messages
    def _envelope(self, header: dict[str, Any], payload: bytes = b"") -> bytes:
        """The message for ``header`` with its sequence number and nonce, logged as sent."""
        header = {**header, "seq": self.send_seq, "nonce": header.get("nonce") or new_nonce()}
        self.send_seq += 1
        self.messages.append({"direction": "server->client", "bytes": len(payload), "header": header})
        return pack(header, payload)

    def _send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        self.conn.send(self._envelope(header, payload))

    def _recv(self) -> tuple[dict[str, Any], bytes]:
        header, payload = unpack(self.conn.recv(timeout=self.node.idle_seconds))
        self.messages.append({"direction": "client->server", "bytes": len(payload), "header": header})
        return header, payload

    # ------------------------------------------------------------ handshake
    def _setup(self, hello: dict[str, Any]) -> None:
        from splitleak.models import SplitModel, load_model
        from splitleak.training.config import ServerConfig
        from splitleak.training.loop import set_trainable
        from splitleak.training.roles import ServerRole
        from splitleak.wire.declare import declare_channels
        from splitleak.wire.defences import DefenceChain

        if hello.get("type") != "hello":
            raise TransportError(f"the first message must be a hello, not {hello.get('type')!r}")
        if hello.get("protocol") != PROTOCOL_VERSION:
            raise TransportError(_mismatch("protocol version", PROTOCOL_VERSION, hello.get("protocol")))
        try:
            config = ServerConfig(**hello["config"])
        except Exception as exc:  # noqa: BLE001 (pydantic and type errors alike)
            raise TransportError(f"the hello's configuration is invalid: {str(exc).splitlines()[0]}") from None
        if config.latent is not None:
            self._setup_latent(hello, config)
            return
        if config.model_path is not None and not Path(config.model_path).exists():
            raise TransportError(
                f"the client's model path {config.model_path} does not exist on the server; give both nodes the "
                "same model files"
            )
        with _LOAD_LOCK:
            lm = load_model(
                config.model,
                precision=config.precision,
                seed=config.model_init_seed or 0,
                model_path=config.model_path,
            )
        if ("init_seed" in lm.info) != (config.model_init_seed is not None):
            raise TransportError(
                f"model {config.model!r} is {'randomly initialised' if 'init_seed' in lm.info else 'pretrained'} on "
                f"the server, but the hello {'lacks' if config.model_init_seed is None else 'sends'} an init seed"
            )
        fingerprint = self.fingerprint = lm.fingerprint()
        if fingerprint != hello.get("fingerprint"):
            raise TransportError(_mismatch("pretrained model fingerprint", fingerprint, hello.get("fingerprint")))
        chain = DefenceChain.from_specs([d.model_dump() for d in config.defences], config.server_seed)
        split = SplitModel(lm, config.depth, config.offload_start, config.offload_length, shielded=config.shielded)
        if split.spec.as_dict() != hello.get("split"):
            raise TransportError(_mismatch("split", split.spec.as_dict(), hello.get("split")))
        if chain.describe() != hello.get("defences"):
            raise TransportError(_mismatch("defence chain", chain.describe(), hello.get("defences")))
        if chain.build_server(split, config.lr) is not None:
            raise TransportError(
                "this defence chain runs several server copies (replica median); over TLS each copy would be its "
                "own server, which this version does not deploy. Run it in one process"
            )
        chain.check_split_mode(split.spec.mode)
        width = int(split.head.weight.shape[1])  # the hidden size at the cut
        self.freed = split.release_client_side()  # the server holds the layers it runs, not the client's
        set_trainable(split)
        self.split, self.config = split, config
        self.split_record, self.defence_record = split.spec.as_dict(), chain.describe()
        # the frame that ends a step (top-only training returns no gradient: its forward ends it)
        self.completes = "backward-top" if split.spec.u_shape and not split.sends_no_gradient else "forward"
        self.loss_on_server = not split.spec.u_shape
        self.model_record = {"name": lm.name, "source": lm.source, "fingerprint": hello["fingerprint"], **lm.info}
        self.role = ServerRole(split, chain, config.lr)
        self._checkpoints(hello)
        probe = 2  # mixup may add probe rows: at most as many as the real ones
        self.limits = Limits(
            width=width,
            max_tokens=config.doc_len,
            max_rows=probe * max(config.capture_batch, 1),
            float_dtype=str(split.dtype),
        )
        self.declaration = declare_channels(
            u_shape=split.spec.u_shape, defences=chain.defences, transport=True, gradients=not split.sends_no_gradient
        )
        if self.node.capture is not None:
            self._open_store()

    def _setup_latent(self, hello: dict[str, Any], config) -> None:
        """The decoy system's latent mode (``splitleak.training.latent``): the untrusted node holds only
        the gauge-equivariant surrogate, so it loads no model weights and cannot check the client's
        fingerprint (it records it). It checks the split and the defence record against the latent
        configuration, and that no parameter of its surrogate has the model's width H (named in the hello)."""
        from splitleak.training.latent import LatentServer, latent_defence_record
        from splitleak.wire.declare import declare_latent_channels

        cfg = config.latent
        if hello.get("checkpoint_every") is not None or hello.get("resume") is not None:
            raise TransportError("the latent mode does not checkpoint or resume yet; start it without checkpoints")
        want = {"split_after": cfg.split_after, "resume_at": cfg.resume_at, "width": cfg.width}
        split = hello.get("split")
        if not isinstance(split, dict) or {k: split.get(k) for k in want} != want:
            raise TransportError(_mismatch("latent split", want, split))
        hidden = split.get("hidden")
        if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
            raise TransportError(
                f"the hello's latent split names the model width {hidden!r}; expected a positive integer"
            )
        if latent_defence_record(cfg) != hello.get("defences"):
            raise TransportError(_mismatch("defence record", latent_defence_record(cfg), hello.get("defences")))
        self.role = LatentServer(cfg, config.lr, config.server_seed, hidden=hidden)
        self.config, self.split = config, None
        self.fingerprint = None  # no weights here to check it against
        self.split_record, self.defence_record = split, latent_defence_record(cfg)
        self.completes, self.loss_on_server = "backward-top", False
        self.model_record = {
            "name": config.model,
            "fingerprint": hello.get("fingerprint"),
            "fingerprint_checked": False,
        }
        self.freed = 0
        self.limits = Limits(
            width=cfg.width,
            max_tokens=config.doc_len + cfg.decoys,  # a frame's rows: one document's and its decoys
            max_rows=max(config.capture_batch, 1),  # frames per request
            float_dtype=f"torch.{config.precision}",
        )
        self.declaration = declare_latent_channels(
            output_gradient=cfg.output_gradient,
            transport=True,
            gauge_entropy=cfg.gauge_entropy,
            decoy_release=cfg.decoy_release,
        )
        if self.node.capture is not None:
            self._open_store()

    def _checkpoints(self, hello: dict[str, Any]) -> None:
        """Resume from a checkpoint the hello names, and set up this session's own checkpoints."""
        from splitleak.training.checkpoint import CheckpointDir, restore_state

        assert self.role is not None
        every, resume = hello.get("checkpoint_every"), hello.get("resume")
        if every is not None and (not isinstance(every, int) or every < 1):
            raise TransportError(f"checkpoint_every must be a positive integer, not {every!r}")
        folder = self.node.checkpoints
        if resume is not None:
            token, done = resume.get("token"), resume.get("done")
            if not isinstance(token, str) or not token.isalnum() or not isinstance(done, int) or done < 1:
                raise TransportError(f"the hello's resume field is malformed: {resume!r}")
            if folder is None:
                raise TransportError(
                    "the client asks to resume, but this server keeps no checkpoints (start it with --checkpoints DIR)"
                )
            ck = CheckpointDir(Path(folder) / token)
            held = ck.steps()
            if done not in held:  # both sides must continue from the same step, or the weights part ways
                where = (
                    "none: that training completed, or its checkpoints were removed"
                    if not held
                    else f"{', '.join(map(str, held))}: "
                    + ("ahead of" if min(held) > done else "behind" if max(held) < done else "none of them")
                    + " the client's"
                )
                raise TransportError(
                    f"this server holds no checkpoint of that training after {done} steps (it holds {where}); "
                    "train the run again without --resume"
                )
            got, tensors, record, _ = ck.load(done)
            if record.get("config_hash") != self.config.hash():
                raise TransportError(
                    _mismatch("configuration of the checkpoint", record.get("config_hash"), self.config.hash())
                )
            restore_state(self.role.params, self.role.opt, tensors, record)
            self.token, self.resumed, self.last_step = token, got, got - 1
        elif folder is not None and every is not None:
            self.token = new_nonce()
        self.checkpoint_every = every if folder is not None else None

    def _checkpoint(self, frame: Frame) -> None:
        """After the frame that completes a training step (the forward in a plain split, the trunk's
        backward in a U-shape), every ``checkpoint_every`` steps: write the server's checkpoint, before
        the reply, so the client's newest checkpoint is never ahead of the server's."""
        from splitleak.training.checkpoint import CheckpointDir, state_tensors

        assert self.role is not None and self.node.checkpoints is not None and self.token is not None
        done = frame.step + 1
        if self.checkpoint_every is None or done % self.checkpoint_every:
            return
        tensors, record = state_tensors(self.role.params, self.role.opt)
        record["config_hash"] = self.config.hash()
        CheckpointDir(Path(self.node.checkpoints) / self.token).save(done, tensors, record)

    def _open_store(self) -> None:
        from splitleak.training.run import package_versions
        from splitleak.wire.store import RunStore

        assert self.node.capture is not None
        root = Path(self.node.capture) / f"session-{self.rec.index:04d}"
        self.store = RunStore.create(root)
        self.rec.capture = str(root)
        self.store.add_json(
            "manifest",
            "manifest.json",
            {
                "role": "server",
                "session": self.rec.index,
                "peer": self.rec.peer,
                "transport": "websockets over mutual TLS 1.3",
                "protocol": PROTOCOL_VERSION,
                "config": self.config.as_dict(),
                "config_hash": self.config.hash(),
                **({"mode": "latent"} if self.config.latent is not None else {}),
                "model": self.model_record,
                "split": self.split_record,
                "defences": self.defence_record,
                "channels": self.declaration.as_dict(),
                "labels_cross_wire": self.loss_on_server,
                "packages": package_versions(),
                "limits": self.limits.as_dict() if self.limits else None,
                "checkpoints": {"every": self.checkpoint_every, "token": self.token},
                "released_client_side_elements": self.freed,
                "resumed_after_steps": self.resumed,
            },
        )

    # ------------------------------------------------------------ frames
    def _switch_phase(self, phase: str) -> None:
        from splitleak.wire.tap import WireRecorder

        if phase == self.phase:
            return
        self._close_recorder()
        self.phase = phase
        if phase == "capture" and self.role is not None:
            self.role.opt = None  # the capture pass never steps (as in one process)
        self.recorder = WireRecorder(self.store, phase, self.declaration) if self.store is not None else None
        self.ledger.set_taps([self.recorder] if self.recorder is not None else [])

    def _close_recorder(self) -> None:
        if self.recorder is not None:
            self.recorder.close([self.ledger.ledger])
            self.recorder = None

    def _frame(self, header: dict[str, Any], payload: bytes) -> None:
        assert self.limits is not None and self.role is not None
        self.guard.check(header)
        frame = receive_frame(header, payload, self.limits, CLIENT_KINDS)
        if frame.kind == "backward-top" and frame.step not in self.role._pending:
            raise TransportError(f"a backward-top frame for step {frame.step} arrived with no pending forward")
        if frame.phase == "train" and frame.kind == "forward" and frame.step <= self.last_step:
            raise TransportError(f"a training forward for step {frame.step} arrived after step {self.last_step}")
        self._switch_phase(frame.phase)
        self.ledger.record(frame, payload)
        reply = self.role.handle(frame)
        if frame.kind == "forward" and self.role.last_losses is not None and self.loss_on_server:
            self.losses[frame.phase].append(
                {"step": frame.step, "rows": list(frame.doc_ids), "loss": self.role.last_losses}
            )
        if frame.phase == "train" and frame.kind == "forward":
            self.last_step = frame.step
        if frame.phase == "train" and frame.kind == self.completes and self.checkpoint_every is not None:
            self._checkpoint(frame)
        blob = encode(reply)
        self.ledger.record(decode(blob), blob)
        self._send(frame_header(reply, blob, self.send_seq), blob)
        self.rec.frames += 1

    def _finish(self, ok: bool, reason: str = "") -> None:
        from splitleak.training.latent import LatentServer

        self.rec.status = "complete" if ok else "failed"
        self.rec.reason = reason
        if ok and self.token is not None and self.node.checkpoints is not None:  # with or without a capture
            shutil.rmtree(Path(self.node.checkpoints) / self.token, ignore_errors=True)  # whole: nothing to resume
        if self.store is None or self.store.closed:
            return
        self._close_recorder()
        self.store.add_json("messages", MESSAGES_FILE, self.messages)
        self.store.add_json("server-log", "server_log.json", {"losses": self.losses, "frames": self.rec.frames})
        if ok and self.role is not None:
            if isinstance(self.role, LatentServer):  # the surrogate is all the server trains
                state = {k: v.detach().cpu().contiguous() for k, v in self.role.surrogate.state_dict().items()}
            else:
                assert self.split is not None
                state = {n: p.detach().cpu().contiguous() for n, p in _server_params(self.split)}
            self.store.add_tensors("server-layers", "server_layers.safetensors", state, {"session": self.rec.index})
        self.store.close(ok, {"reason": reason} if reason else {"frames": self.rec.frames})

    def run(self) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            hello, _ = self._recv()
            self._setup(hello)
            assert self.limits is not None and self.role is not None
            self._send(
                {
                    "type": "welcome",
                    "protocol": PROTOCOL_VERSION,
                    "fingerprint": self.fingerprint,
                    "split": self.split_record,
                    "defences": self.defence_record,
                    "limits": self.limits.as_dict(),
                    "token": self.token,
                    "checkpoint_every": self.checkpoint_every,
                    "resumed_after_steps": self.resumed,
                }
            )
            while True:
                header, payload = self._recv()
                kind = header.get("type")
                if kind == "close":
                    bye = self._envelope({"type": "bye", "frames": self.rec.frames})  # logged before the capture closes
                    self._finish(True)
                    self.conn.send(bye)
                    self.conn.close()
                    return
                if kind != "frame":
                    raise TransportError(f"unknown message type {kind!r}")
                self._frame(header, payload)
        except (ConnectionClosed, TimeoutError) as exc:
            where = f"after {self.rec.frames} frames (phase {self.phase}, last training step {self.last_step})"
            reason = f"the client went away {where}" if isinstance(exc, ConnectionClosed) else f"idle timeout {where}"
            log.warning("session %d: %s", self.rec.index, reason)
            self._finish(False, reason)
        except Exception as exc:  # noqa: BLE001 (a refused frame, or a fault of the server itself: either way the
            # session ends with its reason, and the capture closes as failed at the last whole frame)
            reason = f"{type(exc).__name__}: {exc}"
            log.warning("session %d refused: %s", self.rec.index, reason)
            try:
                self._send({"type": "error", "message": str(exc)})
                self.conn.close()
            except Exception:  # noqa: BLE001 (the peer may be gone already)
                pass
            self._finish(False, reason)


def _server_params(split) -> list[tuple[str, torch.nn.Parameter]]:
    ids = {id(p) for p in split.trainable_parameters()[1]}
    return [(n, p) for n, p in split.model.named_parameters() if id(p) in ids]


@dataclass
class ServerNode:
    """``splitleak serve``: listens on ``host:port`` (loopback unless ``allow_remote``) with mutual TLS
    from ``tls_dir``; one ``Session`` per connection, at most ``max_sessions`` in all (None: no limit)."""

    tls_dir: str | Path
    host: str = "127.0.0.1"
    port: int = 0
    capture: str | Path | None = None
    allow_remote: bool = False
    max_sessions: int | None = None
    idle_seconds: float = IDLE_SECONDS
    checkpoints: str | Path | None = None  # where sessions keep their training checkpoints (to resume)
    sessions: list[SessionRecord] = field(default_factory=list)
    on_session: Callable[[SessionRecord], None] | None = None

    def __post_init__(self) -> None:
        import ipaddress

        try:
            loopback = self.host == "localhost" or ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            loopback = False
        if not loopback and not self.allow_remote:
            raise ConfigError(
                f"--listen {self.host} is not a loopback address; pass --allow-remote to serve other machines"
            )
        self._lock = threading.Lock()
        self._server: Server | None = None
        self._count = 0  # the next session's number
        self._started = 0  # sessions this process started
        if self.capture is not None and Path(self.capture).is_dir():  # a restarted server: number on, never overwrite
            taken = [int(p.name[8:]) for p in Path(self.capture).glob("session-*") if p.name[8:].isdigit()]
            self._count = max(taken, default=-1) + 1

    def _handler(self, conn) -> None:
        with self._lock:
            if self.max_sessions is not None and self._started >= self.max_sessions:
                conn.close()
                return
            self._started += 1
            ordinal = self._started
            index = self._count
            self._count += 1
        session = Session(self, conn, index)
        self.sessions.append(session.rec)
        session.run()
        if self.on_session is not None:
            self.on_session(session.rec)
        if self.max_sessions is not None and ordinal >= self.max_sessions and self._server is not None:
            threading.Thread(target=self._server.shutdown, daemon=True).start()

    def start(self) -> int:
        """Bind and return the port (an ephemeral one when ``port`` is 0); serve with ``serve_forever``."""
        from websockets.sync.server import serve

        from splitleak.wire.tls import server_context

        self._server = serve(
            self._handler,
            self.host,
            self.port,
            ssl=server_context(self.tls_dir),
            compression=None,
            max_size=MAX_MESSAGE_BYTES,
            ping_interval=None,
            server_header=None,
            open_timeout=OPEN_TIMEOUT_S,
        )
        self.port = int(self._server.socket.getsockname()[1])
        return self.port

    def serve_forever(self) -> None:
        assert self._server is not None, "call start() first"
        self._server.serve_forever()

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()


# ====================================================================== client


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
        self.messages: list[dict[str, Any]] = []  # every envelope, both ways, as the server's capture has them
        try:
            self.conn = self._open(host, port, tls_dir, timeout)
        except ssl.SSLError as exc:  # before OSError, of which it is one
            raise TransportError(
                f"the TLS handshake with {self.where} failed ({exc.reason or exc}): both sides need certificates "
                "from the same CA (`splitleak tls init`)"
            ) from None
        except (OSError, TimeoutError) as exc:
            raise TransportError(f"cannot reach the server at {self.where}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 (websockets' handshake errors)
            raise TransportError(f"the TLS/WebSocket handshake with {self.where} failed: {exc}") from None
        try:
            self._send(hello)
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
        except BaseException:
            self.abort()
            raise
        self.limits = Limits(**reply["limits"])
        self.welcome = reply  # the server's token and checkpoint interval: what a later resume names

    def _open(self, host: str, port: int, tls_dir: str | Path, timeout: float, attempts: int = OPEN_ATTEMPTS):
        """The WebSocket over TLS. A server that closes the connection before its HTTP answer (a busy
        machine past the server's opening timeout) is asked again, ``attempts`` times in all: nothing
        has crossed yet, so a retry changes nothing but the nonce-free TCP connection."""
        from websockets.exceptions import InvalidMessage
        from websockets.sync.client import connect

        from splitleak.wire.tls import client_context

        for attempt in range(attempts):
            try:
                return connect(
                    f"wss://{host}:{port}/splitleak",
                    ssl=client_context(tls_dir),
                    compression=None,
                    max_size=MAX_MESSAGE_BYTES,
                    open_timeout=timeout,
                    ping_interval=None,
                    proxy=None,
                    close_timeout=5,
                )
            except InvalidMessage as exc:
                if attempt + 1 == attempts:
                    raise
                log.warning("the server at %s:%d closed the opening handshake (%s); asking again", host, port, exc)
                time.sleep(0.5 * (attempt + 1))
        raise AssertionError("unreachable")

    def _send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        if self.closed:
            raise TransportError("the session is closed; no frame may follow")
        header = {**header, "seq": self.seq, "nonce": header.get("nonce") or new_nonce()}
        self.seq += 1
        self.conn.send(pack(header, payload))
        self.messages.append({"direction": "client->server", "bytes": len(payload), "header": header})

    def _recv(self, what: str) -> tuple[dict[str, Any], bytes]:
        from websockets.exceptions import ConnectionClosed

        try:
            message = self.conn.recv(timeout=self.timeout)
        except ConnectionClosed as exc:
            raise TransportError(f"the server at {self.where} closed the connection during {what} ({exc})") from None
        except TimeoutError:
            raise TransportError(
                f"the server at {self.where} did not answer within {self.timeout:g} s during {what}"
            ) from None
        header, payload = unpack(message)
        self.messages.append({"direction": "server->client", "bytes": len(payload), "header": header})
        if header.get("type") == "error":
            raise TransportError(f"the server at {self.where} ended the session during {what}: {header.get('message')}")
        return header, payload

    def request(self, frame: Frame) -> Frame:
        from websockets.exceptions import ConnectionClosed

        blob = encode(frame)
        self.record(decode(blob), blob)
        what = f"{frame.phase} step {frame.step}" if frame.step >= 0 else f"the {frame.phase} pass"
        header = frame_header(frame, blob, self.seq)
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


def wait_port(host: str, port: int, timeout: float = 30.0) -> None:
    """Block until something listens on host:port (for tests and scripts that start ``serve``)."""
    import socket

    t0 = time.monotonic()
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() - t0 > timeout:
                raise TransportError(f"nothing listens on {host}:{port} after {timeout:g} s") from None
            time.sleep(0.05)
