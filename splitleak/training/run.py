"""One run end to end: load, split-train over the wire, measure utility, capture, record.

Everything that can be checked is checked before the run directory is created (configuration,
model, documents, split), so bad input writes nothing.
"""

from __future__ import annotations

import gc
import logging
import math
import shutil
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from splitleak import seeds
from splitleak.data import DocumentSets
from splitleak.defences import DefenceChain
from splitleak.errors import ConfigError
from splitleak.models import LoadedModel, SplitModel, load_model
from splitleak.progress import Progress, Silent
from splitleak.runs.journal import read_run_json
from splitleak.runs.store import RunStore
from splitleak.runtime import apply_threads, resolve_device
from splitleak.seeds import model_init_seed, server_seed
from splitleak.training.checkpoint import (
    CheckpointDir,
    ResumePoint,
    check_checkpointing,
    checkpoint_folder,
    resume_point,
    resumed_from,
    save_recorded,
    state_tensors,
    welcomed,
)
from splitleak.training.config import ServerConfig, TrainConfig
from splitleak.training.latent_run import run_latent
from splitleak.training.loop import (
    TrainLog,
    capture_traffic,
    evaluate_ce,
    supervision,
    train_all_local,
    train_split,
    utility,
)
from splitleak.training.record import RunEnd, RunResult, documents_record, manifest_head, run_documents
from splitleak.training.replicas import build_server
from splitleak.wire.client import RemoteServer, hello_for, parse_address
from splitleak.wire.declare import Declaration, declare_channels
from splitleak.wire.tap import WireRecorder

_log = logging.getLogger("splitleak.train")


@dataclass
class SplitRun:
    """What the stages of one split run hand each other: the loaded and checked parts (``_prepare``), the
    session (``_connect``), the open record (``_open``), then what training and the capture pass measured."""

    config: TrainConfig
    out: str | Path
    resume: str | Path | None
    dev: torch.device
    progress: Progress
    lm: LoadedModel
    pristine: Callable[[], LoadedModel] | None  # the all-local baseline's fresh model
    point: ResumePoint | None
    secret: bytes | None  # keys the client's draws (draws=os)
    chain_client: DefenceChain
    chain_server: DefenceChain
    docs: DocumentSets
    split: SplitModel
    declaration: Declaration
    answer_only: bool
    checkpoint_every: int | None
    not_resumable: str | None
    remote: Any = None  # the session with ``splitleak serve`` (``connect``)
    server_config: ServerConfig | None = None
    store: RunStore = field(init=False)
    log: TrainLog = field(init=False)
    end: RunEnd = field(init=False)
    server: Any = None  # the remote session, the replicas, or None (one ServerRole in the loop)
    server_logits: Any = None
    pre: dict[str, Any] = field(default_factory=dict)  # the pretrained model's held-out utility
    post: dict[str, Any] | None = None  # the trained one's, where the client can measure it
    cap: dict[str, Any] = field(default_factory=dict)
    client_side: dict[str, list[torch.Tensor]] | None = None  # label-shielded: output gradients kept


