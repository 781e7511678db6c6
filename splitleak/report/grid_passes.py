"""The grid report's whole training traffic: for every run whose training traffic the grid's attacks read (attack
entries with ``phase: train``), what each reader read of the training documents as the server received them (each
document once per pass, with fresh noise), beside the most any reader of those crossings can read.

A document's reading is the mean over its crossing rows of the share of its tokens read right; each reader's mean
over documents carries a document-bootstrap interval. A reader of every crossing (``AttackInfo.passes``) is set
against the reader of one crossing it adapts, on the same run and copy (a paired interval over documents). Each
reading's mis-paired twin (``evaluate.crossings_control``: every crossing of another training document, labelled as
this one) is in its result. The bound is the audit's (``splitleak.audit.bounds``) over the training documents and
every crossing the tap recorded of them. A reading whose lower end lies above the bound, or a twin that reads the
documents it is labelled as, is an INSTRUMENT FAULT."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from splitleak.attacks.registry import attack_info
from splitleak.metrics import fmt_pct
from splitleak.report.document import Document, Heading, Para, Table
from splitleak.report.grid_bound import PublicModels
from splitleak.report.grid_shielded import is_shielded
from splitleak.stats import crossed_bootstrap_ci, paired_difference_ci
from splitleak.training.config import draws_of

HEADING = "The whole training traffic"
#: bootstrap replicates of the section's intervals
BOOT = 5_000


def _reader(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One attack job's reading of the training traffic: per document, the mean over its crossings of the share
    of tokens read right."""
    per_doc: dict[int, list[float]] = {}
    for r in rows:
        if r.get("token_counted"):
            per_doc.setdefault(int(r["doc_id"]), []).append(r["token_correct"] / r["token_counted"])
    result = json.loads(rows[0]["result_json"]) if rows[0].get("result_json") else {}
    control = result.get("control") or {}
    return {
        "attack": rows[0]["attack"],
        "copy": rows[0].get("client_copy") or "public",
        "label": f"{rows[0]['attack']} ({rows[0].get('client_copy') or 'public'})",
        "docs": {d: float(np.mean(v)) for d, v in per_doc.items()},
        "crossings": max((len(v) for v in per_doc.values()), default=0),
        "control": control.get("verdict"),
        "control_effect": (control.get("effect") or {}).get("estimate"),
    }


def _interval(values: np.ndarray, seed: int) -> dict[str, float]:
    ci = crossed_bootstrap_ci(values[None, :], n_boot=BOOT, seed=np.random.default_rng([seed, 0x7A55]))
    return {"estimate": ci.estimate, "low": ci.low, "high": ci.high}


