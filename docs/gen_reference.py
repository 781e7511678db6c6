"""The pages of the docs site made at build time (``docs/conf.py`` calls ``write``): the command line (typer's own
Markdown of the app) and the registries of attacks, defences, model presets, protocols, grid specs and claims files,
read from the code that `splitleak attacks`, `splitleak defences` and `splitleak models` read, so that a new entry
appears in the docs without an edit and a removed one disappears. `tests/test_docs.py` builds the site and checks
every command, option and registered name is in it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from splitleak.audit.protocol import load_protocol, shipped_protocols
from splitleak.cli.catalogue import attack_rows, defence_rows
from splitleak.experiments import shipped_specs
from splitleak.models import PRESETS
from splitleak.reproduce.claims import PAPERS, load_claims

PAGE = "reference/registries.md"  # generated at each build; not committed
CLI_PAGE = "reference/cli.md"  # generated at each build by typer's own docs command; not committed


def cell(text: object) -> str:
    """A Markdown table cell: no pipe or newline breaks the row."""
    return str(text).replace("|", "\\|").replace("\n", "<br>") or "–"


def table(header: list[str], rows: list[list[object]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return out + [""]


def code(items: list[str]) -> str:
    return "<br>".join(f"`{i}`" for i in items) or "–"


def registries_page() -> str:
    lines = [
        "# Attacks, defences, models, protocols",
        "",
        "Generated when the site is built, from the registries the command line reads (`splitleak attacks --wide`,",
        "`splitleak defences --wide`, `splitleak models`); attacks added by `SPLITLEAK_PLUGINS` are not listed.",
        "",
        "## Attacks",
        "",
    ]
    lines += table(
        ["name", "reads", "output", "kind", "split modes", "parameters (default)", "what it does"],
        [
            [
                f"`{r['name']}`",
                ", ".join(r["reads"]),
                r["output"],
                r["kind"],
                ", ".join(r["modes"]),
                code(r["params"]),
                r["summary"],
            ]
            for r in attack_rows()
        ],
    )
    lines += [
        "## Defences",
        "",
        "Arguments with their default and, in brackets, the range `splitleak tune` searches.",
        "",
    ]
    lines += table(
        ["name", "arguments", "acts on", "split modes", "attacks built for it", "what it does"],
        [
            [
                f"`{r['name']}`",
                code(r["arguments"]),
                ", ".join(r["acts"]),
                ", ".join(r["modes"]),
                ", ".join(f"`{a}`" for a in r["attacks"]),
                r["summary"],
            ]
            for r in defence_rows()
        ],
    )
    lines += ["## Model presets", "", "Any other name is taken as a Hugging Face model id or a local directory.", ""]
    lines += table(
        ["name", "description", "kind", "Hugging Face id"],
        [[f"`{p.name}`", p.description, p.kind, p.hf_id or "–"] for p in PRESETS.values()],
    )
    lines += ["## Protocols", "", "Shipped frozen in `splitleak/audit/protocols/`; the hash is the file's SHA-256.", ""]
    rows = []
    for path in shipped_protocols():
        proto, digest = load_protocol(path)
        rows.append([f"`{path.name}`", proto.source, len(proto.hypotheses), f"`{digest[:16]}…`"])
    lines += table(["file", "source", "hypotheses", "SHA-256"], rows)
    lines += [
        "## Grid specs",
        "",
        "Shipped in `splitleak/experiments/specs/`; run one with `splitleak experiment run NAME`.",
        "",
    ]
    lines += table(["spec"], [[f"`{Path(p).stem}`"] for p in shipped_specs()])
    lines += ["## Claims files", "", "The papers' headline claims that `splitleak reproduce` reads.", ""]
    rows = []
    for paper in PAPERS:
        claims, digest = load_claims(paper)
        rows.append([paper, claims.title, f"version {claims.version}", len(claims.claims), f"`{digest[:16]}…`"])
    lines += table(["paper", "title", "version", "claims", "SHA-256"], rows)
    return "\n".join(lines)


def cli_page() -> str:
    """The command-line reference: typer's own Markdown of the app (``typer splitleak.cli utils docs``), every
    command with its arguments and options, under a line that says where it comes from."""
    out = subprocess.run(
        [sys.executable, "-m", "typer", "splitleak.cli", "utils", "docs", "--name", "splitleak"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    title, _, rest = out.partition("\n")
    intro = (
        "Generated when the site is built, by typer from the command line itself: every command, its "
        "arguments and its options. `splitleak COMMAND --help` prints the same in a terminal."
    )
    return f"# Command line ({title.lstrip('# ')})\n\n{intro}\n{rest}"


def _write(path: Path, text: str) -> None:
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)


def write(docs: Path) -> None:
    """Write the generated pages into the docs folder (the docs build calls this; they are not committed)."""
    _write(docs / PAGE, registries_page() + "\n")
    _write(docs / CLI_PAGE, cli_page())
