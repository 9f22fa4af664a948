"""A mixed plan's error budget: `--error-budget` read, resolved against the compression errors the profile measured
(`planner.contracts.errors`), turned into the solver's `ErrorBudget`, and the error of the plan it keeps.

A budget is a number (the error itself, the contraction of the whole gradient, 0 for dense) or a compressor, whose
error with every layer sent by it is the budget (`--error-budget powersgd:4`: no more error than PowerSGD rank 4
everywhere, placed where it buys the most time).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from planner.contracts.errors import CompressionErrors
from planner.contracts.plan import Group, PlanError
from planner.contracts.profile import Profile
from planner.costmodel.mixed_simulator import MixedProblem
from planner.solvers.compressor_choice import ErrorBudget
from planner.types import Compressor, CompressorError, InvalidProfileError, PlannerError

__all__ = ["BY_DEFAULT", "DEFAULT_BUDGETS", "BudgetSpec", "default_budget", "parse_error_budget", "plan_error",
           "resolve_budget", "solver_budget", "uniform_error", "within_reach"]

#: `--error-budget` as given: the error itself, or the compressor whose error over the whole gradient it is.
BudgetSpec = float | Compressor

#: The budget `--strategy auto` keeps its plan within unless told otherwise: the error of the first of these that the
#: profile measured, on every layer. Of the uniform settings measured, fp16 everywhere alone trained like dense on both
#: the digits and the character language model at 200 Mbit/s (final loss within 0.5% of DDP's at equal samples);
#: PowerSGD rank 4 did on the digits but ended 12% worse on the text (docs/results/error-budget.md).
DEFAULT_BUDGETS = (Compressor.parse("fp16"),)
#: Stands for "the default budget" where a budget is asked for (`solve_auto`); None stands for no budget.
BY_DEFAULT = "default"


def default_budget(profile: Profile) -> Compressor | None:
    """The default budget's compressor on this profile (`DEFAULT_BUDGETS`), None where it measured no error."""
    if profile.errors is None:
        return None
    return next((c for c in DEFAULT_BUDGETS if profile.errors.has(c)), None)


def parse_error_budget(text: str) -> BudgetSpec | None:
    """`--error-budget`: a number >= 0, a compressor ("powersgd:4", "fp16", "topk:0.01") or none (no budget).

    Raises:
        PlannerError: neither.
    """
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        if not (math.isfinite(value) and value >= 0):
            raise PlannerError(f"--error-budget must be a finite number >= 0 or a compressor, got {text!r}")
        return value
    try:
        return Compressor.parse(text)
    except CompressorError as exc:
        raise PlannerError(f"--error-budget takes a number >= 0 (the error itself) or a compressor whose error over "
                           f"the whole gradient is the budget, such as powersgd:4; {exc}") from None


def measured_errors(profile: Profile) -> CompressionErrors:
    """The profile's compression errors.

    Raises:
        InvalidProfileError: the profile measured none (made before it did, or with no compressor timed).
    """
    if profile.errors is None:
        raise InvalidProfileError("the profile measured no compression error, which an error budget is weighed "
                                  "against; profile again with this planner (`planner profile`)")
    return profile.errors


def resolve_budget(profile: Profile, spec: BudgetSpec) -> tuple[float, Compressor | None]:
    """The budget as a number, and the compressor that set it (None: given as a number).

    Raises:
        InvalidProfileError: no errors in the profile, or none of that compressor.
    """
    if isinstance(spec, Compressor):
        return uniform_error(profile, spec), spec
    measured_errors(profile)
    return float(spec), None


def solver_budget(profile: Profile, problem: MixedProblem, budget: float, of: Compressor | None = None
                  ) -> ErrorBudget:
    """The solver's budget over `problem`'s compressors (a hierarchical way shares its compressor's error). With
    `of`, the compressor whose error on every layer is the budget: that plan fits it (`ErrorBudget.of`'s
    reference) where the problem has it.

    Raises:
        InvalidProfileError: no errors in the profile, or none of one of the problem's compressors.
    """
    errors = measured_errors(profile)
    rows = []
    for c in problem.compressors:
        try:
            rows.append(errors.layer_errors(c.compressor))
        except KeyError as exc:
            raise InvalidProfileError(str(exc.args[0])) from None
    reference = next((i for i, c in enumerate(problem.compressors) if c.compressor == of), None)
    return ErrorBudget.of(np.array(rows), budget, reference=reference)


def plan_error(profile: Profile, groups: Sequence[Group], compressor_of: Sequence[Compressor],
               budget: tuple[float, Compressor | None] | None = None) -> PlanError | None:
    """The error of sending each group by its compressor, with its interval, and the budget it was kept within;
    None where the profile measured no error for one of them (and there was no budget)."""
    if profile.errors is None:
        return None
    per_layer = [c for g, c in zip(groups, compressor_of, strict=True) for _ in g.layers]
    if [n for g in groups for n in g.layers] != list(profile.errors.layers) or not all(
            profile.errors.has(c) for c in per_layer):
        return None
    value, of = budget if budget is not None else (None, None)
    return PlanError(predicted=profile.errors.error_of(per_layer), interval=profile.errors.interval(per_layer),
                     budget=value, budget_of=of)


def uniform_error(profile: Profile, compressor: Compressor) -> float:
    """The error of `compressor` on every layer, as the profile measured it.

    Raises:
        InvalidProfileError: no errors in the profile, or none of `compressor`.
    """
    try:
        return measured_errors(profile).uniform(compressor)
    except KeyError as exc:
        raise InvalidProfileError(str(exc.args[0])) from None


def within_reach(errors: CompressionErrors, compressors: Sequence[Compressor], budget: Compressor
                 ) -> tuple[Compressor, ...]:
    """Those of `compressors` that a plan over them, within `budget`'s error on every layer, can send a layer by:
    sending that layer by it, and every other layer by the compressor of fewest units there, fits the budget, in
    the units the solver keeps its plans within (`solver_budget`: `ErrorBudget.of`, `budget` the reference where it
    is one of `compressors`; a compressor's units depend on its own errors and the reference's only). Any plan that
    sends a layer by a compressor pays at least that, so leaving out the others changes no plan; with the groups
    free (one layer a group) the rest are each in some plan too.

    Raises:
        KeyError: `errors` lacks one of them, or the budget's.
    """
    chosen = tuple(dict.fromkeys(compressors))
    if not chosen:
        return ()
    reference = next((i for i, c in enumerate(chosen) if c == budget), None)
    units = ErrorBudget.of(np.array([errors.layer_errors(c) for c in chosen]), errors.uniform(budget),
                           reference=reference)
    fewest = units.units.min(axis=0)
    rest = int(fewest.sum())
    return tuple(c for c, row in zip(chosen, units.units, strict=True)
                 if int((row - fewest).min()) + rest <= units.budget)
