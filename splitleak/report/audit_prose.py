"""The audit's words: its verdict, the worst-case readers, what it did not measure, and its one-line
summary, written from what the audit measured (``splitleak.audit.run`` passes its report record and
``AuditSetting`` to ``audit_words``, which the CLI hands it). They go into ``report.json`` beside the
numbers they read, so that ``splitleak.report.audit`` renders the report from that file alone.

The verdict uses the words of Politis & Pappas 2026, §3 (``splitleak.audit.verdicts``): each attack
arm's token top-1 accuracy is a paired effect over the constant baseline (**detected** / **at floor**),
beside its mis-paired negative control; the gate G over the arms **breaks** above its threshold. An
"at floor" verdict stands only where the injected-leak calibration detected a leak on the same capture.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from splitleak.audit.channels import IN_CLEAR, not_attacked
from splitleak.audit.evaluate import attack_label
from splitleak.audit.examples import worst_reader
from splitleak.audit.run import AuditSetting
from splitleak.defences import build_defence
from splitleak.metrics import fmt_pct
from splitleak.training.config import split_mode_of

#: what each copy means for a reader of the report
THREAT_MODELS = {
    "public": "an observer of the activations and gradients (no labels) with the public pretrained weights of the "
    "client layers",
    "trained": "an attacker holding the client's trained layers",
}
#: the third threat model, which no attack needs to play: the server reads every channel it receives
SERVER_THREAT = "the untrusted server itself: every channel it receives, the labels included where the split sends them"


def audit_words(record: dict[str, Any], setting: AuditSetting) -> dict[str, Any]:
    """The sentences of an audit's ``report.json`` (``verdict_parts``, ``summary``, ``threat_models``),
    from its record of what was measured and the setting it was asked for."""
    results, channels = record["attacks"], record["channels"]
    parts = [
        verdict_line(results, record["verdicts"]),
        bound_sentence(results, record.get("bound")),
        whole_traffic_sentence(record.get("whole_traffic")),
        record["verdicts"]["utility_gate"]["sentence"],
        server_sentence(channels, results, record["mode"]),
        readers_sentence(results),
        adaptive_sentence(results, setting.cfg),
        channels_sentence(channels),
    ]
    return {
        "verdict_parts": [p for p in parts if p],
        "summary": summary_line(record, setting),
        "threat_models": {**THREAT_MODELS, "server": SERVER_THREAT},
    }


def summary_line(record: dict[str, Any], setting: AuditSetting) -> str:
    """The audit in one paragraph: model, split, defence, data, utility, what was captured, the run's
    verification, where the traffic came from and the cost of the defence."""
    m, baseline, cap, cost = record["metrics"], record["utility_baseline"], record["capture"], record["cost"]
    utility_text = (
        f"held-out CE {m['heldout_ce']:.4f} ("
        + (
            f"all-local {baseline['all_local_ce']:.4f}, ΔU {baseline['delta_u']:+.4f}"
            if baseline["delta_u"] is not None
            else "ΔU not measured"
        )
        + f"; {baseline['source']})"
        if m["heldout_ce"] is not None
        else f"held-out CE not measured on the client ({m.get('heldout_measured', '')})"
    )
    summary = (
        f"{setting.model}{' (preset)' if setting.preset else ''}, depth {setting.depth}, defence "
        f"{'+'.join(d['name'] for d in record['config']['defences'])}, {setting.data}: {utility_text}; captured "
        f"{cap['documents']} documents × {cap['tokens_per_document']} tokens × width {cap['width']}; run verified "
        f"({record['verify']})."
    )
    deployed = record["deployment"]
    if deployed is not None:
        summary += f" Deployed over TLS against {deployed['server']}; the attacks read " + (
            f"the server's capture ({Path(deployed['traffic']).name})."
            if deployed["recorded_by"] == "server"
            else "the client's record of the wire."
        )
    if cost is not None and cost["rel_ppl_change"] is not None:
        summary += (
            f" Cost of the defence: perplexity {m['perplexity']:.2f} against {cost['twin_perplexity']:.2f} "
            f"undefended ({100 * cost['rel_ppl_change']:+.2f} %)."
        )
    return summary


def adaptive_sentence(results: list[dict[str, Any]], cfg) -> str:
    """Who reads the traffic knowing the defence (Kerckhoffs): the strongest attack built for the run's
    defences under each threat model, beside the strongest that ignores them; empty without a defence."""
    chain = [d for d in cfg.defences if d.name != "none"]
    if not chain:
        return ""
    built = [r for r in results if r.get("built_for")]
    names = ", ".join(d.name for d in chain)
    gaps = sorted({build_defence(d.name, d.args).adaptive_gap(split_mode_of(cfg)) for d in chain} - {""})
    if not built:
        return (
            f"No attack built for {names} read this traffic: the verdict rests on attacks that ignore the defence"
            + (f". Why none applies here: {' '.join(gaps)}." if gaps else ".")
        )
    parts = [text for copy in THREAT_MODELS if (text := _aware_reading(results, built, copy))]
    for r in built:
        summary = r.get("attack_summary") or {}
        if summary.get("applies") and not summary.get("key_found"):
            parts.append(
                f"{attack_label(r)} tried {summary['tried']} run seeds as the key of the forward noise and found none "
                f"(draws={summary.get('draws')})"
            )
    notes = sorted({build_defence(d.name, d.args).adaptive_note for d in chain} - {""})
    return (
        f"Attacks built for {names} (they know its mechanism and public arguments): "
        + "; ".join(parts)
        + "."
        + (f" Why they apply: {' '.join(notes)}." if notes else "")
    )


def _aware_reading(results: list[dict[str, Any]], built: list[dict[str, Any]], copy: str) -> str:
    """The strongest attack built for the defence under the threat model ``copy``, beside the strongest
    that ignores it; empty where none built for it ran there."""
    aware = worst_reader([r for r in built if r.get("threat_model", "public") == copy])
    blind = worst_reader([r for r in results if not r.get("built_for") and r.get("threat_model", "public") == copy])
    if aware is None:
        return ""
    text = (
        f"{attack_label(aware)}{' on the public copy' if copy == 'public' else ''} reads {fmt_pct(aware['token_recovery'])} % of tokens and {fmt_pct(aware['doc_recovery'])} % of whole "
        "documents"
    )
    if blind is not None:
        more = (aware["doc_recovery"], aware["token_recovery"]) > (blind["doc_recovery"], blind["token_recovery"])
        text += (
            f", {'more than' if more else 'no more than'} the best attack that ignores the defence "
            f"({attack_label(blind)}: {fmt_pct(blind['token_recovery'])} %, {fmt_pct(blind['doc_recovery'])} %)"
        )
    found = (aware.get("attack_summary") or {}).get("key_found")
    if found:
        text += f"; it found the key of the client's draws (run seed {aware['attack_summary']['run_seed']})"
    return text


def server_sentence(channels: list[dict[str, Any]], results: list[dict[str, Any]], mode: str) -> str:
    """The third threat model: the untrusted server itself, which receives every channel that crosses. Where the
    labels cross (the plain split) it reads the whole text with no attack; elsewhere it reads what the
    observer reads, with the public copy of the client layers (it does not hold the client's)."""
    clear = [c for c in channels if c["channel"] in IN_CLEAR and c["captured"]]
    if clear:
        phases = sorted({p for c in clear for p in c["frames"]})
        return (
            "The untrusted server itself reads 100 % of tokens and 100 % of whole documents, with no attack: in the "
            f"{mode} split the labels of the next-token loss cross to it in clear (each document's token ids, in the "
            f"{' and '.join(phases)} frames), so the readers below bound only an observer of the activations and "
            "gradients, not the server. The splits that keep the labels on the client are the U-shape "
            "(`splitleak audit --mode u-shape`) and label-shielded fine-tuning (`--mode label-shielded`)."
        )
    worst = worst_reader([r for r in results if r.get("threat_model", "public") == "public"])
    if worst is None:
        return f"In the {mode} split the labels stay on the client; no reader of the server's channels ran."
    return (
        f"In the {mode} split the labels stay on the client: the untrusted server receives the channels the "
        f"observer reads, and with the public weights its worst reader is {attack_label(worst)} "
        f"({fmt_pct(worst['token_recovery'])} % of tokens, {fmt_pct(worst['doc_recovery'])} % of whole documents)."
    )


def channels_sentence(channels: list[dict[str, Any]]) -> str:
    """What the verdict does not cover: the channels no attack of the audit read, and those read
    without a positive control."""
    missed = not_attacked(channels)
    uncal = [c["channel"] for c in channels if c["status"] == "no positive control"]
    out = f"Channels not attacked: {', '.join(missed)}." if missed else "Every declared channel was attacked."
    if uncal:
        out += f" Attacked without a positive control: {', '.join(uncal)}."
    return out


def verdict_line(results: list[dict[str, Any]], verdicts: dict[str, Any]) -> str:
    """The audit's verdict in the words of Politis & Pappas 2026, §3, from each result's arm and the
    record's gate and calibration.

    A detection stands on its own (its mis-paired control guards against false positives); an
    "at floor" verdict needs the calibration to have detected an injected leak, or it is no
    evidence of absence and the verdict says UNCALIBRATED."""
    arms = [r["arm"] for r in results]
    faults = [a["name"] for a in arms if a["control_verdict"] == "detected"]
    if faults:
        return (
            f"INSTRUMENT FAULT: the mis-paired negative control of {', '.join(faults)} reads above its floor: given "
            "the traffic of other documents, the attack still reads the documents it is labelled as, so it reaches "
            "the evaluation text by the documents' identity rather than through the traffic; no verdict."
        )
    gate = verdicts["gate"]
    probe_arms = [a for a in arms if a["name"] in gate["arms"]]
    detected = [a for a in probe_arms if a["verdict"] == "detected"]
    cal, onset = _calibration_words(verdicts["calibration"])
    if not detected and onset is None:
        return (
            "UNCALIBRATED: no attack arm reads above the constant baseline, but the token top-1 metric did not "
            "detect even the largest injected leak on this capture, so its silence is no evidence of absence; "
            f"no verdict ({cal})."
        )
    best = max(probe_arms, key=lambda a: a["effect"]["estimate"])
    effect = best["effect"]
    scored = [r for r in results if r["attack"] != "majority" and r.get("doc_recovery") is not None]
    best_doc = max(scored, key=lambda r: (r["doc_recovery"], r["token_recovery"]))
    gate_words = f"gate G = {100 * gate['G']:+.2f} pp {'breaks the gate' if gate['breaks'] else 'holds the gate'} (+{100 * gate['gate']:.2f} pp)"
    controls = _controls_words(arms)
    if detected:
        return (
            f"LEAKS: {len(detected)} of {len(probe_arms)} attack arms detected above the constant baseline; "
            f"best {best['name']} recovers {fmt_pct(best['accuracy'])} % of tokens (+{100 * effect['estimate']:.2f} pp, "
            f"95 % interval [{100 * effect['low']:+.2f}, {100 * effect['high']:+.2f}]) and "
            f"{fmt_pct(best_doc['doc_recovery'])} % of whole documents ({attack_label(best_doc)}); {gate_words}; "
            f"{controls}; {cal}."
        )
    return (
        f"AT FLOOR: no attack arm reads above the constant baseline (best {best['name']}, "
        f"{100 * effect['estimate']:+.2f} pp, interval [{100 * effect['low']:+.2f}, "
        f"{100 * effect['high']:+.2f}]); {gate_words}; {controls}; {cal}, so a "
        "leak of that size would have been seen."
    )


def _controls_words(arms: list[dict[str, Any]]) -> str:
    """How many arms' mis-paired controls ran (none of them detected)."""
    measured = [a for a in arms if a["control"] is not None]
    if len(measured) == len(arms):
        return "no mis-paired control detected"
    if measured:
        return f"mis-paired controls run for {len(measured)} of {len(arms)} arms, none detected"
    return "no negative control run (--control-docs 0)"


def _calibration_words(calibration: dict[str, Any]) -> tuple[str, dict[str, float] | None]:
    """The calibration's clause of the verdict, and token top-1's onset (None: never detected)."""
    onset = calibration["onsets"].get("token_top1")
    if onset:
        return (
            f"calibration: injected into {calibration['documents']} captured documents, a leak is detected from "
            f"coverage {onset['coverage']:g} × amplitude {onset['amplitude']:g}",
            onset,
        )
    zero = calibration["zero_dose"]["token_top1"]
    return f"calibration: no injected dose raised token top-1 above its zero-dose reading of {fmt_pct(zero)} %", onset


def readers_sentence(results: list[dict[str, Any]]) -> str:
    """The worst-case reader under each threat model, the worst of all, and the exact-inversion
    certificate (SipIt without a budget on the trained copy)."""
    parts = []
    for copy, who in THREAT_MODELS.items():
        best = worst_reader([r for r in results if r.get("threat_model", "public") == copy])
        if best is not None:
            parts.append(
                f"{who} ({attack_label(best)}) reads {fmt_pct(best['token_recovery'])} % of tokens and "
                f"{fmt_pct(best['doc_recovery'])} % of whole documents"
            )
    if not parts:
        return ""
    worst = worst_reader(results)
    assert worst is not None
    return "Worst-case reader: " + "; ".join(parts) + f"; the worst is {attack_label(worst)}." + _certificate(results)


def _certificate(results: list[dict[str, Any]]) -> str:
    """The exact-inversion check's sentence: the check on the trained copy that certified the most
    positions (under a defence, the one that knows it: rounding, clip and noise model); empty where none ran."""
    checks = [
        r
        for r in results
        if r["attack"] in ("sipit", "sipit-aware")
        and r.get("threat_model") == "trained"
        and r.get("certified_tokens") is not None
    ]
    cert = max(checks, key=lambda r: r["certified_tokens"]) if checks else None
    if cert is None:
        return ""
    budget = cert.get("attack_params", {}).get("budget")
    bound = "the whole vocabulary if needed" if budget == "exhaustive" else f"up to {budget} checks per position"
    how = "SipIt through the trained layers" + (", knowing the defence" if cert["attack"] == "sipit-aware" else "")
    return (
        f" Exact-inversion check ({how}, {bound}): "
        f"{fmt_pct(cert['certified_tokens'])} % of positions matched an observed activation exactly "
        f"({cert['mean_checks_per_token']:.1f} checks per position on average)"
        + (
            ": the cut is injective on these documents, and the traffic is the text."
            if cert["certified_tokens"] == 1.0
            else "; the others were read as the nearest checked candidate (a defence, a copy that differs from "
            "the weights that produced the traffic"
            + ("" if budget == "exhaustive" else ", or a true token the order ranks beyond the bound")
            + ")."
        )
    )


def bound_sentence(results: list[dict[str, Any]], bound: dict[str, Any] | None) -> str:
    """The verdict's upper side (``splitleak.audit.bounds``): what no reader can read, beside what the strongest
    reader read; an INSTRUMENT FAULT where a reading's lower end lies above the bound (a bug in the defence, the
    accountant or the scorer)."""
    if bound is None:  # a report written before the bound existed
        return ""
    scored = [r for r in results if r["attack"] != "majority" and r.get("intervals")]
    if not bound.get("bounded") and bound.get("token_bound") is None:
        if caught := mechanism_fault(bound):
            return caught
        return f"Upper side: no formal bound ({bound['why']}): a stronger reader may read up to 100 % of tokens."
    best = max(scored, key=lambda r: r["intervals"]["tokens"]["estimate"]) if scored else None
    read = ""
    if best is not None:
        t = best["intervals"]["tokens"]
        read = (
            f"the strongest reader ({attack_label(best)}) read {fmt_pct(t['estimate'])} % of tokens "
            f"[{fmt_pct(t['low'])}, {fmt_pct(t['high'])}]; "
        )
        if t["low"] > bound["token_bound"] + 1e-9:
            return (
                f"INSTRUMENT FAULT: {attack_label(best)} reads {fmt_pct(t['low'])} % of tokens at the lower end of "
                f"its interval, above the {fmt_pct(bound['token_bound'])} % no reader can read under the chain's "
                "declared noise: the defence adds less noise than it declares, or the accountant or the scorer "
                "is wrong; no verdict on the upper side."
            )
    if caught := mechanism_fault(bound):
        return caught
    eps = bound.get("epsilon_doc_max")
    eps_words = f"ε ≤ {eps:.3g} at δ = {bound['delta']:g} per document, " if eps is not None else ""
    partial = (
        "" if bound["bounded"] else f" ({bound['documents_bounded']} of {bound['documents']} documents: {bound['why']})"
    )
    return (
        f"Upper side: {read}no reader can read more than {fmt_pct(bound['token_bound'])} % of tokens or "
        f"{fmt_pct(bound['doc_bound'])} % of whole documents ({eps_words}over up to {bound['crossings_max']} "
        f"recorded crossings; informed adversary, replace-one; prior κ {fmt_pct(bound['token_kappa'])} % per token, "
        f"{fmt_pct(bound['doc_kappa'])} % per document) against {bound['view']}{partial}."
    )


def mechanism_fault(bound: dict[str, Any]) -> str:
    """INSTRUMENT FAULT where the mechanism's game (``audit.dp_audit``) measured an ε above what the declared
    noise claims for its canaries; empty otherwise."""
    bad = [m for m in bound.get("mechanism_audit") or [] if m["fault"]]
    if not bad:
        return ""
    m = bad[0]
    return (
        f"INSTRUMENT FAULT: {m['defence']}'s {m['channel']} release tells its two canaries apart with ε ≥ "
        f"{m['epsilon_lower']:.3g} ({100 * (1 - m['alpha']):g} % confidence, {m['trials']} trials per world), above "
        f"the ε {m['epsilon_claimed']:.3g} its declared noise claims for them: the mechanism adds less noise than it "
        "declares; no verdict on the upper side."
    )


def whole_traffic_sentence(whole: dict[str, Any] | None) -> str:
    """The verdict over every pass of the training traffic (``splitleak.audit.passes``): the reader of every
    crossing beside the one-crossing reader and the bound on the same documents; an INSTRUMENT FAULT where a
    reading's lower end lies above that bound."""
    if not whole:
        return ""
    gain, bound = whole["gain"], whole["bound"]
    by_label = {r["label"]: r for r in whole["readers"]}
    every, one = by_label[gain["reader"]], by_label[gain["against"]]
    t, o = every["tokens"], one["tokens"]
    passes = f"{whole['epochs']:g} pass{'es' if whole['epochs'] != 1 else ''}"
    head = (
        f"Over the whole training traffic ({passes}, {whole['documents']} documents crossing "
        f"{whole['crossings']['min']}–{whole['crossings']['max']} times): {every['label']} read "
        f"{fmt_pct(t['estimate'])} % of tokens [{fmt_pct(t['low'])}, {fmt_pct(t['high'])}], against "
        f"{fmt_pct(o['estimate'])} % [{fmt_pct(o['low'])}, {fmt_pct(o['high'])}] one crossing at a time "
        f"({100 * gain['estimate']:+.2f} pp [{100 * gain['low']:+.2f}, {100 * gain['high']:+.2f}])"
    )
    if whole.get("control_faults"):
        return (
            f"INSTRUMENT FAULT: {head}; the mis-paired twin of {', '.join(whole['control_faults'])} reads the "
            "documents its traffic is labelled as: it reads the text by the documents' identity, not the traffic."
        )
    if bound.get("token_bound") is None:
        return f"{head}; no formal bound over them ({bound.get('why', 'none declared')})."
    if whole["fault"]:
        return (
            f"INSTRUMENT FAULT: {head}, above the {fmt_pct(bound['token_bound'])} % no reader can read over those "
            "crossings under the chain's declared noise: the defence adds less noise than it declares, or the "
            "accountant or the scorer is wrong."
        )
    eps = bound.get("epsilon_doc_max")
    eps_words = f"; ε ≤ {eps:.3g} at δ = {bound['delta']:g} per document" if eps is not None else ""
    return f"{head}; no reader can read more than {fmt_pct(bound['token_bound'])} % of their tokens{eps_words}."
