"""What crosses the split: frames, channels, the tap, declarations and the verifiable capture store (the
defences that transform it are ``splitleak.defences``)."""

from splitleak.wire.captures import Capture, capture_shards, load_capture
from splitleak.wire.channel import Channel, Crossing, InProcessChannel
from splitleak.wire.declare import ChannelDecl, Declaration, declare_channels, frame_channels
from splitleak.wire.frames import Frame, check_finite, decode, encode
from splitleak.wire.store import RunStore, VerifyResult, config_hash, read_tensors, verify_run
from splitleak.wire.tap import WireRecorder, check_wire, read_wire, wire_phases

__all__ = [
    "Capture",
    "Channel",
    "ChannelDecl",
    "Crossing",
    "Declaration",
    "Frame",
    "InProcessChannel",
    "RunStore",
    "VerifyResult",
    "WireRecorder",
    "capture_shards",
    "check_wire",
    "check_finite",
    "config_hash",
    "declare_channels",
    "decode",
    "encode",
    "frame_channels",
    "load_capture",
    "read_tensors",
    "read_wire",
    "verify_run",
    "wire_phases",
]
