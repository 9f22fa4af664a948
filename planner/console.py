"""The one console that progress and reports go through (rich)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["console", "err_console", "progress"]

# Piped or logged output is read later, often in CI logs: do not wrap tables at 80 columns there. No markup:
# what is printed holds paths, model names and other programs' messages ("[/.../pair.cc:537]" from gloo),
# which must print as they are; styles are given as `style=`.
console = Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, highlight=False, markup=False, width=None if sys.stderr.isatty() else 160)


@contextmanager
def progress(*, enabled: bool = True) -> Iterator[Progress]:
    """A progress display on stderr; disabled ones accept the same calls and show nothing."""
    bar = Progress(
        TextColumn("{task.description}", style="bold", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        disable=not enabled,
        transient=False,
    )
    with bar:
        yield bar
