"""The one console that progress and reports go through (rich)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from planner.platform.phase import set_phase

__all__ = ["LOG_EVERY_S", "console", "err_console", "progress"]

# Piped or logged output is read later, often in CI logs: do not wrap tables at 80 columns there. No markup:
# what is printed holds paths, model names and other programs' messages ("[/.../pair.cc:537]" from gloo),
# which must print as they are; styles are given as `style=`.
console = Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, highlight=False, markup=False, width=None if sys.stderr.isatty() else 160)

#: Where progress goes to a log rather than a terminal, a phase that runs longer than this prints a line every
#: this many seconds, and one when it is done.
LOG_EVERY_S = 10.0


class _LoggedProgress(Progress):
    """rich's progress bars, which draw nothing until the end where the output is not a terminal; there (a log, a
    CI job) a task that runs longer than `LOG_EVERY_S` also prints a line every `LOG_EVERY_S` seconds and one when
    it completes, so that a log shows where a long run is (short phases print nothing more). The lines come from a
    thread of their own too, so a phase that stops advancing (a hang) still prints where it stopped."""

    def __init__(self, *columns: Any, log: bool, **kwargs: Any) -> None:
        super().__init__(*columns, **kwargs)
        self._log = log
        self._started = time.monotonic()
        self._last: dict[TaskID, float] = {}  # when each task started, then when it last printed a line
        self._printed: set[TaskID] = set()
        self._finished: set[TaskID] = set()
        self._stopped = threading.Event()
        self._lines_lock = threading.Lock()
        self._ticker: threading.Thread | None = None

    def start(self) -> None:
        super().start()
        if self._log and not self.disable and self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, name="progress-lines", daemon=True)
            self._ticker.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._ticker is not None:
            self._ticker.join()
        super().stop()

    def _tick(self) -> None:
        """Every unfinished task's line when it is due, checked a few times per `LOG_EVERY_S`."""
        while not self._stopped.wait(min(1.0, max(LOG_EVERY_S / 4, 0.01))):
            for task_id in [t.id for t in self.tasks if t.id not in self._finished]:
                self._line(task_id)

    def add_task(self, description: str, *args: Any, **kwargs: Any) -> TaskID:
        set_phase(description)  # shown or not: a worker that fails or hangs is reported in it
        task = super().add_task(description, *args, **kwargs)
        self._last[task] = time.monotonic()
        return task

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._line(task_id)

    def update(self, task_id: TaskID, *args: Any, **kwargs: Any) -> None:
        super().update(task_id, *args, **kwargs)
        self._line(task_id)

    def _line(self, task_id: TaskID) -> None:
        with self._lines_lock:  # the ticker's thread and the caller's (not rich's lock: printing takes Live's)
            self._line_locked(task_id)

    def _line_locked(self, task_id: TaskID) -> None:
        if not self._log or self.disable or task_id in self._finished:
            return
        task = next((t for t in self.tasks if t.id == task_id), None)
        if task is None:
            return
        now = time.monotonic()
        done = task.total is not None and task.completed >= task.total
        if done:
            self._finished.add(task_id)
            if task_id not in self._printed:  # a short phase: nothing to report beyond the bars at the end
                return
        elif now - self._last.get(task_id, now) < LOG_EVERY_S:
            return
        self._last[task_id] = now
        self._printed.add(task_id)
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
