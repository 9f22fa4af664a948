"""Emulated hosts (`--hosts H`): workers split into H network namespaces with their own host names, fast inside a
host and behind the shaped link between hosts; the topology recorded in profiles and checked against plans.

Tests that build namespaces need root and `ip`/`tc`; they are skipped elsewhere. Refusals are tested everywhere.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import planner.platform.link as link_mod
from planner.commands.cli import main
from planner.contracts.plan import Plan
from planner.platform.hosts import host_names, ranks_by_host
from planner.platform.launch import run_distributed
from planner.platform.link import HOSTS_ENV, EmulatedLink, LinkError, list_namespaces, parse_rate, privilege_problem
from planner.types import PlanMismatchError

pytestmark = pytest.mark.spawns  # its tests start their own workers (tests/pool.py says which must)

needs_root = pytest.mark.skipif(privilege_problem() is not None,
                                reason=f"no emulated hosts here: {privilege_problem()}")
PLAN = Path(__file__).resolve().parents[1] / "plans" / "lstm-2w-dense.json"


def _ours() -> list[str]:
    prefix = f"{link_mod.NAMESPACE_PREFIX}-{os.getpid()}-"
    return [n for n in list_namespaces() if n.startswith(prefix)]


def test_ranks_are_grouped_by_host_name_in_order_of_their_lowest_rank() -> None:
    assert ranks_by_host(["a", "b", "a", "c", "b"]) == [[0, 2], [1, 4], [3]]
    assert ranks_by_host(["x"]) == [[0]]
    assert host_names() == [socket.gethostname()]  # no process group: this process alone


def test_hosts_that_do_not_divide_the_workers_are_refused_before_anything_is_made() -> None:
    with pytest.raises(LinkError, match=r"--hosts must divide the number of workers \(4\).*\[1, 2, 4\]"):
        EmulatedLink(parse_rate("1gbit"), 4, hosts=3)
    link = EmulatedLink(None, 6, hosts=3)
    assert [link.host_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert link.address(1) == link.address(0) != link.address(2)
    assert link.namespace(3) == link.namespace(2) != link.namespace(0)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`planner ARGS` in this process (no interpreter and torch import per call), as `subprocess.run` returns it."""
    from tests.test_contracts import _main

    return _main(*args)


