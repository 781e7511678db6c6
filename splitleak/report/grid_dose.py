"""The decoy system's dose ladder in a grid's report (002 §4.1, Table 4, Figure 3): per latent run that ran the
``dose-ladder`` job, what the oracle probe battery read at each planted dose, and where each metric first detected
the planted leak, beside the paper's coverage sweep. A reproduction reads the same records (``dose_runs``).

It is the instrument's positive control: the leak is planted with the client's record and read by probes trained
on that record, so it says what the instrument can detect at this size, never what the traffic gives away."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Sequence

from splitleak.attacks.dose import DOSE_NOTE
from splitleak.report.document import Document, Heading, Para, Table
from splitleak.report.grid_common import pp

ATTACK = "dose-ladder"
#: 002 Table 4, coordinate mode at amplitude 1: coverage -> (token top-1, rare-token top-1), point effects in pp
#: over the constant baseline; the zero-dose cell's token top-1 (0.41 pp) is the artefact's
PAPER_TABLE4 = {
    0.0: (0.4065, None),
    0.02: (0.35, 0.08),
    0.04: (0.35, 0.32),
    0.06: (0.98, 0.67),
    0.10: (4.19, 1.97),
    0.30: (22.51, 14.18),
    1.0: (94.88, 100.0),
}
#: the axes of the ladder: name -> (the dose's varied field, which doses lie on it)
AXES = {
    "coordinate coverage (amplitude 1)": ("coverage", lambda d: d["mode"] == "coordinate" and d["amplitude"] == 1.0),
    "coordinate amplitude (coverage 1)": ("amplitude", lambda d: d["mode"] == "coordinate" and d["coverage"] == 1.0),
    "invariant coverage (amplitude 1)": ("coverage", lambda d: d["mode"] == "invariant"),
}
#: metric -> whether a dose's reading detects the planted leak
DETECTS = {
    "token_top1": lambda d: d["token_top1"]["verdict"] == "detected",
    "gate": lambda d: bool(d["gate"]["breaks"]),
    "rare_token_top1": lambda d: bool(d["rare_token_top1"]["detected"]),
}


@dataclass
class DoseRun:
    """One dose-ladder job's record: its run (model, latent arm, victim seed), channel and per-dose readings."""

    key: str
    model: str
    arm: str
    seed: int
    channel: str
    frames: int
    doses: list[dict[str, Any]]
    rare_tokens: int
    frame_delta: dict[str, dict[int, float]] = field(default_factory=dict)  # dose name -> frame id -> difference

    def axis(self, name: str) -> list[dict[str, Any]]:
        """The doses on axis ``name`` (``AXES``), in the order of the varied field."""
        key, on = AXES[name]
        return sorted((d for d in self.doses if on(d)), key=lambda d: d[key])

    def onset(self, metric: str, axis: str) -> float | None:
        """The smallest dose on ``axis`` at which ``metric`` detects the leak (None: none of the doses read)."""
        key = AXES[axis][0]
        return next((d[key] for d in self.axis(axis) if DETECTS[metric](d)), None)

    def at(self, mode: str, coverage: float, amplitude: float) -> dict[str, Any] | None:
        return next(
            (d for d in self.doses if (d["mode"], d["coverage"], d["amplitude"]) == (mode, coverage, amplitude)), None
        )


def dose_name(mode: str, coverage: float, amplitude: float) -> str:
    """A dose's prefix in the store's ``arm`` column (``audit.latent_attacks.dose_arm``)."""
    return f"{mode}/coverage={coverage:g}/amplitude={amplitude:g}/"


