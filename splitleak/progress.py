"""Progress reporting that library code can call and the CLI can show (rich) or silence."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator, Protocol

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RP


class Progress(Protocol):
    def start(self, name: str, total: int) -> object: ...

    def advance(self, task: object, n: int = 1) -> None: ...

    def finish(self, task: object) -> None: ...


def end(progress: Progress, task: object, ok: bool) -> None:
    """Close ``task``: ``finish`` when its stage ran to the end; when it was stopped (an interrupt, an
    error) the reporter's ``stop`` where it has one (a plain log then says "stopped", never "done"),
    else ``finish`` (which only takes the task away)."""
    stop = None if ok else getattr(progress, "stop", None)
    (stop or progress.finish)(task)


class Silent:
    def start(self, name: str, total: int) -> object:
        return name

    def advance(self, task: object, n: int = 1) -> None:
        pass

    def finish(self, task: object) -> None:
        pass


#: in a plain log, the least time between two progress lines of one task (ours)
LOG_INTERVAL_S = 30.0


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class RichProgress:
    """rich bars on a terminal. In a plain log (CI, ``nohup``, a pipe), where bars do not show: a line
    when each task starts, a line at most every ``interval`` seconds while it runs (done/total, time
    so far and an estimate of the time left, at the rate so far), and a line when it ends."""

    def __init__(self, progress, interval: float = LOG_INTERVAL_S, clock=None):
        self.p = progress
        self.interval = interval
        self.clock = clock or time.monotonic
        self._times: dict[object, list[float]] = {}  # task -> [started, last line]

    @property
    def _log(self) -> bool:
        return not self.p.console.is_terminal

    def _task(self, task: object):
        return self.p.tasks[[x.id for x in self.p.tasks].index(task)]

    def start(self, name: str, total: int) -> object:
        task = self.p.add_task(name, total=total)
        now = self.clock()
        self._times[task] = [now, now]
        if self._log:
            self.p.console.print(f"start: {name} ({total:g})", highlight=False)
        return task

    def advance(self, task: object, n: int = 1) -> None:
        self.p.advance(task, n)
        if not self._log or task not in self._times:
            return
        now = self.clock()
        started, last = self._times[task]
        if now - last < self.interval:
            return
        self._times[task][1] = now
        t = self._task(task)
        done, total, spent = float(t.completed), float(t.total or 0), now - started
        left = f", about {_duration(spent / done * (total - done))} left" if 0 < done < total else ""
        self.p.console.print(f"… {t.description}: {done:g}/{total:g} after {_duration(spent)}{left}", highlight=False)

    def finish(self, task: object) -> None:
        t = self._task(task)
        self.p.update(task, completed=t.total)
        if self._log:
            started = self._times.pop(task, [self.clock()])[0]
            self.p.console.print(
                f"done: {t.description} ({t.total:g}) in {_duration(self.clock() - started)}", highlight=False
            )

    def stop(self, task: object) -> None:
        """The stage ended before its total (interrupted, or an error): its bar stays where it stopped,
        and a plain log says so, with how far it got."""
        t = self._task(task)
        self.p.stop_task(task)
        started = self._times.pop(task, [self.clock()])[0]
        if self._log:
            self.p.console.print(
                f"stopped: {t.description} at {float(t.completed):g}/{float(t.total or 0):g} after "
                f"{_duration(self.clock() - started)}",
                highlight=False,
            )


@contextmanager
def rich_progress() -> Iterator[Progress]:
    with RP(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        transient=False,
    ) as p:
        yield RichProgress(p)
