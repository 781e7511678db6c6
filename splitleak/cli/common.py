"""What every command shares: the application, the consoles, the error guard, the common options."""

from __future__ import annotations

import errno
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from splitleak.errors import ConfigError, SplitleakError
from splitleak.progress import Silent, rich_progress

app = typer.Typer(
    help="splitleak: split learning of language models, what crosses the split, and what it gives away.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console() if sys.stdout.isatty() else Console(width=160)  # wide tables in plain logs
err = Console(stderr=True) if sys.stderr.isatty() else Console(stderr=True, width=160)


def reset_consoles() -> None:
    """Look at the standard streams again, as at import: the warm worker (``splitleak.warm``) runs each command on its
    client's streams, a terminal or not."""
    for c, stream, stderr in ((console, sys.stdout, False), (err, sys.stderr, True)):
        c.__init__(stderr=stderr) if stream.isatty() else c.__init__(stderr=stderr, width=160)  # type: ignore[misc]


@contextmanager
def user_errors():
    """The project's own errors become one red line on stderr (never wrapped, however long its paths) and exit
    status 2, no traceback."""
    try:
        yield
    except SplitleakError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except OSError as exc:
        msg = place_error(exc)
        if msg is None:
            raise
        err.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


def place_error(exc: OSError) -> str | None:
    """One line for an OSError that the place causes, not the program: a full disk or file-size limit,
    a read-only file system, no permission. ``None`` for any other OSError (a bug shows its traceback)."""
    full = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
    closed = (errno.EROFS, errno.EACCES, errno.EPERM)
    what = exc.filename or "a file"
    if exc.errno == errno.ENAMETOOLONG:
        return (
            f"cannot use {str(what)[:80]}…: a name in that path is too long for the file system ({exc.strerror}); "
            "choose a shorter --out (or path)"
        )
    in_the_way = exc.errno == errno.ENOTDIR or (
        exc.errno == errno.EEXIST and exc.filename is not None and not Path(exc.filename).is_dir()
    )
    if in_the_way:
        return (
            f"cannot create {what}: a file stands where that path needs a folder ({exc.strerror}); choose another "
            "--out (or path), or move the file"
        )
    if exc.errno not in full + closed:
        return None
    if exc.errno in full:
        return (
            f"cannot write {what}: {exc.strerror}; free space on that disk (or lift the file-size limit) and run "
            "the command again. What was written before stays whole: `splitleak verify` checks a run, and a "
            "grid resumes where it stopped"
        )
    verb = "cannot write" if exc.errno == errno.EROFS else "cannot write (or read)"  # no permission: either
    return (
        f"{verb} {what}: {exc.strerror}; that place is read-only for this user (or closed to it), so choose an "
        "--out (or --store) you can write, or change its permissions"
    )


def first_line(text: str, limit: int = 300) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


# ------------------------------------------------------------------ shared options
DeviceOpt = typer.Option("auto", "--device", help="auto (CUDA when present), cpu or cuda")
ThreadsOpt = typer.Option(None, "--threads", help="torch intra-op threads (default: torch's choice)")
TlsDirOpt = typer.Option(None, "--tls-dir", help="with --connect: the folder `splitleak tls init` wrote")
DrawsOpt = typer.Option(
    "os",
    "--draws",
    help="what keys the client's random draws on the wire (noise, decoy draws, scales): os (a fresh 128-bit "
    "secret per run, kept in OUT/client/draws.json; the default) or derived (the run seed: reproducible bit "
    "for bit, but a seed from a small range is found by trying seeds, see the seed-search attack)",
)


def parse_defences(names: list[str], args: list[str]) -> list[dict[str, Any]]:
    """``--defence quant4-noisy --defence-arg clip=1.0`` or ``--defence quant4-noisy:clip=1.0,noise=0.1``;
    with several defences, ``--defence-arg NAME.KEY=VALUE``. Applied in the order given."""
    # lazy: torch stays out of `splitleak --help`
    from splitleak.defences import parse_defence_args

    specs: list[dict[str, Any]] = []
    for raw in names or ["none"]:
        name, _, inline = raw.partition(":")
        specs.append({"name": name.strip(), "args": parse_defence_args([x for x in inline.split(",") if x])})
    for item in args or []:
        key, _, _ = item.partition("=")
        if "." in key:
            target, _, rest = item.partition(".")
            matches = [s for s in specs if s["name"] == target]
            if not matches:
                raise ConfigError(f"--defence-arg {item}: no defence named {target!r} was given with --defence")
            matches[0]["args"].update(parse_defence_args([rest]))
        elif len(specs) == 1:
            specs[0]["args"].update(parse_defence_args([item]))
        else:
            raise ConfigError(f"--defence-arg {item} is ambiguous with {len(specs)} defences; write NAME.{item}")
    return specs


def progress(quiet: bool):
    if quiet:

        @contextmanager
        def silent():
            yield Silent()

        return silent()
    return rich_progress()
