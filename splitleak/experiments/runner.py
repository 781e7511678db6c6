"""Running a grid, resuming it, and saying where it stands.

``run_grid`` validates the spec and expands it (nothing is written if that fails), freezes the
protocol when it is not frozen yet, takes the store's lock, and then runs every job that has no
result in the store: train jobs first become ready, each attack job becomes ready when its train
job is done (attack jobs go before further train jobs, so results land early), and a reuse job is
written as soon as the measurement it reuses is. The ready attack jobs of one run and copy go to one
worker as one task, which shares their common work (``sharing``) and writes each job's rows as it
finishes. A job that fails is recorded with its error and the jobs that depend on it are recorded as
skipped, naming it; the others go on. Killing the process at any moment loses at most the unfinished
jobs in flight: the next ``run_grid`` skips what is in the store and redoes the rest (a train job from
scratch, since its run directory may be partial).
"""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from splitleak.attacks.registry import load_plugins
from splitleak.audit.protocol import file_sha256, freeze_protocol, frozen_record_path, load_protocol, parse_protocol
from splitleak.errors import ConfigError
from splitleak.experiments.display import SilentReporter
from splitleak.experiments.executors import LocalExecutor, RayExecutor, WorkerDied, import_ray, plan_workers
from splitleak.experiments.jobs import Grid, Job, expand
from splitleak.experiments.rekey import apply_rekeys, find_rekeys
from splitleak.experiments.sharing import task_key
from splitleak.experiments.spec_loading import LoadedSpec, load_spec
from splitleak.experiments.store import ResultsStore, reuse_rows
from splitleak.runs.verify import verify_run
from splitleak.runtime import resolve_device

EXECUTORS = ("local", "ray")
STATES = ("done", "running", "failed", "pending")


@dataclass
class JobFailure:
    key: str
    kind: str
    summary: str
    error_type: str
    error: str


#: how often one call runs a job again after its worker died (killed, out of memory) before recording
#: it as failed: once, so that one stray kill costs nothing and a job that kills every worker stops
WORKER_RETRIES = 1


@dataclass
class GridRun:
    """What one ``run_grid`` call did."""

    grid: Grid
    store: Path
    executor: str
    done_before: int
    ran: int = 0
    reused: int = 0
    retried: int = 0  # attempts run again because their worker died
    failures: list[JobFailure] = field(default_factory=list)
    seconds: float = 0.0
    nodes: dict[str, int] = field(default_factory=dict)  # where the executed jobs ran: node -> jobs

    @property
    def ok(self) -> bool:
        return not self.failures


@dataclass
class GridStatus:
    """Per job: done, running (a live claim), failed (its last attempt) or pending."""

    grid: Grid
    store: Path
    states: dict[str, str]
    failures: dict[str, dict[str, Any]]
    claims: dict[str, dict[str, Any]]

    def counts(self) -> dict[str, dict[str, int]]:
        out = {kind: {s: 0 for s in STATES} for kind in ("train", "attack", "reuse")}
        for j in self.grid.jobs:
            out[j.kind][self.states[j.key]] += 1
        return out

    def totals(self) -> dict[str, int]:
        t = {s: 0 for s in STATES}
        for s in self.states.values():
            t[s] += 1
        return t


def _load(spec: str | Path | LoadedSpec, profile: str | None, overrides) -> LoadedSpec:
    if isinstance(spec, LoadedSpec):
        return spec
    return load_spec(spec, profile, tuple(overrides or ()))


def _protocol_hash(loaded: LoadedSpec) -> str:
    """The protocol's hash as it would be frozen; an edit after freezing is refused here."""
    parse_protocol(loaded.protocol_path)  # a clear error for an invalid protocol
    if frozen_record_path(loaded.protocol_path).exists():
        return load_protocol(loaded.protocol_path)[1]
    return file_sha256(loaded.protocol_path)


def plan_grid(spec: str | Path | LoadedSpec, *, profile: str | None = None, overrides=()) -> Grid:
    """Expand a spec into its jobs without writing anything (the protocol is not frozen)."""
    loaded = _load(spec, profile, overrides)
    return expand(loaded, _protocol_hash(loaded))


def store_of(loaded: LoadedSpec, store: str | Path | None) -> Path:
    return (Path(store) if store is not None else loaded.default_store()).resolve()


