"""Two drivers on one results store (issue 17): a second `experiment run` on a store in use is refused
with the holder's pid; a lock left by a driver that died is taken over; nothing of the store changes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from splitleak.errors import SplitleakError
from splitleak.experiments.store import ResultsStore


@pytest.mark.unit
def test_a_second_driver_is_refused_with_the_holders_pid_and_a_dead_ones_lock_is_taken_over(tmp_path):
    store = ResultsStore(tmp_path / "store")
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = store.root / "run.lock"
        store.root.mkdir()
        lock.write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname(), "started": "earlier"}))
        with pytest.raises(SplitleakError, match=f"pid {holder.pid}, started earlier"):
            with store.lock():
                pytest.fail("a second driver got the lock")
        assert json.loads(lock.read_text())["pid"] == holder.pid  # the holder's lock is left as it was
    finally:
        holder.kill()
        holder.wait(timeout=10)
    # the holder died without removing its lock: the next driver takes it over, and frees it when done
    with store.lock():
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert not lock.exists()
    # a lock from another host is not guessed about: it names the host and the file to delete
    lock.write_text(json.dumps({"pid": 1, "host": "elsewhere"}))
    with pytest.raises(SplitleakError, match="locked by a run on host elsewhere"):
        with store.lock():
            pass
    assert lock.exists()


@pytest.mark.unit
def test_a_plain_log_gets_a_start_line_periodic_progress_with_time_left_and_an_end_line():
    import io

    from rich.console import Console
    from rich.progress import Progress as RP

    from splitleak.progress import RichProgress

    now = [100.0]
    out = io.StringIO()
    with RP(console=Console(file=out, force_terminal=False, width=200)) as bars:
        prog = RichProgress(bars, interval=30, clock=lambda: now[0])
        task = prog.start("beam search", 10)
        for _ in range(4):  # 4 of 10 done at 10 s each: the first line after 30 s, then silent until 60 s
            now[0] += 10
            prog.advance(task)
        now[0] += 60
        prog.advance(task)  # 5 of 10 after 100 s
        prog.finish(task)
    # rich also draws the finished bar once when it stops; these are the lines a log reader follows
    lines = [line for line in out.getvalue().splitlines() if line.strip() and "━" not in line]
    assert lines == [
        "start: beam search (10)",
        "… beam search: 3/10 after 30s, about 1m10s left",
        "… beam search: 5/10 after 1m40s, about 1m40s left",
        "done: beam search (10) in 1m40s",
    ]
