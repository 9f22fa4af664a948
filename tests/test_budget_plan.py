"""Plans under an error budget: `planner solve --strategy mixed|auto --error-budget`, the plan's recorded error, and
bad input (one clear line, exit 2)."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from planner.commands.cli import main
from planner.commands.printing import print_auto, print_spread
from planner.contracts.errors import CompressionErrors
from planner.contracts.plan import Plan, PlanError
from planner.contracts.profile import Profile
from planner.costmodel.curves import fit_curve
from planner.strategies.auto import solve_auto
from planner.strategies.budget import parse_error_budget
from planner.strategies.intervals import with_intervals
from planner.strategies.mixed_plan import make_mixed_plan, parse_compressors
from planner.types import Collective, Compressor, PlannerError, SchemaError, SolverError
from tests.factories import examples, synthetic_profile, with_samples

#: Contractions by compressor, the same on every layer: what the synthetic profile's errors record says.
CONTRACTION = {"fp16": 4e-8, "powersgd:1": 0.6, "powersgd:2": 0.45, "powersgd:4": 0.3, "topk:0.01": 0.9,
               "topk:0.1": 0.5}


def profile_with_errors(model: str = "cnn", link_beta: float = 1e-7) -> Profile:
    """A synthetic profile behind a slow network (every collective `link_beta` s per byte), with errors: layer l's
    gradient energy l + 1, every compressor's contraction `CONTRACTION` on every layer."""
    base = synthetic_profile(model)
    sizes = [1 << s for s in range(10, 27, 2)]

    slow = fit_curve([(s, 2e-4 + link_beta * s) for s in sizes])
    layers = tuple(lt.name for lt in base.layers)
    grad = np.broadcast_to(np.arange(1.0, len(layers) + 1)[None, :, None], (2, len(layers), 3)).copy()
    errors = CompressionErrors(layers=layers, warmup=1, grad_sq=grad,
                               input_sq={c: grad.copy() for c in CONTRACTION},
                               error_sq={c: grad * w for c, w in CONTRACTION.items()})
    return replace(base, collectives={c: slow for c in Collective}, errors=errors)


def test_mixed_plan_keeps_within_the_budget_and_records_its_error() -> None:
    profile = profile_with_errors()
    allowed = parse_compressors("dense,fp16,powersgd:1,powersgd:4,topk:0.01")
    free = make_mixed_plan(profile, allowed, time_limit_s=None)
    assert free.error is not None and free.error.budget is None
    assert free.error.predicted > 0.3  # a slow network: unbudgeted, the plan sends most of the gradient lossy
    for budget in (0.3, 0.1, 0.0):
        plan = make_mixed_plan(profile, allowed, error_budget=budget, time_limit_s=None)
        assert plan.error is not None and plan.error.budget == budget
        assert plan.error.predicted <= budget + 1e-12
        # the recorded error is the profile's, layer by layer
        per_layer = [plan.compressor_of(g) for g in plan.groups for _ in g.layers]
        assert plan.error.predicted == pytest.approx(profile.errors.error_of(per_layer), rel=1e-12)
        assert plan.predicted.iteration_s >= free.predicted.iteration_s * (1 - 1e-12)
        assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    nothing = make_mixed_plan(profile, allowed, error_budget=0.0, time_limit_s=None)
    assert {str(nothing.compressor_of(g)) for g in nothing.groups} == {"dense"}
    # relative to a uniform setting: PowerSGD rank 4 everywhere is 0.3 here
    relative = make_mixed_plan(profile, allowed, error_budget=Compressor.parse("powersgd:4"), time_limit_s=None)
    assert relative.error is not None and relative.error.budget == pytest.approx(0.3)
    assert str(relative.error.budget_of) == "powersgd:4"
    with pytest.raises(SolverError, match="no plan fits the error budget"):
        make_mixed_plan(profile, parse_compressors("powersgd:1,topk:0.01"), error_budget=0.1, time_limit_s=None)
    # a compressor's own error is a budget it fits, whatever the rounding
    alone = make_mixed_plan(profile, parse_compressors("powersgd:4"), error_budget=Compressor.parse("powersgd:4"),
                            time_limit_s=None)
    assert {str(alone.compressor_of(g)) for g in alone.groups} == {"powersgd:4"}


