"""``runtime.keep_freed_memory``: glibc keeps what a pass frees for the next pass, in the command line and the
grid's workers, and ``SPLITLEAK_MALLOC=system`` leaves glibc as it is."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from splitleak.errors import ConfigError
from splitleak.runtime import MALLOC_ENV, keep_freed_memory

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's (mallopt)"),
]

# A child process (the setting lasts for the process): a product's output of 40 MiB, made and freed twenty times,
# like the ranking of 256 rows against SmolLM2's vocabulary (48 MiB); then the page faults per call of five
# more. glibc by default maps a block above 32 MiB afresh each time (its dynamic threshold stops there), so
# every call faults in its pages; kept, the heap serves the next call from the memory the last one freed.
_CALLS = """
import hashlib, json, resource, torch
{setup}
from splitleak import runtime
gen = torch.Generator().manual_seed({seed})
a, b = torch.randn(256, 64, generator=gen), torch.randn(64, 40960, generator=gen)
sums = []
def one():
    out = a @ b  # [256, 40960]: 40 MiB
    sums.append(hashlib.sha256(out.numpy()).hexdigest())  # read in place: no second 40 MiB block
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    one()
start = faults()
for _ in range(5):
    one()
print(json.dumps({{"kept": runtime._KEPT, "faults": (faults() - start) / 5, "sums": sorted(set(sums))}}))
"""


def _faults_per_call(setup: str, seed: int, malloc: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != MALLOC_ENV}
    if malloc is not None:
        env[MALLOC_ENV] = malloc
    code = _CALLS.format(setup=setup, seed=seed)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("seed", [0, 1])
def test_kept_memory_serves_the_next_product_without_page_faults(seed):
    setup = "from splitleak.runtime import keep_freed_memory; keep_freed_memory()"
    kept = _faults_per_call(setup, seed)
    system = _faults_per_call(setup, seed, malloc="system")
    assert kept["kept"] is True and system["kept"] is False
    # 40 MiB is 10,240 pages, faulted in again on every call under glibc's own thresholds
    assert system["faults"] > 10_000, system
    assert kept["faults"] < 50, kept
    # the same products, bit for bit, whichever memory served them
    assert len(kept["sums"]) == 1 and kept["sums"] == system["sums"]


def test_a_grid_worker_keeps_freed_memory():
    got = _faults_per_call("from splitleak.experiments.worker import warm_worker; warm_worker()", seed=0)
    assert got["kept"] is True
    assert got["faults"] < 50, got


def test_an_unknown_choice_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(MALLOC_ENV, "jemalloc")
    with pytest.raises(ConfigError, match=r"SPLITLEAK_MALLOC='jemalloc'.*keep, system"):
        keep_freed_memory()


def test_the_command_line_refuses_an_unknown_choice_before_it_runs():
    env = {**os.environ, MALLOC_ENV: "fast"}
    out = subprocess.run(
        [sys.executable, "-c", "from splitleak.cli import main; main()", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode != 0
    assert "SPLITLEAK_MALLOC='fast' is not a choice" in out.stdout + out.stderr
    assert "Usage" not in out.stdout  # refused before the command ran


def test_a_trimmed_heap_gives_the_kept_memory_back():
    """What a worker does after each job (``release_memory``): kept memory stays resident until the trim."""
    code = """
import json, resource, torch
from splitleak.runtime import keep_freed_memory, trim_heap
assert keep_freed_memory()
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / 2**20
x = torch.ones(12 << 20)  # 48 MiB from the heap, not a mapping of its own
del x
kept = rss()
trim_heap()
print(json.dumps({"kept": kept, "trimmed": rss()}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["kept"] - got["trimmed"] > 40, got  # MiB
