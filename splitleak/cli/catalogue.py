"""What is registered: ``splitleak models``, ``splitleak defences``, ``splitleak attacks``, and the defence
names in ``train --help``. Each table is read from the registry it lists (the model presets, the defence
registry, the attack registry), so a new entry appears here without an edit."""

from __future__ import annotations

import inspect
from typing import Any

import typer
from rich.table import Table

from splitleak.attacks.registry import REGISTRY
from splitleak.cli.common import app, console


@app.command("models")
def models_cmd() -> None:
    """List the model presets and whether each loads offline here."""
    # lazy: torch stays out of `splitleak --help`
    from splitleak.models import PRESETS, preset_available

    t = Table(title="model presets")
    for col in ("name", "description", "offline", "where / how"):
        t.add_column(col)
    for name, p in PRESETS.items():
        ok, where = preset_available(name)
        t.add_row(name, p.description, "yes" if ok else "no", where)
    console.print(t)
    console.print("Any other name is taken as a Hugging Face model id or a local directory (--model-path).")


def defence_rows() -> list[dict[str, Any]]:
    """One row per registered defence: its arguments with their defaults and the range ``tune`` searches
    (ours), where its default configuration acts, its split modes and the attacks built for it."""
    # lazy: torch stays out of `splitleak --help`
    from splitleak.defences import DEFENCES, build_defence

    rows = []
    for name, cls in sorted(DEFENCES.items()):
        d = build_defence(name)
        search = cls.search or {}
        args = []
        for arg, default in d.args().items():
            r = search.get(arg)
            span = "" if r is None else f" [{r.low:g}..{r.high:g}{' log' if r.log else ''}]"
            args.append(f"{arg}={default!r}{span}")
        rows.append(
            {
                "name": name,
                "arguments": args,
                "acts": list(d.roles()),
                "modes": list(cls.split_modes),
                "attacks": list(cls.adaptive),
                "summary": (inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " "),
            }
        )
    return rows


@app.command("defences")
def defences_cmd(
    wide: bool = typer.Option(False, "--wide", help="add each defence's one-paragraph description"),
) -> None:
    """List the registered defences: arguments (default, and the range `splitleak tune` searches, ours),
    where each acts, the split modes it supports, and the attacks built for it (which the audit, grids and
    tune run wherever it is in the chain). Pass one with --defence NAME --defence-arg KEY=VALUE."""
    t = Table(title="defences")
    for col in ("name", "arguments (default \\[tune range])", "acts on", "split modes", "attacks built for it"):
        t.add_column(col)
    if wide:
        t.add_column("what it does")
    for r in defence_rows():
        cells = [
            r["name"],
            "\n".join(r["arguments"]) or "-",
            ", ".join(r["acts"]) or "-",
            ", ".join(r["modes"]),
            ", ".join(r["attacks"]) or "-",
        ]
        t.add_row(*cells, *([r["summary"]] if wide else []))
    console.print(t)


def attack_rows() -> list[dict[str, Any]]:
    """One row per registered attack: what it reads, its output, whether it is a control or built for
    defences, the split modes it reads, and its parameters with their defaults (from its class's signature)."""
    # lazy: torch stays out of `splitleak --help`
    from splitleak.attacks.config import params_model

    rows = []
    for name, info in REGISTRY.items():
        model = params_model(info.load())
        params = [
            f"{p}={f.default!r}" if not f.is_required() else f"{p} (required)"
            for p, f in model.model_fields.items()
            if p != "seed"
        ]
        kind = f"control of {info.control_of}" if info.control_of else "control" if info.control else ""
        rows.append(
            {
                "name": name,
                "reads": list(info.reads),
                "output": info.output,
                "kind": "built for defences" if info.adaptive else kind,
                "modes": list(info.modes),
                "params": params,
                "summary": info.summary,
            }
        )
    return rows


@app.command("attacks")
def attacks_cmd(
    wide: bool = typer.Option(False, "--wide", help="add each attack's parameters with their defaults"),
) -> None:
    """List the registered attacks (with those of SPLITLEAK_PLUGINS): the channels each reads, its output,
    whether it is a control or built for a defence, and the split modes whose traffic it reads. Run one
    with `splitleak attack RUN --attack NAME --param KEY=VALUE`."""
    t = Table(title="attacks")
    for col in ("name", "reads", "output", "kind", "split modes", "what it does"):
        t.add_column(col)
    if wide:
        t.add_column("parameters (default)")
    for r in attack_rows():
        cells = [r["name"], ", ".join(r["reads"]) or "-", r["output"], r["kind"], ", ".join(r["modes"]), r["summary"]]
        t.add_row(*cells, *(["\n".join(r["params"]) or "-"] if wide else []))
    console.print(t)


@app.callback()
def name_defences_in_help(ctx: typer.Context) -> None:
    """Before ``train`` parses its options (``--help`` among them), write the registered defence names
    into its ``--defence`` help. Only then: the registry imports torch, which the other commands' help
    and the CLI's start do not need."""
    if ctx.invoked_subcommand not in ("train", "tune", "audit"):
        return
    # lazy: torch stays out of `splitleak --help`
    from splitleak.defences import DEFENCES

    # typer builds its commands on a click of its own: read them by their attributes, not their classes
    command = getattr(ctx.command, "commands", {}).get(ctx.invoked_subcommand)
    for param in getattr(command, "params", []):
        if "--defence" in getattr(param, "opts", ()):
            names = ", ".join(sorted(DEFENCES))
            if names not in (param.help or ""):
                param.help = f"{param.help} — one of: {names} (`splitleak defences` lists their arguments)"
