"""The table ``splitleak attack`` prints for one attack result: a (measure, value) row per score the
result holds, laid out by what the attack outputs (labels, tokens, a probe verdict, a partition, a score
per document), then its run time. The rows are text; the CLI draws them."""

from __future__ import annotations

from typing import Any

from splitleak.metrics import fmt_pct

Row = tuple[str, str]


def attack_rows(res: dict[str, Any]) -> list[Row]:
    """The rows of one ``run_attack`` result (``splitleak.audit.evaluate``), in the order they print."""
    rows: list[Row] = []
    if res.get("label_recovery") is not None:  # a label attack (gma-sl): the labels are tokens 1 … T-1
        rows += _label_rows(res)
    if res.get("token_recovery") is not None:
        rows += _token_rows(res)
    elif "probes" in res:
        rows += _probe_rows(res["probes"], res.get("learnt_from"))
    elif "partition" in res:
        rows += _partition_rows(res["partition"], res.get("control"), res.get("shadow"))
    else:
        for p in res["properties"]:
            rows.append((f"AUC, token {p['token_id']}", "n/a" if p["auc"] is None else f"{p['auc']:.4f}"))
        rows.append(("leakage index I", f"{res['leakage_index']:.4f}"))
    rows.append(("seconds", f"{res['seconds']:.1f}"))
    return rows


def _label_rows(res: dict[str, Any]) -> list[Row]:
    """Label tokens and the answer's label tokens recovered, ROUGE and METEOR of the label text."""
    rows = [("label tokens recovered (%)", fmt_pct(res["label_recovery"]))]
    if res.get("answer_label_recovery") is not None:
        rows.append(("answer label tokens recovered (%)", fmt_pct(res["answer_label_recovery"])))
    for key, title in (("rouge1_f", "ROUGE-1 F"), ("rouge2_f", "ROUGE-2 F"), ("rougeL_f", "ROUGE-L F")):
        rows.append((f"{title} of the label text", f"{res[key]:.4f}"))
    rows.append(("METEOR", "n/a (nltk has no WordNet here)" if res.get("meteor") is None else f"{res['meteor']:.4f}"))
    return rows


def _token_rows(res: dict[str, Any]) -> list[Row]:
    """Token, whole-document and span recovery, the mis-paired control, and what some attacks add (the
    mixing weight, the probe rows, leading-space errors)."""
    rows = [("token recovery (%)", fmt_pct(res["token_recovery"]))]
    if res.get("control") is not None:
        c = res["control"]
        e = c["effect"]
        rows.append(
            (
                f"mis-paired control N (pp, {len(c['doc_ids'])} documents)",
                f"{100 * e['estimate']:+.2f} [{100 * e['low']:+.2f}, {100 * e['high']:+.2f}] ({c['verdict']})",
            )
        )
    rows.append(("whole-document recovery (%)", fmt_pct(res["doc_recovery"])))
    for cls, v in res["span_recovery"].items():
        rows.append((f"{cls} spans (%) [{res['span_counts'][cls]}]", "n/a" if v is None else fmt_pct(v)))
    if res.get("lambda") is not None:
        rows.append(
            ("mixing weight λ" + (" (estimated)" if res.get("lambda_estimated") else ""), f"{res['lambda']:.4f}")
        )
    probe = res.get("probe_rows") or {}
    if probe.get("scored"):
        rows.append(("probe rows: training tokens read (%)", fmt_pct(probe["token_recovery"])))
        rows.append(("probe rows: share of training tokens exposed (%)", fmt_pct(probe["training_token_share"])))
    if res.get("leading_space_errors") is not None:
        rows.append(
            ("wrong tokens / of them leading-space only", f"{res['wrong_tokens']} / {res['leading_space_errors']}")
        )
    return rows


def _probe_rows(pr: dict[str, Any], learnt: dict[str, Any] | None = None) -> list[Row]:
    """What the battery learnt from (its threat model), the probes' constant control, each view's best paired
    effect, the best arm and the verdicts; an oracle battery's verdicts are marked an upper bound."""
    const, v = pr["constant"], pr["verdict"]
    rows: list[Row] = []
    if learnt is not None and learnt.get("threat") == "oracle":
        rows.append(("threat model", "ORACLE: " + str(learnt.get("upper_bound", "an upper bound, not a verdict"))))
    elif learnt is not None:
        rows.append(
            (
                f"threat model: {learnt['threat']}",
                f"{learnt['train_frames']} + {learnt['capture_frames']} shadow frames of {learnt['documents']} "
                f"documents; rows taken as real: {learnt['rows_taken_as_real']}",
            )
        )
    rows.append(("most-frequent-token control (%)", fmt_pct(const["accuracy"])))
    for view, vv in pr["by_view"].items():
        if "best_arm" in vv:
            rows.append((f"{view}: best paired effect (pp)", f"{100 * vv['paired_effect']:+.2f} ({vv['verdict']})"))
    if "best_arm" in v:
        rows.append(("best eligible arm", v["best_arm"]))
        rows.append(
            (
                "its paired effect (pp), " + v["family_correction"],
                f"{100 * v['paired_effect']:+.2f} [{100 * v['paired_low']:+.2f}, {100 * v['paired_high']:+.2f}]",
            )
        )
        rows.append(("gate statistic G (pp)", f"{100 * v['gate_statistic']:+.2f}"))
    rows.append(("verdict (every eligible arm, J = " + str(v.get("J", 0)) + ")", v["verdict"]))
    if pr.get("protocol_verdict") is not None:
        pv = pr["protocol_verdict"]
        rows.append((f"under {pv['thresholds']['protocol']} (J = {pv['J']} per view)", pv["verdict"]))
    if pr.get("control_of_best_arm") is not None:
        rows.append(("its shuffled-label twin (pp)", f"{100 * pr['control_of_best_arm']:+.2f}"))
    if pr.get("instrument_fault"):
        views = ", ".join(pr["negative_control"].get("detected_in") or [])
        rows.append(("INSTRUMENT FAULT", f"the shuffled-label twin reads detected in {views}: no verdict"))
    return rows


def _partition_rows(
    part: dict[str, Any], control: dict[str, Any] | None = None, shadow: dict[str, Any] | None = None
) -> list[Row]:
    """How well the decoy system's real rows were told from its decoys, what the attacker learnt from (its
    own shadow frames), and the mis-paired control."""
    rows = [
        ("frames partitioned exactly", f"{part['frames_exact']} / {part['frames']}"),
        ("row agreement", f"{part['row_agreement']:.4f}"),
        ("real rows (share)", f"{part['real_row_share']:.4f}"),
        ("AUC of the row scores", "n/a" if part["auc"] is None else f"{part['auc']:.4f}"),
    ]
    if shadow is not None:
        rows.append(
            (
                "learnt from (the attacker's own frames)",
                f"{shadow['train_frames']} + {shadow['capture_frames']} shadow frames of {shadow['documents']} documents",
            )
        )
    if control is not None:
        e = control["effect"]
        words = "INSTRUMENT FAULT" if control.get("instrument_fault") else control["verdict"]
        rows.append(
            (
                f"mis-paired control N (pp of rows, {len(control['doc_ids'])} frames)",
                f"{100 * e['estimate']:+.2f} [{100 * e['low']:+.2f}, {100 * e['high']:+.2f}] ({words})",
            )
        )
    return rows
