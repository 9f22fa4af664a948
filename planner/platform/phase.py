"""What a worker is doing, readable by the command that started it: the phase named by its latest progress task.

A command's workers are separate processes. When one fails, hangs past its collective timeout or dies (a gloo
abort kills it outright), the launcher names the phase it was in from a small shared buffer the worker writes
here (`planner.platform.launch` makes one per worker), so the user learns where it stopped in one line.
"""

from __future__ import annotations

from typing import Any

#: The bytes a phase is kept in (longer names are cut).
PHASE_BYTES = 160

_slot: Any = None  # this worker's shared buffer (a multiprocessing Array of chars), where a launcher gave one
_here: str = ""  # the phase in this process, with or without a launcher


def attach(slot: Any) -> None:
    """Write phases to `slot` (a `multiprocessing` Array of `PHASE_BYTES` chars) from now on, in this worker."""
    global _slot
    _slot = slot
    set_phase(_here)


def set_phase(name: str) -> None:
    """This process is now in the phase `name` (a progress task's description, say)."""
    global _here
    _here = name
    if _slot is not None:
        data = name.encode("utf-8", "replace")[:PHASE_BYTES - 1]
        _slot[:] = data + b"\0" * (PHASE_BYTES - len(data))


def current_phase() -> str:
    """This process's phase ("" before any)."""
    return _here


def read_phase(slot: Any) -> str:
    """The phase a worker last wrote to `slot` ("" if none)."""
    return bytes(slot[:]).split(b"\0", 1)[0].decode("utf-8", "replace")
