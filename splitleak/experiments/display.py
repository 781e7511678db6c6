"""What a person sees while a grid runs: on a terminal, one live bar for the grid and one per
running job (its current stage: training, capture, the attack's search, ...); in a plain log, one
line per finished job."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

if TYPE_CHECKING:
    from rich.progress import TaskID


class SilentReporter:
    """Reports nothing (the default for library calls)."""

    def begin(self, text: str, total: int, done: int) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    def job_event(self, event: tuple, summary: str) -> None:
        pass

    def job_finished(self, key: str, summary: str, status: str, seconds: float | None, error: str | None) -> None:
        pass

    def end(self) -> None:
        pass


class PlainReporter(SilentReporter):
    """One line per finished job, for logs: ``[12/184] done   3f2a9c1b0d4e  <summary> (8.1 s)``."""

    def __init__(self, say: Callable[[str], Any] | None = None):
        self.say = say or (lambda s: print(s, flush=True))
        self.total = 0
        self.n = 0

    def begin(self, text: str, total: int, done: int) -> None:
        self.total, self.n = total, done
        self.say(text)

    def note(self, text: str) -> None:
        self.say(text)

    def job_finished(self, key, summary, status, seconds, error) -> None:
        self.n += 1
        t = "" if seconds is None else f" ({seconds:.1f} s)"
        line = f"[{self.n}/{self.total}] {status:<7} {key[:12]}  {summary}{t}"
        if error:
            line += f": {error}"
        self.say(line)


class RichReporter(SilentReporter):
    """rich: a bar for the grid and one bar per running job, showing the job's current stage."""

    def __init__(self, console: Any = None) -> None:
        self.console = console or Console()
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self.grid: TaskID | None = None  # the grid bar, from begin()
        self.jobs: dict[str, Any] = {}
        self.finished: set[str] = set()

    def begin(self, text: str, total: int, done: int) -> None:
        self.console.print(text, highlight=False, markup=False)
        self.progress.start()
        self.grid = self.progress.add_task("grid", total=total, completed=done)

    def note(self, text: str) -> None:
        self.progress.console.print(text, highlight=False, markup=False)

    def job_event(self, event: tuple, summary: str) -> None:
        kind, key = event[0], event[1]
        if key in self.finished:
            return

        label = escape(f"  {key[:8]} {summary}")
        if key not in self.jobs:
            self.jobs[key] = self.progress.add_task(label, total=None)
        task = self.jobs[key]
        if kind == "start":
            self.progress.update(
                task, description=f"{label} · {escape(str(event[3]))}", total=max(1, event[4]), completed=0
            )
        elif kind == "advance":
            self.progress.advance(task, event[3])

    def job_finished(self, key, summary, status, seconds, error) -> None:
        self.finished.add(key)
        task = self.jobs.pop(key, None)
        if task is not None:
            self.progress.remove_task(task)
        if self.grid is not None:
            self.progress.advance(self.grid)
        if status != "done" and status != "reused":
            self.progress.console.print(
                f"[red]{status}[/] {key[:12]} {escape(summary)}: {escape(str(error))}", highlight=False
            )

    def end(self) -> None:
        self.progress.stop()