def run_training(
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
    pristine: Callable[[], LoadedModel] | None = None,
) -> RunResult:
    """Train one split run and write its directory (manifest, documents, training log, captures,
    trained client layers, metrics, journal). ``lm`` lets a caller pass a model already loaded
    with the same name, precision and seed.

    The all-local baseline starts from the pristine weights, which it gets only after the split phase's
    model, optimiser state and captures are freed, so that the two never sit in memory together: from
    ``pristine`` (a factory of a fresh copy, as a grid worker's model cache gives), else by loading the
    model again; a caller that passes ``lm`` and no ``pristine`` gets a copy taken before training (the
    caller still holds ``lm``, so nothing would be saved).

    ``connect`` (``HOST:PORT``, with ``tls_dir``): run the trusted node only, against a server
    started with ``splitleak serve`` (``splitleak.wire.client`` and ``splitleak.deploy``). The handshake happens before the
    run directory is created, so a refused session writes nothing. The client cannot then run the
    uncut model (the server's trained layers stay there): its held-out utility is the loss of the
    capture pass, split inference with the defences as deployed, when it holds the head (U-shape);
    in a plain split the loss stays on the server (the server's ``server_log.json``).

    ``checkpoint_every`` (with ``connect``): both sides checkpoint their trained layers and AdamW
    state every so many steps (the client into ``OUT.checkpoints/``, the server into its
    ``--checkpoints`` folder), unless a defence keeps client state across steps (mixup). ``resume``:
    a failed run directory of the same configuration; training continues after its newest
    checkpoint against a server that holds the matching one, and ``out`` receives the whole run
    (its train-phase capture holds the frames from the resumed step on). Checkpoints are deleted once
    the run is complete."""
    if out is not None:  # refused before anything is loaded: a foreign folder, a link, the run --resume reads
        RunStore.check_out(out, force, keep=resume)
    if config.latent is not None:
        return run_latent(
            config, out, force=force, device=device, threads=threads, progress=progress, lm=lm, connect=connect,
            tls_dir=tls_dir, checkpoint_every=checkpoint_every, resume=resume,
        )  # fmt: skip
    run = _prepare(config, out, resume, device, threads, progress, lm, connect, checkpoint_every, pristine)
    del lm  # the run holds the model from here on, and lets it go before the all-local baseline
    if connect is not None:
        _connect(run, connect, tls_dir, force)
    _open(run, force)
    with run.end.on_fault():  # from here on the run ends closed, whatever raises
        _write_manifest(run)
        _pretrained_loss(run)
        _train(run)
        _heldout_loss(run)
        _capture(run)
        _record_client(run)
        metrics = _measure(run)
        run.end.stage = "writing metrics"
        run.store.add_json("metrics", "metrics.json", metrics)
        run.store.close(True, {"config_hash": config.hash()})
    if run.checkpoint_every is not None:
        shutil.rmtree(checkpoint_folder(out), ignore_errors=True)  # the run is whole: nothing to resume
    return RunResult(Path(out), metrics, config)


def _load(config: TrainConfig) -> LoadedModel:
    """The run's model, fresh from its name, precision and initialisation seed."""
    return load_model(
        config.model, precision=config.precision, seed=model_init_seed(config.seed), model_path=config.model_path
    )


def _prepare(
    config: TrainConfig,
    out: str | Path,
    resume: str | Path | None,
    device: str,
    threads: int | None,
    progress: Progress | None,
    lm: LoadedModel | None,
    connect: str | None,
    checkpoint_every: int | None,
    pristine: Callable[[], LoadedModel] | None,
) -> SplitRun:
    """Load and check everything before the run directory exists (configuration, checkpoint to resume,
    defences, model, documents, split, declared channels), so that bad input writes nothing."""
    progress = progress or Silent()
    apply_threads(threads)
    dev = resolve_device(device)
    if pristine is None and lm is None:
        pristine = partial(_load, config)
    check_checkpointing(checkpoint_every, resume, connect)
    point = None if resume is None else resume_point(resume, config)
    secret = draws_secret(config, point)
    chain_client = DefenceChain.from_specs([d.model_dump() for d in config.defences], config.seed, secret)
    chain_server = DefenceChain.from_specs([d.model_dump() for d in config.defences], server_seed(config.seed))
    if lm is None:
        lm = _load(config)
    lm.model.to(dev)
    docs = run_documents(config, lm.tokenizer)
    split = SplitModel(lm, config.depth, config.offload_start, config.offload_length, shielded=config.shielded)
    if config.doc_len > getattr(
        lm.model.config, "max_position_embeddings", getattr(lm.model.config, "n_positions", 10**9)
    ):
        raise ConfigError(f"--doc-len {config.doc_len} exceeds the model's context length")
    chain_client.check_split_mode(split.spec.mode)
    chain_client.check_run(config.n_steps)
    declaration = declare_channels(
        u_shape=split.spec.u_shape,
        defences=chain_client.defences,
        transport=connect is not None,
        gradients=not split.sends_no_gradient,
        draws=config.draws,
    )
    answer_only = config.shielded is not None and config.shielded.answer_only
    if answer_only:
        supervision(docs.train + docs.evaluation, True)  # refuses documents without an answer, before writing
    if config.all_local_baseline and pristine is None:
        kept = lm.clone()
        pristine = lambda: kept  # noqa: E731
    checkpoint_every, not_resumable = _checkpointing(checkpoint_every, chain_client)
    return SplitRun(
        config, out, resume, dev, progress, lm, pristine, point, secret, chain_client, chain_server, docs, split,
        declaration, answer_only, checkpoint_every, not_resumable,
    )  # fmt: skip


def _checkpointing(every: int | None, chain_client: DefenceChain) -> tuple[int | None, str | None]:
    """How often the client checkpoints (None: never), and why it does not where a defence forbids it."""
    if every is not None and chain_client.client_transform is not None:
        return None, f"defence {chain_client.client_transform.name!r} keeps client state across steps"
    return every, None


