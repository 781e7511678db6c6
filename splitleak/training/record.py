"""What every run records about itself, in either split mode: its documents, the head of its manifest, its
result, and how its record ends whichever way the run ends (``RunEnd``). ``training.run`` (split runs) and
``training.latent_run`` (the decoy system's latent mode) both build on it, so neither imports the other's module
for it."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

import splitleak
from splitleak.data import DocumentSets, load_documents
from splitleak.models import LoadedModel
from splitleak.runs.store import RunStore
from splitleak.runtime import package_versions
from splitleak.training.config import TrainConfig
from splitleak.wire.declare import MESSAGES_FILE
from splitleak.wire.tap import WireRecorder

_log = logging.getLogger("splitleak.train")


@dataclass
class RunResult:
    run_dir: Path
    metrics: dict[str, Any]
    config: TrainConfig


def run_documents(config: TrainConfig, tokenizer) -> DocumentSets:
    return load_documents(
        config.data,
        tokenizer,
        seed=config.data_seed,
        n_calib=config.n_calib,
        n_train=config.n_train,
        n_eval=config.n_eval,
        doc_len=config.doc_len,
        data_path=config.data_path,
    )


def manifest_head(config: TrainConfig, lm: LoadedModel) -> dict[str, Any]:
    """The first fields of every run's manifest: version, time, configuration, packages, model."""
    return {
        "splitleak_version": splitleak.__version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": config.as_dict(),
        "config_hash": config.hash(),
        "packages": package_versions(),
        "model": {"name": lm.name, "source": lm.source, "fingerprint": lm.fingerprint(), **lm.info},
    }


def documents_record(docs: DocumentSets) -> dict[str, Any]:
    """The manifest's record of a run's documents."""
    return {
        "source": docs.source,
        "fingerprint": docs.fingerprint(),
        "n_calib": len(docs.calibration),
        "n_train": len(docs.train),
        "n_eval": len(docs.evaluation),
    }


class RunEnd:
    """How a run's record ends, whichever way the run ends. Everything ``run_training`` does after the
    run directory exists runs inside ``on_fault()``: whatever raises there (any Exception, a
    KeyboardInterrupt) closes the run as failed, its closing entry naming the ``stage`` it was in, the
    training steps done and the cause, and is then raised again. Before closing it records what the
    fault would otherwise leave unrecorded: the frames and ledger of a training phase still open, the
    training log, the session's messages (and drops the connection, so that the server closes its
    session as failed too). Nothing written before is removed, and each of these writes is tried on its
    own (a full disk may refuse some; the journal then ends at its last whole entry)."""

    def __init__(self, store: RunStore, log: Any, remote: Any = None, ledgers: Callable[[], list] | None = None):
        """``log``: the run's training log (``TrainLog``, or the latent mode's ``LatentLog``: ``doc_ids``,
        ``error``, ``as_dict``); ``ledgers``: what the training tap closes with (default ``log.ledgers``)."""
        self.store, self.log, self.remote = store, log, remote
        self.ledgers = ledgers if ledgers is not None else (lambda: log.ledgers)
        self.stage = "writing the manifest"
        self.train_tap: WireRecorder | None = None  # the training phase's tap, until its ledger is written
        self._trained = False  # training.json written
        self._messages = False  # messages.json written

    def record_training(self, record: dict[str, Any] | None = None) -> None:
        """The training phase's last frames and ledger, and ``training.json`` (once)."""
        if self.train_tap is not None:
            tap, self.train_tap = self.train_tap, None
            tap.close(self.ledgers())
        if not self._trained:
            self._trained = True
            self.store.add_json("training", "training.json", record if record is not None else self.log.as_dict())

    def record_messages(self) -> None:
        """Every envelope of the session, both ways (once)."""
        if self.remote is not None and not self._messages:
            self._messages = True
            self.store.add_json("messages", MESSAGES_FILE, self.remote.messages)

    @contextmanager
    def on_fault(self) -> Iterator[None]:
        try:
            yield
        except BaseException as exc:
            self.close_failed(exc)
            raise

    def close_failed(self, exc: BaseException) -> None:
        cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if self.remote is not None:
            self.remote.abort()
        if self.store.closed:
            return
        self.log.error = str(exc) or cause
        writes: list[tuple[str, Callable[[], None]]] = [("the session's messages", self.record_messages)]
        if self.train_tap is not None or self._trained:
            writes.insert(0, ("the training log", self.record_training))
        for what, write in writes:
            try:
                write()
            except Exception as err:  # noqa: BLE001 (a full disk, or the fault itself again): close all the same
                _log.warning("%s: %s not recorded (%s)", self.store.root, what, err)
        try:
            self.store.close(False, {"stage": self.stage, "steps_done": len(self.log.doc_ids), "error": cause})
        except Exception as err:  # noqa: BLE001 (the journal ends at its last whole entry: an unfinished run)
            _log.warning("%s: the failure could not be recorded (%s)", self.store.root, err)
