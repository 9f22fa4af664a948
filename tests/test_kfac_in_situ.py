"""K-FAC's factor hooks calibrated in real steps: the runtime measures them beside plain passes, the profile
carries the calibration, and the K-FAC problem charges the hooks at the calibrated time."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

from planner.contracts.profile import KFAC_STEP_PARTS, Calibration, InSitu, KFACTiming, Profile
from planner.costmodel.curves import curve_model
from planner.models import Workload, build_workload
from planner.profilers.kfac_costs import measure_kfac
from planner.runtime.calibrate import (
    kfac_steps_points,
    measure_kfac_in_situ,
    measure_kfac_steps_in_situ,
    slowest_rank_extra,
    slowest_rank_phases,
)
from planner.strategies.kfac_plan import calibrated_kfac, kfac_problem
from planner.types import InverseMethod, SchemaError
from tests.factories import synthetic_profile
from tests.pool import run_warm

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
    doc["in_situ"]["kfac_factors"] = {"measured_s": -1.0, "modelled_s": 0.2}  # a difference of noisy passes
    assert Profile.from_dict(doc).in_situ.kfac_factors.factor == 1.0  # type: ignore[union-attr]
    doc["in_situ"]["kfac_factors"] = {"measured_s": "0.3", "modelled_s": 0.2}
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


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread for the calibrations run in this process, as the workers run them
    (`planner.platform.launch`): on a shared 2-core machine, two threads per pass made them several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def cnn_kfac() -> KFACTiming:
    """The built-in CNN's K-FAC micro-benchmarks at a batch of 8 (`_cnn`), measured once for the tests of this process
    that calibrate against them."""
    return measure_kfac(_cnn(), CPU, repeats=2, warmup=1)


def _cnn() -> Workload:
    """A fresh built-in CNN at a batch of 8, as the workers below run it: what is under test is how the calibration
    measures, which a small batch shows as well as the default one, in a fraction of the time."""
    return build_workload("cnn", batch_size=8)


def test_the_runtime_measures_its_hooks_beside_plain_passes(cnn_kfac: KFACTiming) -> None:
    wl, kfac = _cnn(), cnn_kfac
    calls: list[int] = []
    cal = measure_kfac_in_situ(wl, CPU, kfac, repeats=3, on_point=lambda: calls.append(1))
    assert len(calls) == 3 * cal.attempts  # measured again when the first was not usable
    assert cal.modelled_s == pytest.approx(sum(lt.a_compute_s + lt.g_compute_s for lt in kfac.layers))
    assert cal.samples_s is not None and len(cal.samples_s) == 3 and cal.factor > 0
    # The hooks are gone: the plain module runs many passes without K-FAC complaining of factors computed twice.
    for _ in range(2):
        wl.loss_fn(wl.module(wl.batch()[0]), wl.batch()[1]).backward()


def _with_step_factors(profile: Profile, **factors: float) -> Profile:
    """`profile` with K-FAC step calibrations of the given factors (part names with ':' written as '__')."""
    situ = profile.in_situ or InSitu()
    steps = {part.replace("__", ":"): Calibration(measured_s=f, modelled_s=1.0) for part, f in factors.items()}
    return replace(profile, in_situ=replace(situ, kfac_steps=steps))


def test_the_step_calibrations_round_trip_and_unknown_parts_are_refused() -> None:
    profile = _with_step_factors(synthetic_profile("cnn"), fold=0.9, invert__eigen=0.8, precondition__inverse=1.2)
    doc = profile.to_dict()
    assert doc["in_situ"]["kfac_steps"]["invert:eigen"]["factor"] == pytest.approx(0.8)
    assert Profile.from_dict(doc) == profile
    del doc["in_situ"]["kfac_steps"]  # profiles made before it was measured
    assert Profile.from_dict(doc).in_situ.kfac_steps == {}  # type: ignore[union-attr]
    doc["in_situ"]["kfac_steps"] = {"invert:cholesky": {"measured_s": 1.0, "modelled_s": 1.0}}
    with pytest.raises(SchemaError, match=r"invert:cholesky.*in_situ\.kfac_steps"):
        Profile.from_dict(doc)
    doc["in_situ"]["kfac_steps"] = {"fold": {"measured_s": "slow", "modelled_s": 1.0}}
    with pytest.raises(SchemaError, match=r"kfac_steps\.fold\.measured_s"):
        Profile.from_dict(doc)


def test_each_step_calibration_scales_its_own_part_of_the_model() -> None:
    base = synthetic_profile("cnn")
    assert base.kfac is not None
    calibrated = _with_step_factors(base, fold=0.5, invert__eigen=0.8, invert__inverse=1.4,
                                    precondition__eigen=1.1, precondition__inverse=1.3)
    kf = calibrated_kfac(calibrated)
    for mine, theirs in zip(kf.layers, base.kfac.layers, strict=True):
        assert mine.fold_s == pytest.approx(0.5 * theirs.fold_s)
        assert mine.precondition_eigen_s == pytest.approx(1.1 * theirs.precondition_eigen_s)
        assert mine.precondition_inverse_s == pytest.approx(1.3 * theirs.precondition_inverse_s)
        assert mine.a_compute_s == theirs.a_compute_s and mine.g_compute_s == theirs.g_compute_s
    for d in (16, 300, 2000):
        assert curve_model(kf.eigen).cost(d) == pytest.approx(0.8 * curve_model(base.kfac.eigen).cost(d))
        assert curve_model(kf.inverse).cost(d) == pytest.approx(1.4 * curve_model(base.kfac.inverse).cost(d))
    # The problem inverts and preconditions at the calibrated times.
    plain, scaled = (kfac_problem(p, InverseMethod.EIGEN) for p in (base, calibrated))
    assert scaled.layout.placement.inv_s == pytest.approx([0.8 * s for s in plain.layout.placement.inv_s])
    assert scaled.layout.precondition_s == pytest.approx([1.1 * s for s in plain.layout.precondition_s])
    assert calibrated_kfac(_with_step_factors(base, fold=1.0, invert__eigen=1.0)) is base.kfac


def test_the_runtime_times_folding_inverting_and_preconditioning_in_real_steps(cnn_kfac: KFACTiming) -> None:
    wl, kfac = _cnn(), cnn_kfac
    calls: list[int] = []
    cals = measure_kfac_steps_in_situ(wl, CPU, kfac, steps=2, on_point=lambda: calls.append(1))
    assert len(calls) == kfac_steps_points(kfac, 2) == 4  # two steps per method: the CNN inverts in milliseconds
    assert set(cals) == set(KFAC_STEP_PARTS)
    dims = [d for lt in kfac.layers for d in (lt.a_dim, lt.g_dim)]
    assert cals["fold"].modelled_s == pytest.approx(sum(lt.fold_s for lt in kfac.layers))
    assert cals["invert:eigen"].modelled_s == pytest.approx(sum(curve_model(kfac.eigen).cost(d) for d in dims))
    assert cals["precondition:inverse"].modelled_s == pytest.approx(
        sum(lt.precondition_inverse_s for lt in kfac.layers))
    assert all(c.measured_s > 0 for c in cals.values())
    # The user's module is left as it was: no hooks, its own weights.
    before = [p.detach().clone() for p in wl.module.parameters()]
    for _ in range(2):
        wl.loss_fn(wl.module(wl.batch()[0]), wl.batch()[1]).backward()
    assert all(torch.equal(a, b) for a, b in zip(before, wl.module.parameters(), strict=True))


def test_a_long_inversion_gets_one_measured_step(cnn_kfac: KFACTiming) -> None:
    kfac = cnn_kfac
    slow = replace(kfac, eigen=kfac.eigen.scaled(1e6))  # minutes per inversion by the curve
    assert kfac_steps_points(slow, 3) == 1 + kfac_steps_points(kfac, 3) // 2


def _steps_worker(rank: int, world_size: int, steps: int = 1) -> dict[str, float]:
    wl = build_workload("cnn", batch_size=8)
    kfac = measure_kfac(wl, CPU, repeats=2, warmup=1)
    cals = measure_kfac_steps_in_situ(wl, CPU, kfac, steps=steps)
    return {part: c.measured_s for part, c in cals.items()}


def test_every_rank_gets_the_same_step_calibrations_from_every_ranks_samples() -> None:

    results = run_warm(_steps_worker, 2)
    assert set(results[0]) == set(KFAC_STEP_PARTS)
    assert results[0] == results[1]  # medians over both ranks' samples


#: Extra seconds rank 1 spends preconditioning in `_slowed_steps_worker`: far above the CNN's own few ms.
SLOWED_PRECONDITION_S = 0.08


def _slowed_steps_worker(rank: int, world_size: int) -> dict[str, float]:
    import time
    from unittest import mock

    from planner.runtime import calibrate

    if rank != 1:
        return _steps_worker(rank, world_size, steps=2)
    # This worker's preconditioning runs slower, as one of two processes on shared cores can: for this case only
    # (the warm worker runs later cases, which must find the runtime as it is).
    original = calibrate._TimedKFAC._precondition

    def slower(self: calibrate._TimedKFAC) -> None:
        original(self)
        self.phase_s["precondition"] = self.phase_s.get("precondition", 0.0) + SLOWED_PRECONDITION_S
        time.sleep(SLOWED_PRECONDITION_S)

    with mock.patch.object(calibrate._TimedKFAC, "_precondition", slower):
        return _steps_worker(rank, world_size, steps=2)


def test_the_step_calibration_takes_each_steps_slowest_rank_as_the_bench_does() -> None:

    results = run_warm(_slowed_steps_worker, 2)
    assert results[0] == results[1]
    # Every step's slowest rank is the slowed one: its preconditioning, not a median pooled with the other rank's
    # (which would come out near half the added time).
    for method in InverseMethod:
        assert results[0][f"precondition:{method.value}"] >= SLOWED_PRECONDITION_S


#: Extra seconds rank 1's passes with the hooks take in `_slowed_hooks_worker`: several times the CNN's own hooks.
SLOWED_HOOKS_S = 0.5


def _slow_hooks_in_this_worker(seconds: float) -> contextlib.AbstractContextManager[Any]:
    """This worker's factor hooks run `seconds` slower per pass, as one of two processes on shared cores can, inside
    the `with` block only (the warm worker runs later cases, which must find the runtime as it is)."""
    import time
    from unittest import mock

    from planner.runtime import calibrate

    original = calibrate._SilentKFAC._forward_hook

    def slower(self: calibrate._SilentKFAC, layer: Any, *args: Any) -> None:
        original(self, layer, *args)
        if layer is self._layers[0]:
            time.sleep(seconds)

    return mock.patch.object(calibrate._SilentKFAC, "_forward_hook", slower)


def _slowed_hooks_worker(rank: int, world_size: int) -> float:
    with _slow_hooks_in_this_worker(SLOWED_HOOKS_S) if rank == 1 else contextlib.nullcontext():
        wl = build_workload("cnn", batch_size=8)
        kfac = measure_kfac(wl, CPU, repeats=2, warmup=1)
        return measure_kfac_in_situ(wl, CPU, kfac, repeats=3).measured_s


def test_the_hooks_calibration_takes_each_pairs_slowest_rank_as_the_bench_does() -> None:

    results = run_warm(_slowed_hooks_worker, 2)
    assert results[0] == results[1]
    # Rank 1's hooked passes are the slowest: the whole added time, not a median pooled with rank 0's samples
    # (about half of it). A little below it where rank 1's plain pass came out faster than rank 0's.
    assert results[0] >= 0.9 * SLOWED_HOOKS_S


#: Extra seconds rank 1's passes with the hooks take in `_extended_hooks_worker`.
EXTENDED_SLOW_S = 0.05


def _extended_hooks_worker(rank: int, world_size: int, cases: list[tuple[float, int]]) -> list[tuple[int, list[int]]]:
    """For each `(min_seconds, max_repeats)` of `cases`, the pairs the hooks calibration measured and the counts
    it extended to, each case on a fresh copy of the CNN (the micro-benchmarks measured once for all of them)."""
    # Rank 1's pairs of passes are the longer ones: the count must come from them.
    with _slow_hooks_in_this_worker(EXTENDED_SLOW_S) if rank == 1 else contextlib.nullcontext():
        kfac = measure_kfac(build_workload("cnn", batch_size=8), CPU, repeats=2, warmup=1)
        found = []
        for min_seconds, max_repeats in cases:
            points: list[int] = []
            totals: list[int] = []
            cal = measure_kfac_in_situ(build_workload("cnn", batch_size=8), CPU, kfac, repeats=2,
                                       min_seconds=min_seconds, max_repeats=max_repeats,
                                       on_point=functools.partial(points.append, 1), on_total=totals.append)
            # A first measurement that was not usable is measured again (as many pairs): count the first one's
            # (the last total is the second one's).
            assert len(points) == cal.attempts * len(cal.samples_s or ())
            found.append((len(cal.samples_s or ()), totals if cal.attempts == 1 else totals[:-1]))
        return found


def test_short_hook_passes_are_measured_for_longer_and_every_rank_as_often() -> None:
    """With `min_seconds`, pairs of passes are added until they span about that long (the slowest rank's
    pair sets the count, or the ranks would pass different numbers of barriers), at most `max_repeats`."""

    results = run_warm(_extended_hooks_worker, 2, [(3.0, 40), (0.0, 40), (1e6, 5)])
    assert results[0] == results[1]
    (count, totals), plain, capped = results[0]
    assert totals == [count]
    # Rank 1's pairs take at least EXTENDED_SLOW_S, so at most 3.0 / 0.05 = 60 of them (and the cap, 40); more than
    # the two asked while a pair takes under 1.5 s, as one of this small CNN does even on a loaded machine (at a
    # span of 0.6 s, a machine busy with other work made two pairs enough).
    assert 2 < count <= 40
    assert plain == (2, [])  # without it, exactly `repeats`
    assert capped == (5, [5])  # capped: at 5 here, the same code as at 40 in an eighth of the passes


def test_slowest_rank_extra_subtracts_the_slowest_plain_pass_from_the_slowest_hooked_one() -> None:
    rank0 = [(5.0, 3.0), (4.0, 3.0)]
    rank1 = [(6.0, 2.0), (4.5, 3.5)]
    assert slowest_rank_extra([rank0, rank1]) == [3.0, 1.0]
    assert slowest_rank_extra([rank0]) == [2.0, 1.0]
    with pytest.raises(ValueError):
        slowest_rank_extra([rank0, rank1[:1]])


def test_slowest_rank_phases_takes_each_steps_rank_with_the_longest_phases_in_all() -> None:
    rank0 = [{"fold": 1.0, "invert": 5.0}, {"fold": 3.0, "invert": 1.0}]
    rank1 = [{"fold": 2.0, "invert": 3.0}, {"fold": 2.0, "invert": 3.0}]
    # Step 0: rank 0 (6 s against 5 s); step 1: rank 1 (5 s against 4 s), whole steps kept together.
    assert slowest_rank_phases([rank0, rank1]) == {"fold": [1.0, 2.0], "invert": [5.0, 3.0]}
    assert slowest_rank_phases([rank0]) == {"fold": [1.0, 3.0], "invert": [5.0, 1.0]}
    with pytest.raises(ValueError):
        slowest_rank_phases([rank0, rank1[:1]])  # ranks with different step counts are a bug, not a statistic


class _Shaped(nn.Module):
    """Tied embedding and output, a frozen Linear and a BatchNorm, a head the loss never uses, and modules
    registered in another order than the forward pass uses them."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(16, 32, bias=False)
        self.unused = nn.Linear(16, 3)
        self.hidden = nn.Linear(16, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.norm = nn.BatchNorm1d(16)
        self.embed = nn.Embedding(32, 16)
        self.out.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.frozen(self.embed(tokens)))
        return self.out(torch.relu(self.hidden(h)))


def test_the_step_calibration_runs_on_a_model_shaped_like_a_real_one() -> None:

    gen = torch.Generator().manual_seed(0)

    def make_batch(n: int, g: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        g = g or gen
        return torch.randint(0, 32, (n,), generator=g), torch.randint(0, 32, (n,), generator=g)

    wl = Workload(name="shaped", module=_Shaped(), batch_size=16, make_batch=make_batch,
                  loss_fn=nn.functional.cross_entropy)
    kfac = measure_kfac(wl, CPU, repeats=2, warmup=1, skip="^unused$")  # the unused head skipped, as profile asks
    assert [lt.name for lt in kfac.layers] == ["hidden"]  # tied and frozen layers keep plain gradients
    cals = measure_kfac_steps_in_situ(wl, CPU, kfac, steps=1)
    assert set(cals) == set(KFAC_STEP_PARTS) and all(c.measured_s > 0 for c in cals.values())
    assert wl.module.out.weight is wl.module.embed.weight  # the user's module is untouched: still tied
