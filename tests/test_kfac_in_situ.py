"""K-FAC's factor hooks calibrated in real steps: the runtime measures them beside plain passes, the profile
carries the calibration, and the K-FAC problem charges the hooks at the calibrated time."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from planner.contracts.profile import Calibration, InSitu, Profile
from planner.models import build_workload
from planner.strategies.kfac import calibrated_kfac, kfac_problem
from planner.types import InverseMethod, SchemaError
from profilers.kfac import measure_kfac
from runtime.calibrate import measure_kfac_in_situ
from tests.factories import synthetic_profile

CPU = torch.device("cpu")


def _with_hooks_factor(profile: Profile, measured: float, modelled: float) -> Profile:
    situ = profile.in_situ or InSitu()
    return replace(profile, in_situ=replace(situ, kfac_factors=Calibration(measured_s=measured, modelled_s=modelled)))


def test_the_calibration_round_trips_and_old_profiles_read_without_it() -> None:
    profile = _with_hooks_factor(synthetic_profile("cnn"), 0.3, 0.2)
    doc = profile.to_dict()
    assert doc["in_situ"]["kfac_factors"]["factor"] == pytest.approx(1.5)
    assert Profile.from_dict(doc) == profile
    del doc["in_situ"]["kfac_factors"]  # profiles made before it was measured
    assert Profile.from_dict(doc).in_situ.kfac_factors is None  # type: ignore[union-attr]
    doc["in_situ"]["kfac_factors"] = {"measured_s": -1.0, "modelled_s": 0.2}
    with pytest.raises(SchemaError, match=r"kfac_factors\.measured_s"):
        Profile.from_dict(doc)


def test_the_problem_charges_the_hooks_at_the_calibrated_time() -> None:
    base = synthetic_profile("cnn")
    assert base.kfac is not None
    doubled = _with_hooks_factor(base, 2.0, 1.0)
    kf = calibrated_kfac(doubled)
    for mine, theirs in zip(kf.layers, base.kfac.layers, strict=True):
        assert mine.a_compute_s == pytest.approx(2 * theirs.a_compute_s)
        assert mine.g_compute_s == pytest.approx(2 * theirs.g_compute_s)
        assert mine.fold_s == theirs.fold_s and mine.precondition_eigen_s == theirs.precondition_eigen_s
    plain, slow = (kfac_problem(p, InverseMethod.EIGEN) for p in (base, doubled))
    hooks = sum(lt.a_compute_s + lt.g_compute_s for lt in base.kfac.layers)
    # Every hook runs on the compute stream: the calibrated step computes longer by exactly their extra time.
    assert slow.compute_end_s - plain.compute_end_s == pytest.approx(hooks, rel=1e-9)
    assert calibrated_kfac(_with_hooks_factor(base, 1.0, 1.0)) is base.kfac


def test_the_runtime_measures_its_hooks_beside_plain_passes() -> None:
    wl = build_workload("cnn")
    kfac = measure_kfac(wl, CPU, repeats=2, warmup=1)
    calls: list[int] = []
    cal = measure_kfac_in_situ(wl, CPU, kfac, repeats=3, on_point=lambda: calls.append(1))
    assert len(calls) == 3
    assert cal.modelled_s == pytest.approx(sum(lt.a_compute_s + lt.g_compute_s for lt in kfac.layers))
    assert cal.measured_s >= 0 and cal.factor >= Calibration.MIN_FACTOR
    # The hooks are gone: the plain module runs many passes without K-FAC complaining of factors computed twice.
    for _ in range(2):
        wl.loss_fn(wl.module(wl.batch()[0]), wl.batch()[1]).backward()
