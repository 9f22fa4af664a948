"""The files the repository ships, as git tracks them: tests that read the example plans read exactly these, never
whatever else a run has left in the same folder (`planner demo` writes under runs/, a user may write anywhere)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def shipped(pattern: str, root: Path = ROOT) -> list[Path]:
    """The tracked files of `root`'s git checkout matching the pathspec `pattern` (e.g. "plans/*.json"), sorted."""
    proc = subprocess.run(["git", "ls-files", "-z", "--", pattern], cwd=root, capture_output=True, text=True,
                          timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"git ls-files in {root} failed: the tests read the shipped files from git "
                           f"({proc.stderr.strip()})")
    return sorted(root / name for name in proc.stdout.split("\0") if name)


def shipped_plans(root: Path = ROOT) -> list[Path]:
    """The example plans the repository ships in plans/ (written before later plan records: intervals, optimality)."""
    plans = shipped("plans/*.json", root)
    assert plans, f"no plan tracked in {root / 'plans'}"
    return plans
