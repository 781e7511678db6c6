"""Checkpoints of one side of a split run, so that a deployment resumes after a kill.

A checkpoint holds, after ``done`` completed training steps, the side's trained parameters and its
AdamW state (moments and step counts) as safetensors, and a JSON record (``done``, the optimiser's
hyperparameters, what the caller adds). Restoring it into a freshly loaded model and optimiser and
running the remaining steps gives the same bits as an uninterrupted run: AdamW's update depends only
on the parameters, the moments, the step count and the gradient.

Files are written atomically (a reader or a crash sees a whole checkpoint or the previous one) into a
folder of their own, outside any run directory's journal; the newest ``keep`` are kept. Each records the
SHA-256 of its tensor data in its own header (``data_sha256``), checked when it is loaded, so that a
damaged checkpoint is refused rather than resumed from; the client's run also records each checkpoint's
file digest in its journal (``splitleak.training.run``), which is what ``--resume`` trusts
(``resume_point``). The client writes its checkpoint after the step's reply arrived, the server before it
replies, so the server always holds the client's newest checkpoint step or a later one (hence ``keep`` = 2
on the server). A client killed after writing its checkpoint after k steps and before recording it resumes
from the one before, k - e, which the server still holds: it cannot write k + e before the client sends step
k + 1, which comes after the recording. Split runs (``splitleak.training.run``) and the latent mode
(``splitleak.training.latent_checkpoint``) share this format and order.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load, save

from splitleak.errors import ConfigError, IntegrityError
from splitleak.files import canonical_json, sha256_bytes, sha256_file, write_atomic
from splitleak.runs.chain import resumed_record
from splitleak.runs.journal import JOURNAL, read_run_json
from splitleak.runs.verify import verify_run
from splitleak.wire.transport import TransportError

if TYPE_CHECKING:
    from splitleak.training.config import TrainConfig

_NAME = re.compile(r"^step-(\d{8})\.safetensors$")


def state_tensors(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer | None) -> tuple[dict, dict]:
    """(tensors, record) of parameters in order and their AdamW state."""
    tensors = {f"param.{i}": p.detach().cpu().contiguous() for i, p in enumerate(params)}
    record: dict[str, Any] = {"n_params": len(params), "param_groups": None, "state_keys": {}}
    if opt is not None:
        sd = opt.state_dict()
        record["param_groups"] = sd["param_groups"]
        for idx, st in sd["state"].items():
            keys = []
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    tensors[f"opt.{idx}.{k}"] = v.detach().cpu().contiguous()
                    keys.append(k)
            record["state_keys"][str(idx)] = keys
    return tensors, record


def restore_state(
    params: list[torch.nn.Parameter], opt: torch.optim.Optimizer | None, tensors: dict, record: dict
) -> None:
    """Load what ``state_tensors`` wrote into ``params`` and ``opt`` (in place)."""
    if record["n_params"] != len(params):
        raise IntegrityError(
            f"the checkpoint holds {record['n_params']} trained parameters, this side trains {len(params)}; "
            "it belongs to another split or model"
        )
    with torch.no_grad():
        for i, p in enumerate(params):
            t = tensors[f"param.{i}"]
            if t.shape != p.shape or t.dtype != p.dtype:
                raise IntegrityError(
                    f"checkpoint parameter {i} is {tuple(t.shape)} {t.dtype}, the model's {tuple(p.shape)}"
                )
            p.copy_(t.to(p.device))
    if opt is None or record["param_groups"] is None:
        return
    state = {int(idx): {k: tensors[f"opt.{idx}.{k}"] for k in keys} for idx, keys in record["state_keys"].items()}
    opt.load_state_dict({"state": state, "param_groups": record["param_groups"]})


class CheckpointDir:
    """A folder of ``step-NNNNNNNN.safetensors`` files, the newest ``keep`` kept."""

    def __init__(self, folder: str | Path, keep: int = 2):
        self.folder = Path(folder)
        self.keep = keep

    def steps(self) -> list[int]:
        if not self.folder.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.folder.iterdir() if (m := _NAME.match(p.name)))

    def path(self, done: int) -> Path:
        return self.folder / f"step-{done:08d}.safetensors"

    def save(
        self, done: int, tensors: dict[str, torch.Tensor], record: dict[str, Any], *, prune: bool = True
    ) -> tuple[Path, str]:
        """Write the checkpoint after ``done`` steps; (its path, the SHA-256 of its bytes). ``prune``: then
        delete all but the newest ``keep`` (a caller that records the checkpoint first prunes after)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        data = _data_section(save(tensors))  # the same tensors lay out the same way, whatever the header
        meta = {**record, "done": done, "data_sha256": sha256_bytes(data)}
        blob = save(tensors, metadata={"splitleak": canonical_json(meta).decode()})
        path = self.path(done)
        write_atomic(path, blob)
        if prune:
            self.prune()
        return path, sha256_bytes(blob)

    def prune(self) -> None:
        """Delete all but the newest ``keep`` checkpoints."""
        for old in self.steps()[: -self.keep]:
            self.path(old).unlink(missing_ok=True)

    def load(self, done: int | None = None) -> tuple[int, dict[str, torch.Tensor], dict[str, Any], str]:
        """(done, tensors, record, sha256) of the checkpoint after ``done`` steps (the newest when None)."""
        steps = self.steps()
        if not steps:
            raise ConfigError(f"{self.folder} holds no checkpoint; the run stopped before its first one")
        if done is None:
            done = steps[-1]
        if done not in steps:
            raise ConfigError(
                f"{self.folder} holds no checkpoint after {done} steps (it holds {', '.join(map(str, steps))})"
            )
        data = self.path(done).read_bytes()
        try:
            tensors = load(data)
            header_len = int.from_bytes(data[:8], "little")
            record = json.loads(json.loads(data[8 : 8 + header_len])["__metadata__"]["splitleak"])
            if not isinstance(record, dict):
                raise ValueError("its record is not a JSON object")
        except Exception as exc:  # noqa: BLE001 (safetensors and JSON errors alike)
            raise IntegrityError(f"{self.path(done)} is not a readable checkpoint ({exc}); it was damaged") from None
        if "data_sha256" in record and record["data_sha256"] != sha256_bytes(_data_section(data)):
            raise IntegrityError(
                f"{self.path(done)}: its tensors differ from the digest in its header; the checkpoint was damaged "
                "and cannot be resumed from"
            )
        return done, tensors, record, sha256_bytes(data)


