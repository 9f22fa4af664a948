"""Cost models from measured points: the affine fit where it holds, interpolation where it does not (DESIGN.md:
fitted where the data is linear, interpolated where it is not), in size and, for top-k, in density.

These are the arithmetic the profile's curves are read with: `planner.contracts.profile` holds the points and
their checks, and `planner.costmodel.curves` turns them into cost models with these.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.costmodel.costs import AffineCost, CostModel, PiecewiseLinearCost

__all__ = [
    "MAX_FIT_ERROR",
    "CubeCost",
    "fitted_or_interpolated",
    "interpolated_in_density",
    "shifted_fit",
    "worst_fit_error",
]

#: Largest relative error of the affine fit at any measured point for the fit to be used as the model: about
#: the spread of a measured mean, well under the 10% the predictions aim for. (At 25% the fit of the
#: hierarchical allreduce across two emulated hosts, 20% high at 1 KiB and 8-13% low from 4 MiB up, was kept, and
#: hierarchical plans were predicted 14-17% short on the MLP where interpolation gives 6-9%.)
MAX_FIT_ERROR = 0.05

#: Measured (size, density, seconds) points: top-k selection against numel, or decoding against values.
DensityPoints = Sequence[tuple[int, float, float]]


def worst_fit_error(points: Sequence[tuple[int, float]], fit: AffineCost) -> float:
    """Largest relative error of `fit` over the measured (size, seconds) points."""
    return max((abs(fit.cost(x) - t) / t for x, t in points if t > 0), default=0.0)


def fitted_or_interpolated(points: Sequence[tuple[int, float]], fit: AffineCost) -> CostModel:
    """`fit` where it holds at every point (within MAX_FIT_ERROR), else interpolation of the points (of equal
    sizes, the last one measured)."""
    if worst_fit_error(points, fit) <= MAX_FIT_ERROR:
        return fit
    pts = sorted(dict(points).items())
    return PiecewiseLinearCost(xs=tuple(float(x) for x, _ in pts), ys=tuple(t for _, t in pts))


def shifted_fit(points: Sequence[tuple[int, float]], old: AffineCost,
                new: AffineCost) -> tuple[tuple[tuple[int, float], ...], float]:
    """The points moved as the fit moves from `old` to `new` (each t + (new - old)(x), at least 0), and the
    median relative error of `new` on them (as `fit_affine` measures it)."""
    shift_a, shift_b = new.alpha - old.alpha, new.beta - old.beta
    moved = tuple((x, max(0.0, t + shift_a + shift_b * x)) for x, t in points)
    errors = sorted(abs(new.cost(x) - t) / t for x, t in moved if t > 0)
    return moved, errors[len(errors) // 2] if errors else 0.0


def interpolated_in_density(points: DensityPoints, density: float) -> PiecewiseLinearCost:
    """The (size, density, seconds) points as seconds against size at `density`: the curve of the measured
    density itself, of the nearest one outside the measured range, else interpolated in log(density)
    between the two around it. Of equal sizes at one density the fastest counts (a k clamped to 1 gives
    several decodes of the same size).

    Raises:
        ValueError: no points.
    """
    ds = sorted({d for _, d, _ in points})
    if not ds:
        raise ValueError("no measured points to interpolate")

    def curve(d: float) -> PiecewiseLinearCost:
        least: dict[int, float] = {}
        for n, dd, t in points:
            if dd == d:
                least[n] = min(t, least.get(n, t))
        pts = sorted(least.items())
        return PiecewiseLinearCost(xs=tuple(float(n) for n, _ in pts), ys=tuple(t for _, t in pts))

    if density <= ds[0]:
        return curve(ds[0])
    if density >= ds[-1]:
        return curve(ds[-1])
    hi = next(i for i, d in enumerate(ds) if d >= density)
    lo_d, hi_d = ds[hi - 1], ds[hi]
    if hi_d == density:
        return curve(hi_d)
    w = (math.log(density) - math.log(lo_d)) / (math.log(hi_d) - math.log(lo_d))
    a, b = curve(lo_d), curve(hi_d)
    xs = tuple(sorted(set(a.xs) | set(b.xs)))
    return PiecewiseLinearCost(xs=xs, ys=tuple((1 - w) * a.cost(x) + w * b.cost(x) for x in xs))


@dataclass(frozen=True, kw_only=True)
class CubeCost(CostModel):
    """A cost model of d^3 seen as a function of d (inversions and eigendecompositions against dimension)."""

    inner: CostModel

    def cost(self, x: float) -> float:
        return self.inner.cost(x**3)

    def cost_many(self, xs: np.ndarray) -> np.ndarray:
        return self.inner.cost_many(np.asarray(xs, dtype=float) ** 3)
