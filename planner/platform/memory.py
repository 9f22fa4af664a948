"""This process's memory on Linux: resident now, the peak since it was last reset, and what the machine has
available, so that long measurements can say what each phase needs and refuse work that cannot fit.

Everything reads /proc; where it cannot be read (another OS) the functions return None and callers go on
without the figure."""

from __future__ import annotations

import gc

__all__ = ["PhaseMemory", "available_bytes", "peak_rss_bytes", "reset_peak", "rss_bytes"]


def _status_kib(field: str, path: str = "/proc/self/status") -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss_bytes() -> int | None:
    """Resident memory of this process now."""
    return _status_kib("VmRSS")


def peak_rss_bytes() -> int | None:
    """Peak resident memory of this process since it started or since `reset_peak()`."""
    return _status_kib("VmHWM")


def reset_peak() -> bool:
    """Start the peak (`peak_rss_bytes`) afresh from the memory resident now (Linux 4.0 and later); False where
    it cannot be reset."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def available_bytes() -> int | None:
    """Memory the machine can give new work without swapping (Linux's MemAvailable)."""
    return _status_kib("MemAvailable", "/proc/meminfo")


class PhaseMemory:
    """Peak resident memory per phase of a long measurement: `begin(name)` ends the phase before and starts
    this one, `end()` ends the last. Each phase starts and ends with a garbage collection, so that what an
    earlier phase left in reference cycles (modules and their hooks) is freed, not held through the next one
    and counted there."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}
        self._current: str | None = None

    def begin(self, name: str) -> None:
        self.end()
        gc.collect()
        reset_peak()
        self._current = name

    def end(self) -> None:
        if self._current is None:
            return
        peak = peak_rss_bytes()
        if peak is not None:
            self.peaks[self._current] = max(peak, self.peaks.get(self._current, 0))
        self._current = None
        gc.collect()
