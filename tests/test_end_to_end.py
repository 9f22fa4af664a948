"""The whole path through the `planner` command on 2 real gloo processes: profile, solve, show, bench. The commands
that start workers run as the `planner` command does, each in its own interpreter; `planner solve`, which reads only
the profile and starts no worker, runs its command line in this process (as tests/test_docs.py runs it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from planner.commands.cli import main
from planner.contracts.plan import Plan
from planner.contracts.profile import Profile
from planner.models import Workload
from planner.sessions.bench import paired_speedup_interval
from planner.sessions.bench_kfac import FACTOR_HOOKS, FACTOR_HOOKS_STRATEGY
from planner.strategies.kfac_plan import LOCAL_KFAC
from planner.types import Collective, Strategy

pytestmark = pytest.mark.spawns  # its tests start their own workers (tests/pool.py says which must)


def _planner(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "planner", *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"planner {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def _solve(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """`planner solve ARGS` run in this process: its stdout."""
    capsys.readouterr()
    code = main(["solve", *args])
    out, err = capsys.readouterr()
    assert code == 0, f"planner solve {' '.join(args)} failed:\n{out}\n{err}"
    return out


def test_profile_solve_bench_on_two_processes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "mlp.json"
    # One PowerSGD rank, a short layer phase and --quick's fewer in-situ pairs and micro-benchmark runs: every kind
    # of measurement, each as few times as the checks need.
    _planner("profile", "--quick", "--model", "mlp", "--batch-size", "8", "--nproc", "2", "--repeats", "3",
             "--warmup", "1", "--densities", "0.01,1.0", "--powersgd-ranks", "1", "--layer-seconds", "0.5", "-o",
             str(prof))
    profile = Profile.load(prof)
    assert profile.cluster.world_size == 2 and profile.cluster.backend == "gloo"
    assert profile.batch_size == 8
    assert profile.step_s is not None and profile.step_s > 0  # whole steps timed as a cross-check
    # each worker's own speed at a quarter, half and all of the batch
    assert profile.throughput is not None and profile.throughput.batch_sizes == (2, 4, 8)
    assert len(profile.throughput.step_s) == 2 and profile.throughput.spread >= 1
    # The MLP's gradients become ready from the last layer back to the first: measured, not assumed.
    assert [lt.name for lt in profile.layers] == ["6", "4", "2", "0"]
    assert set(profile.collectives) == set(Collective)
    assert all(len(c.points) >= 5 for c in profile.collectives.values())
    assert profile.topk is not None and profile.topk.densities() == [0.01, 1.0]
    # PyTorch's PowerSGD hook and the runtime's PowerSGD in real steps: their work alone, and what sending on
    # the real group added to it, each rank's samples kept, against the micro-benchmarks and the allreduce curve
    assert profile.compress is not None and profile.in_situ is not None
    for rank in profile.compress.ranks():
        hook = profile.in_situ.compress[f"ddp+powersgd:{rank}"]
        own = profile.in_situ.compress[f"powersgd:{rank}"]
        assert set(hook) == {"prepare", "send"} and set(own) == {"prepare", "decode", "send"}
        for c in (*hook.values(), *own.values()):
            assert c.modelled_s > 0 and c.samples_s is not None and len(c.samples_s) % 2 == 0
        assert own["send"].modelled_s == hook["send"].modelled_s  # the same two allreduces, on the same curve
    assert "fp16" in profile.in_situ.compress and "send" not in profile.in_situ.compress["fp16"]
    # `profile --only comm` re-measuring this network, the rest kept: tests/test_hierarchical_topk.py

    dense, topk = tmp_path / "dense.json", tmp_path / "topk.json"
    out = _solve(capsys, str(prof), "--strategy", "dense", "-o", str(dense))
    assert "lower bound" in out and "vs ddp " in out and "ddp-25mb" not in out  # DDP's row: plain DDP, "ddp"
    _solve(capsys, str(prof), "--strategy", "topk", "--density", "0.01", "-o", str(topk))
    assert Plan.load(topk).strategy is Strategy.TOPK

    res = _planner("bench", "--plan", str(dense), "--plan", str(topk), "--steps", "3", "--warmup", "1", "--json",
                   "--peers", "none")
    rows = json.loads(res.stdout)
    assert [r["name"] for r in rows] == ["ddp", "local (no communication)", "per-layer dense", "plan dense",
                                         "plan dense via DDP", "per-layer topk@0.01", "plan topk@0.01",
                                         "plan topk@0.01 via DDP", "ddp+topk:0.01"]
    for r in rows:
        assert r["steps"] == 3 and r["median_s"] > 0 and r["predicted_s"] > 0
    assert rows[0]["speedup"] == 1.0 and rows[0]["reference"] == "ddp"
    for r in rows:  # each row's steps kept in the order they ran, and its speedup's paired interval from them
        assert len(r["samples_s"]) == 3 and r["block"] >= 1
        assert r["speedup_interval"] == list(paired_speedup_interval(rows[0]["samples_s"], r["samples_s"], r["block"]))
    assert rows[0]["speedup_interval"] == [1.0, 1.0]
    # The local steps are predicted by the profile's forward + backward + update alone.
    assert rows[1]["predicted_s"] == pytest.approx(profile.parts_s, rel=1e-9)


def tiny_kfac_workload() -> Workload:
    """A small CNN whose factors invert in microseconds: `--model tests.test_end_to_end:tiny_kfac_workload`."""
    module = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(4, 6, 3, stride=2, bias=False),
        nn.BatchNorm2d(6), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 3 * 3, 16), nn.ReLU(), nn.Linear(16, 5),
    )

    def make_batch(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 3, 8, 8, generator=gen), torch.randint(0, 5, (n,), generator=gen)

    return Workload(name="tiny-kfac", module=module, batch_size=8, make_batch=make_batch,
                    loss_fn=nn.functional.cross_entropy)


def test_kfac_profile_solve_bench_on_two_processes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = "tests.test_end_to_end:tiny_kfac_workload"
    prof = tmp_path / "tiny.json"
    _planner("profile", "--model", model, "--nproc", "2", "--repeats", "3", "--warmup", "1", "--densities", "0.01",
             "--powersgd-ranks", "none", "--layer-seconds", "0.5", "--kfac", "-o", str(prof))  # K-FAC's, no more
    kf = Profile.load(prof).kfac
    assert kf is not None
    assert [(lt.name, lt.a_dim, lt.g_dim) for lt in kf.layers] == [("0", 28, 4), ("2", 36, 6), ("6", 55, 16),
                                                                     ("8", 17, 5)]
    assert len(kf.eigen.points) >= 2 and len(kf.inverse.points) >= 2

    plan_path = tmp_path / "kfac.json"
    out = _solve(capsys, str(prof), "--strategy", "kfac", "--factor-update-steps", "1", "--inv-update-steps", "2",
                 "--placement-solver", "cp-sat", "-o", str(plan_path))
    assert "kfac-pytorch" in out and "lower bound" in out
    plan = Plan.load(plan_path)
    assert plan.kfac is not None and plan.kfac.placement_solver == "cp-sat"  # the layout solver

    res = _planner("bench", "--strategy", "kfac", "--plan", str(plan_path), "--steps", "4", "--peers", "none",
                   "--json")
    rows = json.loads(res.stdout)
    placed = any(r is not None for r in plan.kfac.preconditioners.values())
    comm_opt = "COMM_OPT layout, this runtime"
    assert [r["name"] for r in rows] == ["local (no communication)", LOCAL_KFAC, "sgd", "everywhere", comm_opt,
                                         "MEM_OPT layout, this runtime",
                                         *(["plan, everyone preconditions"] if placed else []), "plan",
                                         FACTOR_HOOKS]
    # Not a step: the plan's factor hooks on each factor-update step (every step here), beside the profile's.
    hooks = rows.pop()
    assert hooks["strategy"] == FACTOR_HOOKS_STRATEGY and hooks["speedup"] is None
    assert hooks["predicted_s"] == pytest.approx(plan.kfac.predicted.factor_compute_s, rel=1e-12)
    assert 0 < hooks["median_s"] < rows[-1]["median_s"] and hooks["steps"] == 6
    for r in rows:
        assert r["steps"] == 6 and r["median_s"] > 0 and r["predicted_s"] > 0 and r["reference"] == comm_opt
    assert rows[4]["speedup"] == 1.0
    assert rows[0]["predicted_s"] == pytest.approx(Profile.load(prof).parts_s, rel=1e-9)  # the profile's compute
    # K-FAC's work with nothing sent: the profile's calibrated kernels, beside the plan's own prediction of them.
    assert rows[1]["strategy"] == "local" and rows[1]["predicted_s"] == pytest.approx(
        plan.kfac.baselines[LOCAL_KFAC].step_s, rel=1e-12)


def test_the_quick_demo_writes_outside_the_shipped_folders_and_leaves_the_shipped_files_as_they_were(
        tmp_path: Path) -> None:
    """The README's order, in a copy of the repository: `planner demo` (quick, shortened) leaves nothing git sees
    outside ignored folders, so the tests that read the shipped example plans (from git: tests/shipped.py) read
    the same files there afterwards."""
    from tests.shipped import ROOT, shipped_plans

    def git(*args: str, cwd: Path = ROOT) -> str:
        proc = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    copy = tmp_path / "clone"
    # The working tree as it is (tracked and new files, ignored ones left out), committed in a repository of its own.
    for name in git("ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0"):
        if name and (ROOT / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            (copy / name).write_bytes((ROOT / name).read_bytes())
    git("init", "-q", cwd=copy)
    git("add", "-A", cwd=copy)
    git("commit", "-q", "-m", "copy", cwd=copy)
    planner = Path(sys.executable).parent / "planner"  # the installed command: it imports nothing from the copy
    # Dense and fp16 only: the same files (a profile, a dense and a mixed plan) as with every compressor, in about half
    # the time (the in-situ calibration of PowerSGD at ranks 1 and 2 above all).
    demo = subprocess.run([str(planner), "demo", "--quick", "--model", "mlp", "--link", "none",
                           "--compressors", "light", "--race-time", "1"],
                          cwd=copy, capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    written = sorted(p.relative_to(copy).as_posix() for p in (copy / "runs").rglob("*.json"))
    assert "runs/profiles/mlp-2w.json" in written and "runs/plans/mlp-2w-dense.json" in written, written
    # made for plans of dense and fp16 alone, the profile timed no top-k, and says why
    profile = json.loads((copy / "runs/profiles/mlp-2w.json").read_text())
    assert profile["topk"] is None and profile["topk_left_out"] == {"compressors": [], "budget": None}
    assert set(profile["interference"]) == {"allreduce"}
    assert "wrote plan runs/plans/mlp-2w-dense.json" in demo.stdout  # each write says where, in its line
    assert demo.stdout.rstrip().splitlines()[-1].startswith("race: keep ")  # the last line: decided by the race
    assert "│ ddp+fp16 " in demo.stdout and "ddp+powersgd" not in demo.stdout  # the hooks of what the plan may send
    assert git("status", "--porcelain", cwd=copy) == ""  # nothing new outside the ignored runs/
    assert [p.relative_to(copy) for p in shipped_plans(copy)] == [p.relative_to(ROOT) for p in shipped_plans()]
    assert all((copy / p.relative_to(ROOT)).read_bytes() == p.read_bytes() for p in shipped_plans())