@pytest.mark.parametrize("command", [
    ["profile", "--model", "mlp", "--nproc", "4", "--hosts", "3", "-o", "{out}"],
    ["bench", "--plan", str(PLAN), "--nproc", "4", "--hosts", "3"],
])
def test_hosts_not_dividing_nproc_is_one_line_and_exit_2_with_nothing_written(command: list[str],
                                                                            tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    proc = _cli(*[part.format(out=out) for part in command])
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--hosts 3 does not divide --nproc 4 into hosts of equal size: use one of 1, 2, 4" \
        in lines[0], proc.stderr
    assert not out.exists() and _ours() == []


def test_hosts_without_the_privilege_says_so_and_exits_2(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(link_mod, "privilege_problem", lambda: "it needs root (forced by the test)")
    assert main(["bench", "--plan", str(PLAN), "--nproc", "2", "--hosts", "2", "--steps", "1"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("planner")]
    assert err == ["planner bench: error: cannot emulate 2 hosts: it needs root (forced by the test); "
                   "run without --hosts"]
    assert _ours() == []


def test_an_abs_plan_for_one_host_is_refused_on_two_before_any_worker_starts(tmp_path: Path) -> None:
    from planner.strategies.abs_plan import make_abs_plan
    from tests.test_abs_plan import slowed_profile

    plan = tmp_path / "abs.json"
    make_abs_plan(slowed_profile(), 64, source="p.json").save(plan)
    proc = _cli("bench", "--strategy", "abs", "--plan", str(plan), "--hosts", "2", "--samples", "100")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "made for 1 host of 2 workers, but the process group runs on 2 hosts of 1 worker" in lines[0]
    assert _ours() == []


def _host(rank: int, world_size: int, job: str) -> tuple[str, str]:
    names = host_names()  # a collective: no rank leaves while another still joins the group
    assert names[rank] == socket.gethostname()
    return job, names[rank]


@needs_root
def test_two_jobs_on_emulated_hosts_share_them_rank_by_rank() -> None:
    """`--hosts` for the crossover bench: rank r of both jobs on the same emulated host, hosts of two ranks."""
    from planner.platform.launch import run_jobs

    first, second = run_jobs([(_host, 4, ("a",)), (_host, 4, ("b",))], hosts=2, timeout=60)
    assert [job for job, _ in first] == ["a"] * 4 and [job for job, _ in second] == ["b"] * 4
    names = [name for _, name in first]
    assert [name for _, name in second] == names
    assert names[0] == names[1] != names[2] == names[3] and socket.gethostname() not in names
    with pytest.raises(ValueError, match="jobs of one world size"):
        run_jobs([(_host, 4, ("a",)), (_host, 2, ("b",))], hosts=2)
    assert _ours() == []


def test_a_plan_for_two_hosts_is_refused_on_one_naming_both() -> None:
    plan = Plan.load(PLAN)
    two = dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, host_count=2))
    info = plan.model
    two.check_compatible(info, 2, hosts=2)
    plan.check_compatible(info, 2, hosts=1)
    with pytest.raises(PlanMismatchError, match="made for 2 hosts of 1 worker, but the process group runs on 1 host "
                                                "of 2 workers"):
        two.check_compatible(info, 2, hosts=1)


def _where(rank: int, world_size: int, numel: int) -> tuple[str, str | None, list[str], float, float]:
    """This worker's host name, what it was told of the hosts, every rank's host name, and the seconds of an
    allreduce of `numel` floats with a peer on its own host and with one on the other host (world size 4)."""
    names = host_names()
    pairs = {"same": [[0, 1], [2, 3]], "across": [[0, 2], [1, 3]]}
    groups = {kind: [dist.new_group(p) for p in ps] for kind, ps in pairs.items()}
    x = torch.ones(numel)
    seconds = {}
    for kind, ps in pairs.items():
        mine = groups[kind][0] if rank in ps[0] else groups[kind][1]
        times = []
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x, group=mine)
            times.append(time.perf_counter() - t0)
        seconds[kind] = min(times)
    return socket.gethostname(), os.environ.get(HOSTS_ENV), names, seconds["same"], seconds["across"]


@needs_root
def test_two_hosts_of_two_have_their_own_names_and_only_the_link_between_them_is_shaped() -> None:
    numel = 4 << 20  # 16 MiB: at 1 Gbit/s about 0.27 s with two flows out of each host, a few ms inside one
    results = run_distributed(_where, 4, numel, hosts=2, link=parse_rate("1gbit"), timeout=120)
    names = [r[0] for r in results]
    assert names[0] == names[1] != names[2] == names[3] and socket.gethostname() not in names
    assert all(r[1] == "2" and r[2] == names for r in results)
    same, across = max(r[3] for r in results), max(r[4] for r in results)
    assert across >= 0.1, f"an allreduce of 16 MiB across the 1gbit link took {across:.3f} s"
    assert across >= 3 * same, f"across hosts {across:.3f} s, inside a host {same:.3f} s"
    assert _ours() == []