def grid_status(
    spec: str | Path | LoadedSpec, *, profile: str | None = None, overrides=(), store: str | Path | None = None
) -> GridStatus:
    """Where a grid stands in its store: done / running / failed / pending per job. A claim left by
    a killed process (its PID is gone) counts as pending."""
    loaded = _load(spec, profile, overrides)
    grid = expand(loaded, _protocol_hash(loaded))
    rs = ResultsStore(store_of(loaded, store))
    done = rs.done_keys() | {r.new for r in find_rekeys(grid, rs)}  # re-keyed (moved) when the grid next runs
    failures = rs.failures()
    claims = rs.live_claims()
    states = {}
    for j in grid.jobs:
        if j.key in done:
            states[j.key] = "done"
        elif j.key in claims:
            states[j.key] = "running"
        elif j.key in failures:
            states[j.key] = "failed"
        else:
            states[j.key] = "pending"
    return GridStatus(grid, rs.root, states, {k: v for k, v in failures.items() if states.get(k) == "failed"}, claims)


def _resolve_local_device(device: str) -> str:
    return str(resolve_device(device))


def run_grid(
    spec: str | Path | LoadedSpec,
    *,
    profile: str | None = None,
    overrides=(),
    executor: str = "local",
    workers: int | None = None,
    threads: int | None = None,
    address: str | None = None,
    store: str | Path | None = None,
    device: str = "auto",
    gpus_per_job: float | None = None,
    reporter=None,
    group: bool = True,
) -> GridRun:
    """Run every job of the spec that the store does not hold yet; see the module docstring.

    ``executor``: ``local`` (a process pool of ``workers`` processes with ``threads`` torch threads
    each; default half the cores as workers, workers x threads ~ cores) or ``ray`` (``address``: a
    cluster to join; default a local instance). ``store``: default ``<spec stem>-results/`` beside
    the spec. ``group``: run the attack jobs of one run and copy as one task, sharing the model load, the
    capture read and what their attacks compute alike (``sharing``; the results are the same either way);
    False: each job its own task. Returns a ``GridRun``; its ``failures`` list the jobs that failed or were
    skipped.
    """
    t0 = time.perf_counter()
    load_plugins()  # plug-in attacks (SPLITLEAK_PLUGINS) before the spec's attacks are looked up
    reporter = reporter or SilentReporter()
    if executor not in EXECUTORS:
        raise ConfigError(f"unknown executor {executor!r}; use local or ray")
    loaded = _load(spec, profile, overrides)
    grid = expand(loaded, _protocol_hash(loaded))  # every configuration checked before anything is written
    workers, threads, dev = _plan_execution(executor, workers, threads, device)
    freeze_protocol(loaded.protocol_path)  # what users expect: a grid runs under a frozen protocol
    protocol_hash = load_protocol(loaded.protocol_path)[1]
    if protocol_hash != grid.protocol_hash:  # cannot differ (freezing records the file's hash); be explicit
        grid = expand(loaded, protocol_hash)

    rs = ResultsStore(store_of(loaded, store))
    with rs.lock():
        rs.clear_stale()
        rs.write_json("grid.json", _grid_record(loaded, grid, protocol_hash))
        done = _done_keys(grid, rs, reporter)
        result = GridRun(grid, rs.root, executor, done_before=sum(1 for j in grid.jobs if j.key in done))
        driver = {"driver_pid": os.getpid(), "driver_host": socket.gethostname()}
        if executor == "local":
            assert workers is not None  # _plan_execution chose it
            ex: Any = LocalExecutor(workers, threads, dev, driver)
        else:
            ex = RayExecutor(workers, threads, dev, driver, address=address, gpus_per_job=gpus_per_job)
        counts = grid.counts()
        reporter.begin(
            f"grid {loaded.name} (profile {loaded.profile or 'base'}): {len(grid.jobs)} jobs "
            f"({counts['train']} train, {counts['attack']} attack, {counts['reuse']} reused for inference); "
            f"{result.done_before} already in {rs.root}; protocol {loaded.protocol_path.name} "
            f"sha256 {protocol_hash[:12]}; {ex.describe()}",
            len(grid.jobs),
            result.done_before,
        )
        try:
            _Scheduler(grid, rs, ex, done, result, reporter, group).run()
        finally:
            ex.close()
            reporter.end()
    result.seconds = time.perf_counter() - t0
    return result


