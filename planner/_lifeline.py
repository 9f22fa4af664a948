"""Spawned workers die with the command that started them, whatever kills it (a job scheduler's SIGKILL, the OOM
killer): on Linux the kernel is asked to SIGKILL the worker when its parent dies (`prctl(PR_SET_PDEATHSIG)`),
elsewhere a thread watches the parent's pid.

A worker asks as the first thing its interpreter does with the package (`arm_from_environment`, run by
`planner/__init__.py` where the launcher's pid is in LAUNCHER_ENV), before torch is imported, which takes seconds:
a command killed while its workers start leaves none behind. This module imports nothing heavy for that reason.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

#: Set by the launcher (`planner.platform.launch`) while it starts a worker: its own pid.
LAUNCHER_ENV = "PLANNER_LAUNCHER_PID"
#: prctl(2) option: the signal this process gets when its parent dies.
_PR_SET_PDEATHSIG = 1
#: Where prctl is missing, how often a worker checks that its launcher is alive (seconds).
_PARENT_POLL_S = 1.0

_armed_for: int | None = None


def die_with(launcher: int) -> None:
    """Have this process killed when process `launcher` (its parent) dies, and exit now if it already has: it may
    have died while this process's interpreter was starting, before the request."""
    global _armed_for
    if _armed_for != launcher:
        if not _kill_me_with_my_parent():
            threading.Thread(target=_watch_parent, args=(launcher,), name="watch-launcher", daemon=True).start()
        _armed_for = launcher
    if os.getppid() != launcher:
        os._exit(1)


def arm_from_environment() -> None:
    """In a worker a launcher started (LAUNCHER_ENV holds the launcher's pid, its parent's): ask to die with it.
    The variable is removed, so that a process this one starts does not take itself for a worker. A process whose
    parent is another (the variable came to it some other way, or the launcher is already gone) does nothing here:
    a worker checks its launcher again, by the pid it was given, before it runs anything (`die_with`)."""
    value = os.environ.pop(LAUNCHER_ENV, None)
    if value is None or not value.isdigit() or os.getppid() != int(value):
        return
    die_with(int(value))


def _kill_me_with_my_parent() -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux); False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(launcher: int) -> None:
    """Where the kernel cannot be asked: exit once the parent is no longer `launcher` (it died, this process was
    handed to another)."""
    while os.getppid() == launcher:
        time.sleep(_PARENT_POLL_S)
    os._exit(1)
