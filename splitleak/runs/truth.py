"""The truth the scorer reads, and only the scorer: the documents of a run (the evaluation and training
text) and the latent mode's record of which gauged rows are real and which token each carries.

An attack never reads these: ``splitleak.attacks`` imports nothing from this module
(``tests/test_layout.py``), and its ``Knowledge`` carries only the calibration documents
(``splitleak.runs.manifest.read_calibration``). The metrics, the audit and the experiments compare an
attack's output with what is here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from safetensors.torch import load_file

from splitleak.data import Document, DocumentSets
from splitleak.errors import ConfigError, DataError, IntegrityError
from splitleak.runs.journal import read_run_json

#: the client's record of the latent mode's frames (real rows, the token each row carries); never crosses
TRUTH_FILE = "latent/truth.safetensors"


def read_documents(run_dir: str | Path) -> DocumentSets:
    data = read_run_json(run_dir, "documents.json")
    try:
        return DocumentSets.from_json(data)
    except DataError as exc:
        raise IntegrityError(
            f"{Path(run_dir) / 'documents.json'}: {exc}; run `splitleak verify {run_dir}`, or rerun `splitleak train`"
        ) from None


def phase_documents(run_dir: str | Path, phase: str = "capture") -> tuple[Document, ...]:
    """The documents whose traffic a phase carries: the evaluation set for ``capture``, the training
    set for ``train`` (for scoring only; never given to an attack)."""
    sets = read_documents(run_dir)
    if phase == "capture":
        return tuple(sets.evaluation)
    if phase == "train":
        return tuple(sets.train)
    raise ConfigError(f"unknown phase {phase!r}; use capture (evaluation documents) or train (the training steps)")


def eval_token_ids(run_dir: str | Path, doc_ids: Sequence[int], phase: str = "capture") -> np.ndarray:
    """The true token ids of a phase's documents, for scoring only (never given to an attack)."""
    docs = {d.doc_id: d for d in phase_documents(run_dir, phase)}
    return np.array([docs[i].token_ids for i in doc_ids], dtype=np.int64)


def load_truth(run_dir: str | Path) -> dict[int, np.ndarray]:
    """frame id -> bool mask of real rows in the gauged order (the client's record)."""
    path = Path(run_dir) / TRUTH_FILE
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no {TRUTH_FILE}: pass the client's run directory of a latent-mode run")
    t = load_file(str(path))
    frames, real = t["frames"].numpy(), t["real"].numpy()
    return {int(f[0]): real[i, : int(f[4])].astype(bool) for i, f in enumerate(frames)}


def load_row_tokens(run_dir: str | Path) -> dict[int, np.ndarray]:
    """frame id -> the token each gauged row carries (a decoy: its origin's), from the client's record."""
    t = load_file(str(Path(run_dir) / TRUTH_FILE))
    if "token" not in t:
        raise ConfigError(
            f"{run_dir}/{TRUTH_FILE} records no tokens per row (a run made before the probes existed); train it again"
        )
    frames, tokens = t["frames"].numpy(), t["token"].numpy()
    return {int(f[0]): tokens[i, : int(f[4])] for i, f in enumerate(frames)}