def _connect(run: SplitRun, connect: str, tls_dir: str | Path | None, force: bool) -> None:
    """The handshake with ``splitleak serve``, before the run directory exists: a refused session writes
    nothing. A server that keeps no checkpoints turns the client's off too."""
    if tls_dir is None:
        raise ConfigError("--connect needs --tls-dir (the folder `splitleak tls init` wrote)")
    RunStore.check_out(run.out, force, keep=run.resume)  # the same refusals as below, before any connection
    host, port = parse_address(connect)
    run.server_config = ServerConfig.of(run.config, random_init="init_seed" in run.lm.info)
    point = run.point
    hello = hello_for(
        run.server_config.as_dict(),
        run.lm.fingerprint(),
        run.split.spec.as_dict(),
        run.chain_client.describe(),
        checkpoint_every=run.checkpoint_every,
        resume=None if point is None else {"token": point.token, "done": point.done},
    )
    run.remote = RemoteServer(host, port, tls_dir, hello)
    every, not_resumable = welcomed(run.remote, point, run.checkpoint_every)
    run.checkpoint_every, run.not_resumable = every, not_resumable or run.not_resumable


def _open(run: SplitRun, force: bool) -> None:
    """The run directory, the training log (a resumed run's so far) and how the record ends (``RunEnd``)."""
    try:
        run.store = RunStore.create(run.out, force=force, keep=run.resume)
    except BaseException:
        if run.remote is not None:
            run.remote.abort()  # the server closes its session as failed
        raise
    run.log = TrainLog()
    if run.point is not None:
        run.log.losses, run.log.doc_ids = list(run.point.record["losses"]), list(run.point.record["doc_ids"])
    run.end = RunEnd(run.store, run.log, run.remote)


def _write_manifest(run: SplitRun) -> None:
    """The manifest, the documents and (draws=os) the client's own secret."""
    config, split, remote, point = run.config, run.split, run.remote, run.point
    manifest = {
        **manifest_head(config, run.lm),
        "split": split.spec.as_dict(),
        "defences": run.chain_client.describe(),
        "documents": documents_record(run.docs),
        "runtime": {"device": str(run.dev), "threads": torch.get_num_threads()},
        "labels_cross_wire": not split.spec.u_shape,
        "channels": run.declaration.as_dict(),
    }
    if remote is not None:
        assert run.server_config is not None
        manifest["transport"] = {
            "server": remote.where,
            "kind": "websockets over mutual TLS 1.3",
            "server_config_hash": run.server_config.hash(),
        }
        manifest["checkpoints"] = {"every": run.checkpoint_every, "not_resumable": run.not_resumable}
        if point is not None:
            assert run.resume is not None
            manifest["resumed_from"] = resumed_from(run.resume, point, run.out)
    run.store.add_json("manifest", "manifest.json", manifest)
    run.store.add_json("documents", "documents.json", run.docs.to_json())
    if run.secret is not None:
        run.store.add_json("client-draws", DRAWS_FILE, {"secret": run.secret.hex(), "note": DRAWS_NOTE})


def _pretrained_loss(run: SplitRun) -> None:
    run.end.stage = "pretrained loss"
    run.pre = utility(
        evaluate_ce(
            run.split, run.docs.evaluation, progress=run.progress, name="pretrained loss", answer_only=run.answer_only
        )
    )


def _train(run: SplitRun) -> None:
    """The training steps over the wire, every frame through the training tap; then the training log."""
    config, end, point = run.config, run.end, run.point
    # the server and the checkpoints are set up while the stage still reads "pretrained loss"
    server = run.server = run.remote if run.remote is not None else build_server(run.chain_server, run.split, config.lr)
    run.server_logits = getattr(server, "median_logits", None)
    on_step = _checkpointer(run)

    # the tap: every frame of the training steps and of the capture pass, recorded as it crossed
    end.stage = "training"
    train_tap = end.train_tap = WireRecorder(run.store, "train", run.declaration)
    train_split(
        run.split,
        run.docs.train,
        run.chain_client,
        run.chain_server,
        seed=config.seed,
        steps=config.n_steps,
        lr=config.lr,
        progress=run.progress,
        log=run.log,
        server=server,
        taps=[train_tap],
        start=0 if point is None else point.done,
        client_state=None if point is None else (point.tensors, point.record),
        on_step=on_step,
    )
    train_record = run.log.as_dict()
    if server is not None and hasattr(server, "flag_log"):
        train_record["replica_flags"] = list(server.flag_log)
    end.record_training(train_record)


