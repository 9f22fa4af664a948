"""The race on gloo workers: a planted slower arm leaves the race, every rank holds the same decision, a killed worker
ends `planner race` in one line with nothing left running, and a budget of 0 keeps DDP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

from planner.commands.cli import main
from planner.contracts.race_record import RaceRecord
from planner.models import Workload
from planner.sessions.bench import Runner, Variant
from planner.sessions.race import RaceConfig, race_worker
from planner.strategies.mixed_plan import make_mixed_plan, parse_compressors
from tests.factories import synthetic_plan, synthetic_profile
from tests.pool import run_warm
from tests.test_lifecycle import _alive, _children, _cmdline, _end, _stat, _survivors

ROOT = Path(__file__).resolve().parents[1]
#: The arm planted slower, and by how much of its own step it sleeps.
SLEEPER, SLEEP_SHARE = "plan mixed (fp16) via DDP", 0.5


def _sleeping(build: Callable[..., Runner], sleeper: str, share: float) -> Callable[..., Runner]:
    """`Runner.build`, but the arm named `sleeper` sleeps, before each forward, `share` of its last step measured
    without the sleep: a step about that much slower, inside the timed step as any slower arm's would be."""

    def build_one(v: Variant, *args: Any, **kwargs: Any) -> Runner:
        runner = build(v, *args, **kwargs)
        if v.name != sleeper:
            return runner
        slept = [0.0]  # the sleep of the step under way
        runner.model.register_forward_pre_hook(lambda module, inputs: time.sleep(slept[0]))
        step = runner.step

        def slower_step(batch: tuple[torch.Tensor, torch.Tensor]) -> float:
            seconds = step(batch)
            slept[0] = share * (seconds - slept[0])
            return seconds

        runner.step = slower_step  # type: ignore[method-assign]
        return runner

    return build_one


def race_with_a_sleeper(rank: int, world_size: int, config: RaceConfig) -> RaceRecord:
    """`race_worker` on this rank with `SLEEPER` planted slower; every rank returns its own record."""
    with mock.patch.object(Runner, "build", _sleeping(Runner.build, SLEEPER, SLEEP_SHARE)):
        record = race_worker(rank, world_size, config, every_rank=True)
    assert record is not None
    return record


@pytest.fixture(scope="module")
def sleeper_race() -> list[RaceRecord]:
    """One race on two warm workers, shared by the tests that read it: DDP, an fp16 plan inside DDP (planted 50%
    slower) and the same plan in the runtime, at most 24 rounds of 2 steps per arm (a bet settles in 10 at the
    earliest); each rank's record."""
    plan = make_mixed_plan(synthetic_profile("mlp"), parse_compressors("fp16"))
    config = RaceConfig(plans=(plan,), model="mlp", peers=(), block=2, warmup=2, race_time_s=120.0, max_rounds=24,
                        show_progress=False)
    return run_warm(race_with_a_sleeper, 2, config, timeout=180)


def test_a_planted_slower_arm_is_beaten_and_leaves_the_race(sleeper_race: list[RaceRecord]) -> None:
    """The arm that sleeps 50% of its step (30% missed the 24 rounds once on a doubly loaded machine) is beaten by
    another arm within the 24 rounds, and is not kept."""
    record = sleeper_race[0]
    assert [a.name for a in record.arms] == ["ddp", SLEEPER, "plan mixed (fp16)"]
    slow = record.arm(SLEEPER)
    assert slow.beaten_by in ("ddp", "plan mixed (fp16)") and record.kept != SLEEPER, record.to_dict()


def test_every_rank_holds_the_same_race(sleeper_race: list[RaceRecord]) -> None:
    """Each rank settles the rule on the same slowest-rank times: every rank's record (the decision, the rule, the
    rounds, each arm's ratios, intervals and who beat it) is rank 0's, but for the clock time it was written at."""
    first, second = ({**record.to_dict(), "raced": None} for record in sleeper_race)
    assert first == second


