"""What the launcher's kernel resources (network namespaces, CPU cgroups) share to be removed on every exit path:
signals that unwind `with` blocks, and telling whether the launcher that named a leftover is still alive."""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

__all__ = ["ExitOnSignals", "pid_alive"]


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


class ExitOnSignals:
    """While armed, SIGTERM and SIGHUP raise `SystemExit` in the main thread, so `with` blocks unwind and
    clean up; `disarm` puts the previous handlers back. Off the main thread it does nothing."""

    def __init__(self) -> None:
        self._old: dict[int, Any] = {}

    def arm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old[sig] = signal.signal(sig, _exit_on_signal)

    def disarm(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old.clear()
