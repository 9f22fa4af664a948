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

Crossing over pays when the device time-shares poorly between the jobs and their communication leaves it
idle; where the collectives need the device themselves (gloo over loopback uses the CPU cores it computes on)
taking turns costs more than it saves. So by default the pair measures both (`GateProbe`, `ProbeSchedule`):
after a warm-up, four windows of the host's wall clock run free (no gate, side by side), gated, gated and free;
every rank writes its steps per second in each mode beside the gate, the first rank past the next window adds
the two jobs' samples per second in each mode and writes the decision, and every rank then runs the mode that
made more, until the next probe. Both jobs read the same clock, so they switch together.

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
import glob
import hashlib
import json
import math
import os
import random
import re
import socket
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from planner.contracts.jsonio import write_json_atomic
from planner.contracts.pairing import PairingPlan, check_job_plan, plan_fingerprint
from planner.contracts.plan import Plan
from planner.types import GateTimeoutError, PlanMismatchError, PlannerFileError

__all__ = ["DEFAULT_GATE_TIMEOUT_S", "FREE", "GATED", "GATE_DIR_ENV", "PROBE_WINDOWS", "DeviceGate", "GateProbe",
           "ProbeDecision", "ProbeSchedule", "crossover_gate", "decide", "device_idle", "window_rates"]

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


#: The modes of a crossed-over pair: the gate taken (crossed over) or not (side by side, uncoordinated).
GATED, FREE = "gated", "free"
#: The probe's windows in order: free, gated, gated, free (a drift in speed over the probe cancels out).
PROBE_WINDOWS = (FREE, GATED, GATED, FREE)


