"""``splitleak serve`` for the tests that need a server: in a thread of the test process (``Served``) or in a
process of its own (``ServeProcess``), on an ephemeral loopback port, torn down at exit. Not a test module
(pytest puts ``tests/`` on the path, so tests import it as ``served``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import splitleak
from splitleak.deploy import ServerNode
from splitleak.runs.verify import verify_run

REPO = Path(splitleak.__file__).resolve().parents[1]  # the checkout under test, for the child processes


class Served:
    """A ServerNode on an ephemeral loopback port in a thread; shut down and joined at exit."""

    def __init__(self, tls_dir, capture=None, **kw):
        self.node = ServerNode(tls_dir, capture=capture, **kw)
        self.port = self.node.start()
        self.thread = threading.Thread(target=self.node.serve_forever, daemon=True)
        self.thread.start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.node.shutdown()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()

    def wait_sessions(self, n: int, timeout: float = 30.0):
        t0 = time.monotonic()
        while sum(r.status != "open" for r in self.node.sessions) < n:
            assert time.monotonic() - t0 < timeout, f"sessions did not end: {self.node.sessions}"
            time.sleep(0.02)
        return self.node.sessions


def child_env() -> dict[str, str]:
    """The environment of a child process: offline, quiet, importing the checkout under test."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", PYTHONPATH=str(REPO))
    env.pop("FORCE_COLOR", None)
    return env


class ServeProcess:
    """``splitleak serve`` on an ephemeral loopback port in a process of its own, killed at exit."""

    def __init__(self, tls, *args):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "splitleak.cli", "serve", "--listen", "127.0.0.1:0", "--tls-dir", str(tls),
             "--threads", "1", *map(str, args)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=REPO,
        )  # fmt: skip
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line.startswith("listening on 127.0.0.1:"):
            self.proc.kill()
            raise AssertionError(line + self.proc.stderr.read())  # type: ignore[union-attr]
        self.port = int(line.rsplit(":", 1)[1])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait(timeout=30)


def sessions_ended(cap: Path, n: int, timeout: float = 60.0) -> None:
    """Wait (bounded) until the server's first ``n`` sessions have closed their captures."""
    deadline = time.monotonic() + timeout
    while True:
        done = [verify_run(cap / f"session-{i:04d}").status for i in range(n)]
        if all(done):
            return
        assert time.monotonic() < deadline, f"the server's sessions did not close: {done}"
        time.sleep(0.1)
