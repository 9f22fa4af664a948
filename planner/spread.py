"""Uncertainty: how far a measured number could be from what a new measurement would give.

Every cost the model reads from a profile is a statistic of repeated, interleaved samples: the median of whole
steps, the mean of a collective's runs at one size, the median of paired differences (a step with the runtime's
work less the step next to it without). Where the profile keeps those samples, this module gives each statistic
an interval (percentiles of the statistic over bootstrap resamples of its samples), decides whether an in-situ
calibration is usable (`calibration_use`), and compares two predictions drawn under the same resampled profiles
(`PairedGain`).

Plain numbers only, below every layer that reads them: the profile contract (which writes each calibration's
factor), the cost model and the commands. The profile itself is resampled in `planner.costmodel.resample`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "DRAWS",
    "LEVEL",
    "PLAUSIBLE_FACTORS",
    "CalibrationUse",
    "PairedGain",
    "bootstrap",
    "calibration_use",
    "percentile_interval",
    "statistic_interval",
]

#: Two-sided level of every interval printed (5% of the draws below it, 5% above). A plan is kept over DDP when
#: its gain is above zero at the interval's lower end: in at least 95% of the draws.
LEVEL = 0.90
#: Resampled profiles a prediction's interval is taken over.
DRAWS = 200
#: Bootstrap resamples of one statistic's samples (its own interval, e.g. a calibration's).
STATISTIC_DRAWS = 1000
#: In-situ factors (work in real steps over its micro-benchmark) outside these bounds are not physically
#: plausible: below half, the work ran faster inside a step than alone, in a hot loop; above twenty times, the
#: difference of two step times caught something other than the work (a spell of a shared machine).
PLAUSIBLE_FACTORS = (0.5, 20.0)

Statistic = Callable[..., np.ndarray]  # numpy reduction with an `axis` argument: np.median, np.mean


def bootstrap(samples: Sequence[float], statistic: Statistic, draws: int, rng: np.random.Generator) -> np.ndarray:
    """`statistic` of `draws` resamples (with replacement, of the same size) of `samples`."""
    x = np.asarray(samples, dtype=float)
    if x.size == 0:
        raise ValueError("no samples to resample")
    picks = rng.integers(0, x.size, size=(draws, x.size))
    return np.asarray(statistic(x[picks], axis=1), dtype=float)


def percentile_interval(values: Sequence[float] | np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    """The central `level` of `values`: (the (1 - level) / 2 quantile, the (1 + level) / 2 quantile)."""
    lo, hi = np.quantile(np.asarray(values, dtype=float), [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def statistic_interval(samples: Sequence[float], statistic: Statistic = np.median, *, level: float = LEVEL,
                       draws: int = STATISTIC_DRAWS, seed: int = 0) -> tuple[float, float]:
    """The bootstrap percentile interval of `statistic` over `samples` (deterministic: a fixed seed, so every
    rank and every reading of a profile gets the same interval). One sample: that sample, both ends."""
    if len(samples) < 2:
        value = float(samples[0])
        return value, value
    return percentile_interval(bootstrap(samples, statistic, draws, np.random.default_rng(seed)), level)


@dataclass(frozen=True)
class CalibrationUse:
    """What the cost model does with one in-situ calibration.

    Attributes:
        factor: what the micro-benchmarked cost is multiplied by: measured / modelled when `used`, else 1 (the
            micro-benchmark stands in for the measurement).
        measured: measured / modelled as measured (nan when nothing was micro-benchmarked).
        low, high: the interval of `measured` from its samples (None without samples).
        used: whether the measurement is used.
        why: why not, in a few words ("" when used).
    """

    factor: float
    measured: float
    low: float | None
    high: float | None
    used: bool
    why: str = ""

    def describe(self) -> str:
        """"3.19x [2.80, 3.62]" or "3.19x" without an interval."""
        text = f"{self.measured:.2f}x"
        if self.low is not None and self.high is not None:
            text += f" [{self.low:.2f}, {self.high:.2f}]"
        return text


def calibration_use(measured_s: float, modelled_s: float, samples: Sequence[float] | None = None) -> CalibrationUse:
    """Whether an in-situ measurement of `measured_s` (the median of `samples`, paired differences or whole
    durations, where kept) against the micro-benchmarks' `modelled_s` is used, and the factor that follows.

    Not used: nothing was micro-benchmarked; the interval of the median includes no effect (its lower end at or
    below zero: the work was not told apart from the noise); or measured / modelled lies outside
    `PLAUSIBLE_FACTORS`. The decision is taken on the samples where there are (the interval and their median), so
    that a resampled `measured_s` is used or not as the measurement was; `factor` is `measured_s` / `modelled_s`,
    held within `PLAUSIBLE_FACTORS` (a resampled one may stray beyond them).
    """
    if not (modelled_s > 0 and math.isfinite(modelled_s)):
        return CalibrationUse(factor=1.0, measured=math.nan, low=None, high=None, used=False,
                              why="nothing was micro-benchmarked")
    low = high = None
    centre = measured_s
    if samples is not None and len(samples) >= 2:
        centre, lo_s, hi_s = _median_and_interval(tuple(samples))
        low, high = lo_s / modelled_s, hi_s / modelled_s
    ratio = centre / modelled_s
    # A used measurement lies within the plausible bounds; a resampled one (a draw of `measured_s` from its samples)
    # may fall beyond them in the tails, where it is held at the bound: work is never free, nor a step's noise.
    floor, ceiling = PLAUSIBLE_FACTORS
    factor = min(ceiling, max(floor, measured_s / modelled_s))
    use = CalibrationUse(factor=factor, measured=ratio, low=low, high=high, used=True)
    if (low if low is not None else ratio) <= 0:
        return _unused(use, "its interval includes no effect" if low is not None else "no effect was measured")
    if not floor <= ratio <= ceiling:
        return _unused(use, f"{'below' if ratio < floor else 'above'} the plausible {floor:g}x-{ceiling:g}x of its "
                            "micro-benchmark")
    return use


@functools.lru_cache(maxsize=4096)
def _median_and_interval(samples: tuple[float, ...]) -> tuple[float, float, float]:
    """The median of `samples` and its interval (cached: every draw of a resampled profile asks again)."""
    low, high = statistic_interval(samples)
    return float(np.median(np.asarray(samples, dtype=float))), low, high


def _unused(use: CalibrationUse, why: str) -> CalibrationUse:
    return CalibrationUse(factor=1.0, measured=use.measured, low=use.low, high=use.high, used=False, why=why)


@dataclass(frozen=True)
class PairedGain:
    """How much faster a plan is than an alternative, draw by draw under the same resampled profiles:
    gain = 1 - plan / alternative in each draw (> 0: the plan is faster).

    Attributes:
        median, low, high: the median gain and its `LEVEL` interval.
    """

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, plan: Sequence[float] | np.ndarray, other: Sequence[float] | np.ndarray,
           level: float = LEVEL) -> PairedGain:
        """The gain of `plan`'s draws over `other`'s (the same draws, in the same order)."""
        a, b = np.asarray(plan, dtype=float), np.asarray(other, dtype=float)
        if a.shape != b.shape or a.size == 0:
            raise ValueError(f"paired draws must be the same non-empty shape, got {a.shape} and {b.shape}")
        gains = 1.0 - a / b
        low, high = percentile_interval(gains, level)
        return cls(median=float(np.median(gains)), low=low, high=high)

    @property
    def beyond_noise(self) -> bool:
        """Whether the plan is faster in (1 + LEVEL) / 2 of the draws at least: the interval's lower end above 0."""
        return self.low > 0

    def describe(self) -> str:
        """"12.3% [8.1%, 16.0%]"."""
        return f"{self.median:.1%} [{self.low:.1%}, {self.high:.1%}]"
