"""The whole path through the `planner` command on 2 real gloo processes: profile, solve, show, bench."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from planner.plan import Plan
from planner.profile import Profile
from planner.types import Collective, Strategy


def _planner(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "planner", *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"planner {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_profile_solve_bench_on_two_processes(tmp_path: Path) -> None:
    prof = tmp_path / "mlp.json"
    _planner("profile", "--model", "mlp", "--batch-size", "8", "--nproc", "2", "--repeats", "3", "--warmup", "1",
             "--densities", "0.01,1.0", "-o", str(prof))
    profile = Profile.load(prof)
    assert profile.cluster.world_size == 2 and profile.cluster.backend == "gloo"
    assert profile.batch_size == 8
    # The MLP's gradients become ready from the last layer back to the first: measured, not assumed.
    assert [lt.name for lt in profile.layers] == ["6", "4", "2", "0"]
    assert set(profile.collectives) == set(Collective)
    assert all(len(c.points) >= 5 for c in profile.collectives.values())
    assert profile.topk is not None and profile.topk.densities() == [0.01, 1.0]
    before = profile.collectives

    _planner("profile", "--only", "comm", "--nproc", "2", "-o", str(prof))
    again = Profile.load(prof)
    assert again.layers == profile.layers and again.topk == profile.topk
    assert again.collectives != before  # re-measured

    dense, topk = tmp_path / "dense.json", tmp_path / "topk.json"
    out = _planner("solve", str(prof), "--strategy", "dense", "-o", str(dense)).stdout
    assert "lower bound" in out and "ddp-25mb" in out
    _planner("solve", str(prof), "--strategy", "topk", "--density", "0.01", "-o", str(topk))
    assert Plan.load(topk).strategy is Strategy.TOPK

    res = _planner("bench", "--plan", str(dense), "--plan", str(topk), "--steps", "3", "--warmup", "1", "--json")
    rows = json.loads(res.stdout)
    assert [r["name"] for r in rows] == ["ddp", "per-layer dense", "plan dense", "per-layer topk@0.01",
                                         "plan topk@0.01"]
    for r in rows:
        assert r["steps"] == 3 and r["median_s"] > 0 and r["predicted_s"] > 0
    assert rows[0]["speedup"] == 1.0 and rows[0]["reference"] == "ddp"
