"""`planner bench --strategy crossover` end to end on two small jobs over loopback, its summary's windows, and
its bad input (one line, exit 2)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from planner.commands.cli import main
from planner.contracts.pairing import PairingPlan
from planner.platform import launch
from planner.sessions.bench_crossover import (
    CrossoverBenchConfig,
    CrossoverJob,
    JobRun,
    print_crossover_bench,
    summarise_crossover,
)
from planner.strategies.gradients import make_plan
from planner.types import Strategy
from tests import pool
from tests.factories import synthetic_profile
from tests.test_contracts import _main, _one_clear_line


def _pairing(tmp_path: Path, batch: str = "16") -> Path:
    plan = make_plan(synthetic_profile("digits"), Strategy.DENSE)
    path = tmp_path / "digits.json"
    plan.save(path)
    out = tmp_path / "pairing.json"
    assert main(["pair", str(path), str(path), "--batch", batch, "-o", str(out)]) == 0
    return out


@pytest.fixture
def jobs_on_warm_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """`launch.run_jobs` as the bench calls it for plain jobs (gloo, no link or hosts), on warm workers
    (`tests.pool.run_jobs_warm`): the k-th job of every call on the k-th group of workers, started once for the
    session, instead of new workers for each of the bench's five launches (and each importing torch and the digits
    again). The jobs of a call run at once, each in its own process group, as the launcher runs them; the
    launcher's own way of starting several jobs is tested in tests/test_crossover_runtime.py and tests/test_hosts.py."""
    real = launch.run_jobs

    def run_jobs(jobs: Any, *, timeout: float = 120, backend: str = "gloo", link: Any = None,
                 hosts: int | None = None) -> list[list[Any]]:
        if backend != "gloo" or link is not None or hosts is not None:
            return real(jobs, timeout=timeout, backend=backend, link=link, hosts=hosts)
        return pool.run_jobs_warm(jobs, timeout=min(timeout, pool.COLLECTIVE_TIMEOUT_S))

    monkeypatch.setattr(launch, "run_jobs", run_jobs)


