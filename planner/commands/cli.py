"""The `planner` command line: the parser and `main`. Each subcommand is a `Command` subclass in a module of its
own (planner.commands.solve, bench_cli, ...); defining one registers it.

Errors the planner raises on purpose (PlannerError) become one line on stderr and exit status 2. Ctrl-C is one
line ("planner: interrupted") and exit status 130, however many times it is pressed: the first stops the command,
and later ones are ignored while it cleans up and the interpreter exits.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType
from typing import Any, NoReturn

from planner.commands.common import Command, merge_intra_link
from planner.console import err_console
from planner.types import PlannerError, RemoteTraceback

# isort: off
# Importing a command's module registers its command, and `planner --help` lists the commands in the order they
# register: this one. (So a command module imports no other command module, only common and printing.)
from planner.commands import models, profile_cli, trial_cli, solve, simulate, retune, report_cli, tune_cli, show  # noqa: F401
from planner.commands import pair_cli, bench_cli, race_cli, solver_bench_cli, demo  # noqa: F401
# isort: on

__all__ = ["Command", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="planner",
        description="Profile, plan and run gradient communication for data-parallel PyTorch training.",
    )
    parser.add_argument("--verbose", action="store_true",
                        help="when a worker fails, print its traceback after the one-line error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cls in Command.registry.items():
        cmd = cls()
        p = sub.add_parser(name, help=cls.help, description=cls.help)
        cmd.configure(p)
        p.set_defaults(_command=cmd)
    return parser


class _Parser(argparse.ArgumentParser):
    """Bad arguments are one line (what is wrong; `--help` for the rest), not argparse's usage block too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)\n")


#: What would break an error's one line or drive the terminal, as it shows in a Python string: a path or value
#: quoted in a message may hold a newline or an escape sequence ("not found: a\\nb.json", not two lines).
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, 0x85) if c != 0x09} | {
    0x0A: "\\n", 0x0D: "\\r", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def _one_line(text: str) -> str:
    """`text` with line breaks and other control characters written as escapes (tabs kept)."""
    return text.translate(_CONTROL)


def _first_line(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else "(no message)"


def _worker_traceback(exc: BaseException, verbose: bool) -> None:
    """With --verbose, the traceback text of the worker an error came from."""
    if verbose and isinstance(exc.__cause__, RemoteTraceback):
        err_console.print(exc.__cause__.text, markup=False, soft_wrap=True, highlight=False)


def _interrupted(signum: int, frame: FrameType | None) -> None:
    """The first Ctrl-C: stop the command; ignore the next ones, so none interrupts the cleanup this one starts
    (workers killed, namespaces and cgroups removed) or the exit after it (torch's and multiprocessing's atexit
    callbacks, which would print "Exception ignored ... KeyboardInterrupt")."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _catch_interrupts() -> tuple[bool, Any]:
    """Install `_interrupted` for SIGINT, from the main thread only (elsewhere Python cannot): whether it did, and
    the handler it replaced, to put back."""
    if threading.current_thread() is not threading.main_thread():
        return False, None
    return True, signal.signal(signal.SIGINT, _interrupted)


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv); the exit status. After a Ctrl-C, SIGINT stays ignored in
    this process: it is about to exit, and nothing may interrupt that."""
    parser = build_parser()
    args = parser.parse_args(argv)
    caught, previous = _catch_interrupts()
    interrupted = False
    try:
        merge_intra_link(args)
        return int(args._command.run(args))
    except PlannerError as exc:
        err_console.print(f"planner {args.command}: error: {_one_line(str(exc))}", markup=False, soft_wrap=True)
        _worker_traceback(exc, args.verbose)
        return 2
    except Exception as exc:
        if not isinstance(exc.__cause__, RemoteTraceback):
            raise  # the planner's own bug: its traceback is what to report
        # a worker's error that is not the planner's (the user's model, a collective whose peer died): one line
        during = f" (during: {exc.__cause__.phase})" if exc.__cause__.phase else ""
        err_console.print(f"planner {args.command}: error: worker rank {exc.__cause__.rank} failed{during}: "
                          f"{type(exc).__name__}: {_first_line(exc)}"
                          + ("" if args.verbose else " (--verbose prints its traceback)"),
                          markup=False, soft_wrap=True)
        _worker_traceback(exc, args.verbose)
        return 2
    except KeyboardInterrupt:
        interrupted = True
        if caught:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        err_console.print("planner: interrupted", markup=False)
        return 130
    finally:
        if caught and not interrupted:
            signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)


if __name__ == "__main__":
    sys.exit(main())
