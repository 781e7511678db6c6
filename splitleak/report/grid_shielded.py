"""The grid report's section on label-shielded split fine-tuning (003): per arm, the held-out loss, the
output gradient's utility (ASNR, Recall@10) and what each label attack (GMA-SL, BiSR) reads back; the
privacy–utility figure (reconstruction against held-out loss, one point per arm); and the paper's claims
of shape (a)–(e), each checked on the grid's own numbers.

``shielded_summary`` turns store rows into one ``ArmCell`` per arm (tested), ``shape_claims`` checks the
claims on them (tested, and used by the tests of shape on the tiny model), ``shielded_section`` writes
them. A defence is judged by its strongest reader: the claims read, per arm and metric, the best of the
label attacks the grid ran (``LABEL_READERS``: GMA-SL and the GMA-SL that knows the chain). Rows are the
label-shielded mode's when their ``defence_name`` is ``label-shielded`` (the ``defence`` column holds the
arm's label). Thresholds of the claims come from the protocol
(``mirage_003.yaml``); where it gives none, the defaults here, which are ours (003 states no numbers).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from splitleak.report.document import Document, Figure, Heading, Para, Table
from splitleak.report.figures import recovery_cost_figure

SHIELDED_DEFENCE = "label-shielded"  # the same word as splitleak.experiments.jobs.SHIELDED_DEFENCE (torch-free)
#: 003's label attack, and the label readers whose best reading per arm the claims use (DESIGN: a defence
#: is judged by its strongest reader; ``gma-sl-aware`` knows the chain's public arguments)
CLAIM_ATTACK = "gma-sl"
LABEL_READERS = ("gma-sl", "gma-sl-aware")
BASELINES = ("grad-prune", "grad-dropout", "seq-dp")
#: our defaults for the claims' thresholds (003 gives none); a protocol's ``thresholds`` override them
DEFAULT_THRESHOLDS = {
    "most_labels": 0.5,  # (a) undefended, GMA-SL recovers more than this share of label tokens
    "far_below": 0.1,  # (b) mirage below every comparable baseline by at least this much (share)
    "utility_margin": 0.25,  # (b) comparable utility: held-out CE within this many nats of the undefended arm
    "m_drop": 0.1,  # (c) from the smallest m to the largest, recovery falls by at least this much
    "plateau": 0.1,  # (c) the two largest m read within this much of each other
    "trunk_margin": 0.01,  # (e) training the Trunk: held-out CE no worse than frozen by more than this (nats)
}


def is_shielded(row: dict[str, Any]) -> bool:
    return row.get("defence_name") == SHIELDED_DEFENCE


def _json(row: dict[str, Any], col: str) -> dict[str, Any]:
    return json.loads(row[col]) if row.get(col) else {}


def _mean(xs: Sequence[float | None]) -> float | None:
    known = [float(x) for x in xs if x is not None and math.isfinite(float(x))]
    return float(np.mean(known)) if known else None


@dataclass
class ArmCell:
    model: str
    arm: str
    chain: list[dict[str, Any]]  # the defence chain, as the train config holds it
    train: str  # all, trunk-frozen or top-only
    seeds: list[int]
    heldout_ce: float | None
    all_local_ce: float | None
    asnr: float | None  # mean over documents and seeds (None when the gradient was sent unchanged)
    recall10: float | None
    #: attack -> metric -> mean over seeds (label_recovery, rougeL_f, token_recovery, meteor, answer_label_recovery)
    attacks: dict[str, dict[str, float | None]] = field(default_factory=dict)
    answer_only: bool = False  # the loss on the answer tokens only (003 App. E): outside the claims of shape

    @property
    def chain_names(self) -> str:
        return "+".join(d["name"] for d in self.chain) or "none"

    def arg(self, name: str, key: str, default: float) -> float | None:
        """The argument ``key`` of defence ``name`` in the chain (its default when not given); None when the
        chain has no such defence."""
        for d in self.chain:
            if d["name"] == name:
                return float((d.get("args") or {}).get(key, default))
        return None

    def reads(self, attack: str = CLAIM_ATTACK, metric: str = "label_recovery") -> float | None:
        return (self.attacks.get(attack) or {}).get(metric)

    def strongest(self, metric: str = "label_recovery") -> float | None:
        """The best reading of ``metric`` over the label readers that read this arm (None: none did)."""
        known = [x for a in LABEL_READERS if (x := self.reads(a, metric)) is not None]
        return max(known) if known else None

    def strongest_reader(self, metric: str = "label_recovery") -> str | None:
        best = self.strongest(metric)
        return next((a for a in LABEL_READERS if best is not None and self.reads(a, metric) == best), None)


METRICS = ("label_recovery", "answer_label_recovery", "rougeL_f", "rouge1_f", "meteor", "token_recovery")


def shielded_summary(attack_rows: Sequence[dict[str, Any]], train_rows: Sequence[dict[str, Any]]) -> list[ArmCell]:
    """One cell per model x arm: per model, the undefended arm first, then the arms by training mode,
    chain and label."""
    trains: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for t in train_rows:
        if is_shielded(t):
            trains.setdefault((t["model"], t["defence"]), []).append(t)
    per_job: dict[str, dict[str, Any]] = {}
    for r in attack_rows:
        if is_shielded(r) and r.get("kind") == "attack" and r["key"] not in per_job:
            per_job[r["key"]] = r
    cells = []
    for (model, arm), rows in trains.items():
        cfg = _json(rows[0], "train_config")
        utility = [(_json(t, "metrics_json").get("capture") or {}).get("gradient_utility") or {} for t in rows]
        seen: dict[str, dict[str, list[float | None]]] = {}
        for r in per_job.values():
            if r["model"] == model and r["defence"] == arm:
                res = _json(r, "result_json")
                for m in METRICS:
                    seen.setdefault(r["attack"], {}).setdefault(m, []).append(res.get(m))
        cells.append(
            ArmCell(
                model=model,
                arm=arm,
                chain=list(cfg.get("defences") or []),
                train=(cfg.get("shielded") or {}).get("train", "all"),
                seeds=sorted({int(t["victim_seed"]) for t in rows}),
                heldout_ce=_mean([t.get("heldout_ce") for t in rows]),
                all_local_ce=_mean([t.get("all_local_ce") for t in rows]),
                asnr=_mean([(u.get("mean") or {}).get("asnr") for u in utility]),
                recall10=_mean([(u.get("mean") or {}).get("recall@10") for u in utility]),
                attacks={a: {m: _mean(v) for m, v in ms.items()} for a, ms in seen.items()},
                answer_only=bool((cfg.get("shielded") or {}).get("answer_only", False)),
            )
        )
    order = {"all": 0, "trunk-frozen": 1, "top-only": 2}
    return sorted(
        cells,
        key=lambda c: (
            c.model,
            c.chain_names != "none" or c.train != "all",
            order.get(c.train, 3),
            c.chain_names,
            c.arm,
        ),
    )


@dataclass
class Claim:
    name: str
    statement: str
    holds: bool | None  # None: the grid lacks the arms or the numbers to check it
    evidence: str


def _is(x: float | None, value: float) -> bool:
    return x is not None and math.isclose(x, value, rel_tol=1e-3)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def _ce(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def shape_claims(cells: Sequence[ArmCell], thresholds: dict[str, float] | None = None) -> list[Claim]:
    """003's claims of shape (a)–(e), each checked on the cells of one model (the first listed), on the strongest
    label reader of each arm (``ArmCell.strongest``)."""
    th = {**DEFAULT_THRESHOLDS, **(thresholds or {})}
    if not cells:
        return []
    model = cells[0].model
    cells = [c for c in cells if c.model == model and not c.answer_only]  # (a)-(e) are claims of full supervision
    full = [c for c in cells if c.train == "all"]
    none = next((c for c in full if c.chain_names == "none"), None)
    mirage = [c for c in full if c.chain_names == "mirage"]
    default_mirage = next(
        (c for c in mirage if _is(c.arg("mirage", "m", 1750.0), 1750.0) and _is(c.arg("mirage", "r", 1 / 7), 1 / 7)),
        None,
    )
    return [
        _claim_a(none, th),
        _claim_b(full, none, default_mirage, th),
        _claim_c(mirage, th),
        _claim_d(mirage),
        _claim_e(cells, default_mirage, th),
    ]


_READERS = " or ".join(LABEL_READERS)


def _claim_a(none: ArmCell | None, th: dict[str, float]) -> Claim:
    """(a) undefended, GMA-SL recovers most label tokens."""
    a = none.strongest() if none else None
    return Claim(
        "a",
        f"undefended, GMA-SL recovers most label tokens (more than {_pct(th['most_labels'])})",
        None if a is None else a > th["most_labels"],
        f"no undefended arm read by {_READERS}"
        if a is None
        else f"{none.arm}: {_pct(a)} of label tokens ({none.strongest_reader()})",  # type: ignore[union-attr]
    )


def _claim_b(
    full: Sequence[ArmCell], none: ArmCell | None, default_mirage: ArmCell | None, th: dict[str, float]
) -> Claim:
    """(b) Gradient Mirage reads far below every baseline at comparable utility."""
    base = [c for c in full if c.chain_names in BASELINES and c.strongest() is not None]
    if default_mirage is None or default_mirage.strongest() is None or none is None or not base:
        return Claim(
            "b",
            "Gradient Mirage reads far below every baseline at comparable utility",
            None,
            f"needs the undefended arm, mirage at its defaults and a baseline, each read by {_READERS}",
        )
    near = [
        c
        for c in base
        if c.heldout_ce is not None
        and none.heldout_ce is not None
        and abs(c.heldout_ce - none.heldout_ce) <= th["utility_margin"]
    ]
    mirage_ok = (
        default_mirage.heldout_ce is not None
        and none.heldout_ce is not None
        and abs(default_mirage.heldout_ce - none.heldout_ce) <= th["utility_margin"]
    )
    mr, mrl = default_mirage.strongest() or 0.0, default_mirage.strongest("rougeL_f") or 0.0
    below = all(
        mr <= (c.strongest() or 0.0) - th["far_below"] and mrl <= (c.strongest("rougeL_f") or 0.0) - th["far_below"]
        for c in near
    )
    ev = (
        f"mirage: {_pct(mr)} labels ({default_mirage.strongest_reader()}), ROUGE-L {_pct(mrl)}, held-out CE "
        f"{_ce(default_mirage.heldout_ce)} (undefended {_ce(none.heldout_ce)}); "
        + "; ".join(
            f"{c.arm}: {_pct(c.strongest())}, ROUGE-L {_pct(c.strongest('rougeL_f'))}, CE {_ce(c.heldout_ce)}"
            + ("" if c in near else " (utility not comparable)")
            for c in base
        )
    )
    return Claim(
        "b",
        f"Gradient Mirage cuts label recovery and ROUGE-L at least {_pct(th['far_below'])} below every "
        f"baseline whose held-out CE is within {th['utility_margin']} nats of the undefended run, its own "
        "CE within that margin too",
        bool(mirage_ok and near and below),
        ev + ("" if near else "; no baseline at comparable utility"),
    )


def _sweep(
    mirage: Sequence[ArmCell], arg: str, default: float, other: str, other_default: float
) -> list[tuple[float | None, ArmCell]]:
    """The mirage arms read by a label reader with ``other`` at its default, by their ``arg``, ascending."""
    return sorted(
        (
            (c.arg("mirage", arg, default), c)
            for c in mirage
            if _is(c.arg("mirage", other, other_default), other_default) and c.strongest() is not None
        ),
        key=lambda x: x[0],  # type: ignore[arg-type,return-value]
    )


def _claim_c(mirage: Sequence[ArmCell], th: dict[str, float]) -> Claim:
    """(c) reconstruction falls then plateaus as mirage's m grows (r at its default)."""
    by_m = _sweep(mirage, "m", 1750.0, "r", 1 / 7)
    if len(by_m) < 3:
        return Claim("c", "reconstruction falls then plateaus as m grows", None, "needs mirage at three or more m")
    rec = [c.strongest() or 0.0 for _, c in by_m]
    ces = [c.heldout_ce for _, c in by_m if c.heldout_ce is not None]
    flat = (max(ces) - min(ces)) <= th["utility_margin"] if ces else False
    holds = rec[0] - rec[-1] >= th["m_drop"] and abs(rec[-1] - rec[-2]) <= th["plateau"] and flat
    return Claim(
        "c",
        f"reconstruction falls by at least {_pct(th['m_drop'])} from the smallest m to the largest, the two "
        f"largest within {_pct(th['plateau'])}, held-out CE within {th['utility_margin']} nats across m",
        holds,
        "; ".join(f"m={m:g}: {_pct(c.strongest())}, CE {_ce(c.heldout_ce)}" for m, c in by_m),
    )


