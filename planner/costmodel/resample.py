"""Resampled profiles: the profile as another run of the same measurements might have given it.

A draw replaces every statistic whose samples the profile kept with the same statistic over a bootstrap resample
of those samples, and leaves every other number as measured:

- the layer phase's steps (`Profile.steps`): whole steps drawn with replacement, each with the hooked step beside
  it, so F, every b_i, U and the whole step move together as they did in the measurement (`StepSamples.scaled_parts`);
- each collective point (`FittedCurve.samples`): its runs drawn with replacement, their mean the new point, and the
  curve fitted again (fit or interpolation, as any curve: `planner.costmodel.curves.curve_model`);
- each in-situ calibration (`Calibration.samples_s`): its median over drawn samples (used by the cost model or not
  as the measurement is: `planner.spread.calibration_use` decides on the samples);
- sigma and kappa (`Profile.slowdown_samples`): pairs of passes and of chains drawn with replacement.

Predictions evaluated under many draws give each prediction an interval; two predictions evaluated under the same
draws give the interval of their difference (`planner.spread.PairedGain`), where what both share (the
same compute, the same network) cancels out.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

import numpy as np

from planner.contracts.profile import Calibration, FittedCurve, HostTiming, Profile
from planner.costmodel.curves import fit_curve

__all__ = ["SOURCES", "resampled", "resampled_many", "spread_sources"]

#: What a profile may keep samples of, as `spread_sources` names them.
SOURCES = ("steps", "collectives", "in-situ calibrations", "sigma and kappa")


def spread_sources(profile: Profile) -> tuple[str, ...]:
    """Which of `SOURCES` this profile kept samples of (empty: a profile made before they were kept)."""
    found = []
    if profile.steps is not None:
        found.append(SOURCES[0])
    if any(c.samples is not None for c in _curves(profile)):
        found.append(SOURCES[1])
    if profile.in_situ is not None and any(c.samples_s for _, c in profile.in_situ.named()):
        found.append(SOURCES[2])
    if profile.slowdown_samples:
        found.append(SOURCES[3])
    return tuple(found)


def resampled_many(profile: Profile, draws: int, seed: int = 0, only: Collection[str] | None = None) -> list[Profile]:
    """`draws` resampled profiles (`resampled`), the same for the same profile and seed."""
    rng = np.random.default_rng(seed)
    return [resampled(profile, rng, only) for _ in range(draws)]


def resampled(profile: Profile, rng: np.random.Generator, only: Collection[str] | None = None) -> Profile:
    """One draw of `profile` (see the module docstring); numbers without samples stay as they are, and so do those
    of the `SOURCES` not in `only` (default: every source drawn), to tell how much of a prediction's spread each
    source makes."""
    unknown = set(only or ()) - set(SOURCES)
    if unknown:
        raise ValueError(f"no such source of samples: {sorted(unknown)}; the sources are {list(SOURCES)}")

    def drawn(source: str) -> bool:
        return only is None or source in only

    changes: dict[str, object] = {}
    if profile.steps is not None and drawn(SOURCES[0]):
        changes.update(_steps(profile, rng))
    if drawn(SOURCES[1]):
        changes["collectives"] = {c: _curve(curve, rng) for c, curve in profile.collectives.items()}
        if profile.hosts is not None:
            changes["hosts"] = _hosts(profile.hosts, rng)
    if profile.in_situ is not None and drawn(SOURCES[2]):
        changes["in_situ"] = profile.in_situ.mapped(lambda c: _calibration(c, rng))
    if profile.slowdown_samples and drawn(SOURCES[3]):
        sigma, kappa = dict(profile.interference or {}), dict(profile.comm_stretch or {})
        for coll, samples in profile.slowdown_samples.items():
            picks = _picks(len(samples.alone_s), rng)
            if coll in sigma:
                sigma[coll] = samples.sigma(picks)
            if coll in kappa:
                kappa[coll] = samples.kappa(_picks(len(samples.pace_alone_s), rng))
        changes["interference"] = sigma if profile.interference is not None else None
        changes["comm_stretch"] = kappa if profile.comm_stretch is not None else None
    return replace(profile, **changes)  # type: ignore[arg-type]


def _picks(count: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, count, size=count)


def _steps(profile: Profile, rng: np.random.Generator) -> dict[str, object]:
    """F, the layers' times, U and the whole step over drawn steps; each layer's forward time and spread follow the
    forward pass and the scale."""
    steps = profile.steps
    assert steps is not None
    fwd, upd, backward, whole = steps.scaled_parts(_picks(steps.count, rng))
    forward_ratio = fwd / profile.forward_s if profile.forward_s > 0 else 1.0
    total = sum(backward)
    summed = sum(lt.backward_s for lt in profile.layers)
    backward_ratio = total / summed if summed > 0 else 1.0
    layers = tuple(replace(lt, backward_s=b, forward_s=lt.forward_s * forward_ratio,
                           backward_iqr_s=lt.backward_iqr_s * backward_ratio)
                   for lt, b in zip(profile.layers, backward, strict=True))
    return {"forward_s": fwd, "update_s": upd, "layers": layers, "backward_s": profile.backward_s * backward_ratio,
            "step_s": whole}


def _curve(curve: FittedCurve, rng: np.random.Generator) -> FittedCurve:
    """The curve with each point the mean of its drawn runs, fitted again (unchanged without samples)."""
    if curve.samples is None:
        return curve
    points = []
    for (size, _), runs in zip(curve.points, curve.samples, strict=True):
        x = np.asarray(runs, dtype=float)
        points.append((size, float(x[_picks(x.size, rng)].mean())))
    return fit_curve(points, curve.samples)


def _hosts(hosts: HostTiming, rng: np.random.Generator) -> HostTiming:
    return replace(hosts, inter=_curve(hosts.inter, rng), hierarchical=_curve(hosts.hierarchical, rng),
                   intra=None if hosts.intra is None else _curve(hosts.intra, rng),
                   topk=tuple(replace(t, exchange=_curve(t.exchange, rng)) for t in hosts.topk))


def _calibration(calibration: Calibration, rng: np.random.Generator) -> Calibration:
    """The calibration with its median over drawn samples (unchanged without samples)."""
    if not calibration.samples_s:
        return calibration
    x = np.asarray(calibration.samples_s, dtype=float)
    return replace(calibration, measured_s=float(np.median(x[_picks(x.size, rng)])))


def _curves(profile: Profile) -> list[FittedCurve]:
    out = list(profile.collectives.values())
    if profile.hosts is not None:
        h = profile.hosts
        out += [h.inter, h.hierarchical, *([] if h.intra is None else [h.intra]), *(t.exchange for t in h.topk)]
    return out