@dataclass(frozen=True)
class ProbeSchedule:
    """When a crossed-over pair measures its throughput gated and free, in seconds of the host's wall clock.

    The pair's session starts when the first rank of either job opens the gate, and lasts while any rank of
    either has it open. After `warmup_s` (gated), each cycle runs the four `PROBE_WINDOWS` of `window_s`, then
    one window more in the mode decided before (gated before any decision) while the measurements come in,
    then the mode they favour until the next cycle, which starts `every_s` after that decision (None: the first
    decision holds to the end).
    """

    warmup_s: float = 10.0
    window_s: float = 5.0
    every_s: float | None = 600.0

    def __post_init__(self) -> None:
        for name in ("warmup_s", "window_s", "every_s"):
            value = getattr(self, name)
            if value is None and name == "every_s":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or (
                    value < 0 if name == "warmup_s" else value <= 0):
                raise ValueError(f"ProbeSchedule.{name} must be a finite number of seconds "
                                 f"({'>= 0' if name == 'warmup_s' else '> 0'}), got {value!r}")

    @property
    def cycle_s(self) -> float:
        """Seconds from one cycle's first window to the next's (inf with `every_s` None)."""
        return len(PROBE_WINDOWS) * self.window_s + self.window_s + (math.inf if self.every_s is None
                                                                      else self.every_s)

    def stage(self, elapsed: float) -> tuple[int, int]:
        """(cycle, part) `elapsed` seconds into the session: cycle -1 in the warm-up; part k < 4 in probe window
        k, 4 while the measurements come in, 5 when the cycle's decision holds."""
        after = elapsed - self.warmup_s
        if after < 0:
            return -1, 0
        cycle = 0 if self.every_s is None else int(after // self.cycle_s)
        part = int((after - cycle * self.cycle_s if cycle else after) // self.window_s)
        return cycle, min(part, len(PROBE_WINDOWS) + 1)

    def windows(self, cycle: int) -> list[tuple[float, float, str]]:
        """The probe windows of `cycle`: (start, end, mode), in seconds into the session."""
        start = self.warmup_s + cycle * (self.cycle_s if self.every_s is not None else 0.0)
        return [(start + k * self.window_s, start + (k + 1) * self.window_s, mode)
                for k, mode in enumerate(PROBE_WINDOWS)]


def window_rates(stamps: Sequence[float], windows: Sequence[tuple[float, float, str]]) -> dict[str, float | None]:
    """Steps per second in each mode, from the times steps began (`stamps`): over each window, the steps that
    began in it and ended when the next began in it, over the time they took (None: no such step in any window
    of that mode)."""
    steps = {GATED: 0, FREE: 0}
    spans = {GATED: 0.0, FREE: 0.0}
    for start, end, mode in windows:
        inside = [t for t in stamps if start <= t < end]
        if len(inside) >= 2:
            steps[mode] += len(inside) - 1
            spans[mode] += inside[-1] - inside[0]
    return {mode: steps[mode] / spans[mode] if spans[mode] > 0 else None for mode in (GATED, FREE)}


@dataclass(frozen=True)
class ProbeDecision:
    """What a probe cycle found: the mode to run and the pair's samples per second measured in each mode."""

    cycle: int
    mode: str
    gated_samples_per_s: float | None
    free_samples_per_s: float | None
    reason: str


def decide(cycle: int, results: Mapping[str, Sequence[Mapping[str, float | None]]],
           samples: Mapping[str, int]) -> ProbeDecision:
    """The mode that made more samples per second over both jobs. `results`: per job, each of its ranks' steps
    per second in each mode (`window_rates`); `samples`: per job, samples per step. A job or mode without a
    measurement keeps the plan's crossover (gated)."""
    totals: dict[str, float] = {}
    for mode in (GATED, FREE):
        total = 0.0
        for job, per_step in samples.items():
            rates = [r[mode] for r in results.get(job, ()) if r.get(mode)]
            if not rates:
                return ProbeDecision(cycle, GATED, None, None,
                                     f"no measurement of {job} {mode}: keeping the plan's crossover")
            total += per_step * statistics.fmean(rate for rate in rates if rate is not None)
        totals[mode] = total
    gated, free = totals[GATED], totals[FREE]
    if free > gated:
        return ProbeDecision(cycle, FREE, gated, free, f"side by side made {free / gated:.3f}x the samples/s")
    return ProbeDecision(cycle, GATED, gated, free, f"crossed over made {gated / free:.3f}x the samples/s")


class GateProbe:
    """One rank's part in its pair's probe (see `ProbeSchedule`), through files beside the gate `path`:

    - `<gate>.session`: every rank of both jobs holds a shared lock on it while it has the gate open. The first
      to find it unlocked starts a new session: it removes the last session's files and writes
      `<gate>.probe-epoch`, the start time and its schedule, which every rank joining the session follows.
    - `<gate>.probe-c<cycle>-<job>-<pid>-<token>.json`: a rank's steps per second in each mode.
    - `<gate>.probe-c<cycle>-decision.json`: the first rank past the cycle's probe writes it; the rest read it.

    Args:
        path: the gate file.
        schedule: when to probe.
        job: this job's id in the pair ("job0").
        samples: per job id of the pair, samples per step.
    """

    def __init__(self, path: Path, schedule: ProbeSchedule, job: str, samples: Mapping[str, int]) -> None:
        self.schedule = schedule
        self.job = job
        self.samples = dict(samples)
        self._dir = path.parent
        self._prefix = f"{path.name}.probe-"
        self._stamps: list[float] = []
        self._stamp_cycle: int | None = None
        self._me = f"{os.getpid()}-{random.getrandbits(32):08x}"  # this rank's files (pids repeat across hosts)
        self.decisions: dict[int, ProbeDecision] = {}
        #: (wall-clock time, decision) when this rank first ran each cycle's decision
        self.applied: list[tuple[float, ProbeDecision]] = []
        self._session = _open(path.with_name(f"{path.name}.session"))
        mutex = _open(path.with_name(f"{path.name}.session.mutex"))
        try:
            fcntl.flock(mutex, fcntl.LOCK_EX)  # held a moment by whoever opens a gate: no session starts twice
            epoch = self._dir / f"{self._prefix}epoch"
            if _try(self._session, fcntl.LOCK_EX):  # no live rank: a new session
                for old in self._dir.glob(glob.escape(self._prefix) + "*"):
                    old.unlink(missing_ok=True)
                write_json_atomic(epoch, {"epoch": time.time(), **asdict(schedule)}, "crossover probe file")
                fcntl.flock(self._session, fcntl.LOCK_SH)
            else:
                fcntl.flock(self._session, fcntl.LOCK_SH)  # nobody holds it exclusively outside the mutex
            # the session's start and schedule, the first rank's: the two jobs switch together whatever each asked
            try:
                session = json.loads(epoch.read_text(encoding="ascii"))
                self.epoch = float(session.pop("epoch"))
                self.schedule = ProbeSchedule(**session)
            except (ValueError, TypeError, KeyError, AttributeError):
                raise ValueError(f"the probe's session file {epoch} is damaged (delete it)") from None
        except (OSError, ValueError):
            self.close()
            raise
        finally:
            os.close(mutex)

    def gated(self, now: float) -> bool:
        """Whether the step beginning at `now` (time.time()) takes the gate; the probe records it."""
        cycle, part = self.schedule.stage(now - self.epoch)
        if self._stamp_cycle is not None and (cycle != self._stamp_cycle or part >= len(PROBE_WINDOWS)):
            self._report()
        if cycle < 0:
            return True
        if part < len(PROBE_WINDOWS):
            self._stamp_cycle = cycle
            self._stamps.append(now)
            return PROBE_WINDOWS[part] == GATED
        if part == len(PROBE_WINDOWS):  # the measurements come in: the mode decided before
            return cycle == 0 or self.decision(cycle - 1).mode == GATED
        decision = self.decision(cycle)
        if not self.applied or self.applied[-1][1].cycle != cycle:
            self.applied.append((now, decision))
        return decision.mode == GATED

    def _report(self) -> None:
        """Write this rank's steps per second in each mode of the cycle its stamps are from."""
        cycle, self._stamp_cycle = self._stamp_cycle, None
        assert cycle is not None
        windows = [(self.epoch + a, self.epoch + b, mode) for a, b, mode in self.schedule.windows(cycle)]
        rates = window_rates(self._stamps, windows)
        self._stamps = []
        with contextlib.suppress(PlannerFileError):  # a rank that cannot write leaves the decision to the others
            write_json_atomic(self._dir / f"{self._prefix}c{cycle}-{_file_name(self.job)}-{self._me}.json",
                              {"job": self.job, **rates}, "crossover probe file")

    def decision(self, cycle: int) -> ProbeDecision:
        """The decision of `cycle`: the file's, else made from the ranks' measurements now and written."""
        if cycle in self.decisions:
            return self.decisions[cycle]
        path = self._dir / f"{self._prefix}c{cycle}-decision.json"
        found = self._read_decision(path)
        if found is None:
            results: dict[str, list[dict[str, float | None]]] = {}
            for file in self._dir.glob(glob.escape(f"{self._prefix}c{cycle}-") + "*.json"):
                if file == path:
                    continue
                with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
                    data = json.loads(file.read_text(encoding="ascii"))
                    rates = {m: float(data[m]) if isinstance(data.get(m), int | float) else None
                             for m in (GATED, FREE)}
                    results.setdefault(str(data["job"]), []).append(rates)
            made = decide(cycle, results, self.samples)
            try:
                self._create(path, json.dumps(asdict(made)))
                found = made
            except FileExistsError:  # another rank decided first: its decision holds for all
                found = self._read_decision(path) or made
            except OSError:
                found = made
        self.decisions[cycle] = found
        return found

    @staticmethod
    def _read_decision(path: Path) -> ProbeDecision | None:
        try:
            data = json.loads(path.read_text(encoding="ascii"))
            found = ProbeDecision(**data)
        except (OSError, ValueError, TypeError):
            return None
        return found if found.mode in (GATED, FREE) else None

    def _create(self, path: Path, text: str) -> None:
        """Create `path` holding `text`, whole (a temporary file linked to it); FileExistsError if it exists."""
        fd, tmp = tempfile.mkstemp(dir=self._dir, prefix=".probe-")
        try:
            with os.fdopen(fd, "w", encoding="ascii") as out:
                out.write(text)
            os.link(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._session)
        self._session = -1


class DeviceGate:
    """The devices of a host, shared by two paired jobs through files.

    Args:
        path: the gate file (created, with its directory, if absent; never deleted: an unlocked file is not a
            lock).
        timeout_s: how long `acquire` waits for the partner before raising GateTimeoutError.
        job: this job's name in messages.
        turns: (this job's id, the partner's id): the gate is the pair's (see the module docstring), shared by
            this job's ranks. None: a plain exclusive lock on `path`, one holder at a time.
        probe: with `turns`, measure the pair gated and free and run the better (`GateProbe`); None: always
            gated.
        samples: with `probe`, samples per step of each job id in `turns` (default 1 each).

    Raises:
        PlannerFileError: a file cannot be created or opened.
    """

    def __init__(self, path: str | os.PathLike[str], *, timeout_s: float = DEFAULT_GATE_TIMEOUT_S,
                 job: str = "this job", turns: tuple[str, str] | None = None,
                 probe: ProbeSchedule | None = None, samples: Mapping[str, int] | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.path = Path(path)
        self.timeout_s = float(timeout_s)
        self.job = job
        if probe is not None and turns is None:
            raise ValueError("a probe needs turns: it measures a pair of jobs")
        self.turns = turns
        self._fds: dict[str, int] = {}
        self.held = False
        self._free_step = False  # this step runs without the gate (the probe's choice)
        self.steps = 0  # calls that began a step: this rank's turn number (once per training step)
        self.acquisitions = 0  # times taken
        self.probe: GateProbe | None = None
        self.waited_s = 0.0  # seconds spent waiting for the partner, in all
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fds["gate"] = _open(self.path)
            if turns is not None:
                me, partner = (_file_name(t) for t in turns)
                for key, name in (("mine", me), ("theirs", partner), ("waiting", f"{me}.wait"),
                                  ("partner waiting", f"{partner}.wait")):
                    self._fds[key] = _open(self.path.with_name(f"{self.path.name}.{name}"))
            if probe is not None:
                assert turns is not None
                self.probe = GateProbe(self.path, probe, turns[0], samples or dict.fromkeys(turns, 1))
        except (OSError, ValueError) as exc:
            self.close()
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise PlannerFileError(f"cannot create the crossover gate {self.path}: {reason}; give a "
                                   "writable gate directory (crossover_dir= or PLANNER_GATE_DIR)") from None

    def acquire(self) -> float:
        """Take the gate for a step (a no-op if this gate already holds it, or runs this step free); returns the
        seconds waited."""
        if self.held or self._free_step:
            return 0.0
        self.steps += 1
        if self.probe is not None and not self.probe.gated(time.time()):
            self._free_step = True
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
        os.pwrite(gate, f"{os.getpid():<12} {me:<48} {self.steps:<16}\n".encode(), 0)
        waited = time.perf_counter() - started
        self.waited_s += waited
        return waited

    def _try_take(self) -> bool:
        if self.turns is None:
            return _try(self._fd("gate"), fcntl.LOCK_EX)
        last = self._last()
        if (last is not None and last[0] == self.turns[0] and last[1] != self.steps
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
        self._free_step = False

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
        if self.probe is not None:
            self.probe.close()
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


def device_idle(device: torch.device) -> None:
    """Return once `device` has run the work queued on its current stream: a CUDA device runs kernels after the
    host queues them, so a rank's compute phase ends when the device has run its backward, not when the host has
    queued it (the collectives, on their own streams, go on). A CPU has run its work when the call returns."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def crossover_gate(crossover: Any, plan: Plan, *, job: str | None = None,
                   gate_dir: str | os.PathLike[str] | None = None,
                   timeout_s: float = DEFAULT_GATE_TIMEOUT_S,
                   probe: ProbeSchedule | bool = True) -> DeviceGate | None:
    """The gate this rank of the job running `plan` takes, from `crossover` (see `GradientExchange`): None for
    no crossover or a job the pairing leaves alone.

    The job is the pairing's job whose plan fingerprint is `plan`'s (or the one called `job`, needed when two
    jobs run the same plan). Its gate is `<gate_dir>/<pairing>-pair<P>-<host>.lock` (and the files beside it):
    <pairing> a digest of the pairing plan, P the pair, <host> this host's name, so that a gate folder on a
    shared file system still gives each host its own gate. `probe`: True (the default `ProbeSchedule`) or a
    schedule: the pair measures gated and free running and runs the better; False: always gated.

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
    schedule = (ProbeSchedule() if probe is True else probe) if probe is not False else None
    if schedule is not None and not isinstance(schedule, ProbeSchedule):
        raise TypeError(f"probe must be True, False or a ProbeSchedule, got {type(probe).__name__}")
    return DeviceGate(directory / f"{digest}-pair{pair}-{host}.lock", timeout_s=timeout_s,
                      job=pairing.jobs[index].name, turns=(f"job{index}", f"job{partner}"), probe=schedule,
                      samples={f"job{k}": pairing.jobs[k].samples for k in (index, partner)})
