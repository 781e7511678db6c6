"""The audit as a person reads it: the verdict, the leakage per attack, the verdict words per arm,
the instrument's calibration, the channel table and the utility, rendered from the audit's
``report.json`` (``splitleak.audit.run``; its sentences written by ``splitleak.report.audit_prose``) as
``report.md`` and a self-contained ``report.html``.

Rendering is separate from measuring: ``write_audit_report(OUT)`` re-renders an audit folder from
its JSON at any time, without rerunning anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from splitleak.audit.channels import HEADER as CHANNEL_HEADER
from splitleak.audit.channels import table_rows as channel_rows
from splitleak.audit.evaluate import attack_label
from splitleak.data import LABELS
from splitleak.errors import SplitleakError
from splitleak.files import read_json
from splitleak.metrics import fmt_pct
from splitleak.report.calibration import write_calibration_report
from splitleak.report.document import (
    Block,
    Contents,
    Document,
    Figure,
    Heading,
    Para,
    Table,
    TextComparison,
    TokenLine,
    render_html,
    render_markdown,
)

ATTACK_HEADER = ["attack", "threat model", "token % [95 % CI]", "document % [95 % CI]", "certified %", "seconds"]
SPAN_HEADER = ["attack", *(f"{c} spans %" for c in LABELS)]
COPY_WORDS = {"public": "public copy", "trained": "trained layers", "server": "the server"}
ARM_HEADER = ["attack", "token top-1 %", "A over constant (pp)", "verdict", "mis-paired N (pp)", "control"]
CALIBRATION_METRICS = ("token_top1", "rare_token_top1", "token_cross_entropy", "membership_auc")


def _with_interval(value: float, interval: dict[str, Any] | None) -> str:
    if interval is None:  # a report written before the audit stated its intervals
        return fmt_pct(value)
    return f"{fmt_pct(value)} [{100 * interval['low']:.1f}, {100 * interval['high']:.1f}]"


def attack_table_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in results:
        cert = r.get("certified_tokens")
        iv = r.get("intervals") or {}
        rows.append(
            [
                attack_label(r),
                COPY_WORDS.get(r.get("threat_model", "public"), r.get("threat_model", "")),
                _with_interval(r["token_recovery"], iv.get("tokens")),
                _with_interval(r["doc_recovery"], iv.get("documents")),
                "—" if cert is None else fmt_pct(cert),
                f"{r['seconds']:.0f}",
            ]
        )
    return rows


def span_table_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in results:
        spans, counts = r.get("span_recovery") or {}, r.get("span_counts") or {}
        rows.append(
            [attack_label(r)]
            + [
                "n/a" if spans.get(c) is None else f"{fmt_pct(spans[c])} ({r['span_hits'][c]}/{counts[c]})"
                for c in LABELS
            ]
        )
    return rows


def example_blocks(examples: dict[str, Any] | None) -> list[Block]:
    """The true text beside each reader's reconstruction, for the documents the audit chose."""
    if not examples or not examples.get("documents"):
        why = (examples or {}).get("how", "this report predates them")
        return [Para(f"No documents are shown ({why}).")]
    blocks: list[Block] = [
        Para(
            f"Shown: {examples['how']}, so they are typical rather than chosen for show. Wrong tokens are struck "
            "through; annotated spans are underlined by class (a span counts as recovered only when all its tokens "
            "are right)."
        )
    ]
    for d in examples["documents"]:
        n = len(d["tokens"])
        lines = [TokenLine("true text", d["tokens"], [False] * n, d["spans"])]
        for r in d["readings"]:
            label = f"{r['attack']} ({fmt_pct(r['accuracy'])} %)"
            lines.append(TokenLine(label, r["tokens"], r["wrong"], d["spans"]))
        blocks.append(TextComparison(f"Evaluation document {d['doc_id']}", lines))
    return blocks


