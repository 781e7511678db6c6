"""Reading an attack result's per-document predictions (the Parquet beside its RESULT.json), checked against
the digest the result records; shared by the pre-registered analysis and the gate protocol's readers, below
both (``splitleak.audit.analysis`` imports ``splitleak.audit.gate``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from splitleak.errors import IntegrityError, SplitleakError
from splitleak.files import read_parquet, sha256_file
from splitleak.runs.journal import read_run_json
from splitleak.runs.verify import verify_run

RESULT_FIX = "rerun `splitleak attack` (or the audit) that wrote it, or move it out of the folder"


def read_predictions(path: Path, res: dict[str, Any], columns: list[str]) -> list[dict[str, Any]]:
    """The per-document predictions beside a result, checked against the digest the result records."""
    name = res.get("predictions") or path.with_suffix(".parquet").name
    if name in ("", ".", "..") or Path(name).name != name:
        raise IntegrityError(f"{path} names predictions {name!r}, not a file beside it; {RESULT_FIX}")
    pq_path = path.with_name(name)
    if not pq_path.is_file():
        raise SplitleakError(f"{path} names predictions {pq_path.name}, which are missing beside it")
    want = res.get("predictions_sha256")
    if want is not None and sha256_file(pq_path) != want:
        raise IntegrityError(f"{pq_path} does not hash to the digest {path.name} records; {RESULT_FIX}")
    return read_parquet(pq_path, "predictions file", RESULT_FIX, columns=columns).to_pylist()


def verified_metrics(run_dir: str | Path) -> tuple[dict[str, Any] | None, str | None]:
    """A run's ``metrics.json`` only when the run verifies, complete (``verify_run``, as ``compare`` checks it):
    ``(metrics, None)``, or ``(None, why not)``. An edited held-out CE (0.123, NaN) is not what the run
    measured, and no reader of utility may take it as measured."""
    v = verify_run(run_dir)
    if not v.ok:
        return None, v.message
    if v.status != "complete":
        return None, f"the run {v.status}"
    return read_run_json(run_dir, "metrics.json"), None