def _plan_execution(
    executor: str, workers: int | None, threads: int | None, device: str
) -> tuple[int | None, int, str]:
    """(workers, threads, device) for the executor, checked before anything is written: locally the
    planned pool and the resolved device; on Ray one CPU per task unless told, at most ``workers`` tasks
    at once (default: what the cluster holds), and the device as given (each node resolves it)."""
    if executor == "local":
        workers, threads = plan_workers(workers, threads)
        return workers, threads, _resolve_local_device(device)
    plan_workers(workers or 1, threads or 1)
    import_ray()
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"unknown device {device!r}; use auto, cpu or cuda")
    return workers, threads or 1, device


def _grid_record(loaded: LoadedSpec, grid: Grid, protocol_hash: str) -> dict[str, Any]:
    """What ``grid.json`` records: the spec, profile, overrides and protocol the grid ran under, and its jobs."""
    return {
        "spec": str(loaded.path),
        "name": loaded.name,
        "profile": loaded.profile,
        "overrides": list(loaded.overrides),
        "protocol": str(loaded.protocol_path),
        "protocol_hash": protocol_hash,
        "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "counts": grid.counts(),
        "jobs": [
            {"key": j.key, "kind": j.kind, "summary": j.summary, "train_key": j.train_key, "reuse_of": j.reuse_of}
            for j in grid.jobs
        ],
    }


def _done_keys(grid: Grid, rs: ResultsStore, reporter) -> set[str]:
    """The keys the store holds, after moving results stored under an earlier canonical form's keys and
    dropping the train jobs whose run directory no longer verifies."""
    rekeys = find_rekeys(grid, rs)
    if rekeys:
        moved = apply_rekeys(rs, rekeys)
        reporter.note(
            f"{moved} result(s) stored under the keys of an earlier canonical form of their configuration "
            "(defence arguments as typed) now stand under their jobs' keys; nothing was recomputed"
        )
    done = rs.done_keys()
    _recheck_train_runs(grid, rs, done, reporter)
    return done


def _recheck_train_runs(grid: Grid, rs: ResultsStore, done: set[str], reporter) -> None:
    """A done train job whose attack jobs are still to run must have an intact run directory;
    otherwise it is redone."""
    for job in grid.of_kind("train"):
        if job.key not in done:
            continue
        if all(d in done for d in grid.dependents.get(job.key, [])):
            continue
        v = verify_run(rs.run_dir(job.key))
        if not v.ok or v.status != "complete":
            reporter.note(
                f"train job {job.key[:12]} ({job.summary}): its run directory does not verify ({v.message}); redoing it"
            )
            rs.remove("train", job.key)
            done.discard(job.key)


