"""A protocol analysis (``splitleak.audit.analysis``) as Markdown: the main test, the Bonferroni
family and the partial-offloading tests."""

from __future__ import annotations

from typing import Any

from splitleak.audit.analysis import Analysis, ComparisonResult


def analysis_markdown(a: Analysis) -> str:
    def fmt(c: ComparisonResult) -> str:
        if c.missing:
            return f"missing ({c.missing})"
        assert c.estimate is not None and c.low is not None and c.high is not None  # set unless missing
        return (
            f"{100 * c.estimate:+.2f} pp, interval [{100 * c.low:+.2f}, {100 * c.high:+.2f}] at α = {c.alpha:.4g}; "
            f"{'passes' if c.passes else 'fails'} (mark {100 * c.mark:+.2f} pp; {c.n_models} models × {c.n_docs} documents)"
        )

    lines = [f"# Analysis under protocol `{a.protocol}`", "", f"Protocol SHA-256 `{a.protocol_hash}`.", ""]
    if a.main is not None:
        lines += [
            "## Main test",
            "",
            f"{selection_text(a.main.treatment)} − {selection_text(a.main.control)}: {fmt(a.main)}",
            "",
        ]
    if a.family:
        n_pass = sum(c.passes for c in a.family)
        lines += [
            "## Family",
            "",
            f"{n_pass} of {len(a.family)} comparisons pass at α = {a.family_alpha:.4g} each (Bonferroni).",
            "",
            "| treatment | control | difference |",
            "|---|---|---|",
        ]
        lines += [f"| {selection_text(c.treatment)} | {selection_text(c.control)} | {fmt(c)} |" for c in a.family]
        lines.append("")
    if a.partial_offloading:
        lines += [
            "## Partial offloading",
            "",
            "| model | defence | outcome | runs | partial R² | interval | p | passes | "
            "held-out RMSE (length → with start) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in a.partial_offloading:
            if "missing" in r:
                lines.append(
                    f"| {r['model']} | {r['defence']} | {r['outcome']} | {r['runs']} | missing: {r['missing']} "
                    "| | | | |"
                )
                continue
            h = r.get("heldout") or {}
            ht = (
                "n/a"
                if not h or "missing" in h
                else f"{h['rmse_length']:.4f} → {h['rmse_with_start']:.4f} ({100 * h['reduction']:+.1f} %; "
                f"{'≥' if h['passes'] else '<'} {100 * h['required']:.0f} %)"
            )
            lines.append(
                f"| {r['model']} | {r['defence']} | {r['outcome']} | {r['runs']} | {r['partial_r2']:.4f} | "
                f"[{r['low']:.4f}, {r['high']:.4f}] | {r['p_value']:.4g} | {'yes' if r['passes'] else 'no'} | "
                f"{ht} |"
            )
        lines.append("")
    if a.gate:
        lines += gate_markdown(a)
    if a.notes:
        lines += ["## Not evaluated", ""] + [f"- {n}" for n in a.notes] + [""]
    return "\n".join(lines)


def _pp(x: Any) -> str:
    return "n/a" if x is None else f"{100 * x:+.2f}"


def gate_markdown(a: Analysis) -> list[str]:
    """The gate test's verdicts: per probe-battery result, each view over the protocol's family; per split
    run, the gate over its token attacks; with the thresholds and J each used."""
    th = a.gate_thresholds or {}
    util = th.get("utility_ce_increase_max")
    lines = [
        "## Gate (Politis & Pappas 2026, Eq. 1)",
        "",
        f"Read at the protocol's gate +{100 * th.get('gate', float('nan')):.2f} pp, α = {th.get('alpha')}, declared "
        f"J = {th.get('arms')}, utility gate "
        + ("none declared" if util is None else f"≤ {util:g} nats of held-out cross-entropy")
        + ". J is always the number of arms compared; where it differs from the declared J the verdict says so.",
        "",
        "| result | run | J | verdict | passes |",
        "|---|---|---|---|---|",
    ]
    for g in a.gate:
        where = g.get("result") or ", ".join(g.get("results", []))
        run = f"{g.get('model')} seed {g.get('victim_seed')}"
        ok = {True: "yes", False: "no", None: "undecided"}[g.get("passes")]
        lines.append(f"| {where} | {run} | {g.get('J')} | {g['verdict']} | {ok} |")
    lines.append("")
    for g in a.gate:
        if g["kind"] != "latent probe battery":
            continue
        lines += [
            f"### {g['result']}: per view",
            "",
            "| view | family measured / declared | J | best arm | effect at α/J (pp) | verdict | G (pp) | gate |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for view, v in g["by_view"].items():
            lines.append(
                f"| {view} | {v.get('family_measured', 0)} / {v.get('declared_J')} | {v.get('J')} | "
                f"{v.get('best_arm', 'n/a')} | {_pp(v.get('paired_effect'))} [{_pp(v.get('paired_low'))}, "
                f"{_pp(v.get('paired_high'))}] | {v.get('verdict')} | {_pp(v.get('gate_statistic'))} | "
                f"{v.get('decision')} |"
            )
        if g.get("outside_family"):
            lines.append("")
            lines.append(f"Outside the protocol's family (not in J): {', '.join(g['outside_family'])}.")
        twin = g.get("negative_control")
        lines.append("")
        if twin is None:
            lines.append("Negative control: none ran (the battery's shuffled-label twin was not measured).")
        else:
            where = ", ".join(twin.get("detected_in") or []) or "no view"
            lines.append(
                f"Negative control ({twin.get('type') or 'shuffled-label twin'}), which must read at floor: "
                f"{twin['verdict']}, detected in {where}; read at {twin.get('read_at', 'the job’s thresholds')}."
                + (" **INSTRUMENT FAULT**: no verdict." if g.get("instrument_fault") else "")
            )
        lines.append("")
    return lines


def selection_text(s: dict[str, Any]) -> str:
    """A selector of results as ``key=value, ...`` (``(all)`` when it selects everything)."""
    return ", ".join(f"{k}={v}" for k, v in s.items()) or "(all)"
