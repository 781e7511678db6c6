"""Where and how a process computes: the torch device, its threads, glibc's heap, and the versions of the
packages a run's numbers depend on (recorded in every manifest). One small module, below every stage that uses it."""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import platform
import signal
from typing import TYPE_CHECKING

import splitleak
from splitleak.errors import ConfigError

if TYPE_CHECKING:
    import torch

PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "pydantic", "faker", "gguf")


def resolve_device(device: str) -> torch.device:
    import torch  # lazy: torch stays out of `splitleak --help`, which loads this module (keep_freed_memory)

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was requested but no CUDA device is visible; use --device cpu or auto")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ConfigError(f"unknown device {device!r}; use auto, cpu or cuda")
    return torch.device(device)


def apply_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {threads}")
        import torch  # lazy: as in resolve_device

        torch.set_num_threads(threads)


#: glibc's ``mallopt`` parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: ours: the largest block glibc takes from its heap (not a fresh mapping), and the free memory it keeps at the
#: heap's top, when ``keep_freed_memory`` is on. 64 MiB holds a ranking of 256 rows against a 49,152-token
#: vocabulary (48 MiB) and every tensor of a candidates' pass; 256 MiB holds the pass's temporaries together.
HEAP_MMAP_THRESHOLD = 64 << 20
HEAP_TRIM_THRESHOLD = 256 << 20
#: ``keep`` (the default) or ``system`` (glibc's own behaviour, for comparison)
MALLOC_ENV = "SPLITLEAK_MALLOC"
_MALLOC_CHOICES = ("keep", "system")
_KEPT: bool | None = None


def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc (whose ``mallopt`` and ``malloc_trim`` the heap's two settings call),
    else None."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # glibc under another name: leave it
        return None


def die_with_parent() -> None:
    """Linux: get SIGKILL when the parent process dies (``PR_SET_PDEATHSIG``), so that a killed driver leaves no
    grid worker or fork server behind (a worker could write into a run directory the next run is redoing).
    Nothing elsewhere. Not inherited by the process's own children. Strictly it is the parent *thread* that
    counts: a fork server started from a thread that then ends goes with it, and multiprocessing starts another
    when the next worker is asked for (``forkserver.connect_to_new_process`` checks that its server runs)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent already died before prctl
            os._exit(1)
    except (OSError, AttributeError):
        pass


def trim_heap() -> None:
    """Ask glibc to return the heap's free memory to the system now (``malloc_trim``), kept or not: what a
    worker does after each job (``experiments.worker.release_memory``). Nothing where the C library is not
    glibc."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def keep_freed_memory() -> bool:
    """Let glibc's malloc keep the memory the process frees, up to ``HEAP_TRIM_THRESHOLD`` at the heap's top
    and in blocks of up to ``HEAP_MMAP_THRESHOLD``, for the next tensors of the same sizes. By default glibc
    maps a large block afresh and returns the heap's free top to the kernel past twice the largest block freed
    so far, so a forward pass whose temporaries together exceed that faults in (and the kernel zeroes) the same
    memory on every pass: 90 MiB per pass of 2,048 candidates through SmolLM2's six client blocks. Kept,
    budgeted SipIt on 256 documents ran about 2 % faster (``benchmarks/RESULTS.md``, "glibc's heap").
    Workers still give memory back after each job (``experiments.worker.release_memory``: ``malloc_trim``).
    Numbers are unchanged: torch aligns every tensor the same way whichever allocator serves it.

    Called once by the command line, the grid's worker processes and the benchmarks, not on import: a Python
    user's process keeps its allocator unless they call it. ``SPLITLEAK_MALLOC=system`` leaves glibc as it is.
    Returns whether the setting is in force (False where the C library is not glibc)."""
    global _KEPT
    choice = os.environ.get(MALLOC_ENV, "keep")
    if choice not in _MALLOC_CHOICES:
        raise ConfigError(f"{MALLOC_ENV}={choice!r} is not a choice; use one of {', '.join(_MALLOC_CHOICES)}")
    if _KEPT is None:
        _KEPT = False
        libc = _glibc() if choice == "keep" else None
        if libc is not None:
            _KEPT = bool(
                libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(HEAP_MMAP_THRESHOLD))
                and libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(HEAP_TRIM_THRESHOLD))
            )
    return _KEPT


def fused_optimizer(cls: type[torch.optim.Adam] | type[torch.optim.AdamW], params, **kwargs) -> torch.optim.Optimizer:
    """``cls`` (Adam or AdamW) over ``params`` with ``kwargs``, as torch's fused kernel where the device and
    dtype support it, else the default one. The fused kernel updates each tensor in one pass, where the
    default one on the CPU makes about ten: on GMA-SL's soft labels (12.2 M floats) that is 7 % of a step
    (``benchmarks/fused_adam.py``). The update is the same up to float32 rounding, so results can differ from
    the default kernel's in their last bits."""
    params = list(params)
    # torch checks this only at the first step; the devices are those splitleak runs on (``resolve_device``)
    if all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params):
        return cls(params, fused=True, **kwargs)
    return cls(params, **kwargs)


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version(), "splitleak": splitleak.__version__}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out