def precision_blocks(report: dict[str, Any]) -> list[Block]:
    """What the chosen document count buys: the widest 95 % interval among the readers, and how it scales."""
    readers = [r for r in report["attacks"] if r.get("intervals") and r["attack"] != "majority"]
    if not readers:
        return []
    n = readers[0]["intervals"]["n_docs"]

    def half(r: dict[str, Any], what: str) -> float:
        iv = r["intervals"][what]
        return 100 * (iv["high"] - iv["low"]) / 2

    tok = max(half(r, "tokens") for r in readers)
    doc = max(half(r, "documents") for r in readers)
    return [
        Para(
            f"In brackets: 95 % intervals (token recovery: percentile bootstrap over the {n} evaluation documents; "
            f"whole documents: Wilson). With {n} documents they are at most ±{tok:.1f} pp on tokens and "
            f"±{doc:.1f} pp on whole documents here; they narrow as 1/√n, so `--n-eval {4 * n}` halves them at "
            "about four times the attacks' time."
        )
    ]


def split_words(cfg: dict[str, Any]) -> str:
    """Where the model is split, in words, for each audit mode."""
    if cfg.get("shielded"):
        sh = cfg["shielded"]
        return (
            f"label-shielded (Bottom of {sh['bottom']} blocks and Top of {sh['top']} blocks on the client with the "
            "labels, the Trunk on the server)"
        )
    if cfg.get("offload_start") is not None:
        b, n = cfg["offload_start"], cfg["offload_length"]
        return f"U-shape (blocks {b}–{b + n - 1} on the server; the client keeps the rest, the labels and the loss)"
    return f"cut after {cfg['depth']} blocks (the labels cross to the server)"


def arm_table_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in results:
        a = r["arm"]
        e, n = a["effect"], a["control"]
        rows.append(
            [
                attack_label(r),
                fmt_pct(a["accuracy"]),
                f"{100 * e['estimate']:+.2f} [{100 * e['low']:+.2f}, {100 * e['high']:+.2f}]",
                a["verdict"],
                "not run"
                if n is None
                else f"{100 * n['estimate']:+.2f} [{100 * n['low']:+.2f}, {100 * n['high']:+.2f}]",
                a["control_verdict"],
            ]
        )
    return rows


def channel_table(rows: list[dict[str, Any]], notes: list[str] | tuple[str, ...] = ()) -> list[Table | Para]:
    """The channel table, and one line per channel note and declaration note."""
    blocks: list[Table | Para] = [Table(CHANNEL_HEADER, channel_rows(rows))]
    extra = [f"{r['channel']}: {r['note']}" for r in rows if r["note"]] + list(notes)
    blocks += [Para(line, kind="caption") for line in extra]
    return blocks


def verdict_blocks(report: dict[str, Any]) -> list[Block]:
    """The verdict first: its main sentence in bold, then the worst-case reader and the channels it
    does not cover (older reports hold the verdict as one string)."""
    parts = report.get("verdict_parts") or [report["verdict"]]
    return [Para(f"**{parts[0]}**"), *(Para(p) for p in parts[1:])]


def _onset(o: dict[str, float] | None) -> str:
    if o is None:
        return "not detected at any dose"
    return f"first detects at coverage {o['coverage']:g} × amplitude {o['amplitude']:g}"


def audit_document(report: dict[str, Any], calibration_figure: Path | None = None) -> Document:
    cfg = report["config"]
    defence = "+".join(d["name"] for d in cfg["defences"])
    doc = Document("splitleak audit")
    doc.add(
        Heading(1, "splitleak audit"),
        *verdict_blocks(report),
        Para(
            f"Model `{cfg['model']}`, {split_words(cfg)}, defence `{defence}`, data `{cfg['data']}` "
            f"(seed {cfg['seed']}; {cfg['n_calib']} calibration / {cfg['n_train']} training / {cfg['n_eval']} "
            f"evaluation documents of {cfg['doc_len']} tokens). Configuration hash `{report['config_hash'][:16]}`."
        ),
        Contents(),
        *reader_blocks(report),
        *arm_blocks(report),
        *bound_blocks(report.get("bound")),
        *whole_traffic_blocks(report.get("whole_traffic")),
        *calibration_blocks(report["verdicts"]),
    )
    if calibration_figure is not None:
        doc.add(Figure(calibration_figure, "Dose-response of the calibration attack per metric."))
    doc.add(*utility_blocks(report, defence))
    doc.add(Para(f"Run directory verified: {report['verify']}."))
    return doc


