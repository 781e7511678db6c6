"""``splitleak protocol freeze|analyse|show``: protocols fixed before the runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from splitleak.cli.common import app, console, user_errors

protocol_app = typer.Typer(help="Protocols fixed before the runs: freeze, show, analyse.", no_args_is_help=True)
app.add_typer(protocol_app, name="protocol")


@protocol_app.command("freeze")
def protocol_freeze_cmd(file: Path = typer.Argument(..., help="protocol YAML file")) -> None:
    """Validate FILE and record its SHA-256 in FILE.frozen.json; results written under it carry the hash."""
    # lazy: pydantic stays out of `splitleak --help`
    from splitleak.audit.protocol import freeze_protocol

    with user_errors():
        digest = freeze_protocol(file)
        console.print(f"frozen {file}: sha256 {digest}")


@protocol_app.command("analyse")
def protocol_analyse_cmd(
    file: Path = typer.Argument(..., help="the frozen protocol file"),
    results: list[Path] = typer.Argument(
        ..., help="attack RESULT.json files, or folders holding them (searched recursively)"
    ),
    out: Optional[Path] = typer.Option(None, "--out", help="write the analysis as OUT.json and OUT.md"),
) -> None:
    """Apply a frozen protocol to results: the main test against its pass mark, the Bonferroni family,
    the partial-offloading tests, and the gate test (probe-battery results and split runs read at the
    protocol's gate, α, arm family and utility gate). Results not written under the protocol's hash are
    refused; a declared test the results do not evaluate is named, with why."""
    # lazy: torch and pydantic stay out of `splitleak --help`
    from splitleak.audit.analysis import analyse, find_results, rows_from_results, run_rows_from_results
    from splitleak.audit.gate_results import gate_inputs
    from splitleak.audit.protocol import load_protocol
    from splitleak.report.analysis import analysis_markdown

    with user_errors():
        proto, digest = load_protocol(file)
        skipped: list[Path] = []
        found = find_results(results, skipped)
        a = analyse(proto, digest, rows_from_results(found), run_rows_from_results(found), gate_inputs(found))
        console.print(f"{len(found)} attack result(s) read", markup=False, highlight=False)
        for f in skipped:
            console.print(f"skipped {f}: a JSON object that is no attack result", markup=False, highlight=False)
        md = analysis_markdown(a)
        console.print(md, markup=False, highlight=False)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.with_suffix(".json").write_text(json.dumps(a.as_dict(), indent=2) + "\n")
            out.with_suffix(".md").write_text(md)
            console.print(f"analysis: {out.with_suffix('.json')}")
        if a.main is not None and not a.main.passes:
            raise typer.Exit(1)
        if any(g.get("passes") is False or g.get("instrument_fault") for g in a.gate):
            raise typer.Exit(1)  # a failed gate, or a declared control that read above its floor


@protocol_app.command("show")
def protocol_show_cmd(file: Path = typer.Argument(..., help="protocol YAML file")) -> None:
    """Check that FILE is frozen and unchanged, and print its hypotheses and hash."""
    # lazy: pydantic stays out of `splitleak --help`
    from splitleak.audit.protocol import load_protocol

    with user_errors():
        proto, digest = load_protocol(file)
        console.print(f"{proto.name} ({proto.source}) sha256 {digest}")
        for h in proto.hypotheses:
            console.print(f"- {h}")


# ------------------------------------------------------------------ commands
