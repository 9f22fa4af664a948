"""Slowing chosen local workers down for real: each in a CPU cgroup with a quota, so heterogeneity is measurable.

Real clusters mix GPU generations and shared machines; on one machine every local worker runs at the same
speed. `ThrottledWorkers` gives each slowed worker a child group of the cgroup v1 `cpu` controller

    /sys/fs/cgroup/cpu/planner-<pid>-<token>-w<rank>/   cpu.cfs_quota_us  = 1000
                                                         cpu.cfs_period_us = 1000 * FACTOR

so the worker's training thread runs at most 1 ms in every FACTOR ms: a worker that computes on one thread then runs
about FACTOR times slower. The launcher moves that thread alone, after the process group started its communication
threads, which keep full speed: a slower GPU computes slower, its network does not (and the collectives of the fast
workers do not wait on a throttled thread of the slow one).

The period is as short as the kernel allows (its least quota is 1 ms) because the cap is on CPU time per period, not
on speed: with the usual 100 ms period a worker that computes in bursts of a few ms between waits never exhausts its
quota and is not slowed at all (measured here: a 20 ms matmul burst between 20 ms sleeps took 20.0 ms under 50 ms
per 100 ms, 47 ms under 1 ms per 2 ms, and 57 ms under 1 ms per 3 ms). The cap is not fair sharing; a busy machine
slows everyone further, so the profile measures each worker's real throughput rather than trusting the factor.

The launcher (`planner.platform.launch.run_distributed(..., slowdown=...)`) creates the groups, each slowed worker
moves its training thread into its group once it has joined the process group (`enter_cgroup`), and every group is
removed on every exit path: a normal return, an error, Ctrl-C or SIGTERM, a killed worker (a group is removed once
its processes are gone; groups left by a run that was itself killed with SIGKILL are removed by the next run, once
its pid is gone).

It needs root and the cgroup v1 `cpu` controller mounted at /sys/fs/cgroup/cpu; without them
`SlowdownUnavailableError` says so in one line.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from planner.platform.cleanup import ExitOnSignals, pid_alive
from planner.types import PlannerError

__all__ = [
    "CGROUP_CPU_ROOT",
    "SLOWDOWNS_ENV",
    "SLOWDOWN_ENV",
    "Slowdown",
    "SlowdownError",
    "SlowdownUnavailableError",
    "ThrottledWorkers",
    "WorkerThrottle",
    "current_slowdown",
    "current_slowdowns",
    "enter_cgroup",
    "parse_slowdown",
    "remove_stale_cgroups",
    "set_own_factor",
]

#: Where the cgroup v1 `cpu` controller is mounted.
CGROUP_CPU_ROOT = Path("/sys/fs/cgroup/cpu")
#: Set in every slowed worker (its factor, e.g. "2").
SLOWDOWN_ENV = "PLANNER_SLOWDOWN"
#: Set in every worker of a run with slowed workers (the --slowdown, e.g. "1=2"), so profiles can record it.
SLOWDOWNS_ENV = "PLANNER_SLOWDOWNS"
#: The CPU time each group may use per period (microseconds): the kernel's least; the period is FACTOR times it.
QUOTA_US = 1000
#: Factors above this leave a worker too little CPU to answer a collective in time.
MAX_FACTOR = 100.0

_PREFIX = "planner"
_NAME_RE = re.compile(rf"^{_PREFIX}-(\d+)-([0-9a-f]+)-w(\d+)$")
_ITEM_RE = re.compile(r"^\s*(\S+?)\s*=\s*(\S+)\s*$")


class SlowdownError(PlannerError, ValueError):
    """A --slowdown that cannot be: malformed, a factor <= 1, a rank named twice or beyond the world size."""


class SlowdownUnavailableError(SlowdownError):
    """This process cannot make CPU cgroups: not root, or no cgroup v1 `cpu` controller."""


@dataclass(frozen=True)
class Slowdown:
    """Which local workers run slower, and by what factor (> 1); the text the user gave, for provenance."""

    factors: Mapping[int, float]
    text: str

    def check_world_size(self, world_size: int) -> None:
        beyond = sorted(r for r in self.factors if r >= world_size)
        if beyond:
            raise SlowdownError(
                f"--slowdown names rank(s) {beyond} but there are {world_size} workers (ranks 0 to {world_size - 1})"
            )

    def factor(self, rank: int) -> float:
        """How much slower `rank` runs (1.0: not slowed)."""
        return float(self.factors.get(rank, 1.0))


def parse_slowdown(text: str) -> Slowdown:
    """`RANK=FACTOR[,RANK=FACTOR...]`, e.g. `1=2` or `0=1.5,2=3`: each rank a whole number >= 0 named once,
    each factor a number > 1 (how many times slower) and at most 100."""
    factors: dict[int, float] = {}
    for item in text.split(","):
        m = _ITEM_RE.match(item)
        if m is None:
            raise SlowdownError(f"--slowdown must be RANK=FACTOR[,RANK=FACTOR...] such as 1=2, but got {text!r}")
        rank_text, factor_text = m.groups()
        if not rank_text.isdigit():
            raise SlowdownError(f"--slowdown: a rank is a whole number >= 0, but got {rank_text!r} in {text!r}")
        rank = int(rank_text)
        try:
            factor = float(factor_text)
        except ValueError:
            raise SlowdownError(f"--slowdown: a factor is a number > 1, but got {factor_text!r} for rank {rank}") \
                from None
        if not math.isfinite(factor) or factor <= 1:
            raise SlowdownError(
                f"--slowdown: rank {rank}'s factor must be > 1 (how many times slower it runs), but got {factor_text}"
            )
        if factor > MAX_FACTOR:
            raise SlowdownError(
                f"--slowdown: rank {rank}'s factor must be at most {MAX_FACTOR:g}, but got {factor_text}"
            )
        if rank in factors:
            raise SlowdownError(f"--slowdown names rank {rank} twice in {text!r}")
        factors[rank] = factor
    canonical = ",".join(f"{r}={f:g}" for r, f in sorted(factors.items()))
    return Slowdown(factors=factors, text=canonical)


def current_slowdown() -> float:
    """The factor this worker was slowed down by (1.0 when it was not)."""
    return float(os.environ.get(SLOWDOWN_ENV) or 1.0)


def current_slowdowns() -> str | None:
    """The --slowdown of the run this worker belongs to ("1=2"), or None when no worker was slowed."""
    return os.environ.get(SLOWDOWNS_ENV) or None


def privilege_problem(root: Path = CGROUP_CPU_ROOT) -> str | None:
    """Why CPU cgroups cannot be made here, or None when they can (the first check that fails)."""
    if not (root / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 `cpu` controller at {root}"
    if os.geteuid() != 0 or not os.access(root, os.W_OK):
        return f"it needs root to create CPU cgroups under {root}"
    return None


def _remove_group(path: Path, wait_s: float = 10.0) -> bool:
    """Remove a cgroup directory once its processes are gone (waiting up to `wait_s`); whether it went."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:  # busy: a process in it has not been reaped yet
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def remove_stale_cgroups(root: Path = CGROUP_CPU_ROOT) -> list[str]:
    """Remove groups this module made for runs whose launcher no longer exists; return their names."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in root.iterdir():
            m = _NAME_RE.match(entry.name)
            if m and entry.is_dir() and not pid_alive(int(m.group(1))) and _remove_group(entry, wait_s=0):
                removed.append(entry.name)
    return removed


class ThrottledWorkers:
    """One CPU cgroup per slowed worker, with its quota; a context manager (or `create()` / `destroy()`).

    `destroy` is safe to call more than once. While the groups exist, SIGTERM and SIGHUP raise `SystemExit`
    in the main thread so `with` blocks unwind and the groups are removed.
    """

    def __init__(self, slowdown: Slowdown, world_size: int, root: Path = CGROUP_CPU_ROOT) -> None:
        slowdown.check_world_size(world_size)
        self.slowdown = slowdown
        self.world_size = world_size
        self.root = root
        self.prefix = f"{_PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.created: list[Path] = []
        self._signals = ExitOnSignals()

    def path(self, rank: int) -> Path | None:
        """The group worker `rank` joins, or None when it is not slowed."""
        return self.root / f"{self.prefix}-w{rank}" if rank in self.slowdown.factors else None

    def throttle(self, rank: int) -> WorkerThrottle:
        path = self.path(rank)
        return WorkerThrottle(None if path is None else str(path), self.slowdown.factor(rank), self.slowdown.text)

    def create(self) -> ThrottledWorkers:
        problem = privilege_problem(self.root)
        if problem is not None:
            raise SlowdownUnavailableError(f"cannot slow workers down: {problem}; run without --slowdown")
        self._signals.arm()
        try:
            remove_stale_cgroups(self.root)
            for rank, factor in sorted(self.slowdown.factors.items()):
                path = self.path(rank)
                assert path is not None
                path.mkdir()
                self.created.append(path)
                (path / "cpu.cfs_period_us").write_text(str(round(QUOTA_US * factor)))
                (path / "cpu.cfs_quota_us").write_text(str(QUOTA_US))
        except BaseException:
            self.destroy()
            raise
        return self

    def destroy(self) -> None:
        """Remove every group this made (each once the processes in it are gone)."""
        while self.created:
            _remove_group(self.created.pop())
        self._signals.disarm()

    def __enter__(self) -> ThrottledWorkers:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()


@dataclass(frozen=True)
class WorkerThrottle:
    """What one worker of a run with a --slowdown does first: join its group (None: not slowed)."""

    path: str | None
    factor: float
    run_text: str


def enter_cgroup(throttle: WorkerThrottle, *, thread_only: bool = False) -> None:
    """Move the calling process (all its threads; call it first thing in a fresh worker), or with `thread_only`
    the calling thread alone (and the threads it starts later), into its CPU cgroup, and record its factor and
    the run's --slowdown in the environment."""
    os.environ[SLOWDOWNS_ENV] = throttle.run_text
    if throttle.path is None:
        return
    target, who = ("tasks", threading.get_native_id()) if thread_only else ("cgroup.procs", os.getpid())
    try:
        Path(throttle.path, target).write_text(str(who))
    except OSError as exc:
        raise SlowdownError(f"cannot join CPU cgroup {throttle.path}: {exc.strerror or exc}") from None
    os.environ[SLOWDOWN_ENV] = f"{throttle.factor:g}"


