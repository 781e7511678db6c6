"""The command line: parses, then calls the same functions a Python user would.

One module per group of commands; importing this package registers them all on ``app``."""

from __future__ import annotations

from splitleak.attacks.registry import load_plugins
from splitleak.cli import audit, catalogue, deploy, experiment, protocol, reproduce, runs, tune, worker  # noqa: F401  (each registers its commands)
from splitleak.cli.common import app, parse_defences, user_errors
from splitleak.runtime import keep_freed_memory

__all__ = ["app", "main", "parse_defences"]


def main() -> None:  # console-script entry point
    with user_errors():
        keep_freed_memory()  # glibc keeps what the passes free for the next ones (SPLITLEAK_MALLOC=system: not)
        load_plugins()  # attacks registered by SPLITLEAK_PLUGINS
    app()


if __name__ == "__main__":
    main()


def __getattr__(name: str):
    """``click_app``: the click command behind ``app``, for the docs' command-line reference (mkdocs-click)."""
    if name == "click_app":
        # lazy: built only for the docs; a start of the CLI does not need it
        import typer.main

        return typer.main.get_command(app)
    raise AttributeError(f"module 'splitleak.cli' has no attribute {name!r}")
