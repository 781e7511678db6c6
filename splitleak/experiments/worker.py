"""What runs inside a worker process (a local pool process or a Ray task): one task, start to end: a
train job, or the attack jobs of one run and copy (``sharing``), one after another.

A train job calls ``run_training`` into ``STORE/runs/<key[:16]>`` (``force=True``: a partial
directory left by a killed run is removed and redone), checks it with ``verify_run`` and writes its
utility row. An attack job loads the attacker's knowledge from that run directory, calls
``run_attack`` and writes one row per document; the attack jobs of one task share the run's
verification, its capture and the knowledge (``sharing.Shared``). Each job writes its Parquet file
atomically as it finishes and gives a small status dict; exceptions become ``{"status": "failed", ...}``,
so one bad job never stops the others. A Ray task (``ray_execute_jobs``) does the same in a private
scratch store on its node and yields each job's status with the files it wrote there as it finishes, for
the driver to write into its store (``shipping``).

With ``SPLITLEAK_COUNT_FLOPS=DIR`` in its environment (``benchmarks/grid.py --flops`` sets it), a
worker also counts each job's floating-point operations with ``torch.utils.flop_counter`` and
writes ``DIR/<key>.json`` (``flops``, ``seconds``, the count per operator). The counter sees the
operators it has formulas for (matrix products, attention, convolutions; torch's own formulas,
which count a causal attention as a full one), which carry almost all of a transformer's work,
and only on the job's own thread. In a task, work its jobs share is counted in the job that did it.

Each worker process keeps the pristine weights of the last few models it loaded and hands every
attack task a deep copy (per copy of the client layers it reads), so a grid loads each model once per
worker, not once per job. A train job takes the cached weights themselves (and loads them again for its
all-local twin), so that it never holds the cache, its copy and the optimiser state at once; after every
job the worker collects what the job held and gives the freed heap back to the system
(``release_memory``). See ``benchmarks/worker_memory.py`` for the memory of one worker, job by job.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.utils import flop_counter as fc

from splitleak.attacks.config import make_attack_config
from splitleak.attacks.knowledge import load_knowledge
from splitleak.attacks.registry import REGISTRY, attack_info, load_plugins
from splitleak.audit.defaults import CONTROL_DOCS
from splitleak.errors import IntegrityError
from splitleak.experiments.sharing import Shared
from splitleak.experiments.shipping import outputs_parcel, scratch_root, unpack_run
from splitleak.experiments.store import ResultsStore, attack_rows, format_error, train_row
from splitleak.files import write_atomic
from splitleak.models.presets import ModelKeep
from splitleak.runs.manifest import read_manifest
from splitleak.runs.verify import verify_run
from splitleak.runtime import die_with_parent, keep_freed_memory, trim_heap
from splitleak.seeds import model_init_seed
from splitleak.training import config_from_record, run_training

_QUEUE: Any = None  # progress queue, set by init_worker (local pool) or per Ray task
_MODELS = ModelKeep(3)
PROGRESS_INTERVAL_S = 0.3
FLOPS_ENV = "SPLITLEAK_COUNT_FLOPS"


def _die_with_driver(driver: int | None) -> None:
    """Die with the driver (pid ``driver``). A spawned worker's parent is the driver (``runtime.die_with_parent``); a
    worker forked from a fork server is the server's child, and the server lives as long as any worker holds
    its pipe, so a thread waits for the driver's exit (a pidfd, Linux; else a poll every half second) and
    kills the worker then."""
    if driver is None or driver == os.getppid():
        die_with_parent()
        return
    threading.Thread(target=_watch_driver, args=(driver,), daemon=True, name="splitleak-driver-watch").start()


def _watch_driver(driver: int) -> None:
    try:
        fd = os.pidfd_open(driver)
    except ProcessLookupError:  # already gone
        fd = -1
    except (AttributeError, OSError):  # no pidfd here
        fd = None
    if fd is None:
        while True:
            try:
                os.kill(driver, 0)
            except ProcessLookupError:
                break
            except PermissionError:  # alive, another user's (a reused pid): keep waiting
                pass
            time.sleep(0.5)
    elif fd >= 0:
        select.select([fd], [], [])  # readable once the driver has exited
    os.kill(os.getpid(), signal.SIGKILL)


def driver_state() -> dict[str, Any]:
    """What a local worker takes on from the driver that makes its pool (``init_worker``): its pid, environment,
    working directory and import path, as a spawned process would inherit them."""
    return {"pid": os.getpid(), "environ": dict(os.environ), "cwd": os.getcwd(), "sys_path": list(sys.path)}


def init_worker(queue: Any, threads: int | None, driver: dict[str, Any] | None = None) -> None:
    """Initializer of a local pool process: progress queue, torch threads, die with the driver. ``driver``
    (``driver_state``, taken when the driver made the pool): a worker forked from a fork server, which was started
    earlier and perhaps under another environment, takes on the driver's environment, working directory and import
    path (a plug-in's folder), as a spawned one does."""
    global _QUEUE
    driver = driver or {}
    _die_with_driver(driver.get("pid"))
    if "environ" in driver:
        os.environ.clear()
        os.environ.update(driver["environ"])
    if "cwd" in driver:
        os.chdir(driver["cwd"])
    if "sys_path" in driver:
        sys.path[:] = driver["sys_path"]
    _QUEUE = queue
    if threads:
        torch.set_num_threads(threads)
    warm_worker()


_WARM = False


def import_job_modules() -> None:
    """Import what the jobs import when they first run: every registered attack, the model classes of the
    presets, the scoring (``audit.evaluate``). Importing only: no torch operation runs."""
    # lazy: the driver imports this module without transformers; the model classes load on first use
    import transformers

    import splitleak.audit.evaluate  # noqa: F401  # lazy: as in _attack (scipy.stats)

    for name in ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen3ForCausalLM", "AutoTokenizer"):
        with contextlib.suppress(ImportError, AttributeError):  # an older transformers without one of them
            getattr(transformers, name)
    for info in REGISTRY.values():
        with contextlib.suppress(Exception):  # an attack that cannot load fails in its own job, with its error
            info.load()


def warm_worker() -> None:
    """Once per process: import what the jobs import (``import_job_modules``; already done in a worker forked
    from the fork server), collect, then move every object the process holds to the collector's permanent
    generation (``gc.freeze``). ``release_memory`` after each job then walks the objects made since, not the
    few hundred thousand of torch and transformers (what that saves: benchmarks/RESULTS.md, "The test
    suite"). What is frozen lives as long as the process anyway (modules, classes, functions); no job has run
    in this process yet, so none of a job's objects is among it. It also sets glibc to keep freed memory for
    the next pass (``runtime.keep_freed_memory``)."""
    global _WARM
    if _WARM:
        return
    keep_freed_memory()
    import_job_modules()
    gc.collect()
    gc.freeze()
    _WARM = True


class QueueProgress:
    """The ``splitleak.progress.Progress`` protocol, forwarded to the driver through a queue
    (advances batched to one message per PROGRESS_INTERVAL_S per task)."""

    def __init__(self, queue: Any, key: str):
        self.queue, self.key = queue, key
        self._n = 0
        self._pending: dict[int, int] = {}
        self._last: dict[int, float] = {}

    def _put(self, msg: tuple) -> None:
        if self.queue is None:
            return
        try:
            self.queue.put_nowait(msg)
        except Exception:  # noqa: BLE001 - progress must never fail a job
            pass

    def start(self, name: str, total: int) -> object:
        self._n += 1
        self._pending[self._n] = 0
        self._last[self._n] = time.monotonic()
        self._put(("start", self.key, self._n, name, int(total)))
        return self._n

    def advance(self, task: object, n: int = 1) -> None:
        t = int(task)  # type: ignore[call-overload]  # the int start() returned; Progress types handles as object
        self._pending[t] = self._pending.get(t, 0) + n
        now = time.monotonic()
        if now - self._last.get(t, 0.0) >= PROGRESS_INTERVAL_S:
            self._put(("advance", self.key, t, self._pending[t]))
            self._pending[t] = 0
            self._last[t] = now

    def finish(self, task: object) -> None:
        t = int(task)  # type: ignore[call-overload]  # the int start() returned; Progress types handles as object
        self._put(("finish", self.key, t))
        self._pending.pop(t, None)


def cached_model(name: str, precision: str, run_seed: int, model_path: str | None, *, take: bool = False):
    """A fresh copy of a model's pristine weights for a run with ``run_seed`` (loaded at most once
    per process and key: ``_MODELS``). ``take``: hand over the cached weights themselves and forget them (or load
    them, uncached), for a job that would otherwise hold the cache and a copy of it at once: a train
    job, whose optimiser state makes it a worker's largest."""
    fetch = _MODELS.take if take else _MODELS.load
    return fetch(name, precision=precision, seed=model_init_seed(run_seed), model_path=model_path)


def _train(job: dict[str, Any], store, device: str, threads: int | None, progress) -> None:
    cfg = config_from_record(job["run_config"])  # as_dict leaves draws="derived" out
    run_dir = store.run_dir(job["key"])
    args = (cfg.model, cfg.precision, cfg.seed, cfg.model_path)
    t0 = time.perf_counter()
    res = run_training(
        cfg,
        run_dir,
        force=True,
        device=device,
        threads=threads,
        progress=progress,
        lm=cached_model(*args, take=True),  # held by run_training alone, which frees it before the all-local twin
        pristine=lambda: cached_model(*args, take=True),
    )
    seconds = time.perf_counter() - t0
    v = verify_run(run_dir)
    if not v.ok or v.status != "complete":
        raise IntegrityError(f"the run directory {run_dir} did not verify after training: {v.message}")
    row = train_row(job, res.metrics, read_manifest(run_dir), str(run_dir.relative_to(store.root)), seconds)
    store.write_rows("train", job["key"], [row])


def _attack(job: dict[str, Any], store, device: str, progress, shared=None) -> None:
    """One attack job; with ``shared`` (``sharing.Shared``), on the run, traffic and knowledge its task shares."""
    # lazy: audit.evaluate loads scipy.stats (a second), which the driver importing this module does without
    from splitleak.audit.evaluate import run_attack

    run_dir = store.run_dir(job["train_key"])
    if not store.is_done({"kind": "train", "key": job["train_key"]}):
        raise IntegrityError(f"its train job {job['train_key'][:12]} has no result in the store")
    manifest = read_manifest(run_dir)
    if manifest.get("config_hash") is None:
        raise IntegrityError(f"{run_dir} has no configuration hash in its manifest")
    m = manifest["config"]
    cfg = make_attack_config(**job["config"]["attack"])
    info = attack_info(cfg.attack)

    def knowledge_of_run():
        lm = cached_model(m["model"], m["precision"], m["seed"], m.get("model_path"))
        return load_knowledge(run_dir, cfg.client_copy, lm=lm, with_top=info.needs_top)

    knowledge = traffic = None
    if "latent" not in info.modes:  # the latent attacks read frames and the truth file only
        if shared is None:
            knowledge = knowledge_of_run()
        else:
            shared.verify(run_dir)
            knowledge = shared.knowledge(run_dir, cfg.client_copy, info.needs_top, knowledge_of_run)
            traffic = shared.traffic(run_dir, cfg.phase, not cfg.inference)
    result = run_attack(
        run_dir,
        cfg,
        knowledge=knowledge,
        traffic=traffic,
        progress=progress,
        device=device,
        protocol_hash=job["config"]["protocol_hash"],
        # every token attack of a grid runs its mis-paired twin (result_json "control"), on the spec's documents
        control_docs=job["config"].get("control_docs", CONTROL_DOCS),
        already_verified=traffic is not None,
    )
    store.write_rows("attack", job["key"], attack_rows(job, result, manifest["split"]["cut"]))


class _GlobalOnly:
    """Stands in for FlopCounterMode's module tracker: counts go to "Global" only."""

    parents = frozenset({"Global"})

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def _as_is(formula: Callable[..., Any]) -> Callable[..., Any]:
    """A formula torch already wrapped (tensors to shapes), marked so it is not wrapped twice."""

    def f(*args, **kwargs):
        return formula(*args, **kwargs)

    f._get_raw = True  # type: ignore[attr-defined]  # a marker attribute on a function object
    return f


#: the CPU kernels of scaled-dot-product attention, missing from torch's formula table (the CUDA ones are there),
#: with torch's own attention formulas (already taking tensors to shapes), so CPU and GPU counts agree
CPU_SDPA_FORMULAS: dict[Any, Callable[..., Any]] = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: fc.sdpa_flop,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: fc.sdpa_backward_flop,
}