def test_auto_leaves_out_the_plans_beyond_the_budget() -> None:
    profile = profile_with_errors()
    allowed = parse_compressors("dense,fp16,topk:0.01,topk:0.1")
    free = solve_auto(profile, allowed, weigh_noise=False, time_limit_s=None, error_budget=None)
    assert {"topk at 0.01", "topk at 0.1"} <= set(free.candidates)
    assert all(p.error is not None for p in free.candidates.values())
    within = solve_auto(profile, allowed, weigh_noise=False, error_budget=0.6, time_limit_s=None)
    assert "topk at 0.01" not in within.candidates and "topk at 0.1" in within.candidates  # 0.9 > 0.6 >= 0.5
    assert all(p.error is not None and p.error.predicted <= 0.6 + 1e-12 for p in within.candidates.values())
    assert within.plan.error is not None and within.plan.error.budget == 0.6
    assert within.rule == "rule: fastest within the error budget 0.6; left out beyond it: topk at 0.01 (error 0.9)"
    assert free.rule.startswith("rule: by predicted step alone")
    # By default: fp16's error on every layer (4e-8 here), the one uniform setting that trained like dense.
    default = solve_auto(profile, allowed, weigh_noise=False, time_limit_s=None)
    assert set(default.candidates) == {"dense", "mixed over dense, fp16, topk:0.01, topk:0.1"}
    assert default.plan.error is not None and default.plan.error.budget == pytest.approx(4e-8)
    assert {str(default.plan.compressor_of(g)) for g in default.plan.groups} <= {"dense", "fp16"}
    assert default.rule.startswith("rule: fastest within the default error budget 4e-08 (fp16 on every layer, which "
                                   "trained like dense); left out beyond it: topk at 0.01 (error 0.9), topk at 0.1 "
                                   "(error 0.5)")
    no_fp16 = replace(profile, errors=replace(profile.errors, input_sq={
        c: a for c, a in profile.errors.input_sq.items() if c != "fp16"}, error_sq={
        c: a for c, a in profile.errors.error_sq.items() if c != "fp16"}))
    assert "the profile measured no error of fp16" in solve_auto(no_fp16, allowed, weigh_noise=False,
                                                                 time_limit_s=None).rule
    unmeasured = solve_auto(replace(profile, errors=None), allowed, weigh_noise=False, time_limit_s=None)
    assert "the profile measured no compression error" in unmeasured.rule


