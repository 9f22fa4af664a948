"""Where a profile measured in rounds spends its next round (`planner profile --time`).

After a coarse first round, the profile's finalists are solved once (`--strategy auto`: the plan, its runners-up, the
plan inside DDP, DDP and its hooks within the error budget), each as a step that can be predicted on any profile
(`planner.strategies.intervals`). A round is worth spending where it could change which finalist a race starts
from: on the pairs of the fastest predicted finalist and another whose predicted ratio is not settled, its interval
over resampled profiles neither beyond the margin nor inside it. For each source of samples the next round could
measure again (the layer phase's steps, the collectives, the pairs of passes sigma and kappa are taken from), the
same pairs are predicted on profiles resampled from that source alone: the source whose own spread widens those
pairs' intervals most is measured next. When no pair is open, the profile has what the finalists need: the rounds
stop, the rest of the time unspent.

Measurement then pools the new round's samples with the earlier ones (`planner.profilers.pooled`), which narrows
that source's share of the intervals as 1 / sqrt(samples).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from planner.contracts.plan import DDP_ROW, VIA_DDP_ROW, Plan
from planner.contracts.profile import Profile
from planner.costmodel.resample import SOURCES, resampled_many, spread_sources
from planner.sequential import DEFAULT_MARGIN
from planner.spread import LEVEL, percentile_interval
from planner.strategies.intervals import (
    Draws,
    Problems,
    RowStep,
    beyond_budget,
    ddp_rows,
    evaluate,
    hook_names,
    plan_row,
    plan_rows,
)

__all__ = ["FOCUS_DRAWS", "REFINABLE", "Finalists", "Focus", "focus"]

#: The sources a round can measure again: the layer phase's steps, the collectives, sigma and kappa's pairs.
REFINABLE = (SOURCES[0], SOURCES[1], SOURCES[3])
#: Resampled profiles each source's share of the intervals is taken over (fewer than a plan's intervals: a round's
#: choice needs the largest share, not each interval's ends).
FOCUS_DRAWS = 60


@dataclass(frozen=True)
class Finalists:
    """The finalists of a profile's solve, each a step on any profile."""

    rows: Mapping[str, RowStep]

    @classmethod
    def of(cls, profile: Profile, source: str = "the profile so far") -> Finalists:
        """The finalists of `planner solve --strategy auto` on `profile`: its plan and runners-up, the plan inside
        DDP where predicted, DDP and DDP's hooks within the plan's error budget."""
        from planner.strategies.solve import SolveRequest, solve  # deferred (cycle: solve imports the strategies)

        plan = solve(profile, SolveRequest.auto(), source=source).plan
        return cls(rows=finalist_rows(plan, profile))


def finalist_rows(plan: Plan, profile: Profile) -> dict[str, RowStep]:
    """`plan`'s finalists on `profile` (see `Finalists.of`)."""
    own = plan_rows(plan, profile)
    rows: dict[str, RowStep] = {"plan": own.get("plan") or plan_row(plan, profile)}
    if VIA_DDP_ROW in own:
        rows[VIA_DDP_ROW] = own[VIA_DDP_ROW]
    for name, other in plan.runners_up.items():
        rows[f"runner-up {name}"] = plan_row(other, profile)
    left_out = set(hook_names(beyond_budget(plan, profile)))
    rows.update({name: step for name, step in ddp_rows(plan, profile).items() if name not in left_out})
    return rows


@dataclass(frozen=True)
class Focus:
    """What the next round measures (`source`; None: nothing left open), the fastest predicted finalist, the pairs
    left open (the other finalist of each, with its predicted ratio to the fastest and the interval), and each
    source's summed width of their log-ratio intervals."""

    source: str | None
    fastest: str
    open_pairs: dict[str, tuple[float, float, float]]
    widths: dict[str, float]

    def describe(self) -> str:
        """One line: what is open and what is measured next, or that nothing is."""
        if self.source is None:
            return (f"every finalist is settled against the fastest predicted ({self.fastest}), beyond the margin or "
                    "within it")
        pairs = ", ".join(f"{name} {ratio:.3f} [{low:.3f}, {high:.3f}]"
                          for name, (ratio, low, high) in self.open_pairs.items())
        return f"open against {self.fastest}: {pairs}; measuring the {self.source} again"

    def next_round(self, took: Mapping[str, float], left: float) -> tuple[str | None, str]:
        """The source the next round measures (None: the rounds are over) and the line that says why, with `left`
        seconds of the budget and `took` the seconds each source's last round took (a round of it takes as long
        again; one not measured again yet, its first round's share, unknown: it runs while time is left)."""
        if self.source is None:
            return None, self.describe()
        if left <= 0 or took.get(self.source, 0.0) > left:
            return None, (f"{self.describe()}, but {max(left, 0.0):.0f} s of --time are left, less than a round of it "
                          "takes")
        return self.source, self.describe()


def focus(profile: Profile, finalists: Finalists, *, margin: float = DEFAULT_MARGIN, draws: int = FOCUS_DRAWS,
          seed: int = 0) -> Focus:
    """Which source of samples the next round should measure again (see the module docstring)."""
    rows = dict(finalists.rows)
    nominal = Problems(profile)
    predicted = {name: step(nominal) for name, step in rows.items()}
    fastest = min(predicted, key=lambda name: (predicted[name], name != DDP_ROW))
    sources = tuple(s for s in spread_sources(profile) if s in REFINABLE)
    if not sources or len(rows) < 2:
        return Focus(None, fastest, {}, {})
    band = math.log1p(margin)

    def log_ratios(only: tuple[str, ...]) -> dict[str, np.ndarray]:
        drawn = Draws(profiles=tuple(resampled_many(profile, draws, seed, only=only)), sources=only)
        values = evaluate(rows, drawn)
        return {name: np.log(values[name] / values[fastest]) for name in rows if name != fastest}

    everything = log_ratios(sources)
    open_pairs = {}
    for name, logs in everything.items():
        low, high = percentile_interval(logs, LEVEL)
        beyond = low > band or high < -band
        within = -band <= low and high <= band
        if not (beyond or within):
            ratio = predicted[name] / predicted[fastest]
            open_pairs[name] = (ratio, math.exp(low), math.exp(high))
    if not open_pairs:
        return Focus(None, fastest, {}, {})
    widths = {}
    for source in sources:
        alone = log_ratios((source,))
        widths[source] = float(sum(np.subtract(*percentile_interval(alone[name], LEVEL)[::-1])
                                   for name in open_pairs))
    return Focus(max(widths, key=lambda s: widths[s]), fastest, open_pairs, widths)
