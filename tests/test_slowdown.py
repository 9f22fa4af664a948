"""Slowed local workers (planner.platform.slowdown): parsing, the cgroups' life cycle, refusals in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from planner.contracts.fingerprint import ClusterInfo
from planner.platform import slowdown as sd
from planner.platform.launch import run_distributed
from planner.platform.slowdown import (
    Slowdown,
    SlowdownError,
    SlowdownUnavailableError,
    ThrottledWorkers,
    parse_slowdown,
    privilege_problem,
)

pytestmark = pytest.mark.spawns  # its tests start their own workers (tests/pool.py says which must)

REAL_CGROUPS = privilege_problem() is None
needs_cgroups = pytest.mark.skipif(not REAL_CGROUPS, reason=f"no CPU cgroups here: {privilege_problem()}")


@pytest.mark.parametrize(
    ("text", "factors", "canonical"),
    [("1=2", {1: 2.0}, "1=2"), (" 0 = 1.5 , 2=3", {0: 1.5, 2: 3.0}, "0=1.5,2=3"), ("3=100", {3: 100.0}, "3=100")],
)
def test_slowdowns_parse(text: str, factors: dict[int, float], canonical: str) -> None:
    parsed = parse_slowdown(text)
    assert dict(parsed.factors) == factors and parsed.text == canonical
    assert parsed.factor(max(factors) + 1) == 1.0


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("1", "must be RANK=FACTOR"),
        ("a=2", "a rank is a whole number >= 0"),
        ("-1=2", "a rank is a whole number >= 0"),
        ("1=fast", "a factor is a number > 1"),
        ("1=1", "must be > 1"),
        ("1=0.5", "must be > 1"),
        ("1=nan", "must be > 1"),
        ("1=inf", "must be > 1"),
        ("1=1000", "at most 100"),
        ("1=2,1=3", "names rank 1 twice"),
        ("", "must be RANK=FACTOR"),
    ],
)
def test_bad_slowdowns_are_refused(text: str, match: str) -> None:
    with pytest.raises(SlowdownError, match=match):
        parse_slowdown(text)


def test_a_rank_beyond_the_world_size_is_refused() -> None:
    with pytest.raises(SlowdownError, match=r"names rank\(s\) \[2\] but there are 2 workers"):
        ThrottledWorkers(parse_slowdown("2=2"), world_size=2)


def test_without_a_cpu_controller_or_root_it_refuses_in_one_line(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SlowdownUnavailableError, match="no cgroup v1 `cpu` controller"):
        ThrottledWorkers(parse_slowdown("1=2"), 2, root=tmp_path).create()
    (tmp_path / "cpu.cfs_quota_us").write_text("-1")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SlowdownUnavailableError, match=r"needs root.*run without --slowdown"):
        ThrottledWorkers(parse_slowdown("1=2"), 2, root=tmp_path).create()
    assert [p.name for p in tmp_path.iterdir()] == ["cpu.cfs_quota_us"]  # nothing made


def test_groups_get_the_quota_and_go_away(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a stand-in controller folder: one group per slowed rank, 1 ms per FACTOR ms, removed by destroy;
    a group left by a launcher that is gone is removed by the next run, one of a live launcher is not."""
    (tmp_path / "cpu.cfs_quota_us").write_text("-1")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"planner-{int(dead.stdout)}-abc123-w1"
    live = tmp_path / f"planner-{os.getppid()}-abc123-w0"
    stale.mkdir()
    live.mkdir()
    with ThrottledWorkers(parse_slowdown("0=1.5,2=4"), 3, root=tmp_path) as groups:
        assert groups.path(1) is None
        for rank, period in ((0, "1500"), (2, "4000")):
            path = groups.path(rank)
            assert path is not None and path.is_dir()
            assert (path / "cpu.cfs_period_us").read_text() == period
            assert (path / "cpu.cfs_quota_us").read_text() == "1000"
            # a stand-in folder keeps the files it was given; the kernel's would vanish with the group
            for f in path.iterdir():
                f.unlink()
        assert not stale.exists() and live.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu.cfs_quota_us", live.name]


def test_cluster_provenance_records_the_slowdown() -> None:
    slowed = ClusterInfo(world_size=2, backend="gloo", device="cpu", slowdown="1=2")
    assert ClusterInfo.from_dict(slowed.to_dict()) == slowed
    assert "workers slowed 1=2" in slowed.describe()
    plain = ClusterInfo(world_size=2, backend="gloo", device="cpu")
    assert "slowdown" not in plain.to_dict()  # documents without slowed workers are as before