def test_a_budget_of_zero_keeps_ddp_after_one_round(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--race-time 0`: the budget is spent after the first round, which settles nothing, so the simplest arm not
    beaten, DDP, is kept by the budget rule."""
    make_mixed_plan(synthetic_profile("mlp"), parse_compressors("fp16")).save(tmp_path / "fp16.json")
    assert main(["race", str(tmp_path / "fp16.json"), "--race-time", "0", "--block", "1", "--warmup", "0",
                 "--peers", "fp16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["kept"], result["rule"], result["rounds"]) == ("ddp", "budget", 1), result
    assert all(arm["rounds"] == 1 and arm["beaten_by"] is None for arm in result["arms"])


class _DiesMidRace(nn.Module):
    """A small MLP whose rank 1 kills itself (SIGKILL, as the OOM killer or a scheduler would) at its 30th forward
    in a process group. In `test_a_killed_worker_ends_the_race_in_one_line`'s race of three arms the set-up and the
    warm-up take a few forwards and each round 6, so it dies a few rounds in, while the race is still on: no rule
    settles before the tenth round (a bet needs that many to reach 1 / (alpha / 12)) nor the budget ends it."""

    forwards = 0  # in this process, over every arm's copy of the model

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _DiesMidRace.forwards += 1
        if _DiesMidRace.forwards >= 30 and dist.is_initialized() and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.net(x)


def dies_mid_race() -> Workload:
    torch.manual_seed(0)  # every rank builds the same weights
    return Workload(name="dies-mid-race", module=_DiesMidRace(), batch_size=8,
                    make_batch=lambda n, g: (torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)),
                    loss_fn=nn.functional.cross_entropy)


def _descendants(pids: set[int]) -> set[int]:
    """The processes started by any of `pids`, and by those, and so on (one scan of /proc)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            parents[int(entry.name)] = stat[1]
    found, grown = set(pids), True
    while grown:
        more = {pid for pid, parent in parents.items() if parent in found} - found
        found |= more
        grown = bool(more)
    return found - pids


@pytest.mark.spawns  # a command of its own, whose workers must die as spawned ones do
def test_a_killed_worker_ends_the_race_in_one_line(tmp_path: Path) -> None:
    """Rank 1 is killed by SIGKILL in the race's rounds: `planner race` exits 2 with one line on stderr naming the
    worker, the signal and the phase, and none of its processes (the workers, the resource tracker, anything they
    started) is left."""
    plan = tmp_path / "plan.json"
    synthetic_plan("tests.test_race_workers:dies_mid_race").save(plan)
    command = subprocess.Popen([sys.executable, "-m", "planner", "race", str(plan), "--peers", "none", "--block", "2",
                                "--warmup", "1", "--race-time", "120", "--json"],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set[int] = set()  # the command's processes, as they come
    workers: set[int] = set()
    deadline = time.monotonic() + 180
    try:
        while command.poll() is None and time.monotonic() < deadline:
            kids = _children(command.pid)
            seen.update(kids)
            seen.update(_descendants(seen))
            workers.update(kid for kid in kids if "spawn_main" in _cmdline(kid))
            time.sleep(0.05)
        out, err = command.communicate(timeout=10)
        lines = [line for line in err.splitlines() if line.strip()]
        assert command.returncode == 2 and len(lines) == 1 and out == "", (command.returncode, err, out)
        assert "worker rank 1 was killed by SIGKILL" in lines[0] and "(during: race rounds" in lines[0], lines[0]
        assert len(workers) == 2 and workers < seen, (workers, seen)
        assert _survivors(sorted(seen), within_s=10) == [], [_cmdline(pid) for pid in seen if _alive(pid)]
        assert "race" not in json.loads(plan.read_text())  # nothing recorded
    finally:  # what a failed check found left is ended here
        if command.poll() is None:
            command.kill()
            command.wait()
        _end(sorted(seen))
