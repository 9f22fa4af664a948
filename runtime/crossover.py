"""Crossover: two jobs on the same devices take turns computing, each communicating while the other computes.

A pair of jobs sharing a host's devices shares a gate there: files in `<gate_dir>`, named after the pairing, the
pair and the host. A rank takes the gate before a training forward pass and gives it back when its backward is
done and only collectives are left (`synchronize`), so the partner computes while this job's gradients are on
the network. The jobs share nothing but the files: separate launches, separate process groups.

The gate is exclusive between the jobs and shared within one: every rank of the job holding it may compute
(each holds a shared `flock` on its job's file, `<gate>.<job>`), and the partner's ranks wait until none of them
does (an exclusive probe of that file succeeds). A per-device lock would let device 0 run job A while device 1
runs job B, and each job's allreduce would then wait for the other's compute. The jobs also take turns: a job
that computed last lets a partner that is waiting for the gate (it holds a shared lock on `<gate>.<job>.wait`
meanwhile) go first; with nobody waiting, a job takes the gate again at once. The gate file records which job
computed last and its turn number (every rank of a job takes the gate once per training step, so its k-th
acquisition is the job's k-th turn): a rank arriving after a sibling opened the same turn joins it rather than
yielding, so a job's ranks compute in the same slot.

It cannot deadlock: a rank holds the gate only while it computes locally (forward and backward; the
collectives launched from backward are asynchronous, and the buffer broadcast before a forward runs before
the gate is taken), so a holder never waits for anything the partner holds, and a yielding job holds nothing.
The kernel drops a `flock` when its process exits, however it exits (crash, kill -9), so a vanished partner
never leaves a stale lock behind; a partner that is alive but stuck holding the gate (stopped, hung) is met by
a timeout and one line naming its pid. Waiting polls with a short back-off (POLL_S, with jitter so that the
two jobs do not retry in step) rather than blocking in the kernel, so the timeout needs no signal and works
from any thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import random
import re
import socket
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from planner.contracts.pairing import PairingPlan, check_job_plan, plan_fingerprint
from planner.contracts.plan import Plan
from planner.types import GateTimeoutError, PlanMismatchError, PlannerFileError

__all__ = ["DEFAULT_GATE_TIMEOUT_S", "GATE_DIR_ENV", "DeviceGate", "crossover_gate"]

#: The environment variable naming the directory of the gate files (default <tmp>/planner-gates).
GATE_DIR_ENV = "PLANNER_GATE_DIR"
#: How long a job waits for its partner to hand the devices back before giving up (seconds).
DEFAULT_GATE_TIMEOUT_S = 120.0
#: The polling back-off while the partner holds the gate: from the first to the second value, doubling.
POLL_S = (5e-5, 1e-3)


def _file_name(text: str) -> str:
    """`text` with every character a file name should not hold replaced by "_"."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def _open(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)


def _try(fd: int, how: int) -> bool:
    """Take a non-blocking `flock` of kind `how` on `fd`; whether it was taken."""
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _free(fd: int) -> bool:
    """Whether nobody holds a lock on `fd`'s file (an exclusive probe, let go at once)."""
    if not _try(fd, fcntl.LOCK_EX):
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


