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
