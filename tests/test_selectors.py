"""The top-k selectors: one conformance suite for every selector, and the selector through profile, plan,
solve, CLI and the DDP hook state."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import planner.kernels.topk as compress
from planner.commands.cli import main
from planner.contracts.plan import SELECTORS as PLAN_SELECTORS
from planner.contracts.plan import Plan
from planner.contracts.profile import Profile, TopkTiming
from planner.costmodel.curves import curve_model, decode_model, select_model
from planner.costmodel.from_profile import gradient_problem
from planner.kernels.topk import SELECTORS, select_topk
from planner.models import build_workload
from planner.profilers.topk import measure_topk
from planner.runtime.ddp_hooks import TopkHookState
from planner.sessions.bench import per_layer_plan
from planner.strategies.gradients import make_plan
from planner.strategies.retune_plan import retune_plan
from planner.types import InvalidProfileError, SchemaError, Strategy
from tests.factories import examples, synthetic_profile
from tests.pool import run_warm
from tests.test_contracts import _main, _one_clear_line

# -- the selectors ---------------------------------------------------------------------------------------------


@contextmanager
def sampling_everywhere(**overrides: Any) -> Iterator[None]:
    """Run the sampled selector's own path on tiny inputs too (and override its other knobs)."""
    knobs = {"_SAMPLED_MIN_NUMEL": 1, **overrides}
    with mock.patch.multiple(compress, **knobs):
        yield