def _checkpointer(run: SplitRun) -> Callable[[int, Any], None] | None:
    """What the client does after each training step when it checkpoints (None: nothing)."""
    every = run.checkpoint_every
    if every is None:
        return None
    assert run.remote is not None
    config, log, store, secret = run.config, run.log, run.store, run.secret
    folder = CheckpointDir(checkpoint_folder(run.out), keep=1)
    token = run.remote.welcome["token"]

    def on_step(done: int, client) -> None:
        if done % every or done >= config.n_steps:
            return
        tensors, record = state_tensors(client.params, client.opt)
        record.update(config_hash=config.hash(), token=token, losses=log.losses, doc_ids=log.doc_ids)
        if secret is not None:
            record["draws_secret"] = secret.hex()
        save_recorded(folder, store, done, tensors, record, tap=run.end.train_tap)

    return on_step


def _heldout_loss(run: SplitRun) -> None:
    """The trained model's held-out loss, in one process (over TLS it is the capture pass's, if any)."""
    if run.remote is None:
        run.end.stage = "held-out loss"
        run.post = utility(
            evaluate_ce(
                run.split,
                run.docs.evaluation,
                progress=run.progress,
                server_logits=run.server_logits,
                answer_only=run.answer_only,
            )
        )


def _capture(run: SplitRun) -> None:
    """The capture pass over the evaluation documents, every frame through the capture tap; over TLS, then
    the session's close and its messages, and the held-out loss the client measured in the pass."""
    end, remote = run.end, run.remote
    end.stage = "capture"
    capture_tap = WireRecorder(run.store, "capture", run.declaration)
    run.client_side = {} if run.split.spec.label_shielded else None
    run.cap, ledgers = capture_traffic(
        run.split,
        run.docs.evaluation,
        run.chain_client,
        run.chain_server,
        batch=run.config.capture_batch,
        taps=[capture_tap],
        progress=run.progress,
        server=run.server,
        client_side=run.client_side,
    )
    capture_tap.close(ledgers)
    if remote is not None:
        end.stage = "closing the session"
        remote.close()  # the server closes its capture
        end.record_messages()
        client_losses = run.cap.pop("client_losses")
        run.post = None if client_losses is None else utility(np.asarray(client_losses, dtype=np.float64))


def _record_client(run: SplitRun) -> None:
    """What stays with the client: the defences' own records, the label-shielded output gradients, and the
    trained client layers (bound to this run)."""
    store, config = run.store, run.config
    run.end.stage = "writing the client's records"
    for d in run.chain_client.defences:
        record = getattr(d, "client_record", None)
        if record is not None:  # the client's own record (mixup: where each decoy came from); it never crosses
            rel, obj = record()
            store.add_json("client-record", rel, obj)
    if run.client_side:  # label-shielded: the output gradient before and after the defences, kept by the client
        raw, sent = torch.cat(run.client_side["raw"]), torch.cat(run.client_side["sent"])
        store.add_tensors(
            "client-record",
            "shielded/output_gradients.safetensors",
            {"raw": raw.contiguous(), "sent": sent.contiguous()},
            {"phase": "capture", "note": "never crosses: the client's own copy, for the gradient-utility metrics"},
        )
        run.cap["gradient_utility"] = gradient_utility_summary(raw, sent)
    run.end.stage = "writing the client layers"
    store.add_tensors(
        "client-layers",
        "client_layers.safetensors",
        run.split.client_state_dict(),
        {"cut": run.split.spec.cut},
        metadata={"model": run.lm.name, "cut": run.split.spec.cut, "config_hash": config.hash()},  # bound to this run
    )


