"""The warm worker's client side: where the worker listens, what it and its clients say to each other, and how a
command is handed to it. The worker itself is ``splitleak worker serve`` (``splitleak.cli.worker``); the console
script (``splitleak.launch``) calls ``hand_over`` first.

The worker is one long-lived process per user that keeps the imports and the loaded models of ``splitleak attack``
commands, so that a command pays the process's start, torch's and transformers' imports and the model's load once,
not every time (issue 53: at 8 documents they were four fifths of the command). ``splitleak worker start`` starts it,
detached; it exits after ``--idle`` seconds without a command, or on ``splitleak worker stop``. While it runs, every
``splitleak attack`` command is handed to it over a Unix socket in a folder only the user can open (``worker_dir``),
with the command's arguments, its working folder, its environment and its standard streams (their file
descriptors, so that the output goes where the command's would), and the command exits with the exit status the
worker reports. The worker runs the command through the same command line a fresh process runs, one command at a
time, after putting back what a command may leave behind (torch's threads, its global generator, its default dtype,
the consoles' view of the terminal); ``models.presets.keep_models`` gives each command its own copy of a model loaded
once: the same weights, bit for bit, as a fresh load.

A command runs in its own process as before where no worker runs, with ``SPLITLEAK_WORKER=off``, and where the worker
was started from other code: the package's files (their paths, sizes and modification times), another Python, other
installed distributions, or other values of the variables a process reads once at its start (``START_ENV``). Such a
worker answers that it is stale and exits; the command says so in one line and runs here.

Nothing is unpickled: the messages are length-prefixed JSON. The worker serves only its own user (the socket's folder
is 0700, and the peer's uid is checked on every connection).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import sys
from pathlib import Path
from typing import Any

#: ``off`` (or 0): never hand a command to a worker
WORKER_ENV = "SPLITLEAK_WORKER"
#: where the worker's socket and log live (default: $XDG_CACHE_HOME/splitleak/worker or ~/.cache/splitleak/worker)
DIR_ENV = "SPLITLEAK_WORKER_DIR"
#: read once when a process starts (plug-ins, import paths, thread pools, the heap, devices): a worker started under
#: other values is stale
START_ENV = (
    "SPLITLEAK_PLUGINS",
    "SPLITLEAK_MALLOC",
    "PYTHONPATH",
    "PYTHONHASHSEED",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
)
#: the commands handed to a worker
COMMANDS = ("attack",)
#: ours: how many models a worker keeps (each about 0.6 GB for SmolLM2 in float32)
KEEP_MODELS = 2
_HEADER = struct.Struct("!I")
_MAX_MESSAGE = 16 << 20


def worker_dir() -> Path:
    env = os.environ.get(DIR_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "splitleak" / "worker"


def socket_path() -> Path:
    return worker_dir() / "worker.sock"


def log_path() -> Path:
    return worker_dir() / "worker.log"


def code_digest(root: Path | None = None) -> str:
    """What a command's results depend on besides its arguments and files, known without importing torch: this
    Python, the distributions installed beside it, ``START_ENV``'s values, and the files of the package (or of
    ``root``): path, size, modification time."""
    h = hashlib.sha256()
    h.update(f"{sys.executable}\n{sys.version}\n".encode())
    for name in START_ENV:
        h.update(f"{name}={os.environ.get(name)}\n".encode())
    for entry in sys.path:
        if entry and os.path.isdir(entry):
            h.update(repr(sorted(n for n in os.listdir(entry) if n.endswith(".dist-info"))).encode())
    root = root or Path(__file__).resolve().parent
    for p in sorted(root.rglob("*")):
        if "__pycache__" not in p.parts and p.is_file():
            st = p.stat()
            h.update(f"{p.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


# --------------------------------------------------------------------------- messages


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    body = json.dumps(message).encode()
    data = _HEADER.pack(len(body)) + body
    if fds:
        sent = socket.send_fds(sock, [data], fds)
        data = data[sent:]
    if data:  # nothing left: no second send, which fails where the peer has answered and closed already
        sock.sendall(data)


def receive(sock: socket.socket, max_fds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """One message and the descriptors that came with it; (None, []) where the peer closed first."""
    buf, fds = b"", list[int]()
    while len(buf) < _HEADER.size or len(buf) < _HEADER.size + _HEADER.unpack_from(buf)[0]:
        if max_fds and not fds:
            chunk, got, _, _ = socket.recv_fds(sock, 1 << 16, max_fds)
            fds = list(got)
        else:
            chunk = sock.recv(1 << 16)
        if not chunk:
            for fd in fds:
                os.close(fd)
            return None, []
        buf += chunk
        if len(buf) >= _HEADER.size and _HEADER.unpack_from(buf)[0] > _MAX_MESSAGE:
            raise ValueError("a message over 16 MiB")
    size = _HEADER.unpack_from(buf)[0]
    return json.loads(buf[_HEADER.size : _HEADER.size + size]), fds


def connect(timeout: float | None = None) -> socket.socket | None:
    """A connection to this user's worker, or None where none listens."""
    path = socket_path()
    try:
        st = path.parent.stat()
    except OSError:
        return None
    if st.st_uid != os.getuid() or st.st_mode & 0o077:  # a folder another user could reach: not ours to trust
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        return None
    return sock