def _tensor(kind: str, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    match kind:
        case "normal":
            return torch.randn(n, generator=gen)
        case "ties":  # every magnitude equal, random signs
            return torch.randint(0, 2, (n,), generator=gen).float().mul_(2).sub_(1)
        case "few-levels":  # many ties at a handful of magnitudes
            return torch.randint(-3, 4, (n,), generator=gen).float()
        case "zeros":
            return torch.zeros(n)
        case "sparse":  # mostly zeros, a few values
            x = torch.zeros(n)
            x[torch.randint(0, n, (max(1, n // 50),), generator=gen)] = torch.randn(max(1, n // 50), generator=gen)
            return x
        case "outliers":  # a few huge entries over small noise
            x = torch.randn(n, generator=gen).mul_(1e-3)
            x[torch.randint(0, n, (min(n, 5),), generator=gen)] = torch.tensor([1e6, -3e5, 7e4, -1e4, 2e3])[: min(n, 5)]
            return x
        case _:
            raise AssertionError(kind)


def check_selection(grad: torch.Tensor, residual: torch.Tensor | None, k: int, selector: str) -> None:
    """The contract every selector meets: exactly k unique in-range int32 indices, the accumulator's values,
    nothing lost to error feedback, and the k largest magnitudes."""
    acc = grad if residual is None else grad + residual
    grad_before = grad.clone()
    values, indices = select_topk(grad, residual, k, selector=selector)
    assert indices.dtype == torch.int32 and values.dtype == torch.float32
    assert indices.shape == (k,) and values.shape == (k,)
    idx = indices.long()
    assert idx.unique().numel() == k
    assert int(idx.min()) >= 0 and int(idx.max()) < grad.numel()
    assert torch.equal(values, acc[idx])
    assert torch.equal(grad, grad_before)  # grad is only read
    left = acc.clone() if residual is None else residual
    if residual is not None:
        assert torch.equal(residual[idx], torch.zeros(k))
        rebuilt = residual.clone()
        rebuilt[idx] += values  # sent + what stays == accumulated, bit for bit
        assert torch.equal(rebuilt, acc)
    else:
        left[idx] = 0
    assert values.abs().min() >= left.abs().max()  # the k largest magnitudes (up to ties)


KINDS = ["normal", "ties", "few-levels", "zeros", "sparse", "outliers"]


@pytest.mark.parametrize("selector", SELECTORS)
@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(KINDS),
    n=st.integers(1, 3000),
    frac=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
    with_residual=st.booleans(),
    block=st.sampled_from([8, 13, 64, 1 << 18]),
)
def test_selector_contract(selector: str, kind: str, n: int, frac: float, seed: int, with_residual: bool,
                           block: int) -> None:
    k = max(1, min(n, round(frac * n)))
    grad = _tensor(kind, n, seed)
    residual = _tensor("normal", n, seed + 1).mul_(0.5) if with_residual else None
    with sampling_everywhere(_SCAN_BLOCK=block):
        check_selection(grad, residual, k, selector)


@pytest.mark.parametrize("selector", SELECTORS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("n", "k"), [(1, 1), (2, 1), (7, 7), (7, 3), (70_000, 1), (70_000, 70_000), (70_000, 700),
                                      (100_003, 1000)])
def test_selector_edge_cases(selector: str, kind: str, n: int, k: int) -> None:
    """k == 1, k == numel, tiny numel, ties, zeros and outliers, at the real sampling threshold."""
    check_selection(_tensor(kind, n, 3), _tensor("normal", n, 4), k, selector)


@pytest.mark.parametrize("sigmas", [(-5.0,), (-5.0, 10.0), (-5.0, -5.0, -5.0)])
def test_sampled_under_selection_retries_then_falls_back(sigmas: tuple[float, ...]) -> None:
    """A threshold that finds fewer than k candidates is lowered, then exact topk takes over: still exact."""
    grad = _tensor("normal", 80_000, 5)
    with mock.patch.object(compress, "_OVERSELECT_SIGMAS", sigmas):
        check_selection(grad, torch.zeros(80_000), 800, "sampled")


def test_sampled_path_runs_above_its_cutoff() -> None:
    """Above `_SAMPLED_MIN_NUMEL` the threshold path answers; all-zero input and tiny inputs go to exact."""
    n = compress._SAMPLED_MIN_NUMEL + 5
    picked = compress._sampled_topk(_tensor("normal", n, 1), n // 100)
    assert picked is not None and picked[1].numel() == n // 100
    assert compress._sampled_topk(_tensor("ties", n, 1), n // 100) is not None
    assert compress._sampled_topk(torch.zeros(n), n // 100) is None
    assert compress._sampled_topk(_tensor("normal", 1000, 1), 10) is None


def test_sampled_picks_the_exact_set_at_scale() -> None:
    """Distinct magnitudes: the sampled selection is the true top-k (recall 1), with the same values."""
    grad, residual = _tensor("normal", 1_000_000, 6), _tensor("normal", 1_000_000, 7)
    res_exact, res_sampled = residual.clone(), residual.clone()
    v_exact, i_exact = select_topk(grad, res_exact, 10_000, selector="exact")
    v_sampled, i_sampled = select_topk(grad, res_sampled, 10_000, selector="sampled")
    order_e, order_s = i_exact.argsort(), i_sampled.argsort()
    assert torch.equal(i_exact[order_e], i_sampled[order_s])
    assert torch.equal(v_exact[order_e], v_sampled[order_s])
    assert torch.equal(res_exact, res_sampled)


def test_error_feedback_over_steps_is_the_same_for_both_selectors() -> None:
    grads = [_tensor("normal", 80_000, s) for s in range(4)]
    residuals = {s: torch.zeros(80_000) for s in SELECTORS}
    for g in grads:
        sent = {}
        for s in SELECTORS:
            v, i = select_topk(g, residuals[s], 800, selector=s)
            sent[s] = torch.zeros(80_000).index_put_((i.long(),), v)
        assert torch.equal(sent["exact"], sent["sampled"])
    assert torch.equal(residuals["exact"], residuals["sampled"])


def test_unknown_selector_is_one_clear_value_error() -> None:
    with pytest.raises(ValueError, match="unknown top-k selector 'fast'; valid selectors: exact, sampled") as info:
        select_topk(torch.zeros(4), None, 1, selector="fast")
    assert "\n" not in str(info.value)


def test_runtime_and_planner_name_the_same_selectors() -> None:
    assert SELECTORS == PLAN_SELECTORS == ("exact", "sampled")


# -- the DDP hook state ------------------------------------------------------------------------------------------


def test_hook_state_keeps_and_checks_its_selector() -> None:
    state = TopkHookState(0.01, selector="sampled")
    saved = state.state_dict()
    assert saved["selector"] == "sampled"
    fresh = TopkHookState(0.5)
    assert fresh.selector == "exact"
    fresh.load_state_dict(saved)
    assert fresh.selector == "sampled" and fresh.density == 0.01
    old = {k: v for k, v in saved.items() if k != "selector"}  # saved before the selector was recorded
    fresh.load_state_dict(old)
    assert fresh.selector == "exact"
    with pytest.raises(ValueError, match="unknown top-k selector 'fast'"):
        TopkHookState(0.01, selector="fast")
    with pytest.raises(ValueError, match="unknown top-k selector 'fast'"):
        fresh.load_state_dict({**saved, "selector": "fast"})


def _hook_selectors_worker(rank: int, world_size: int) -> int:
    """DDP with the top-k hook: the sampled selector's gradients and residuals equal the exact one's."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from planner.runtime.ddp_hooks import topk_hook

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 256), nn.Tanh(), nn.Linear(256, 10))  # one bucket of 134k elements
    states = {s: TopkHookState(0.01, selector=s) for s in SELECTORS}
    ddps = {}
    for s, state in states.items():
        ddps[s] = DistributedDataParallel(copy.deepcopy(model))
        ddps[s].register_comm_hook(state, topk_hook)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(4):
        x = torch.randn(32, 512, generator=gen)
        for m in ddps.values():
            m.zero_grad()
            m(x).pow(2).sum().backward()
        for (_, pe), (_, ps) in zip(ddps["exact"].named_parameters(), ddps["sampled"].named_parameters(), strict=True):
            assert pe.grad is not None and ps.grad is not None and torch.equal(pe.grad, ps.grad)
    assert states["sampled"].residuals.keys() == states["exact"].residuals.keys()
    for i, r in states["exact"].residuals.items():
        assert torch.equal(r, states["sampled"].residuals[i])
    return max(r.numel() for r in states["sampled"].residuals.values())


def test_ddp_hook_with_the_sampled_selector_matches_exact() -> None:

    sizes = run_warm(_hook_selectors_worker, 2)
    assert all(n >= compress._SAMPLED_MIN_NUMEL for n in sizes)  # the sampled path ran


# -- profile ---------------------------------------------------------------------------------------------------


def with_sampled(profile: Profile, factor: float) -> Profile:
    """The profile with sampled-selector points at `factor` times the exact ones."""
    assert profile.topk is not None
    sampled = tuple((n, d, t * factor) for n, d, t in profile.topk.select)
    return replace(profile, topk=replace(profile.topk, select_sampled=sampled))


def test_profile_round_trip_with_selector_points(tmp_path: Path) -> None:
    profile = with_sampled(synthetic_profile("mlp"), 0.1)
    path = tmp_path / "p.json"
    profile.save(path)
    loaded = Profile.load(path)
    assert loaded == profile
    assert loaded.topk is not None and loaded.topk.selectors() == ["exact", "sampled"]
    exact, sampled = select_model(loaded.topk, 0.01, "exact"), select_model(loaded.topk, 0.01, "sampled")
    assert sampled.cost(1e5) == pytest.approx(0.1 * exact.cost(1e5))
    assert select_model(loaded.topk, 0.01).cost(1e5) == exact.cost(1e5)
    problem = gradient_problem(loaded, Strategy.TOPK, 0.01, selector="sampled")
    assert problem.select is not None and problem.select.cost(1e5) == pytest.approx(sampled.cost(1e5))


def test_old_profile_without_sampled_points_loads_as_exact_only(tmp_path: Path) -> None:
    doc = synthetic_profile("mlp").to_dict()
    del doc["topk"]["select_sampled"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    loaded = Profile.load(path)
    assert loaded.topk is not None and loaded.topk.selectors() == ["exact"] and loaded.topk.select_sampled == ()
    with pytest.raises(InvalidProfileError, match="no top-k selection points for the sampled selector"):
        gradient_problem(loaded, Strategy.TOPK, 0.01, selector="sampled")
    with pytest.raises(SchemaError, match="must be one of exact, sampled, but got 'fast'"):
        gradient_problem(loaded, Strategy.TOPK, 0.01, selector="fast")


def test_profile_rejects_bad_sampled_points(tmp_path: Path) -> None:
    doc = synthetic_profile("mlp").to_dict()
    doc["topk"]["select_sampled"] = [[1024, 0.01]]
    with pytest.raises(SchemaError, match=r"profile.topk.select_sampled\[0\] must be \[numel, density, seconds\]"):
        Profile.from_dict(doc)


def test_scaled_topk_timing_scales_every_selector() -> None:
    profile = with_sampled(synthetic_profile("mlp"), 0.5)
    assert profile.topk is not None
    fast = profile.topk.scaled(0.1)
    for s in SELECTORS:
        assert [t for *_, t in fast.points(s)] == pytest.approx([0.1 * t for *_, t in profile.topk.points(s)])
    assert fast.decode == profile.topk.decode


def test_measure_topk_times_every_selector() -> None:
    calls = []
    timing = measure_topk([1024, 40_000], [0.01, 0.1], 2, torch.device("cpu"), repeats=1, warmup=0,
                          on_point=lambda: calls.append(1))
    assert isinstance(timing, TopkTiming) and timing.selectors() == ["exact", "sampled"]
    for s in SELECTORS:
        assert [(n, d) for n, d, _ in timing.points(s)] == [(1024, 0.01), (1024, 0.1), (40_000, 0.01), (40_000, 0.1)]
    assert len(calls) == 2 * 2  # once per (size, density)
    # Decode at every density, of the P * k values two ranks send; the affine fit at the density nearest 1%.
    assert [(x, d) for x, d, _ in timing.decode_points] == [(2 * 11, 0.01), (2 * 103, 0.1), (2 * 400, 0.01),
                                                            (2 * 4000, 0.1)]
    assert [x for x, _ in timing.decode.points] == [22, 800]


def _with_decode_points(profile: Profile) -> Profile:
    """Decode at 1% and 10%, the 10% decodes twice as slow at equal P * k (more zeroing per value at 1%
    would make it the other way round; what matters is that the density is read)."""
    assert profile.topk is not None
    points = tuple((x, d, (1 + (d == 0.1)) * (1e-5 + 1e-9 * x)) for x in (100, 10_000, 1_000_000) for d in (0.01, 0.1))
    return replace(profile, topk=replace(profile.topk, decode_points=points))


def test_decode_model_reads_the_density(tmp_path: Path) -> None:
    profile = _with_decode_points(synthetic_profile("mlp"))
    path = tmp_path / "p.json"
    profile.save(path)
    loaded = Profile.load(path)
    assert loaded == profile and loaded.topk is not None
    at = {d: decode_model(loaded.topk, d).cost(10_000) for d in (0.001, 0.01, 0.0316, 0.1, 0.5)}
    assert at[0.01] == pytest.approx(2e-5) and at[0.1] == pytest.approx(4e-5)
    assert at[0.001] == at[0.01] and at[0.5] == at[0.1]  # the nearest measured density outside the range
    assert at[0.0316] == pytest.approx(2e-5 * (1 + math.log(3.16) / math.log(10)), rel=1e-3)  # log-interpolated
    problem = gradient_problem(loaded, Strategy.TOPK, 0.1)
    assert problem.decode is not None and problem.decode.cost(10_000) == pytest.approx(4e-5)


def test_old_profile_without_decode_points_decodes_with_the_one_percent_curve(tmp_path: Path) -> None:
    doc = synthetic_profile("mlp").to_dict()
    del doc["topk"]["decode_points"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    loaded = Profile.load(path)
    assert loaded.topk is not None and loaded.topk.decode_points == ()
    for density in (0.01, 0.1):
        decode = gradient_problem(loaded, Strategy.TOPK, density).decode
        assert decode is not None and decode.cost(5000) == curve_model(loaded.topk.decode).cost(5000)


def test_profile_rejects_bad_decode_points() -> None:
    doc = synthetic_profile("mlp").to_dict()
    doc["topk"]["decode_points"] = [[100, 1.5, 1e-5]]
    with pytest.raises(InvalidProfileError, match=r"decode_points\[0\]: `values > 0 and 0 < density <= 1`"):
        Profile.from_dict(doc)


# -- plan, solve, CLI ----------------------------------------------------------------------------------------------


def test_plan_round_trip_with_selector(tmp_path: Path) -> None:
    plan = make_plan(with_sampled(synthetic_profile("mlp"), 0.1), Strategy.TOPK, 0.01, selector="sampled")
    assert plan.selector == "sampled"
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    dense = make_plan(synthetic_profile("mlp"), Strategy.DENSE)
    assert dense.selector is None and dense.to_dict()["selector"] is None
    assert Plan.from_dict(dense.to_dict()) == dense


def test_old_plan_without_selector_loads_as_exact() -> None:
    doc = make_plan(synthetic_profile("mlp"), Strategy.TOPK, 0.01).to_dict()
    del doc["selector"]
    assert Plan.from_dict(doc).selector == "exact"


@pytest.mark.parametrize(
    ("strategy", "selector", "message"),
    [
        ("topk", "fast", "plan.selector must be one of exact, sampled, but got 'fast'"),
        ("topk", 3, "plan.selector must be one of exact, sampled, but got 3"),
        ("dense", "exact", "only a plan with top-k groups has a selector"),
    ],
)
def test_plan_rejects_bad_selectors(strategy: str, selector: object, message: str) -> None:
    density = 0.01 if strategy == "topk" else None
    doc = make_plan(synthetic_profile("mlp"), Strategy(strategy), density).to_dict()
    with pytest.raises(SchemaError, match=message) as info:
        Plan.from_dict({**doc, "selector": selector})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("factor", "expected"), [(0.05, "sampled"), (20.0, "exact")])
def test_auto_selector_keeps_the_faster_plan(factor: float, expected: str) -> None:
    profile = with_sampled(synthetic_profile("resnet18"), factor)
    auto = make_plan(profile, Strategy.TOPK, 0.01)
    forced = {s: make_plan(profile, Strategy.TOPK, 0.01, selector=s) for s in SELECTORS}
    assert forced[expected].predicted.iteration_s < min(p.predicted.iteration_s for p in forced.values()
                                                         if p is not forced[expected])
    assert auto.selector == expected
    chosen = forced[expected]
    # solved, and its baselines and lower bound evaluated, under the chosen selector's costs
    assert (auto.groups, auto.predicted, auto.baselines, auto.lower_bound_s) == (
        chosen.groups, chosen.predicted, chosen.baselines, chosen.lower_bound_s)


def test_auto_selector_on_an_exact_only_profile_is_exact() -> None:
    plan = make_plan(synthetic_profile("mlp"), Strategy.TOPK, 0.01)
    assert plan.selector == "exact"
    with pytest.raises(InvalidProfileError, match="sampled selector"):
        make_plan(synthetic_profile("mlp"), Strategy.TOPK, 0.01, selector="sampled")
    with pytest.raises(SchemaError, match="selector applies to top-k plans only"):
        make_plan(synthetic_profile("mlp"), Strategy.DENSE, selector="exact")


def test_per_layer_and_retuned_plans_keep_the_selector() -> None:
    profile = with_sampled(synthetic_profile("mlp"), 2.0)
    plan = make_plan(profile, Strategy.TOPK, 0.01, selector="sampled")
    assert per_layer_plan(plan, build_workload("mlp").module).selector == "sampled"
    assert retune_plan(plan, profile, cluster=profile.cluster).selector == "sampled"


def test_cli_solve_with_a_selector(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof, out = tmp_path / "prof.json", tmp_path / "plan.json"
    with_sampled(synthetic_profile("mlp"), 20.0).save(prof)
    assert main(["solve", str(prof), "--strategy", "topk", "--selector", "sampled", "-o", str(out)]) == 0
    assert Plan.load(out).selector == "sampled"
    assert "density 0.01, sampled selector" in capsys.readouterr().out
    assert main(["solve", str(prof), "--strategy", "topk", "-o", str(out)]) == 0  # auto
    assert Plan.load(out).selector == "exact"
    assert main(["show", str(out)]) == 0
    assert "exact selector" in capsys.readouterr().out


def test_cli_bad_selector_gives_one_line(tmp_path: Path) -> None:
    prof, out = tmp_path / "prof.json", tmp_path / "plan.json"
    synthetic_profile("mlp").save(prof)
    _one_clear_line(_main("solve", str(prof), "--strategy", "topk", "--selector", "fast", "-o", str(out)),
                    "--selector must be one of auto, exact, sampled, but got 'fast'")
    _one_clear_line(_main("solve", str(prof), "--selector", "exact", "-o", str(out)),
                    "--selector applies to top-k plans only")
    _one_clear_line(_main("solve", str(prof), "--strategy", "topk", "--selector", "sampled", "-o", str(out)),
                    "no top-k selection points for the sampled selector")
    assert not out.exists()
