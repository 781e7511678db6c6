"""The results store of a grid: a folder of Parquet files, one file per finished job, named by
the job's key, so a job is in the store at most once and a rerun finds what is done.

Layout::

    STORE/
      attacks/<key>.parquet   one row per (attack or reuse job, evaluation document), or per frame (and
                              probe arm) of a latent attack
      train/<key>.parquet     one row per train job: utility metrics, wire bytes, run directory
      failed/<key>.parquet    one row per job whose last attempt failed (error text, traceback)
      runs/<key[:16]>/        the run directory of each train job (verifiable, see `splitleak verify`)
      claims/<key>.json       a job being worked on (worker PID and host); removed when it ends
      run.lock                the driver of a `run` in progress (PID and host)
      grid.json               the jobs of the last grid run on this store (for people; never read back)

Every file is written to a hidden temporary name in its own folder, flushed and renamed
(``os.replace``), so a killed process leaves either the whole file or none. No pickle: Parquet and
JSON only. ``read_results`` reads a kind of rows back as one ``pyarrow.Table``.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import traceback as tb
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa

from splitleak.attacks.config import STORED_FIELDS
from splitleak.data.documents import LABELS
from splitleak.errors import IntegrityError, SplitleakError
from splitleak.files import json_default, parquet_bytes, read_parquet, write_atomic

KIND_DIRS = {"attack": "attacks", "train": "train", "failed": "failed", "retried": "retried"}

_JOB = [
    ("key", pa.string()),
    ("kind", pa.string()),
    ("model", pa.string()),
    ("precision", pa.string()),
    ("depth", pa.int64()),
    ("offload_start", pa.int64()),
    ("offload_length", pa.int64()),
    ("cut", pa.int64()),
    ("defence", pa.string()),
    ("defence_name", pa.string()),
    ("victim_seed", pa.int64()),
    ("data", pa.string()),
    ("steps", pa.int64()),
    ("n_calib", pa.int64()),
    ("n_train", pa.int64()),
    ("n_eval", pa.int64()),
    ("doc_len", pa.int64()),
    ("data_seed", pa.int64()),
]

#: the column type of each kind of identity field
ARROW_TYPES = {str: pa.string(), int: pa.int64(), float: pa.float64(), bool: pa.bool_()}

ATTACK_SCHEMA = pa.schema(
    _JOB[:2]
    + [("train_key", pa.string()), ("reuse_of", pa.string()), ("protocol_hash", pa.string())]
    + _JOB[2:]
    # the attack's identity (``attacks.config.IDENTITY``; ``params``: its other hyperparameters as canonical JSON),
    # and the label of its observer-side gradient perturbation
    + [(f.name, ARROW_TYPES[f.kind]) for f in STORED_FIELDS]
    + [
        ("perturbation", pa.string()),
        ("doc_id", pa.int64()),
        ("token_correct", pa.int64()),
        ("token_counted", pa.int64()),
        ("exact", pa.bool_()),
    ]
    + [(f"span_hits_{lab}", pa.int64()) for lab in LABELS]
    + [(f"span_counts_{lab}", pa.int64()) for lab in LABELS]
    + [
        ("predicted", pa.list_(pa.int64())),
        ("property_score", pa.float64()),
        # the latent attacks' rows are frames (doc_id holds the frame id; null in older stores):
        ("frame_agreement", pa.float64()),  # support-partition: the share of the frame's rows labelled right
        ("arm", pa.string()),  # latent-probe: the probe arm (view/model/restart) of the row
        ("paired_delta", pa.float64()),  # latent-probe: the arm's accuracy minus the control's on the frame
        ("leakage_index", pa.float64()),
        ("vmi_token_recovery", pa.float64()),
        ("majority_token_recovery", pa.float64()),
        ("n_docs", pa.int64()),
        ("seconds", pa.float64()),
        ("train_config", pa.string()),
        ("attack_config", pa.string()),
        ("job_config", pa.string()),
        ("result_json", pa.string()),
        # training-phase traffic (the identity's ``phase`` "train"): the step of the row's crossing, a row per crossing
        ("step", pa.int64()),
    ]
)
#: columns added after stores were first written: a row file without them reads them as null
LATER_COLUMNS = {"attack": ("phase", "step")}

TRAIN_SCHEMA = pa.schema(
    _JOB
    + [
        ("u_shape", pa.bool_()),
        ("heldout_ce", pa.float64()),
        ("perplexity", pa.float64()),
        ("all_local_ce", pa.float64()),
        ("all_local_perplexity", pa.float64()),
        ("delta_u", pa.float64()),
        ("pretrained_ce", pa.float64()),
        ("pretrained_perplexity", pa.float64()),
        ("wire_bytes_client_to_server", pa.float64()),
        ("wire_bytes_server_to_client", pa.float64()),
        ("train_tokens_per_second", pa.float64()),
        ("seconds", pa.float64()),
        ("run_dir", pa.string()),
        ("train_config", pa.string()),
        ("job_config", pa.string()),
        ("metrics_json", pa.string()),
    ]
)

FAILED_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("kind", pa.string()),
        ("train_key", pa.string()),
        ("summary", pa.string()),
        ("error_type", pa.string()),
        ("error", pa.string()),
        ("traceback", pa.string()),
        ("time", pa.string()),
        ("job_config", pa.string()),
    ]
)

#: one row per attempt of a job that its worker did not live to finish (killed, out of memory), and
#: that the driver therefore ran again
RETRIED_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("kind", pa.string()),
        ("summary", pa.string()),
        ("attempt", pa.int64()),
        ("error", pa.string()),
        ("time", pa.string()),
    ]
)

SCHEMAS = {"attack": ATTACK_SCHEMA, "train": TRAIN_SCHEMA, "failed": FAILED_SCHEMA, "retried": RETRIED_SCHEMA}


def _json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=json_default)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def table_bytes(rows: list[dict[str, Any]], schema: pa.Schema) -> bytes:
    return parquet_bytes(pa.Table.from_pylist([{n: r.get(n) for n in schema.names} for r in rows], schema=schema))


# ------------------------------------------------------------------ rows


def train_row(
    job: dict[str, Any], metrics: dict[str, Any], manifest: dict[str, Any], run_dir_rel: str, seconds: float
) -> dict[str, Any]:
    """The one utility row of a finished train job."""
    wire = metrics.get("wire_bytes_per_step") or {}
    return {
        "key": job["key"],
        "kind": "train",
        **job["fields"],
        "cut": manifest["split"]["cut"],
        "u_shape": bool(manifest["split"].get("u_shape", False)),
        **{
            k: metrics.get(k)
            for k in (
                "heldout_ce",
                "perplexity",
                "all_local_ce",
                "all_local_perplexity",
                "delta_u",
                "pretrained_ce",
                "pretrained_perplexity",
                "train_tokens_per_second",
            )
        },
        "wire_bytes_client_to_server": wire.get("client_to_server"),
        "wire_bytes_server_to_client": wire.get("server_to_client"),
        "seconds": seconds,
        "run_dir": run_dir_rel,
        "train_config": _json(job["config"]["train"]),
        "job_config": _json(job["config"]),
        "metrics_json": _json(metrics),
    }


def attack_rows(job: dict[str, Any], result: dict[str, Any], cut: int) -> list[dict[str, Any]]:
    """One row per evaluation document of a finished attack job (``result`` from ``run_attack``)."""
    summary = {k: v for k, v in result.items() if k not in ("per_doc", "run")}
    base = {
        "key": job["key"],
        "kind": job["kind"],
        "train_key": job["train_key"],
        "reuse_of": job["reuse_of"],
        "protocol_hash": result.get("protocol_hash"),
        **job["fields"],
        "cut": cut,
        "n_docs": result.get("n_docs", result.get("n_frames")),
        "seconds": result.get("seconds"),
        "leakage_index": result.get("leakage_index"),
        "vmi_token_recovery": result.get("vmi_token_recovery"),
        "majority_token_recovery": result.get("majority_token_recovery"),
        "train_config": _json(result["run"]["config"]),
        "attack_config": _json(job["config"]["attack"]),
        "job_config": _json(job["config"]),
        "result_json": _json(summary),
    }
    rows = []
    for d in result["per_doc"]:
        row = dict(base)
        row["step"] = d.get("step")  # training-phase traffic: the step of the row's crossing
        if "frame_id" in d:  # a latent attack: one row per frame (partition) or per arm and frame (probes)
            row.update(doc_id=d["frame_id"], exact=d.get("exact"), frame_agreement=d.get("agreement"))
            row.update(arm=d.get("arm"), paired_delta=d.get("paired_delta"))
            rows.append(row)
            continue
        row["doc_id"] = d["doc_id"]
        if "token_correct" in d:
            row.update(
                token_correct=d["token_correct"],
                token_counted=d["token_counted"],
                exact=d["exact"],
                predicted=d.get("predicted"),
            )
            for lab in LABELS:
                row[f"span_hits_{lab}"] = d["span_hits"][lab]
                row[f"span_counts_{lab}"] = d["span_counts"][lab]
        if "score" in d:
            row["property_score"] = d["score"]
        rows.append(row)
    return rows


def reuse_rows(job: dict[str, Any], source: pa.Table) -> list[dict[str, Any]]:
    """The inference-setting rows of a reuse job: the source measurement, relabelled."""
    rows = source.to_pylist()
    for r in rows:
        r.update(
            key=job["key"],
            kind="reuse",
            reuse_of=job["reuse_of"],
            **job["fields"],
            attack_config=_json(job["config"]["attack"]),
            job_config=_json(job["config"]),
        )
    return rows


# ------------------------------------------------------------------ the store


class ResultsStore:
    """Reads and writes one grid's store folder (see the module docstring for the layout)."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()

    # paths
    def path(self, kind: str, key: str) -> Path:
        return self.root / KIND_DIRS[kind] / f"{key}.parquet"

    def run_dir(self, train_key: str) -> Path:
        return self.root / "runs" / train_key[:16]

    def claim_path(self, key: str) -> Path:
        return self.root / "claims" / f"{key}.json"

    # state
    def keys(self, kind: str) -> set[str]:
        d = self.root / KIND_DIRS[kind]
        if not d.is_dir():
            return set()
        return {
            p.name[: -len(".parquet")] for p in d.iterdir() if p.suffix == ".parquet" and not p.name.startswith(".")
        }

    def done_keys(self) -> set[str]:
        return self.keys("attack") | self.keys("train")

    def is_done(self, job: dict[str, Any] | Any) -> bool:
        kind = job["kind"] if isinstance(job, dict) else job.kind
        key = job["key"] if isinstance(job, dict) else job.key
        return self.path("train" if kind == "train" else "attack", key).is_file()

    # writes
    def write_rows(self, kind: str, key: str, rows: list[dict[str, Any]]) -> Path:
        p = self.path(kind, key)
        write_atomic(p, table_bytes(rows, SCHEMAS[kind]))
        return p

    def read_job(self, kind: str, key: str) -> pa.Table:
        """The rows of one job, checked: a readable Parquet file of the kind's schema (page checksums
        verified), at least one row, and every row of this job's key; else an IntegrityError in one
        line that names the file and says how to redo the job."""
        p = self.path(kind, key)
        fix = (
            f"delete it and run `splitleak experiment run` on this store again to redo job {key[:12]}"
            if kind != "failed"
            else "delete it (the job is then pending again)"
        )
        table = read_parquet(p, f"{kind} row file", fix, schema=SCHEMAS[kind], optional=LATER_COLUMNS.get(kind, ()))
        if table.num_rows == 0:
            raise IntegrityError(f"{p} holds no rows; {fix}")
        keys = set(table.column("key").to_pylist())
        if keys != {key}:
            raise IntegrityError(
                f"{p} holds rows of job(s) {sorted(str(k)[:12] for k in keys)}, not of job {key[:12]} its name "
                f"gives; {fix}"
            )
        return table

    def remove(self, kind: str, key: str) -> None:
        try:
            self.path(kind, key).unlink()
        except FileNotFoundError:
            pass

    def record_failure(self, job: dict[str, Any], error: str, error_type: str, traceback: str = "") -> None:
        row = {
            "key": job["key"],
            "kind": job["kind"],
            "train_key": job.get("train_key"),
            "summary": job["summary"],
            "error_type": error_type,
            "error": error,
            "traceback": traceback,
            "time": _now(),
            "job_config": _json(job["config"]),
        }
        self.write_rows("failed", job["key"], [row])

    def record_retry(self, job: dict[str, Any], error: str) -> int:
        """Record that ``job``'s worker died while it ran and that it runs again; returns the attempt
        that failed (1 for the first). Earlier attempts' rows are kept."""
        rows = self.read_job("retried", job["key"]).to_pylist() if self.path("retried", job["key"]).is_file() else []
        row = {
            "key": job["key"],
            "kind": job["kind"],
            "summary": job["summary"],
            "attempt": len(rows) + 1,
            "error": error,
            "time": _now(),
        }
        self.write_rows("retried", job["key"], [*rows, row])
        return len(rows) + 1

    def failures(self) -> dict[str, dict[str, Any]]:
        keys = self.keys("failed")
        return {k: self.read_job("failed", k).to_pylist()[0] for k in sorted(keys)}

    # claims: a job being worked on
    def claim(self, key: str, driver: dict[str, Any] | None = None) -> None:
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": _now(), **(driver or {})}
        write_atomic(self.claim_path(key), json.dumps(info).encode())

    def release(self, key: str) -> None:
        try:
            self.claim_path(key).unlink()
        except FileNotFoundError:
            pass

    def live_claims(self) -> dict[str, dict[str, Any]]:
        """Claims whose process is alive. A claim from another host counts as live while that run's
        driver, when it runs here, is alive (a PID on another host cannot be checked from here)."""
        d = self.root / "claims"
        out: dict[str, dict[str, Any]] = {}
        if not d.is_dir():
            return out
        here = socket.gethostname()
        for p in d.glob("*.json"):
            try:
                info = json.loads(p.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if info.get("host") == here:
                live = pid_alive(info.get("pid", -1))
            elif info.get("driver_host") == here:
                live = pid_alive(info.get("driver_pid", -1))
            else:
                live = True
            if live:
                out[p.stem] = info
        return out

    def clear_stale(self) -> None:
        """Remove claims of dead processes and half-written temporary files (call under the run lock)."""
        live = self.live_claims()
        for p in (self.root / "claims").glob("*.json") if (self.root / "claims").is_dir() else []:
            if p.stem not in live:
                p.unlink(missing_ok=True)
        for sub in (*KIND_DIRS.values(), "claims"):  # a claim too can be cut off while it is written
            d = self.root / sub
            if d.is_dir():
                for p in d.glob(".*.tmp"):
                    p.unlink(missing_ok=True)

    @contextmanager
    def lock(self) -> Iterator[None]:
        """One driver per store at a time; a lock left by a killed driver is taken over.

        Exclusive under a race: ``run.lock`` is held with ``flock`` (the kernel frees it when its holder
        dies), on the file that is under that name once it is held (a lock on a file a releasing driver
        has just unlinked is let go, and taken again on the new one); its content (PID, host, start)
        names the holder for the refusal. A lock file that names a live driver on this host or a driver
        on another host is refused even where no flock holds it (another file system, an older
        version)."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / "run.lock"
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": _now()}
        while True:
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                old = self._lock_holder(path)
                raise SplitleakError(
                    f"another `splitleak experiment run` (pid {old.get('pid', 'unknown')}, started "
                    f"{old.get('started', 'just now')}) is using the store {self.root}; wait for it, or stop it first"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # a holder unlinked it as this driver took it: take the file now under the name
        try:
            old = self._lock_holder(path)
            if old.get("host") == info["host"] and old.get("pid") not in (None, os.getpid()) and pid_alive(old["pid"]):
                raise SplitleakError(
                    f"another `splitleak experiment run` (pid {old['pid']}, started {old.get('started')}) is using "
                    f"the store {self.root}; wait for it, or stop it first"
                )
            if old.get("host") not in (None, info["host"]):
                raise SplitleakError(
                    f"the store {self.root} is locked by a run on host {old['host']} (pid {old.get('pid')}); "
                    f"if that run is gone, delete {path}"
                )
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        try:
            yield
        finally:
            path.unlink(missing_ok=True)  # while it is held: a driver that opened this file lets it go
            os.close(fd)

    @staticmethod
    def _lock_holder(path: Path) -> dict[str, Any]:
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return old if isinstance(old, dict) else {}

    def write_json(self, name: str, obj: Any) -> None:
        write_atomic(
            self.root / name, (json.dumps(obj, indent=1, sort_keys=True, default=json_default) + "\n").encode()
        )


def read_results(
    store: str | Path, kind: str = "attack", *, as_rows: bool = False, phase: str | None = "capture"
) -> pa.Table | list[dict[str, Any]]:
    """The rows of one kind from a results store, as a ``pyarrow.Table`` (or a list of dicts with
    ``as_rows=True``), sorted by key (and document).

    ``kind``: ``attack`` (one row per attack or reuse job and evaluation document; reuse rows have
    ``kind == "reuse"``, ``inference == True`` and ``reuse_of`` set to the measured job's key; ``phase``:
    the attack rows of the capture pass (the default; every table of the report reads these), of the training
    traffic (``"train"``: one row per crossing, with its ``step``), or ``None`` for both),
    ``train`` (one row per train job), ``failed`` (one row per job whose last attempt failed) or
    ``retried`` (one row per attempt whose worker died, after which the job ran again).
    """
    if kind not in SCHEMAS:
        raise SplitleakError(f"unknown kind {kind!r}; use {', '.join(SCHEMAS)}")
    rs = ResultsStore(store)
    if not rs.root.is_dir():
        raise SplitleakError(f"{rs.root} is not a results store (no such folder)")
    schema = SCHEMAS[kind]
    keys = sorted(rs.keys(kind))
    tables = [rs.read_job(kind, k) for k in keys]
    table = pa.concat_tables(tables) if tables else schema.empty_table()
    if table.num_rows:
        order = [("key", "ascending")] + (
            [("doc_id", "ascending"), ("arm", "ascending")]
            if kind == "attack"
            else [("attempt", "ascending")]
            if kind == "retried"
            else []
        )
        table = table.sort_by(order)
    if kind == "attack" and phase is not None:
        # lazy: pyarrow's compute module, only where rows are filtered
        import pyarrow.compute as pc

        read = pc.fill_null(table.column("phase"), "capture")  # null: a row file written before the column
        table = table.filter(pc.equal(read, phase))
    return table.to_pylist() if as_rows else table


def format_error(exc: BaseException) -> tuple[str, str, str]:
    """(type name, one-line message, traceback) of an exception."""
    return type(exc).__name__, str(exc) or type(exc).__name__, "".join(tb.format_exception(exc))