def save_recorded(
    folder: CheckpointDir, store: Any, done: int, tensors: dict, record: dict[str, Any], tap: Any = None
) -> None:
    """The client's checkpoint after ``done`` steps: written whole, recorded in its run's journal (``store``)
    with the file's SHA-256, and only then the previous one deleted, so that a kill at any point leaves a
    checkpoint the journal vouches for (what ``resume_point`` trusts). ``tap``: the training phase's tap,
    flushed first, so that the journal holds every frame before a checkpoint it records (a run resumed from
    it is read whole with this one's frames, ``splitleak.runs.chain``)."""
    if tap is not None:
        tap.flush()
    path, sha = folder.save(done, tensors, record, prune=False)
    store.add("checkpoint", None, {"done": done, "file": path.name, "sha256": sha})
    folder.prune()


def check_checkpointing(every: int | None, resume: Any, connect: str | None) -> None:
    """Refuse checkpoints or a resume outside a deployment, and an interval under one step."""
    if (resume is not None or every is not None) and connect is None:
        raise ConfigError("checkpoints and --resume are for a deployment: pass --connect and --tls-dir")
    if every is not None and every < 1:
        raise ConfigError(f"--checkpoint-every must be >= 1, got {every}")


def welcomed(remote: Any, point: ResumePoint | None, every: int | None) -> tuple[int | None, str | None]:
    """What the server's welcome leaves of the client's checkpoints: (interval, why not resumable). A
    server that did not resume at the client's step is refused (the session aborted); one that keeps no
    checkpoints turns the client's off, and the manifest says why."""
    if point is not None and remote.welcome.get("resumed_after_steps") != point.done:
        remote.abort()
        raise TransportError(f"the server did not resume after step {point.done}")
    if every is not None and remote.welcome.get("checkpoint_every") is None:
        return None, "the server keeps no checkpoints (start it with --checkpoints DIR)"
    return every, None


