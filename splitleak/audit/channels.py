"""The channel table of a run: every declared channel, whether the tap captured it, which registered
attacks read it, and its status in the words of Politis & Pappas 2026, §3 (Table 3).

Status, for an audit (``attacks_run`` given):

- **measured**: an attack of the audit read the channel and the audit's injected-leak calibration
  doses that channel (a positive control), so a silent reading is evidence of absence;
- **no positive control**: an attack of the audit read it, but no calibration doses it;
- **no attack**: no attack of the audit read it (the registered attacks that could are named);
- **in clear**: the channel is the text itself (the labels a plain split sends for the server's loss): the
  server reads it without an attack, whatever the audit measures.

For a bare run (``splitleak channels RUN_DIR``) nothing has been measured yet: a channel reads
**not measured** when registered attacks can read it, **no attack** when none can. A channel the
tap does not record (timing) reads **not captured**.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from splitleak.attacks.registry import attacks_for_mode, attacks_reading
from splitleak.audit.evaluate import attack_label, run_mode
from splitleak.defences import DefenceChain
from splitleak.runs.manifest import read_manifest
from splitleak.runs.wire import read_wire, wire_phases
from splitleak.wire.declare import Declaration, declare_channels

HEADER = ["channel", "link(s)", "direction", "shape", "captured", "read by", "status"]
#: channels that carry the text itself: the server that receives them reads every token, no attack needed
IN_CLEAR = ("labels",)


def run_declaration(run_dir: str | Path) -> Declaration:
    m = read_manifest(run_dir)
    if "channels" in m:
        return Declaration.from_dict(m["channels"])
    chain = DefenceChain.from_specs(m["config"]["defences"], m["config"]["seed"])  # a run older than declarations
    top_only = (m["config"].get("shielded") or {}).get("train") == "top-only"
    return declare_channels(u_shape=bool(m["split"].get("u_shape")), defences=chain.defences, gradients=not top_only)


def _captured(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Per channel: frames and rows per phase, links, and the shape of its first occurrence."""
    out: dict[str, dict[str, Any]] = {}
    for phase in wire_phases(run_dir):
        for rec in read_wire(run_dir, phase):
            for name, span in rec.header["channels"].items():
                c = out.setdefault(name, {"frames": {}, "rows": {}, "links": set(), "shape": {}})
                c["frames"][phase] = c["frames"].get(phase, 0) + 1
                c["links"].add(rec.header["link"])
                if span is not None:
                    c["rows"][phase] = c["rows"].get(phase, 0) + span[1] - span[0]
                    c["shape"].setdefault(phase, [span[1] - span[0], *rec.frame.tensor.shape[1:]])
                elif name == "labels":
                    assert rec.frame.labels is not None  # frame_channels names labels only when the frame has them
                    c["shape"].setdefault(phase, list(rec.frame.labels.shape))
    return out


def channel_table(
    run_dir: str | Path, attacks_run: Iterable[dict[str, Any]] | None = None, calibrated: Iterable[str] = ()
) -> list[dict[str, Any]]:
    """One row per declared channel. ``attacks_run``: the audit's results (each with ``attack`` and
    ``channels_read``); ``calibrated``: the channels the audit's calibration doses."""
    run_dir = Path(run_dir)
    decl = run_declaration(run_dir)
    captured = _captured(run_dir)
    for_mode = set(attacks_for_mode(run_mode(read_manifest(run_dir))))
    ran = None if attacks_run is None else list(attacks_run)
    calibrated = set(calibrated)
    rows = []
    for c in decl.channels:
        cap = captured.get(c.name)
        registered = [a for a in attacks_reading(c.name) if a in for_mode]
        if ran is None:
            read_by = registered
        else:
            read_by = sorted({attack_label(r) for r in ran if c.name in r.get("channels_read", ())})
        if not c.captured:
            status = "not captured"
        elif c.name in IN_CLEAR:
            status = "in clear"
        elif ran is None:
            status = "not measured" if registered else "no attack"
        elif read_by:
            status = "measured" if c.name in calibrated else "no positive control"
        else:
            status = "no attack"
        rows.append(
            {
                "channel": c.name,
                "direction": c.direction,
                "carries": c.carries,
                "note": c.note,
                "links": sorted(cap["links"]) if cap else list(decl.links),
                "shape": cap["shape"] if cap and cap["shape"] else c.shape,
                "captured": (bool(cap) or bool(c.recorded_in and (run_dir / c.recorded_in).is_file()))
                if c.captured
                else False,
                "frames": cap["frames"] if cap else {},
                "rows": cap["rows"] if cap else {},
                "read_by": read_by,
                "registered_readers": registered,
                "recorded_in": c.recorded_in,
                "status": status,
            }
        )
    for name in sorted(set(captured) - decl.names()):  # recorded by an older tap, never declared
        rows.append(
            {
                "channel": name,
                "direction": "?",
                "carries": "",
                "note": "undeclared",
                "links": [],
                "shape": captured[name]["shape"],
                "captured": True,
                "frames": captured[name]["frames"],
                "rows": captured[name]["rows"],
                "read_by": [],
                "registered_readers": [],
                "status": "undeclared",
            }
        )
    return rows


def _fmt_shape(shape) -> str:
    """The first frame's shape per phase (``train [1, 32, 64]; capture [16, 32, 64]``), or the
    declaration's words."""
    if isinstance(shape, str):
        return shape
    return "; ".join(f"{phase} [{', '.join(str(x) for x in dims)}]" for phase, dims in shape.items())


def _fmt_captured(row: dict[str, Any]) -> str:
    if not row["captured"]:
        return "no"
    if row.get("recorded_in") and not row["frames"]:
        return f"yes: {row['recorded_in']}"
    parts = [
        f"{phase} {row['frames'][phase]} frames" + (f" / {row['rows'][phase]} rows" if phase in row["rows"] else "")
        for phase in row["frames"]
    ]
    return "yes: " + "; ".join(parts)


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    return [
        [
            r["channel"],
            ", ".join(r["links"]),
            r["direction"],
            _fmt_shape(r["shape"]),
            _fmt_captured(r),
            ", ".join(r["read_by"]) or "—",
            r["status"],
        ]
        for r in rows
    ]


def not_attacked(rows: list[dict[str, Any]]) -> list[str]:
    return [r["channel"] for r in rows if r["status"] in ("no attack", "not captured", "not measured", "undeclared")]


def channels_json(run_dir: str | Path) -> str:
    rows = channel_table(run_dir)
    return json.dumps(
        {"run": str(run_dir), "declaration": run_declaration(run_dir).as_dict(), "channels": rows},
        indent=2,
        sort_keys=True,
    )
