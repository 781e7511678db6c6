"""The grid report's upper side: for every defended run of the grid (plain, U-shape or label-shielded), the most any reader of its
traffic can read (``splitleak.audit.bounds``: every crossing the tap recorded, composed under the chain's noise
guarantees, for the informed adversary), beside the strongest reading of the grid's attacks on that run. A
reading whose interval lies above the bound, or a mechanism that tells its neighbours apart better than it
declares, is an instrument fault; a chain without a noise guarantee has no bound, and the report says so."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from splitleak.metrics import fmt_pct
from splitleak.report.document import Document, Heading, Para, Table
from splitleak.report.grid_shielded import is_shielded
from splitleak.report.grid_stats import scored, token_rate
from splitleak.training.config import draws_of

HEADING = "The upper side: what no reader can read"


def strongest_reading(attack_rows: Sequence[dict[str, Any]], train_key: str) -> dict[str, Any] | None:
    """The attack job on run ``train_key`` with the highest mean token recovery over its documents: its name,
    the mean, a normal 95 % interval over documents and the number of documents (None: no token attack read it)."""
    by_job: dict[str, list[dict[str, Any]]] = {}
    for r in scored(attack_rows):
        if r.get("train_key") == train_key:
            by_job.setdefault(r["key"], []).append(r)
    best: dict[str, Any] | None = None
    for rows in by_job.values():
        rates = np.array([token_rate(r) for r in rows], dtype=float)
        rates = rates[~np.isnan(rates)]
        if not len(rates):
            continue
        mean = float(rates.mean())
        half = 1.96 * float(rates.std(ddof=1)) / math.sqrt(len(rates)) if len(rates) > 1 else math.inf
        if best is None or mean > best["mean"]:
            name = f"{rows[0]['attack']} ({rows[0].get('client_copy') or 'public'})"
            low, high = max(0.0, mean - half), min(1.0, mean + half)  # a share: the normal interval cut to [0, 1]
            best = {"attack": name, "mean": mean, "low": low, "high": high, "documents": len(rates)}
    return best


class PublicModels:
    """The public models of the runs, loaded once per (model, precision, init seed, path)."""

    def __init__(self) -> None:
        self.loaded: dict[tuple, Any] = {}

    def of(self, run: Path):
        # lazy: the report loads a model only where a run has a noise guarantee to bound
        from splitleak.attacks.knowledge import public_model
        from splitleak.models.presets import load_model
        from splitleak.runs.manifest import read_manifest
        from splitleak.seeds import model_init_seed

        cfg = read_manifest(run)["config"]
        key = (cfg["model"], cfg["precision"], model_init_seed(cfg["seed"]), cfg.get("model_path"))
        if key not in self.loaded:
            self.loaded[key] = load_model(key[0], precision=key[1], seed=key[2], model_path=key[3])
        return public_model(run, self.loaded[key])  # checked against the fingerprint the run recorded


def run_bounds(
    train_rows: Sequence[dict[str, Any]], attack_rows: Sequence[dict[str, Any]], store: str | Path | None
) -> list[dict[str, Any]]:
    """One record per defended run: its cell, the strongest reading, and its bound (``audit.bounds``) or why it has
    none; ``fault`` names an instrument fault (a reading above the bound, or a mechanism that fails its game)."""
    # lazy: the bound reads the runs' captures and the public models (torch), only where a report asks for it
    from splitleak.audit.bounds import audit_bound
    from splitleak.defences import build_defence
    from splitleak.privacy.guarantee import chain_guarantees
    from splitleak.runs.truth import phase_documents

    models = PublicModels()
    games: dict[str, list[dict[str, Any]]] = {}  # the mechanism's game reads no run: played once per chain
    out = []
    for t in sorted(train_rows, key=lambda t: (t["model"], t["depth"] or 0, t["defence"], t["victim_seed"])):
        cfg = json.loads(t["train_config"]) if t.get("train_config") else None
        chain = [d for d in cfg["defences"] if d["name"] != "none"] if cfg else []
        if not chain and (cfg or t["defence"] == "none"):
            continue
        rec: dict[str, Any] = {
            "model": t["model"],
            "depth": t["depth"],
            "defence": t["defence"],
            "seed": t["victim_seed"],
            "reading": strongest_reading(attack_rows, t["key"]),
            "fault": None,
        }
        out.append(rec)
        if cfg is None:
            rec["why"] = "its store row records no training configuration (a row written by hand, or by an old version)"
            continue
        guarantees = chain_guarantees([build_defence(d["name"], dict(d.get("args") or {})) for d in chain])
        if not guarantees.by_channel:
            rec["why"] = "no defence of the chain adds noise with a formal guarantee"
            continue
        run = Path(store) / t["run_dir"] if store is not None else None
        if run is None or not run.is_dir():
            rec["why"] = f"its run is not in the store ({t['run_dir']})"
            continue
        docs = phase_documents(run, "capture")
        truth = np.array([d.token_ids for d in docs], dtype=np.int64)
        mode = "label-shielded" if is_shielded(t) else "u-shape" if t.get("u_shape") else "plain"
        played = json.dumps(chain, sort_keys=True)
        b = audit_bound(
            run, chain, mode, draws_of(cfg), [d.doc_id for d in docs], truth, models.of(run).model,
            mechanism=played not in games,
        )  # fmt: skip
        b["mechanism_audit"] = games.setdefault(played, b.get("mechanism_audit", []))
        rec["bound"] = b
        failed = [m for m in b.get("mechanism_audit", []) if m["fault"]]
        reading = rec["reading"]
        if failed:
            m = failed[0]
            rec["fault"] = (
                f"{m['defence']}'s {m['channel']} release tells its neighbours apart at ε ≥ {m['epsilon_lower']:.3g}, "
                f"above the {m['epsilon_claimed']:.3g} it declares"
            )
        elif b.get("bounded") and reading is not None and reading["low"] > b["token_bound"]:
            rec["fault"] = (
                f"{reading['attack']} reads {fmt_pct(reading['mean'])} % of tokens (95 % interval from "
                f"{fmt_pct(reading['low'])} %), above the bound of {fmt_pct(b['token_bound'])} %"
            )
        if not b.get("bounded"):
            rec["why"] = b.get("why")
    return out


def bound_section(doc: Document, records: Sequence[dict[str, Any]]) -> None:
    """The section: one row per defended run, both sides, faults first in the text."""
    if not records:
        return
    doc.add(Heading(2, HEADING))
    doc.add(
        Para(
            "Every other section reports what the grid's attacks read: a lower bound on what a reader can read. "
            "Here, for each defended run, the other side: the mean over its evaluation documents of the most any "
            "reader of its traffic can read of a token, and of a whole document (every crossing of the document's "
            "rows the tap recorded, in every pass, composed under the chain's noise guarantees with dp-accounting's "
            "PLD; replace-one neighbours; the informed adversary, who knows every other token; κ from the public "
            "model). In a plain split it is stated for an observer of the activations and gradients: the server "
            "that computes the loss reads the labels in clear. A chain without a noise guarantee has no bound: a "
            "stronger reader may read up to 100 %. A reading whose interval lies above the bound, or a mechanism "
            "whose noise tells neighbours apart better than it declares, is an instrument fault (a bug in the "
            "defence, the accountant or the scorer)."
        )
    )
    faults = [r for r in records if r["fault"]]
    for r in faults:
        doc.add(Para(f"**INSTRUMENT FAULT** ({r['model']}, {r['defence']}, seed {r['seed']}): {r['fault']}."))
    rows = []
    for r in records:
        reading = r["reading"]
        read = (
            "n/a"
            if reading is None
            else f"{reading['attack']}: {fmt_pct(reading['mean'])} [{fmt_pct(reading['low'])}, {fmt_pct(reading['high'])}]"
        )
        b = r.get("bound") or {}
        bounded = bool(b.get("bounded"))
        eps = b.get("epsilon_doc_max")
        verdict = (
            "INSTRUMENT FAULT" if r["fault"] else ("both sides" if bounded else f"no formal bound: {r.get('why')}")
        )
        rows.append(
            [
                r["model"],
                "" if r["depth"] is None else str(r["depth"]),
                f"`{r['defence']}`",
                str(r["seed"]),
                read,
                fmt_pct(b["token_bound"]) if bounded else "100 (no bound)",
                fmt_pct(b["doc_bound"]) if bounded else "—",
                "—" if eps is None or not bounded else f"{eps:.3g}",
                verdict,
            ]
        )
    doc.add(
        Table(
            [
                "model",
                "depth",
                "defence",
                "seed",
                "strongest reading, token recovery (%) [95 %]",
                "no reader above (%)",
                "whole documents: no reader above (%)",
                "ε per document",
                "verdict",
            ],
            rows,
            caption="Both sides per defended run. ε: the largest over the run's documents, at δ = 1e-5.",
        )
    )
