"""`planner profile --time`: rounds pool their samples with the earlier ones' as one longer run would have them, the
next round measures the source the finalists' open comparisons depend on most, and the budget ends the rounds."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest

from planner.commands.cli import main
from planner.contracts.profile import Profile, SlowdownSamples
from planner.costmodel.curves import fit_curve
from planner.profilers.comm import _repetitions
from planner.profilers.layers import LayerRun, combine_ranks
from planner.profilers.pooled import pooled_curve, pooled_runs, pooled_slowdown
from planner.sessions.profile import QUICK_EFFORT, ProfileConfig, profile_worker
from planner.strategies.focus import Finalists, finalist_rows, focus
from planner.strategies.mixed_plan import make_mixed_plan, parse_compressors
from tests.factories import synthetic_profile, with_samples
from tests.pool import run_warm

#: A model small enough that a quick profile of it takes seconds.
TINY = "tests.test_torchrun:kfac_workload"


def _run(steps: list[float], order: tuple[str, ...] = ("b", "a")) -> LayerRun:
    return LayerRun(order=order, params={n: (n,) for n in order}, numel={n: 4 for n in order},
                    forward={n: [s / 4 for s in steps] for n in order},
                    backward={n: [s / 3 for s in steps] for n in order},
                    forward_total=[s / 2 for s in steps], backward_total=[s / 1.5 for s in steps],
                    update=[s / 10 for s in steps], whole=list(steps))


def test_pooled_samples_give_what_one_longer_run_gives() -> None:
    first, second = [1.0, 1.2, 0.9], [1.1, 1.4]
    pooled = pooled_runs([_run(first), _run([2.0, 2.1, 2.2])], [_run(second), _run([2.3, 2.4])])
    assert combine_ranks(pooled) == combine_ranks([_run(first + second), _run([2.0, 2.1, 2.2, 2.3, 2.4])])
    other_order = pooled_runs([_run(first)], [_run(second, order=("a", "b"))])
    assert other_order[0].whole == first  # layers ready in another order: their samples do not join

    a = fit_curve([(1024, 1.0), (4096, 2.0)], [(0.9, 1.1), (1.9, 2.1)])
    b = fit_curve([(1024, 1.3), (4096, 2.4)], [(1.3,), (2.4,)])
    assert pooled_curve(a, b) == fit_curve([(1024, statistics.fmean([0.9, 1.1, 1.3])),
                                            (4096, statistics.fmean([1.9, 2.1, 2.4]))],
                                           [(0.9, 1.1, 1.3), (1.9, 2.1, 2.4)])
    with pytest.raises(ValueError, match="different message sizes"):
        pooled_curve(a, fit_curve([(1024, 1.0), (8192, 2.0)], [(1.0,), (2.0,)]))

    x = SlowdownSamples(alone_s=(1.0, 1.1), busy_s=(1.5, 1.6), pace_alone_s=(0.1,), pace_busy_s=(0.2,))
    y = SlowdownSamples(alone_s=(1.2,), busy_s=(1.3,), pace_alone_s=(0.1, 0.2), pace_busy_s=(0.15, 0.3))
    both = pooled_slowdown(x, y)
    assert both.sigma() == SlowdownSamples(alone_s=(1.0, 1.1, 1.2), busy_s=(1.5, 1.6, 1.3), pace_alone_s=(),
                                           pace_busy_s=()).sigma()
    assert both.kappa() == pytest.approx(statistics.median([0.2, 0.15, 0.3]) / statistics.median([0.1, 0.1, 0.2]) - 1)


def _profile_and_rows(collective_spread: float, step_spread: float) -> tuple[Profile, Finalists]:
    """The MLP's synthetic profile with samples: its steps drawn with `step_spread`, its collectives' runs with
    `collective_spread`; the finalists of a dense-or-fp16 plan on it (DDP, its fp16 hook, the plan both ways)."""
    base = synthetic_profile("mlp")
    steps, comm = with_samples(base, spread=step_spread), with_samples(base, spread=collective_spread, seed=1)
    profile = dataclasses.replace(steps, collectives=comm.collectives)
    plan = make_mixed_plan(profile, parse_compressors("dense,fp16"))
    return profile, Finalists(rows=finalist_rows(plan, profile))


def test_the_next_round_measures_what_the_open_comparisons_depend_on_most() -> None:
    """Runs of the collectives spread 40% and steps 0.1%: a finalist that sends differently is open against the
    fastest, and it is the collectives' spread that keeps it open; with every sample spread 0.1%, every comparison is
    settled (beyond the margin or within it) and no round is needed; a profile that kept no samples has nothing a
    round could narrow."""
    profile, finalists = _profile_and_rows(0.4, 0.001)
    found = focus(profile, finalists)
    assert found.open_pairs and found.source == "collectives", found
    assert found.widths["collectives"] > 10 * found.widths["steps"]
    assert "measuring the collectives again" in found.describe()
    narrow, finalists = _profile_and_rows(0.001, 0.001)
    assert focus(narrow, finalists).source is None
    bare = synthetic_profile("mlp")
    assert focus(bare, Finalists(rows=finalist_rows(make_mixed_plan(bare, parse_compressors("dense,fp16")),
                                                      bare))).source is None


def _profile_in_rounds(rank: int, world_size: int, config: ProfileConfig, sources: tuple[str, ...]) -> Any:
    """`profile_worker` whose focus names `sources` round after round (then settles), to test the rounds' pooling
    whatever the machine's noise would have left open."""
    from planner.strategies import focus as module

    real, queue = module.focus, list(sources)

    def forced(profile: Profile, finalists: Finalists, **kwargs: Any) -> Any:
        return dataclasses.replace(real(profile, finalists, **kwargs), source=queue.pop(0) if queue else None)

    with mock.patch.object(module, "focus", forced):
        return profile_worker(rank, world_size, config)