def _flop_counter():
    counter = fc.FlopCounterMode(display=False, custom_mapping={op: _as_is(f) for op, f in CPU_SDPA_FORMULAS.items()})
    # torch's module tracker hooks backward passes in a way that autograd.grad on a leaf tensor (the
    # server returning the gradient of its input) rejects; a job's total needs no per-module split
    counter.mod_tracker = _GlobalOnly()
    return counter


def _write_flops(folder: Path, job: dict[str, Any], counter, seconds: float, device: str) -> None:
    by_op = {str(op): int(n) for op, n in counter.get_flop_counts().get("Global", {}).items()}
    record = {
        "key": job["key"],
        "kind": job["kind"],
        "flops": int(counter.get_total_flops()),
        "seconds": seconds,
        "device": device,
        "by_op": by_op,
    }
    write_atomic(folder / f"{job['key']}.json", json.dumps(record, indent=1).encode())


def execute_job(
    job: dict[str, Any],
    store_root: str,
    device: str = "cpu",
    threads: int | None = None,
    driver: dict[str, Any] | None = None,
    node: str | None = None,
    shared=None,
) -> dict[str, Any]:
    """Run one train or attack job and write its result into the store. Never raises: the
    returned dict has ``status`` ``done`` or ``failed`` (with ``error``, ``error_type``, ``traceback``)
    and ``node``, where it ran (the host name, or what the caller passed). ``shared``: what the attack
    jobs of its task share (``sharing.Shared``); None: the job alone, as ``splitleak attack`` runs it."""
    node = node or socket.gethostname()

    store = ResultsStore(store_root)
    key = job["key"]
    progress = QueueProgress(_QUEUE, key)
    progress._put(("job", key, os.getpid(), socket.gethostname()))
    t0 = time.perf_counter()
    try:
        store.claim(key, driver)

        load_plugins()  # a worker process or a Ray task starts without the driver's plug-in attacks
        if threads:
            torch.set_num_threads(threads)
        if job["kind"] not in ("train", "attack"):
            raise ValueError(f"a worker runs train and attack jobs, not {job['kind']!r}")
        flops_dir = os.environ.get(FLOPS_ENV)
        counter = _flop_counter() if flops_dir else contextlib.nullcontext()
        with counter:
            if job["kind"] == "train":
                _train(job, store, device, threads, progress)
            else:
                _attack(job, store, device, progress, shared)
        seconds = time.perf_counter() - t0
        if flops_dir:
            _write_flops(Path(flops_dir), job, counter, seconds, device)
        return {"key": key, "status": "done", "seconds": seconds, "device": device, "node": node}
    except Exception as exc:  # noqa: BLE001 - every failure is recorded, none stops the grid
        return failed_status(key, exc, time.perf_counter() - t0, device, node)
    finally:
        store.release(key)
        release_memory()


