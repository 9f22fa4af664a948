"""planner.runtime.crossover.DeviceGate: exclusive between processes, released by the kernel when its holder dies, a
timeout naming the holder when it is stuck, and one clear error when the gate file cannot be made."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from planner.runtime.crossover import DeviceGate
from planner.types import GateTimeoutError, PlannerFileError

HOLD = """
import sys, time
from planner.runtime.crossover import DeviceGate
gate = DeviceGate(sys.argv[1])
gate.acquire()
print("held", flush=True)
time.sleep(60)
"""


def _holder(path: Path) -> subprocess.Popen[str]:
    """Another process that takes the gate and keeps it; returns once it holds it."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parent.parent)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_one_holder_at_a_time(tmp_path: Path) -> None:
    a = DeviceGate(tmp_path / "gates" / "d0.lock", job="job a")
    b = DeviceGate(tmp_path / "gates" / "d0.lock", timeout_s=0.2, job="job b")
    assert a.acquire() < 1.0 and a.held
    assert a.acquire() == 0.0  # already held: a no-op
    with pytest.raises(GateTimeoutError, match=rf"job b waited 0 s for the device gate .*d0.lock, held by pid "
                                               rf"{os.getpid()}"):
        b.acquire()
    assert not b.held
    a.release()
    with b:
        assert b.held and b.acquisitions == 1
    assert not b.held
    a.close()
    b.close()
    with pytest.raises(ValueError, match="closed"):
        a.acquire()


def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    path = tmp_path / "d0.lock"
    proc = _holder(path)
    gate = DeviceGate(path, timeout_s=0.3)
    with pytest.raises(GateTimeoutError, match=f"held by pid {proc.pid}"):
        gate.acquire()
    proc.kill()  # SIGKILL: no clean-up runs in it; the kernel drops its lock
    proc.wait()
    gate.timeout_s = 30.0  # a lock left behind would time out here
    gate.acquire()
    gate.close()
    again = DeviceGate(path, timeout_s=1.0)  # and the next run finds the file unlocked
    again.acquire()
    again.close()


def test_a_stopped_holder_times_out_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "d0.lock"
    proc = _holder(path)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        gate = DeviceGate(path, timeout_s=0.5, job="resnet18-2w")
        with pytest.raises(GateTimeoutError) as info:
            gate.acquire()
        message = str(info.value)
        assert "\n" not in message and f"pid {proc.pid}" in message and "resnet18-2w" in message
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_gate_that_cannot_be_created_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(PlannerFileError, match=r"cannot create the crossover gate .*a-file/d0.lock: .*writable"):
        DeviceGate(blocker / "d0.lock")
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        DeviceGate(tmp_path / "d0.lock", timeout_s=0)


def test_a_pairs_gate_is_shared_by_a_jobs_ranks_and_exclusive_between_the_jobs(tmp_path: Path) -> None:
    path = tmp_path / "pair0.lock"
    a0, a1 = (DeviceGate(path, turns=("job0", "job1"), job=f"a rank {r}") for r in (0, 1))
    b0 = DeviceGate(path, turns=("job1", "job0"), timeout_s=0.3, job="b rank 0")
    a0.acquire()
    assert a1.acquire() < 1.0  # the same job: both ranks compute at once
    with pytest.raises(GateTimeoutError, match="b rank 0 waited 0 s"):
        b0.acquire()
    a0.release()
    with pytest.raises(GateTimeoutError):  # a rank of the other job still computes
        b0.acquire()
    a1.release()
    b0.acquire()  # no rank of job 0 computes any more
    with pytest.raises(GateTimeoutError):
        DeviceGate(path, turns=("job0", "job1"), timeout_s=0.3).acquire()
    b0.release()
    for gate in (a0, a1, b0):
        gate.close()


def test_the_job_that_computed_last_lets_a_waiting_partner_go_first(tmp_path: Path) -> None:
    path = tmp_path / "pair0.lock"
    a = DeviceGate(path, turns=("job0", "job1"))
    b = DeviceGate(path, turns=("job1", "job0"))
    order: list[str] = []
    a.acquire()
    a.release()
    a.acquire()  # nobody waits: a takes it again at once
    order.append("a")

    def b_turn() -> None:
        b.acquire()
        order.append("b")
        time.sleep(0.2)
        b.release()

    waiting = threading.Thread(target=b_turn)
    waiting.start()
    time.sleep(0.3)  # b is waiting for the gate now
    a.release()
    a.acquire()  # a computed last and b waits: b goes first
    order.append("a")
    a.release()
    waiting.join(timeout=30)
    assert order == ["a", "b", "a"]
    a.close()
    b.close()


def test_a_rank_joins_the_turn_its_sibling_opened(tmp_path: Path) -> None:
    path = tmp_path / "pair0.lock"
    a0 = DeviceGate(path, turns=("job0", "job1"))
    a1 = DeviceGate(path, turns=("job0", "job1"), timeout_s=2.0)
    b = DeviceGate(path, turns=("job1", "job0"))
    a0.acquire()  # rank 0 of job 0 opens job 0's first turn; job 1 waits for the gate meanwhile
    waiting = threading.Thread(target=lambda: (b.acquire(), b.release()))
    waiting.start()
    time.sleep(0.3)
    # job 0 computed last and job 1 waits, but rank 1's first turn is the one rank 0 opened: it joins it (yielding
    # would put it a turn behind its sibling, and job 0's allreduce would wait for job 1's compute)
    a1.acquire()
    assert a1.held and a0.held
    a0.release()
    a1.release()
    waiting.join(timeout=30)
    assert b.acquisitions == 1
    for gate in (a0, a1, b):
        gate.close()
