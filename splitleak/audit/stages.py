"""The audit's record of its own stages (``stages.json`` in the audit folder), what ``splitleak audit --resume``
continues from and what ``compare`` reads to mark an audit that stopped before it finished.

An audit runs in stages: the run (``run/``), one stage per attack (``attacks/STEM.json`` and its Parquet),
the calibration (``calibration/calibration.json``), the undefended twin (``twin/``), and the report. When a
stage has finished, the audit records the SHA-256 of the files it wrote (for a run: its journal, which
vouches for every file of the run); the record is replaced whole (``write_atomic``), so a kill leaves the
previous record or the new one. ``--resume`` reuses a finished stage only after its files hash as recorded
(and a run verifies, complete, under the audit's configuration); a stage that had not finished is done
again from the start, after what it left half-written is removed. The record also holds the audit's
settings (``settings_hash``): a resume with other options is refused, never mixed with the old results.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from splitleak.audit.analysis import read_result
from splitleak.audit.evaluate import attack_label
from splitleak.audit.predictions import read_predictions
from splitleak.errors import IntegrityError, SplitleakError
from splitleak.files import config_hash, json_default, read_json, sha256_file, write_atomic
from splitleak.runs.journal import path_problem, read_run_json
from splitleak.runs.store import is_run_dir
from splitleak.runs.verify import verify_run

STAGES = "stages.json"
#: the fix a refused resume names
START_AGAIN = "pass --force instead of --resume to start the audit again, or choose another --out"


def settings_hash(settings: dict[str, Any]) -> str:
    return config_hash(json.loads(json.dumps(settings, default=json_default)))


def _bad(out: Path, why: str) -> IntegrityError:
    return IntegrityError(f"{out / STAGES} {why}; {START_AGAIN}")


def read_stages(out: str | Path) -> dict[str, Any]:
    """The audit's stage record, checked for shape (IntegrityError in one line naming the file and the fix)."""
    out = Path(out)
    data = read_json(out / STAGES, "audit stage record", START_AGAIN)
    if not isinstance(data.get("settings"), dict) or not isinstance(data.get("settings_hash"), str):
        raise _bad(out, "has no settings and settings_hash (it was edited, or is not an audit's)")
    if data["settings_hash"] != settings_hash(data["settings"]):
        raise _bad(out, "records settings that do not hash to its settings_hash (it was edited)")
    stages = data.get("stages")
    if not isinstance(stages, dict) or not all(
        isinstance(s, dict)
        and isinstance(s.get("files"), dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in s["files"].items())
        for s in stages.values()
    ):
        raise _bad(out, "has no stages mapping each finished stage to the digests of its files")
    planned = data.get("planned")
    if planned is not None and not (
        isinstance(planned, list) and all(isinstance(p, dict) and isinstance(p.get("stem"), str) for p in planned)
    ):
        raise _bad(out, "has a planned list that is not the audit's attacks")
    if not isinstance(data.get("complete", False), bool):
        raise _bad(out, "has a complete flag that is not true or false")
    return data


def _inside(out: Path, rel: str) -> Path:
    problem = path_problem(out, rel)
    if problem:
        raise _bad(out, f"names {problem}")
    return out / rel


