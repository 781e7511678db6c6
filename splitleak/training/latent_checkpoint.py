"""Checkpoints of the latent mode's client (the decoy system, ``splitleak.training.latent``), so that a client
killed mid-training resumes against ``splitleak serve --checkpoints`` (``splitleak.training.checkpoint`` has
the file format, the journal's record of each checkpoint and what ``--resume`` trusts).

Besides the encoder/decoder and their AdamW state, the client carries from step to step what decides what it
sends next and what it records: the decoy pool (its rows and their origins in ring order, its head and size),
the next frame id, every frame's tokens (a decoy row carries its origin's), the record of every frame's real
rows and decoy origins, the training log so far, and under ``gauge_entropy="os"`` the per-run secret that keys
the noise and the decoy draws. All of it is kept as tensors and JSON in the one checkpoint file (never
pickle), in the client's own folder (``OUT.checkpoints/``); nothing of it crosses. Under ``"derived"`` a
resumed run gives the same bits as an uninterrupted one; under ``"os"`` the gauge masters come fresh from
OS entropy per frame and are not kept (a resumed frame gets new ones, by design), while the noise and the
decoy draws stay keyed by the run's secret.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from splitleak.errors import ConfigError, IntegrityError
from splitleak.runs.store import RunStore
from splitleak.training.checkpoint import (
    CheckpointDir,
    ResumePoint,
    checkpoint_folder,
    restore_state,
    resume_point,
    save_recorded,
    state_tensors,
)
from splitleak.training.config import TrainConfig
from splitleak.training.latent import SECRET_BYTES, FrameTruth, LatentClient, LatentLog

PHASES = ("train", "capture")  # the phase codes of ``LatentClient.truth_tensors``


def latent_state(client: LatentClient, log: LatentLog) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, record) of everything the client needs to continue after the steps ``log`` holds."""
    tensors, record = state_tensors(client.params, client.opt)
    pool = client.pool
    tensors["pool.rows"] = pool.rows.detach().cpu().contiguous()
    tensors["pool.origins"] = torch.from_numpy(pool.origins.copy())
    tensors |= {f"truth.{k}": v.contiguous() for k, v in client.truth_tensors().items()}
    origins = [f.decoy_origins.reshape(-1, 2) for f in client.truth]
    tensors["truth.decoys"] = torch.tensor([len(o) for o in origins], dtype=torch.int64)
    tensors["truth.decoy_origins"] = torch.from_numpy(np.concatenate([np.zeros((0, 2), np.int64), *origins]))
    ids = sorted(client.frame_tokens)
    tensors["frame_tokens.ids"] = torch.tensor(ids, dtype=torch.int64)
    tensors["frame_tokens.lengths"] = torch.tensor([len(client.frame_tokens[i]) for i in ids], dtype=torch.int64)
    tensors["frame_tokens.flat"] = torch.from_numpy(
        np.concatenate([np.zeros(0, np.int64), *(client.frame_tokens[i] for i in ids)]).astype(np.int64)
    )
    record.update(
        mode="latent",
        pool={"size": pool.size, "head": pool.head},
        next_frame=client.next_frame,
        losses=log.losses,
        teacher=log.teacher,
        doc_ids=log.doc_ids,
    )
    if client.secret is not None:  # the client's own, as latent/secret.json: it never crosses
        record["noise_and_decoy_key"] = client.secret.hex()
    return tensors, record


def latent_resume_point(run: str | Path, config: TrainConfig) -> ResumePoint:
    """The newest checkpoint of a failed or killed latent run (``resume_point``), before anything is loaded:
    a checkpoint of the latent mode, with its secret under ``gauge_entropy="os"``."""
    point = resume_point(run, config)
    if point.record.get("mode") != "latent":
        raise ConfigError(
            f"the checkpoint of {run} after {point.done} steps is not of the latent mode; resume the run that "
            "wrote it with its own configuration (`splitleak train --resume RUN --out NEW` reads it from the run)"
        )
    kept = point.record.get("noise_and_decoy_key")
    if config.latent is not None and config.latent.gauge_entropy == "os":
        if not isinstance(kept, str) or len(kept) != 2 * SECRET_BYTES:
            raise ConfigError(
                f"the checkpoint of {run} after {point.done} steps keeps no secret of the client's noise and decoy "
                "draws; it cannot be resumed under gauge_entropy=os: train the run again"
            )
    return point


def restore_latent(client: LatentClient, tensors: dict[str, torch.Tensor], record: dict) -> None:
    """Load what ``latent_state`` wrote into a freshly made client (in place); its log is ``resumed_log``."""
    restore_state(client.params, client.opt, tensors, record)
    pool, rows = client.pool, tensors["pool.rows"]
    if rows.shape != pool.rows.shape or rows.dtype != pool.rows.dtype:
        raise IntegrityError(f"the checkpoint's decoy pool is {tuple(rows.shape)} {rows.dtype}, the run's "
                             f"{tuple(pool.rows.shape)} {pool.rows.dtype}; it belongs to another configuration")  # fmt: skip
    pool.rows.copy_(rows)
    pool.origins = tensors["pool.origins"].numpy().copy()
    pool.size, pool.head = int(record["pool"]["size"]), int(record["pool"]["head"])
    client.truth = _truth(tensors)
    ids, lengths = tensors["frame_tokens.ids"].tolist(), tensors["frame_tokens.lengths"].numpy()
    flat = np.split(tensors["frame_tokens.flat"].numpy(), np.cumsum(lengths)[:-1]) if ids else []
    client.frame_tokens = {int(i): t.copy() for i, t in zip(ids, flat)}
    client.next_frame = int(record["next_frame"])
    if client.cfg.gauge_entropy == "os":  # the draws after the resume are keyed as those before it
        client.secret = bytes.fromhex(record["noise_and_decoy_key"])


def resumed_log(record: dict) -> LatentLog:
    """The training log of the steps a checkpoint holds (their losses, teacher matches and documents)."""
    return LatentLog(losses=list(record["losses"]), teacher=list(record["teacher"]), doc_ids=list(record["doc_ids"]))


def _truth(tensors: dict[str, torch.Tensor]) -> list[FrameTruth]:
    """The client's record of each frame, from the tensors ``latent_state`` wrote."""
    frames, real = tensors["truth.frames"].numpy(), tensors["truth.real"].numpy()
    token, position = tensors["truth.token"].numpy(), tensors["truth.position"].numpy()
    counts = tensors["truth.decoys"].numpy()
    origins = np.split(tensors["truth.decoy_origins"].numpy(), np.cumsum(counts)[:-1]) if len(counts) else []
    out = []
    for i, (fid, phase, step, doc, n) in enumerate(frames.tolist()):
        out.append(
            FrameTruth(fid, PHASES[phase], step, doc, real[i, :n].astype(bool), origins[i].copy(),
                       token[i, :n].copy(), position[i, :n].copy())
        )  # fmt: skip
    return out


def latent_checkpointer(
    out: str | Path, store: RunStore, config: TrainConfig, token: str, every: int, log: LatentLog, tap: Any = None
) -> Callable[[int, LatentClient], None]:
    """What the client does after each training step: every ``every`` steps (not after the last), its
    checkpoint into ``OUT.checkpoints/``, recorded in the run's journal before the previous one goes."""
    folder = CheckpointDir(checkpoint_folder(out), keep=1)

    def on_step(done: int, client: LatentClient) -> None:
        if done % every or done >= config.n_steps:
            return
        tensors, record = latent_state(client, log)
        record.update(config_hash=config.hash(), token=token)
        save_recorded(folder, store, done, tensors, record, tap=tap)

    return on_step