def _claim_d(mirage: Sequence[ArmCell]) -> Claim:
    """(d) token-wise variation r helps up to a point (m at its default)."""
    by_r = _sweep(mirage, "r", 1 / 7, "m", 1750.0)
    if len(by_r) < 2 or by_r[0][0] != 0:
        return Claim("d", "token-wise variation r helps up to a point", None, "needs mirage at r = 0 and at r > 0")
    r0 = by_r[0][1].strongest() or 0.0
    best = min(c.strongest() or 0.0 for _, c in by_r[1:])
    return Claim(
        "d",
        "some r > 0 reads less than r = 0 (the best r is reported; larger r past it reading more is the "
        "'up to a point')",
        best < r0,
        "; ".join(f"r={r:.3g}: {_pct(c.strongest())}" for r, c in by_r),
    )


def _claim_e(cells: Sequence[ArmCell], default_mirage: ArmCell | None, th: dict[str, float]) -> Claim:
    """(e) training the Trunk does at least as well as freezing it."""
    frozen = next(
        (
            c
            for c in cells
            if c.train == "trunk-frozen"
            and c.chain_names == (default_mirage.chain_names if default_mirage else "mirage")
            # at the default mirage's own m and r: the extreme-m arms (App. C.6) are another question
            and _is(c.arg("mirage", "m", 1750.0), 1750.0)
            and _is(c.arg("mirage", "r", 1 / 7), 1 / 7)
        ),
        None,
    )
    if default_mirage is None or frozen is None or default_mirage.heldout_ce is None or frozen.heldout_ce is None:
        return Claim(
            "e",
            "training the Trunk does at least as well as freezing it",
            None,
            "needs mirage with train all and trunk-frozen",
        )
    return Claim(
        "e",
        f"training the Trunk: held-out CE no worse than freezing it by more than {th['trunk_margin']} nats",
        default_mirage.heldout_ce <= frozen.heldout_ce + th["trunk_margin"],
        f"train all {_ce(default_mirage.heldout_ce)}, trunk-frozen {_ce(frozen.heldout_ce)}",
    )