def reader_blocks(report: dict[str, Any]) -> list[Block]:
    """Who reads what: the threat models, the leakage per attack, the channels, the text coming back and
    the recovery per span class."""
    return [
        Heading(2, "Who reads what"),
        Para(
            "Threat models: "
            + "; ".join(f"**{COPY_WORDS.get(k, k)}**: {v}" for k, v in report.get("threat_models", {}).items())
            + ". Each attack read the evaluation documents' captured traffic under one of the first two (What "
            "Gradients Add §3); the server's reading is in the verdict. `certified` is the share of positions whose recomputed activation matched the observed one "
            "exactly (SipIt); without a budget, on the trained layers, it is the exact-inversion check of the cut."
        ),
        Table(ATTACK_HEADER, attack_table_rows(report["attacks"])),
        *precision_blocks(report),
        Para(
            "Percentages are rounded half-up to two decimals. A whole document counts only when every token is "
            "right. `majority` is the control that guesses the calibration documents' most frequent token at "
            "every position."
        ),
        Heading(2, "Channels (Politis & Pappas 2026, §3)"),
        Para(
            "Every channel the split mode and its defences declare, whether the tap captured it, which attacks of "
            "this audit read it, and its status: **measured** (attacked, and the injected-leak calibration doses "
            "it), **no positive control** (attacked, not calibrated), **no attack** (no attack of this audit read "
            "it; the verdict above says nothing about it), **in clear** (the text itself, such as the labels a "
            "plain split sends for the server's loss: the server reads it with no attack)."
        ),
        *channel_table(report.get("channels", []), report.get("channel_notes", [])),
        Heading(2, "Your text coming back"),
        *example_blocks(report.get("examples")),
        Heading(2, "Recovery by span class"),
        Table(SPAN_HEADER, span_table_rows([r for r in report["attacks"] if r.get("span_recovery") is not None])),
        Para("Spans recovered whole, with hits/spans; n/a where the evaluation documents hold no span of the class."),
    ]


def arm_blocks(report: dict[str, Any]) -> list[Block]:
    """The verdict words per arm, the constant baseline, the negative controls and the gate."""
    v = report["verdicts"]
    return [
        Heading(2, "Verdict words (Politis & Pappas 2026, §3)"),
        Table(ARM_HEADER, arm_table_rows(report["attacks"])),
        Para(
            f"Constant baseline: always guess token {v['constant_baseline']['token_id']}, the most frequent "
            f"evaluation token ({fmt_pct(v['constant_baseline']['rate'])} %). A is the mean over documents of the "
            "arm's accuracy minus the baseline's, with a 95 % document-bootstrap interval; **detected** when its "
            "lower end is above 0, **at floor** when it includes 0, *below floor* when it lies below 0. N is the "
            "negative control, the arm's mis-paired twin: the same fitted attack given the traffic of other "
            "documents, scored against the labels of the documents it is labelled as, minus the arm's own reading "
            "of that traffic scored against the same labels. An attack that reads the traffic reads N = 0 (about "
            "0 where it pools over documents); one that reaches the text by the documents' identity is detected, "
            "and the verdict is then an instrument fault. Gate (Politis & "
            f"Pappas 2026, Eq. 1) over {', '.join(v['gate']['arms'])}: G = max Bonferroni–Wilson upper-95 − "
            f"baseline = {100 * v['gate']['G']:+.2f} pp, "
            f"{'breaks the gate' if v['gate']['breaks'] else 'holds the gate'} (+{100 * v['gate']['gate']:.2f} pp"
            + (f", {v['gate']['thresholds']['protocol']} protocol" if v["gate"].get("thresholds") else "")
            + ")."
        ),
    ]


