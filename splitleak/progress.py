"""Progress reporting that library code can call and the CLI can show (rich) or silence."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Protocol


class Progress(Protocol):
    def start(self, name: str, total: int) -> object: ...

    def advance(self, task: object, n: int = 1) -> None: ...

    def finish(self, task: object) -> None: ...


class Silent:
    def start(self, name: str, total: int) -> object:
        return name

    def advance(self, task: object, n: int = 1) -> None:
        pass

    def finish(self, task: object) -> None:
        pass


class RichProgress:
    """rich bars on a terminal; in a plain log, one line when each task starts and ends."""

    def __init__(self, progress):
        self.p = progress

    def start(self, name: str, total: int) -> object:
        return self.p.add_task(name, total=total)

    def advance(self, task: object, n: int = 1) -> None:
        self.p.advance(task, n)

    def finish(self, task: object) -> None:
        t = self.p.tasks[[x.id for x in self.p.tasks].index(task)]
        self.p.update(task, completed=t.total)
        if not self.p.console.is_terminal:
            self.p.console.print(f"done: {t.description} ({t.total:g})")


@contextmanager
def rich_progress() -> Iterator[Progress]:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.progress import (
        Progress as RP,
    )

    with RP(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        transient=False,
    ) as p:
        yield RichProgress(p)
