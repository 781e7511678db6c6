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

``joint-crossings`` does the same with ``joint-aware``, for noise on the returned gradient (its read-out reads the
mean of a document's returned gradients). ``gma-sl-crossings`` does the same for label-shielded fine-tuning: ``gma-sl-aware`` on the mean of a
document's trunk outputs and of the output gradients its client returned for them (seq-dp draws its noise
fresh for each).

It reads only what the threat model grants: the frame headers (which rows are one document's, public to
the server), the public copy and the chain's declared arguments. On traffic where each document crossed once
(the capture pass) it is ``activation-aware``, bit for bit. Read it on the training traffic
(``--phase train``), where the passes are.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from splitleak.attacks.aware import AwareActivationBeam
from splitleak.attacks.base import Reconstruction
from splitleak.attacks.gma_aware import AwareGMASL
from splitleak.attacks.joint_aware import AwareJointBeam
from splitleak.attacks.knowledge import Traffic


def crossing_groups(doc_ids: tuple[int, ...]) -> tuple[tuple[int, ...], list[list[int]]]:
    """The documents in order of first crossing, and the rows of each."""
    rows: dict[int, list[int]] = {}
    for i, d in enumerate(doc_ids):
        rows.setdefault(int(d), []).append(i)
    return tuple(rows), list(rows.values())


def combine_crossings(traffic: Traffic) -> tuple[Traffic, list[list[int]]]:
    """One row per document: the mean of its activation rows (and of its returned gradients, and of a U-shape's
    trunk output and output gradient, where they cross), in float64 and back to the traffic's dtype; one frame
    per document (a training step's frame holds one document); the rows of each document in the input."""
    docs, groups = crossing_groups(traffic.doc_ids)

    def mean(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return torch.stack([t[g].double().mean(0) for g in groups]).to(t.dtype)

    steps = None if traffic.steps is None else tuple(max(traffic.steps[i] for i in g) for g in groups)
    act = mean(traffic.activations)
    assert act is not None
    combined = Traffic(
        docs, act, mean(traffic.gradients), trunk_output=mean(traffic.trunk_output),
        output_gradients=mean(traffic.output_gradients), steps=steps, phase=traffic.phase,
    )  # fmt: skip
    return combined, groups


#: list-valued outputs that hold one value per document (GMA-SL's final distances)
PER_DOCUMENT_LISTS = ("distance",)


def _spread(key: str, value: Any, index: torch.Tensor) -> Any:
    """A per-document output back on the crossing rows: tensors whose first axis is the documents, and the
    lists ``PER_DOCUMENT_LISTS`` names; anything else (a summary, steps per chunk) as it is."""
    if isinstance(value, torch.Tensor) and value.dim() >= 1:
        return value[index]
    if key in PER_DOCUMENT_LISTS and isinstance(value, list):
        return [value[int(i)] for i in index]
    return value


def read_every_crossing(read: Callable[[Traffic], Reconstruction], traffic: Traffic) -> Reconstruction:
    """``read`` (a one-crossing reader's reconstruct) on the mean of each document's crossings, its reading given
    back to every crossing row; ``read(traffic)`` itself where every document crossed once."""
    combined, groups = combine_crossings(traffic)
    if len(groups) == len(traffic):  # every document crossed once: the one-crossing reading, as it is
        return read(traffic)
    rec = read(combined)
    index = torch.empty(len(traffic), dtype=torch.long)
    for j, g in enumerate(groups):
        index[g] = j
    counts = [len(g) for g in groups]
    extra = {k: _spread(k, v, index) for k, v in rec.extra.items()}
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


class CrossingsAware(AwareActivationBeam):
    """``activation-aware`` on the mean of each document's crossings (module docstring)."""

    name = "crossings-aware"

    def reconstruct(self, traffic, progress=None):
        self._check(traffic)
        return read_every_crossing(lambda t: AwareActivationBeam.reconstruct(self, t, progress), traffic)


class CrossingsJoint(AwareJointBeam):
    """``joint-aware`` on the mean of each document's crossings: the activations and the gradients returned for
    them, whose fresh noise (clip-noise on the return wire, quant4-noisy's) the mean divides by √R, so that the
    gradient read-out has more to read than in any one crossing."""

    name = "joint-crossings"

    def reconstruct(self, traffic, progress=None):
        self._check(traffic)
        return read_every_crossing(lambda t: AwareJointBeam.reconstruct(self, t, progress), traffic)


class CrossingsGMASL(AwareGMASL):
    """``gma-sl-aware`` on the mean of each document's crossings: the trunk outputs and the output gradients
    of its passes (seq-dp's fresh noise on each divided by √R), matched as one frame of one document."""

    name = "gma-sl-crossings"

    def reconstruct(self, traffic, progress=None):
        return read_every_crossing(lambda t: AwareGMASL.reconstruct(self, t, progress), traffic)
