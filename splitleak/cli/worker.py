"""``splitleak worker``: the warm worker that runs ``splitleak attack`` commands with its imports done and its models
loaded (``splitleak.warm`` holds what its clients share with it: where it listens, its messages, the code digest).

``serve`` is the worker itself: it runs each command it is handed through this command line (``app``), on the
client's streams, in the client's folder and environment, after putting back what a command may leave behind
(``_Baseline``); ``start`` runs ``serve`` detached."""

from __future__ import annotations

import datetime
import os
import socket
import struct
import subprocess
import sys
import time
import traceback
from typing import Any

import typer

from splitleak import warm
from splitleak.attacks.registry import load_plugins
from splitleak.cli.common import app, console, err, reset_consoles, user_errors
from splitleak.errors import ConfigError
from splitleak.runtime import keep_freed_memory

#: the longest path a Unix socket binds to on Linux (sun_path's 108 bytes, less the terminating NUL)
_SOCKET_PATH_BYTES = 107
#: ours: how long the worker waits for a connection's request before it drops the connection
REQUEST_TIMEOUT_S = 5.0

worker_app = typer.Typer(
    help="The warm worker: one process that keeps the imports and the loaded models of `splitleak attack` commands "
    "(each command then skips its start, imports and model load)."
)
app.add_typer(worker_app, name="worker")

IdleOpt = typer.Option(900.0, "--idle", help="stop after this many seconds without a command")
PreloadOpt = typer.Option(
    [], "--preload", help="a model to load before the first command (a preset, e.g. smollm2-135m; repeatable)"
)


def _check_idle(idle: float) -> None:
    if idle <= 0:
        err.print(f"[bold red]error:[/] --idle must be > 0 seconds, got {idle:g}", highlight=False)
        raise typer.Exit(2)