class _Scheduler:
    """``run_grid``'s loop (the module docstring): ready jobs go to the executor as tasks (with ``group``, the
    ready attack jobs of one run and copy as one task: ``sharing``), and each job is recorded as its status
    comes back. A task whose worker died loses only its unfinished jobs: those it finished are in the store,
    the one it died in runs again (``WORKER_RETRIES``), the others go back to the queue as they were."""

    def __init__(self, grid: Grid, rs: ResultsStore, ex, done: set[str], result: GridRun, reporter, group: bool):
        self.grid, self.rs, self.ex, self.done, self.result, self.reporter = grid, rs, ex, done, result, reporter
        self.group = group
        self.pending_train: deque[Job] = deque(j for j in grid.of_kind("train") if j.key not in done)
        self.ready: deque[Job] = deque(j for j in grid.of_kind("attack") if j.key not in done and j.train_key in done)
        self.inflight: dict[Any, list[Job]] = {}  # task -> its jobs whose status has not come back
        self.attempts: dict[str, int] = {}  # retries after a dead worker, per job, in this call

    def run(self) -> None:
        for j in self.grid.of_kind("reuse"):  # measurements already in the store
            if j.key not in self.done and j.reuse_of in self.done:
                self.reuse(j)
        store_root = str(self.rs.root)
        while self.pending_train or self.ready or self.inflight:
            while len(self.inflight) < self.ex.capacity and (self.ready or self.pending_train):
                jobs = self._next_task()
                self.inflight[self.ex.submit([j.to_dict() for j in jobs], store_root)] = jobs
            finished_handles = self.ex.wait(list(self.inflight), timeout=0.2)
            for ev in self.ex.events():
                ev_job = self.grid.by_key.get(ev[1]) if len(ev) > 1 else None
                if ev_job is not None:
                    self.reporter.job_event(ev, ev_job.summary)
            broken = False
            for h in finished_handles:
                broken = self._collect(h) or broken
            if broken:
                self.ex.recover()

    def _next_task(self) -> list[Job]:
        """The next task: the first ready attack job with (``group``) the other ready ones of its run and copy,
        in their order; else the next train job."""
        if not self.ready:
            return [self.pending_train.popleft()]
        first = self.ready.popleft()
        if not self.group:
            return [first]
        key = task_key(first.to_dict())
        jobs = [first] + [j for j in self.ready if task_key(j.to_dict()) == key]
        self.ready = deque(j for j in self.ready if task_key(j.to_dict()) != key)
        return jobs

    def _collect(self, handle) -> bool:
        """Record what a task reported; True when its worker died."""
        jobs = self.inflight[handle]
        try:
            statuses, over = self.ex.result(handle)
        except WorkerDied as exc:
            del self.inflight[handle]
            self._died(jobs, exc)
            return True
        for res in statuses:
            job = self.grid.by_key[res["key"]]
            jobs.remove(job)
            node = res.get("node")
            if node:
                self.result.nodes[node] = self.result.nodes.get(node, 0) + 1
            if res["status"] == "done":
                self.succeeded(job, res["seconds"])
            else:
                self.fail(job, res["error_type"], res["error"], res.get("traceback", ""), res.get("seconds"))
        if over:
            del self.inflight[handle]
        return False

    def _died(self, jobs: list[Job], exc: WorkerDied) -> None:
        """The unreported jobs of a task whose worker died: done where the store holds their rows (written
        before it died); the job it died in (the first unfinished one where that is not known) charged one
        attempt; the others queued again without one."""
        left = []
        for job in jobs:
            self.rs.release(job.key)  # a claim the dead worker left
            if self.rs.is_done(job):
                self.succeeded(job, None)
            else:
                left.append(job)
        running = exc.running if exc.running in {j.key for j in left} else (left[0].key if left else None)
        for job in reversed(left):
            if job.key == running and self.attempts.get(job.key, 0) >= WORKER_RETRIES:
                self.fail(job, "WorkerDied", str(exc))
                continue
            if job.key == running:
                self.attempts[job.key] = self.attempts.get(job.key, 0) + 1
                n = self.rs.record_retry(job.to_dict(), str(exc))
                self.result.retried += 1
                self.reporter.note(f"{job.key[:12]} ({job.summary}): its worker died (attempt {n}); running it again")
            (self.pending_train if job.kind == "train" else self.ready).appendleft(job)

    def finished(self, job: Job, status: str, seconds: float | None, error: str | None = None) -> None:
        self.reporter.job_finished(job.key, job.summary, status, seconds, error)

    def skip(self, key: str, reason: str) -> None:
        job = self.grid.by_key[key]
        if key in self.done:
            return
        self.rs.record_failure(job.to_dict(), reason, "skipped")
        self.result.failures.append(JobFailure(key, job.kind, job.summary, "skipped", reason))
        self.finished(job, "skipped", None, reason)
        for dep in self.grid.dependents.get(key, []):
            self.skip(dep, f"the job it depends on ({key[:12]}) was skipped")

    def fail(self, job: Job, etype: str, msg: str, trace: str = "", seconds: float | None = None) -> None:
        self.rs.record_failure(job.to_dict(), msg, etype, trace)
        self.result.failures.append(JobFailure(job.key, job.kind, job.summary, etype, msg))
        self.finished(job, "failed", seconds, f"{etype}: {msg}")
        for dep in self.grid.dependents.get(job.key, []):
            self.skip(dep, f"its {job.kind} job {job.key[:12]} failed ({etype})")

    def reuse(self, job: Job) -> None:
        try:
            assert job.reuse_of is not None  # a reuse job names the measurement it copies
            rows = reuse_rows(job.to_dict(), self.rs.read_job("attack", job.reuse_of))
            self.rs.write_rows("attack", job.key, rows)
        except Exception as exc:  # noqa: BLE001 - recorded like any failure
            self.fail(job, type(exc).__name__, str(exc))
            return
        self.rs.remove("failed", job.key)
        self.done.add(job.key)
        self.result.reused += 1
        self.finished(job, "reused", None)

    def succeeded(self, job: Job, seconds: float | None) -> None:
        self.rs.remove("failed", job.key)
        self.done.add(job.key)
        self.result.ran += 1
        self.finished(job, "done", seconds)
        for dep in self.grid.dependents.get(job.key, []):
            dj = self.grid.by_key[dep]
            if dep in self.done:
                continue
            if dj.kind == "attack":
                self.ready.append(dj)
            elif dj.kind == "reuse":
                self.reuse(dj)
