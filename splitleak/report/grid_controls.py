"""The grid report's negative controls: every token attack job's mis-paired twin
(``splitleak.audit.verdicts``), tested as one Bonferroni family over the grid's jobs, per attack and
copy, with each detected job named as an instrument fault above the protocol's tests."""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from splitleak.audit.protocol import Protocol
from splitleak.audit.verdicts import control_p_value
from splitleak.report.document import Document, Heading, Para, Table
from splitleak.report.grid_common import Ctx, count, pp

#: the family-wise level of a grid's negative controls (Bonferroni over its jobs) where the protocol names none
CONTROL_ALPHA = 0.05


def control_alpha(protocol: Protocol) -> tuple[float, str]:
    """The family-wise level of the grid's negative controls, and where it comes from: the protocol's
    ``thresholds.alpha``, else its main test's α, else its family's, else ``CONTROL_ALPHA`` (said so)."""
    th = protocol.thresholds
    if "alpha" in th and isinstance(th["alpha"], (int, float)) and 0 < float(th["alpha"]) < 1:
        return float(th["alpha"]), f"protocol {protocol.name}'s thresholds.alpha"
    if protocol.main_test is not None:
        return protocol.main_test.alpha, f"protocol {protocol.name}'s main test"
    if protocol.family is not None:
        return protocol.family.alpha, f"protocol {protocol.name}'s family"
    return CONTROL_ALPHA, f"splitleak's default (protocol {protocol.name} names no level)"


def job_controls(attack_rows: Sequence[dict[str, Any]], alpha: float = CONTROL_ALPHA) -> list[dict[str, Any]]:
    """One record per attack job whose result holds a mis-paired negative control
    (``splitleak.audit.verdicts``): its fields, N, the one-sided p-value of its differences
    (``control_p_value``) and ``fault``: detected in the family of the grid's controls, p below ``alpha``
    over the number of jobs with a control (Bonferroni; a grid of thousands of jobs would otherwise flag
    some attack whose reading varies with its batch by chance)."""
    seen: dict[str, dict[str, Any]] = {}
    for r in attack_rows:
        if r["key"] in seen or not r.get("result_json"):
            continue
        control = json.loads(r["result_json"]).get("control")
        if control is not None:
            seen[r["key"]] = {"row": r, **control, "p": control_p_value(control["per_doc_delta"])}
    out = list(seen.values())
    for c in out:
        c["fault"] = c["p"] < alpha / len(out)
    return out + probe_controls(attack_rows)


def probe_controls(attack_rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per probe battery job whose result holds its shuffled-label twin (002: it must read at floor):
    ``fault`` where the twin was detected in any view, at the battery's own family level (α over its arms, from
    the protocol the job ran under; not corrected again over the grid's batteries, which can only flag more)."""
    seen: dict[str, dict[str, Any]] = {}
    for r in attack_rows:
        if r["key"] in seen or not r.get("result_json"):
            continue
        probes = json.loads(r["result_json"]).get("probes") or {}
        twin = probes.get("negative_control")
        if twin is None:
            continue
        best = probes.get("control_of_best_arm")
        seen[r["key"]] = {
            "row": r,
            "type": twin.get("type"),
            "detected_in": list(twin.get("detected_in", [])),
            "fault": bool(twin.get("detected_in")),
            "p": None,
            "effect": {"estimate": best, "high": None},
        }
    return list(seen.values())


def _fault_text(c: dict[str, Any]) -> str:
    if c["p"] is None:
        return f"{_job_text(c['row'])}: its shuffled-label twin reads above floor in {', '.join(c['detected_in'])}"
    return f"{_job_text(c['row'])}: N = {pp(c['effect']['estimate'])} pp, p = {c['p']:.2g}"


def control_faults(attack_rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The jobs whose mis-paired control was detected in the grid's family: an attack that read the documents
    it was labelled as from traffic of other documents, so its readings are not readings of the traffic."""
    return [c for c in job_controls(attack_rows) if c["fault"]]


def _job_text(r: dict[str, Any]) -> str:
    parts = [str(r.get("attack"))]
    parts += [
        f"{k}={r[k]}" for k in ("k", "budget", "client_copy", "defence", "depth", "victim_seed") if r.get(k) is not None
    ]
    return " ".join(parts) + f" (job {str(r['key'])[:12]})"


def controls_section(doc: Document, ctx: Ctx, attack_rows: Sequence[dict[str, Any]]) -> None:
    """The mis-paired negative control of every token and partition attack job, and the shuffled-label twin of
    every probe battery: per attack and copy, how many jobs ran one and how many read above floor; every
    detected job by name. A detected control is an instrument
    fault: the protocol's tests below are not to be read until it is explained."""
    doc.add(Heading(2, "Negative controls"))
    alpha, source = control_alpha(ctx.used)
    controls = job_controls(attack_rows, alpha)
    if not controls:
        doc.add(Para("Omitted: no attack job of this store ran a mis-paired negative control.", "note"))
        return
    mispaired = [c for c in controls if c["p"] is not None]
    caption = []
    if mispaired:
        caption.append(
            "N: each job's mis-paired twin, the same fitted attack given the traffic of other documents of its "
            f"run ({len(mispaired[0]['doc_ids'])} documents, whole frames) and scored against the labels of the "
            "documents it is labelled as, minus the job's own reading of that traffic scored against the same "
            "labels. An attack that reads only the traffic reads 0; one that reaches the evaluation text by the "
            "documents' identity reads above it. Detected: a one-sided t-test of the job's per-document "
            f"differences, p below {alpha:g} ({source}) / {len(mispaired):,} (Bonferroni over the jobs with a "
            "control)."
        )
    if len(mispaired) < len(controls):
        caption.append(
            "A probe battery's shuffled-label twin: the battery trained on shuffled labels and scored against the "
            "true ones; its best arm's paired effect is shown, and it is detected where any view's family test (at "
            "the α of the protocol the job ran under, over the battery's arms) reads it above floor."
        )
    doc.add(_controls_table(controls), Para(" ".join(caption), "caption"))
    faults = [c for c in controls if c["fault"]]
    if faults:
        ctx.rep.control_faults = faults
        doc.add(
            Para(
                f"**INSTRUMENT FAULT**: the negative control of {count(len(faults), 'job')} reads above its floor, "
                "so those attacks read the evaluation text by the documents' identity rather than through the "
                "traffic; no test of this report is to be read until that is explained: "
                + "; ".join(_fault_text(c) for c in faults[:20])
                + ("" if len(faults) <= 20 else f"; and {len(faults) - 20} more")
                + ".",
                "note",
            )
        )


def _controls_table(controls: Sequence[dict[str, Any]]) -> Table:
    """Per attack and copy: the jobs with a control, how many were detected, the mean N and the largest upper end."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in controls:
        groups.setdefault((str(c["row"].get("attack")), str(c["row"].get("client_copy"))), []).append(c)
    table = []
    for (attack, copy), cs in sorted(groups.items()):
        est = [c["effect"]["estimate"] for c in cs if c["effect"]["estimate"] is not None]
        high = [c["effect"]["high"] for c in cs if c["effect"]["high"] is not None]
        table.append(
            [
                attack if cs[0]["p"] is not None else f"{attack} (shuffled-label twin, best arm)",
                copy,
                str(len(cs)),
                str(sum(c["fault"] for c in cs)),
                pp(float(np.mean(est))) if est else "n/a",
                pp(max(high)) if high else "n/a",
            ]
        )
    return Table(["attack", "copy", "jobs", "detected", "mean N (pp)", "largest upper end (pp)"], table)
