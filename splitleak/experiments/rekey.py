"""Results stored under a job key that an earlier version of splitleak computed, found and re-keyed.

A job's key hashes its configuration (``splitleak.experiments.jobs``). When the configuration's
canonical form changes — defence arguments became normalised (``splitleak.defences.canonical_args``:
``mixup`` and ``mixup(lambda=0.75)`` are one configuration, ``clip=1`` is ``clip=1.0``) — the same job
gets a new key, and a store written before would run it again. ``find_rekeys`` reads each stored row
file that the grid does not plan, recomputes its key from the job configuration it recorded, and names
those that are a planned job under their new key; ``apply_rekeys`` moves them there (under the store's
lock: ``run_grid`` holds it). Nothing is recomputed and nothing is lost: the rows keep every measured
value, their ``job_config`` becomes the configuration the new key hashes, and the train job's run
directory moves with it (its manifest, which records what the run was given, is untouched and still
verifies). Each move writes the new file before it removes the old one, so a kill part-way leaves a
store the next run finishes re-keying."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from splitleak.errors import SplitleakError
from splitleak.experiments.jobs import SCHEMA, Grid
from splitleak.experiments.spec import DefenceItem, defence_label
from splitleak.experiments.store import SCHEMAS, ResultsStore, table_bytes
from splitleak.files import config_hash, read_parquet, write_atomic
from splitleak.training.config import config_from_record


@dataclass(frozen=True)
class Rekey:
    kind: str  # "train" or "attack" (an attack or reuse job: both live in attacks/)
    old: str
    new: str
    job_config: dict[str, Any]  # what the new key hashes


def _canonical_train(train: dict[str, Any]) -> dict[str, Any]:
    return config_from_record(train).as_dict()


def _job_config(rs: ResultsStore, kind: str, key: str) -> dict[str, Any] | None:
    p = rs.path(kind, key)
    try:
        table = read_parquet(p, f"{kind} row file", "delete it to redo its job", columns=["job_config"])
    except Exception:  # noqa: BLE001 (a damaged file is left for read_job to name; it is not re-keyed)
        return None
    values = table.column("job_config").to_pylist()
    if not values or values[0] is None:
        return None
    try:
        config = json.loads(values[0])
    except json.JSONDecodeError:
        return None
    return config if isinstance(config, dict) and config.get("schema") == SCHEMA else None


def find_rekeys(grid: Grid, rs: ResultsStore) -> list[Rekey]:
    """The stored results that are planned jobs of ``grid`` under a key computed before the configuration's
    canonical form changed, train jobs first."""
    planned = grid.by_key
    out: list[Rekey] = []
    trains: dict[str, str] = {}
    for old in sorted(rs.keys("train") - set(planned)):
        config = _job_config(rs, "train", old)
        if config is None or config.get("kind") != "train":
            continue
        try:
            canonical = {**config, "train": _canonical_train(config["train"])}
        except (SplitleakError, TypeError, KeyError):  # a configuration this version no longer takes
            continue
        new = config_hash(canonical)
        if new != old and new in planned and planned[new].kind == "train":
            trains[old] = new
            out.append(Rekey("train", old, new, canonical))
    if not trains:
        return out
    for old in sorted(rs.keys("attack") - set(planned)):
        config = _job_config(rs, "attack", old)
        if config is None or config.get("train_key") not in trains:
            continue
        canonical = {**config, "train_key": trains[config["train_key"]]}
        new = config_hash(canonical)
        if new in planned and planned[new].kind in ("attack", "reuse"):
            out.append(Rekey("attack", old, new, canonical))
    return out


def _label(old_label: Any, old_chain: Any, new_chain: Any) -> Any:
    """The store's ``defence`` column after a re-key: the canonical chain's label where the old one was the
    label an earlier version derived from the chain with its arguments as typed (a latent or shielded arm's
    own label stays)."""
    if not isinstance(old_chain, list) or not isinstance(new_chain, list):
        return old_label
    typed = "+".join(
        d["name"] + ("(" + ",".join(f"{k}={d['args'][k]}" for k in sorted(d["args"])) + ")" if d.get("args") else "")
        for d in old_chain
    )
    if old_label != (typed or "none"):
        return old_label
    return defence_label([DefenceItem(**d) for d in new_chain])


def apply_rekeys(rs: ResultsStore, rekeys: list[Rekey]) -> int:
    """Move each re-keyed result (and a train job's run directory) to its new key; returns how many moved.
    A train job's old file goes last, after its attack jobs have moved: a kill part-way leaves it, so that
    the next run finds the same re-keys again (a result already under its new key is kept, its old file
    removed). Call it holding the store's lock."""
    trains = {r.old: r.new for r in rekeys if r.kind == "train"}
    attacks = {r.old: r.new for r in rekeys if r.kind == "attack"}
    moved = 0
    for t in (r for r in rekeys if r.kind == "train"):
        _write(rs, t, trains, attacks)
        src, dst = rs.run_dir(t.old), rs.run_dir(t.new)
        if src.is_dir() and not dst.exists():
            os.replace(src, dst)
        for a in (r for r in rekeys if r.kind == "attack" and r.job_config["train_key"] == t.new):
            _write(rs, a, trains, attacks)
            rs.remove("attack", a.old)
            moved += 1
        rs.remove("train", t.old)
        moved += 1
    return moved


def _write(rs: ResultsStore, r: Rekey, trains: dict[str, str], attacks: dict[str, str]) -> None:
    """The rows of ``r.old`` under ``r.new`` (unless a file stands there already: the same job's result)."""
    if rs.path(r.kind, r.new).exists():
        return
    rows = rs.read_job(r.kind, r.old).to_pylist()
    new_chain = (r.job_config.get("train") or {}).get("defences")
    for row in rows:
        row["key"] = r.new
        if r.kind == "train":
            old_chain = (json.loads(row["job_config"]).get("train") or {}).get("defences")
            row["train_config"] = json.dumps(r.job_config["train"], sort_keys=True)
            row["run_dir"] = str(rs.run_dir(r.new).relative_to(rs.root))
            row["defence"] = _label(row.get("defence"), old_chain, new_chain)
        else:
            row["train_key"] = trains.get(row.get("train_key"), row.get("train_key"))
            if row.get("reuse_of") is not None:
                row["reuse_of"] = attacks.get(row["reuse_of"], row["reuse_of"])
            chain = (json.loads(row["train_config"]) if row.get("train_config") else {}).get("defences")
            row["defence"] = _label(row.get("defence"), chain, _canonical_chain(chain))
        row["job_config"] = json.dumps(r.job_config, sort_keys=True)
    write_atomic(rs.path(r.kind, r.new), table_bytes(rows, SCHEMAS[r.kind]))


def _canonical_chain(chain: Any) -> Any:
    if not isinstance(chain, list):
        return chain
    try:
        return [DefenceItem(**d).model_dump(mode="json") for d in chain]
    except Exception:  # noqa: BLE001
        return chain