def test_rounds_pool_each_source_measured_again(tmp_path: Path) -> None:
    """Rounds of the collectives, the steps and sigma and kappa after the first: each source holds two rounds'
    samples (each collective point twice its runs, twice the steps, twice the pairs of passes), pooled."""
    config = ProfileConfig.at(QUICK_EFFORT, quick=True, model=TINY, output=tmp_path / "p.json", nproc=2,
                              in_situ=False, show_progress=False, time_s=600.0, layer_seconds=0.0, powersgd_ranks=())
    profile = run_warm(_profile_in_rounds, 2, config, ("collectives", "steps", "sigma and kappa"), timeout=240)[0]
    assert isinstance(profile, Profile)
    for curve in profile.collectives.values():
        assert curve.samples is not None
        assert [len(s) for s in curve.samples] == [2 * _repetitions(n * 4, QUICK_EFFORT.comm_repeats)
                                                   for n, _ in curve.points]
        assert [t for _, t in curve.points] == pytest.approx([float(np.mean(s)) for s in curve.samples])
    assert profile.steps is not None and profile.steps.count == 2 * QUICK_EFFORT.repeats
    assert profile.slowdown_samples and profile.interference is not None
    for coll, samples in profile.slowdown_samples.items():
        assert len(samples.alone_s) == 2 * 2 * QUICK_EFFORT.interference_repeats  # two rounds of every rank's pairs
        assert profile.interference[coll] == samples.sigma()


def test_the_budget_ends_the_rounds_before_one_that_would_not_fit() -> None:
    profile, finalists = _profile_and_rows(0.4, 0.001)
    found = focus(profile, finalists)
    assert found.next_round({}, 5.0)[0] == "collectives"  # not measured again yet: it runs while time is left
    assert found.next_round({"collectives": 4.0}, 5.0)[0] == "collectives"
    source, why = found.next_round({"collectives": 6.0}, 5.0)
    assert source is None and "5 s of --time are left, less than a round of it takes" in why
    assert found.next_round({}, 0.0)[0] is None
    assert dataclasses.replace(found, source=None).next_round({}, 100.0)[0] is None


def test_time_is_refused_beside_kfac_and_only_comm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for extra in (["--kfac"], ["--only", "comm"]):
        assert main(["profile", "--model", TINY, "--time", "30", *extra, "-o", str(tmp_path / "p.json")]) == 2
        assert "--time measures the gradient finalists in rounds" in capsys.readouterr().err
