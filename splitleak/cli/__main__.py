"""``python -m splitleak.cli``: the same as the ``splitleak`` command."""

from splitleak.cli import main

main()
