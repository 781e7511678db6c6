"""One run of the decoy system's latent mode, end to end (``splitleak.training.latent`` has its roles and
loops): prepare → connect (or the surrogate in this process) → open the record → pretrained loss → train →
capture → the client's records → metrics. The stages share one ``LatentRun``; from the run directory's
creation on, ``RunEnd`` closes the run as failed whatever a stage raises, as ``run_training`` does."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from splitleak.data import DocumentSets
from splitleak.errors import ConfigError
from splitleak.models import LoadedModel, load_model
from splitleak.models.latent import LatentSpec
from splitleak.models.split import SplitModel
from splitleak.progress import Progress, Silent
from splitleak.runs.store import RunStore
from splitleak.runs.truth import TRUTH_FILE
from splitleak.runtime import apply_threads, resolve_device
from splitleak.seeds import model_init_seed, server_seed
from splitleak.training.checkpoint import (
    ResumePoint,
    check_checkpointing,
    checkpoint_folder,
    resumed_from,
    welcomed,
)
from splitleak.training.config import LatentConfig, ServerConfig, TrainConfig
from splitleak.training.latent import (
    CODEC_FILE,
    SECRET_BYTES,
    SECRET_FILE,
    SURROGATE_FILE,
    LatentClient,
    LatentLog,
    LatentServer,
    capture_latent,
    latent_defence_record,
    latent_split,
    privacy_accounting,
    surrogate_parameters,
    train_latent,
)
from splitleak.training.latent_checkpoint import (
    latent_checkpointer,
    latent_resume_point,
    restore_latent,
    resumed_log,
)
from splitleak.training.loop import evaluate_ce, utility
from splitleak.training.record import RunEnd, RunResult, documents_record, manifest_head, run_documents
from splitleak.wire.channel import InProcessChannel
from splitleak.wire.client import RemoteServer, hello_for, parse_address
from splitleak.wire.declare import Declaration, declare_latent_channels
from splitleak.wire.tap import WireRecorder


@dataclass
class LatentRun:
    """What the stages of one latent run hand each other: the loaded parts (``_prepare``), the server (in this
    process, or the session with ``splitleak serve``), the open record (``_open``), then what was measured."""

    config: TrainConfig
    cfg: LatentConfig
    out: str | Path
    dev: torch.device
    progress: Progress
    lm: LoadedModel
    docs: DocumentSets
    split: SplitModel
    spec: LatentSpec
    hidden: int  # the model's width, which the surrogate must not reach
    declaration: Declaration
    server: LatentServer | None = None  # in one process
    remote: Any = None  # the session with ``splitleak serve`` (``connect``)
    server_config: ServerConfig | None = None
    resume: str | Path | None = None  # the run ``--resume`` continues, and its checkpoint
    point: ResumePoint | None = None
    checkpoint_every: int | None = None
    not_resumable: str | None = None
    manifest: dict[str, Any] = field(default_factory=dict)
    store: RunStore = field(init=False)
    log: LatentLog = field(init=False)
    end: RunEnd = field(init=False)
    channel: Any = None  # the in-process channel or the remote session, once training starts
    client: LatentClient = field(init=False)
    pre: dict[str, Any] = field(default_factory=dict)  # the pretrained model's held-out utility
    bytes_per_step: dict[str, float] = field(default_factory=dict)
    cap: dict[str, Any] = field(default_factory=dict)


def run_latent(
    config: TrainConfig,
    out: str | Path,
    *,
    force: bool = False,
    device: str = "auto",
    threads: int | None = None,
    progress: Progress | None = None,
    lm: LoadedModel | None = None,
    connect: str | None = None,
    tls_dir: str | Path | None = None,
    checkpoint_every: int | None = None,
    resume: str | Path | None = None,
) -> RunResult:
    """Train the decoy system's latent mode and write its run directory: manifest, documents, the
    capture of all four wires in both phases (``wire/``), the client's private record of real rows
    (``latent/truth.safetensors``), the trained encoder/decoder, and metrics (held-out loss as
    deployed, the pretrained model's, their difference, the per-row (ε, δ)).

    In one process the surrogate runs here and its trained state is written too. With ``connect``
    (``HOST:PORT``, with ``tls_dir``) the client is the trusted node only, against ``splitleak serve``:
    the surrogate trains there (its state in the server's capture), the hello carries the server's part
    of the configuration (``ServerConfig``, with ``latent``) and the model's width, and the same four
    crossings go over mutual TLS; every bit that crosses is the same as in one process.

    ``checkpoint_every`` and ``resume`` (with ``connect``) as in ``run_training``: both sides checkpoint every
    so many steps (the client its codec, AdamW, decoy pool, frame record and, under OS entropy, its secret:
    ``splitleak.training.latent_checkpoint``), and a failed or killed run continues after its newest
    checkpoint against a server that holds the matching one."""
    check_checkpointing(checkpoint_every, resume, connect)
    if connect is not None and tls_dir is None:
        raise ConfigError("--connect needs --tls-dir (the folder `splitleak tls init` wrote)")
    point = None if resume is None else latent_resume_point(resume, config)  # checked before anything loads
    run = _prepare(config, out, device, threads, progress, lm, transport=connect is not None)
    run.resume, run.point, run.checkpoint_every = resume, point, checkpoint_every
    if connect is None:
        run.server = LatentServer(run.cfg, config.lr, server_seed(config.seed), hidden=run.hidden)
    else:
        assert tls_dir is not None
        _connect(run, connect, tls_dir, force)
    _open(run, force)
    with run.end.on_fault():  # from here on the run ends closed, whatever raises (RunEnd, as run_training)
        run.store.add_json("manifest", "manifest.json", run.manifest)
        run.store.add_json("documents", "documents.json", run.docs.to_json())
        _pretrained_loss(run)
        _train(run)
        _capture(run)
        _record_client(run)
        run.end.stage = "writing metrics"
        metrics = _measure(run)
        run.store.add_json("metrics", "metrics.json", metrics)
        run.store.close(True, {"config_hash": config.hash()})
    if run.checkpoint_every is not None:
        shutil.rmtree(checkpoint_folder(out), ignore_errors=True)  # the run is whole: nothing to resume
    return RunResult(Path(out), metrics, config)


def _prepare(
    config: TrainConfig,
    out: str | Path,
    device: str,
    threads: int | None,
    progress: Progress | None,
    lm: LoadedModel | None,
    *,
    transport: bool,
) -> LatentRun:
    """Load the model and the documents, cut the frozen model and declare the four channels."""
    assert config.latent is not None
    cfg = config.latent
    progress = progress or Silent()
    apply_threads(threads)
    dev = resolve_device(device)
    if lm is None:
        lm = load_model(
            config.model, precision=config.precision, seed=model_init_seed(config.seed), model_path=config.model_path
        )
    lm.model.to(dev)
    docs = run_documents(config, lm.tokenizer)
    split, spec = latent_split(lm, cfg)
    hidden = int(split.model.get_input_embeddings().weight.shape[1])
    declaration = declare_latent_channels(
        output_gradient=cfg.output_gradient,
        transport=transport,
        gauge_entropy=cfg.gauge_entropy,
        decoy_release=cfg.decoy_release,
    )
    return LatentRun(config, cfg, out, dev, progress, lm, docs, split, spec, hidden, declaration)


def _connect(run: LatentRun, connect: str, tls_dir: str | Path, force: bool) -> None:
    """The handshake with ``splitleak serve``, before the run directory exists: a refused session writes
    nothing. The hello carries the server's part of the configuration, the model's width, and the checkpoint
    interval and the checkpoint to resume from; a server that keeps no checkpoints turns the client's off."""
    RunStore.check_out(run.out, force, keep=run.resume)  # the same refusals as below, before any connection
    host, port = parse_address(connect)
    run.server_config = ServerConfig.of(run.config, random_init="init_seed" in run.lm.info)
    hello = hello_for(
        run.server_config.as_dict(),
        run.lm.fingerprint(),
        {**run.spec.as_dict(), "hidden": run.hidden},
        latent_defence_record(run.cfg),
        checkpoint_every=run.checkpoint_every,
        resume=None if run.point is None else {"token": run.point.token, "done": run.point.done},
    )
    run.remote = RemoteServer(host, port, tls_dir, hello)
    run.checkpoint_every, run.not_resumable = welcomed(run.remote, run.point, run.checkpoint_every)


def _open(run: LatentRun, force: bool) -> None:
    """The manifest (built before anything is written, so that a fault in it leaves no unfinished run), the run
    directory, the log and how the record ends."""
    try:
        run.manifest = _manifest(run)
        run.store = RunStore.create(run.out, force=force, keep=run.resume)
    except BaseException:
        if run.remote is not None:
            run.remote.abort()  # the server closes its session as failed
        raise
    run.log = LatentLog() if run.point is None else resumed_log(run.point.record)
    run.end = RunEnd(
        run.store, run.log, run.remote, ledgers=lambda: [] if run.channel is None else [run.channel.ledger]
    )


def _manifest(run: LatentRun) -> dict[str, Any]:
    """The run's manifest: the head every run has, the latent split, its defences and declared channels."""
    manifest = {
        **manifest_head(run.config, run.lm),
        "mode": "latent",
        "split": {**run.spec.as_dict(), "cut": run.split.spec.cut},
        "defences": latent_defence_record(run.cfg),
        "documents": documents_record(run.docs),
        "runtime": {"device": str(run.dev), "threads": torch.get_num_threads()},
        "labels_cross_wire": False,
        "channels": run.declaration.as_dict(),
        "surrogate_parameters": surrogate_parameters(run.cfg),
    }
    if run.remote is not None:
        assert run.server_config is not None
        manifest["transport"] = {
            "server": run.remote.where,
            "kind": "websockets over mutual TLS 1.3",
            "server_config_hash": run.server_config.hash(),
        }
        manifest["checkpoints"] = {"every": run.checkpoint_every, "not_resumable": run.not_resumable}
        if run.point is not None:
            assert run.resume is not None
            manifest["resumed_from"] = resumed_from(run.resume, run.point, run.out)
    return manifest


def _pretrained_loss(run: LatentRun) -> None:
    run.end.stage = "pretrained loss"
    run.pre = utility(evaluate_ce(run.split, run.docs.evaluation, progress=run.progress, name="pretrained loss"))


def _train(run: LatentRun) -> None:
    """The training steps over the four crossings, every frame through the training tap; then the log."""
    config, end = run.config, run.end
    end.stage = "training"
    train_tap = end.train_tap = WireRecorder(run.store, "train", run.declaration)
    if run.remote is not None:
        run.channel = run.remote
        run.channel.set_taps([train_tap])
    else:
        assert run.server is not None
        run.channel = InProcessChannel(run.server.handle, [train_tap])
    run.client = LatentClient(run.split, run.cfg, config.seed, run.channel, config.lr)
    start = 0 if run.point is None else run.point.done
    if run.point is not None:
        restore_latent(run.client, run.point.tensors, run.point.record)
    on_step = None
    if run.checkpoint_every is not None:
        token = run.remote.welcome["token"]
        on_step = latent_checkpointer(run.out, run.store, config, token, run.checkpoint_every, run.log, tap=train_tap)
    train_latent(
        run.client, run.docs.train, seed=config.seed, steps=config.n_steps, progress=run.progress, log=run.log,
        start=start, on_step=on_step,
    )  # fmt: skip
    steps = max(1, len(run.log.losses) - start)  # the steps this run sent
    run.bytes_per_step = {k: v / steps for k, v in run.channel.bytes_per_direction().items()}
    end.record_training()


def _capture(run: LatentRun) -> None:
    """The capture pass, every parameter frozen, through the capture tap; over TLS, then the session's close
    (the server closes its capture, with the trained surrogate in it) and its messages."""
    end = run.end
    end.stage = "capture"
    capture_tap = WireRecorder(run.store, "capture", run.declaration)
    run.channel.set_taps([capture_tap])
    if run.server is not None:
        run.server.opt = None
    run.cap = capture_latent(run.client, run.docs.evaluation, batch=run.config.capture_batch, progress=run.progress)
    capture_tap.close([run.channel.ledger])
    if run.remote is not None:
        end.stage = "closing the session"
        run.remote.close()  # the server closes its capture, with the trained surrogate in it
        end.record_messages()


def _record_client(run: LatentRun) -> None:
    """The client's own records, which never cross: which gauged rows were real, the per-run secret
    (a control reads it), the trained encoder/decoder; and in one process the trained surrogate."""
    store, client = run.store, run.client
    run.end.stage = "writing the client's records"
    store.add_tensors("latent-truth", TRUTH_FILE, client.truth_tensors(), {"frames": len(client.truth)})
    if client.secret is not None:  # the client's own, never sent and not in the manifest: a control reads it
        store.add_json(
            "latent-secret", SECRET_FILE, {"noise_and_decoy_key": client.secret.hex(), "bytes": SECRET_BYTES}
        )
    store.add_tensors("latent-codec", CODEC_FILE, client.state_dict(), {"width": run.cfg.width})
    if run.server is not None:
        surrogate = {k: v.detach().clone().contiguous() for k, v in run.server.surrogate.state_dict().items()}
        store.add_tensors(
            "latent-surrogate", SURROGATE_FILE, surrogate, {"parameters": run.manifest["surrogate_parameters"]}
        )


def _measure(run: LatentRun) -> dict[str, Any]:
    """The run's metrics: the held-out loss as deployed (the capture pass), the pretrained model's, the
    throughput, the capture, and the per-row (ε, δ) of the forward wire."""
    pre, log = run.pre, run.log
    post = utility(np.asarray(run.cap.pop("client_losses"), dtype=np.float64))
    releases = run.client.max_row_releases()
    return {
        "heldout_ce": post["ce"],
        "perplexity": post["perplexity"],
        "pretrained_ce": pre["ce"],
        "pretrained_perplexity": pre["perplexity"],
        "ce_increase_over_pretrained": post["ce"] - pre["ce"],
        "heldout_measured": "the capture pass: the latent pipeline as deployed (noise, decoys, gauges); rows form "
        "a set, so a position's output may depend on later tokens of its block",
        "all_local_ce": None,
        "all_local_perplexity": None,
        "delta_u": None,
        "final_teacher_match": next((t for t in reversed(log.teacher) if t is not None), None),
        "wire_bytes_per_step": run.bytes_per_step,
        "train_tokens_per_second": log.as_dict()["tokens_per_second"],
        "capture": run.cap,
        "privacy": privacy_accounting(run.cfg, releases),
    }