def set_own_factor(factor: float, root: Path = CGROUP_CPU_ROOT) -> None:
    """Change the slowdown of the calling thread's group to `factor` (> 1) while it runs: a slowed worker whose
    speed changes mid-run. Only a worker started slowed (in a group of this module) can: its group is found in
    /proc/thread-self/cgroup."""
    if not (math.isfinite(factor) and 1 < factor <= MAX_FACTOR):
        raise SlowdownError(f"a slowdown factor must be > 1 and at most {MAX_FACTOR:g}, got {factor}")
    try:
        lines = Path("/proc/thread-self/cgroup").read_text().splitlines()
    except OSError as exc:
        raise SlowdownError(f"cannot read this thread's cgroups: {exc.strerror or exc}") from None
    group = next((line.split(":", 2)[2] for line in lines
                  if line.count(":") >= 2 and "cpu" in line.split(":", 2)[1].split(",")), "/")
    if not _NAME_RE.match(Path(group).name):
        raise SlowdownError(f"this worker is not slowed (its cpu cgroup is {group!r}); only a worker started with "
                            "--slowdown can change its speed")
    try:
        (root / group.lstrip("/") / "cpu.cfs_period_us").write_text(str(round(QUOTA_US * factor)))
    except OSError as exc:
        raise SlowdownError(f"cannot change the slowdown of {group}: {exc.strerror or exc}") from None
    os.environ[SLOWDOWN_ENV] = f"{factor:g}"
