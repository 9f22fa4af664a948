"""Commands that start workers also run as the ranks of a job torchrun launched (one host, two ranks,
`torch.distributed.run --standalone`; and, where root can emulate hosts, one torchrun per host under `--nnodes 2`
as on two real hosts): rank 0 writes the results, the other ranks write nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from torch import nn

from planner.contracts.plan import Plan
from planner.contracts.profile import Profile
from planner.models import Workload
from planner.platform.link import WORKER_IFNAME, EmulatedLink, parse_rate
from planner.strategies.gradients import make_plan
from planner.types import Strategy
from tests.factories import synthetic_profile
from tests.test_hierarchical import _two_host_profile
from tests.test_hosts import _ours, needs_root
from tests.test_tune import MODEL

pytestmark = pytest.mark.spawns  # its tests start their own workers (tests/pool.py says which must)

PlanOrProfile = TypeVar("PlanOrProfile", Plan, Profile)
#: `kfac_workload`, as the workers build it.
KFAC_MODEL = "tests.test_torchrun:kfac_workload"


def kfac_workload() -> Workload:
    """Three Linear layers (16-32-16-128) on random data, whose K-FAC plan on 2 hosts of 2 has every variant of
    K-FAC's bench and preconditioners owned on both hosts, as the digits MLP's has, with factors of at most 128
    (the digits MLP's are 513) and no data set to load."""
    module = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 128))

    def make_batch(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 16, generator=gen), torch.randint(0, 128, (n,), generator=gen)

    return Workload(name="kfac-two-hosts", module=module, batch_size=16, make_batch=make_batch,
                    loss_fn=nn.functional.cross_entropy)


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}