def execute_jobs(
    jobs: list[dict[str, Any]],
    store_root: str,
    device: str = "cpu",
    threads: int | None = None,
    driver: dict[str, Any] | None = None,
    node: str | None = None,
) -> list[dict[str, Any]]:
    """Run one task's jobs one after another, each written into the store as it finishes (``execute_job``),
    and return their statuses in order: a train job alone, or the attack jobs of one run and copy, which
    share one ``sharing.Shared`` when there are several."""
    shared = Shared(jobs) if len(jobs) > 1 else None
    return [execute_job(job, store_root, device, threads, driver, node, shared) for job in jobs]


def failed_status(key: str, exc: BaseException, seconds: float, device: str, node: str) -> dict[str, Any]:
    """The status dict of a job that failed with ``exc``."""
    etype, msg, trace = format_error(exc)
    return {
        "key": key,
        "status": "failed",
        "error_type": etype,
        "error": msg,
        "traceback": trace,
        "seconds": seconds,
        "device": device,
        "node": node,
    }


def release_memory() -> None:
    """Give back what a finished job held: collect its objects (model copies, optimiser state, captures),
    then ask glibc to return the freed heap to the system (``malloc_trim``), which it otherwise keeps for
    the process's lifetime, so that a worker's resident memory after a job is the model cache, not the
    largest job's peak."""
    gc.collect()
    trim_heap()