@needs_root
def test_a_profile_on_two_emulated_hosts_records_them_and_its_plan_is_refused_on_one(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    # --quick: every phase, on the emulated hosts, measured as few times as a profile does (what is checked is what
    # the profile records of the hosts and their link, not its numbers)
    assert main(["profile", "--quick", "--model", "mlp", "--batch-size", "8", "--nproc", "2", "--hosts", "2",
                 "--repeats", "2", "--warmup", "1", "--densities", "0.01", "--powersgd-ranks", "none", "--link",
                 "10gbit", "--intra-link", "20gbit", "-o", str(out)]) == 0
    from planner.contracts.profile import Profile

    profile = Profile.load(out)
    assert (profile.cluster.world_size, profile.cluster.host_count) == (2, 2)
    assert profile.cluster.link == "10gbit (20gbit inside hosts)"
    plan = tmp_path / "plan.json"
    assert main(["solve", str(out), "--strategy", "dense", "-o", str(plan)]) == 0
    proc = _cli("bench", "--plan", str(plan), "--steps", "1", "--warmup", "0", "--peers", "none")
    assert proc.returncode == 2
    assert "made for 2 hosts of 1 worker, but the process group runs on 1 host of 2 workers" in proc.stderr
    assert _ours() == []


def test_retune_hosts_needs_the_probe_and_hosts_dividing_the_workers(tmp_path: Path) -> None:
    from tests.factories import synthetic_profile

    prof, plan = tmp_path / "prof.json", tmp_path / "plan.json"
    synthetic_profile("mlp").save(prof)
    assert main(["solve", str(prof), "-o", str(plan)]) == 0
    for args, says in [(["--no-probe", "--hosts", "2"], "--hosts spreads the workers that retune probes with"),
                       (["--cluster", "eth10-8", "--hosts", "2"], "it needs the probe (drop --cluster"),
                       (["--nproc", "4", "--hosts", "3"], "--hosts 3 does not divide --nproc 4")]:
        proc = _cli("retune", str(plan), *args)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], proc.stderr
    assert not (Path("runs") / "plan-retuned.json").exists() and _ours() == []


@needs_root
def test_retune_on_two_emulated_hosts_probes_each_level_and_plans_for_them(tmp_path: Path) -> None:
    from tests.factories import synthetic_profile

    prof, plan, new = tmp_path / "prof.json", tmp_path / "plan.json", tmp_path / "new.json"
    synthetic_profile("mlp").save(prof)
    assert main(["solve", str(prof), "-o", str(plan)]) == 0
    proc = _cli("retune", str(plan), "--nproc", "4", "--hosts", "2", "-o", str(new))
    assert proc.returncode == 0, proc.stderr
    assert "probed world size 4 on 2 hosts, gloo" in proc.stdout and "allreduce inside a host" in proc.stdout
    assert "2 hosts:" in proc.stdout  # the plan says how its groups cross them
    retuned = Plan.load(new)
    assert (retuned.cluster.world_size, retuned.cluster.host_count) == (4, 2)
    assert _ours() == []


@pytest.mark.parametrize("args, says", [
    (["--intra-link", "10gbit", "--link", "1gbit"], "--intra-link shapes the loopback inside each emulated host: "
                                                    "it needs --hosts H"),
    (["--intra-link", "10gbit", "--hosts", "2"], "--intra-link needs --link RATE too"),
    (["--intra-link", "fast", "--hosts", "2", "--link", "1gbit"], "argument --intra-link: must be a rate"),
])
def test_intra_link_without_what_it_needs_is_one_line_and_nothing_is_made(args: list[str], says: str,
                                                                         tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    proc = _cli("profile", "--model", "mlp", "--nproc", "4", *args, "-o", str(out))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], proc.stderr
    assert not out.exists() and _ours() == []


@needs_root
def test_intra_link_shapes_inside_each_host_and_workers_record_both_rates() -> None:
    numel = 1 << 20  # 4 MiB: inside a host at 200 Mbit/s about 0.34 s (both directions share its loopback)
    link = dataclasses.replace(parse_rate("1gbit"), intra=parse_rate("200mbit"))
    results = run_distributed(_where, 4, numel, hosts=2, link=link, timeout=120)
    same, across = max(r[3] for r in results), max(r[4] for r in results)
    assert same >= 0.15, f"an allreduce of 4 MiB inside a 200mbit host took {same:.3f} s"
    assert same >= 2 * across, f"inside a host {same:.3f} s, across hosts {across:.3f} s"
    assert _ours() == []


def test_a_link_with_its_inside_rate_is_recorded_with_both() -> None:
    link = dataclasses.replace(parse_rate("1gbit"), intra=parse_rate("10gbit"))
    assert (link.label, link.text, parse_rate("1gbit").label) == ("1gbit (10gbit inside hosts)", "1gbit", "1gbit")
    cluster = dataclasses.replace(Plan.load(PLAN).cluster, world_size=4, host_count=2, link=link.label)
    assert cluster.describe().startswith("world size 4 on 2 hosts, gloo on ")
    assert cluster.describe().endswith("behind an emulated 1gbit (10gbit inside hosts) link")
