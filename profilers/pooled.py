"""Measurements of one phase pooled over the rounds of a profile measured in rounds (`planner profile --time`).

A later round of a phase measures the same things the same way (the same layers in the same order, the same
collectives at the same message sizes, the same pairs of passes), so its samples join the earlier ones and every
statistic is taken again over all of them: the profile is what one longer run of the phase would have given, but
for the machine's drift between the rounds, which the pooled samples' spread then holds.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from planner.contracts.profile import FittedCurve, SlowdownSamples
from planner.costmodel.curves import fit_curve
from planner.profilers.layers import LayerRun

__all__ = ["pooled_curve", "pooled_runs", "pooled_slowdown"]


def pooled_runs(earlier: list[LayerRun], later: list[LayerRun]) -> list[LayerRun]:
    """Every rank's layer runs, the later round's steps after the earlier's (by rank). A rank whose layers came
    ready in another order in the later round keeps its earlier run alone: per-layer samples join only in the same
    order."""
    if len(earlier) != len(later):
        raise ValueError(f"the rounds measured {len(earlier)} and {len(later)} ranks")
    return [_pooled_run(a, b) for a, b in zip(earlier, later, strict=True)]


def _pooled_run(a: LayerRun, b: LayerRun) -> LayerRun:
    if a.order != b.order:
        return a
    return replace(a, forward={name: a.forward[name] + b.forward[name] for name in a.order},
                   backward={name: a.backward[name] + b.backward[name] for name in a.order},
                   forward_total=a.forward_total + b.forward_total, backward_total=a.backward_total + b.backward_total,
                   update=a.update + b.update, whole=a.whole + b.whole)


def pooled_curve(earlier: FittedCurve, later: FittedCurve) -> FittedCurve:
    """One collective's curve over both rounds' runs: each point the mean of all its runs, the curve fitted again.
    Both rounds must have kept their runs at the same message sizes."""
    if earlier.samples is None or later.samples is None:
        raise ValueError("only curves that kept their runs can be pooled")
    if [size for size, _ in earlier.points] != [size for size, _ in later.points]:
        raise ValueError("the rounds measured the collective at different message sizes")
    samples = [a + b for a, b in zip(earlier.samples, later.samples, strict=True)]
    points = [(size, statistics.fmean(runs)) for (size, _), runs in zip(earlier.points, samples, strict=True)]
    return fit_curve(points, samples)


def pooled_slowdown(earlier: SlowdownSamples, later: SlowdownSamples) -> SlowdownSamples:
    """One collective's pairs of passes and of chains over both rounds (sigma and kappa are taken from them)."""
    return SlowdownSamples(alone_s=earlier.alone_s + later.alone_s, busy_s=earlier.busy_s + later.busy_s,
                           pace_alone_s=earlier.pace_alone_s + later.pace_alone_s,
                           pace_busy_s=earlier.pace_busy_s + later.pace_busy_s)
