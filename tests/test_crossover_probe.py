"""planner.runtime.crossover's probe: a crossed-over pair measures its throughput gated and free on the host's
wall clock and runs the better. The schedule and the arithmetic worked by hand; two jobs' probes, each fed step times,
agree on one decision through the files; a session starts afresh once every rank has closed its gate; a free
step leaves the gate to the partner."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from planner.runtime.crossover import (
    FREE,
    GATED,
    DeviceGate,
    GateProbe,
    ProbeDecision,
    ProbeSchedule,
    decide,
    device_idle,
    window_rates,
)
from planner.types import PlannerFileError

SCHEDULE = ProbeSchedule(warmup_s=1.0, window_s=2.0, every_s=10.0)


def test_the_schedule_worked_by_hand() -> None:
    assert SCHEDULE.cycle_s == 4 * 2.0 + 2.0 + 10.0
    # warm-up, then free, gated, gated, free (2 s each), 2 s of measurements coming in, 10 s decided
    expected = {0.5: (-1, 0), 1.0: (0, 0), 2.9: (0, 0), 3.0: (0, 1), 5.5: (0, 2), 8.0: (0, 3), 9.0: (0, 4),
                11.0: (0, 5), 20.9: (0, 5), 21.0: (1, 0), 29.5: (1, 4), 41.0: (2, 0)}
    for elapsed, stage in expected.items():
        assert SCHEDULE.stage(elapsed) == stage, elapsed
    assert SCHEDULE.windows(1) == [(21.0, 23.0, FREE), (23.0, 25.0, GATED), (25.0, 27.0, GATED),
                                   (27.0, 29.0, FREE)]
    once = ProbeSchedule(warmup_s=0.0, window_s=1.0, every_s=None)
    assert math.isinf(once.cycle_s)
    assert [once.stage(t) for t in (0.0, 3.5, 4.5, 1e6)] == [(0, 0), (0, 3), (0, 4), (0, 5)]
    assert once.windows(0)[-1] == (3.0, 4.0, FREE)
    for bad in ({"window_s": 0}, {"warmup_s": -1}, {"every_s": math.inf}, {"window_s": True}):
        with pytest.raises(ValueError, match="ProbeSchedule"):
            ProbeSchedule(**bad)  # type: ignore[arg-type]


def test_window_rates_count_the_steps_that_begin_and_end_inside_a_window() -> None:
    windows = [(0.0, 1.0, FREE), (1.0, 2.0, GATED), (2.0, 3.0, GATED), (3.0, 4.0, FREE)]
    # free: 0.1, 0.3, 0.5 (2 steps in 0.4 s) and 3.2, 3.7 (1 step in 0.5 s); gated: 1.0, 1.8 (1 step in 0.8 s)
    # and the lone 2.5 (no whole step)
    stamps = [0.1, 0.3, 0.5, 1.0, 1.8, 2.5, 3.2, 3.7, 4.2]
    rates = window_rates(stamps, windows)
    assert rates[FREE] == pytest.approx(3 / 0.9)
    assert rates[GATED] == pytest.approx(1 / 0.8)
    assert window_rates([0.5, 2.5], windows) == {GATED: None, FREE: None}


def test_decide_adds_the_jobs_samples_per_second_and_keeps_the_crossover_without_a_measurement() -> None:
    samples = {"job0": 100, "job1": 10}
    # job0: 5 steps/s gated, 4 free; job1 (two ranks): 10 gated, 30 free -> 600 gated against 700 free
    results = {"job0": [{GATED: 5.0, FREE: 4.0}],
               "job1": [{GATED: 10.0, FREE: 29.0}, {GATED: 10.0, FREE: 31.0}]}
    made = decide(3, results, samples)
    assert (made.cycle, made.mode) == (3, FREE)
    assert made.gated_samples_per_s == pytest.approx(600.0) and made.free_samples_per_s == pytest.approx(700.0)
    results["job1"] = [{GATED: 20.0, FREE: 20.0}]  # 700 gated, 600 free
    assert decide(3, results, samples).mode == GATED
    results["job0"] = [{GATED: 4.0, FREE: 4.0}]  # a tie keeps the plan's crossover
    assert decide(3, results, samples).mode == GATED
    missing = decide(3, {"job0": [{GATED: 5.0, FREE: None}], "job1": results["job1"]}, samples)
    assert missing.mode == GATED and missing.free_samples_per_s is None and "no measurement of job0 free" in \
        missing.reason
    assert decide(0, {"job0": results["job0"]}, samples).mode == GATED  # the partner never reported


def _feed(probes: list[GateProbe], step_s: dict[str, tuple[float, float]], start: float, end: float) -> list[bool]:
    """Step every probe from `start` to `end` (seconds into the session), each job taking (gated, free) seconds
    per step in the mode its probe says; returns job0's first probe's modes."""
    modes = []
    clock = {id(p): start for p in probes}
    while True:
        probe = min(probes, key=lambda p: clock[id(p)])
        now = clock[id(probe)]
        if now >= end:
            return modes
        gated = probe.gated(probe.epoch + now)
        if probe is probes[0]:
            modes.append(gated)
        clock[id(probe)] = now + step_s[probe.job][0 if gated else 1]


def test_two_jobs_probes_agree_through_the_files_and_run_the_better_mode(tmp_path: Path) -> None:
    path = tmp_path / "pair0.lock"
    samples = {"job0": 64, "job1": 32}
    probes = [GateProbe(path, SCHEDULE, job, samples) for job in ("job0", "job0", "job1", "job1")]
    assert len({p.epoch for p in probes}) == 1  # one session: the first opened it, the others joined
    # both jobs are slower crossed over (as over loopback): after the first cycle's probe the pair runs free
    _feed(probes, {"job0": (0.25, 0.2), "job1": (0.5, 0.4)}, 0.0, 9.0)
    assert all(p.gated(p.epoch + 9.5) for p in probes)  # measurements coming in: still gated (nothing decided)
    assert not any(p.gated(p.epoch + 11.0) for p in probes)
    decisions = {p.decisions[0] for p in probes}
    assert len(decisions) == 1  # the first past the probe decided; the others read its file
    (decision,) = decisions
    assert decision.mode == FREE
    assert decision.free_samples_per_s == pytest.approx(64 / 0.2 + 32 / 0.4, rel=1e-6)
    assert decision.gated_samples_per_s == pytest.approx(64 / 0.25 + 32 / 0.5, rel=1e-6)
    assert probes[0].applied[0][1] == decision
    assert len(list(tmp_path.glob("pair0.lock.probe-c0-job*.json"))) == 4  # each rank's measurement
    # the next cycle: now crossing over pays; the pair runs free while the measurements come in, then gated
    modes = _feed(probes, {"job0": (0.1, 0.2), "job1": (0.2, 0.4)}, 21.0, 29.0)
    assert modes[:8] == [False] * 8 and modes[-1] is False  # the first window is free, and so is the last
    assert not probes[0].gated(probes[0].epoch + 29.5)  # measurements coming in: the last decision (free)
    assert probes[2].gated(probes[2].epoch + 31.0)
    assert probes[0].decision(1).mode == GATED  # read from the file job1's rank wrote
    for p in probes:
        p.close()


def test_a_session_starts_afresh_once_every_rank_has_closed_its_gate(tmp_path: Path) -> None:
    path = tmp_path / "pair0.lock"
    first = GateProbe(path, SCHEDULE, "job0", {"job0": 1, "job1": 1})
    _feed([first], {"job0": (0.1, 0.1), "job1": (0.1, 0.1)}, 0.0, 12.0)
    assert first.decisions[0].mode == GATED  # the partner never reported: keep crossing over
    assert (tmp_path / "pair0.lock.probe-c0-decision.json").exists()
    joined = GateProbe(path, SCHEDULE, "job1", {"job0": 1, "job1": 1})
    assert joined.epoch == first.epoch  # a rank of the session is alive: the newcomer joins it
    joined.close()
    first.close()
    again = GateProbe(path, SCHEDULE, "job0", {"job0": 1, "job1": 1})
    assert again.epoch > first.epoch  # nobody alive: a new session, the last one's files gone
    assert not (tmp_path / "pair0.lock.probe-c0-decision.json").exists()
    assert list(tmp_path.glob("pair0.lock.probe-c*")) == []
    again.close()


def test_a_decision_file_is_data_and_a_bad_one_is_remade(tmp_path: Path) -> None:
    path = tmp_path / "pair0.lock"
    probe = GateProbe(path, SCHEDULE, "job0", {"job0": 1, "job1": 1})
    (tmp_path / "pair0.lock.probe-c0-decision.json").write_text('{"mode": "__import__(\'os\')"}')
    made = probe.decision(0)
    assert isinstance(made, ProbeDecision) and made.mode == GATED
    probe.close()


def test_a_free_step_leaves_the_gate_to_the_partner(tmp_path: Path) -> None:
    path = tmp_path / "pair0.lock"
    free = ProbeSchedule(warmup_s=0.0, window_s=3600.0, every_s=None)  # the first window (free) for an hour
    a = DeviceGate(path, turns=("job0", "job1"), probe=free, samples={"job0": 8, "job1": 8})
    b = DeviceGate(path, turns=("job1", "job0"), timeout_s=0.3)
    assert a.acquire() == 0.0 and not a.held and a.steps == 1 and a.acquisitions == 0
    assert a.acquire() == 0.0 and a.steps == 1  # a second forward in the same step: still the same free step
    b.acquire()  # a runs this step free: the partner is not kept waiting
    assert b.held
    b.release()
    a.release()
    assert a.acquire() == 0.0 and a.steps == 2
    a.release()
    plain = DeviceGate(tmp_path / "pair1.lock", turns=("job0", "job1"))
    assert plain.acquire() < 1.0 and plain.held and plain.steps == plain.acquisitions == 1
    for gate in (a, b, plain):
        gate.close()
    with pytest.raises(ValueError, match="a probe needs turns"):
        DeviceGate(path, probe=free)


def test_a_rank_joining_a_session_follows_its_schedule(tmp_path: Path) -> None:
    path = tmp_path / "pair0.lock"
    first = GateProbe(path, SCHEDULE, "job0", {"job0": 1, "job1": 1})
    joined = GateProbe(path, ProbeSchedule(), "job1", {"job0": 1, "job1": 1})  # asks for the default schedule
    assert joined.schedule == SCHEDULE  # but switches with the session's
    joined.close()
    first.close()
    (tmp_path / "pair0.lock.probe-epoch").write_text("[1, 2]")
    held = GateProbe(path, SCHEDULE, "job0", {"job0": 1, "job1": 1})  # a new session rewrites it
    with pytest.raises(PlannerFileError, match=r"probe-epoch is damaged \(delete it\)"):
        (tmp_path / "pair0.lock.probe-epoch").write_text("{}")
        DeviceGate(path, turns=("job1", "job0"), probe=SCHEDULE)  # joins the live session: its file is damaged
    held.close()


def test_the_gate_is_handed_over_once_a_cuda_device_has_run_the_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    synced: list[object] = []

    class Stream:
        def synchronize(self) -> None:
            synced.append("stream")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: synced.append(device) or Stream())
    device_idle(torch.device("cpu"))
    assert synced == []  # a CPU has run its work when the call returns
    device_idle(torch.device("cuda", 1))
    assert synced == [torch.device("cuda", 1), "stream"]
