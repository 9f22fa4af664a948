"""Two data-parallel jobs on the same devices: each one's seconds per iteration, side by side or crossed over.

A job's iteration alternates a compute phase on the device (forward, backward and update: its iteration time
less the communication it leaves exposed) and a communication phase on the network (the gradient allreduce not
hidden behind backward). `JobPhases` (`planner.contracts.pairing`) holds the two lengths, each as the job takes it
alone, so a job alone runs one iteration every `alone(job)` = compute_s + comm_s seconds.

`simulate_pair` runs two jobs on the same devices in a small deterministic fluid model of two resources, the
device (compute) and the network (communication). Each job cycles compute -> comm -> compute ..., both start
computing at t = 0, and a phase of w seconds takes w seconds of its resource's full rate:

- side by side (`gated=False`, uncoordinated): a resource both jobs use at once is shared equally (processor
  sharing: each progresses at half rate), otherwise the job using it has it at full rate. Two equal jobs then
  run in lockstep: both compute at half rate, then both communicate at half rate, and each iteration takes
  twice as long as alone.
- crossed over (`gated=True`, Muri, NSDI'22; the CrossoverScheduler of `planner.runtime.crossover`): the device is
  exclusive, handed over first come, first served: a job that finishes its compute releases it and a waiting
  job takes it (at t = 0, and whenever a job that has just released the device asks for it again at the same
  instant as the other, the other goes first; on the tie at t = 0 job `a` goes first). The network is still
  shared equally while both communicate. So job A computes while job B communicates and vice versa: for
  phases that fit (each job's compute covers the other's communication), the pair's period is about
  max(cA, nB) + max(nA, cB) (`muri_period`) instead of cA + nA + cB + nB for the two run one after the other.

Each job's period is measured after a warm-up of `WARMUP_ITERATIONS` iterations of both, over the window that
ends when both have made `iterations` more: the window's length over the iterations the job made in it,
counting the iteration in progress at either end by the fraction of its work (compute and communication
seconds) done. A window over a periodic steady state thus gives the period exactly; two jobs of very different
periods stop after `MAX_EVENTS` phase changes, and the window then ends there.
"""

from __future__ import annotations

import math

from planner.contracts.pairing import JobPhases
from planner.types import SolverError

__all__ = [
    "DEFAULT_ITERATIONS",
    "MAX_EVENTS",
    "WARMUP_ITERATIONS",
    "alone",
    "muri_period",
    "simulate_pair",
]

#: Iterations of both jobs simulated before the measurement window opens.
WARMUP_ITERATIONS = 4
#: Iterations the slower job makes in the measurement window by default.
DEFAULT_ITERATIONS = 64
#: Most phase changes one simulation runs (a job thousands of times faster than its partner would otherwise
#: make millions of iterations while the slow one makes its few).
MAX_EVENTS = 100_000
#: Phase ends within this fraction of the longest phase of the pair are one event (so that 0.1 + 0.2 and 0.3
#: hand the device over at the same instant, as they would with exact numbers).
_TIE_RTOL = 1e-9

_WAIT, _COMPUTE, _COMM = 0, 1, 2


def alone(job: JobPhases) -> float:
    """Seconds per iteration of `job` alone on its devices: compute_s + comm_s."""
    return job.compute_s + job.comm_s


def muri_period(a: JobPhases, b: JobPhases) -> float:
    """The crossed-over pair's period when each job's phases fit the other's: max(cA, nB) + max(nA, cB).

    A computes while B communicates, then B computes while A communicates. `simulate_pair(gated=True)` gives it
    when neither job waits on the network for the other; otherwise the shared network makes the pair slower.
    """
    return max(a.compute_s, b.comm_s) + max(a.comm_s, b.compute_s)


