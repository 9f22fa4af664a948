"""Anytime-valid evidence that one thing happens more (or less) than half the time, for a race decided as it runs.

A race (`planner.strategies.race_rule`) times its arms in rounds and asks, after every round, questions such as "is arm
B's block slower than arm A's by more than the margin in more than half the rounds?" It may stop as soon as an
answer is settled, so a fixed-sample test would not hold its level: checked after every round, it would sooner or
later say yes by chance. This module answers with a betting e-process (Waudby-Smith & Ramdas, "Estimating means of
bounded random variables by betting", JRSS B 2023; for a quantile as here, Howard & Ramdas, "Sequential estimation
of quantiles with applications to A/B-testing and best-arm identification", Bernoulli 2022):

- each round gives an outcome y in {0, 1} (did the event happen);
- a gambler who believes the event happens more than half the time stakes a fraction `lam` of her wealth on it,
  chosen from the past rounds only: wealth *= 1 + lam * (y - 1/2);
- if in truth the event happens at most half the time in every round (whatever happened before), her wealth is a
  nonnegative supermartingale that starts at 1, and by Ville's inequality it ever reaches 1/alpha with probability
  at most alpha: so "wealth >= 1/alpha" is evidence at level alpha, valid whenever one looks and stops.

Why betting on a {0, 1} outcome rather than an empirical-Bernstein bound on the mean log time ratio: a mean of an
unbounded ratio needs a bound on its range, and a bounded sequence pays that range times log(1/alpha) / t in width,
which for a margin of 2% and any honest range (a block can be twice as slow in a spell of a shared machine) is
hundreds of rounds; clipping the ratio to a smaller range would decide on numbers that are not what was measured.
The outcome "slower beyond the margin" is bounded by construction, a spell of the machine counts once whatever its
size, and when one arm is clearly slower the wealth doubles about every round (about 10 rounds to 1/alpha = 1000).
The price: what is settled is about the median ratio of paired blocks, not their mean.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["DEFAULT_ALPHA", "DEFAULT_MARGIN", "LESS_OFTEN", "MORE_OFTEN", "HalfBet", "median_interval",
           "weights_near"]

#: A race's practical margin: a gain below it is not worth a less simple arm (`planner race --margin`).
DEFAULT_MARGIN = 0.02
#: The chance that any statement a race settles is false.
DEFAULT_ALPHA = 0.05

#: The directions a bet can take: that the event happens more than half the time, or less.
MORE_OFTEN = 1
LESS_OFTEN = -1
#: The largest stake, as a fraction of the most a bet at one half may stake (2): wealth never falls below
#: 1 - 0.75 = a quarter of itself in one round.
_STAKE_CAP = 0.75


@dataclass
class HalfBet:
    """The wealth of two gamblers on one event's outcomes: one bets it happens more than half the time, the other
    less. The stake is the predictable plug-in of Waudby-Smith & Ramdas (2023) for a mean of 1/2:
    sqrt(2 log(1/alpha) / (variance estimate * t * log(1 + t))), capped (the variance estimate, from the rounds
    before, starts at 1/4, a fair coin's, and follows the outcomes)."""

    alpha: float
    rounds: int = 0
    happened: int = 0
    more: float = 1.0  # wealth of the gambler who bets it happens more than half the time
    less: float = 1.0
    _squares: float = field(default=0.25, repr=False)  # sum of squared deviations from the running mean, + 1/4

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")

    def _stake(self) -> float:
        t = self.rounds + 1
        variance = self._squares / t  # the estimate from the rounds before this one
        stake = math.sqrt(2 * math.log(1 / self.alpha) / (variance * t * math.log(1 + t)))
        return min(stake, 2 * _STAKE_CAP)

    def observe(self, happened: bool) -> None:
        """One more round's outcome."""
        stake, y = self._stake(), 1.0 if happened else 0.0
        self.more *= 1 + stake * (y - 0.5)
        self.less *= 1 - stake * (y - 0.5)
        self.rounds += 1
        self.happened += int(happened)
        mean = (0.5 + self.happened) / (self.rounds + 1)  # the running mean, shrunk to 1/2 as the stake is
        self._squares += (y - mean) ** 2

    def settled(self, direction: int) -> bool:
        """Whether the evidence that the event happens more (MORE_OFTEN) or less (LESS_OFTEN) than half the time
        has reached 1/alpha."""
        wealth = self.more if direction == MORE_OFTEN else self.less
        return wealth >= 1 / self.alpha

    @property
    def share(self) -> float | None:
        """How often the event happened so far (None before the first round)."""
        return self.happened / self.rounds if self.rounds else None


def median_interval(values: Sequence[float], grid: Sequence[float], alpha: float,
                    weights: Sequence[float] | None = None) -> tuple[float, float]:
    """An anytime-valid interval for the median of the distribution `values` (in the order they came) were drawn
    from: the grid points q whose bet on "a value exceeds q" settled in neither direction lie inside. From the
    largest q settled to be exceeded more than half the time to the smallest settled to be exceeded less; a grid's
    end where no point is settled on that side.

    The point q's bet runs at alpha * weight(q) (`weights`, one per grid point, fixed before the values came; by
    default equal), and the weights sum to 1, so the interval holds the median with probability at least 1 - alpha,
    whenever one stops. Weights spend the error where the median is expected (a prediction made before the race):
    an interval's ends settle in fewer rounds there, and in more far from it."""
    if not grid:
        raise ValueError("the grid of candidate medians is empty")
    share = [1.0] * len(grid) if weights is None else list(weights)
    if len(share) != len(grid) or not all(w > 0 and math.isfinite(w) for w in share):
        raise ValueError("the weights must be positive and finite, one per grid point")
    total = sum(share)
    points = sorted(zip(grid, share, strict=True))
    low, high = points[0][0], points[-1][0]
    for q, weight in points:
        bet = HalfBet(alpha * weight / total)
        for v in values:
            bet.observe(v > q)
        if bet.settled(MORE_OFTEN):
            low = max(low, q)
        elif bet.settled(LESS_OFTEN):
            high = min(high, q)
    return low, high


def weights_near(grid: Sequence[float], expected: float, scale: float = 0.1) -> list[float]:
    """Weights for `median_interval` that spend the error near `expected` (a ratio predicted before the values
    came): exp(-|log(q / expected)| / scale), so a point 10% away (at the default scale) weighs 1/e as much as one
    at the prediction."""
    if not (expected > 0 and math.isfinite(expected)):
        raise ValueError(f"the expected value must be positive and finite, got {expected}")
    return [math.exp(-abs(math.log(q / expected)) / scale) for q in grid]
