"""The injected-leak calibration as a person reads it: the dose-response table, the onsets, and one
figure per metric. The numbers come from ``splitleak.audit.calibrate`` (``calibration.json``); this
module only renders them (Markdown, a self-contained HTML page, PNG + SVG)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from splitleak.audit.calibrate import METRIC_TITLES, METRICS, read_calibration
from splitleak.audit.gate import shipped_thresholds
from splitleak.report.document import Document, Figure, Heading, Para, Table, render_html, render_markdown
from splitleak.report.figures import pyplot, save_png_svg


def record_gate(record: dict[str, Any]) -> float:
    """The gate a calibration record was read against (recorded since the gate comes from the protocol;
    an older record, written before, used the shipped gate_002's, which is read from the package)."""
    if record.get("gate") is not None:
        return float(record["gate"])

    return shipped_thresholds().gate


def calibration_table(record: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = ["coverage × amplitude", "token top-1 %", "rare top-1 %", "CE (nats)", "membership AUC", "gate G (pp)"]
    rows = []
    for r in record["doses"]:
        e = r["effects"]

        def cell(m: str, value: str) -> str:  # called within this iteration only
            if e[m] is None:  # noqa: B023
                return f"{value} (n/a)"
            mark = " ✓" if e[m]["detected"] else ""  # noqa: B023
            return f"{value}{mark}"

        rows.append(
            [
                f"{r['coverage']:g} × {r['amplitude']:g}",
                cell("token_top1", f"{100 * r['token_top1']:.2f}"),
                cell("rare_token_top1", f"{100 * r['rare_token_top1']:.2f}"),
                cell("token_cross_entropy", f"{r['token_cross_entropy']:.3f}"),
                cell("membership_auc", f"{r['membership_auc']:.3f}"),
                f"{100 * r['gate_G']:+.2f}" + (" breaks" if r["gate_breaks"] else ""),
            ]
        )
    return header, rows


def onset_text(record: dict[str, Any], metric: str) -> str:
    o = record["onsets"].get(metric)
    if o is None:
        return "not detected at any dose"
    return f"first detects at coverage {o['coverage']:g} × amplitude {o['amplitude']:g}"


def calibration_document(record: dict[str, Any], figure: Path | None = None) -> Document:
    """The calibration record as a document: what was dosed, the table, the onsets (and the figure)."""
    header, rows = calibration_table(record)
    a = record["attack"]
    doc = Document(f"Injected-leak calibration: {a['attack']}")
    doc.add(
        Heading(1, f"Injected-leak calibration: {a['attack']} ({a['client_copy']} copy)"),
        Para(
            f"Run `{record['run']['dir']}` (configuration `{record['run']['config_hash'][:16]}`, cut after "
            f"{record['run']['cut']} blocks); {record['documents']} documents, {record['tokens']} tokens "
            f"({record['rare_tokens']} rare), {record['members']} member documents; constant baseline "
            f"{100 * record['constant_baseline']['rate']:.2f} %."
        ),
        Table(header, rows),
        Para(
            "✓: detected (the lower end of the 95 % document-bootstrap interval of the effect against zero dose "
            "is above 0). Gate G: Wilson upper-95 of token top-1 minus the constant baseline; breaks above "
            f"+{100 * record_gate(record):.2f} pp."
        ),
        Heading(2, "Onsets"),
        Table(
            ["metric", "onset"], [[METRIC_TITLES[m].split(" (")[0], onset_text(record, m)] for m in METRICS], kv=True
        ),
        Para("A metric that detects no dose cannot stand behind a verdict of absence.", kind="note"),
    )
    if figure is not None:
        doc.add(
            Figure(
                figure,
                "Dose-response per metric: the effect against zero dose with its 95 % interval; filled points "
                "are detected doses.",
            )
        )
    return doc


def calibration_figure(record: dict[str, Any], out_stem: str | Path) -> list[Path]:
    plt = pyplot()

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4.2 * len(METRICS), 3.8), constrained_layout=True)
    scale = {"token_top1": 100, "rare_token_top1": 100, "token_cross_entropy": 1, "membership_auc": 1}
    amps = sorted({r["amplitude"] for r in record["doses"][1:]})
    for ax, m in zip(axes, METRICS):
        for j, amp in enumerate(amps):
            pts = [
                r
                for r in record["doses"][1:]
                if r["amplitude"] == amp and r["coverage"] > 0 and r["effects"][m] is not None
            ]
            if not pts:
                continue
            x = [r["coverage"] for r in pts]
            y = [scale[m] * r["effects"][m]["effect"] for r in pts]
            lo = [scale[m] * r["effects"][m]["low"] for r in pts]
            hi = [scale[m] * r["effects"][m]["high"] for r in pts]
            ax.plot(x, y, "-", color=f"C{j}", label=f"amplitude {amp:g}")
            ax.fill_between(x, lo, hi, color=f"C{j}", alpha=0.2)
            det = [r["effects"][m]["detected"] for r in pts]
            ax.scatter(
                [xi for xi, d in zip(x, det) if d],
                [yi for yi, d in zip(y, det) if d],
                color=f"C{j}",
                marker="o",
                zorder=3,
                label="detected" if j == 0 else None,
            )
            ax.scatter(
                [xi for xi, d in zip(x, det) if not d],
                [yi for yi, d in zip(y, det) if not d],
                facecolors="white",
                edgecolors=f"C{j}",
                marker="o",
                zorder=3,
                label="not detected" if j == 0 else None,
            )
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xscale("log")
        if m == "token_top1":
            gate = record_gate(record)
            ax.axhline(100 * gate, color="grey", ls="--", lw=0.8)
            ax.annotate(
                f"gate +{100 * gate:.1f} pp",
                (0.98, 100 * gate),
                xycoords=("axes fraction", "data"),
                fontsize=8,
                color="grey",
                va="bottom",
                ha="right",
            )
        ax.set_xlabel("injected coverage (share of rows)")
        ax.set_title(f"{METRIC_TITLES[m]}\n{onset_text(record, m)}", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(
        f"dose-response per metric: {record['attack']['attack']} on {Path(record['run']['dir']).name} "
        f"({record['documents']} documents; shaded: 95 % interval of the effect against zero dose)",
        fontsize=10,
    )
    return save_png_svg(fig, out_stem, dpi=130)


def write_calibration_report(out: str | Path) -> list[Path]:
    """Render ``OUT/calibration.json`` as ``calibration.md``, ``calibration.html`` and the figure
    ``calibration.png`` / ``.svg``; return the paths written."""
    out = Path(out)
    record = read_calibration(out)
    figs = calibration_figure(record, out / "calibration")
    doc = calibration_document(record, figure=figs[0])
    md, page = out / "calibration.md", out / "calibration.html"
    md.write_text(render_markdown(doc), encoding="utf-8")
    page.write_text(render_html(doc), encoding="utf-8")
    return [md, page, *figs]