def test_the_verdict_weighs_only_the_hooks_within_the_budget(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A plan kept within an error budget is weighed against DDP and the hooks a user holding to that budget would
    run, not against a hook that moves the gradient further (here PowerSGD r1 and top-k 1% beyond PowerSGD r4's
    0.3); the hooks left out are recorded and named in the verdict line. Without a budget every hook is weighed."""
    profile = with_samples(profile_with_errors())
    allowed = parse_compressors("dense,fp16,powersgd:1,powersgd:4,topk:0.01")
    hooks = {"ddp+fp16", "ddp+powersgd:1", "ddp+powersgd:4", "ddp+topk:0.01"}
    free = solve_auto(profile, allowed, error_budget=None, time_limit_s=None)
    assert free.plan.verdict is not None
    assert set(free.plan.verdict.variants) == {"ddp", *hooks} and free.plan.verdict.beyond_budget == ()
    for budget, left_out in (("powersgd:4", ("ddp+powersgd:1", "ddp+topk:0.01")),
                             ("fp16", ("ddp+powersgd:1", "ddp+powersgd:4", "ddp+topk:0.01"))):
        within = solve_auto(profile, allowed, error_budget=Compressor.parse(budget), time_limit_s=None)
        for plan in within.candidates.values():  # every hook predicted, those beyond the budget not weighed
            assert plan.verdict is not None and plan.verdict.beyond_budget == left_out
            assert set(plan.verdict.variants) == {"ddp", *hooks}
            assert plan.verdict.against not in left_out and plan.verdict.keep not in left_out
        assert Plan.from_dict(json.loads(json.dumps(within.plan.to_dict()))) == within.plan
        assert within.beyond_budget == left_out
        print_auto(within)
        table = capsys.readouterr().out
        assert all(f"{name}" in table for name in left_out) and "beyond the error budget: not weighed" in table
        # the same verdict for the mixed plan solved alone, and its line names the hooks left out
        mixed = with_intervals(make_mixed_plan(profile, allowed, error_budget=Compressor.parse(budget),
                                               time_limit_s=None), profile)
        assert mixed.verdict is not None and mixed.verdict.beyond_budget == left_out
        print_spread(mixed)
        line = " ".join(capsys.readouterr().out.split())
        assert f"not weighed against {', '.join(left_out)}: beyond the error budget" in line
    # a plan file whose verdict was weighed against a hook it says it left out is refused
    data = within.plan.to_dict()
    data["predicted"]["verdict"]["beyond_budget"] = [data["predicted"]["verdict"]["against"]]
    with pytest.raises(SchemaError, match="which is not among the variants weighed"):
        Plan.from_dict(data)
    data["predicted"]["verdict"]["beyond_budget"] = ["ddp+powersgd:2"]
    with pytest.raises(SchemaError, match="beyond_budget must name DDP hooks among its variants"):
        Plan.from_dict(data)


def test_cli_error_budget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "profile.json"
    profile_with_errors().save(prof)
    out = tmp_path / "plan.json"
    assert main(["solve", str(prof), "--strategy", "mixed", "--compressors", "all", "--error-budget", "powersgd:4",
                 "-o", str(out)]) == 0
    assert "within the budget 0.3: powersgd:4 on every layer" in capsys.readouterr().out
    plan = Plan.load(out)
    assert plan.error is not None and plan.error.predicted <= 0.3 + 1e-12
    assert main(["show", str(out)]) == 0
    assert "within the budget 0.3" in capsys.readouterr().out
    assert main(["show", str(prof)]) == 0
    assert "compression error" in capsys.readouterr().out
    assert main(["show", str(prof), "--details"]) == 0
    assert "compression error per layer" in capsys.readouterr().out
    # auto keeps its plan within the default budget unless told none
    assert main(["solve", str(prof), "--strategy", "auto", "--compressors", "all", "-o", str(out)]) == 0
    assert "rule: fastest within the default error budget 4e-08 (fp16 on every layer" in capsys.readouterr().out
    assert main(["solve", str(prof), "--strategy", "auto", "--compressors", "all", "--error-budget", "none", "-o",
                 str(out)]) == 0
    assert "rule: by predicted step alone" in capsys.readouterr().out
    # a budget named by a compressor allows it where --compressors is not given (light, and the budget's own)
    for strategy in ("mixed", "auto"):
        assert main(["solve", str(prof), "--strategy", strategy, "--error-budget", "powersgd:4", "-o", str(out)]) == 0
        assert Plan.load(out).compressors == parse_compressors("dense,fp16,powersgd:4")
    capsys.readouterr()


@pytest.mark.parametrize(("argv", "message"), [
    (["--strategy", "dense", "--error-budget", "0.1"], "--error-budget applies to --strategy mixed and auto only"),
    (["--strategy", "mixed", "--error-budget", "-1"], "finite number >= 0"),
    (["--strategy", "mixed", "--error-budget", "nan"], "finite number >= 0"),
    (["--strategy", "mixed", "--error-budget", "zip:3"], "a number >= 0 (the error itself) or a compressor"),
    (["--strategy", "mixed", "--compressors", "dense,fp16", "--error-budget", "topk:0.001"],
     "measured no compression error for topk:0.001"),
    (["--strategy", "mixed", "--compressors", "powersgd:1", "--error-budget", "0.1"], "no plan fits the error budget"),
])
def test_cli_bad_budgets_give_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                       message: str) -> None:
    prof = tmp_path / "profile.json"
    profile_with_errors().save(prof)
    assert main(["solve", str(prof), *argv, "-o", str(tmp_path / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_profile_without_errors_refuses_a_budget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "profile.json"
    synthetic_profile("mlp").save(prof)
    assert main(["solve", str(prof), "--strategy", "mixed", "--error-budget", "0.1", "-o",
                 str(tmp_path / "plan.json")]) == 2
    assert "measured no compression error" in capsys.readouterr().err
    assert not (tmp_path / "plan.json").exists()


def test_parse_error_budget_and_plan_error_record() -> None:
    assert parse_error_budget("0.25") == 0.25 and parse_error_budget("powersgd:4") == Compressor.parse("powersgd:4")
    with pytest.raises(PlannerError):
        parse_error_budget("inf")
    for bad, message in (({"predicted": -1.0, "interval": [0, 1], "budget": None, "budget_of": None}, ">= 0"),
                         ({"predicted": 0.1, "interval": [0.2, 0.1], "budget": None, "budget_of": None}, "[low, high]"),
                         ({"predicted": 0.1, "interval": [0.1], "budget": None, "budget_of": None}, "[low, high]"),
                         ({"predicted": 0.1, "interval": [0, 1], "budget": None, "budget_of": "fp16"},
                          "there is no budget"),
                         ({"predicted": 0.1, "interval": [0, 1], "budget": 0.2}, "budget_of")):
        with pytest.raises(SchemaError, match=message):
            PlanError.from_dict(bad)


def test_retune_keeps_the_error_budget() -> None:
    from planner.strategies.retune_plan import retune_plan

    profile = profile_with_errors()
    allowed = parse_compressors("dense,fp16,powersgd:1,powersgd:4,topk:0.01")
    plan = make_mixed_plan(profile, allowed, error_budget=Compressor.parse("powersgd:4"), time_limit_s=None)
    # a faster network: the same budget, and the plan re-solved within it
    again = retune_plan(plan, profile_with_errors(link_beta=1e-9), cluster=profile.cluster)
    assert again.error is not None and again.error.budget == pytest.approx(0.3)
    assert str(again.error.budget_of) == "powersgd:4" and again.error.predicted <= 0.3 + 1e-12


@pytest.mark.parametrize("budget", [None, 0.3, 0.05])
def test_the_plan_alone_is_the_plan_with_its_rows(budget: float | None) -> None:
    """`rows=False` (a re-plan in training) solves the same plan without the rows beside it; with the grouping
    fixed, each group's compressor is chosen again and the groups stay."""
    from planner.contracts.layers import plan_grouping

    profile = profile_with_errors()
    allowed = parse_compressors("dense,fp16,powersgd:1,powersgd:4")
    full = make_mixed_plan(profile, allowed, error_budget=budget, time_limit_s=None)
    alone = make_mixed_plan(profile, allowed, error_budget=budget, time_limit_s=None, rows=False)
    assert alone.baselines == {} and "ddp" in full.baselines
    assert [(g.params, full.compressor_of(g)) for g in full.groups] == \
        [(g.params, alone.compressor_of(g)) for g in alone.groups]
    assert alone.predicted.iteration_s == pytest.approx(full.predicted.iteration_s, rel=1e-12)
    assert alone.optimal and alone.lower_bound_s <= alone.predicted.iteration_s * (1 + 1e-12)
    assert alone.error == full.error
    # the grouping of an all-fp16 plan kept: the same groups, each compressor chosen again within the budget
    fp16 = make_mixed_plan(profile, parse_compressors("fp16"), time_limit_s=None)
    kept = make_mixed_plan(profile, allowed, error_budget=budget, time_limit_s=None, rows=False,
                           grouping=plan_grouping(fp16, profile))
    assert [g.params for g in kept.groups] == [g.params for g in fp16.groups]
    assert kept.predicted.iteration_s >= full.predicted.iteration_s * (1 - 1e-12)
    if budget is not None:
        assert kept.error is not None and kept.error.predicted <= budget + 1e-12


def random_errors(rng: np.random.Generator, layers: int, compressors: list[str]) -> CompressionErrors:
    """Errors of `compressors` on `layers` layers: random gradient energy per layer, random contractions (a few
    compressors far beyond the others, as top-k is beyond fp16)."""
    names = tuple(f"layer{i}" for i in range(layers))
    grad = np.broadcast_to(rng.uniform(0.1, 10, layers)[None, :, None], (2, layers, 3)).copy()
    scale = {c: 10.0 ** rng.uniform(-8, 0) for c in compressors}
    return CompressionErrors(layers=names, warmup=1, grad_sq=grad, input_sq={c: grad.copy() for c in compressors},
                             error_sq={c: grad * rng.uniform(0.2, 1, layers)[None, :, None] * scale[c]
                                       for c in compressors})


@pytest.mark.parametrize("seed", range(examples(12)))
def test_within_reach_is_exact_against_brute_force(seed: int) -> None:
    """A compressor is within reach of the budget exactly when some plan within the budget, in the solver's own
    units, sends a layer by it: every assignment of compressors to layers (one layer a group) enumerated."""
    from planner.solvers.compressor_choice import ErrorBudget
    from planner.strategies.budget import within_reach

    rng = np.random.default_rng(seed)
    layers = int(rng.integers(1, 5))
    lossy = ["fp16", "powersgd:1", "powersgd:4", "topk:0.01"][: int(rng.integers(2, 5))]
    errors = random_errors(rng, layers, lossy)
    chosen = [Compressor.parse(c) for c in (["dense"] if rng.random() < 0.5 else []) + lossy]
    budget = Compressor.parse(str(rng.choice(lossy)))
    units = ErrorBudget.of(np.array([errors.layer_errors(c) for c in chosen]), errors.uniform(budget),
                           reference=chosen.index(budget))
    used: set[Compressor] = set()
    for choice in itertools.product(range(len(chosen)), repeat=layers):
        if units.of_solution(tuple(range(1, layers + 1)), choice) <= units.budget:
            used.update(chosen[c] for c in choice)
    assert set(within_reach(errors, chosen, budget)) == used
    assert budget in used  # a budget fits itself


@pytest.mark.parametrize("seed", range(examples(4)))
def test_leaving_out_what_is_beyond_reach_changes_no_plan(seed: int) -> None:
    """The mixed plan within a budget, solved over every compressor and over those within reach alone: the same."""
    from planner.strategies.budget import within_reach

    rng = np.random.default_rng(seed)
    base = profile_with_errors()
    lossy = list(CONTRACTION)
    errors = random_errors(rng, len(base.layers), lossy)
    profile = replace(base, errors=replace(errors, layers=tuple(lt.name for lt in base.layers)))
    allowed = parse_compressors("dense," + ",".join(lossy))
    budget = min(allowed[1:], key=profile.errors.uniform)  # the least: some beyond it
    reach = within_reach(profile.errors, allowed, budget)
    assert len(reach) < len(allowed)  # the instances leave some out (seeded)
    full = make_mixed_plan(profile, allowed, error_budget=budget, time_limit_s=None, rows=False)
    narrow = make_mixed_plan(profile, reach, error_budget=budget, time_limit_s=None, rows=False)
    assert [(g.params, full.compressor_of(g)) for g in full.groups] == \
        [(g.params, narrow.compressor_of(g)) for g in narrow.groups]
    assert narrow.predicted.iteration_s == pytest.approx(full.predicted.iteration_s, rel=1e-12)


def test_a_profile_made_for_plans_without_top_k_leaves_it_out() -> None:
    """`planner demo`'s scope: top-k is left out where no top-k compressor it solves over can fit the budget (fp16's
    error is far below top-k's on every layer), or it solves over none; a solve asking for top-k then says why."""
    from planner.commands.printing import profile_summary
    from planner.contracts.profile import TopkLeftOut
    from planner.sessions.profile import PlanScope, topk_left_out
    from planner.strategies.gradients import make_plan
    from planner.types import InvalidProfileError, Strategy

    profile = profile_with_errors()
    every = parse_compressors("dense,fp16,powersgd:4,topk:0.01,topk:0.1")
    fp16, topk = Compressor.parse("fp16"), parse_compressors("topk:0.01,topk:0.1")
    assert topk_left_out(PlanScope(every, fp16), profile.errors) == TopkLeftOut(compressors=topk, budget=fp16)
    assert topk_left_out(PlanScope(parse_compressors("light"), fp16), profile.errors) == \
        TopkLeftOut(compressors=(), budget=None)
    # within reach, no budget, or nothing measured to decide from: timed
    assert topk_left_out(PlanScope(every, Compressor.parse("topk:0.1")), profile.errors) is None
    assert topk_left_out(PlanScope(every, None), profile.errors) is None
    assert topk_left_out(PlanScope(every, fp16), None) is None
    assert topk_left_out(PlanScope((*every, Compressor.parse("topk:0.5")), fp16), profile.errors) is None
    left = TopkLeftOut(compressors=topk, budget=fp16)
    without = replace(profile, topk=None, topk_left_out=left)
    loaded = Profile.from_dict(json.loads(json.dumps(without.to_dict())))
    assert loaded.topk_left_out == left and "topk_left_out" not in profile.to_dict()
    assert profile_summary(loaded)[-1] == ("top-k not timed: the profile left top-k out: topk:0.01, topk:0.1 cannot "
                                           "fit the error budget it was made for (fp16's error on every layer), not "
                                           "even on one layer")
    with pytest.raises(InvalidProfileError, match="topk:0.01, topk:0.1 cannot fit the error budget it was made for "
                                                  r"\(fp16's error on every layer\).*profile again"):
        make_plan(loaded, Strategy.TOPK, 0.01)
    with pytest.raises(InvalidProfileError, match=r"cannot fit the error budget.*cannot plan topk:0\.01"):
        make_mixed_plan(loaded, every, time_limit_s=None)
    # the plans within the budget need no top-k timings
    assert make_mixed_plan(loaded, parse_compressors("dense,fp16,powersgd:4"), error_budget=fp16,
                           time_limit_s=None).error is not None
    with pytest.raises(InvalidProfileError, match=r"left out, but profile\.topk holds"):
        replace(profile, topk_left_out=left)
    with pytest.raises(SchemaError, match="top-k compressors only"):
        TopkLeftOut(compressors=(fp16,), budget=fp16)
