"""Where jobs run: a process pool on this machine (``local``) or Ray tasks (``ray``).

Both give the scheduler the same four operations: ``submit(job)`` -> handle, ``wait(handles,
timeout)`` -> the finished ones, ``result(handle)`` -> the worker's status dict (``WorkerDied``
when the process running it died), and ``events()`` -> progress messages sent by running jobs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor
from concurrent.futures import wait as futures_wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from splitleak.errors import ConfigError, IntegrityError, SplitleakError
from splitleak.experiments.shipping import deliver, run_parcel
from splitleak.experiments.store import ResultsStore
from splitleak.experiments.worker import execute_job, failed_status, init_worker, ray_execute_job
from splitleak.files import sha256_file
from splitleak.runs.journal import JOURNAL

RAY_HINT = "pip install 'splitleak[ray]'"


class WorkerDied(Exception):
    """The process that ran a job died (killed, out of memory, crashed) before it returned."""


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def plan_workers(workers: int | None, threads: int | None, cores: int | None = None) -> tuple[int, int]:
    """(workers, torch threads per job) with workers x threads ~ cores. Default: half the cores as
    workers (at least one), each with cores // workers threads."""
    cores = cores or cpu_count()
    if workers is not None and workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {threads}")
    if workers is None:
        workers = max(1, cores // threads) if threads else max(1, cores // 2)
    if threads is None:
        threads = max(1, cores // workers)
    return workers, threads


class LocalExecutor:
    """``concurrent.futures.ProcessPoolExecutor`` with the spawn context; one job per process at a
    time, each with ``threads`` torch threads."""

    name = "local"

    def __init__(self, workers: int, threads: int, device: str, driver: dict[str, Any]):
        self.workers, self.threads, self.device, self.driver = workers, threads, device, driver
        self.capacity = workers
        self._ctx = mp.get_context("spawn")
        self._queue = self._ctx.Queue()
        self._pool = self._new_pool()

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            max_workers=self.workers,
            mp_context=self._ctx,
            initializer=init_worker,
            initargs=(self._queue, self.threads),
        )

    def describe(self) -> str:
        return f"local process pool, {self.workers} worker(s) x {self.threads} thread(s), device {self.device}"

    def submit(self, job: dict[str, Any], store_root: str):
        try:
            return self._pool.submit(execute_job, job, store_root, self.device, self.threads, self.driver)
        except BrokenProcessPool:  # a worker died between jobs: a new pool takes the job
            self.recover()
            return self._pool.submit(execute_job, job, store_root, self.device, self.threads, self.driver)

    def wait(self, handles: list, timeout: float) -> list:
        if not handles:
            return []
        done, _ = futures_wait(handles, timeout=timeout, return_when=FIRST_COMPLETED)
        return list(done)

    def result(self, handle) -> dict[str, Any]:
        try:
            return handle.result()
        except BrokenProcessPool as exc:
            raise WorkerDied(
                f"a worker process died while this job ran (killed, out of memory or crashed): {exc}"
            ) from None

    def recover(self) -> None:
        """Replace a pool broken by a dead worker."""
        try:
            self._pool.shutdown(wait=False, cancel_futures=True)
        finally:
            self._pool = self._new_pool()

    def events(self) -> list[tuple]:
        out = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue_mod.Empty:
                return out
            except (OSError, EOFError, ValueError):
                return out

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._queue.close()


def import_ray():
    try:
        # lazy: ray is optional (`pip install 'splitleak[ray]'`)
        import ray
    except ImportError:
        raise ConfigError(f"--executor ray needs Ray, which is not installed; {RAY_HINT}") from None
    return ray


class RayExecutor:
    """Ray tasks declaring ``num_cpus`` (= threads) and ``num_gpus`` per job. Without ``address``,
    ``ray.init`` starts a local instance (``workers x threads`` CPUs, no dashboard) and stops it at
    the end; with ``address`` it joins that cluster and leaves it at the end (the cluster stays up).
    A task uses ``cuda`` when Ray gave it a GPU. Nothing is shared on disk: a task runs its job in a
    scratch store on its node and returns the files, which ``result`` checks and writes into the
    driver's store; an attack job gets its run directory from the driver through Ray's object store,
    put there once per run (``shipping``). The driver claims a job in its store while a task runs it.
    splitleak (with the models) must be installed on every node."""

    #: run parcels kept in Ray's object store for the attack jobs still to come (most recent runs)
    RUNS_KEPT = 4

    name = "ray"

    def __init__(
        self,
        workers: int | None,
        threads: int,
        device: str,
        driver: dict[str, Any],
        address: str | None = None,
        gpus_per_job: float | None = None,
    ):
        ray = import_ray()
        self.ray = ray
        self.threads, self.driver = threads, driver
        self.device = device
        self._started = False
        if not ray.is_initialized():
            try:
                if address:
                    ray.init(address=address, log_to_driver=False)
                    self._started = True  # this driver's connection: disconnected again in close()
                else:
                    ray.init(
                        num_cpus=(workers or max(1, cpu_count() // threads)) * threads,
                        include_dashboard=False,
                        log_to_driver=False,
                    )
                    self._started = True
            except (ConnectionError, RuntimeError, ValueError) as exc:
                where = f"join the Ray cluster at {address}" if address else "start a local Ray instance"
                raise SplitleakError(f"could not {where}: {exc}; check --address (e.g. auto, or HOST:6379)") from None
        res = ray.cluster_resources()
        gpus = float(res.get("GPU", 0))
        if gpus_per_job is None:
            gpus_per_job = 1.0 if gpus > 0 and device in ("auto", "cuda") else 0.0
        if gpus_per_job > 0 and gpus == 0:
            raise ConfigError(f"--gpus-per-job {gpus_per_job} was asked for, but the Ray cluster has no GPU")
        self.gpus_per_job = gpus_per_job
        cpus = float(res.get("CPU", 1))
        by_cpu = max(1, int(cpus // threads))
        by_gpu = int(gpus // gpus_per_job) if gpus_per_job > 0 else by_cpu
        self.capacity = workers or max(1, min(by_cpu, by_gpu))
        # lazy: ray is optional (`pip install 'splitleak[ray]'`)
        from ray.util.queue import Queue
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self._queue = Queue(actor_options={"num_cpus": 0, "scheduling_strategy": here})  # dies with the driver only
        self._task = ray.remote(max_retries=1)(ray_execute_job)
        self._address = address
        self._inflight: dict[Any, tuple[dict[str, Any], ResultsStore]] = {}
        self._runs: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def describe(self) -> str:
        where = f"cluster {self._address}" if self._address else "local Ray instance"
        return (
            f"Ray ({where}), up to {self.capacity} task(s) at once, {self.threads} CPU(s)"
            f"{f' and {self.gpus_per_job:g} GPU(s)' if self.gpus_per_job else ''} per task"
        )

    def submit(self, job: dict[str, Any], store_root: str):
        task_device = "auto" if self.device in ("auto", "cuda") else self.device
        store = ResultsStore(store_root)
        store.claim(job["key"], self.driver)
        try:
            run = self._run_ref(store, job["train_key"]) if job["kind"] == "attack" else None
        except OSError as exc:  # its run cannot be read here: the job fails, the grid goes on
            handle = self.ray.put(failed_status(job["key"], exc, 0.0, task_device, "driver"))
        else:
            handle = self._task.options(num_cpus=self.threads, num_gpus=self.gpus_per_job).remote(
                job, self.threads, self._queue, self.driver, task_device, run
            )
        self._inflight[handle] = (job, store)
        return handle

    def _run_ref(self, store: ResultsStore, train_key: str):
        """The run's parcel in Ray's object store, put there once per run (and again if its journal changed)."""
        key = (train_key, sha256_file(store.run_dir(train_key) / JOURNAL))
        if key not in self._runs:
            self._runs[key] = self.ray.put(run_parcel(store, train_key))
            while len(self._runs) > self.RUNS_KEPT:
                self._runs.popitem(last=False)
        self._runs.move_to_end(key)
        return self._runs[key]

    def wait(self, handles: list, timeout: float) -> list:
        if not handles:
            return []
        ready, _ = self.ray.wait(handles, num_returns=1, timeout=timeout)
        if ready:
            ready, _ = self.ray.wait(handles, num_returns=len(handles), timeout=0)
        return ready

    def result(self, handle) -> dict[str, Any]:
        """The task's status; the files of a job that is done written into the driver's store first."""
        job, store = self._inflight.pop(handle)
        try:
            res = self.ray.get(handle)
        except self.ray.exceptions.RayError as exc:
            raise WorkerDied(f"the Ray task running this job failed: {exc}") from None
        finally:
            store.release(job["key"])
        files = res.pop("files", None)
        if res["status"] == "done":
            try:
                deliver(store, job, files or {})
            except (IntegrityError, OSError) as exc:
                return failed_status(job["key"], exc, res["seconds"], res["device"], res["node"])
        return res

    def recover(self) -> None:
        pass

    def events(self) -> list[tuple]:
        out = []
        try:
            while not self._queue.empty():
                out.append(self._queue.get_nowait())
        except Exception:  # noqa: BLE001 - queue.Empty, or the queue actor went away
            pass
        return out

    def close(self) -> None:
        if self._started:
            self.ray.shutdown()
