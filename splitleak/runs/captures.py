"""Captured traffic of a run: what crossed the wire, per document, read back verified.

The tap (``splitleak.wire.tap``) records whole frames; ``load_capture`` reads one phase (``capture``:
the evaluation documents sent once with frozen weights; ``train``: one frame per training step) on
one link, groups its frames into exchanges (a forward frame and the frames that answer it,
``exchanges``) and splits every frame's rows into its channels, one row per document
(``stack_channel``):

- ``activations`` / ``gradients``: the document rows of the forward frames and of their returned
  gradients, after the defences (what crossed);
- ``probe_activations`` / ``probe_gradients``: mixup's probe rows (decoys), paired with the
  documents by frame position; ``probe_present`` marks the documents whose frame carried them;
- ``trunk_output`` / ``output_gradients``: the U-shape's second crossing;
- ``steps``: the training step of each document's frame (-1 in the capture pass); the client
  weights that produced it are those after that many steps.

The training phase of a resumed run is read whole by default: the frames of the runs it continues
before the step it resumed from, then its own (``splitleak.runs.chain``); ``whole=False`` reads only
the run's own frames.

Run directories written before the tap recorded whole frames (journal kind ``captures``) still read,
with the forward and backward document rows only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from splitleak.errors import IntegrityError, NonFiniteError
from splitleak.runs.chain import read_wire_whole
from splitleak.runs.journal import journal_entries, read_tensors
from splitleak.runs.wire import WireRecord, read_wire, wire_phases


@dataclass
class Capture:
    doc_ids: torch.Tensor  # [n]
    activations: torch.Tensor  # [n, T, d]
    gradients: torch.Tensor | None  # [n, T, d]; None where no gradient crosses (top-only training)
    mask: torch.Tensor  # [n, T]
    steps: torch.Tensor | None = None  # [n]
    probe_activations: torch.Tensor | None = None  # [n, T, d]
    probe_gradients: torch.Tensor | None = None
    probe_present: torch.Tensor | None = None  # [n] bool
    trunk_output: torch.Tensor | None = None
    output_gradients: torch.Tensor | None = None
    phase: str = "capture"
    link: str = "main"
    frames: torch.Tensor | None = None  # [n]: the index of the frame (exchange) each row crossed in

    def __len__(self) -> int:
        return int(self.doc_ids.numel())


def capture_shards(run_dir: str | Path) -> list[str]:
    """Shards of the legacy capture format (journal kind ``captures``)."""
    shards = []
    for entry in journal_entries(run_dir):
        if entry.get("kind") == "captures":
            shards.extend(sorted(entry["files"]))
    return shards


def _declares_gradient(run_dir: str | Path) -> bool:
    """Whether the run's manifest declares a returned gradient (every mode but top-only training does)."""

    try:
        channels = json.loads((Path(run_dir) / "manifest.json").read_text())["channels"]["channels"]
    except (OSError, ValueError, KeyError, TypeError):
        return True  # no readable declaration: expect the gradient, as every older run has it
    return any(c.get("name") == "gradient" for c in channels)


