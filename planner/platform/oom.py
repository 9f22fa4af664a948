"""Telling whether the kernel's OOM killer ended a worker: a SIGKILL alone does not say, since a user, a job
scheduler and the OOM killer all send it.

Two sources, the first readable one decides:

- the `oom_kill` counter of this process's memory cgroup (cgroup v2 `memory.events`, or cgroup v1
  `memory.oom_control`, whichever exists), read when the workers start and again when one dies: the kernel counts
  every OOM kill of a process in the group or below it, whether the group's own limit or the machine ran out;
- the kernel log (`/dev/kmsg`, where readable), for a record "... out of memory: Killed process PID (...)" written
  since the workers started.

Where neither can be read (the root cgroup has no counter, and the kernel log is often closed to containers), the
answer is None: not known.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["CGROUP_ROOT", "KERNEL_LOG", "OomWatch", "oom_kill_count", "oom_killed_in_kernel_log"]

#: Where the cgroup hierarchies are mounted (v2 here itself; v1 one folder per controller, as `memory/`).
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: The kernel's log, one record per read.
KERNEL_LOG = Path("/dev/kmsg")
#: How far apart the kernel log's clock and CLOCK_MONOTONIC may be, in seconds, when telling a record's age.
_CLOCK_SLACK_S = 5.0
#: At most this many kernel log records are read (a ring buffer holds some thousands).
_MAX_RECORDS = 200_000

_OOM_KILL = re.compile(r"^oom_kill\s+(\d+)\s*$", re.MULTILINE)


def _counter_files(proc_cgroup: Path, root: Path) -> list[Path]:
    """Where this process's memory cgroup keeps its OOM-kill counter, per line of /proc/self/cgroup
    ("HIERARCHY:CONTROLLERS:PATH"): the v2 group's memory.events, the v1 memory group's memory.oom_control."""
    files = []
    for line in proc_cgroup.read_text().splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        relative = path.strip().lstrip("/")
        if hierarchy == "0" and not controllers:
            files += [root / relative / "memory.events", root / "unified" / relative / "memory.events"]
        elif "memory" in controllers.split(","):
            files.append(root / "memory" / relative / "memory.oom_control")
    return files


def oom_kill_count(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT) -> int | None:
    """How many processes of this process's memory cgroup (and the groups below it) the OOM killer has killed,
    or None where no counter is readable."""
    try:
        files = _counter_files(proc_cgroup, root)
    except OSError:
        return None
    for file in files:
        try:
            match = _OOM_KILL.search(file.read_text())
        except OSError:
            continue
        if match is not None:
            return int(match.group(1))
    return None


def oom_killed_in_kernel_log(pid: int, since: float, log: Path = KERNEL_LOG) -> bool | None:
    """Whether the kernel log has an OOM kill of `pid` since `since` (a `time.monotonic()` value); None where the
    log cannot be read. Pids are this machine's: in a container with its own pid namespace the log names other
    numbers, and the cgroup counter is the one to trust."""
    try:
        fd = os.open(log, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    needle = re.compile(rf"out of memory: Killed process {pid} \(", re.IGNORECASE)
    found = False
    try:
        for _ in range(_MAX_RECORDS):
            try:
                chunk = os.read(fd, 8192)
            except BlockingIOError:  # no more records
                break
            except BrokenPipeError:  # records overwritten while reading: go on with the next
                continue
            except OSError:
                return None
            if not chunk:
                break
            for record in chunk.decode(errors="replace").splitlines():
                header, sep, message = record.partition(";")
                fields = header.split(",")
                if not sep or len(fields) < 3 or not fields[2].isdigit():
                    continue
                if int(fields[2]) / 1e6 >= since - _CLOCK_SLACK_S and needle.search(message):
                    found = True
    finally:
        os.close(fd)
    return found


class OomWatch:
    """OOM kills from the moment it is made (when the workers start): did the OOM killer end worker `pid`?"""

    def __init__(self, count: Callable[[], int | None] = oom_kill_count,
                 kernel_log: Callable[[int, float], bool | None] = oom_killed_in_kernel_log) -> None:
        self._count = count
        self._kernel_log = kernel_log
        self._since = time.monotonic()
        self._before = count()

    def killed(self, pid: int | None) -> bool | None:
        """True if the OOM killer ended `pid` (or, by the cgroup's counter, some process of this group since the
        watch began), False if not, None if nothing says."""
        if self._before is not None:
            after = self._count()
            if after is not None:
                return after > self._before
        return None if pid is None else self._kernel_log(pid, self._since)