@worker_app.command("start")
def start_cmd(
    idle: float = IdleOpt,
    preload: list[str] = PreloadOpt,
    wait: float = typer.Option(120.0, "--wait", help="seconds to wait for it to listen"),
) -> None:
    """Start the worker, detached (its log: worker.log beside its socket). While it runs, `splitleak attack` commands
    run in it; SPLITLEAK_WORKER=off runs one in its own process."""
    _check_idle(idle)
    if warm.listening():
        state = warm.ask("ping")
        pid = f"pid {state['pid']}" if state else "busy with a command"
        console.print(f"a worker runs already ({pid}) on {warm.socket_path()}", highlight=False)
        return
    warm.private_dir(warm.worker_dir())
    with open(warm.log_path(), "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "splitleak.cli", "worker", "serve", "--idle", str(idle)]
            + [arg for name in preload for arg in ("--preload", name)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # not stopped by the terminal's Ctrl-C or hang-up
        )
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        state = warm.ask("ping", timeout=2.0)
        if state is not None and state["pid"] == proc.pid:
            console.print(f"worker pid {proc.pid} listens on {warm.socket_path()} (stops after {idle:g} s idle)")
            return
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
    said = [line for line in warm.log_path().read_text(errors="replace").splitlines() if line.strip()][-1:]
    err.print(
        f"[bold red]error:[/] the worker did not start (exit {proc.poll()}); its log ({warm.log_path()}) ends: "
        f"{said[0] if said else '(nothing)'}",
        highlight=False,
        soft_wrap=True,
    )
    raise typer.Exit(1)


@worker_app.command("serve")
def serve_cmd(
    idle: float = IdleOpt,
    preload: list[str] = PreloadOpt,
) -> None:
    """Be the worker, in the foreground (`start` runs this detached): serve `splitleak attack` commands until --idle
    seconds pass without one, or `splitleak worker stop`."""
    _check_idle(idle)
    raise typer.Exit(serve(idle, preload))


@worker_app.command("status")
def status_cmd() -> None:
    """Whether a worker runs: its pid, since when, the commands it ran, the models it keeps. Exit 1 where none runs."""
    state = warm.ask("ping")
    if state is None:
        busy = warm.listening()
        what = (
            "a worker listens on {} but ran a command for over 10 s without answering"
            if busy
            else "no worker listens on {}"
        )
        console.print(what.format(warm.socket_path()), highlight=False)
        raise typer.Exit(0 if busy else 1)
    since = datetime.datetime.fromtimestamp(state["since"]).isoformat(timespec="seconds")
    stale = state["digest"] != warm.code_digest()
    console.print(
        f"worker pid {state['pid']} on {warm.socket_path()}, since {since}: {state['served']} commands, "
        f"stops after {state['idle_s']:g} s idle; models kept: {', '.join(state['models']) or 'none'}"
        + ("; [bold]stale[/] (started from other code or settings): the next command stops it" if stale else ""),
        highlight=False,
    )


@worker_app.command("stop")
def stop_cmd(wait: float = typer.Option(30.0, "--wait", help="seconds to wait for it to exit")) -> None:
    """Stop the worker (after the command it runs, if any)."""
    if not warm.listening():
        console.print("no worker was running", highlight=False)
        return
    state = warm.ask("ping", timeout=wait)
    if state is None or warm.ask("stop", timeout=wait) is None:
        err.print(f"the worker did not answer in {wait:g} s (a command still runs); try again later", highlight=False)
        raise typer.Exit(1)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and _alive(state["pid"]):
        time.sleep(0.05)
    console.print(f"worker pid {state['pid']} stopped", highlight=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a child of this process (the tests start one) stays a zombie until reaped
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


# --------------------------------------------------------------------------- the worker


class _Baseline:
    """What a command may change in the process and a fresh process starts with: put back before every command."""

    def __init__(self) -> None:
        import torch  # lazy: the worker only

        self.threads = torch.get_num_threads()
        self.dtype = torch.get_default_dtype()

    def restore(self) -> None:
        import torch  # lazy: the worker only

        torch.set_num_threads(self.threads)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(True)
        torch.seed()  # a fresh process's generator starts from a fresh nondeterministic seed too
        reset_consoles()


def _run(app: Any, request: dict[str, Any], fds: list[int], baseline: _Baseline) -> int:
    """One command on the client's streams, in its folder and environment; its exit status."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(i) for i in range(3)]
    env, cwd = dict(os.environ), os.getcwd()
    try:
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
        try:
            os.environ.clear()
            os.environ.update(request["env"])
            os.chdir(request["cwd"])
            baseline.restore()
            app(args=list(request["argv"]), prog_name="splitleak")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)
        except KeyboardInterrupt:
            code = 130
        except Exception:  # noqa: BLE001 (a bug: its traceback goes where a fresh process's would)
            traceback.print_exc()
            code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for i, fd in enumerate(saved):
            os.dup2(fd, i)
            os.close(fd)
        for fd in fds:
            os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
    return code


def serve(idle: float, preload: list[str] | None = None) -> int:
    """Listen on ``warm.socket_path`` until ``idle`` seconds pass without a command or a ``stop``; 0, or 1 where another
    worker listens already. Before the first command: torch's and transformers' imports, and the models ``preload``
    names (float32; the first command that loads another model loads it then)."""
    digest = warm.code_digest()
    warm.private_dir(warm.worker_dir())
    if warm.listening():  # answering or busy: its socket is not a stale one to replace
        print(f"a worker listens on {warm.socket_path()} already", file=sys.stderr)
        return 1
    path = warm.socket_path()
    if len(os.fsencode(path)) > _SOCKET_PATH_BYTES:
        print(
            f"the worker's socket {path} is longer than a Unix socket's path may be ({_SOCKET_PATH_BYTES} bytes); set "
            f"{warm.DIR_ENV} to a shorter folder",
            file=sys.stderr,
        )
        return 2
    path.unlink(missing_ok=True)  # left by a worker that was killed
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(8)
    try:
        return _listen(srv, path, idle, preload or [], digest)
    finally:
        srv.close()
        path.unlink(missing_ok=True)


def _listen(srv: socket.socket, path: Any, idle: float, preload: list[str], digest: str) -> int:
    """``serve``'s imports, preloads and loop, on a bound socket."""
    import torch  # lazy: torch stays out of `splitleak --help`; the worker imports it once, before the first command
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: F401  (lazy: as torch)

    from splitleak.models.presets import keep_models, kept_models, load_model  # lazy: as torch

    keep_freed_memory()
    load_plugins()
    keep_models(warm.KEEP_MODELS)
    with user_errors():  # an unknown or missing model: the error in one line, and no worker
        if len(preload) > warm.KEEP_MODELS:
            raise ConfigError(f"--preload names {len(preload)} models; a worker keeps at most {warm.KEEP_MODELS}")
        for name in preload:
            load_model(name)
    baseline = _Baseline()
    state = {"pid": os.getpid(), "digest": digest, "since": time.time(), "served": 0, "idle_s": idle}
    print(
        f"worker {os.getpid()} listening on {path} (torch {torch.__version__}, idle {idle:g} s, models kept: "
        f"{', '.join(kept_models()) or 'none'})",
        flush=True,
    )
    while True:
        srv.settimeout(idle)
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            print(f"idle for {idle:g} s: stopping", flush=True)
            return 0
        with conn:
            conn.settimeout(REQUEST_TIMEOUT_S)  # a client that connects and says nothing holds the worker no longer
            if not _serve_one(conn, app, baseline, state, kept_models):
                return 0


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _serve_one(conn: socket.socket, app: Any, baseline: _Baseline, state: dict[str, Any], kept) -> bool:
    """Answer one connection; False where the worker is to stop."""
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if uid != os.getuid():
        print(f"refused a connection from uid {uid} (pid {pid})", flush=True)
        return True
    try:
        request, fds = warm.receive(conn, max_fds=3)
        conn.settimeout(None)  # a command may run for hours; its client waits as long
    except (OSError, ValueError) as exc:
        print(f"a malformed request from pid {pid}: {exc}", flush=True)
        return True
    if request is None:
        return True
    op = request.get("op")
    if op == "run" and len(fds) == 3:
        answer: dict[str, Any] = {"pid": os.getpid()} if request.get("digest") == state["digest"] else {"stale": True}
    elif op in ("ping", "stop"):
        answer = {**state, "models": kept()} if op == "ping" else {"stopping": True}
    else:
        _close(fds)
        print(f"an unknown request from pid {pid}: {op!r}", flush=True)
        return True
    try:
        warm.send(conn, answer)
        sent = True
    except OSError:  # the client went away before the answer (it waited too long)
        sent = False
        print(f"pid {pid} went away before its answer to {op!r}", flush=True)
    if op == "stop" or "stale" in answer:
        _close(fds)
        print(f"stopped by pid {pid}" if op == "stop" else f"stale: pid {pid} runs other code or settings", flush=True)
        return False
    if op == "ping" or not sent:  # a command whose client went away is not run
        _close(fds)
        return True
    t0 = time.perf_counter()
    code = _run(app, request, fds, baseline)
    state["served"] += 1
    print(f"{' '.join(request['argv'])!r} for pid {pid}: exit {code} in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        warm.send(conn, {"exit": code})
    except OSError:  # the client went away (interrupted): the command's outcome is in its files
        pass
    return True