def bound_blocks(bound: dict[str, Any] | None) -> list[Block]:
    """The upper side of the verdict (``splitleak.audit.bounds``): what no reader can read, and what it assumes."""
    if bound is None:
        return []
    blocks: list[Block] = [Heading(2, "What no reader can read")]
    if bound.get("token_bound") is None:
        blocks.append(Para(f"No formal bound: {bound['why']}. A stronger reader may read up to 100 % of tokens."))
    else:
        rows = [
            ["tokens any reader recovers, at most (mean over documents)", f"{100 * bound['token_bound']:.2f} %"],
            ["whole documents any reader recovers, at most", f"{100 * bound['doc_bound']:.2f} %"],
            ["prior success κ per token / per document", f"{100 * bound['token_kappa']:.2f} % / {bound['doc_kappa']:.3g}"],
            ["ε per document, at δ", f"{bound['epsilon_doc_max']:.4g} at {bound['delta']:g} ({', '.join(bound['accountant'])})"],
            ["crossings composed (most of one document)", str(bound["crossings_max"])],
            ["documents bounded", f"{bound['documents_bounded']} of {bound['documents']}"],
        ]  # fmt: skip
        blocks.append(Table(["bound", "value"], rows))
    blocks.append(Para(f"Against {bound['view']}. Neighbouring relation: {bound['relation']}.", "note"))
    blocks.extend(Para(n, "note") for n in bound.get("notes", []))
    games = bound.get("mechanism_audit") or []
    if games:
        blocks.append(
            Para(
                "Each noised channel's mechanism, played on two canaries inside its clip (DP auditing): the ε its "
                "releases show at least (Clopper–Pearson, 95 %), beside the ε its declared noise claims for them."
            )
        )
        rows = [
            [f"{m['defence']} {m['channel']}", f"{m['epsilon_lower']:.3g}", f"{m['epsilon_claimed']:.3g}",
             f"{m['fpr']:.3f} / {m['fnr']:.3f}", "FAULT" if m["fault"] else "holds"]
            for m in games
        ]  # fmt: skip
        blocks.append(Table(["mechanism", "ε measured ≥", "ε claimed", "FPR / FNR", "claim"], rows))
    return blocks


def whole_traffic_blocks(whole: dict[str, Any] | None) -> list[Block]:
    """Every pass of the training traffic (``splitleak.audit.passes``): each reader's reading of the training
    documents, the combining reader's gain and the bound over the same crossings."""
    if not whole:
        return []

    def control(r: dict[str, Any]) -> str:
        c = r.get("control")
        if not c:
            return "—"
        e = c["effect"]
        return f"{100 * e['estimate']:+.2f} pp [{100 * e['low']:+.2f}, {100 * e['high']:+.2f}], {c['verdict']}"

    rows = [
        [r["label"], f"{100 * r['tokens']['estimate']:.2f} % [{100 * r['tokens']['low']:.2f}, "
         f"{100 * r['tokens']['high']:.2f}]", control(r)]
        for r in whole["readers"]
    ]  # fmt: skip
    g, b = whole["gain"], whole["bound"]
    rows.append(
        [
            "all crossings minus one at a time",
            f"{100 * g['estimate']:+.2f} pp [{100 * g['low']:+.2f}, {100 * g['high']:+.2f}]",
            "",
        ]
    )
    top = b.get("token_bound")
    rows.append(
        ["no reader can read more than", "no formal bound" if top is None else f"{100 * top:.2f} % of tokens", ""]
    )
    return [
        Heading(2, "The whole training traffic"),
        Para(
            f"The {whole['documents']} training documents crossed {whole['crossings']['min']}–"
            f"{whole['crossings']['max']} times over {whole['epochs']:g} pass(es) ({whole['steps']} steps), each "
            "time under fresh noise. Token recovery of the training documents (a document's reading is the mean over "
            "its crossings; intervals resample documents), and each reader's mis-paired twin (every crossing of "
            "another training document, labelled as this one: N, which a reader of the traffic reads at 0):"
        ),
        Table(["reader", "tokens", "mis-paired N"], rows),
    ]


def calibration_blocks(v: dict[str, Any]) -> list[Block]:
    """The instrument's calibration: per metric, its zero-dose reading and where it first detects."""
    return [
        Heading(2, "Instrument calibration (Politis & Pappas 2026, §4)"),
        Para(
            f"`{v['calibration']['attack']}` on the first {v['calibration']['documents']} captured documents with "
            "a known leak injected at rising coverage (see `calibration/calibration.md`):"
        ),
        Table(
            ["metric", "zero-dose reading and onset"],
            [
                [
                    name.replace("_", " "),
                    f"zero dose {v['calibration']['zero_dose'][name]:.4g}; "
                    f"{_onset(v['calibration']['onsets'].get(name))}",
                ]
                for name in CALIBRATION_METRICS
            ],
            kv=True,
        ),
    ]


