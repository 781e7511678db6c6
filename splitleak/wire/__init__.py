"""What crosses the split: frames, defences, channels, and the verifiable capture store."""

from splitleak.wire.captures import Capture, capture_shards, load_capture
from splitleak.wire.channel import Channel, InProcessChannel
from splitleak.wire.defences import (
    DEFENCES,
    Defence,
    DefenceChain,
    WireContext,
    build_defence,
    clip_per_document,
    parse_defence_args,
    quantize_symmetric,
)
from splitleak.wire.frames import Frame, check_finite, decode, encode
from splitleak.wire.store import RunStore, VerifyResult, config_hash, read_tensors, verify_run

__all__ = [
    "DEFENCES",
    "Capture",
    "Channel",
    "Defence",
    "DefenceChain",
    "Frame",
    "InProcessChannel",
    "RunStore",
    "VerifyResult",
    "WireContext",
    "build_defence",
    "capture_shards",
    "check_finite",
    "clip_per_document",
    "config_hash",
    "decode",
    "encode",
    "load_capture",
    "parse_defence_args",
    "quantize_symmetric",
    "read_tensors",
    "verify_run",
]