def _where_am_i(rank: int, world_size: int, fail_on: int | None) -> tuple[str, str | None, str | None]:
    """This worker's cpu cgroup and what the environment says of its slowdown."""
    if rank == fail_on:
        raise RuntimeError("boom")
    line = next(x for x in Path("/proc/self/cgroup").read_text().splitlines() if ":cpu," in x or ":cpu:" in x)
    return line.split(":", 2)[2], os.environ.get(sd.SLOWDOWN_ENV), os.environ.get(sd.SLOWDOWNS_ENV)


def _planner_groups() -> set[str]:
    return {p.name for p in sd.CGROUP_CPU_ROOT.iterdir() if p.name.startswith("planner-")}


@needs_cgroups
def test_slowed_workers_run_in_their_group_and_it_is_removed_on_every_exit() -> None:
    before = _planner_groups()
    results = run_distributed(_where_am_i, 2, None, slowdown=Slowdown(factors={1: 2.0}, text="1=2"))
    (group0, factor0, run0), (group1, factor1, run1) = results
    assert not group0.split("/")[-1].startswith("planner-") and factor0 is None
    assert group1.split("/")[-1].startswith("planner-") and factor1 == "2"
    assert run0 == run1 == "1=2"
    assert _planner_groups() == before
    with pytest.raises(RuntimeError, match="boom"):
        run_distributed(_where_am_i, 2, 1, slowdown=Slowdown(factors={1: 3.0}, text="1=3"))
    assert _planner_groups() == before


def _change_my_speed(rank: int, world_size: int) -> tuple[str, str | None] | str:
    """Slowed rank 1 changes its factor to 3; rank 0 (not slowed) is refused."""
    try:
        sd.set_own_factor(3.0)
    except sd.SlowdownError as exc:
        return str(exc)
    group = next(x for x in Path("/proc/thread-self/cgroup").read_text().splitlines() if ":cpu," in x or ":cpu:" in x)
    period = (sd.CGROUP_CPU_ROOT / group.split(":", 2)[2].lstrip("/") / "cpu.cfs_period_us").read_text().strip()
    return period, os.environ.get(sd.SLOWDOWN_ENV)


@needs_cgroups
def test_a_slowed_worker_changes_its_speed_mid_run() -> None:
    refused, changed = run_distributed(_change_my_speed, 2, slowdown=Slowdown(factors={1: 1.5}, text="1=1.5"))
    assert isinstance(refused, str) and "this worker is not slowed" in refused
    assert changed == ("3000", "3")
    with pytest.raises(sd.SlowdownError, match="must be > 1"):
        sd.set_own_factor(1.0)


@needs_cgroups
def test_cli_refuses_bad_slowdowns_in_one_line(tmp_path: Path) -> None:
    for args, message in ((["--slowdown", "1=0.5"], "must be > 1"),
                          (["--slowdown", "5=2"], "names rank(s) [5] but there are 2 workers")):
        proc = subprocess.run([sys.executable, "-m", "planner", "profile", "--model", "mlp", "--nproc", "2",
                               *args, "-o", str(tmp_path / "p.json")], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        # one line naming the problem (a malformed value too: argparse's usage block is not printed)
        lines = [x for x in proc.stderr.splitlines() if x.strip() and "socket.cpp" not in x]
        assert len(lines) == 1 and message in lines[0], proc.stderr
        assert not (tmp_path / "p.json").exists()


def test_worker_throughput_round_trips_and_is_validated() -> None:
    from planner.contracts.profile import Profile, WorkerThroughput
    from planner.types import InvalidProfileError
    from tests.factories import synthetic_profile

    tp = WorkerThroughput(batch_sizes=(8, 16), step_s=((0.01, 0.02), (0.02, 0.04)))
    assert tp.samples_per_s(0) == (800.0, 800.0) and tp.spread == pytest.approx(2.0)
    profile = replace(synthetic_profile("mlp", world_size=2), throughput=tp)
    assert Profile.from_dict(profile.to_dict()).throughput == tp
    doc = profile.to_dict()
    del doc["throughput"]  # profiles made before: not measured
    assert Profile.from_dict(doc).throughput is None
    for bad, match in (({"batch_sizes": [16, 8], "step_s": [[1, 1], [1, 1]]}, "increasing"),
                       ({"batch_sizes": [8], "step_s": [[1, 1], [1, 1]]}, "one time per batch size"),
                       ({"batch_sizes": [8], "step_s": [[0], [1]]}, "times > 0"),
                       ({"batch_sizes": [8], "step_s": [[1]]}, "1 workers but the world size is 2"),
                       ({"batch_sizes": [0], "step_s": [[1], [1]]}, "batch_sizes")):
        with pytest.raises(InvalidProfileError, match=match):
            Profile.from_dict({**doc, "throughput": bad})