def run_passes(
    train_rows: Sequence[dict[str, Any]], train_phase_rows: Sequence[dict[str, Any]], store: str | Path | None
) -> list[dict[str, Any]]:
    """One record per run with training-phase readings: its cell, each reader's reading with its interval and
    twin, each reader of every crossing's gain over the reader it adapts, the bound over the same crossings (or why
    there is none) and the instrument faults."""
    # lazy: the bound reads the runs' captures and the public models (torch), only where a grid read the training
    from splitleak.audit.bounds import audit_bound
    from splitleak.runs.truth import eval_token_ids

    jobs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in train_phase_rows:
        if r.get("token_counted"):
            jobs.setdefault(r["train_key"], {}).setdefault(r["key"], []).append(r)
    models = PublicModels()
    out = []
    for t in sorted(train_rows, key=lambda t: (t["model"], t["depth"] or 0, t["defence"], t["victim_seed"])):
        if t["key"] not in jobs:
            continue
        readers = sorted((_reader(rows) for rows in jobs[t["key"]].values()), key=lambda r: r["label"])
        docs = sorted(set.intersection(*(set(r["docs"]) for r in readers)))
        seed = int(t["victim_seed"])
        for r in readers:
            r["tokens"] = _interval(np.array([r["docs"][d] for d in docs]), seed)
        gains = []
        for every in readers:
            adapts = attack_info(every["attack"]).adapts if attack_info(every["attack"]).passes else None
            one = next((r for r in readers if r["attack"] == adapts and r["copy"] == every["copy"]), None)
            if one is None:
                continue
            g = paired_difference_ci(
                np.array([[every["docs"][d] for d in docs]]),
                np.array([[one["docs"][d] for d in docs]]),
                n_boot=BOOT,
                seed=np.random.default_rng([seed, 0x6A1]),
            )
            gains.append(
                {
                    "reader": every["label"],
                    "against": one["label"],
                    "estimate": g.estimate,
                    "low": g.low,
                    "high": g.high,
                }
            )
        rec: dict[str, Any] = {
            "model": t["model"], "depth": t["depth"], "defence": t["defence"], "seed": seed, "documents": len(docs),
            "crossings": max(r["crossings"] for r in readers), "readers": readers, "gains": gains, "faults": [],
        }  # fmt: skip
        out.append(rec)
        cfg = json.loads(t["train_config"]) if t.get("train_config") else {}
        chain = [d for d in cfg.get("defences", []) if d["name"] != "none"]
        run = Path(store) / t["run_dir"] if store is not None else None
        if not chain or run is None or not run.is_dir():
            why = "no defence of the chain adds noise" if not chain else f"its run is not in the store ({t['run_dir']})"
            rec["bound"] = {"bounded": False, "why": why}
        else:
            mode = "label-shielded" if is_shielded(t) else "u-shape" if t.get("u_shape") else "plain"
            truth = eval_token_ids(run, docs, phase="train")
            rec["bound"] = audit_bound(
                run, chain, mode, draws_of(cfg), docs, truth, models.of(run).model, mechanism=False
            )
        top = rec["bound"].get("token_bound") if rec["bound"].get("bounded") else None
        for r in readers:
            if top is not None and r["tokens"]["low"] > top + 1e-9:
                rec["faults"].append(
                    f"{r['label']} reads {fmt_pct(r['tokens']['estimate'])} % of the training tokens (95 % interval "
                    f"from {fmt_pct(r['tokens']['low'])} %), above the bound of {fmt_pct(top)} %"
                )
            if r["control"] == "detected":
                rec["faults"].append(
                    f"{r['label']}'s mis-paired twin reads the documents it is labelled as: it reads the text, not the "
                    "traffic"
                )
    return out


def passes_section(doc: Document, records: Sequence[dict[str, Any]]) -> None:
    """The section: one row per run and reader, the bound beside them; faults first in the text."""
    if not records:
        return
    doc.add(Heading(2, HEADING))
    doc.add(
        Para(
            "Fine-tuning sends each training document once per pass, each time with fresh noise, and the server "
            "knows which rows are one document's. Here the grid's readers of the training traffic (attack entries "
            "with `phase: train`): a document's reading is the mean over its crossings of the share of its tokens "
            "read right, with a 95 % interval over the training documents; a reader of every crossing is set "
            "against the reader of one crossing it adapts (paired, same documents). Each reading has its "
            "mis-paired twin (every crossing of another training document, labelled as this one). Beside them, the "
            "most any reader of the same crossings can read of a token (informed adversary, replace-one, every "
            "crossing the tap recorded composed with dp-accounting's PLD), or why there is no bound."
        )
    )
    for r in records:
        for f in r["faults"]:
            doc.add(Para(f"**INSTRUMENT FAULT** ({r['model']}, {r['defence']}, seed {r['seed']}): {f}."))
    rows = []
    for r in records:
        b = r["bound"]
        bound = fmt_pct(b["token_bound"]) if b.get("bounded") else f"100 (no bound: {b.get('why')})"
        gain_of = {g["reader"]: g for g in r["gains"]}
        for rd in r["readers"]:
            t = rd["tokens"]
            g = gain_of.get(rd["label"])
            gain = (
                ""
                if g is None
                else f"{100 * g['estimate']:+.2f} pp [{100 * g['low']:+.2f}, {100 * g['high']:+.2f}] over {g['against']}"
            )
            rows.append(
                [
                    r["model"], "" if r["depth"] is None else str(r["depth"]), f"`{r['defence']}`", str(r["seed"]),
                    str(r["crossings"]), rd["label"],
                    f"{fmt_pct(t['estimate'])} [{fmt_pct(t['low'])}, {fmt_pct(t['high'])}]", gain,
                    rd["control"] or "not run", bound,
                ]
            )  # fmt: skip
    doc.add(
        Table(
            [
                "model",
                "depth",
                "defence",
                "seed",
                "crossings per document",
                "reader",
                "token recovery (%) [95 %]",
                "gain of reading every crossing",
                "mis-paired twin",
                "no reader above (%)",
            ],
            rows,
            caption="The training documents of each run, read as the server received them.",
        )  # fmt: skip
    )
