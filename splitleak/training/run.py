"""One run end to end: load, split-train over the wire, measure utility, capture, record.

Everything that can be checked is checked before the run directory is created (configuration,
model, documents, split), so bad input writes nothing.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from splitleak.defences import DefenceChain
from splitleak.errors import ConfigError
from splitleak.models import LoadedModel, SplitModel, load_model
from splitleak.progress import Progress, Silent
from splitleak.runs.journal import read_run_json
from splitleak.runs.store import RunStore
from splitleak.runtime import apply_threads, resolve_device
from splitleak.seeds import model_init_seed, server_seed
from splitleak.training.checkpoint import CheckpointDir, state_tensors
from splitleak.training.config import ServerConfig, TrainConfig
from splitleak.training.loop import TrainLog, capture_traffic, evaluate_ce, train_all_local, train_split, utility
from splitleak.training.record import RunEnd, RunResult, documents_record, manifest_head, run_documents
from splitleak.training.replicas import build_server
from splitleak.wire.declare import declare_channels
from splitleak.wire.tap import WireRecorder
from splitleak.wire.transport import TransportError

_log = logging.getLogger("splitleak.train")


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
        from splitleak.training.latent import run_latent

        return run_latent(
            config, out, force=force, device=device, threads=threads, progress=progress, lm=lm, connect=connect,
            tls_dir=tls_dir, checkpoint_every=checkpoint_every, resume=resume,
        )  # fmt: skip
    progress = progress or Silent()
    apply_threads(threads)
    dev = resolve_device(device)
    if pristine is None and lm is None:

        def pristine() -> LoadedModel:
            return load_model(
                config.model,
                precision=config.precision,
                seed=model_init_seed(config.seed),
                model_path=config.model_path,
            )

    if (resume is not None or checkpoint_every is not None) and connect is None:
        raise ConfigError("checkpoints and --resume are for a deployment: pass --connect and --tls-dir")
    point = None if resume is None else resume_point(resume, config)
    secret = draws_secret(config, point)
    chain_client = DefenceChain.from_specs([d.model_dump() for d in config.defences], config.seed, secret)
    chain_server = DefenceChain.from_specs([d.model_dump() for d in config.defences], server_seed(config.seed))
    if lm is None:
        lm = load_model(
            config.model, precision=config.precision, seed=model_init_seed(config.seed), model_path=config.model_path
        )
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
        from splitleak.training.loop import supervision

        supervision(docs.train + docs.evaluation, True)  # refuses documents without an answer, before writing
    if config.all_local_baseline and pristine is None:
        assert lm is not None
        kept = lm.clone()
        pristine = lambda: kept  # noqa: E731
    remote = None
    if checkpoint_every is not None and checkpoint_every < 1:
        raise ConfigError(f"--checkpoint-every must be >= 1, got {checkpoint_every}")
    not_resumable = None
    if checkpoint_every is not None and chain_client.client_transform is not None:
        not_resumable = f"defence {chain_client.client_transform.name!r} keeps client state across steps"
        checkpoint_every = None
    if connect is not None:
        from splitleak.wire.client import RemoteServer, hello_for, parse_address

        if tls_dir is None:
            raise ConfigError("--connect needs --tls-dir (the folder `splitleak tls init` wrote)")
        RunStore.check_out(out, force, keep=resume)  # the same refusals as below, before any connection
        host, port = parse_address(connect)
        server_config = ServerConfig.of(config, random_init="init_seed" in lm.info)
        hello = hello_for(
            server_config.as_dict(),
            lm.fingerprint(),
            split.spec.as_dict(),
            chain_client.describe(),
            checkpoint_every=checkpoint_every,
            resume=None if point is None else {"token": point.token, "done": point.done},
        )
        remote = RemoteServer(host, port, tls_dir, hello)
        if point is not None and remote.welcome.get("resumed_after_steps") != point.done:
            remote.abort()
            raise TransportError(f"the server did not resume after step {point.done}")
        if checkpoint_every is not None and remote.welcome.get("checkpoint_every") is None:
            not_resumable = "the server keeps no checkpoints (start it with --checkpoints DIR)"
            checkpoint_every = None

    try:
        store = RunStore.create(out, force=force, keep=resume)
    except BaseException:
        if remote is not None:
            remote.abort()  # the server closes its session as failed
        raise
    log = TrainLog()
    if point is not None:
        log.losses, log.doc_ids = list(point.record["losses"]), list(point.record["doc_ids"])
    end = RunEnd(store, log, remote)
    with end.on_fault():  # from here on the run ends closed, whatever raises
        manifest = {
            **manifest_head(config, lm),
            "split": split.spec.as_dict(),
            "defences": chain_client.describe(),
            "documents": documents_record(docs),
            "runtime": {"device": str(dev), "threads": torch.get_num_threads()},
            "labels_cross_wire": not split.spec.u_shape,
            "channels": declaration.as_dict(),
        }
        if remote is not None:
            manifest["transport"] = {
                "server": remote.where,
                "kind": "websockets over mutual TLS 1.3",
                "server_config_hash": server_config.hash(),
            }
            manifest["checkpoints"] = {"every": checkpoint_every, "not_resumable": not_resumable}
            if point is not None:
                manifest["resumed_from"] = {
                    "run": str(resume),
                    "after_steps": point.done,
                    "checkpoint_sha256": point.sha256,
                    "note": "the train-phase capture holds the frames from the resumed step on; the frames before "
                    "it are in the capture of the run named here",
                }
        store.add_json("manifest", "manifest.json", manifest)
        store.add_json("documents", "documents.json", docs.to_json())
        if secret is not None:
            store.add_json("client-draws", DRAWS_FILE, {"secret": secret.hex(), "note": DRAWS_NOTE})

        end.stage = "pretrained loss"
        pre = utility(
            evaluate_ce(split, docs.evaluation, progress=progress, name="pretrained loss", answer_only=answer_only)
        )
        server = remote if remote is not None else build_server(chain_server, split, config.lr)  # None: one ServerRole
        server_logits = getattr(server, "median_logits", None)
        on_step = None
        if checkpoint_every is not None:
            assert remote is not None
            folder = CheckpointDir(checkpoint_folder(out), keep=1)
            token = remote.welcome["token"]

            def on_step(done: int, client) -> None:
                if done % checkpoint_every or done >= config.n_steps:
                    return
                tensors, record = state_tensors(client.params, client.opt)
                record.update(config_hash=config.hash(), token=token, losses=log.losses, doc_ids=log.doc_ids)
                if secret is not None:
                    record["draws_secret"] = secret.hex()
                # recorded in the journal once whole, and only then is the previous one deleted: a kill at any
                # point leaves a checkpoint that the journal vouches for (what --resume trusts)
                path, sha = folder.save(done, tensors, record, prune=False)
                store.add("checkpoint", None, {"done": done, "file": path.name, "sha256": sha})
                folder.prune()

        # the tap: every frame of the training steps and of the capture pass, recorded as it crossed
        end.stage = "training"
        train_tap = end.train_tap = WireRecorder(store, "train", declaration)
        train_split(
            split,
            docs.train,
            chain_client,
            chain_server,
            seed=config.seed,
            steps=config.n_steps,
            lr=config.lr,
            progress=progress,
            log=log,
            server=server,
            taps=[train_tap],
            start=0 if point is None else point.done,
            client_state=None if point is None else (point.tensors, point.record),
            on_step=on_step,
        )
        train_record = log.as_dict()
        if server is not None and hasattr(server, "flag_log"):
            train_record["replica_flags"] = list(server.flag_log)
        end.record_training(train_record)
        post: dict[str, Any] | None = None
        if remote is None:
            end.stage = "held-out loss"
            post = utility(
                evaluate_ce(
                    split, docs.evaluation, progress=progress, server_logits=server_logits, answer_only=answer_only
                )
            )

        end.stage = "capture"
        capture_tap = WireRecorder(store, "capture", declaration)
        client_side: dict[str, list[torch.Tensor]] | None = {} if split.spec.label_shielded else None
        cap, ledgers = capture_traffic(
            split,
            docs.evaluation,
            chain_client,
            chain_server,
            batch=config.capture_batch,
            taps=[capture_tap],
            progress=progress,
            server=server,
            client_side=client_side,
        )
        capture_tap.close(ledgers)
        if remote is not None:
            end.stage = "closing the session"
            remote.close()  # the server closes its capture
            end.record_messages()
            client_losses = cap.pop("client_losses")
            post = None if client_losses is None else utility(np.asarray(client_losses, dtype=np.float64))
        end.stage = "writing the client's records"
        for d in chain_client.defences:
            record = getattr(d, "client_record", None)
            if record is not None:  # the client's own record (mixup: where each decoy came from); it never crosses
                rel, obj = record()
                store.add_json("client-record", rel, obj)
        if client_side:  # label-shielded: the output gradient before and after the defences, kept by the client
            raw, sent = torch.cat(client_side["raw"]), torch.cat(client_side["sent"])
            store.add_tensors(
                "client-record",
                "shielded/output_gradients.safetensors",
                {"raw": raw.contiguous(), "sent": sent.contiguous()},
                {"phase": "capture", "note": "never crosses: the client's own copy, for the gradient-utility metrics"},
            )
            cap["gradient_utility"] = gradient_utility_summary(raw, sent)
        end.stage = "writing the client layers"
        store.add_tensors(
            "client-layers",
            "client_layers.safetensors",
            split.client_state_dict(),
            {"cut": split.spec.cut},
            metadata={"model": lm.name, "cut": split.spec.cut, "config_hash": config.hash()},  # bound to this run
        )

        metrics: dict[str, Any] = {
            "heldout_ce": None if post is None else post["ce"],
            "perplexity": None if post is None else post["perplexity"],
            "pretrained_ce": pre["ce"],
            "pretrained_perplexity": pre["perplexity"],
            "wire_bytes_per_step": log.bytes_per_step,
            "train_tokens_per_second": log.as_dict()["tokens_per_second"],
            "capture": cap,
        }
        if server is not None and hasattr(server, "flag_log"):
            metrics["replica_flagged_messages"] = sum(1 for f in server.flag_log if f["flagged"])
            metrics["replica_max_deviation"] = max((max(f["deviation"]) for f in server.flag_log), default=0.0)
        if config.all_local_baseline:
            end.stage = "all-local baseline"
            assert pristine is not None
            # free the split phase first (its model, the server's replicas and optimisers, the client's record)
            del split
            lm = server = server_logits = client_side = None
            gc.collect()
            base_lm = pristine()
            base_lm.model.to(dev)
            base = SplitModel(base_lm, depth=1)  # the cut is irrelevant: the whole model trains locally
            local_log = train_all_local(
                base,
                docs.train,
                seed=config.seed,
                steps=config.n_steps,
                lr=config.lr,
                progress=progress,
                answer_only=answer_only,
            )
            local = utility(
                evaluate_ce(base, docs.evaluation, progress=progress, name="all-local loss", answer_only=answer_only)
            )
            metrics.update(
                {
                    "all_local_ce": local["ce"],
                    "all_local_perplexity": local["perplexity"],
                    "delta_u": None if post is None else post["ce"] - local["ce"],
                    "all_local_train_tokens_per_second": local_log.as_dict()["tokens_per_second"],
                }
            )
            store.add_json("all-local", "all_local.json", local_log.as_dict())
        else:
            metrics.update({"all_local_ce": None, "all_local_perplexity": None, "delta_u": None})
        if remote is not None:
            metrics["heldout_measured"] = (
                "split inference over TLS (the capture pass, defences as deployed)"
                if post is not None
                else "not on the client: in a plain split the loss stays on the server (its server_log.json)"
            )
        end.stage = "writing metrics"
        store.add_json("metrics", "metrics.json", metrics)
        store.close(True, {"config_hash": config.hash()})
    if checkpoint_every is not None:
        shutil.rmtree(checkpoint_folder(out), ignore_errors=True)  # the run is whole: nothing to resume
    return RunResult(Path(out), metrics, config)


def gradient_utility_summary(raw: torch.Tensor, sent: torch.Tensor) -> dict[str, Any]:
    """Gradient Mirage's utility metrics (003 App. C.1) of the output gradient sent against the raw one (of
    the full loss, before any defence), per document and their means. An ASNR is null (JSON has no
    infinity) where the document was sent unchanged."""
    import math

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


def checkpoint_folder(out: str | Path) -> Path:
    """Where a deployed run keeps its client checkpoints: beside the run directory, outside its journal."""
    return Path(f"{Path(out)}.checkpoints")


@dataclass
class ResumePoint:
    done: int
    token: str
    tensors: dict[str, torch.Tensor]
    record: dict[str, Any]
    sha256: str


DRAWS_FILE = "client/draws.json"
DRAWS_NOTE = (
    "the client's own record: the 128-bit secret that keyed its random draws on the wire (draws=os); it never "
    "crossed, and no attack reads it (a positive control may, to show what the draws hid)"
)


def draws_secret(config: TrainConfig, point: "ResumePoint | None" = None) -> bytes | None:
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
    return os.urandom(16)


def read_draws_secret(run_dir: str | Path) -> bytes | None:
    """The client's secret of a run made under ``draws="os"`` (for positive controls), or None."""
    path = Path(run_dir) / DRAWS_FILE
    if not path.is_file():
        return None
    return bytes.fromhex(read_run_json(run_dir, DRAWS_FILE)["secret"])


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
    from splitleak.files import sha256_file
    from splitleak.runs.journal import JOURNAL
    from splitleak.runs.verify import verify_run

    run = Path(run)
    again = "train again with --force (or another --out)"
    v = verify_run(run, to_last_entry=True)
    if not v.ok:
        raise ConfigError(f"{run} does not verify ({v.message}); it cannot be resumed: {again}")
    if v.status == "complete":
        raise ConfigError(f"{run} is complete; there is nothing to resume")
    m = read_run_json(run, "manifest.json")
    if m.get("config_hash") != config.hash():
        raise ConfigError(f"{run} was trained with another configuration ({m.get('config_hash', '?')[:12]})")
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


def read_metrics(run_dir: str | Path) -> dict[str, Any]:
    return read_run_json(run_dir, "metrics.json")
