"""One client connection of ``splitleak serve`` (``Session``): the handshake and its checks, the frames,
the session's own capture and checkpoints, and its end, recorded whatever raises. The node that accepts
connections and caps them is ``splitleak.deploy.server``; the module docstring there says what a hostile
client meets."""

from __future__ import annotations

import logging
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from websockets.exceptions import ConnectionClosed

from splitleak.defences import DefenceChain
from splitleak.models import SplitModel, load_model
from splitleak.runs.chain import resumed_record
from splitleak.runs.store import RunStore
from splitleak.runtime import package_versions
from splitleak.training.checkpoint import CheckpointDir, mode_of, restore_state, state_tensors
from splitleak.training.config import ServerConfig
from splitleak.training.latent import LatentServer, latent_defence_record
from splitleak.training.loop import set_trainable
from splitleak.training.roles import PENDING_WINDOW, ServerRole
from splitleak.wire.channel import MAIN_LINK, WireLedger
from splitleak.wire.client import CLIENT_KINDS, cap_messages
from splitleak.wire.declare import MESSAGES_FILE, declare_channels, declare_latent_channels
from splitleak.wire.frames import PHASES, Frame, decode, encode
from splitleak.wire.tap import WireRecorder
from splitleak.wire.transport import (
    HANDSHAKE_MESSAGE_BYTES,
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

log = logging.getLogger("splitleak.serve")
#: transformers' lazy imports are not thread-safe, and two sessions need not hold two copies at once
#: while loading: sessions load their model one at a time
_LOAD_LOCK = threading.Lock()


def _mismatch(what: str, mine: Any, theirs: Any) -> str:
    return f"{what} differs: the server has {mine!r}, the client sent {theirs!r}"


class Node(Protocol):
    """What a session reads of the node that accepted it (``splitleak.deploy.server.ServerNode``)."""

    @property
    def capture(self) -> str | Path | None: ...
    @property
    def checkpoints(self) -> str | Path | None: ...
    @property
    def hello_seconds(self) -> float: ...
    @property
    def idle_seconds(self) -> float: ...
    @property
    def max_rows(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def max_frame_tokens(self) -> int: ...
    @property
    def max_frame_bytes(self) -> int: ...


@dataclass
class SessionRecord:
    index: int
    peer: str
    status: str = "open"
    reason: str = ""
    frames: int = 0
    capture: str | None = None


def peer_address(conn) -> str:
    """The client's address, or "?" when its socket has none any more: a client that left between its opening
    handshake and its session's start made ``remote_address`` raise (ENOTCONN), which failed the connection's
    handler with a traceback."""
    try:
        return str(conn.remote_address)
    except (AttributeError, OSError):
        return "?"


class Session:
    """One client connection: handshake, frames, close. Owns its model, role, ledger and capture."""

    def __init__(self, node: Node, conn, index: int):
        self.node = node
        self.conn = conn
        self.rec = SessionRecord(index, peer_address(conn))
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
        self.resumed_capture: str | None = None

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
        cfg = config.latent
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
        self._checkpoints(hello)  # the surrogate and its AdamW, as a split server's layers
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
                    f"this server's checkpoint of that training after {done} steps is of another configuration "
                    f"({record.get('mode', 'split')} mode, {str(record.get('config_hash'))[:12]}; the hello's: "
                    f"{mode_of(self.config.latent)} mode, {self.config.hash()[:12]}); resume the run that trained it, or train "
                    "again without --resume"
                )
            restore_state(self.role.params, self.role.opt, tensors, record)
            self.token, self.resumed, self.last_step = token, got, got - 1
            self.resumed_capture = record.get("capture")  # the session capture holding the steps before
        elif folder is not None and every is not None:
            self.token = new_nonce()
        self.checkpoint_every = every if folder is not None else None

    def _checkpoint(self, frame: Frame) -> bool:
        """After the frame that completes a training step (the forward in a plain split, the trunk's
        backward in a U-shape, the surrogate's in the latent mode), every ``checkpoint_every`` steps: write
        the server's checkpoint, before the reply, so the client's newest checkpoint is never ahead of the
        server's. Whether it wrote one (the reply's frames are then flushed to the capture)."""
        done = frame.step + 1
        if self.checkpoint_every is None or done % self.checkpoint_every:
            return False
        assert self.role is not None and self.node.checkpoints is not None and self.token is not None
        tensors, record = state_tensors(self.role.params, self.role.opt)
        record.update(config_hash=self.config.hash(), mode=mode_of(self.config.latent))
        if self.store is not None:
            record["capture"] = str(self.store.root.resolve())
        CheckpointDir(Path(self.node.checkpoints) / self.token).save(done, tensors, record)
        return True

    def _open_store(self) -> None:
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
                **self._resumed_from(root),
            },
        )

    def _resumed_from(self, root: Path) -> dict[str, Any]:
        """A resumed session's record of the session capture that holds its steps before the resume."""
        if self.resumed is None or self.resumed_capture is None:
            return {}
        return {"resumed_from": resumed_record(self.resumed_capture, self.resumed, root, token=self.token)}

    # ------------------------------------------------------------ frames
    def _switch_phase(self, phase: str) -> None:
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
        saved = frame.phase == "train" and frame.kind == self.completes and self._checkpoint(frame)
        blob = encode(reply)
        self.ledger.record(decode(blob), blob)
        if saved and self.recorder is not None:
            self.recorder.flush()  # every frame before the checkpoint in the capture: a resume reads them there
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
        try:
            cap_messages(self.conn, HANDSHAKE_MESSAGE_BYTES)  # a hello is a header: nothing larger yet
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
            cap_messages(self.conn, self.limits.max_message_bytes())
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


def _server_params(split) -> list[tuple[str, torch.nn.Parameter]]:
    ids = {id(p) for p in split.trainable_parameters()[1]}
    return [(n, p) for n, p in split.model.named_parameters() if id(p) in ids]
