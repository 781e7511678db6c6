"""Captured traffic of a run: what an observer at the split recorded, read back verified.

Shards ``captures/shard-NNNNN.safetensors`` hold ``activations`` and ``gradients``
``[docs, tokens, width]`` (after the defence: what crossed the wire), ``mask`` ``[docs, tokens]``
and ``doc_ids`` ``[docs]``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from splitleak.errors import IntegrityError
from splitleak.wire.store import JOURNAL, read_tensors


@dataclass
class Capture:
    doc_ids: torch.Tensor  # [n]
    activations: torch.Tensor  # [n, T, d]
    gradients: torch.Tensor  # [n, T, d]
    mask: torch.Tensor  # [n, T]

    def __len__(self) -> int:
        return int(self.doc_ids.numel())


def capture_shards(run_dir: str | Path) -> list[str]:
    root = Path(run_dir)
    if not (root / JOURNAL).is_file():
        raise IntegrityError(f"{root} has no {JOURNAL}; pass a run directory written by `splitleak train`")
    shards = []
    for raw in (root / JOURNAL).read_bytes().splitlines():
        entry = json.loads(raw)
        if entry.get("kind") == "captures":
            shards.extend(sorted(entry["files"]))
    return shards


def load_capture(run_dir: str | Path) -> Capture:
    """All capture shards of a run, each checked against its journal hash."""
    shards = capture_shards(run_dir)
    if not shards:
        raise IntegrityError(f"{run_dir} holds no captures; the run failed or was stopped before capture")
    parts = [read_tensors(run_dir, rel) for rel in shards]
    cat = lambda k: torch.cat([p[k] for p in parts])  # noqa: E731
    return Capture(cat("doc_ids"), cat("activations"), cat("gradients"), cat("mask"))
