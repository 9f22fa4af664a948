"""`python -m planner` is the `planner` command; `console` is the `planner` script's entry point."""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType


def _interrupted(signum: int, frame: FrameType | None) -> None:
    """A Ctrl-C before the command runs (its modules and torch take seconds to import): the one line, and exit.
    Nothing has started yet, so nothing needs the interpreter's exit. Raising KeyboardInterrupt instead would not
    always reach `console`: the handler can run inside a callback of the import system (a module lock's weakref
    callback), which prints "Exception ignored in ..." and swallows it; and Python 3.11 marks one that passed
    through an exec call (dataclasses build their methods so, as modules import) as unhandled even once caught,
    ending the process by SIGINT instead of with this status."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _leave()


def _leave() -> None:
    print("planner: interrupted", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(130)


def console() -> int:
    """Import the commands and run the one on the command line; a Ctrl-C while they are imported is the same one
    line and exit 130 as one while the command runs (`planner.commands.cli.main`), not a traceback."""
    signal.signal(signal.SIGINT, _interrupted)
    from planner.commands.cli import main  # deferred: the Ctrl-C handler is set before the commands (and torch) import

    return main()  # from its parsing on, main answers a Ctrl-C itself


if __name__ == "__main__":
    sys.exit(console())
