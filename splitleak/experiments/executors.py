"""Where jobs run: a process pool on this machine (``local``) or Ray tasks (``ray``).

Both give the scheduler the same four operations on a task (a train job alone, or the attack jobs of one
run and copy: ``sharing``): ``submit(jobs)`` -> handle, ``wait(handles, timeout)`` -> the handles with news,
``result(handle)`` -> (the statuses of the jobs that finished since the last call, in the task's order;
whether the task is over), ``WorkerDied`` when the process running it died (its ``running``: the job it
died in, where known), and ``events()`` -> progress messages sent by running jobs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor
from concurrent.futures import wait as futures_wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

from splitleak.errors import ConfigError, IntegrityError, SplitleakError
from splitleak.experiments.shipping import deliver, run_parcel
from splitleak.experiments.store import ResultsStore
from splitleak.experiments.worker import driver_state, execute_jobs, failed_status, init_worker, ray_execute_jobs
from splitleak.files import sha256_file
from splitleak.runs.journal import JOURNAL

RAY_HINT = "pip install 'splitleak[ray]'"


class WorkerDied(Exception):
    """The process that ran a task died (killed, out of memory, crashed) before it returned; ``running``:
    the key of the job it was running then, or None where that is not known (it died between jobs)."""

    def __init__(self, message: str, running: str | None = None):
        super().__init__(message)
        self.running = running


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


#: what the fork server imports before it forks a worker
PRELOAD = "splitleak.experiments.preload"


def worker_context() -> Any:
    """The multiprocessing context of local workers: a fork server where the platform has one (Linux, macOS),
    which imports torch, transformers and the attacks once (``PRELOAD``: imports only, no torch operation) and
    forks each worker from that state, as PyTorch's DataLoader forks its workers from a process that imported
    torch; else spawn, where each worker imports them itself (about 4 s of CPU a worker). Never a plain fork of
    the driver, which may be mid-operation in threads of its own (torch's pools, the progress display). A forked
    worker takes on the driver's environment, folder and import path (``worker.driver_state``)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([PRELOAD])  # read when the server starts; it lasts as long as this process
    return ctx


class LocalExecutor:
    """``concurrent.futures.ProcessPoolExecutor`` on ``worker_context()``; one job per process at a time, each
    with ``threads`` torch threads, in the driver's environment and working directory."""

    name = "local"

    def __init__(self, workers: int, threads: int, device: str, driver: dict[str, Any]):
        self.workers, self.threads, self.device, self.driver = workers, threads, device, driver
        self.capacity = workers
        self._ctx = worker_context()
        self._queue = self._ctx.Queue()
        self._pool = self._new_pool()
        self._tasks: dict[Any, tuple[list[dict[str, Any]], ResultsStore]] = {}

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            max_workers=self.workers,
            mp_context=self._ctx,
            initializer=init_worker,
            initargs=(self._queue, self.threads, driver_state()),
        )

    def describe(self) -> str:
        return f"local process pool, {self.workers} worker(s) x {self.threads} thread(s), device {self.device}"

    def submit(self, jobs: list[dict[str, Any]], store_root: str):
        try:
            fut = self._pool.submit(execute_jobs, jobs, store_root, self.device, self.threads, self.driver)
        except BrokenProcessPool:  # a worker died between tasks: a new pool takes the task
            self.recover()
            fut = self._pool.submit(execute_jobs, jobs, store_root, self.device, self.threads, self.driver)
        self._tasks[fut] = (jobs, ResultsStore(store_root))
        return fut

    def wait(self, handles: list, timeout: float) -> list:
        if not handles:
            return []
        done, _ = futures_wait(handles, timeout=timeout, return_when=FIRST_COMPLETED)
        return list(done)

    def result(self, handle) -> tuple[list[dict[str, Any]], bool]:
        """All the task's statuses at once; a worker that died leaves the claim of the job it ran (a job
        releases its claim when it ends), which names that job."""
        jobs, store = self._tasks.pop(handle)
        try:
            return handle.result(), True
        except BrokenProcessPool as exc:
            running = next((j["key"] for j in jobs if store.claim_path(j["key"]).is_file()), None)
            raise WorkerDied(
                f"a worker process died while this job ran (killed, out of memory or crashed): {exc}", running
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


@dataclass
class _RayTask:
    """The jobs of one Ray task, the driver's store, and the jobs whose status has come back."""

    jobs: list[dict[str, Any]]
    store: ResultsStore
    reported: set[str] = field(default_factory=set)


class RayExecutor:
    """Ray tasks declaring ``num_cpus`` (= threads) and ``num_gpus`` per task. Without ``address``,
    ``ray.init`` starts a local instance (``workers x threads`` CPUs, no dashboard) and stops it at
    the end; with ``address`` it joins that cluster and leaves it at the end (the cluster stays up).
    A task uses ``cuda`` when Ray gave it a GPU. Nothing is shared on disk: a task (a generator) runs
    its jobs in a scratch store on its node and yields each job's files as it finishes, which ``result``
    checks and writes into the driver's store; attack jobs get their run directory from the driver
    through Ray's object store, put there once per run (``shipping``). The driver claims a task's jobs in
    its store while it runs them. Ray does not run a failed task again (it would replay a generator from
    its first job): the scheduler reruns the unfinished jobs. splitleak (with the models) must be
    installed on every node."""

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
        # a generator task: Ray would run it again from its first job; the scheduler reruns what is unfinished
        self._task = ray.remote(max_retries=0)(ray_execute_jobs)
        self._address = address
        self._inflight: dict[Any, _RayTask] = {}
        self._runs: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def describe(self) -> str:
        where = f"cluster {self._address}" if self._address else "local Ray instance"
        return (
            f"Ray ({where}), up to {self.capacity} task(s) at once, {self.threads} CPU(s)"
            f"{f' and {self.gpus_per_job:g} GPU(s)' if self.gpus_per_job else ''} per task"
        )

    def submit(self, jobs: list[dict[str, Any]], store_root: str):
        task_device = "auto" if self.device in ("auto", "cuda") else self.device
        store = ResultsStore(store_root)
        for job in jobs:
            store.claim(job["key"], self.driver)
        try:
            run = self._run_ref(store, jobs[0]["train_key"]) if jobs[0]["kind"] == "attack" else None
        except OSError as exc:  # its run cannot be read here: the jobs fail, the grid goes on
            handle = self.ray.put([failed_status(j["key"], exc, 0.0, task_device, "driver") for j in jobs])
        else:
            handle = self._task.options(num_cpus=self.threads, num_gpus=self.gpus_per_job).remote(
                jobs, self.threads, self._queue, self.driver, task_device, run
            )
        self._inflight[handle] = _RayTask(jobs, store)
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

    def result(self, handle) -> tuple[list[dict[str, Any]], bool]:
        """The status of the task's next finished job (its files written into the driver's store first), as
        its generator yields them, and whether that was the task's last job."""
        task = self._inflight[handle]
        try:
            if isinstance(handle, self.ray.ObjectRef):  # the task failed before it started
                statuses = self.ray.get(handle)
            else:
                statuses = [self.ray.get(next(handle))]
        except (self.ray.exceptions.RayError, StopIteration) as exc:
            del self._inflight[handle]
            left = [j["key"] for j in task.jobs if j["key"] not in task.reported]
            for key in left:
                task.store.release(key)
            raise WorkerDied(f"the Ray task running this job failed: {exc}", left[0] if left else None) from None
        out = [self._delivered(task, res) for res in statuses]
        over = len(task.reported) == len(task.jobs)
        if over:
            del self._inflight[handle]
        return out, over

    def _delivered(self, task: "_RayTask", res: dict[str, Any]) -> dict[str, Any]:
        """A job's status, its files written into the driver's store where it is done (a failed status if
        they cannot be), its claim released."""
        job = next(j for j in task.jobs if j["key"] == res["key"])
        task.reported.add(job["key"])
        task.store.release(job["key"])
        files = res.pop("files", None)
        if res["status"] == "done":
            try:
                deliver(task.store, job, files or {})
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
