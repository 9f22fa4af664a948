"""This process's memory on Linux: resident now, the peak since it was last reset, and what the machine has
available, so that long measurements can say what each phase needs and refuse work that cannot fit.

Everything reads /proc; where it cannot be read (another OS) the functions return None and callers go on
without the figure. `steady_allocator` sets glibc's malloc up as a long training run has it."""

from __future__ import annotations

import ctypes
import gc

__all__ = ["PhaseMemory", "available_bytes", "collect_garbage", "gib", "peak_rss_bytes", "reset_peak", "rss_bytes",
           "steady_allocator"]

#: glibc's mallopt parameters (malloc.h) and the values its dynamic thresholds grow to on 64-bit Linux.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
STEADY_MMAP_THRESHOLD = 32 << 20
STEADY_TRIM_THRESHOLD = 2 * STEADY_MMAP_THRESHOLD


def steady_allocator() -> bool:
    """Give this process's malloc (glibc) the thresholds a long training run reaches, from the start: blocks
    under 32 MiB come from the heap and up to 64 MiB of free heap is kept, not given back to the system. glibc
    starts both at 128 KiB and raises them only as big blocks are freed; until then each step's gradients are
    given back when `zero_grad` frees them and faulted in again by the next backward. The built-in MLP took
    about 2,500 page faults per training step in a fresh process and none in the bench's, whose earlier work
    had grown the thresholds; the profile timed its steps 20-35% slower than the bench (2026-11-27). The
    workers `planner` starts call it before measuring anything. False where there is no glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, STEADY_MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, STEADY_TRIM_THRESHOLD))


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


def collect_garbage() -> None:
    """Collect the garbage held in reference cycles, then freeze what survives (`gc.freeze`): later collections skip
    it. A full collection scans every object the garbage collector tracks, about 280,000 once torch and torch._dynamo
    (which the first optimizer imports) are loaded: 0.15-0.2 s each. The profile collects between its phases and
    between the in-situ configurations, 23 times in a quick profile of the MLP, 4.4 s of its rank 0's 16 s
    (2026-12-03); frozen, the collections cost next to nothing. What is frozen is never collected: a cycle alive
    here and dropped later lives on, so call it where what survives lives on (between phases, once a
    configuration's copies are dropped). The workers unfreeze and collect everything before they leave their
    process group (`planner.platform.launch`)."""
    gc.collect()
    gc.freeze()


class PhaseMemory:
    """Peak resident memory per phase of a long measurement: `begin(name)` ends the phase before and starts
    this one, `end()` ends the last. Each phase starts and ends with a garbage collection, so that what an
    earlier phase left in reference cycles (modules and their hooks) is freed, not held through the next one
    and counted there; what survives is frozen (`collect_garbage`)."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}
        self._current: str | None = None

    def begin(self, name: str) -> None:
        self.end()
        collect_garbage()
        reset_peak()
        self._current = name

    def end(self) -> None:
        if self._current is None:
            return
        peak = peak_rss_bytes()
        if peak is not None:
            self.peaks[self._current] = max(peak, self.peaks.get(self._current, 0))
        self._current = None
        collect_garbage()


def gib(n_bytes: float) -> str:
    """Bytes as GiB with two decimals ("1.25 GiB")."""
    return f"{n_bytes / 2**30:.2f} GiB"
