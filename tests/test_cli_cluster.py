"""The cluster commands end to end: `solve --cluster`, `simulate`, `retune` (with a real probe on 2 processes)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from planner.commands.cli import main
from planner.contracts.plan import Plan
from planner.strategies.cluster import PRESETS, profile_for_cluster
from planner.strategies.gradients import make_plan
from planner.types import Strategy
from tests.factories import synthetic_profile
from tests.test_contracts import _cli, _main, _one_clear_line


def test_solve_for_a_preset_plans_for_its_world_size_and_device(tmp_path: Path) -> None:
    prof = tmp_path / "prof.json"
    profile = synthetic_profile("resnet18")
    profile.save(prof)
    out = tmp_path / "plan.json"
    assert main(["solve", str(prof), "--cluster", "ib100-64,compute_factor=0.1", "-o", str(out)]) == 0
    plan = Plan.load(out)
    assert plan.cluster.world_size == 64 and plan.cluster.backend == "nccl" and plan.cluster.host_count == 8
    assert plan.cluster.device_kind == "gpu"
    # The same plan as solving the what-if profile directly.
    expected = make_plan(profile_for_cluster(profile, replace(PRESETS["ib100-64"], compute_factor=0.1)), Strategy.DENSE)
    assert plan.groups == expected.groups and plan.predicted == expected.predicted


def test_simulate_prints_one_row_per_world_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "prof.json"
    synthetic_profile("resnet18").save(prof)
    assert main(["simulate", str(prof), "--cluster", "eth10-8", "--world-sizes", "4,8,...,64", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["world_size"] for r in doc["rows"]] == [4, 8, 16, 32, 64]
    assert [r["nodes"] for r in doc["rows"]] == [1, 2, 4, 8, 16]
    for r in doc["rows"]:
        assert r["lower_bound_s"] <= r["plan_s"] + 1e-12
        assert all(r["plan_s"] <= b + 1e-12 for b in r["baselines"].values())
    # Without --cluster: the profile's own network, scaled.
    assert main(["simulate", str(prof), "--world-sizes", "2,8", "--strategy", "kfac"]) == 0
    assert "kfac-pytorch" in capsys.readouterr().out


def test_bad_cluster_specs_give_one_line(tmp_path: Path) -> None:
    prof = tmp_path / "prof.json"
    synthetic_profile("mlp").save(prof)
    out = str(tmp_path / "plan.json")
    _one_clear_line(_main("solve", str(prof), "--cluster", "ib100-64,inter_gbps=-5", "-o", out), "inter_gbps > 0")
    _one_clear_line(_main("solve", str(prof), "--cluster", "ib100-64,gpus_per_node=0", "-o", out), "gpus_per_node >= 1")
    _one_clear_line(_main("solve", str(prof), "--cluster", "infiniband", "-o", out), "unknown cluster preset")
    _one_clear_line(_main("simulate", str(prof), "--cluster", "ib100-64", "--world-sizes", "8,12"), "not a multiple")
    _one_clear_line(_main("simulate", str(prof), "--world-sizes", "4,8,...,100"), "not reached exactly")
    assert not Path(out).exists()


def test_retune_without_probe_and_for_a_described_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # retune writes by default under runs/ of the folder it runs in
    prof = tmp_path / "prof.json"
    synthetic_profile("resnet18").save(prof)
    plan_path = tmp_path / "plan.json"
    assert main(["solve", str(prof), "-o", str(plan_path)]) == 0
    capsys.readouterr()
    assert main(["retune", str(plan_path), "--cluster", "eth10-8"]) == 0
    out = capsys.readouterr().out
    assert "what changed" in out and "predicted gain of re-tuning" in out
    new = Plan.load(tmp_path / "runs" / "plan-retuned.json")
    assert not (tmp_path / "plan-retuned.json").exists()  # never beside the plan: that may be a shipped folder
    assert new.cluster.world_size == 8 and new.source_profile == str(prof)
    assert main(["retune", str(plan_path), "--no-probe", "-o", str(tmp_path / "same.json")]) == 0
    assert Plan.load(tmp_path / "same.json").groups == Plan.load(plan_path).groups
    assert "1.000x" in capsys.readouterr().out


def test_retune_probes_the_network_of_two_processes(tmp_path: Path) -> None:
    prof = tmp_path / "prof.json"
    synthetic_profile("mlp").save(prof)
    plan_path = tmp_path / "plan.json"
    assert main(["solve", str(prof), "-o", str(plan_path)]) == 0
    proc = _cli("retune", str(plan_path), "--nproc", "2", "-o", str(tmp_path / "new.json"))
    assert proc.returncode == 0, proc.stderr
    assert "probed world size 2, gloo" in proc.stdout
    new = Plan.load(tmp_path / "new.json")
    assert new.cluster.world_size == 2 and new.cluster.device.startswith("cpu")


def test_retune_refuses_a_missing_profile_in_one_line(tmp_path: Path) -> None:
    prof = tmp_path / "prof.json"
    synthetic_profile("mlp").save(prof)
    plan_path = tmp_path / "plan.json"
    assert main(["solve", str(prof), "-o", str(plan_path)]) == 0
    prof.unlink()
    _one_clear_line(_main("retune", str(plan_path), "--no-probe"), "does not exist")


def test_what_if_profiles_keep_the_workers_speeds_only_at_their_own_world_size(tmp_path: Path) -> None:
    """Real profiles record each worker's speed (`throughput`); a what-if cluster of another size has other
    workers, so the speeds are dropped there (and `simulate` works), and kept, scaled, at the same size."""
    from planner.contracts.profile import WorkerThroughput

    speeds = WorkerThroughput(batch_sizes=(8, 16), step_s=((0.1, 0.2), (0.15, 0.3)))
    profile = replace(synthetic_profile("mlp", world_size=2), throughput=speeds)
    same = profile_for_cluster(profile, replace(PRESETS["eth10-8"], nodes=1, gpus_per_node=2, compute_factor=0.5))
    assert same.throughput is not None and same.throughput.step_s == ((0.05, 0.1), (0.075, 0.15))
    assert profile_for_cluster(profile, PRESETS["eth10-8"]).throughput is None
    profile.save(tmp_path / "prof.json")
    assert main(["simulate", str(tmp_path / "prof.json"), "--world-sizes", "2,8", "--json"]) == 0