@pytest.mark.usefixtures("jobs_on_warm_workers")
def test_bench_crossover_runs_every_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pairing = _pairing(tmp_path)
    capsys.readouterr()
    code = main(["bench", "--strategy", "crossover", "--pairing", str(pairing), "--steps", "4", "--warmup", "1",
                 "--repeats", "1", "--gate-dir", str(tmp_path / "gates"), "--probe-window", "0.2", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    modes = ["sequential", "side-by-side", "crossover", "probed"]
    assert [m["mode"] for m in out["modes"]] == modes
    for mode in out["modes"]:
        assert mode["samples_per_s"] > 0 and mode["predicted_samples_per_s"] > 0
    runs = out["runs"]
    assert {(r["mode"], r["job"]) for r in runs} == {(m, j) for m in modes for j in ("digits", "digits-2")}
    assert all(len(r["stamps"]) == 5 for r in runs if r["mode"] != "probed")
    assert all(r["gate_wait_s"] == 0 for r in runs if r["mode"] not in ("crossover", "probed"))
    # probed: both jobs ran the one decision the pair's probe made, and 4 steps after it
    probed = [r for r in runs if r["mode"] == "probed"]
    assert len({r["decision"] for r in probed}) == 1 and probed[0]["decision"] in ("gated", "free")
    assert all(sum(t > r["decided_at"] for t in r["stamps"]) == 4 for r in probed)
    (summary,) = [m for m in out["modes"] if m["mode"] == "probed"]
    assert [d[0] for d in summary["decisions"]] == [probed[0]["decision"]]
    assert len(list((tmp_path / "gates").glob("*.lock"))) == 1  # the pair's gate on this host


def _summary_config(tmp_path: Path, repeats: int) -> CrossoverBenchConfig:
    """The pairing's two digits jobs (8 samples per rank, 2 ranks), each predicted 0.1 s per step alone, 0.2 side
    by side and 0.15 crossed over."""
    pairing = PairingPlan.load(_pairing(tmp_path))
    plan = make_plan(synthetic_profile("digits"), Strategy.DENSE)
    jobs = tuple(CrossoverJob(name=j.name, plan=plan, model="digits", batch=8) for j in pairing.jobs)
    return CrossoverBenchConfig(pairing="p", jobs=jobs, repeats=repeats,
                                predicted={j.name: {"alone_s": 0.1, "side_by_side_s": 0.2, "crossover_s": 0.15}
                                           for j in pairing.jobs})


def test_the_summary_counts_only_the_window_both_jobs_ran_in(tmp_path: Path) -> None:
    config = _summary_config(tmp_path, repeats=1)
    runs = [
        JobRun("digits", "sequential", 0, (0.0, 0.1, 0.2), 0.0),  # 0.1 s per step
        JobRun("digits-2", "sequential", 0, (5.0, 5.3, 5.6), 0.0),  # 0.3 s per step
        # side by side: the window is [1.0, 2.0] (the later start, the earlier end): "digits" finishes 4 steps in
        # it (not the one ending at 2.25), "digits-2" 3 (not its warm-up start at 0.5)
        JobRun("digits", "side-by-side", 0, (1.0, 1.25, 1.5, 1.75, 2.0, 2.25), 0.0),
        JobRun("digits-2", "side-by-side", 0, (0.5, 1.2, 1.9, 2.0), 0.0),
        JobRun("digits", "crossover", 0, (0.0, 1.0), 0.2),
        JobRun("digits-2", "crossover", 0, (0.0, 1.0), 0.0),
        # probed: the window opens when both run the decision (3.0, the later) and ends at 5.0: "digits" finishes 4
        # steps in it, "digits-2" 2
        JobRun("digits", "probed", 0, (0.0, 1.0, 2.0, 2.5, 3.5, 4.0, 4.5, 5.0), 0.0, decided_at=2.4,
               decision="free", probed_samples_per_s=(50.0, 60.0)),
        JobRun("digits-2", "probed", 0, (0.5, 2.0, 3.0, 4.0, 5.0, 6.0), 0.0, decided_at=3.0, decision="free",
               probed_samples_per_s=(50.0, 60.0)),
    ]
    by_mode = {s.mode: s for s in summarise_crossover(config, runs)}
    assert by_mode["sequential"].samples_per_s == pytest.approx(32 / 0.4)  # 16 + 16 samples per 0.1 + 0.3 s
    assert by_mode["side-by-side"].samples_per_s == pytest.approx((4 * 16 + 3 * 16) / 1.0)
    assert by_mode["side-by-side"].step_s == pytest.approx({"digits": 0.25, "digits-2": 1 / 3})
    assert by_mode["crossover"].samples_per_s == pytest.approx(32.0)
    assert by_mode["crossover"].gate_wait_s["digits"] == pytest.approx(0.2)
    assert by_mode["crossover"].speedup == pytest.approx(32.0 / 112.0)
    assert by_mode["sequential"].predicted_samples_per_s == pytest.approx(32 / 0.2)
    assert by_mode["crossover"].predicted_samples_per_s == pytest.approx(2 * 16 / 0.15)
    assert by_mode["probed"].samples_per_s == pytest.approx((4 * 16 + 2 * 16) / 2.0)
    assert by_mode["probed"].step_s == pytest.approx({"digits": 0.5, "digits-2": 1.0})
    assert by_mode["probed"].decisions == (("free", 50.0, 60.0),)
    assert by_mode["probed"].speedup == pytest.approx(48.0 / 112.0)
    assert by_mode["side-by-side"].predicted_best_samples_per_s is None  # a pairing without the interleaved case
    both = replace(config, predicted={n: {**p, "side_by_side_interleaved_s": 0.125}
                                      for n, p in config.predicted.items()})
    side = {s.mode: s for s in summarise_crossover(both, runs)}["side-by-side"]
    assert side.predicted_best_samples_per_s == pytest.approx(2 * 16 / 0.125)
    assert side.predicted_samples_per_s == pytest.approx(2 * 16 / 0.2)  # lockstep


def test_a_run_in_which_the_jobs_never_ran_together_counts_for_nothing(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    config = _summary_config(tmp_path, repeats=2)
    runs = [JobRun(n, "sequential", k, (0.0, 0.1), 0.0) for n in ("digits", "digits-2") for k in (0, 1)]
    runs += [
        # side by side, repeat 0: "digits" ended (1.0) before "digits-2" began (2.0); repeat 1 overlaps in [0, 1]
        JobRun("digits", "side-by-side", 0, (0.0, 0.5, 1.0), 0.0),
        JobRun("digits-2", "side-by-side", 0, (2.0, 2.5, 3.0), 0.0),
        JobRun("digits", "side-by-side", 1, (0.0, 0.5, 1.0), 0.0),
        JobRun("digits-2", "side-by-side", 1, (0.0, 0.5, 1.0), 0.0),
        # probed, both repeats: "digits" ran its timed steps before "digits-2" took the decision
        *(JobRun("digits", "probed", k, (0.0, 1.0, 1.5, 2.0), 0.0, decided_at=1.0, decision="free") for k in (0, 1)),
        *(JobRun("digits-2", "probed", k, (0.0, 2.0, 2.5, 3.0), 0.0, decided_at=2.0, decision="free")
          for k in (0, 1)),
    ]
    by_mode = {s.mode: s for s in summarise_crossover(config, runs)}
    # repeat 1 only: 2 jobs × 2 steps × 16 samples in 1 s
    assert by_mode["side-by-side"].samples_range == pytest.approx((64.0, 64.0))
    assert "probed" not in by_mode and "crossover" not in by_mode
    capsys.readouterr()
    print_crossover_bench(config, runs, as_json=False)
    out = capsys.readouterr().out
    assert "probed: no row: in no run did both jobs get to time steps together" in out


def test_bench_crossover_bad_input_gives_one_line(tmp_path: Path) -> None:
    pairing = _pairing(tmp_path)
    _one_clear_line(_main("bench", "--strategy", "crossover"), "needs --pairing")
    _one_clear_line(_main("bench", "--pairing", str(pairing), "--plan", str(tmp_path / "digits.json")),
                    "--pairing applies to --strategy crossover only")
    _one_clear_line(_main("bench", "--strategy", "crossover", "--pairing", str(pairing), "--plan",
                         str(tmp_path / "digits.json")), "--plan does not apply to --strategy crossover")
    _one_clear_line(_main("bench", "--plan", str(tmp_path / "digits.json"), "--probe-window", "2"),
                    "--probe-window applies to --strategy crossover only")
    _one_clear_line(_main("bench", "--strategy", "crossover", "--pairing", str(pairing), "--probe-window", "0"),
                    "expected a finite number > 0")
    _one_clear_line(_main("bench", "--strategy", "crossover", "--pairing", str(pairing), "--hosts", "3"),
                    "--hosts 3 does not divide job digits's 2 workers")
    _one_clear_line(_main("bench", "--strategy", "crossover", "--pairing", str(pairing), "--hosts", "2"),
                    "made for 1 host of 2 workers, but the process group runs on 2 hosts of 1 worker")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    _one_clear_line(_main("bench", "--strategy", "crossover", "--pairing", str(pairing), "--gate-dir",
                         str(blocker / "gates")), "cannot create the gate folder")
    (tmp_path / "digits.json").unlink()
    _one_clear_line(_main("bench", "--strategy", "crossover", "--pairing", str(pairing)), "is missing")
    _one_clear_line(_main("bench", "--strategy", "gradients"), "needs --plan")