def load_capture(run_dir: str | Path, phase: str = "capture", link: str | None = None, whole: bool = True) -> Capture:
    """One phase of a run's recorded wire on one link (default: ``main``, or the first replica),
    every shard checked against its journal hash; with ``whole``, a resumed run's training phase with the
    frames of the runs it continues (``read_wire_whole``)."""
    phases = wire_phases(run_dir)
    if not phases:
        legacy = capture_shards(run_dir)
        if legacy and phase == "capture" and link in (None, "main"):
            parts = [read_tensors(run_dir, rel) for rel in legacy]
            cat = lambda k: torch.cat([p[k] for p in parts])  # noqa: E731
            return Capture(cat("doc_ids"), cat("activations"), cat("gradients"), cat("mask"))
        raise IntegrityError(f"{run_dir} holds no recorded traffic; the run failed or was stopped before capture")
    if phase not in phases:
        raise IntegrityError(f"{run_dir} recorded no {phase!r} traffic (it has: {', '.join(phases)})")
    records = read_wire_whole(run_dir, phase) if whole else read_wire(run_dir, phase)
    links = links_of(records)
    link = link or ("main" if "main" in links else links[0])
    if link not in links:
        raise IntegrityError(f"{run_dir} has no link {link!r} in its {phase} traffic (links: {', '.join(links)})")
    exs = exchanges(records, link)
    if not exs:
        raise IntegrityError(f"{run_dir} recorded no forward frame on link {link} in phase {phase}")
    n_docs = [ex.forward.header["channels"]["activations"][1] for ex in exs]
    doc_ids = torch.tensor(
        [i for ex, n in zip(exs, n_docs) for i in ex.forward.header["row_ids"][:n]], dtype=torch.long
    )
    steps = torch.tensor([ex.forward.header["step"] for ex, n in zip(exs, n_docs) for _ in range(n)], dtype=torch.long)
    mask = torch.cat([ex.forward.frame.mask[:n] for ex, n in zip(exs, n_docs)])
    act, _ = stack_channel(exs, "forward", "activations", n_docs)
    assert act is not None  # every forward frame carries the activations channel
    grad, have_grad = stack_channel(exs, "backward", "gradient", n_docs)
    if grad is None and not _declares_gradient(run_dir):
        pass  # label-shielded top-only training: no gradient crosses, and the run declares none
    elif grad is None or have_grad is None or not bool(have_grad.all()):
        raise IntegrityError(f"{run_dir}: a forward frame on link {link} ({phase}) has no returned gradient")
    probe, present = stack_channel(exs, "forward", "probe-activations", n_docs)
    probe_g, _ = stack_channel(exs, "backward", "probe-gradient", n_docs)
    trunk, _ = stack_channel(exs, "forward-return", "trunk-output", n_docs)
    out_g, _ = stack_channel(exs, "backward-top", "output-gradient", n_docs)
    frames = torch.repeat_interleave(torch.arange(len(exs)), torch.tensor(n_docs, dtype=torch.long))
    for name, t in (("activations", act), ("gradients", grad), ("trunk outputs", trunk), ("output gradients", out_g)):
        if t is not None and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise NonFiniteError(
                f"{run_dir}: the recorded {phase} {name} on link {link} hold NaN or Inf, which never cross (both ends "
                f"refuse non-finite frames): the capture was altered; run `splitleak verify {run_dir}`"
            )
    return Capture(doc_ids, act, grad, mask, steps, probe, probe_g, present, trunk, out_g, phase, link, frames)


@dataclass
class Exchange:
    """One forward frame and the frames that answer it, on one link."""

    forward: WireRecord
    replies: list[WireRecord]

    def reply(self, kind: str) -> WireRecord | None:
        return next((r for r in self.replies if r.header["kind"] == kind), None)


def exchanges(records: list[WireRecord], link: str) -> list[Exchange]:
    out: list[Exchange] = []
    for rec in records:
        if rec.header["link"] != link:
            continue
        if rec.header["kind"] == "forward":
            out.append(Exchange(rec, []))
        elif not out:
            raise IntegrityError(f"a {rec.header['kind']!r} frame on link {link} precedes every forward frame")
        else:
            out[-1].replies.append(rec)
    return out


def links_of(records: list[WireRecord]) -> list[str]:
    return sorted({r.header["link"] for r in records})


def stack_channel(
    exs: list[Exchange], kind: str, channel: str, rows_per_exchange: list[int] | None = None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One channel's rows concatenated over exchanges, and a bool mask of the exchanges' rows that
    carry it. Where an exchange does not carry the channel (mixup's unmixed warm-up steps carry no
    probe rows) its rows are zero and the mask False; ``rows_per_exchange`` gives their count (the
    document rows of each exchange). Returns (None, None) when no exchange carries it."""
    parts: list[torch.Tensor | None] = []
    present: list[torch.Tensor] = []
    any_found = False
    for i, ex in enumerate(exs):
        rec = ex.forward if kind == "forward" else ex.reply(kind)
        rows = None if rec is None else rec.rows(channel)
        n = rows_per_exchange[i] if rows_per_exchange is not None else (0 if rows is None else rows.shape[0])
        if rows is None:
            parts.append(None)
            present.append(torch.zeros(n, dtype=torch.bool))
            continue
        if rows.shape[0] != n:
            raise IntegrityError(
                f"channel {channel} carries {rows.shape[0]} rows in an exchange of {n} documents; "
                "its rows cannot be paired with the documents by position"
            )
        any_found = True
        parts.append(rows)
        present.append(torch.ones(n, dtype=torch.bool))
    if not any_found:
        return None, None
    like = next(p for p in parts if p is not None)
    full = [
        p if p is not None else like.new_zeros((n, *like.shape[1:]))
        for p, n in zip(parts, [m.numel() for m in present])
    ]
    return torch.cat(full), torch.cat(present)
