"""runtime.crossover.DeviceGate: exclusive between processes, released by the kernel when its holder dies, a
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

from planner.types import GateTimeoutError, PlannerFileError
from runtime import crossover
from runtime.crossover import DeviceGate

HOLD = """
import sys, time
from runtime import crossover
from runtime.crossover import DeviceGate
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


def test_with_turns_a_job_waits_for_its_partner_to_compute_before_computing_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "d0.lock"
    a = DeviceGate(path, turns=("job0", "job1"))
    assert not a.partner_present()
    a.acquire()
    a.release()
    a.acquire()  # the partner is not there: no waiting for it
    a.release()
    b = DeviceGate(path, turns=("job1", "job0"))
    assert a.partner_present() and b.partner_present()
    again = threading.Thread(target=a.acquire)
    again.start()
    time.sleep(0.3)
    assert not a.held  # a computed last and b is here: a's turn comes after b's
    b.acquire()
    b.release()
    again.join(timeout=5)
    assert a.held
    a.release()
    # a partner that lets its turn pass (alive but not computing) is waited for YIELD_S, then not until it
    # computes again (the bounds say "waited", "did not wait", not how fast)
    monkeypatch.setattr(crossover, "YIELD_S", 1.0)
    assert b.acquire() < 0.5  # a computed last
    b.release()
    started = time.perf_counter()
    b.acquire()
    assert 1.0 <= time.perf_counter() - started < 30.0
    b.release()
    assert b.acquire() < 0.5  # a has not computed since: b does not wait again
    b.release()
    a.close()
    assert not b.partner_present()  # a closed its gate
    b.close()
