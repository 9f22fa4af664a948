"""Cost models: functions from a size to seconds, fitted to or interpolated from measured points."""

from __future__ import annotations

import abc
import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.types import SchemaError

__all__ = ["AffineCost", "CheaperOf", "CostModel", "PiecewiseLinearCost", "ScaledCost", "fit_affine"]


class CostModel(abc.ABC):
    """Seconds taken by an operation of size `x` (bytes, elements, ...). Must be >= 0 and non-decreasing."""

    @abc.abstractmethod
    def cost(self, x: float) -> float:
        """Predicted seconds for size `x`."""

    def __call__(self, x: float) -> float:
        return self.cost(x)

    def cost_many(self, xs: np.ndarray) -> np.ndarray:
        """Vectorised `cost` (the solvers call this in their inner loops); override for speed."""
        return np.array([self.cost(float(x)) for x in np.asarray(xs).ravel()], dtype=float).reshape(np.shape(xs))

    def lines(self) -> tuple[tuple[float, float], ...]:
        """Lines (a, b) below the cost: cost(x) >= a + b * x for every x > 0 (the solvers bound the cost of
        long groups with them). The zero line holds for every cost model; override for tighter ones."""
        return ((0.0, 0.0),)


@dataclass(frozen=True, kw_only=True)
class AffineCost(CostModel):
    """T(x) = alpha + beta * x for x > 0, and 0 for x == 0 (nothing is sent)."""

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.alpha) and math.isfinite(self.beta)) or self.alpha < 0 or self.beta < 0:
            raise SchemaError(f"`alpha >= 0 and beta >= 0` must hold, but got (alpha={self.alpha}, beta={self.beta})")

    def cost(self, x: float) -> float:
        return 0.0 if x <= 0 else self.alpha + self.beta * x

    def cost_many(self, xs: np.ndarray) -> np.ndarray:
        xs = np.asarray(xs, dtype=float)
        return np.where(xs > 0, self.alpha + self.beta * xs, 0.0)

    def lines(self) -> tuple[tuple[float, float], ...]:
        return ((self.alpha, self.beta),)


@dataclass(frozen=True, kw_only=True)
class PiecewiseLinearCost(CostModel):
    """Linear interpolation between measured points (xs ascending).

    Below the first point the first measurement holds (start-up dominates small sizes); beyond the last
    point the cost grows in proportion to size (no faster, no slower than the last measurement).
    """

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.xs) != len(self.ys) or not self.xs:
            raise SchemaError(f"need as many sizes as times and at least one, got {len(self.xs)} and {len(self.ys)}")
        if any(b <= a for a, b in zip(self.xs, self.xs[1:], strict=False)):
            raise SchemaError(f"sizes must be strictly ascending, got {self.xs}")
        if any(not math.isfinite(y) or y < 0 for y in self.ys):
            raise SchemaError(f"times must be finite and >= 0, got {self.ys}")
        # Monotone envelope: a measured dip (noise) must not make a larger message cheaper.
        envelope = tuple(max(self.ys[: i + 1]) for i in range(len(self.ys)))
        object.__setattr__(self, "ys", envelope)

    def cost(self, x: float) -> float:
        if x <= 0:
            return 0.0
        xs, ys = self.xs, self.ys
        if x <= xs[0]:
            return ys[0]
        if x >= xs[-1]:
            return ys[-1] * x / xs[-1]
        i = bisect.bisect_right(xs, x)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    def cost_many(self, xs: np.ndarray) -> np.ndarray:
        xs = np.asarray(xs, dtype=float)
        inside = np.interp(xs, self.xs, self.ys)
        beyond = self.ys[-1] * xs / self.xs[-1]
        return np.where(xs <= 0, 0.0, np.where(xs >= self.xs[-1], beyond, inside))

    def lines(self) -> tuple[tuple[float, float], ...]:
        """One line per slope of the measured segments (capped at the final slope): cost - b * x is piecewise
        linear on x > 0, so its least value is at a measured point, at 0+ (where the cost is ys[0]) or, if
        b exceeded the final slope, -inf; the line's intercept is that least value."""
        xs, ys = np.asarray(self.xs), np.asarray(self.ys)
        final = ys[-1] / xs[-1]
        slopes = np.clip(np.diff(ys) / np.diff(xs), 0.0, final) if xs.size > 1 else np.zeros(0)
        slopes = np.unique(np.concatenate((slopes, [0.0, final])))
        intercepts = np.minimum(ys[0], np.min(ys[None, :] - slopes[:, None] * xs[None, :], axis=1))
        return tuple((float(a), float(b)) for a, b in zip(intercepts, slopes, strict=True))