def listening() -> bool:
    """Whether a worker listens (answering or busy with a command: a worker answers one connection at a time)."""
    sock = connect(1.0)
    if sock is not None:
        sock.close()
    return sock is not None


def ask(op: str, timeout: float = 10.0) -> dict[str, Any] | None:
    """``ping`` (the worker's state) or ``stop``: the worker's answer, or None where none listens."""
    sock = connect(timeout)
    if sock is None:
        return None
    with sock:
        try:
            send(sock, {"op": op})
            answer, _ = receive(sock)
        except OSError:
            return None
    return answer


# --------------------------------------------------------------------------- the client (the console script)


def hand_over(argv: list[str]) -> int | None:
    """Run ``splitleak ARGV`` in the worker: its exit status, or None where the command is to run here (no worker, not
    a command it takes, ``SPLITLEAK_WORKER=off``, a stale worker)."""
    if not argv or argv[0] not in COMMANDS or os.environ.get(WORKER_ENV, "").strip().lower() in ("off", "0"):
        return None
    if any(a in ("--help", "-h") for a in argv):
        return None
    sock = connect()
    if sock is None:
        return None
    with sock:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        request = {"op": "run", "argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "digest": code_digest()}
        try:
            send(sock, request, [0, 1, 2])
            started, _ = receive(sock)
        except OSError as exc:  # the worker runs a command only once it has said so: this one it did not run
            started = {"lost": f"{type(exc).__name__}: {exc}"}
        except KeyboardInterrupt:  # while the worker ran another command: this one never started there
            return 130
        if started is None or "pid" not in started:
            why = (
                "was started from other code or settings and has stopped"
                if started is not None and started.get("stale")
                else f"did not take the command ({(started or {}).get('lost', 'it closed the connection')})"
            )
            print(
                f"splitleak: the warm worker {why}; running the command here (start a new one with `splitleak worker "
                "start`)",
                file=sys.stderr,
            )
            return None
        try:
            done, _ = receive(sock)
        except KeyboardInterrupt:  # the command stops as a fresh process's would; the worker goes on serving
            os.kill(int(started["pid"]), 2)
            done, _ = receive(sock)
        except OSError:
            done = None
    if done is None:
        print(f"splitleak: the warm worker stopped while running the command; see {log_path()}", file=sys.stderr)
        return 1
    return int(done["exit"])


def private_dir(path: Path) -> None:
    """Make ``path`` a folder only this user can open (the worker's socket and log live there)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to another user; set {DIR_ENV} to a folder of yours")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
