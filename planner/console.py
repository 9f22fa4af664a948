"""The one console that progress and reports go through (rich)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

__all__ = ["LOG_EVERY_S", "console", "err_console", "progress"]

# Piped or logged output is read later, often in CI logs: do not wrap tables at 80 columns there. No markup:
# what is printed holds paths, model names and other programs' messages ("[/.../pair.cc:537]" from gloo),
# which must print as they are; styles are given as `style=`.
console = Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, highlight=False, markup=False, width=None if sys.stderr.isatty() else 160)

#: Where progress goes to a log rather than a terminal, a phase prints a line when it starts, then at most this
#: often, and when it is done.
LOG_EVERY_S = 15.0


class _LoggedProgress(Progress):
    """rich's progress bars, which draw nothing until the end where the output is not a terminal; there (a log, a
    CI job) each task also prints a line when it starts, at most every `LOG_EVERY_S` seconds while it runs, and
    when it completes, so that a log shows where a long run is."""

    def __init__(self, *columns: Any, log: bool, **kwargs: Any) -> None:
        super().__init__(*columns, **kwargs)
        self._log = log
        self._started = time.monotonic()
        self._logged: dict[TaskID, float] = {}

    def add_task(self, description: str, *args: Any, **kwargs: Any) -> TaskID:
        task = super().add_task(description, *args, **kwargs)
        self._line(task, force=True)
        return task

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._line(task_id)

    def update(self, task_id: TaskID, *args: Any, **kwargs: Any) -> None:
        super().update(task_id, *args, **kwargs)
        self._line(task_id)

    def _line(self, task_id: TaskID, *, force: bool = False) -> None:
        if not self._log or self.disable:
            return
        task = next((t for t in self.tasks if t.id == task_id), None)
        if task is None:
            return
        now = time.monotonic()
        done = task.total is not None and task.completed >= task.total
        if not (force or done or now - self._logged.get(task_id, now) >= LOG_EVERY_S):
            return
        if done and self._logged.get(task_id) == -1.0:  # its completion is logged once
            return
        self._logged[task_id] = -1.0 if done else now
        total = "?" if task.total is None else f"{task.total:g}"
        elapsed = int(now - self._started)
        self.console.print(f"[{elapsed // 60}:{elapsed % 60:02d}] {task.description}: {task.completed:g}/{total}"
                           + (" done" if done else ""), markup=False, highlight=False)


@contextmanager
def progress(*, enabled: bool = True) -> Iterator[Progress]:
    """A progress display on stderr (progress lines where stderr is not a terminal); disabled ones accept the same
    calls and show nothing."""
    bar = _LoggedProgress(
        TextColumn("{task.description}", style="bold", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        disable=not enabled,
        transient=False,
        log=not err_console.is_terminal,
    )
    with bar:
        yield bar
