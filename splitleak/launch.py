"""The console script ``splitleak``: a ``splitleak attack`` command goes to the warm worker where one runs
(``splitleak.warm.hand_over``, ``splitleak worker start``); everything else, and everything where none runs, runs
here through the command line (``splitleak.cli``)."""

from __future__ import annotations

import sys

from splitleak.warm import hand_over


def main() -> None:
    code = hand_over(sys.argv[1:])
    if code is not None:
        sys.exit(code)
    # lazy: a command handed over imports none of the command line (its start is what the worker saves)
    from splitleak.cli import main as cli_main

    cli_main()