def _num(x: float | None, fmt: str) -> str:
    return "not measured" if x is None else format(x, fmt)


def utility_blocks(report: dict[str, Any], defence: str) -> list[Block]:
    """The utility table (held-out loss, the all-local baseline, the undefended twin), the leakage against
    the cost of the defence, and where the traffic came from when deployed."""
    m = report["metrics"]
    # reports written before the audit derived the baseline (utility_baseline) read it from the run's metrics
    base = report.get("utility_baseline") or {
        "all_local_ce": m["all_local_ce"],
        "delta_u": m["delta_u"],
        "source": "the all-local baseline run",
    }
    utility = [
        ["held-out cross-entropy (nats)", _num(m["heldout_ce"], ".4f")],
        ["held-out perplexity (geometric mean)", _num(m["perplexity"], ".2f")],
        ["all-local cross-entropy", _num(base["all_local_ce"], ".4f")],
        ["ΔU = L_split − L_all-local", _num(base["delta_u"], "+.4f")],
        ["all-local loss from", base["source"]],
        ["pretrained cross-entropy", _num(m["pretrained_ce"], ".4f")],
    ]
    cost = report.get("cost")
    if cost:
        rel = cost["rel_ppl_change"]
        utility += [
            ["undefended twin: held-out cross-entropy", _num(cost["twin_heldout_ce"], ".4f")],
            ["undefended twin: perplexity", _num(cost["twin_perplexity"], ".2f")],
            ["relative perplexity change against the twin", "not measured" if rel is None else f"{100 * rel:+.2f} %"],
        ]
    blocks: list[Block] = [Heading(2, "Utility"), Table(["measure", "value"], utility)]
    readers = [r for r in report["attacks"] if r.get("doc_recovery") is not None and r["attack"] != "majority"]
    if cost and readers:
        worst = max(readers, key=lambda r: (r["doc_recovery"], r["token_recovery"]))
        rel = cost["rel_ppl_change"]
        blocks.append(
            Para(
                f"Leakage against cost: under `{defence}` the worst-case reader ({attack_label(worst)}) recovers "
                f"{fmt_pct(worst['token_recovery'])} % of tokens and {fmt_pct(worst['doc_recovery'])} % of whole "
                "documents, at "
                + ("an unmeasured cost" if rel is None else f"{100 * rel:+.2f} % perplexity against the twin")
                + ". The undefended twin is trained for the cost only, not attacked; `splitleak compare` puts "
                "several audit folders on one leakage-against-cost figure."
            )
        )
    if m.get("heldout_measured"):
        blocks.append(Para(f"Held-out loss: {m['heldout_measured']}."))
    deployed = report.get("deployment")
    if deployed:
        blocks.append(
            Para(
                f"Deployed as two processes over mutual TLS against {deployed['server']}; the attacks read the "
                f"traffic as the {deployed['recorded_by']} recorded it ({deployed['traffic']})."
            )
        )
    return blocks


def read_audit_report(out: str | Path) -> dict[str, Any]:
    """The audit's ``report.json``, checked to be a JSON object (IntegrityError in one line otherwise)."""
    p = Path(out) / "report.json"
    if not p.exists():
        raise SplitleakError(f"{p} does not exist; run `splitleak audit --out {Path(out)}` first")
    return read_json(p, "audit report", f"rerun `splitleak audit --out {Path(out)} --force`")


def write_audit_report(out: str | Path) -> list[Path]:
    """Render the audit folder ``out`` (its ``report.json``, and ``calibration/calibration.json`` when
    present) as ``report.md`` and ``report.html``; return the paths written."""
    out = Path(out)
    report = read_audit_report(out)
    written: list[Path] = []
    figure = None
    if (out / "calibration" / "calibration.json").is_file():
        cal = write_calibration_report(out / "calibration")
        written += cal
        figure = next(p for p in cal if p.suffix == ".png")
    doc = audit_document(report, calibration_figure=figure)
    md, page = out / "report.md", out / "report.html"
    md.write_text(render_markdown(doc, base=out), encoding="utf-8")
    page.write_text(render_html(doc), encoding="utf-8")
    return [md, page, *written]
