"""What crosses the split, and only that: frames, channels, the tap, declarations, the transports and
the TLS client. Where it is written and read back (the run directory, its journal and captures) is
``splitleak.runs``; the defences that transform it, the decoy system's gauges and decoys included,
are ``splitleak.defences``."""

from splitleak.wire.channel import Channel, Crossing, InProcessChannel
from splitleak.wire.declare import ChannelDecl, Declaration, declare_channels, frame_channels
from splitleak.wire.frames import Frame, check_finite, decode, encode
from splitleak.wire.tap import RunSink, WireRecorder

__all__ = [
    "Channel",
    "ChannelDecl",
    "Crossing",
    "Declaration",
    "Frame",
    "InProcessChannel",
    "RunSink",
    "WireRecorder",
    "check_finite",
    "declare_channels",
    "decode",
    "encode",
    "frame_channels",
]
