"""Commands that start workers also run as the ranks of a job torchrun launched (here one host, two ranks,
`torch.distributed.run --standalone`; on several hosts the same commands run under `--nnodes`): rank 0 writes
the results, the other ranks write nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from planner.contracts.plan import Plan
from tests.factories import synthetic_profile
from tests.test_tune import MODEL


def _torchrun(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "planner", *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_tune_and_bench_run_on_the_group_torchrun_made(tmp_path: Path) -> None:
    synthetic_profile(MODEL, world_size=2).save(tmp_path / "p.json")
    tuned = tmp_path / "tuned.json"
    proc = _torchrun("tune", str(tmp_path / "p.json"), "--model", MODEL, "--trials", "2", "--steps", "2",
                     "--rungs", "2", "--warmup", "1", "--compare-steps", "2", "--max-group-mb", "0.0006,0.002",
                     "-o", str(tuned))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("wrote plan") == 1  # rank 0 only
    plan = Plan.load(tuned)
    assert plan.cluster.world_size == 2
    proc = _torchrun("bench", "--plan", str(tuned), "--model", MODEL, "--steps", "3", "--peers", "none", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)  # one document: rank 0's
    assert {"ddp", f"plan {plan.strategy.value}"} <= {r["name"] for r in rows}
    assert all(r["median_s"] > 0 for r in rows)
    # --hosts emulates hosts for workers a command starts itself; torchrun's are its own: one line.
    proc = _torchrun("tune", str(tmp_path / "p.json"), "--model", MODEL, "--hosts", "2", "-o",
                     str(tmp_path / "x.json"), timeout=120)
    assert proc.returncode != 0 and "drop --hosts" in proc.stderr and not (tmp_path / "x.json").exists()
