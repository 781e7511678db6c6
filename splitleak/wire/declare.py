"""Declared channels: everything that crosses the split, by name (Politis & Pappas 2026, §3, Table 3).

A *channel* is one stream of information an observer on the untrusted side receives or sends:
the rows of a frame's tensor (document activations, mixup's probe rows, the returned gradient, the
U-shape's second crossing), the labels a plain split sends for the server's loss, the row ids and
metadata in each frame's header, the shapes, and the timing of the messages. Each split mode with
its defence chain *declares* its channels before the run (``declare_channels``); the tap names the
channels of every frame that crosses (``frame_channels``) and a crossing that no declaration names
stops the run with the channel named (``check_declared``).

Names are link-free (``activations``); under replica median each server copy has its own link
(``replica-0``, ...) and every channel exists once per link.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from splitleak.errors import UndeclaredChannelError
from splitleak.wire.frames import Frame

#: row channels of each frame kind: (channel of the document rows, channel of the probe rows)
ROW_CHANNELS = {
    "forward": ("activations", "probe-activations"),
    "backward": ("gradient", "probe-gradient"),
    "forward-return": ("trunk-output", None),
    "backward-top": ("output-gradient", None),
}


@dataclass(frozen=True)
class ChannelDecl:
    """One declared channel."""

    name: str
    direction: str  # "client->server" | "server->client" | "both"
    carries: str  # what it carries, in words
    shape: str  # its shape per frame, in words
    captured: bool = True  # whether the tap records it (timing is not recorded)
    note: str = ""
    recorded_in: str = ""  # a channel that is not a frame's: the run file that records it

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Declaration:
    """The channels of one split mode with its defence chain, and the links they cross on."""

    channels: tuple[ChannelDecl, ...]
    links: tuple[str, ...] = ("main",)
    notes: tuple[str, ...] = field(default_factory=tuple)

    def names(self) -> set[str]:
        return {c.name for c in self.channels}

    def as_dict(self) -> dict[str, Any]:
        return {"channels": [c.as_dict() for c in self.channels], "links": list(self.links), "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Declaration":
        return cls(tuple(ChannelDecl(**c) for c in d["channels"]), tuple(d["links"]), tuple(d.get("notes", ())))


#: the channel no tap records: when messages cross
TIMING = ChannelDecl(
    "timing",
    "both",
    "when each message crosses and how long the other side takes",
    "per message",
    captured=False,
    note="not recorded by the tap",
)

#: the file of a two-process run (client and server side alike) that records every message's envelope
MESSAGES_FILE = "wire/messages.json"


def declare_channels(
    *,
    u_shape: bool,
    defences: Iterable[Any] = (),
    transport: bool = False,
    gradients: bool = True,
    draws: str | None = None,
) -> Declaration:
    """The channels of a plain split (``u_shape`` False: labels cross for the server's loss) or a
    U-shape (partial offloading, label-shielded: the trunk's output comes back, the output gradient goes
    out), plus what each defence adds (``Defence.declare(channels)``) and the links (``Defence.links``).
    ``transport``: client and server are two processes (``splitleak.wire.client`` and ``splitleak.deploy``), so the
    handshake and every message's envelope cross too. ``gradients`` False: no gradient crosses in either
    direction (label-shielded top-only training). ``draws``: what keys the client's draws on the wire
    (``TrainConfig.draws``; None where the declaring side does not know it, as the server), named in the note
    of the row ids, which reveal the run seed."""
    seed_note = (
        "they reveal the training order, a function of the run seed, which also keys the client's draws on the "
        "wire if it ran with draws=derived (a run seed from a small range is then found by trying each)"
        if draws is None
        else "they reveal the training order, a function of the run seed, which also keys the client's "
        "forward-defence randomness (draws=derived): a run seed from a small range is found by trying each "
        "(the seed-search attack), and with it the noise; use draws=os, or a run seed drawn at random from 2^63"
        if draws == "derived"
        else "they reveal the training order, a function of the run seed; the client's draws on the wire are "
        "keyed by a per-run secret from OS entropy (draws=os), which no frame carries"
    )
    ch: list[ChannelDecl] = [
        ChannelDecl(
            "activations",
            "client->server",
            "activations at the observation point, one row per token of each document (after the forward defences)",
            "[docs, tokens, width]",
        ),
        ChannelDecl(
            "gradient",
            "server->client",
            "gradient of the loss with respect to the activations it received (after the backward defences)",
            "[docs, tokens, width]",
        ),
        ChannelDecl(
            "row-ids",
            "both",
            "the document id of every row in the frame header; they link the rows of "
            "one document across frames and steps",
            "[rows]",
            note=seed_note,
        ),
        ChannelDecl(
            "shapes",
            "both",
            "frame kind, phase, step, tensor shape and dtype, the attention mask and the bits per element",
            "header",
        ),
        TIMING,
    ]
    if u_shape:
        ch += [
            ChannelDecl(
                "trunk-output",
                "server->client",
                "the offloaded run's output, returned to the client's top blocks (the U-shape's second crossing)",
                "[docs, tokens, width]",
            ),
            ChannelDecl(
                "output-gradient",
                "client->server",
                "gradient of the client's loss with respect to the trunk output (sits next to the loss)",
                "[docs, tokens, width]",
            ),
        ]
    else:
        ch.append(
            ChannelDecl(
                "labels",
                "client->server",
                "the next-token labels for the server's loss: the document's token ids",
                "[docs, tokens]",
                note="the text itself; outside the observer view of What Gradients Add §3, read verbatim by the "
                "server that computes the loss",
            )
        )
    if not gradients:
        ch = [c for c in ch if c.name not in ("gradient", "output-gradient")]
    if transport:
        ch += _transport_channels()
    links: tuple[str, ...] = ("main",)
    notes: list[str] = []
    for d in defences:
        declare = getattr(d, "declare", None)
        if declare is not None:
            ch = list(declare(ch))
        own = getattr(d, "links", None)
        if callable(own):
            links = tuple(own())
        note = getattr(d, "channel_note", None)
        if callable(note) and note():
            notes.append(note())
    return Declaration(tuple(ch), links, tuple(notes))


def _transport_channels() -> list[ChannelDecl]:
    """What a two-process run adds: the handshake and every message's envelope."""
    return [
        ChannelDecl(
            "handshake",
            "both",
            "the hello (protocol version; the server's configuration: model name, path and precision, split, "
            "defence chain with its arguments, learning rate, frame sizes, and two seeds derived one-way from "
            "the run seed; the "
            "model's fingerprint; how often to checkpoint, and when resuming the checkpoint's token and step "
            "count) and the welcome (the server's model fingerprint, split and defence chain, the agreed "
            "limits, its checkpoint token and a fresh 128-bit session id drawn from the operating system's random "
            "source)",
            "once per session",
            recorded_in=MESSAGES_FILE,
            note="the run seed, the data set, its seed and the document counts do not cross",
        ),
        ChannelDecl(
            "envelope",
            "both",
            "each message's envelope: type, frame kind, phase, step, row ids, dtype, shape and size (as in the "
            "frame's own header), a sequence number counting the messages, a 128-bit nonce drawn from the "
            "operating system's random source (independent of the data and the seeds), and after the welcome "
            "its session id (the same random value in every message of the session); a refusal's error text; "
            "the goodbye's frame count",
            "per message",
            recorded_in=MESSAGES_FILE,
        ),
    ]


def declare_latent_channels(
    *, output_gradient: str, transport: bool = False, gauge_entropy: str = "os", decoy_release: str = "fresh"
) -> Declaration:
    """The channels of the decoy system's latent mode (``splitleak.training.latent``): four row
    channels per frame of one document's rows and its decoys, gauged, plus the header channels.
    ``output_gradient``, ``gauge_entropy`` and ``decoy_release`` are the latent config's; the forward
    channel's note names the weakness of the derived keys and of verbatim decoys."""
    rows = "[frames, rows, D]: one frame per document, its rows and its decoy rows, rotated and permuted"
    og = (
        "gradient of the client's loss with respect to the surrogate's output, UNCLIPPED and UNNOISED: a decoy "
        "row's is exactly zero, since the loss keeps only the real rows"
        if output_gradient == "open"
        else "gradient of the client's loss with respect to the surrogate's output, clipped per row and noised "
        "(the paper's fix): decoy rows carry noise only"
    )
    weak = []
    if gauge_entropy == "derived":
        weak.append(
            "gauges and noise keyed by the run seed (everything else in the key crosses in the header): a key "
            "search over seeds rebuilds them (gauge-key-search)"
        )
    if decoy_release == "verbatim":
        weak.append(
            "decoys re-sent as released: each repeats a row of an earlier frame, its norm to float precision "
            "(decoy-history)"
        )
    ch = [
        ChannelDecl(
            "activations",
            "client->server",
            "the forward wire: the private encoder's output mixed with decoy rows (earlier frames' encoder rows), "
            "gauged, every row clipped and noised afresh"
            if decoy_release == "fresh"
            else "the forward wire: the private encoder's output, clipped per row and noised, mixed with decoy rows "
            "(earlier released rows, re-sent as they were) and gauged",
            rows,
            note="; ".join(weak),
        ),
        ChannelDecl(
            "trunk-output",
            "server->client",
            "the return wire: the surrogate's output on the gauged rows, clipped per row and noised",
            rows,
        ),
        ChannelDecl("output-gradient", "client->server", og, rows),
        ChannelDecl(
            "gradient",
            "server->client",
            "the input gradient: the surrogate's gradient with respect to the rows it received",
            rows,
        ),
        ChannelDecl(
            "row-ids",
            "both",
            "one opaque frame id per frame (a counter over the run); it names no document",
            "[frames]",
        ),
        ChannelDecl(
            "shapes",
            "both",
            "frame kind, phase, step, tensor shape (rows per frame: fewer while the decoy pool fills), dtype and "
            "the mask (all ones)",
            "header",
        ),
        TIMING,
    ]
    if transport:
        ch += _transport_channels()
    return Declaration(tuple(ch), ("main",), ())


def frame_channels(frame: Frame, probe_rows: int | None = None) -> dict[str, Any]:
    """The channels one frame carries: row channels with their row range ``(start, stop)``, and the
    header channels (``labels``, ``row-ids``, ``shapes``, ``meta:KEY`` for every metadata key).
    A reply carries as many probe rows as the forward frame it answers (``probe_rows``)."""
    main, probe = ROW_CHANNELS[frame.kind]
    rows = frame.tensor.shape[0]
    n_probe = int(frame.meta.get("probe_rows", 0)) if probe_rows is None else probe_rows
    out: dict[str, Any] = {main: (0, rows - n_probe)}
    if n_probe:
        if probe is None:
            raise UndeclaredChannelError(
                f"a {frame.kind!r} frame carries {n_probe} probe rows, which that frame kind has no channel for"
            )
        out[probe] = (rows - n_probe, rows)
    out["row-ids"] = None
    out["shapes"] = None
    if frame.labels is not None:
        out["labels"] = None
    for key in frame.meta:
        out[f"meta:{key}"] = None
    return out


def check_declared(frame: Frame, declaration: Declaration, link: str, probe_rows: int | None = None) -> dict[str, Any]:
    """``frame_channels(frame)``, refusing any channel (or link) the declaration does not name."""
    found = frame_channels(frame, probe_rows)
    if link not in declaration.links:
        raise UndeclaredChannelError(
            f"a {frame.kind!r} frame crossed on link {link!r}, which the split mode and its defences do not declare "
            f"(declared links: {', '.join(declaration.links)}); declare it, or stop sending on it"
        )
    missing = sorted(set(found) - declaration.names())
    if missing:
        raise UndeclaredChannelError(
            f"a {frame.kind!r} frame at step {frame.step} ({frame.phase}) carries undeclared channel(s) "
            f"{', '.join(missing)}; every crossing must be declared (splitleak.wire.declare) so that the audit "
            "measures it — declare the channel where the defence or split mode adds it, or stop sending it"
        )
    return found
