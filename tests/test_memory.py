"""What `planner profile` holds in memory: the peak of each phase is measured and kept in the profile, and the
top-k sweep leaves out the points that would not fit."""

from __future__ import annotations

import ast
import ctypes
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from planner.commands.cli import main
from planner.contracts.profile import Profile
from planner.costmodel.curves import select_model
from planner.platform.memory import PhaseMemory, available_bytes, peak_rss_bytes, rss_bytes
from planner.profilers.topk import measure_topk, topk_point_bytes
from planner.types import SchemaError
from tests.factories import synthetic_profile

pytestmark = pytest.mark.spawns  # its tests start their own workers (tests/pool.py says which must)

CPU = torch.device("cpu")
linux = pytest.mark.skipif(peak_rss_bytes() is None, reason="reads /proc (Linux)")


@linux
def _phase_peaks() -> dict[str, int]:
    memory = PhaseMemory()
    memory.begin("big")
    big = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    del big
    memory.begin("small")
    small = torch.ones(1 << 10, dtype=torch.uint8)
    del small
    memory.end()
    return memory.peaks


def test_each_phase_has_its_own_peak() -> None:
    # In a process of its own: the peaks are the whole process's resident memory, and in the test session's
    # process what earlier tests left behind once hid the 64 MiB (both phases read 921 MiB in a full run).
    out = subprocess.run([sys.executable, "-c", "from tests.test_memory import _phase_peaks; "
                          "print(repr(_phase_peaks()))"], capture_output=True, text=True, check=True)
    peaks = ast.literal_eval(out.stdout.strip())
    assert list(peaks) == ["big", "small"]
    assert peaks["big"] - peaks["small"] > 48 << 20  # the second phase's peak starts afresh
    rss, available = rss_bytes(), available_bytes()
    assert rss is not None and available is not None and rss > 0 and available > 0


def test_the_topk_sweep_leaves_out_what_does_not_fit() -> None:
    sizes, densities = [1 << 10, 1 << 12, 1 << 14, 1 << 16], [0.01, 1.0]
    budget = topk_point_bytes(1 << 14, 0.01, 2)  # the third size fits at 1% only; the fourth not at all
    assert topk_point_bytes(1 << 14, 1.0, 2) > budget
    calls: list[int] = []
    timing = measure_topk(sizes, densities, 2, CPU, repeats=1, warmup=0, max_point_bytes=budget,
                          on_point=lambda: calls.append(1))
    measured = {(n, d) for n, d, _ in timing.select}
    assert measured == {(1 << 10, 0.01), (1 << 10, 1.0), (1 << 12, 0.01), (1 << 12, 1.0), (1 << 14, 0.01)}
    assert len(calls) == len(sizes) * len(densities)  # progress counts the points left out too
    # The curves reach the sizes left out by extending the measured ones.
    assert select_model(timing, 1.0).cost(1 << 16) > select_model(timing, 1.0).cost(1 << 12) > 0
    # The two smallest sizes are measured whatever the budget: a curve needs two points.
    tiny = measure_topk(sizes[:3], [0.01], 2, CPU, repeats=1, warmup=0, max_point_bytes=1)
    assert {n for n, _, _ in tiny.select} == {1 << 10, 1 << 12}


def test_peak_memory_round_trips_is_checked_and_shown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dataclasses import replace

    profile = replace(synthetic_profile("mlp"), peak_memory={"layers": 3 << 30, "top-k": 1 << 29})
    doc = profile.to_dict()
    assert Profile.from_dict(json.loads(json.dumps(doc))) == profile
    path = tmp_path / "p.json"
    profile.save(path)
    assert main(["show", str(path), "--details"]) == 0  # the summary leaves memory to the details
    assert "per phase of the profile: layers 3.00 GiB, top-k 0.50 GiB" in " ".join(capsys.readouterr().out.split())
    del doc["peak_memory"]  # profiles made before it was measured
    assert Profile.from_dict(doc).peak_memory is None
    doc["peak_memory"] = {"layers": -1}
    with pytest.raises(SchemaError, match=r"peak_memory\.layers must be an integer between 0"):
        Profile.from_dict(doc)


@linux
def test_a_profile_that_cannot_fit_is_refused_before_it_starts(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import planner.sessions.profile as profile_cmd

    out = tmp_path / "p.json"
    # An MLP of 1.6 MB of parameters on 2 workers needs (7 + 2) copies each: refused with 20 MB available.
    monkeypatch.setattr(profile_cmd, "available_bytes", lambda: 20 << 20)
    proc_args = ["profile", "--model", "mlp", "--nproc", "2", "-o", str(out)]
    assert main(proc_args) == 2 and not out.exists()
    with pytest.raises(profile_cmd.PlannerError, match=r"profiling mlp with 2 worker\(s\) on this host needs at "
                                                        r"least .* but 0\.02 GiB is available: use fewer --nproc"):
        profile_cmd.check_memory("mlp", None, 2, world_size=2)
    assert profile_cmd.memory_floor(1000, 4) == 11_000




def _returned_on_free() -> float:
    """MiB of resident memory this process gives back when a 16 MiB tensor it filled is freed: what a step's
    gradients cost to fault in again at the next step if their memory goes back to the system."""
    torch.set_num_threads(1)
    t = torch.ones(16 << 20, dtype=torch.uint8)
    before = rss_bytes()
    del t
    after = rss_bytes()
    assert before is not None and after is not None
    return (before - after) / 2**20


def _returned_in_worker(rank: int, world_size: int) -> float:
    return _returned_on_free()


@linux
@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallopt"), reason="needs glibc's mallopt")
def test_the_workers_keep_freed_memory_as_a_long_training_run_does() -> None:
    """On glibc's starting thresholds a fresh process gives every block of 128 KiB or more back when it is
    freed, so a step's gradients were faulted in again at every step (2,500 page faults per step of the MLP,
    and its profile's steps 20-35% slower than the bench's, where the thresholds had grown). The workers
    `planner` starts keep them, as a long run does."""
    from planner.platform.launch import run_distributed

    fresh = subprocess.run([sys.executable, "-c", "from tests.test_memory import _returned_on_free; "
                            "print(_returned_on_free())"], capture_output=True, text=True, check=True)
    assert float(fresh.stdout) > 12, fresh.stdout
    assert run_distributed(_returned_in_worker, 1)[0] < 4
