"""The profile's measured curves as cost models: fitting alpha + beta * x to the measured points (the profilers),
and reading a curve as the seconds of any size (the cost model): the fit where it holds at every point,
interpolation where it does not (`planner.costmodel.measured`).

`planner.contracts.profile` holds each curve's points, its fitted coefficients and their checks; this module does
the arithmetic on them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from planner.contracts.profile import DimCurve, FittedCurve, TopkTiming
from planner.costmodel.costs import AffineCost, CostModel, fit_affine
from planner.costmodel.measured import (
    CubeCost,
    fitted_or_interpolated,
    interpolated_in_density,
    shifted_fit,
    worst_fit_error,
)
from planner.types import InvalidProfileError, SchemaError

__all__ = [
    "affine",
    "corrected",
    "curve_model",
    "decode_model",
    "fit_curve",
    "fit_dim_curve",
    "select_model",
    "worst_error",
]


def fit_curve(points: Sequence[tuple[int, float]],
              samples: Sequence[tuple[float, ...]] | None = None) -> FittedCurve:
    """The curve of the measured (size, seconds) `points` with its affine fit; `samples`, where kept, the runs each
    point's seconds are the mean of (in the order of `points`)."""
    model, err = fit_affine(list(points))
    return FittedCurve(points=tuple(points), alpha_s=model.alpha, beta_s_per_byte=model.beta, fit_error=err,
                       samples=None if samples is None else tuple(tuple(s) for s in samples))


def fit_dim_curve(points: Sequence[tuple[int, float]]) -> DimCurve:
    """The curve of the measured (dimension d, seconds) `points` with its fit alpha + beta * d^3."""
    model, err = fit_affine([(d**3, t) for d, t in points])
    return DimCurve(points=tuple(points), alpha_s=model.alpha, beta_s_per_dim3=model.beta, fit_error=err)


def affine(curve: FittedCurve) -> AffineCost:
    """The curve's fit alpha + beta * size."""
    return AffineCost(alpha=curve.alpha_s, beta=curve.beta_s_per_byte)


def _against_cubes(curve: DimCurve) -> FittedCurve:
    """The same measurements as seconds against d^3, where the fit is affine."""
    return FittedCurve(points=tuple((d**3, t) for d, t in curve.points), alpha_s=curve.alpha_s,
                       beta_s_per_byte=curve.beta_s_per_dim3, fit_error=curve.fit_error)


def worst_error(curve: FittedCurve | DimCurve) -> float:
    """Largest relative error of the fit over the measured points."""
    if isinstance(curve, DimCurve):
        return worst_error(_against_cubes(curve))
    return worst_fit_error(curve.points, affine(curve))


def curve_model(curve: FittedCurve | DimCurve) -> CostModel:
    """Seconds against size: the fit where it holds at every point, else interpolation of the measured points (a
    `DimCurve`: seconds against d, the cubic fit or interpolation in d^3)."""
    if isinstance(curve, DimCurve):
        return CubeCost(inner=curve_model(_against_cubes(curve)))
    return fitted_or_interpolated(curve.points, affine(curve))


def corrected(curve: FittedCurve, alpha_scale: float, beta_scale: float) -> FittedCurve:
    """`curve` with its start-up scaled by `alpha_scale` and its per-byte cost by `beta_scale`.

    The fit becomes alpha * alpha_scale + beta * beta_scale * x, and every measured point (x, t) moves by the same
    amount, t + (alpha_scale - 1) * alpha + (beta_scale - 1) * beta * x (at least 0): where the fit is the model,
    the model is exactly the corrected affine cost; where the points are interpolated, they are shifted the same
    way. `fit_error` is recomputed on the moved points (and so is the choice between fit and interpolation, which
    a large correction can change). Scales of 1 return the curve.

    Raises:
        SchemaError: a scale is not finite and > 0.
    """
    scales = (alpha_scale, beta_scale)
    if not all(not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v) and v > 0
               for v in scales):
        raise SchemaError(
            f"`alpha_scale > 0 and beta_scale > 0` (finite) must hold, but got "
            f"(alpha_scale={alpha_scale!r}, beta_scale={beta_scale!r})"
        )
    if alpha_scale == 1 and beta_scale == 1:
        return curve
    new = AffineCost(alpha=curve.alpha_s * alpha_scale, beta=curve.beta_s_per_byte * beta_scale)
    points, fit_error = shifted_fit(curve.points, affine(curve), new)
    # The moved points are no longer the means of the runs measured: a corrected curve keeps no samples.
    return FittedCurve(points=points, alpha_s=new.alpha, beta_s_per_byte=new.beta, fit_error=fit_error)


def select_model(topk: TopkTiming, density: float, selector: str = "exact") -> CostModel:
    """Selection seconds against numel at `density` with `selector`, interpolated in log(density) between measured
    densities.

    Raises:
        InvalidProfileError: the profile has no points for `selector`.
        SchemaError: an unknown selector name.
    """
    points = topk.points(selector)
    if not points:
        raise InvalidProfileError(
            f"the profile has no top-k selection points for the {selector} selector; measure again with "
            "`planner profile`" + (" or use --selector exact" if selector != "exact" else "")
        )
    return interpolated_in_density(points, density)


def decode_model(topk: TopkTiming, density: float) -> CostModel:
    """Decode seconds against the P * k values gathered, at `density` (interpolated in log(density) between
    measured densities; the 1% curve when the profile has no per-density points)."""
    if not topk.decode_points:
        return curve_model(topk.decode)
    return interpolated_in_density(topk.decode_points, density)
