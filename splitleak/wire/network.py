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

**A hostile client** (one holding a valid certificate) cannot take the server down: every size a
hello may ask is capped by the server (``max_rows``, ``max_tokens``, their product
``max_frame_tokens``, ``max_frame_bytes``; a hello
over one is refused naming the value, the maximum and the ``serve`` flag that raises it), and the
WebSocket layer refuses a message larger than the session's frame limit plus its envelope before
reading it (only a header-sized message before the welcome); at most ``PENDING_WINDOW`` forwards
await their backward-top per session; at most ``max_concurrent`` sessions run at once (a connection
over the cap is told so, and no model is loaded for it); the hello must arrive within
``hello_seconds``, and the model loads only after a valid hello; a phase only goes forward (train,
then capture); every message after the welcome carries the session id the welcome gave, so a
message recorded in one session is refused in another; a failed TLS handshake is logged with the
peer's address and the reason. Whatever raises, a session's capture ends closed (complete, or failed
with the reason and the last step).
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
from splitleak.training.roles import PENDING_WINDOW
from splitleak.wire.channel import MAIN_LINK, WireLedger
from splitleak.wire.declare import MESSAGES_FILE
from splitleak.wire.frames import PHASES, Frame, decode, encode
from splitleak.wire.transport import (
    ENVELOPE_BYTES,
    HANDSHAKE_MESSAGE_BYTES,
    HELLO_SECONDS,
    MAX_CONCURRENT,
    MAX_FRAME_MIB,
    MAX_FRAME_TOKENS,
    MAX_ROWS,
    MAX_TOKENS,
    PROBE_FACTOR,
    PROTOCOL_VERSION,
    Limits,
    ReplayGuard,
    TransportError,
    frame_bytes,
    frame_header,
    new_nonce,
    new_session_id,
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
#: the client's ceiling on one message whatever a server's welcome says (a session's own cap is lower)
MAX_MESSAGE_BYTES = 512 << 20
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
        self.session_id = new_session_id()  # the welcome gives it; every later message must carry it
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
        header["session"] = self.session_id
        self.send_seq += 1
        self.messages.append({"direction": "server->client", "bytes": len(payload), "header": header})
        return pack(header, payload)

    def _send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        self.conn.send(self._envelope(header, payload))

    def _recv(self, timeout: float | None = None) -> tuple[dict[str, Any], bytes]:
        header, payload = unpack(self.conn.recv(timeout=self.node.idle_seconds if timeout is None else timeout))
        self.messages.append({"direction": "client->server", "bytes": len(payload), "header": header})
        return header, payload

    # ------------------------------------------------------------ handshake
    def _setup(self, hello: dict[str, Any]) -> None:
        from splitleak.defences import DefenceChain
        from splitleak.models import SplitModel, load_model
        from splitleak.training.config import ServerConfig
        from splitleak.training.loop import set_trainable
        from splitleak.training.roles import ServerRole
        from splitleak.wire.declare import declare_channels

        if hello.get("type") != "hello":
            raise TransportError(f"the first message must be a hello, not {hello.get('type')!r}")
        if hello.get("protocol") != PROTOCOL_VERSION:
            raise TransportError(_mismatch("protocol version", PROTOCOL_VERSION, hello.get("protocol")))
        try:
            config = ServerConfig(**hello["config"])
        except Exception as exc:  # noqa: BLE001 (pydantic and type errors alike)
            raise TransportError(f"the hello's configuration is invalid: {str(exc).splitlines()[0]}") from None
        self._check_sizes(config)
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
        if chain.server_defence is not None:
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
        self._check_frame_bytes(PROBE_FACTOR * max(config.capture_batch, 1), config.doc_len, width, str(split.dtype))
        self.role = ServerRole(split, chain, config.lr)
        self._checkpoints(hello)
        self.limits = Limits(
            width=width,
            max_tokens=config.doc_len,
            max_rows=PROBE_FACTOR * max(config.capture_batch, 1),
            float_dtype=str(split.dtype),
            max_frame_bytes=self.node.max_frame_bytes,
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
        self._check_frame_bytes(
            max(config.capture_batch, 1), config.doc_len + cfg.decoys, cfg.width, f"torch.{config.precision}"
        )
        self.limits = Limits(
            width=cfg.width,
            max_tokens=config.doc_len + cfg.decoys,  # a frame's rows: one document's and its decoys
            max_rows=max(config.capture_batch, 1),  # frames per request
            float_dtype=f"torch.{config.precision}",
            max_frame_bytes=self.node.max_frame_bytes,
        )
        self.declaration = declare_latent_channels(
            output_gradient=cfg.output_gradient,
            transport=True,
            gauge_entropy=cfg.gauge_entropy,
            decoy_release=cfg.decoy_release,
        )
        if self.node.capture is not None:
            self._open_store()

    def _check_sizes(self, config) -> None:
        """Refuse a hello whose rows or tokens exceed the server's maxima, before any model loads."""
        node = self.node
        batch = max(config.capture_batch, 1)
        if config.latent is None:
            rows, rows_why = (
                PROBE_FACTOR * batch,
                f"capture_batch {config.capture_batch} x {PROBE_FACTOR} for probe rows",
            )
            tokens, tokens_why = config.doc_len, f"doc_len {config.doc_len}"
        else:
            rows, rows_why = batch, f"capture_batch {config.capture_batch}"
            decoys = config.latent.decoys
            tokens, tokens_why = config.doc_len + decoys, f"doc_len {config.doc_len} + {decoys} decoys"
        if rows > node.max_rows:
            raise TransportError(
                f"the hello asks for {rows} rows per frame ({rows_why}); this server allows at most {node.max_rows} "
                "(raise it with `splitleak serve --max-rows`, or lower the client's capture_batch)"
            )
        if tokens > node.max_tokens:
            raise TransportError(
                f"the hello asks for {tokens} tokens per row ({tokens_why}); this server allows at most "
                f"{node.max_tokens} (raise it with `splitleak serve --max-tokens`, or lower the client's --doc-len)"
            )
        if rows * tokens > node.max_frame_tokens:
            raise TransportError(
                f"the hello asks for frames of {rows} rows x {tokens} tokens = {rows * tokens}; this server allows at "
                f"most {node.max_frame_tokens} rows x tokens (raise it with `splitleak serve --max-frame-tokens`, or "
                "lower the client's capture_batch or --doc-len)"
            )

    def _check_frame_bytes(self, rows: int, tokens: int, width: int, float_dtype: str) -> None:
        """Refuse a hello whose largest frame would exceed the server's frame-byte maximum."""
        need, cap = frame_bytes(rows, tokens, width, float_dtype), self.node.max_frame_bytes
        if need > cap:
            raise TransportError(
                f"the hello's frames would hold up to {need} bytes ({rows} rows x {tokens} tokens x width {width}, "
                f"{float_dtype}); this server allows at most {cap} (raise it with `splitleak serve --max-frame-mib`)"
            )

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
        if self.phase is not None and PHASES.index(phase) < PHASES.index(self.phase):
            raise TransportError(
                f"a {phase} frame arrived after the {self.phase} phase began; a phase may only go forward "
                f"({' -> '.join(PHASES[:2])}), never back"
            )
        self._close_recorder()
        self.phase = phase
        if phase == "capture" and self.role is not None:
            self.role.opt = None  # the capture pass never steps (as in one process)
        self.recorder = WireRecorder(self.store, phase, self.declaration) if self.store is not None else None
        self.ledger.set_taps([self.recorder] if self.recorder is not None else [])

    def _close_recorder(self) -> None:
        recorder, self.recorder = self.recorder, None  # closed once, even when closing it raises
        if recorder is not None:
            recorder.close([self.ledger.ledger])

    def _frame(self, header: dict[str, Any], payload: bytes) -> None:
        assert self.limits is not None and self.role is not None
        self.guard.check(header)
        frame = receive_frame(header, payload, self.limits, CLIENT_KINDS)
        if frame.kind == "backward-top" and frame.step not in self.role._pending:
            raise TransportError(f"a backward-top frame for step {frame.step} arrived with no pending forward")
        if frame.phase == "train" and frame.kind == "forward" and frame.step <= self.last_step:
            raise TransportError(f"a training forward for step {frame.step} arrived after step {self.last_step}")
        pending = getattr(self.role, "_pending", {})
        if frame.kind == "forward" and len(pending) >= PENDING_WINDOW:
            raise TransportError(
                f"a {frame.phase} forward for step {frame.step} arrived while the forward of step "
                f"{', '.join(map(str, sorted(pending)))} awaits its backward-top; a session may hold at most "
                f"{PENDING_WINDOW} unanswered forward(s) (send the backward-top first)"
            )
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
        """End the session's record: its capture closes complete (``ok``) or failed with ``reason``,
        the phase and the last training step. Never raises: when recording the end fails (a full disk,
        a record already there), the capture closes as failed naming that, or, where even the closing
        entry cannot be written, the session is logged as such (``verify`` then calls it unfinished)."""
        self.rec.status = "complete" if ok else "failed"
        self.rec.reason = reason
        if self.store is None or self.store.closed:
            self._drop_checkpoints()
            return
        try:
            self._close_store(ok, reason)
            self._drop_checkpoints()
            return
        except Exception as exc:  # noqa: BLE001 (whatever it was, the capture must still end closed)
            why = f"{type(exc).__name__}: {exc}"
            self.rec.status = "failed"
            self.rec.reason = f"{reason}; " * bool(reason) + f"recording the session's end failed ({why})"
            log.warning("session %d: %s", self.rec.index, self.rec.reason)
        try:
            if not self.store.closed:
                self.store.close(False, self._failure_info(self.rec.reason))
        except Exception as exc:  # noqa: BLE001
            log.error(
                "session %d: its capture %s could not be closed (%s: %s); `splitleak verify` calls it unfinished",
                self.rec.index,
                self.store.root,
                type(exc).__name__,
                exc,
            )

    def _drop_checkpoints(self) -> None:
        """A session recorded complete (with or without a capture) leaves nothing to resume: its training's
        checkpoints go. Only then: a session whose end could not be recorded keeps them for the client's resume."""
        if self.rec.status == "complete" and self.token is not None and self.node.checkpoints is not None:
            shutil.rmtree(Path(self.node.checkpoints) / self.token, ignore_errors=True)

    def _failure_info(self, reason: str) -> dict[str, Any]:
        return {"reason": reason, "phase": self.phase, "last_step": self.last_step, "frames": self.rec.frames}

    def _close_store(self, ok: bool, reason: str) -> None:
        from splitleak.training.latent import LatentServer

        assert self.store is not None
        try:
            self._close_recorder()
        finally:
            self.recorder = None
        self.store.add_json("messages", MESSAGES_FILE, self.messages)
        self.store.add_json("server-log", "server_log.json", {"losses": self.losses, "frames": self.rec.frames})
        if ok and self.role is not None:
            if isinstance(self.role, LatentServer):  # the surrogate is all the server trains
                state = {k: v.detach().cpu().contiguous() for k, v in self.role.surrogate.state_dict().items()}
            else:
                assert self.split is not None
                state = {n: p.detach().cpu().contiguous() for n, p in _server_params(self.split)}
            self.store.add_tensors("server-layers", "server_layers.safetensors", state, {"session": self.rec.index})
        self.store.close(ok, self._failure_info(reason) if not ok else {"frames": self.rec.frames})

    def run(self) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            _cap_messages(self.conn, HANDSHAKE_MESSAGE_BYTES)  # a hello is a header: nothing larger yet
            hello, _ = self._recv(timeout=self.node.hello_seconds)
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
            self.guard.session = self.session_id  # from now on every message must carry it
            _cap_messages(self.conn, self.limits.max_message_bytes())
            while True:
                header, payload = self._recv()
                self.guard.check_session(header)
                kind = header.get("type")
                if kind == "close":
                    bye = self._envelope({"type": "bye", "frames": self.rec.frames})  # logged before the capture closes
                    self._finish(True)
                    if self.rec.status == "complete":
                        self.conn.send(bye)
                    else:  # the end could not be recorded: the client must not take the session as whole
                        self.conn.send(self._envelope({"type": "error", "message": self.rec.reason}))
                    self.conn.close()
                    return
                if kind != "frame":
                    raise TransportError(f"unknown message type {kind!r}")
                self._frame(header, payload)
        except (ConnectionClosed, TimeoutError) as exc:
            where = f"after {self.rec.frames} frames (phase {self.phase}, last training step {self.last_step})"
            if isinstance(exc, TimeoutError):
                reason = (
                    f"no hello within {self.node.hello_seconds:g} s of connecting"
                    if self.limits is None
                    else f"idle timeout {where}"
                )
            elif exc.sent is not None and exc.sent.code == 1009:  # the WebSocket layer refused a message unread
                cap = self.limits.max_message_bytes() if self.limits else HANDSHAKE_MESSAGE_BYTES
                reason = (
                    f"a message over the session's limit of {cap} bytes was refused unread {where} "
                    "(the frame limit is `splitleak serve --max-frame-mib`)"
                )
            else:
                reason = f"the client went away {where}"
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
        finally:  # even a BaseException (KeyboardInterrupt) leaves the capture closed
            if self.store is not None and not self.store.closed:
                self._finish(False, f"the session stopped {self.phase and f'in phase {self.phase}' or ''}".strip())


def _cap_messages(conn, n: int) -> None:
    """Set the largest message the WebSocket layer reads on ``conn`` (a larger one is refused from its
    frame header, unread, and the connection closed with code 1009)."""
    conn.protocol.max_message_size = n


class _LoggedSSLSocket(ssl.SSLSocket):
    """The server's TLS sockets: a handshake that fails is logged with the peer's address and why."""

    def do_handshake(self, block: bool = False) -> None:
        try:
            peer = "{}:{}".format(*self.getpeername()[:2])  # before the handshake: a refused peer may leave at once
        except OSError:
            peer = "an unknown peer"
        try:
            super().do_handshake(block)
        except Exception as exc:
            log.warning("TLS handshake with %s failed: %s", peer, _tls_reason(exc))
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
        return f"no TLS handshake within {OPEN_TIMEOUT_S:g} s"
    if reason in ("WRONG_VERSION_NUMBER", "HTTP_REQUEST", "UNSUPPORTED_PROTOCOL"):
        return f"not TLS 1.3 ({reason}): plaintext or an older TLS version"
    return f"{reason} ({exc})"


def _server_params(split) -> list[tuple[str, torch.nn.Parameter]]:
    ids = {id(p) for p in split.trainable_parameters()[1]}
    return [(n, p) for n, p in split.model.named_parameters() if id(p) in ids]


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
        for flag, value in (
            ("--max-rows", self.max_rows),
            ("--max-tokens", self.max_tokens),
            ("--max-frame-tokens", self.max_frame_tokens),
            ("--max-frame-mib", self.max_frame_bytes),
            ("--max-concurrent", self.max_concurrent),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{flag} must be a positive integer, not {value!r}")
        if not self.hello_seconds > 0:
            raise ConfigError(f"--hello-timeout must be positive, not {self.hello_seconds!r}")
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
        _cap_messages(conn, HANDSHAKE_MESSAGE_BYTES)
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
        peer = getattr(conn, "remote_address", "?")
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
        from websockets.sync.server import serve

        from splitleak.wire.tls import server_context

        ctx = server_context(self.tls_dir)
        ctx.sslsocket_class = _LoggedSSLSocket  # a failed TLS handshake is logged (websockets drops it silently)
        self._server = serve(
            self._handler,
            self.host,
            self.port,
            ssl=ctx,
            compression=None,
            max_size=self.max_message_bytes(),
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
        from websockets.exceptions import ConnectionClosed

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
            if isinstance(_ssl_cause(exc), ssl.SSLError):  # the TLS session broke right after it opened
                raise TransportError(self._refused_certificate(_ssl_cause(exc))) from None
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
            _cap_messages(self.conn, min(self.limits.max_message_bytes(), MAX_MESSAGE_BYTES))
        except BaseException:
            self.abort()
            raise
        self.welcome = reply  # the server's token and checkpoint interval: what a later resume names

    def _refused_certificate(self, exc: BaseException | None) -> str:
        """Which certificate the server refused, and why as far as this side can tell."""
        from datetime import datetime, timezone

        from cryptography import x509

        alert = getattr(exc, "reason", None) or type(exc).__name__
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
        from websockets.exceptions import InvalidMessage
        from websockets.sync.client import connect

        from splitleak.wire.tls import client_context

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
                if attempt + 1 == attempts:
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
        from websockets.exceptions import ConnectionClosed

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
        from websockets.exceptions import ConnectionClosed

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