@dataclass(frozen=True, kw_only=True)
class ScaledCost(CostModel):
    """Another cost model's times multiplied by `factor` (> 0): a micro-benchmark calibrated in situ."""

    inner: CostModel
    factor: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise SchemaError(f"`0 < factor < inf` must hold, but got factor={self.factor}")

    def cost(self, x: float) -> float:
        return self.factor * self.inner.cost(x)

    def cost_many(self, xs: np.ndarray) -> np.ndarray:
        return self.factor * self.inner.cost_many(xs)

    def lines(self) -> tuple[tuple[float, float], ...]:
        return tuple((self.factor * a, self.factor * b) for a, b in self.inner.lines())


@dataclass(frozen=True, kw_only=True)
class CheaperOf(CostModel):
    """The cheaper of two ways at each size (`first` on a tie): a group sent flat or hierarchically, whichever
    costs less for its size. `second_wins(x)` says which was taken."""

    first: CostModel
    second: CostModel

    def cost(self, x: float) -> float:
        return min(self.first.cost(x), self.second.cost(x))

    def cost_many(self, xs: np.ndarray) -> np.ndarray:
        return np.minimum(self.first.cost_many(xs), self.second.cost_many(xs))

    def second_wins(self, x: float) -> bool:
        return self.second.cost(x) < self.first.cost(x)

    def lines(self) -> tuple[tuple[float, float], ...]:
        """A line below both costs is below the cheaper: the lower intercept with the lower slope of every pair."""
        return tuple((min(a1, a2), min(b1, b2)) for a1, b1 in self.first.lines() for a2, b2 in self.second.lines())


def fit_affine(points: Sequence[tuple[float, float]]) -> tuple[AffineCost, float]:
    """Least-squares alpha + beta*x over (size, seconds) points, weighted to fit small and large sizes alike.

    Returns the model and its fit error: the median of |predicted - measured| / measured over the points.
    Residuals are relative (each point weighted by 1/y) because sizes span several decades.
    """
    pts = [(float(x), float(y)) for x, y in points if y > 0]
    if len(pts) < 2:
        raise SchemaError(f"need at least two measured points with time > 0 to fit alpha + beta*x, got {len(pts)}")
    # Weighted least squares with weights 1/y^2 (relative error), closed form for two unknowns.
    sw = sx = sy = sxx = sxy = 0.0
    for x, y in pts:
        w = 1.0 / (y * y)
        sw += w
        sx += w * x
        sy += w * y
        sxx += w * x * x
        sxy += w * x * y
    det = sw * sxx - sx * sx
    beta = (sw * sxy - sx * sy) / det if det > 0 else 0.0
    alpha = (sy - beta * sx) / sw
    if beta < 0:  # noise made large messages look cheaper: fall back to a constant
        beta, alpha = 0.0, sy / sw
    if alpha < 0:  # start-up cannot be negative: refit the slope through the origin
        alpha = 0.0
        beta = sum(x * y / (y * y) for x, y in pts) / sum(x * x / (y * y) for x, y in pts)
    model = AffineCost(alpha=alpha, beta=beta)
    errs = sorted(abs(model.cost(x) - y) / y for x, y in pts)
    return model, errs[len(errs) // 2]