def dose_runs(attack_rows: Sequence[dict[str, Any]]) -> list[DoseRun]:
    """Every dose-ladder job of a store's latent rows, with its per-frame differences from the rows."""
    frames: dict[str, dict[str, dict[int, float]]] = {}
    heads: dict[str, dict[str, Any]] = {}
    for r in attack_rows:
        if r.get("attack") != ATTACK or r.get("kind") != "attack":
            continue
        heads.setdefault(r["key"], r)
        if r.get("arm") is not None and r.get("paired_delta") is not None:
            dose = str(r["arm"]).rsplit("/", 3)[0] + "/"  # the dose's name, without the arm it read
            frames.setdefault(r["key"], {}).setdefault(dose, {})[int(r["doc_id"])] = float(r["paired_delta"])
    out = []
    for key, r in heads.items():
        res = json.loads(r["result_json"]) if r.get("result_json") else {}
        ladder = res.get("dose")
        if not ladder:
            continue
        out.append(
            DoseRun(
                key, str(r.get("model")), str(r.get("defence")), int(r["victim_seed"]), ladder["channel"],
                int(res.get("n_frames") or 0), ladder["doses"], int(ladder["rare_tokens"]["count"]),
                frames.get(key, {}),
            )
        )  # fmt: skip
    return sorted(out, key=lambda d: (d.model, d.arm, d.channel, d.seed))


def dose_section(doc: Document, attack_rows: Sequence[dict[str, Any]]) -> None:
    """The dose ladder: omitted where no dose-ladder job ran."""
    runs = dose_runs(attack_rows)
    if not runs:
        return
    doc.add(Heading(3, "The instrument's positive control: the dose ladder"))
    doc.add(Para(f"{DOSE_NOTE[0].upper()}{DOSE_NOTE[1:]}.", "note"))
    doc.add(_onset_table(runs), _coverage_table(runs))


def _onset_table(runs: Sequence[DoseRun]) -> Table:
    paper = {
        ("token_top1", "coordinate coverage (amplitude 1)"): "between 0.04 and 0.06",
        ("gate", "coordinate coverage (amplitude 1)"): "0.06",
        ("rare_token_top1", "coordinate coverage (amplitude 1)"): "0.04 (first movement)",
    }
    rows = []
    for metric in DETECTS:
        for axis in AXES:
            read = [r for r in runs if r.axis(axis)]
            if not read:
                continue
            ours = "; ".join(
                f"{r.model} {r.arm} seed {r.seed}: {'none' if (o := r.onset(metric, axis)) is None else f'{o:g}'}"
                for r in read
            )
            rows.append([metric, axis, ours, paper.get((metric, axis), "—")])
    return Table(
        ["metric", "axis", "ours: the first dose that detects", "the paper"],
        rows,
        caption="Where each metric first detects the planted leak: token top-1 where the best arm's paired effect "
        "over the constant is above 0 at alpha over the arms; the gate where G exceeds its mark; rare-token top-1 "
        "where the Wilson lower bound of the best arm on rare rows (tokens seen at most once in probe training: "
        "ours) is above the constant's rate there. 'none': no dose read on the axis detects it. The paper: 002 §4.1 "
        "and Table 5 (one calibration run, its rare-token onset a first movement, not a test).",
    )


def _coverage_table(runs: Sequence[DoseRun]) -> Table:
    axis = "coordinate coverage (amplitude 1)"
    read = [r for r in runs if r.axis(axis)]
    coverages = sorted({d["coverage"] for r in read for d in r.axis(axis)})
    rows = []
    for c in coverages:
        cells = []
        for r in read:
            d = r.at("coordinate", c, 1.0)
            if d is None:
                cells.append("n/a")
                continue
            tt = d["token_top1"]
            cells.append(f"{pp(tt['paired_effect'])} [{pp(tt['paired_low'])}, {pp(tt['paired_high'])}], "
                         f"G {pp(d['gate']['statistic'])}")  # fmt: skip
        theirs = PAPER_TABLE4.get(c)
        rows.append([f"{c:g}", *cells, "—" if theirs is None else f"{theirs[0]:+.2f}"])
    return Table(
        ["coverage", *[f"{r.model} {r.arm} seed {r.seed} ({r.frames} frames)" for r in read], "the paper"],
        rows,
        caption="Token top-1 over the constant at each coverage (coordinate mode, amplitude 1), pp, the best arm's "
        "interval at alpha over the arms, and the gate statistic G. The paper: 002 Table 4 (2,048 evaluation "
        "frames, one run; the zero-dose cell from its artefact).",
    )
