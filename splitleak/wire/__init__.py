"""What crosses the split: frames, defences, channels, and the verifiable capture store."""

from splitleak.wire.captures import Capture, capture_shards, load_capture
from splitleak.wire.channel import Channel, Crossing, InProcessChannel
from splitleak.wire.declare import ChannelDecl, Declaration, declare_channels, frame_channels
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
from splitleak.wire.tap import WireRecorder, check_wire, read_wire, wire_phases

__all__ = [
    "DEFENCES",
    "Capture",
    "Channel",
    "ChannelDecl",
    "Crossing",
    "Declaration",
    "Defence",
    "DefenceChain",
    "Frame",
    "InProcessChannel",
    "RunStore",
    "VerifyResult",
    "WireContext",
    "WireRecorder",
    "build_defence",
    "capture_shards",
    "check_wire",
    "check_finite",
    "clip_per_document",
    "config_hash",
    "declare_channels",
    "decode",
    "encode",
    "frame_channels",
    "load_capture",
    "parse_defence_args",
    "quantize_symmetric",
    "read_tensors",
    "read_wire",
    "verify_run",
    "wire_phases",
]