def privacy_utility_figure(cells: Sequence[ArmCell], out_stem: str | Path, attack: str | None = None) -> list[Path]:
    """Reconstruction (ROUGE-L F of the label text, and label-token recovery) against held-out CE, one point per
    arm, the undefended one in blue (the grid report's cost figure, with the loss as the cost); by ``attack``, or
    by the strongest label reader of each arm (None). Writes OUT.png and OUT.svg."""
    panels = {}
    for metric, title in (("rougeL_f", "ROUGE-L F of the labels"), ("label_recovery", "label tokens recovered")):
        panels[title] = [
            (c.heldout_ce, 100 * y, c.arm, c.chain_names == "none" and c.train == "all")
            for c in cells
            if c.heldout_ce is not None
            and (y := c.strongest(metric) if attack is None else c.reads(attack, metric)) is not None
        ]
    who = attack or "strongest label reader"
    return recovery_cost_figure(
        panels, out_stem, xlabel="held-out cross-entropy (nats; lower is better)", ylabel="{title} (%), " + who
    )


def shielded_section(
    doc: Document,
    attack_rows: Sequence[dict[str, Any]],
    train_rows: Sequence[dict[str, Any]],
    out: Path,
    thresholds: dict[str, float] | None = None,
) -> list[ArmCell]:
    """Writes the section (nothing when the grid trained no label-shielded arm); returns the cells."""
    cells = shielded_summary(attack_rows, train_rows)
    for ext in ("png", "svg"):
        (out / f"privacy-utility.{ext}").unlink(missing_ok=True)
    if not cells:
        return cells
    doc.add(Heading(2, "Label-shielded fine-tuning and Gradient Mirage (003)"))
    attacks = sorted({a for c in cells for a in c.attacks}, key=lambda a: (a != CLAIM_ATTACK, a))
    header = ["model", "arm", "chain", "train", "seeds", "held-out CE", "all-local CE", "ASNR", "Recall@10"]
    for a in attacks:
        header += [f"{a} labels", f"{a} ROUGE-L", f"{a} tokens"]
    rows = []
    for c in cells:
        row = [c.model, c.arm, c.chain_names, c.train, str(len(c.seeds)), _ce(c.heldout_ce), _ce(c.all_local_ce)]
        row += ["n/a" if c.asnr is None else f"{c.asnr:.3g}", _pct(c.recall10)]
        for a in attacks:
            row += [_pct(c.reads(a)), _pct(c.reads(a, "rougeL_f")), _pct(c.reads(a, "token_recovery"))]
        rows.append(row)
    doc.add(
        Table(
            header,
            rows,
            caption=(
                "Per arm, means over victim seeds. Held-out CE: the split run's supervised cross-entropy on the "
                "evaluation documents; all-local CE: the same model trained wholly on the client (n/a where the grid "
                "trained no baseline: an undefended label-shielded arm trains as all-local training does, its held-out "
                "CE the all-local one to 1e-5 nats). ASNR and Recall@10: "
                "the output gradient sent against the raw one of the full loss (003 App. C.1; n/a: sent unchanged). "
                "Labels: share of label tokens (tokens 1 … T−1) the attack recovers; ROUGE-L: F of the label text; "
                "tokens: whole-document token recovery (token 0 included)."
            ),
        )
    )
    if any(c.heldout_ce is not None and c.strongest() is not None for c in cells):
        png = privacy_utility_figure(cells, out / "privacy-utility")[0]
        doc.add(
            Figure(
                png,
                "Reconstruction by the strongest label reader of each arm (GMA-SL or GMA-SL that knows the chain) "
                "against held-out cross-entropy, one point per arm (blue: undefended). A defence worth having sits "
                "low and to the left.",
                alt="privacy-utility scatter of the label-shielded arms",
            )
        )
    claims = shape_claims(cells, thresholds)
    doc.add(
        Table(
            ["claim", "statement", "verdict", "evidence"],
            [
                [c.name, c.statement, {True: "holds", False: "does not hold", None: "not checked"}[c.holds], c.evidence]
                for c in claims
            ],
            caption=(
                f"003's claims of shape, checked on {cells[0].model}'s arms and read on each arm's strongest label "
                f"reader ({', '.join(LABEL_READERS)}: the best the grid ran). Thresholds are ours (003 states none) "
                "unless the protocol sets them."
            ),
        )
    )
    doc.add(
        Para(
            "Not measured here: attacks on the Bottom's gradient returned to the client (the server computes it), "
            "on the trunk output h_t alone, and any attacker holding the client's fine-tuned Top; BiSR's forward "
            "stage reads h_b, which Gradient Mirage does not touch.",
            "note",
        )
    )
    return cells
