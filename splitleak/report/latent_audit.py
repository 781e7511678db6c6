"""The latent audit's report (``splitleak audit --mode latent``, ``splitleak.audit.latent_audit``): its
``report.json`` rendered as ``report.md`` and a self-contained ``report.html``: the verdict, the setting, which
rows are real, what the rows say, the instrument's positive control, utility and privacy accounting, and what
the audit did not measure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from splitleak.files import read_json
from splitleak.report.document import Document, Heading, Para, Table, render_html, render_markdown
from splitleak.report.grid_common import fixed, pp

PAPER_PARTITION = (
    "002: the zero-support rule reads 4,096 of 4,096 frames exactly without the fix, and the base rate with it"
)


def latent_audit_document(r: dict[str, Any]) -> Document:
    c, lat = r["config"], r["config"]["latent"]
    doc = Document("Latent audit")
    doc.add(
        Heading(1, "Latent audit: the decoy system (Politis & Pappas 2026)"),
        Para(f"**{r['verdict']}**" + ("" if not r["verdict_parts"] else ": " + "; ".join(r["verdict_parts"]) + ".")),
        Para(
            f"{c['model']}, split after block {lat['split_after']} and resuming at {lat['resume_at']} (blocks between "
            f"on the server as a gauge-commuting surrogate), latent width {lat['width']}, {lat['decoys']} decoys per "
            f"frame, clip {lat['clip']:g} and noise sigma {lat['sigma']:g}, gauges {'on' if lat['gauges'] else 'off'}, "
            f"gauge entropy {lat['gauge_entropy']}, output gradient {lat['output_gradient']}; {c['steps']} training "
            f"steps over {c['n_train']} documents of {c['data']}, {c['n_eval']} capture frames, seed {c['seed']}. "
            "002's main runs train 40,000 steps and read 2,048 frames: at this size every interval is wider and the "
            "codec far from trained (the held-out loss below).",
            "note",
        ),
    )
    doc.add(Heading(2, "Which rows are real"), _partition_table(r["partition"]))
    doc.add(Heading(2, "What the rows say: the probe battery"), _probe_para(r["probes"], r["thresholds"]))
    doc.add(_probe_table(r["probes"]))
    doc.add(Heading(2, "The instrument's positive control: the dose ladder"), _ladder(r["dose_ladder"]))
    doc.add(Heading(2, "Utility and privacy accounting"), _utility(r))
    doc.add(Heading(2, "What this audit did not measure"), Para("; ".join(r["not_measured"]) + "."))
    return doc


def _partition_table(parts: dict[str, dict[str, Any]]) -> Table:
    rows = []
    for name, p in parts.items():
        ctl = p["control"]
        rows.append([
            name, f"{p['frames_exact']:,} / {p['frames']:,}", fixed(p["row_agreement"], 3), fixed(p["real_row_share"], 3),
            "—" if ctl is None else f"{pp(ctl['effect']['estimate'])} pp, {ctl['verdict']}",
        ])  # fmt: skip
    return Table(
        ["reader", "frames exact", "row agreement", "real-row share (chance)", "mis-paired twin (N)"],
        rows,
        caption="Each reader calls rows real from the traffic alone (the classifier fitted on the attacker's own "
        "shadow frames; decoy-history and gauge-key-search built for the decoy mix and the gauges). A row agreement "
        f"at the real-row share is chance; every frame exact hands the decoys over. {PAPER_PARTITION}. The "
        "mis-paired twin reads the same wires under another frame's header: at floor for a reader of the wires.",
    )


def _probe_para(p: dict[str, Any], th: dict[str, Any]) -> Para:
    b = p["battery"]
    return Para(
        f"Probes under the {b['threat']} threat model ({p['learnt_from'].get('rows_taken_as_real', 'its own frames')}; "
        f"{p['learnt_from'].get('documents', '?')} documents of its own), views {', '.join(b['views'])}, models "
        f"{', '.join(b['models'])} at {b['restarts']} restarts: each view's family read under protocol "
        f"{th['protocol']} (G, the largest Bonferroni-Wilson upper bound less the constant's rate "
        f"{100 * p['constant']['accuracy']:.2f} %, against +{100 * th['gate']:.1f} pp). The shuffled-label twin "
        + ("reads at floor in every view." if not p["twin_detected_in"] else f"is detected in {', '.join(p['twin_detected_in'])}: an instrument fault.")
    )  # fmt: skip


def _probe_table(p: dict[str, Any]) -> Table:
    rows = [
        [view, str(v["decision"]), pp(v["gate_statistic"]), f"{pp(v['paired_effect'])} [{pp(v['paired_low'])}, "
         f"{pp(v['paired_high'])}]", str(v["best_arm"]), f"{v['J']} of {v['declared_J']}"]
        for view, v in p["by_view"].items()
    ]  # fmt: skip
    return Table(
        ["view", "gate", "G (pp)", "best arm over the constant (pp)", "best arm", "arms (declared)"],
        rows,
        caption="Per view: breaks where G exceeds the gate, holds where it does not over the declared family, "
        "undecided where fewer arms than declared hold it.",
    )


def _ladder(d: dict[str, Any]) -> Table:
    rows = [
        [f"{x['coverage']:g}", f"{pp(x['token_top1']['paired_effect'])} [{pp(x['token_top1']['paired_low'])}, "
         f"{pp(x['token_top1']['paired_high'])}]", str(x["token_top1"]["verdict"]), pp(x["gate"]["statistic"])]
        for x in d["doses"] if x["mode"] == "coordinate" and x["amplitude"] == 1.0
    ]  # fmt: skip
    onset = d["onset_token_top1"]
    return Table(
        ["coverage", "token top-1 over the constant (pp)", "reading", "G (pp)"],
        rows,
        caption=f"A known token leak planted at each coverage (coordinate mode, amplitude 1); the first dose "
        f"detected: {'none' if onset is None else f'{onset:g}'} (002 Table 4: the gate first breaks at 0.06). "
        f"{d['note'][0].upper()}{d['note'][1:]}.",
    )


def _utility(r: dict[str, Any]) -> Para:
    m, u = r["metrics"], r["utility"]
    priv = m.get("privacy") or {}
    eps = priv.get("epsilon_per_row_one_release")
    return Para(
        f"{u['text'][0].upper()}{u['text'][1:]} (held-out CE {fixed(m.get('heldout_ce'), 3)} nats, the pretrained "
        f"model's {fixed(m.get('pretrained_ce'), 3)}). The wires' Gaussian noise, accounted as zCDP per row "
        f"({priv.get('accountant', 'not recorded')}): epsilon {fixed(eps, 1)} per release at delta "
        f"{priv.get('delta', 'n/a')}, {fixed(priv.get('epsilon_per_row_all_releases'), 1)} over a row's releases."
    )


def write_latent_audit_report(out: str | Path) -> list[Path]:
    """Render the latent audit folder ``out`` (its ``report.json``) as ``report.md`` and ``report.html``."""
    out = Path(out)
    r = read_json(
        out / "report.json", "latent audit report", f"rerun `splitleak audit --mode latent --out {out} --force`"
    )
    doc = latent_audit_document(r)
    md, page = out / "report.md", out / "report.html"
    md.write_text(render_markdown(doc, base=out), encoding="utf-8")
    page.write_text(render_html(doc), encoding="utf-8")
    return [md, page]