def simulate_pair(a: JobPhases, b: JobPhases, *, gated: bool, iterations: int = DEFAULT_ITERATIONS,
                  interleaved: bool = False) -> tuple[float, float]:
    """Steady-state seconds per iteration of `a` and of `b` run together on the same devices.

    Args:
        gated: True: crossed over (the device exclusive, first come first served); False: side by side (each
            resource shared equally by the jobs using it). See the module docstring.
        iterations: iterations the slower job makes in the measurement window, after the warm-up.
        interleaved: start `b` communicating (its first compute done) while `a` computes, instead of both
            computing. Side by side, the fluid model keeps whatever offset the jobs start with, so the two starts
            bound what uncoordinated jobs may settle into: in lockstep (the default) and interleaved.

    Returns:
        (period of a, period of b), each at least the job's `alone` time.
    """
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise SolverError(f"`iterations >= 1` must hold, but got iterations={iterations!r}")
    sim = _PairSimulation(a, b, gated=gated, interleaved=interleaved)
    start: tuple[float, tuple[float, float]] | None = None  # (time, progress) when the window opens
    for event in range(MAX_EVENTS):
        sim.step()
        if start is None and (min(sim.done) >= WARMUP_ITERATIONS or event == MAX_EVENTS // 4):
            start = (sim.now, sim.progress())
        if min(sim.done) >= WARMUP_ITERATIONS + iterations:
            break
    assert start is not None
    begin, before = start
    after = sim.progress()
    periods = []
    for j in (0, 1):
        made = after[j] - before[j]
        # A job progresses at most at its alone rate; max() only absorbs the rounding of the sums.
        periods.append(max((sim.now - begin) / made, sim.total[j]) if made > 0 else math.inf)
    return periods[0], periods[1]


class _PairSimulation:
    """The state of the fluid model of the module docstring, advanced from one phase end to the next.

    A job is waiting for the device (gated only), computing or communicating, with `left` seconds of work
    (at full rate) to go in its phase. Its progress is its completed iterations plus the fraction of the
    current one's work done.

    Fast-forward: when a job ends an iteration in the same discrete state (phases, device holder, queue) as at
    its previous iteration end, and its partner has been in the same phase all along, the partner is in a long
    phase that the job cycles inside; the job's cycle then repeats exactly until the partner's phase is nearly
    done, so whole cycles are skipped at once (a job far faster than its partner would otherwise need an event
    per iteration).
    """

    __slots__ = ("changes", "comm", "compute", "done", "gated", "holder", "into", "last_end", "left", "now",
                 "phase", "queue", "tol", "total")

    def __init__(self, a: JobPhases, b: JobPhases, *, gated: bool, interleaved: bool = False) -> None:
        self.gated = gated
        self.compute = (a.compute_s, b.compute_s)
        self.comm = (a.comm_s, b.comm_s)
        self.total = (a.compute_s + a.comm_s, b.compute_s + b.comm_s)
        self.tol = _TIE_RTOL * max(*self.compute, *self.comm)
        self.phase = [_WAIT, _WAIT]
        self.left = [0.0, 0.0]  # seconds of work left in the current phase, at full rate
        self.done = [0, 0]  # iterations completed
        self.into = [0.0, 0.0]  # seconds of work done in the iteration in progress
        self.changes = [0, 0]  # phases ended so far
        self.holder: int | None = None  # gated: the job on the device
        self.queue: list[tuple[float, int, int]] = []  # gated: (asked at, 1 if it released the device then, job)
        # Per job, at its last iteration end: (discrete state, time, partner's work left, partner's phase ends).
        self.last_end: list[tuple[tuple[object, ...], float, float, int] | None] = [None, None]
        self.now = 0.0
        self._ask(0, released=False)
        if interleaved and b.comm_s > 0:  # b's first compute is done: it starts communicating
            self.phase[1], self.left[1], self.into[1] = _COMM, self.comm[1], self.compute[1]
        else:
            self._ask(1, released=False)

    def progress(self) -> tuple[float, float]:
        """Each job's iterations so far, counting the one in progress by the fraction of its work done."""
        return (self.done[0] + self.into[0] / self.total[0], self.done[1] + self.into[1] / self.total[1])

    def step(self) -> None:
        """Hand a free device to the first in the queue, then run to the next phase end(s) and act on them."""
        if self.gated and self.holder is None and self.queue:
            self.queue.sort()
            job = self.queue.pop(0)[2]
            self.holder = job
            self.phase[job], self.left[job] = _COMPUTE, self.compute[job]
        computing, communicating = self.phase.count(_COMPUTE), self.phase.count(_COMM)
        rate = [0.0 if p == _WAIT else 1.0 / (computing if p == _COMPUTE else communicating) for p in self.phase]
        step = min(self.left[j] / rate[j] for j in (0, 1) if rate[j] > 0)
        self.now += step
        finished = []
        for j in (0, 1):
            if rate[j] == 0:
                continue
            if self.left[j] / rate[j] <= step + self.tol:
                finished.append(j)
                self.into[j] += self.left[j]
                self.left[j] = 0.0
            else:
                self.into[j] += rate[j] * step
                self.left[j] -= rate[j] * step
        ended = [j for j in finished if self._end_phase(j)]
        if len(ended) == 1 and len(finished) == 1:
            self._fast_forward(ended[0])

    def _ask(self, job: int, *, released: bool) -> None:
        """`job` wants the device for its next compute phase."""
        if self.gated:
            self.phase[job] = _WAIT
            self.queue.append((self.now, int(released), job))
        else:
            self.phase[job], self.left[job] = _COMPUTE, self.compute[job]

    def _end_phase(self, job: int) -> bool:
        """Move `job` past the phase it just finished; True when that ended an iteration."""
        self.changes[job] += 1
        if self.phase[job] == _COMPUTE:
            if self.gated:
                self.holder = None
            if self.comm[job] > 0:
                self.phase[job], self.left[job] = _COMM, self.comm[job]
                return False
        released = self.phase[job] == _COMPUTE  # no communication: it asks again as it hands the device over
        self.done[job] += 1
        self.into[job] = 0.0
        self._ask(job, released=released)
        return True

    def _fast_forward(self, job: int) -> None:
        """Skip the whole cycles of `job` that repeat inside its partner's current phase (see the class)."""
        other = 1 - job
        state = (tuple(self.phase), self.holder, tuple((prio, j) for _, prio, j in sorted(self.queue)))
        last, self.last_end[job] = self.last_end[job], (state, self.now, self.left[other], self.changes[other])
        if last is None or self.phase[other] == _WAIT:
            return
        last_state, last_now, last_left, last_changes = last
        used = last_left - self.left[other]  # the partner's work in one cycle of `job`
        if last_state != state or last_changes != self.changes[other] or used <= 0:
            return
        cycles = math.floor((self.left[other] - self.tol) / used) - 1  # keeps a cycle's work and more to go
        if cycles < 1:
            return
        self.now += cycles * (self.now - last_now)
        self.left[other] -= cycles * used
        self.into[other] += cycles * used
        self.done[job] += cycles
        self.last_end[job] = (state, self.now, self.left[other], self.changes[other])