def _start_torchrun(*args: str) -> subprocess.Popen[str]:
    """`planner ARGS` on the 2 ranks of a standalone torchrun, started (`_finish` waits for it)."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             "-m", "planner", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_clean_env())


def _finish(proc: subprocess.Popen[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _torchrun(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return _finish(_start_torchrun(*args), timeout)


def test_tune_runs_on_the_group_torchrun_made(tmp_path: Path) -> None:
    """(`planner bench` on torchrun's group: two nodes of it below, and ABS-SGD's on one host's.)"""
    synthetic_profile(MODEL, world_size=2).save(tmp_path / "p.json")
    tuned = tmp_path / "tuned.json"
    # --hosts emulates hosts for workers a command starts itself; torchrun's are its own: one line. Its own torchrun
    # (a standalone one: its own rendezvous port), run while the tune runs.
    refused = _start_torchrun("tune", str(tmp_path / "p.json"), "--model", MODEL, "--hosts", "2", "-o",
                              str(tmp_path / "x.json"))
    try:
        proc = _torchrun("tune", str(tmp_path / "p.json"), "--model", MODEL, "--trials", "2", "--steps", "2",
                         "--rungs", "2", "--warmup", "1", "--compare-steps", "2", "--max-group-mb", "0.0006,0.002",
                         "-o", str(tuned))
    finally:
        refusal = _finish(refused, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("wrote plan") == 1  # rank 0 only
    assert Plan.load(tuned).cluster.world_size == 2
    assert refusal.returncode != 0 and "drop --hosts" in refusal.stderr and not (tmp_path / "x.json").exists()


def _on_two_emulated_hosts(tmp_path: Path, *planner_args: str) -> list[str]:
    """`planner ARGS` launched as two real hosts launch it: one torchrun per emulated host (`--nnodes 2
    --node_rank h`, 2 ranks each), each in its host's network namespace under its own host name, the hosts joined
    by a shaped link. Asserts both nodes exit 0 and nothing is left behind; returns each node's stdout."""
    outs = [tmp_path / f"host{h}.out" for h in range(2)]
    errs = [tmp_path / f"host{h}.err" for h in range(2)]
    with EmulatedLink(parse_rate("10gbit"), world_size=4, hosts=2) as link:
        procs = []
        for h in range(2):
            name = link.namespace(2 * h)
            line = (f"hostname {name} && exec {sys.executable} -m torch.distributed.run --nnodes 2 --node_rank {h} "
                    f"--nproc_per_node 2 --master_addr {link.address(0)} --master_port 29500 -m planner "
                    + " ".join(planner_args))
            with outs[h].open("w") as out, errs[h].open("w") as err:
                procs.append(subprocess.Popen(["ip", "netns", "exec", name, "unshare", "--uts", "sh", "-c", line],
                                              stdout=out, stderr=err, env={**_clean_env(),
                                                                           "GLOO_SOCKET_IFNAME": WORKER_IFNAME}))
        codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0, 0], [e.read_text()[-2000:] for e in errs]
    assert _ours() == []
    return [o.read_text() for o in outs]


@needs_root
def test_bench_runs_under_torchrun_on_two_nodes_as_on_two_hosts(tmp_path: Path) -> None:
    """A plan for 2 hosts of 2 that crosses them hierarchically runs under `--nnodes 2`; rank 0 (on the first
    host) writes the results and the second host nothing."""
    plan = make_plan(_two_host_profile(), Strategy.DENSE, route="hierarchical")
    assert plan.cluster.host_count == 2 and all(g.hierarchical for g in plan.groups)
    plan.save(tmp_path / "plan.json")
    first, second = _on_two_emulated_hosts(tmp_path, "bench", "--plan", str(tmp_path / "plan.json"), "--steps", "2",
                                           "--warmup", "1", "--peers", "none", "--json")
    rows = json.loads(first)  # one document: rank 0's
    assert {"ddp", "plan dense, hierarchical"} <= {r["name"] for r in rows}
    assert all(r["median_s"] > 0 for r in rows)
    assert second == ""


def _for_two_hosts(made: PlanOrProfile) -> PlanOrProfile:
    """A synthetic plan or profile, as if made on 2 hosts."""
    return dataclasses.replace(made, cluster=dataclasses.replace(made.cluster, host_count=2))


@needs_root
def test_the_kfac_bench_runs_under_torchrun_on_two_nodes(tmp_path: Path) -> None:
    """K-FAC's bench on torchrun's group across two emulated hosts, with layers preconditioned on each host and sent
    to the other. Rank 0 writes; the second host prints nothing. (ABS-SGD's bench and tune start their workers as
    bench does: one host's torchrun shows it for them, at half the ranks.)"""
    from planner.strategies.kfac_plan import make_kfac_plan

    kfac = _for_two_hosts(make_kfac_plan(synthetic_profile(KFAC_MODEL, 4), inv_update_steps=2, source="synthetic"))
    assert kfac.kfac is not None
    owners = {rank for rank in kfac.kfac.preconditioners.values() if rank is not None}
    assert {rank // 2 for rank in owners} == {0, 1}  # layers preconditioned on each host, sent to the other
    kfac.save(tmp_path / "kfac.json")
    first, second = _on_two_emulated_hosts(tmp_path, "bench", "--strategy", "kfac", "--plan",
                                           str(tmp_path / "kfac.json"), "--steps", "2", "--warmup", "1", "--peers",
                                           "none", "--json")
    rows = json.loads(first)
    assert {"sgd", "plan"} <= {r["name"] for r in rows} and all(r["median_s"] > 0 for r in rows)
    assert second == ""


def test_the_abs_bench_runs_on_the_group_torchrun_made(tmp_path: Path) -> None:
    """ABS-SGD's bench on a standalone torchrun's 2 ranks: rank 0 prints the one JSON document."""
    from planner.strategies.abs_plan import make_abs_plan
    from tests.test_abs_plan import slowed_profile

    make_abs_plan(slowed_profile(world_size=2), 128, source="p.json").save(tmp_path / "abs.json")
    proc = _torchrun("bench", "--strategy", "abs", "--plan", str(tmp_path / "abs.json"), "--samples", "512",
                     "--repeats", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    variants = json.loads(proc.stdout)["variants"]  # one document: rank 0's
    assert {v["variant"] for v in variants} == {"abs-sgd", "sync-equal", "sync-proportional"}
