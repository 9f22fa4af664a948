"""The model's own error on the ratio it predicts of a finalist to DDP, calibrated from races (split conformal).

A prediction's interval from the profile's samples (`planner.strategies.intervals`) holds the profile's noise, not
the model's error: what the timeline leaves out (a cache, the scheduler, a kernel's launch) moves every measurement
the same way. Races measure what the model predicted: each raced arm gives a pair (predicted ratio to DDP,
measured ratio), `planner.contracts.race_log`. Split conformal prediction (Vovk et al. 2005; Lei et al., JASA 2018)
turns the residuals r = |log(measured / predicted)| of n arms raced before into one bound q: the ceil((n + 1) level)-th
smallest residual. A new arm's ratio then lies in [predicted e^-q, predicted e^q] with probability at least `level`,
provided the new arm's pair and the logged ones are exchangeable (drawn alike: the same kind of models, links and
machine; arms of one race are not independent of each other, so with few races the coverage is looser than said).
With fewer than (1 - level)^-1 - 1 arms logged no finite bound has that coverage: none is given.

The ratio is the headline: the machine's drift since the profile moves DDP's steps and the finalist's alike, so the
ratio's error is smaller than either's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from planner.contracts.plan import DDP_ROW
from planner.contracts.race_log import LoggedRace

__all__ = ["DEFAULT_LEVEL", "ModelError", "residuals"]

#: The coverage the model-error interval aims at.
DEFAULT_LEVEL = 0.9


def residuals(races: Iterable[LoggedRace]) -> list[float]:
    """|log(measured / predicted)| of every raced arm but the reference with both ratios."""
    return [abs(math.log(arm.ratio_to_ddp / arm.predicted_ratio)) for logged in races for arm in logged.race.arms
            if arm.name != logged.race.reference and arm.ratio_to_ddp is not None and arm.predicted_ratio is not None]


@dataclass(frozen=True)
class ModelError:
    """The conformal bound on the log ratio's error: `bound` from `arms` residuals at `level`."""

    level: float
    arms: int
    races: int
    bound: float
    reference: str = DDP_ROW

    @classmethod
    def of(cls, races: Iterable[LoggedRace], level: float = DEFAULT_LEVEL,
           reference: str = DDP_ROW) -> ModelError | None:
        """The bound from the races logged against `reference` (DDP: races of gradient plans; a K-FAC race's
        ratios are to another arm, a prediction of another model); None with too few arms for a finite bound."""
        if not 0 < level < 1:
            raise ValueError(f"the level must be in (0, 1), got {level}")
        races = [logged for logged in races if logged.race.reference == reference]
        values = sorted(residuals(races))
        rank = math.ceil((len(values) + 1) * level)
        if rank > len(values):
            return None
        return cls(level=level, arms=len(values), races=len(races), bound=values[rank - 1], reference=reference)

    def interval(self, predicted: float) -> tuple[float, float]:
        """Where a ratio predicted at `predicted` lies, with probability at least `level`."""
        return predicted * math.exp(-self.bound), predicted * math.exp(self.bound)

    def describe(self) -> str:
        """"the model's error on ratios to DDP: within x1.046 in 90% (conformal, 23 arms of 6 races)"."""
        to = "DDP" if self.reference == DDP_ROW else self.reference
        return (f"the model's error on ratios to {to}: within x{math.exp(self.bound):.3f} either way in "
                f"{self.level:.0%} (split conformal on {self.arms} arms of {self.races} earlier races)")
