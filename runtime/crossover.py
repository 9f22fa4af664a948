"""Crossover: two jobs on the same devices take turns computing, each communicating while the other computes.

Each device shared by a pair of jobs has a gate: an exclusive `flock` on a file both jobs open,
`<gate_dir>/<pairing>-<pair>-device<N>.lock`. A job takes its device's gate before a training forward
pass and gives it back when its backward is done and only collectives are left (`synchronize`), so the
partner computes while this job's gradients are on the network. The jobs share nothing but the file:
separate launches, separate process groups.

The paired jobs take turns: a job that computed last on a device lets its partner compute before it does again
(the gate file records whose turn it was; each job holds a shared lock on a presence file beside it while its
gate is open, so the other can tell it is there). Every device then alternates A, B, A, B in the same order,
and a job's ranks compute in the same slot on all its devices: with first come, first served alone, device 0
could run A while device 1 runs B, and each job's allreduce would wait for the other's compute. A partner that
lets its turn pass for YIELD_S (finished, evaluating) is not waited for again until it computes.

It cannot deadlock: a rank holds the gate only while it computes locally (forward and backward; the
collectives launched from backward are asynchronous, and the buffer broadcast before a forward runs before
the gate is taken), so the holder never waits for anything the partner holds. The kernel drops a `flock`
when its process exits, however it exits (crash, kill -9), so a vanished partner never leaves a stale lock
behind; a partner that is alive but stuck holding the gate (stopped, hung) is met by a timeout and one line
naming its pid. Waiting polls the lock with a short back-off (POLL_S) rather than blocking in the kernel, so
the timeout needs no signal and works from any thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from planner.contracts.pairing import PairingPlan, check_job_plan, plan_fingerprint
from planner.contracts.plan import Plan
from planner.types import GateTimeoutError, PlanMismatchError, PlannerFileError

__all__ = ["DEFAULT_GATE_TIMEOUT_S", "GATE_DIR_ENV", "DeviceGate", "crossover_gate"]

#: The environment variable naming the directory of the gate files (default <tmp>/planner-gates).
GATE_DIR_ENV = "PLANNER_GATE_DIR"
#: How long a job waits for its partner to hand the device back before giving up (seconds).
DEFAULT_GATE_TIMEOUT_S = 120.0
#: The polling back-off while the partner holds the gate: from the first to the second value, doubling.
POLL_S = (5e-5, 1e-3)
#: With turns, how long a job that computed last waits for its partner to take its turn before going on anyway.
YIELD_S = 5.0


class DeviceGate:
    """An exclusive lock on one device, shared by the paired jobs through a file.

    Args:
        path: the gate file (created, with its directory, if absent; never deleted: an unlocked file is not a
            lock).
        timeout_s: how long `acquire` waits for the partner before raising GateTimeoutError.
        job: this job's name in messages.
        turns: (this job's id, the partner's id) to take turns (see the module docstring); None: first come,
            first served.

    Raises:
        PlannerFileError: the file cannot be created or opened.
    """

    def __init__(self, path: str | os.PathLike[str], *, timeout_s: float = DEFAULT_GATE_TIMEOUT_S,
                 job: str = "this job", turns: tuple[str, str] | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.path = Path(path)
        self.timeout_s = float(timeout_s)
        self.job = job
        self.turns = turns
        self._present: int | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            if turns is not None:  # held (shared) while this gate lives: the partner sees this job is here
                self._present = os.open(self._presence(turns[0]), os.O_RDWR | os.O_CREAT, 0o666)
                self._lock_shared(self._present)
        except OSError as exc:
            raise PlannerFileError(f"cannot create the crossover gate {self.path}: {exc.strerror or exc}; give a "
                                   "writable gate directory (crossover_dir= or PLANNER_GATE_DIR)") from None
        self._partner_idle = False  # the partner let a turn pass (YIELD_S): do not wait for it until it computes
        self.held = False
        self.acquisitions = 0  # times taken
        self.waited_s = 0.0  # seconds spent waiting for the partner, in all

    def _presence(self, name: str) -> Path:
        return self.path.with_name(f"{self.path.name}.{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.present")

    @staticmethod
    def _lock_shared(fd: int) -> None:
        deadline = time.monotonic() + 5.0
        while True:  # the partner may hold it exclusively for an instant while it checks on this job
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(POLL_S[0])

    def partner_present(self) -> bool:
        """Whether the partner job's gate on this device is alive (its process holds its presence lock)."""
        if self.turns is None:
            return False
        fd = os.open(self._presence(self.turns[1]), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing drops the lock if it was taken
        return False

    def acquire(self) -> float:
        """Take the gate (a no-op if this gate already holds it); returns the seconds waited."""
        if self.held:
            return 0.0
        fd = self._open_fd()
        started = time.perf_counter()
        pause = POLL_S[0]
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if not self._my_turn(time.perf_counter() - started):
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    raise BlockingIOError
                break
            except BlockingIOError:
                waited = time.perf_counter() - started
                if waited >= self.timeout_s:
                    raise GateTimeoutError(
                        f"{self.job} waited {waited:.0f} s for the device gate {self.path}, held by pid "
                        f"{self.holder() or '?'} (the paired job), which is stuck or stopped; end that job, or "
                        "raise the gate timeout") from None
                time.sleep(pause)
                pause = min(2 * pause, POLL_S[1])
        # who holds it (for the partner's messages) and whose turn it was (for turn-taking)
        os.pwrite(fd, f"{os.getpid():<12} {self.turns[0] if self.turns else '':<64}\n".encode(), 0)
        self.held = True
        self.acquisitions += 1
        waited = time.perf_counter() - started
        self.waited_s += waited
        return waited

    def release(self) -> None:
        """Give the gate back (a no-op if not held)."""
        if self.held and self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self.held = False

    def _my_turn(self, yielded_s: float) -> bool:
        """With turns, holding the lock: whether to compute now. Not when this job computed last and the partner
        is here to take its turn; but a partner that lets YIELD_S pass without computing (it finished, or does
        something else) is not waited for again until it computes."""
        if self.turns is None:
            return True
        last = self._last()
        if last == self.turns[1]:
            self._partner_idle = False
        if last != self.turns[0] or self._partner_idle or not self.partner_present():
            return True
        if yielded_s >= YIELD_S:
            self._partner_idle = True
            return True
        return False

    def _read(self) -> list[str]:
        try:
            return self.path.read_text(encoding="ascii", errors="replace").split()
        except OSError:
            return []

    def _last(self) -> str | None:
        words = self._read()
        return words[1] if len(words) > 1 else None

    def holder(self) -> int | None:
        """The pid that took the gate last (None if none wrote one)."""
        words = self._read()
        return int(words[0]) if words and words[0].isdigit() else None

    def close(self) -> None:
        """Release and close the file."""
        self.release()
        for fd in (self._fd, self._present):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = self._present = None

    def _open_fd(self) -> int:
        if self._fd is None:
            raise ValueError(f"the device gate {self.path} is closed")
        return self._fd

    def __enter__(self) -> DeviceGate:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def crossover_gate(crossover: Any, plan: Plan, *, job: str | None = None, process_group: Any = None,
                   gate_dir: str | os.PathLike[str] | None = None,
                   timeout_s: float = DEFAULT_GATE_TIMEOUT_S) -> DeviceGate | None:
    """The gate this rank of the job running `plan` takes, from `crossover` (see `GradientExchange`): None for
    no crossover or a job the pairing leaves alone.

    The job is the pairing's job whose plan fingerprint is `plan`'s (or the one called `job`, needed when two
    jobs run the same plan). Its gate is `<gate_dir>/<pairing>-pair<P>-device<D>.lock`: <pairing> a digest of
    the pairing plan, P the pair, D this rank's device (the CUDA device in use, else LOCAL_RANK, else the rank
    in `process_group`).

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
    return DeviceGate(directory / f"{digest}-pair{pair}-device{_device_index(process_group)}.lock",
                      timeout_s=timeout_s, job=pairing.jobs[index].name, turns=(f"job{index}", f"job{partner}"))


def _device_index(process_group: Any) -> int:
    """This rank's device on its host: the CUDA device in use, else LOCAL_RANK, else the rank in the group."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(process_group)
    return 0
