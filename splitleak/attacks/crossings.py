"""``crossings-aware``: the defence-aware activation attacker on every crossing of a document at once.

Fine-tuning sends each training document once per pass, each time with fresh noise, and the server sees
which rows are whose: every frame's header names its documents (``row_ids``). A reader of one crossing at a
time reads each under the whole noise; a reader that averages a document's R crossings reads their mean,
whose noise has std σ/√R around the mean of the clipped rows (the client's layers move a little between the
passes; the public copy, which the attacker emulates, is the same for all of them). So the attack groups the
traffic's rows by document, takes the mean of each document's activation rows, and reads it with
``activation-aware``'s search (candidates from the defended ridge map, the beam scored through the chain's
public forward and its Gaussian likelihood). Each crossing row is then given its document's reading, so
that its result pairs row for row with a one-crossing reader's on the same traffic; a report of documents
averages a document's rows (one reading, repeated).

It reads only what the threat model grants: the frame headers (which rows are one document's, public to
the server), the public copy and the chain's declared arguments. On traffic where each document crossed once
(the capture pass) it is ``activation-aware``, bit for bit. Read it on the training traffic
(``--phase train``), where the passes are.
"""

from __future__ import annotations

from typing import Any

import torch

from splitleak.attacks.aware import AwareActivationBeam
from splitleak.attacks.base import Reconstruction
from splitleak.attacks.knowledge import Traffic


def crossing_groups(doc_ids: tuple[int, ...]) -> tuple[tuple[int, ...], list[list[int]]]:
    """The documents in order of first crossing, and the rows of each."""
    rows: dict[int, list[int]] = {}
    for i, d in enumerate(doc_ids):
        rows.setdefault(int(d), []).append(i)
    return tuple(rows), list(rows.values())


def combine_crossings(traffic: Traffic) -> tuple[Traffic, list[list[int]]]:
    """One row per document: the mean of its activation rows (and of its returned gradients, where they
    cross), in float64 and back to the traffic's dtype; the rows of each document in the input."""
    docs, groups = crossing_groups(traffic.doc_ids)

    def mean(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return torch.stack([t[g].double().mean(0) for g in groups]).to(t.dtype)

    steps = None if traffic.steps is None else tuple(max(traffic.steps[i] for i in g) for g in groups)
    act = mean(traffic.activations)
    assert act is not None
    return Traffic(docs, act, mean(traffic.gradients), steps=steps, phase=traffic.phase), groups


def _spread(value: Any, index: torch.Tensor) -> Any:
    """A per-document output back on the crossing rows (tensors whose first axis is the documents)."""
    return value[index] if isinstance(value, torch.Tensor) and value.dim() >= 1 else value


class CrossingsAware(AwareActivationBeam):
    """``activation-aware`` on the mean of each document's crossings (module docstring)."""

    name = "crossings-aware"

    def reconstruct(self, traffic, progress=None):
        self._check(traffic)
        combined, groups = combine_crossings(traffic)
        if len(groups) == len(traffic):  # every document crossed once: the plain aware reading, as it is
            return super().reconstruct(traffic, progress)
        rec = super().reconstruct(combined, progress)
        index = torch.empty(len(traffic), dtype=torch.long)
        for j, g in enumerate(groups):
            index[g] = j
        counts = [len(g) for g in groups]
        extra = {k: _spread(v, index) for k, v in rec.extra.items()}
        summary = dict(extra.get("summary") or {})
        summary["crossings"] = {
            "documents": len(groups),
            "rows": len(traffic),
            "min": min(counts),
            "max": max(counts),
            "mean": sum(counts) / len(counts),
        }
        extra["summary"] = summary
        assert rec.tokens is not None
        return Reconstruction(rec.tokens[index], extra)