class DeviceGate:
    """The devices of a host, shared by two paired jobs through files.

    Args:
        path: the gate file (created, with its directory, if absent; never deleted: an unlocked file is not a
            lock).
        timeout_s: how long `acquire` waits for the partner before raising GateTimeoutError.
        job: this job's name in messages.
        turns: (this job's id, the partner's id): the gate is the pair's (see the module docstring), shared by
            this job's ranks. None: a plain exclusive lock on `path`, one holder at a time.

    Raises:
        PlannerFileError: a file cannot be created or opened.
    """

    def __init__(self, path: str | os.PathLike[str], *, timeout_s: float = DEFAULT_GATE_TIMEOUT_S,
                 job: str = "this job", turns: tuple[str, str] | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.path = Path(path)
        self.timeout_s = float(timeout_s)
        self.job = job
        self.turns = turns
        self._fds: dict[str, int] = {}
        self.held = False
        self.acquisitions = 0  # times taken: this rank's turn number (once per training step)
        self.waited_s = 0.0  # seconds spent waiting for the partner, in all
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fds["gate"] = _open(self.path)
            if turns is not None:
                me, partner = (_file_name(t) for t in turns)
                for key, name in (("mine", me), ("theirs", partner), ("waiting", f"{me}.wait"),
                                  ("partner waiting", f"{partner}.wait")):
                    self._fds[key] = _open(self.path.with_name(f"{self.path.name}.{name}"))
        except OSError as exc:
            self.close()
            raise PlannerFileError(f"cannot create the crossover gate {self.path}: {exc.strerror or exc}; give a "
                                   "writable gate directory (crossover_dir= or PLANNER_GATE_DIR)") from None

    def acquire(self) -> float:
        """Take the gate (a no-op if this gate already holds it); returns the seconds waited."""
        if self.held:
            return 0.0
        gate = self._fd("gate")
        started = time.perf_counter()
        pause = POLL_S[0]
        waiting = self.turns is not None and _try(self._fd("waiting"), fcntl.LOCK_SH)
        try:
            while not self._try_take():
                waited = time.perf_counter() - started
                if waited >= self.timeout_s:
                    raise GateTimeoutError(
                        f"{self.job} waited {waited:.0f} s for the device gate {self.path}, held by pid "
                        f"{self.holder() or '?'} (the paired job), which is stuck or stopped; end that job, or "
                        "raise the gate timeout")
                time.sleep(pause * random.uniform(0.5, 1.5))
                pause = min(2 * pause, POLL_S[1])
        finally:
            if waiting:
                fcntl.flock(self._fd("waiting"), fcntl.LOCK_UN)
        self.held = True
        self.acquisitions += 1
        # who took it last (for the partner's messages), and for the turns which job and its how-manieth turn
        me = self.turns[0] if self.turns else "-"
        os.pwrite(gate, f"{os.getpid():<12} {me:<48} {self.acquisitions:<16}\n".encode(), 0)
        waited = time.perf_counter() - started
        self.waited_s += waited
        return waited

    def _try_take(self) -> bool:
        if self.turns is None:
            return _try(self._fd("gate"), fcntl.LOCK_EX)
        last = self._last()
        if (last is not None and last[0] == self.turns[0] and last[1] != self.acquisitions + 1
                and not _free(self._fd("partner waiting"))):
            return False  # this job computed last (and not this turn: no sibling rank opened it), the partner waits
        mine = self._fd("mine")
        if not _try(mine, fcntl.LOCK_SH):  # the partner is probing it this instant
            return False
        if _free(self._fd("theirs")):  # none of the partner's ranks computes
            return True
        fcntl.flock(mine, fcntl.LOCK_UN)
        return False

    def release(self) -> None:
        """Give the gate back (a no-op if not held)."""
        if self.held:
            fcntl.flock(self._fd("mine" if self.turns is not None else "gate"), fcntl.LOCK_UN)
        self.held = False

    def _read(self) -> list[str]:
        try:
            return self.path.read_text(encoding="ascii", errors="replace").split()
        except OSError:
            return []

    def _last(self) -> tuple[str, int] | None:
        """(the job that took the gate last, its turn number then), or None."""
        words = self._read()
        return (words[1], int(words[2])) if len(words) > 2 and words[2].isdigit() else None

    def holder(self) -> int | None:
        """The pid that took the gate last (None if none wrote one)."""
        words = self._read()
        return int(words[0]) if words and words[0].isdigit() else None

    def close(self) -> None:
        """Release and close the files."""
        with contextlib.suppress(OSError, ValueError):
            self.release()
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = {}

    def _fd(self, key: str) -> int:
        if key not in self._fds:
            raise ValueError(f"the device gate {self.path} is closed")
        return self._fds[key]

    def __enter__(self) -> DeviceGate:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def crossover_gate(crossover: Any, plan: Plan, *, job: str | None = None,
                   gate_dir: str | os.PathLike[str] | None = None,
                   timeout_s: float = DEFAULT_GATE_TIMEOUT_S) -> DeviceGate | None:
    """The gate this rank of the job running `plan` takes, from `crossover` (see `GradientExchange`): None for
    no crossover or a job the pairing leaves alone.

    The job is the pairing's job whose plan fingerprint is `plan`'s (or the one called `job`, needed when two
    jobs run the same plan). Its gate is `<gate_dir>/<pairing>-pair<P>-<host>.lock` (and the files beside it):
    <pairing> a digest of the pairing plan, P the pair, <host> this host's name, so that a gate folder on a
    shared file system still gives each host its own gate.

    Raises:
        PlanMismatchError: no job of the pairing runs `plan`, or several do and `job` does not say which.
        PlannerFileError, SchemaError: the pairing plan cannot be read; the gate file cannot be created.
    """
    if crossover is None:
        return None
    if isinstance(crossover, DeviceGate):
        return crossover
    if isinstance(crossover, str | os.PathLike):
        where = os.fspath(crossover)
        pairing = PairingPlan.load(crossover)
    elif isinstance(crossover, PairingPlan):
        where, pairing = "given", crossover
    else:
        raise TypeError(f"crossover must be a pairing plan, its path or a DeviceGate, got {type(crossover).__name__}")
    if job is not None:
        index = pairing.index(job)
        check_job_plan(pairing.jobs[index], plan)
    else:
        found = plan_fingerprint(plan)
        matches = [k for k, entry in enumerate(pairing.jobs) if entry.plan_fingerprint == found]
        if not matches:
            jobs = ", ".join(f"{entry.name} ({entry.plan})" for entry in pairing.jobs)
            raise PlanMismatchError(f"the pairing plan {where} has no job running this plan (model "
                                    f"{plan.model.name}, fingerprint {found}); its jobs are {jobs}: run one of "
                                    "their plans, or re-run `planner pair` with this one")
        if len(matches) > 1:
            names = [pairing.jobs[k].name for k in matches]
            raise PlanMismatchError(f"jobs {names} of the pairing plan {where} all run this plan: say which one "
                                    "this is with crossover_job=NAME")
        index = matches[0]
    pair = pairing.pair_of(index)
    if pair is None:
        return None  # the pairing leaves this job alone: it runs as before
    directory = Path(gate_dir if gate_dir is not None else
                     os.environ.get(GATE_DIR_ENV) or Path(tempfile.gettempdir()) / "planner-gates")
    digest = hashlib.sha256(json.dumps(pairing.to_dict(), sort_keys=True).encode()).hexdigest()[:12]
    partner = pairing.partner(index)
    assert partner is not None
    host = _file_name(socket.gethostname()) or "host"
    return DeviceGate(directory / f"{digest}-pair{pair}-{host}.lock", timeout_s=timeout_s,
                      job=pairing.jobs[index].name, turns=(f"job{index}", f"job{partner}"))