class AuditStages:
    """The record of one audit folder's stages, written as each stage finishes."""

    def __init__(self, out: Path, data: dict[str, Any]):
        self.out = Path(out)
        self.data = data

    # ------------------------------------------------------------------ opening

    @classmethod
    def prior(cls, out: Path) -> AuditStages:
        """The record a killed or failed audit left in ``out``, each finished stage's files checked against
        their recorded digests (IntegrityError in one line, naming the file and the fix, on any that differ)."""
        out = Path(out)
        if not (out / STAGES).exists():
            raise SplitleakError(
                f"{out} holds no {STAGES}: no audit that can resume wrote it (an audit of an older splitleak, or "
                f"another folder); {START_AGAIN}"
            )
        data = read_stages(out)
        for name, stage in data["stages"].items():
            for rel, digest in stage["files"].items():
                path = _inside(out, rel)
                if not path.is_file():
                    raise IntegrityError(
                        f"{path}: recorded by the audit's finished stage {name!r} but missing; {START_AGAIN}"
                    )
                if sha256_file(path) != digest:
                    raise IntegrityError(
                        f"{path} differs from what the audit's stage {name!r} wrote (its SHA-256 is not the one "
                        f"{STAGES} records): it was changed after; {START_AGAIN}"
                    )
            if name in ("run", "twin"):  # a finished run: every file its journal records, and its closing entry
                v = verify_run(out / name)
                if not v.ok or v.status != "complete":
                    raise IntegrityError(
                        f"the audit's {name} {out / name} does not verify "
                        f"({v.message if not v.ok else f'the run {v.status}'}); {START_AGAIN}"
                    )
        return cls(out, data)

    @classmethod
    def begin(cls, out: Path, settings: dict[str, Any], prior: AuditStages | None) -> AuditStages:
        """The record of this audit: ``prior``'s when resuming (refused in one line when it was started with
        other settings), else a new one; written before any stage runs, marked not complete."""
        digest = settings_hash(settings)
        if prior is None:
            data: dict[str, Any] = {"settings": settings, "settings_hash": digest, "stages": {}, "complete": False}
        else:
            old = prior.data["settings"]
            if prior.data["settings_hash"] != digest:
                keys = sorted(
                    k for k in old.keys() | settings.keys() if old.get(k) != settings.get(k) and k != "config"
                )
                a, b = old.get("config") or {}, settings.get("config") or {}
                keys += sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
                raise SplitleakError(
                    f"{out} holds an audit started with other settings ({', '.join(keys) or 'its configuration'} "
                    f"{'differs' if len(keys) < 2 else 'differ'}); resume it with the options it was started with, or pass --force instead of --resume "
                    "to start it again with these"
                )
            data = {**prior.data, "complete": False}
            data.pop("stopped", None)
        stages = cls(out, data)
        stages._write()
        return stages

    # ------------------------------------------------------------------ recording

    def done(self, name: str) -> bool:
        return name in self.data["stages"]

    def finish(self, name: str, files: list[str]) -> None:
        self.data["stages"][name] = {"files": {rel: sha256_file(self.out / rel) for rel in files}}
        self._write()

    def plan(self, attacks: list[dict[str, Any]]) -> None:
        self.data["planned"] = attacks
        self._write()

    def stopped(self, stage: str, exc: BaseException) -> None:
        """Record where the audit stopped and why (an error or an interrupt; a kill records nothing)."""
        why = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        self.data["stopped"] = {"stage": stage, "error": why}
        self._write()

    def complete(self) -> None:
        self.data["complete"] = True
        self._write()

    def _write(self) -> None:
        text = json.dumps(self.data, indent=2, sort_keys=True, default=json_default) + "\n"
        write_atomic(self.out / STAGES, text.encode("utf-8"))

    # ------------------------------------------------------------------ what an unfinished stage left

    def clear_run(self, rel: str, config_hash: str) -> None:
        """Remove the run folder ``rel`` that an unfinished stage left (killed or failed mid-training), after
        checking it is a run of this audit's configuration; refuse a foreign folder in one line."""
        path = self.out / rel
        if not path.exists() and not path.is_symlink():
            return
        if not is_run_dir(path):
            raise SplitleakError(
                f"{path} is not a run that the audit wrote (a link, a file or a foreign folder); move it out of the "
                f"audit folder, or {START_AGAIN}"
            )
        if (path / "manifest.json").is_file():
            try:
                recorded = read_run_json(path, "manifest.json").get("config_hash")
            except IntegrityError:
                recorded = None  # a manifest cut by the kill: the unfinished run is the audit's own
            if recorded is not None and recorded != config_hash:
                raise SplitleakError(
                    f"{path} is a run of another configuration ({str(recorded)[:12]}, the audit's is "
                    f"{config_hash[:12]}); move it out of the audit folder, or {START_AGAIN}"
                )
        shutil.rmtree(path)

    def clear_files(self, *rels: str) -> None:
        """Remove what an unfinished stage may have left under these names, and its writers' temporary files."""
        for rel in rels:
            path = self.out / rel
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.is_dir():
                shutil.rmtree(path)
            for tmp in path.parent.glob(f".{path.name}.*.tmp") if path.parent.is_dir() else ():
                tmp.unlink(missing_ok=True)


def audit_state(out: str | Path) -> dict[str, Any] | None:
    """Whether the audit folder ``out`` finished: None when it did, else why not and the attacks it is missing
    (``{"why": ..., "missing": [labels] or None when unknown}``), for ``compare`` to mark it."""
    out = Path(out)
    if not (out / STAGES).exists():  # an audit of an older splitleak: only the report says it finished
        if (out / "report.json").is_file():
            return None
        return {"why": "it stopped before writing its report (killed, or failed)", "missing": None}
    try:
        data = read_stages(out)
    except IntegrityError as exc:
        return {"why": f"its stage record is damaged ({exc})", "missing": None}
    if data.get("complete") and (out / "report.json").is_file():
        return None
    stop = data.get("stopped")
    why = (
        f"it failed in stage {stop.get('stage')} ({stop.get('error')})"
        if isinstance(stop, dict)
        else "it was killed, or is still running"
    )
    planned = data.get("planned")
    if planned is None:
        return {"why": why + ", before its attacks ran", "missing": None}
    missing = [
        attack_label({"attack": p.get("attack", p["stem"]), "attack_params": p.get("params") or {},
                      "config": {"client_copy": p.get("copy", "public")}})
        for p in planned
        if f"attack:{p['stem']}" not in data["stages"]
    ]  # fmt: skip
    return {"why": why, "missing": missing}


def finished_attack(path: Path, acfg, run_config_hash: str) -> dict[str, Any]:
    """An attack result the audit wrote (``path``: RESULT.json, its predictions beside it), read back and
    checked: its hashes (``read_result``), the predictions' digest, and that it is this attack on this run.
    The dictionary ``run_attack`` returned, with ``per_doc`` holding the predictions."""
    res = read_result(path)
    if res is None or res.get("config_hash") != acfg.hash() or res["run"].get("config_hash") != run_config_hash:
        raise SplitleakError(
            f"{path} is not the result of the audit's attack {acfg.attack} on its run (another attack or run wrote "
            f"it); {START_AGAIN}"
        )
    res["per_doc"] = read_predictions(path, res, ["doc_id", "predicted"])
    res.pop("predictions", None)
    res.pop("predictions_sha256", None)
    return res
