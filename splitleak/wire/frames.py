"""Frames: what crosses the split, and their byte encoding.

A frame carries its kind (see ``KINDS``), the training step (or -1 outside training), the document
ids of its rows, the tensor ``[docs, tokens, width]`` and the attention mask ``[docs, tokens]``.
In a plain split the forward frame also carries the labels (the token ids), because the server
computes the next-token loss; under partial offloading (U-shape) labels never leave the client.

``encode``/``decode`` give the bytes a transport sends: a safetensors blob whose metadata holds the
JSON header. No pickle anywhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from splitleak.errors import IntegrityError, NonFiniteError

# forward: client -> server activations at the observation point (what the attacker watches)
# backward: server -> client gradient with respect to those activations
# forward-return / backward-top: the second crossing of a U-shaped split (server output to the
#   client's top, and the gradient the client's top sends back)
KINDS = ("forward", "backward", "forward-return", "backward-top")
PHASES = ("train", "capture", "eval")


@dataclass
class Frame:
    kind: str
    step: int
    doc_ids: tuple[int, ...]
    tensor: torch.Tensor
    mask: torch.Tensor
    phase: str = "train"
    labels: torch.Tensor | None = None
    payload_bits: int = 32  # bits per element as encoded on the wire
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown frame kind {self.kind!r}; expected one of {KINDS}")
        if self.phase not in PHASES:
            raise ValueError(f"unknown frame phase {self.phase!r}; expected one of {PHASES}")
        if self.tensor.dim() != 3 or self.tensor.shape[0] != len(self.doc_ids):
            raise ValueError(
                f"frame tensor must be [docs, tokens, width] with one row per document id; got "
                f"shape {tuple(self.tensor.shape)} for {len(self.doc_ids)} document ids"
            )
        if tuple(self.mask.shape) != tuple(self.tensor.shape[:2]):
            raise ValueError(
                f"frame mask shape {tuple(self.mask.shape)} does not match tensor {tuple(self.tensor.shape[:2])}"
            )

    def wire_bytes(self) -> int:
        """Bytes this frame costs on the wire: payload at its encoding width, one float32 scale
        per document when quantised, the mask as bits, labels as int32."""
        n = self.tensor.numel()
        total = (n * self.payload_bits + 7) // 8
        if self.payload_bits < 32:
            total += 4 * len(self.doc_ids)
        total += (self.mask.numel() + 7) // 8
        if self.labels is not None:
            total += 4 * self.labels.numel()
        return total

    def check_finite(self, where: str) -> None:
        check_finite(self.tensor, f"{self.kind} frame at {where}")


def check_finite(t: torch.Tensor, what: str, hint: str = "") -> None:
    if not torch.isfinite(t).all():
        bad = int((~torch.isfinite(t)).sum())
        raise NonFiniteError(f"{what}: {bad} non-finite value(s) (NaN or Inf){hint}")


def encode(frame: Frame) -> bytes:
    header = {
        "kind": frame.kind,
        "step": frame.step,
        "phase": frame.phase,
        "doc_ids": list(frame.doc_ids),
        "payload_bits": frame.payload_bits,
        "meta": frame.meta,
    }
    tensors = {"tensor": frame.tensor.detach().cpu().contiguous(), "mask": frame.mask.cpu().contiguous()}
    if frame.labels is not None:
        tensors["labels"] = frame.labels.cpu().contiguous()
    return st_save(tensors, metadata={"frame": json.dumps(header, sort_keys=True)})


def decode(blob: bytes) -> Frame:
    """The frame ``encode`` wrote, or an IntegrityError in one line for bytes that are not one (not
    safetensors, no frame header, a header field missing or of the wrong type, an unknown kind)."""
    try:
        tensors = st_load(blob)
        header = json.loads(_metadata(blob)["frame"])
        return Frame(
            kind=header["kind"],
            step=header["step"],
            doc_ids=tuple(header["doc_ids"]),
            tensor=tensors["tensor"],
            mask=tensors["mask"],
            phase=header["phase"],
            labels=tensors.get("labels"),
            payload_bits=header["payload_bits"],
            meta=header["meta"],
        )
    except Exception as exc:  # noqa: BLE001 (safetensors, JSON, a missing key or a refused field alike)
        why = (str(exc).splitlines() or [""])[0][:200]
        raise IntegrityError(f"cannot decode a frame ({type(exc).__name__}: {why}); the message is corrupt") from None


def _metadata(blob: bytes) -> dict[str, str]:
    n = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + n].decode("utf-8")).get("__metadata__", {})