def _measure(run: SplitRun) -> dict[str, Any]:
    """The run's metrics: held-out and pretrained utility, throughput, the capture, the replicas' flags, and
    the all-local baseline's utility and the difference (Δu) where it runs."""
    log, post, pre, server = run.log, run.post, run.pre, run.server
    metrics: dict[str, Any] = {
        "heldout_ce": None if post is None else post["ce"],
        "perplexity": None if post is None else post["perplexity"],
        "pretrained_ce": pre["ce"],
        "pretrained_perplexity": pre["perplexity"],
        "wire_bytes_per_step": log.bytes_per_step,
        "train_tokens_per_second": log.as_dict()["tokens_per_second"],
        "capture": run.cap,
    }
    if server is not None and hasattr(server, "flag_log"):
        metrics["replica_flagged_messages"] = sum(1 for f in server.flag_log if f["flagged"])
        metrics["replica_max_deviation"] = max((max(f["deviation"]) for f in server.flag_log), default=0.0)
    del server  # the baseline frees the split phase's server
    if run.config.all_local_baseline:
        metrics.update(_all_local(run))
    else:
        metrics.update({"all_local_ce": None, "all_local_perplexity": None, "delta_u": None})
    if run.remote is not None:
        metrics["heldout_measured"] = (
            "split inference over TLS (the capture pass, defences as deployed)"
            if post is not None
            else "not on the client: in a plain split the loss stays on the server (its server_log.json)"
        )
    return metrics


def _all_local(run: SplitRun) -> dict[str, Any]:
    """The all-local baseline: the pristine model trained whole on the same steps, and its held-out utility.
    The split phase (its model, the server's replicas and optimisers, the client's record) is freed first."""
    run.end.stage = "all-local baseline"
    assert run.pristine is not None
    config, docs, progress, answer_only = run.config, run.docs, run.progress, run.answer_only
    del run.split, run.lm
    run.server = run.server_logits = run.client_side = None
    gc.collect()
    base_lm = run.pristine()
    base_lm.model.to(run.dev)
    base = SplitModel(base_lm, depth=1)  # the cut is irrelevant: the whole model trains locally
    local_log = train_all_local(
        base, docs.train, seed=config.seed, steps=config.n_steps, lr=config.lr, progress=progress,
        answer_only=answer_only,
    )  # fmt: skip
    local = utility(
        evaluate_ce(base, docs.evaluation, progress=progress, name="all-local loss", answer_only=answer_only)
    )
    measured = {
        "all_local_ce": local["ce"],
        "all_local_perplexity": local["perplexity"],
        "delta_u": None if run.post is None else run.post["ce"] - local["ce"],
        "all_local_train_tokens_per_second": local_log.as_dict()["tokens_per_second"],
    }
    run.store.add_json("all-local", "all_local.json", local_log.as_dict())
    return measured


def gradient_utility_summary(raw: torch.Tensor, sent: torch.Tensor) -> dict[str, Any]:
    """Gradient Mirage's utility metrics (003 App. C.1) of the output gradient sent against the raw one (of
    the full loss, before any defence), per document and their means. An ASNR is null (JSON has no
    infinity) where the document was sent unchanged."""
    # lazy: splitleak.metrics loads scipy.stats (a second); only label-shielded runs score the gradient
    from splitleak.metrics.gradient_utility import gradient_utility

    per_doc = gradient_utility(raw, sent)
    finite = [{k: (v if math.isfinite(v) else None) for k, v in d.items()} for d in per_doc]
    keys = list(per_doc[0]) if per_doc else []
    mean = {k: float(np.mean([d[k] for d in per_doc])) for k in keys}
    return {
        "against": "the raw output gradient of the full loss",
        "mean": {k: (v if math.isfinite(v) else None) for k, v in mean.items()},
        "per_doc": finite,
    }


DRAWS_FILE = "client/draws.json"
DRAWS_NOTE = (
    "the client's own record: the 128-bit secret that keyed its random draws on the wire (draws=os); it never "
    "crossed, and no attack reads it (a positive control may, to show what the draws hid)"
)


def draws_secret(config: TrainConfig, point: ResumePoint | None = None) -> bytes | None:
    """The secret that keys the client's draws: None under ``draws="derived"`` (the run seed keys them), the
    resumed run's under ``--resume``, else 16 fresh bytes of OS entropy."""
    if config.draws == "derived":
        return None
    if point is not None:
        kept = point.record.get("draws_secret")
        if not isinstance(kept, str) or len(kept) != 32:
            raise ConfigError(
                "the checkpoint keeps no secret of the client's draws; it cannot be resumed under draws=os"
            )
        return bytes.fromhex(kept)
    return seeds.entropy(16)


def read_draws_secret(run_dir: str | Path) -> bytes | None:
    """The client's secret of a run made under ``draws="os"`` (for positive controls), or None."""
    path = Path(run_dir) / DRAWS_FILE
    if not path.is_file():
        return None
    return bytes.fromhex(read_run_json(run_dir, DRAWS_FILE)["secret"])


def read_metrics(run_dir: str | Path) -> dict[str, Any]:
    return read_run_json(run_dir, "metrics.json")