def resumed_from(resume: str | Path, point: ResumePoint, out: str | Path) -> dict[str, Any]:
    """The manifest's record of the run a resumed run (in ``out``) continues."""
    return resumed_record(
        resume,
        point.done,
        out,
        checkpoint_sha256=point.sha256,
        note="the train-phase capture holds the frames from the resumed step on; the frames before it are in the "
        "capture of the run named here, and readers join them (splitleak.runs.chain)",
    )


def mode_of(latent: Any) -> str:
    """The mode a configuration trains, named by its ``latent`` field: latent, or split (every other)."""
    return "split" if latent is None else "latent"


def _data_section(blob: bytes) -> bytes:
    """The tensor bytes of a safetensors file (after its 8-byte length and JSON header)."""
    return blob[8 + int.from_bytes(blob[:8], "little") :]


def checkpoint_folder(out: str | Path) -> Path:
    """Where a deployed run keeps its client checkpoints: beside the run directory, outside its journal."""
    return Path(f"{Path(out)}.checkpoints")


@dataclass
class ResumePoint:
    """Where a resumed client starts: the steps done, the session's token, its checkpoint and that file's digest."""

    done: int
    token: str
    tensors: dict[str, torch.Tensor]
    record: dict[str, Any]
    sha256: str


def resume_point(run: str | Path, config: TrainConfig) -> ResumePoint:
    """The newest client checkpoint of a run of ``config`` that failed or was killed, checked against the run.

    A client that is killed (SIGKILL, a power cut) cannot close its run, so a resume does not ask for a
    closed run: it verifies what it reads, and reads nothing else. The run's journal is checked to its last
    whole entry (``verify_run(..., to_last_entry=True)``: the hash chain, every file each whole entry
    records, the manifest's config hash; an entry the kill cut off mid-write is passed over, its files never
    read). The manifest must be of this configuration and say that checkpoints were kept. The checkpoint
    resumed is the newest one the journal records (a ``checkpoint`` entry holds its file's SHA-256, written
    once the file was whole and before the previous one was deleted), and its bytes must hash to that
    digest; its own header's digest of its tensors is checked as it is loaded. A checkpoint written after
    the journal's last entry is not trusted (the one before it still is). The frames of the run are not
    read: the new run's manifest names the run that holds those before the resumed step."""
    run = Path(run)
    again = "train again with --force (or another --out)"
    v = verify_run(run, to_last_entry=True)
    if not v.ok:
        raise ConfigError(f"{run} does not verify ({v.message}); it cannot be resumed: {again}")
    if v.status == "complete":
        raise ConfigError(f"{run} is complete; there is nothing to resume")
    m = read_run_json(run, "manifest.json")
    if m.get("config_hash") != config.hash():
        theirs, mine = mode_of((m.get("config") or {}).get("latent")), mode_of(config.latent)
        what = (
            f"is a {theirs}-mode run and this configuration is of the {mine} mode"
            if theirs != mine
            else f"was trained with another configuration ({str(m.get('config_hash', '?'))[:12]})"
        )
        raise ConfigError(
            f"{run} {what}; resume it with its own configuration: `splitleak train --resume {run} --out NEW` "
            "reads it from the run"
        )
    ck = m.get("checkpoints") or {}
    if ck.get("not_resumable"):
        raise ConfigError(f"{run} wrote no checkpoints: {ck['not_resumable']}")
    whole = (run / JOURNAL).read_bytes().split(b"\n")[: v.entries]  # the entries verify_run checked
    entries = [json.loads(line) for line in whole]
    recorded = [e.get("info") or {} for e in entries if e.get("kind") == "checkpoint"]
    if not recorded:
        raise ConfigError(f"{run} stopped before its first checkpoint (every {ck.get('every')} steps); {again}")
    last = recorded[-1]
    folder = CheckpointDir(checkpoint_folder(run))
    path = folder.path(int(last["done"]))
    if not path.is_file() or sha256_file(path) != last.get("sha256"):
        state = "missing" if not path.is_file() else "changed since it was recorded"
        raise ConfigError(
            f"the checkpoint after {last['done']} steps that {run}'s journal records is {state} ({path}); "
            f"it cannot be resumed: {again}"
        )
    done, tensors, record, sha = folder.load(int(last["done"]))
    if record.get("config_hash") != config.hash():
        raise ConfigError(f"the checkpoint in {checkpoint_folder(run)} belongs to another configuration")
    return ResumePoint(done, str(record["token"]), tensors, record, sha)