def ray_execute_jobs(
    jobs: list[dict[str, Any]],
    threads: int | None,
    queue: Any,
    driver: dict[str, Any] | None,
    device: str = "auto",
    run: dict[str, Any] | None = None,
) -> Iterator[dict[str, Any]]:
    """A Ray generator task: run a task's jobs (``execute_jobs``) in a private scratch store on this node and
    yield each job's status as it finishes, a finished one with the files it wrote (``files``, a parcel the
    driver writes into its store; see ``shipping``). ``run``: the attack jobs' run directory, parcelled by the
    driver, unpacked and verified here first. ``cuda`` when Ray gave this task a GPU, else ``cpu`` (unless
    ``device`` is set)."""
    global _QUEUE

    # lazy: ray is optional (`pip install 'splitleak[ray]'`)
    import ray

    _QUEUE = queue
    warm_worker()
    if device == "auto":
        device = "cuda" if ray.get_gpu_ids() else "cpu"
    node = f"{socket.gethostname()} (Ray node {ray.get_runtime_context().get_node_id()[:12]})"
    t0 = time.perf_counter()
    scratch = ResultsStore(tempfile.mkdtemp(prefix=f"splitleak-{jobs[0]['key'][:12]}-", dir=scratch_root()))
    try:
        try:
            if run is not None:
                unpack_run(run, scratch, jobs[0]["train_key"])
        except Exception as exc:  # noqa: BLE001 - a run that does not arrive whole fails these jobs only
            for job in jobs:
                yield failed_status(job["key"], exc, time.perf_counter() - t0, device, node)
            return
        shared = Shared(jobs) if len(jobs) > 1 else None
        for job in jobs:
            status = execute_job(job, str(scratch.root), device, threads, driver, node, shared)
            if status["status"] == "done":
                try:
                    status["files"] = outputs_parcel(scratch, job)
                except Exception as exc:  # noqa: BLE001 - a result that cannot be read back fails its job
                    status = failed_status(job["key"], exc, status["seconds"], device, node)
            yield status
    finally:
        shutil.rmtree(scratch.root, ignore_errors=True)
