"""`planner tune`: an optuna study that measures real training steps for what the cost model cannot settle.

The cost model is never exact: the fitted collective costs can be off on the real job, and some settings
(group-size bounds, top-k density, K-FAC update intervals) trade things the model does not see. The tuner
searches, within ranges the user allows (`TuneSpace`):

- corrections to the fitted collective costs, alpha * alpha_scale + beta * beta_scale * bytes, applied to
  every collective of the profile (`planner.costmodel.curves.corrected`), after which the exact solver re-plans;
- bounds on the size of gradient groups (`DenseDP` / `TopkParetoDP` with min/max group bytes; the rule is
  in `planner.solvers`), each with the choice "no bound";
- the top-k density (top-k plans), and the factor and inverse update intervals (K-FAC plans).

Each trial's parameters become a plan (`params_to_plan`), and the plan is run for real: one distributed
job (`planner.platform.launch.run_distributed`, gloo) runs every trial in the same processes. Rank 0 owns the
study (SQLite through `optuna.storages.RDBStorage`), asks for a trial, makes its plan and broadcasts it;
every rank builds the runtime for it (`GradientExchange`, or `KFACPreconditioner` for K-FAC plans) on a
fresh copy of the model, runs `warmup` steps, then `steps` measured steps in `rungs` chunks. After each
chunk rank 0 reports the running median to the trial and the pruner (MedianPruner) decides whether to go
on; the decision is broadcast. Steps are timed as `planner bench` does: from a barrier to the end of
`optimizer.step()`, a step's time being the slowest rank's. Before the first trial, the job runs `warmup`
steps of the untuned plan once, so that the first trial (the warm start) does not pay for a cold process.

Objective (seconds, minimised): the median measured step time. K-FAC steps differ (factors every
`factor_update_steps`, inverses every `inv_update_steps`), so for K-FAC plans the sample is the average
step over a window of `inv_update_steps` consecutive steps (each window holds exactly one inversion), as in
`planner bench --strategy kfac`: every chunk is rounded up to whole windows of the trial's plan, and the
objective is the median window average.

Warm start and resumption: a new study first runs the untuned parameters (scales 1, no bounds, the
starting density or intervals), i.e. the plan `planner solve` makes, even where they lie outside the
ranges. Running again with the same storage and study name resumes: only the trials missing to reach
`trials` finished ones (COMPLETE or PRUNED) run. Trials an interrupted run left RUNNING are told FAIL and
their parameters enqueued again (a study must not be run by two jobs at once). A trial whose plan cannot
be made (bounds no grouping satisfies, for example) is told FAIL with the reason in its user attributes
and does not count.

After the study, the best trial's parameters make the tuned plan, and the tuned and untuned plans are
compared in the same processes: interleaved round-robin blocks, `compare_steps` steps each.

K-FAC: the gradient groups of a K-FAC plan come from the dense DP inside the K-FAC problem (and the factor
fusion is planned around them), so group-size bounds are not tuned for K-FAC; the collective corrections
(which also move factor allreduces and inverse broadcasts) and the update intervals are.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from planner.console import progress
from planner.contracts.fingerprint import model_info
from planner.contracts.jsonio import check_output_path
from planner.contracts.kfac_section import kfac_layers
from planner.contracts.plan import Plan
from planner.contracts.profile import Profile
from planner.costmodel.curves import corrected
from planner.models import build_workload
from planner.platform import launch  # its launchers called through it: tests replace them there
from planner.platform.launch import broadcast_json, under_torchrun
from planner.runtime import GradientExchange, KFACPreconditioner
from planner.sessions.bench import BenchResult, refuse_gpu_plans, slowest_rank, timed_step
from planner.solvers import DenseDP, GroupingSolver, TopkParetoDP
from planner.strategies.gradients import make_plan
from planner.strategies.kfac_plan import DEFAULT_FACTOR_UPDATE_STEPS, DEFAULT_INV_UPDATE_STEPS, make_kfac_plan
from planner.types import (
    InverseMethod,
    PlanMismatchError,
    PlannerError,
    PlannerFileError,
    SchemaError,
    SolverError,
    Strategy,
)

if TYPE_CHECKING:
    import optuna

    from planner.platform.link import LinkRate

__all__ = [
    "STRATEGIES",
    "TuneConfig",
    "TuneResult",
    "TuneSpace",
    "check_study_file",
    "describe_params",
    "open_study",
    "params_to_plan",
    "run_tune",
    "same_decisions",
    "suggest_params",
    "tune_worker",
    "untuned_params",
]

#: What `TuneConfig.strategy` accepts: gradient plans (dense, top-k) and K-FAC plans.
STRATEGIES = ("dense", "topk", "kfac")
#: The top-k density `planner solve` uses when none is given.
DEFAULT_DENSITY = 0.01
#: Bytes in the MB of the group-size ranges (MiB, as DDP's `bucket_cap_mb`).
MB = 1024 * 1024
#: Steps per variant and turn in the final comparison of gradient plans (K-FAC plans: one window).
COMPARE_BLOCK = 5
#: Plans that cannot be made in a row before the study gives up (the ranges allow almost nothing).
MAX_PLAN_FAILURES = 25

# Names of the parameters in the study (and in `params_to_plan`'s dictionary).
ALPHA = "alpha_scale"
BETA = "beta_scale"
MAX_ON = "max_group_bounded"
MAX_MB = "max_group_mb"
MIN_ON = "min_group_bounded"
MIN_MB = "min_group_mb"
DENSITY = "density"
FACTOR = "factor_update_steps"
INV = "inv_update_steps"
_KNOWN = (ALPHA, BETA, MAX_ON, MAX_MB, MIN_ON, MIN_MB, DENSITY, FACTOR, INV)

# Study user attributes naming what a study was made for (a resumed study must match).
_IDENTITY = ("planner.strategy", "planner.model", "planner.world_size")


# ----------------------------------------------------------------------------------------------------
# What may be tuned


def _number(value: Any, integer: bool) -> bool:
    """Whether `value` is a finite number (an integer if `integer`; never a bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return isinstance(value, int) if integer else math.isfinite(value)


def _range(name: str, value: Any, *, integer: bool = False, at_most: float | None = None) -> tuple[Any, Any]:
    """A validated (low, high) range: two finite numbers (integers if `integer`), 0 < low <= high."""
    where = f"TuneSpace.{name}"
    if not isinstance(value, tuple | list) or len(value) != 2:
        raise SchemaError(f"{where} must be a (low, high) pair, but got {value!r}")
    low, high = value
    if not all(_number(v, integer) for v in (low, high)):
        kind = "integers" if integer else "finite numbers"
        raise SchemaError(f"{where}: low and high must be {kind}, but got (low={low!r}, high={high!r})")
    if low > high:
        raise SchemaError(f"{where}: `low <= high` must hold, but got (low={low}, high={high})")
    if low <= 0:
        raise SchemaError(f"{where}: `low > 0` must hold, but got (low={low}, high={high})")
    if at_most is not None and high > at_most:
        raise SchemaError(f"{where}: `high <= {at_most:g}` must hold, but got (low={low}, high={high})")
    return (int(low), int(high)) if integer else (float(low), float(high))


@dataclass(frozen=True, kw_only=True)
class TuneSpace:
    """The ranges the user allows the tuner to search (all sampled log-uniformly, intervals uniformly).

    Attributes:
        alpha_scale: factor on the fitted start-up time alpha of every collective.
        beta_scale: factor on the fitted per-byte time beta of every collective.
        max_group_mb: the largest group (dense gradient MB, 1 MB = 2^20 bytes), or "no bound", which is
            also a choice; None: never bounded. Dense and top-k only.
        min_group_mb: the smallest group but the last, or "no bound"; None (default): never bounded.
            Dense and top-k only.
        density: top-k density; None: keep the starting one. Top-k only.
        factor_update_steps: K-FAC factor update interval; None: keep the starting one. K-FAC only.
        inv_update_steps: K-FAC inverse update interval, sampled as a multiple of the factor interval
            within this range; None: keep the starting one. K-FAC only.
    """

    alpha_scale: tuple[float, float] = (0.25, 4.0)
    beta_scale: tuple[float, float] = (0.25, 4.0)
    max_group_mb: tuple[float, float] | None = (0.25, 64.0)
    min_group_mb: tuple[float, float] | None = None
    density: tuple[float, float] | None = None
    factor_update_steps: tuple[int, int] | None = None
    inv_update_steps: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        checked: dict[str, Any] = {
            "alpha_scale": _range("alpha_scale", self.alpha_scale),
            "beta_scale": _range("beta_scale", self.beta_scale),
        }
        for name in ("max_group_mb", "min_group_mb"):
            value = getattr(self, name)
            checked[name] = None if value is None else _range(name, value)
        checked["density"] = None if self.density is None else _range("density", self.density, at_most=1.0)
        for name in ("factor_update_steps", "inv_update_steps"):
            value = getattr(self, name)
            checked[name] = None if value is None else _range(name, value, integer=True)
        for name, value in checked.items():  # lists become tuples, ints become floats where floats are meant
            object.__setattr__(self, name, value)

    @classmethod
    def default_for(cls, strategy: str) -> TuneSpace:
        """The default ranges for a strategy: corrections and the largest group (dense, top-k), or
        corrections only (K-FAC, whose gradient groups are not bounded)."""
        if strategy not in STRATEGIES:
            raise SchemaError(f"strategy must be one of {list(STRATEGIES)}, but got {strategy!r}")
        return cls(max_group_mb=None) if strategy == "kfac" else cls()


def _multiples(factor: int, inv_range: tuple[int, int]) -> tuple[int, int] | None:
    """The least and largest multiple of `factor` within `inv_range`, or None if there is none."""
    low = -(-inv_range[0] // factor) * factor
    high = inv_range[1] // factor * factor
    return (low, high) if low <= high else None


@dataclass(frozen=True, kw_only=True)
class TuneConfig:
    """One tuning job: the profile and starting plan, the model to run, the study, and the budget.

    Attributes:
        profile: the measured profile the plans are solved from.
        profile_path: where it was read from (recorded in the plans).
        strategy: "dense", "topk" or "kfac".
        density: starting top-k density (default 0.01, as `planner solve`); top-k only.
        method, factor_update_steps, inv_update_steps: the starting K-FAC plan (as `planner solve`).
        placement_solver, time_limit_s: the K-FAC placement solver and its time limit (as `planner solve`).
        model: built-in model name or `package.module:factory`; None: the profile's model name.
        batch_size: per-worker batch; None: the workload's default.
        nproc: worker processes (the profile's world size).
        trials: finished trials (COMPLETE or PRUNED) the study must hold; a resumed study runs the rest.
        storage: the SQLite file holding the study.
        study_name: the study's name in the storage.
        steps: measured steps per trial, split into `rungs` chunks (the pruner decides after each).
        rungs: chunks per trial.
        warmup: unmeasured steps before each trial, before each variant of the comparison, and once per job.
        compare_steps: measured steps per variant in the final tuned-against-untuned comparison.
        seed: seed of the sampler (TPE); a resumed study adds the number of trials it holds.
        space: the ranges searched (`TuneSpace.default_for(strategy)` gives the defaults).
        lr: SGD learning rate of the measured steps (momentum 0.9, as `planner bench`).
        output: where to write the tuned plan (atomically); None: not written.
        timeout_s: limit of the whole job (and of every collective) in seconds.
        show_progress: progress bars on stderr (rank 0).
        link: run the workers behind an emulated link of this rate (`planner.platform.link`); None: loopback.
        hosts: spread the workers over this many emulated hosts (`--hosts`); None: one machine as it is. A
            profile of several hosts is tuned on as many.
    """

    profile: Profile
    profile_path: str = ""
    strategy: str = "dense"
    density: float | None = None
    method: InverseMethod = InverseMethod.EIGEN
    factor_update_steps: int = DEFAULT_FACTOR_UPDATE_STEPS
    inv_update_steps: int = DEFAULT_INV_UPDATE_STEPS
    placement_solver: str = "cp-sat"
    time_limit_s: float = 2.0
    model: str | None = None
    batch_size: int | None = None
    nproc: int = 2
    trials: int = 20
    storage: Path
    study_name: str = "planner-tune"
    steps: int = 30
    rungs: int = 3
    warmup: int = 5
    compare_steps: int = 30
    seed: int = 0
    space: TuneSpace
    lr: float = 0.01
    output: Path | None = None
    timeout_s: float = 24 * 3600.0
    show_progress: bool = True
    link: LinkRate | None = None
    hosts: int | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise SchemaError(f"strategy must be one of {list(STRATEGIES)}, but got {self.strategy!r}")
        object.__setattr__(self, "method", InverseMethod(self.method))
        object.__setattr__(self, "storage", Path(self.storage))
        for name, least in (("nproc", 1), ("trials", 1), ("steps", 1), ("rungs", 1), ("warmup", 0),
                            ("compare_steps", 1), ("factor_update_steps", 1), ("inv_update_steps", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise SchemaError(f"`{name} >= {least}` must hold (an integer), but got {name}={value!r}")
        if self.batch_size is not None and (not isinstance(self.batch_size, int) or self.batch_size < 1):
            raise SchemaError(f"`batch_size >= 1` must hold, but got batch_size={self.batch_size!r}")
        if self.steps < self.rungs:
            raise SchemaError(f"`steps >= rungs` must hold, but got (steps={self.steps}, rungs={self.rungs})")
        for name in ("time_limit_s", "timeout_s", "lr"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise SchemaError(f"`{name} > 0` must hold, but got {name}={value!r}")
        if not self.study_name:
            raise SchemaError("study_name must not be empty")
        self._check_strategy_fields()

    def _check_strategy_fields(self) -> None:
        space, strategy = self.space, self.strategy
        if strategy == "topk":
            density = DEFAULT_DENSITY if self.density is None else self.density
            if isinstance(density, bool) or not isinstance(density, int | float) or not 0 < density <= 1:
                raise SchemaError(f"`0 < density <= 1` must hold, but got density={density!r}")
            object.__setattr__(self, "density", float(density))
        elif self.density is not None:
            raise SchemaError(f"density applies to strategy 'topk' only, but strategy is {strategy!r}")
        if space.density is not None and strategy != "topk":
            raise SchemaError(f"TuneSpace.density applies to strategy 'topk' only, but strategy is {strategy!r}")
        if strategy != "kfac":
            given = [n for n in ("factor_update_steps", "inv_update_steps") if getattr(space, n) is not None]
            if given:
                raise SchemaError(f"TuneSpace.{given[0]} applies to strategy 'kfac' only, but strategy is {strategy!r}")
            return
        given = [n for n in ("max_group_mb", "min_group_mb") if getattr(space, n) is not None]
        if given:
            raise SchemaError(
                f"TuneSpace.{given[0]} is not tuned for strategy 'kfac' (its gradient groups come from the K-FAC "
                "problem's own dense DP); set it to None, e.g. TuneSpace.default_for('kfac')"
            )
        if self.inv_update_steps % self.factor_update_steps:
            raise SchemaError(
                "inv_update_steps must be a multiple of factor_update_steps, but got "
                f"(factor_update_steps={self.factor_update_steps}, inv_update_steps={self.inv_update_steps})"
            )
        factors = space.factor_update_steps or (self.factor_update_steps, self.factor_update_steps)
        invs = space.inv_update_steps or (self.inv_update_steps, self.inv_update_steps)
        lonely = [f for f in range(factors[0], factors[1] + 1) if _multiples(f, invs) is None]
        if lonely:
            raise SchemaError(
                f"every factor interval in {factors} needs a multiple in the inverse interval range {invs}, but "
                f"{lonely[0]} has none; widen TuneSpace.inv_update_steps or narrow TuneSpace.factor_update_steps"
            )

    @property
    def model_name(self) -> str:
        """The model the workers build: `model`, else the profile's model name."""
        return self.model or self.profile.model.name


# ----------------------------------------------------------------------------------------------------
# From parameters to a plan


@dataclass(frozen=True, kw_only=True)
class _Params:
    """One trial's parameters, typed, with the starting plan's values where a parameter is not tuned."""

    alpha_scale: float
    beta_scale: float
    max_group_mb: float | None
    min_group_mb: float | None
    density: float | None
    factor_update_steps: int
    inv_update_steps: int

    @classmethod
    def parse(cls, config: TuneConfig, params: dict[str, Any]) -> _Params:
        unknown = sorted(set(params) - set(_KNOWN))
        if unknown:
            raise SchemaError(f"unknown tuning parameter(s) {unknown}; known: {list(_KNOWN)}")
        strategy = config.strategy
        misplaced = [k for k, only in ((DENSITY, "topk"), (FACTOR, "kfac"), (INV, "kfac")) if k in params
                     and strategy != only]
        if strategy == "kfac":
            misplaced += [k for k in (MAX_ON, MAX_MB, MIN_ON, MIN_MB) if k in params]
        if misplaced:
            raise SchemaError(f"tuning parameter {misplaced[0]!r} does not apply to strategy {strategy!r}")

        def bound(on: str, mb: str) -> float | None:
            if not params.get(on, mb in params):
                return None
            if mb not in params:
                raise SchemaError(f"tuning parameter {on!r} is true but {mb!r} is missing")
            return float(params[mb])

        try:
            return cls(
                alpha_scale=float(params.get(ALPHA, 1.0)),
                beta_scale=float(params.get(BETA, 1.0)),
                max_group_mb=bound(MAX_ON, MAX_MB),
                min_group_mb=bound(MIN_ON, MIN_MB),
                density=float(params.get(DENSITY, config.density or DEFAULT_DENSITY)) if strategy == "topk" else None,
                factor_update_steps=int(params.get(FACTOR, config.factor_update_steps)),
                inv_update_steps=int(params.get(INV, config.inv_update_steps)),
            )
        except (TypeError, ValueError) as exc:
            if isinstance(exc, PlannerError):
                raise
            raise SchemaError(f"tuning parameters must be numbers, but got {params}: {exc}") from None

    def describe(self, config: TuneConfig) -> str:
        """What differs from the starting plan, e.g. "alpha x0.8, beta x1.3, max 4 MB" (empty if nothing)."""
        if self == _Params.parse(config, {}):
            return ""
        parts = [f"alpha x{self.alpha_scale:.3g}", f"beta x{self.beta_scale:.3g}"]
        if self.max_group_mb is not None:
            parts.append(f"max {self.max_group_mb:.3g} MB")
        if self.min_group_mb is not None:
            parts.append(f"min {self.min_group_mb:.3g} MB")
        if config.strategy == "topk" and self.density != config.density:
            parts.append(f"density {self.density:.3g}")
        if config.strategy == "kfac":
            parts.append(f"factors every {self.factor_update_steps}, inverses every {self.inv_update_steps}")
        return ", ".join(parts)


def untuned_params(config: TuneConfig) -> dict[str, Any]:
    """The parameters of the starting plan, for every parameter the space tunes (the warm start)."""
    space = config.space
    params: dict[str, Any] = {ALPHA: 1.0, BETA: 1.0}
    if space.max_group_mb is not None:
        params[MAX_ON] = False
    if space.min_group_mb is not None:
        params[MIN_ON] = False
    if space.density is not None:
        params[DENSITY] = config.density
    if space.factor_update_steps is not None:
        params[FACTOR] = config.factor_update_steps
    if space.inv_update_steps is not None:
        params[INV] = config.inv_update_steps
    return params


def suggest_params(trial: optuna.trial.Trial, config: TuneConfig) -> dict[str, Any]:
    """Ask `trial` for a value of every parameter the space tunes; returns them (as `trial.params`)."""
    space = config.space
    params: dict[str, Any] = {
        ALPHA: trial.suggest_float(ALPHA, *space.alpha_scale, log=True),
        BETA: trial.suggest_float(BETA, *space.beta_scale, log=True),
    }
    for on, mb, rng in ((MAX_ON, MAX_MB, space.max_group_mb), (MIN_ON, MIN_MB, space.min_group_mb)):
        if rng is not None:
            params[on] = bool(trial.suggest_categorical(on, [False, True]))
            if params[on]:
                params[mb] = trial.suggest_float(mb, *rng, log=True)
    if space.density is not None:
        params[DENSITY] = trial.suggest_float(DENSITY, *space.density, log=True)
    factor = config.factor_update_steps
    if space.factor_update_steps is not None:
        factor = params[FACTOR] = trial.suggest_int(FACTOR, *space.factor_update_steps)
    if space.inv_update_steps is not None:
        multiples = _multiples(factor, space.inv_update_steps)
        assert multiples is not None, "TuneConfig checks that every factor interval has a multiple"
        params[INV] = trial.suggest_int(INV, *multiples, step=factor)
    return params


def describe_params(config: TuneConfig, params: dict[str, Any]) -> str:
    """One line for a trial's parameters ("untuned" for the starting plan's)."""
    return _Params.parse(config, params).describe(config) or "untuned"


def _corrected(profile: Profile, alpha_scale: float, beta_scale: float) -> Profile:
    """The profile with every collective's fitted cost corrected (the same profile for scales of 1)."""
    if alpha_scale == 1 and beta_scale == 1:
        return profile
    curves = {c: corrected(curve, alpha_scale, beta_scale) for c, curve in profile.collectives.items()}
    return replace(profile, collectives=curves)


def _bytes(mb: float | None) -> int | None:
    return None if mb is None else max(1, round(mb * MB))


def params_to_plan(profile: Profile, config: TuneConfig, params: dict[str, Any]) -> Plan:
    """The plan a trial's parameters make: the corrected profile solved exactly under the bounds.

    Parameters not given keep the starting plan's values, so `params_to_plan(profile, config, {})` (or
    `untuned_params(config)`) is the plan `planner solve` makes. The plan's solver name records the
    parameters ("dense-exact tuned: alpha x0.8, beta x1.3, max 4 MB"); its predictions are the corrected
    model's.

    Raises:
        SchemaError: unknown parameters, or parameters of another strategy.
        SolverError: the bounds allow no grouping (or min > max), or the profile lacks what the strategy needs.
    """
    p = _Params.parse(config, params)
    corrected = _corrected(profile, p.alpha_scale, p.beta_scale)
    if config.strategy == "kfac":
        plan = make_kfac_plan(
            corrected,
            method=config.method,
            factor_update_steps=p.factor_update_steps,
            inv_update_steps=p.inv_update_steps,
            placement_solver=config.placement_solver,
            time_limit_s=config.time_limit_s,
            source=config.profile_path,
        )
        name = plan.solver
    else:
        strategy = Strategy(config.strategy)
        low, high = _bytes(p.min_group_mb) or 0, _bytes(p.max_group_mb)
        solver: GroupingSolver = (
            DenseDP(min_group_bytes=low, max_group_bytes=high)
            if strategy is Strategy.DENSE
            else TopkParetoDP(min_group_bytes=low, max_group_bytes=high)
        )
        plan = make_plan(corrected, strategy, p.density, source=config.profile_path, solver=solver)
        name = f"{strategy.value}-exact"
    tuned = p.describe(config)
    return replace(plan, solver=f"{name} tuned: {tuned}" if tuned else name)


def same_decisions(a: Plan, b: Plan) -> bool:
    """Whether two plans run the same way: groups, density, top-k selector, and K-FAC buffers, owners, method
    and intervals (predictions and solver names aside). Tuned and untuned plans that decide alike differ only
    by noise."""
    if (a.groups, a.strategy, a.density, a.selector) != (b.groups, b.strategy, b.density, b.selector):
        return False
    if a.kfac is None or b.kfac is None:
        return a.kfac is None and b.kfac is None
    fields = ("a_buffers", "g_buffers", "owners", "method", "factor_update_steps", "inv_update_steps")
    return all(getattr(a.kfac, f) == getattr(b.kfac, f) for f in fields)


def _predicted_s(plan: Plan) -> float:
    """The plan's predicted (average) step in seconds."""
    if plan.kfac is not None and plan.kfac.predicted is not None:
        return plan.kfac.predicted.step_s
    return plan.predicted.iteration_s


# ----------------------------------------------------------------------------------------------------
# The study


def check_study_file(path: Path) -> Path:
    """`path` if a study can live there: a SQLite file, or nothing yet (PlannerFileError in one line for a
    folder, another kind of file or a place that cannot hold a file)."""
    check_output_path(path, "study")
    if path.is_file() and path.stat().st_size > 0:
        try:
            with open(path, "rb") as f:
                header = f.read(16)
        except OSError as exc:
            raise PlannerFileError(f"cannot read the study {path}: {exc.strerror or exc}") from None
        if header != b"SQLite format 3\x00":
            raise PlannerFileError(f"the study {path} is not a SQLite database; give a new file name or a study "
                                   "written by `planner tune`")
    return path


def _storage_url(path: Path) -> str:
    return f"sqlite:///{path.resolve()}"


def _finished(study: optuna.Study) -> int:
    from optuna.trial import TrialState  # deferred: only rank 0 runs the study; workers load no optuna

    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))


def open_study(config: TuneConfig) -> tuple[optuna.Study, int]:
    """Open (or create) the study in `config.storage`, ready to run; returns it and its finished trials.

    A new study gets the untuned parameters enqueued as its first trial. An existing one must have been made
    for the same strategy, model (fingerprint) and world size (recorded in its user attributes); its trials
    left RUNNING (by an interrupted run) are told FAIL and their parameters enqueued again (user attribute
    "retry_of" names the trial). The sampler is
    TPE seeded with `config.seed` plus the number of trials the study holds, so that a resumed study does not
    draw the same points again; the pruner is MedianPruner(n_startup_trials=2, n_warmup_steps=0).

    Raises:
        PlanMismatchError: the study was made for another strategy, model or world size.
    """
    import optuna  # deferred: only rank 0 runs the study; workers load no optuna
    from optuna.trial import TrialState  # deferred: only rank 0 runs the study; workers load no optuna

    config.storage.parent.mkdir(parents=True, exist_ok=True)
    storage = optuna.storages.RDBStorage(_storage_url(config.storage))
    first = optuna.create_study(storage=storage, study_name=config.study_name, direction="minimize",
                                load_if_exists=True)
    held = len(first.get_trials(deepcopy=False))
    study = optuna.load_study(
        study_name=config.study_name,
        storage=storage,
        sampler=optuna.samplers.TPESampler(seed=config.seed + held),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0),
    )
    identity = dict(zip(_IDENTITY, (config.strategy, config.profile.model.fingerprint, config.nproc), strict=True))
    made_for = {k: study.user_attrs[k] for k in _IDENTITY if k in study.user_attrs}
    if any(identity[k] != v for k, v in made_for.items()):
        raise PlanMismatchError(
            f"study {config.study_name!r} in {config.storage} was made for {made_for}, but this job is {identity}; "
            "use another study name or storage"
        )
    for key, value in identity.items():
        if key not in made_for:
            study.set_user_attr(key, value)
    if held == 0:
        study.enqueue_trial(untuned_params(config), user_attrs={"warm_start": True})
        return study, 0
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study.tell(trial.number, state=TrialState.FAIL)
        if trial.params:
            study.enqueue_trial(dict(trial.params), user_attrs={"retry_of": trial.number})
    return study, _finished(study)


# ----------------------------------------------------------------------------------------------------
# Measuring (every rank)


def _broadcast(value: Any, rank: int) -> Any:
    """Rank 0's JSON-compatible `value` on every rank (as JSON: plans travel as data, never as pickles)."""
    return broadcast_json(value if rank == 0 else None)


class _Runner:
    """A fresh copy of the model with the runtime a plan needs, and its optimizer; `step()` times one step."""

    def __init__(self, config: TuneConfig, plan: Plan, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.workload = build_workload(config.model_name, batch_size=config.batch_size)  # same weights everywhere
        self.part: GradientExchange | KFACPreconditioner
        self.finish: Callable[[], None]
        if plan.kfac is not None:
            self.part = KFACPreconditioner(self.workload.module, plan=plan, lr=config.lr)
            self.finish = self.part.step
            self.window = plan.kfac.inv_update_steps
        else:
            self.part = GradientExchange(self.workload.module, plan)
            self.finish = self.part.synchronize
            self.window = 1
        self.opt = torch.optim.SGD(self.workload.module.parameters(), lr=config.lr, momentum=0.9)
        self.batch = batch

    def step(self) -> float:
        return timed_step(self.workload.module, self.workload.loss_fn, self.batch, self.opt, self.finish)

    def samples(self, slowest: list[float]) -> list[float]:
        """Step times, or K-FAC window averages, from consecutive slowest-rank step times."""
        w = self.window
        return [sum(slowest[i:i + w]) / w for i in range(0, len(slowest) - w + 1, w)]

    def close(self) -> None:
        self.part.close()


def _warm_up(config: TuneConfig, plan: Plan, batch: tuple[torch.Tensor, torch.Tensor], advance: Callable[[], None]
             ) -> None:
    """`config.warmup` unmeasured steps of `plan` (once per job, before the first trial)."""
    runner = _Runner(config, plan, batch)
    try:
        for _ in range(config.warmup):
            runner.step()
            advance()
    finally:
        runner.close()


def _chunks(steps: int, rungs: int) -> list[int]:
    """`steps` split into `rungs` nearly equal chunks."""
    return [steps // rungs + (1 if i < steps % rungs else 0) for i in range(rungs)]


def _rung_steps(config: TuneConfig, window: int) -> list[int]:
    """Steps of each rung: the chunks of `steps`, rounded up to whole windows."""
    return [-(-c // window) * window for c in _chunks(config.steps, config.rungs)]


def _run_trial(
    rank: int, config: TuneConfig, plan: Plan, batch: tuple[torch.Tensor, torch.Tensor],
    trial: optuna.trial.Trial | None, advance: Callable[[], None],
) -> tuple[bool, list[float]]:
    """Warm up and measure one plan rung by rung; rank 0 reports to `trial` (other ranks pass None) and
    broadcasts whether to prune after each rung. Returns (pruned, samples)."""
    runner = _Runner(config, plan, batch)
    try:
        for _ in range(config.warmup):
            runner.step()
            advance()
        samples: list[float] = []
        rungs = _rung_steps(config, runner.window)
        for rung, count in enumerate(rungs):
            times = []
            for _ in range(count):
                times.append(runner.step())
                advance()
            samples += runner.samples(slowest_rank([times])[0])
            prune = False
            if trial is not None:
                trial.report(statistics.median(samples), rung)
                prune = rung < len(rungs) - 1 and bool(trial.should_prune())
            if _broadcast(prune, rank):
                return True, samples
        return False, samples
    finally:
        runner.close()


def _compare(
    rank: int, config: TuneConfig, plans: list[tuple[str, Plan]], batch: tuple[torch.Tensor, torch.Tensor],
    advance: Callable[[], None],
) -> list[BenchResult] | None:
    """The plans measured in interleaved round-robin blocks in the same processes; rank 0 returns the results."""
    runners = [_Runner(config, plan, batch) for _, plan in plans]
    try:
        for runner in runners:
            for _ in range(config.warmup):
                runner.step()
                advance()
        targets = [-(-config.compare_steps // r.window) * r.window for r in runners]
        blocks = [r.window if r.window > 1 else COMPARE_BLOCK for r in runners]
        times: list[list[float]] = [[] for _ in runners]
        while any(len(t) < n for t, n in zip(times, targets, strict=True)):
            for i, runner in enumerate(runners):
                for _ in range(min(blocks[i], targets[i] - len(times[i]))):
                    times[i].append(runner.step())
                    advance()
    finally:
        for runner in runners:
            runner.close()
    slowest = [slowest_rank([row])[0] for row in times]  # K-FAC variants may measure different numbers of steps
    if rank != 0:
        return None
    results = [
        BenchResult.from_samples(name, "kfac" if plan.kfac is not None else plan.strategy.value,
                                 runner.samples(row), steps=len(row), predicted_s=_predicted_s(plan),
                                 reference="untuned")
        for (name, plan), runner, row in zip(plans, runners, slowest, strict=True)
    ]
    reference = results[0].median_s
    return [replace(r, speedup=reference / r.median_s) for r in results]


def _trial_rows(study: optuna.Study) -> list[dict[str, Any]]:
    """Every trial as a row for printing: number, state, params, value, predicted (seconds) and a note."""
    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs["retry_of"]: t.number for t in trials if "retry_of" in t.user_attrs}
    rows = []
    for t in trials:
        attrs = t.user_attrs
        notes = [attrs["fail_reason"]] if "fail_reason" in attrs else []
        if t.number in retried:
            notes.append(f"interrupted; retried as trial {retried[t.number]}")
        if "retry_of" in attrs:
            notes.append(f"retry of trial {attrs['retry_of']}")
        if attrs.get("warm_start"):
            notes.append("untuned (warm start)")
        rows.append({"number": t.number, "state": t.state.name, "params": dict(t.params), "value": t.value,
                     "predicted": attrs.get("predicted_s"), "note": "; ".join(notes)})
    return rows


def tune_worker(rank: int, world_size: int, config: TuneConfig) -> TuneResult | None:
    """One rank of the tuning job (see the module docstring); rank 0 returns the result."""
    torch.manual_seed(0)
    base = build_workload(config.model_name, batch_size=config.batch_size)
    batch = base.make_batch(base.batch_size, torch.Generator().manual_seed(1000 + rank))
    show = config.show_progress and rank == 0
    with progress(enabled=show) as bar:
        if rank == 0:
            return _lead(config, batch, bar)
        while True:
            message = _broadcast(None, rank)
            if "warmup" in message:
                _warm_up(config, Plan.from_dict(message["warmup"]), batch, lambda: None)
            elif "plan" in message:
                _run_trial(rank, config, Plan.from_dict(message["plan"]), batch, None, lambda: None)
            elif "compare" in message:
                plans = [(name, Plan.from_dict(p)) for name, p in message["compare"]]
                _compare(rank, config, plans, batch, lambda: None)
                return None
            else:  # rank 0 stopped with an error it raises itself
                return None


def _lead(config: TuneConfig, batch: tuple[torch.Tensor, torch.Tensor], bar: Any) -> TuneResult:
    """Rank 0: run the study, broadcasting each trial's plan, then the comparison."""
    import optuna  # deferred: only rank 0 runs the study; workers load no optuna
    from optuna.trial import TrialState  # deferred: only rank 0 runs the study; workers load no optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    profile = config.profile
    try:
        study, resumed_from = open_study(config)
        untuned = params_to_plan(profile, config, untuned_params(config))
    except BaseException as exc:
        _broadcast({"error": str(exc)}, 0)
        raise
    trials_task = bar.add_task(_best_line(study), total=config.trials, completed=resumed_from)
    steps_task = bar.add_task("warm-up (untuned plan)", total=config.warmup)
    if config.warmup and _finished(study) < config.trials:
        # The first trial would otherwise also pay for what a fresh process does once (thread pools, first
        # collectives, allocations): the warm start would look slower than it is.
        _broadcast({"warmup": untuned.to_dict()}, 0)
        _warm_up(config, untuned, batch, lambda: bar.advance(steps_task))
    failures = 0
    while _finished(study) < config.trials:
        trial = study.ask()
        params = suggest_params(trial, config)
        try:
            plan = params_to_plan(profile, config, params)
        except PlannerError as exc:
            trial.set_user_attr("fail_reason", f"no plan: {exc}")
            study.tell(trial, state=TrialState.FAIL)
            failures += 1
            if failures < MAX_PLAN_FAILURES:
                continue
            _broadcast({"error": "no plans"}, 0)
            raise SolverError(
                f"{failures} trials in a row had no plan (last: {exc}); widen or fix the TuneSpace ranges"
            ) from exc
        failures = 0
        predicted = _predicted_s(plan)
        trial.set_user_attr("predicted_s", predicted)
        trial.set_user_attr("solver", plan.solver)
        window = plan.kfac.inv_update_steps if plan.kfac is not None else 1
        bar.reset(steps_task, total=config.warmup + sum(_rung_steps(config, window)),
                  description=f"trial {trial.number}: {describe_params(config, params)}")
        _broadcast({"plan": plan.to_dict()}, 0)
        try:
            pruned, samples = _run_trial(0, config, plan, batch, trial, lambda: bar.advance(steps_task))
        except Exception as exc:
            trial.set_user_attr("fail_reason", f"{type(exc).__name__}: {exc}")
            study.tell(trial, state=TrialState.FAIL)
            raise
        trial.set_user_attr("measured_median_s", statistics.median(samples))
        trial.set_user_attr("measured_samples", len(samples))
        if pruned:
            study.tell(trial, state=TrialState.PRUNED)
        else:
            study.tell(trial, statistics.median(samples))
        bar.update(trials_task, completed=_finished(study), description=_best_line(study))

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not complete:
        _broadcast({"error": "no complete trial"}, 0)
        raise PlannerError(
            f"study {config.study_name!r} has no complete trial to take a plan from (all pruned or failed); "
            "run more trials"
        )
    best = study.best_trial
    tuned = params_to_plan(profile, config, dict(best.params))
    plans = [("untuned", untuned), ("tuned", tuned)]
    bar.reset(steps_task, total=len(plans) * config.warmup + sum(_compare_steps(config, p) for _, p in plans),
              description="comparison: untuned against tuned")
    _broadcast({"compare": [(name, p.to_dict()) for name, p in plans]}, 0)
    comparison = _compare(0, config, plans, batch, lambda: bar.advance(steps_task))
    assert comparison is not None
    return TuneResult(
        best_params=dict(best.params),
        best_value_s=float(best.value) if best.value is not None else math.nan,
        best_trial=best.number,
        tuned_plan=tuned,
        untuned_plan=untuned,
        comparison=comparison,
        trials=_trial_rows(study),
        resumed_from=resumed_from,
    )


def _compare_steps(config: TuneConfig, plan: Plan) -> int:
    window = plan.kfac.inv_update_steps if plan.kfac is not None else 1
    return -(-config.compare_steps // window) * window


def _best_line(study: optuna.Study) -> str:
    try:
        best = study.best_trial
    except ValueError:
        return "trials"
    value = best.value if best.value is not None else math.nan
    return f"trials (best {value * 1e3:.3g} ms, trial {best.number})"


# ----------------------------------------------------------------------------------------------------
# Entry point


@dataclass(frozen=True, kw_only=True)
class TuneResult:
    """What a tuning job found, and the tuned plan measured against the untuned one.

    Attributes:
        best_params: the best trial's parameters (see `params_to_plan`).
        best_value_s: its objective, the median measured step (K-FAC: window average) in seconds.
        best_trial: its number in the study.
        tuned_plan: the plan its parameters make.
        untuned_plan: the plan `planner solve` makes (the warm start).
        comparison: [untuned, tuned], measured interleaved after the study; speedup is untuned / tuned.
        trials: every trial of the study: number, state, params, value (s), predicted (s), note.
        resumed_from: finished trials the study held when the job started.
    """

    best_params: dict[str, Any]
    best_value_s: float
    best_trial: int
    tuned_plan: Plan
    untuned_plan: Plan
    comparison: list[BenchResult]
    trials: list[dict[str, Any]]
    resumed_from: int


def run_tune(config: TuneConfig) -> TuneResult | None:
    """Run the study in one job of `config.nproc` local gloo workers (or, under torchrun, on torchrun's group,
    maybe across hosts: rank 0 leads and writes; the other ranks get None), compare, and write the tuned plan.

    Raises:
        PlanMismatchError: the profile was made for another world size or model, or the study for another job.
        SolverError, SchemaError: the starting plan cannot be made from the profile.
    """
    profile = config.profile
    torchrun = under_torchrun()  # then the hosts are real ones: the plans' runtime reads them from host names
    if profile.cluster.world_size != config.nproc:
        raise PlanMismatchError(
            f"the profile was measured on world size {profile.cluster.world_size}, but nproc is {config.nproc}; "
            f"profile again: planner profile --model {config.model_name} --nproc {config.nproc}"
        )
    if not torchrun and profile.cluster.host_count != (config.hosts or 1):
        raise PlanMismatchError(
            f"the profile was measured on {profile.cluster.host_count} host(s), but the tuning runs on "
            f"{config.hosts or 1}: tune on as many, --hosts {profile.cluster.host_count}, or profile again"
        )
    untuned = params_to_plan(profile, config, untuned_params(config))  # fails early, before any process starts
    refuse_gpu_plans([untuned], "planner tune", instead="on GPUs, use the plan `planner solve` makes")
    module = build_workload(config.model_name, batch_size=config.batch_size).module
    # The plans' hierarchical groups need the hosts they were made for; --hosts emulates them.
    untuned.check_compatible(model_info(module, config.model_name), config.nproc,
                             hosts=None if torchrun else config.hosts or 1)
    if untuned.kfac is not None:
        untuned.kfac.check_layers(kfac_layers(module, untuned.kfac.skip))
    result = launch.run_job(tune_worker, config.nproc, config, backend="gloo", timeout=config.timeout_s,
                            link=config.link, hosts=config.hosts)
    if result is None:  # a rank of torchrun's group other than 0
        return None
    assert isinstance(result, TuneResult)
    if config.output is not None:
        result.tuned_plan.save(config.output)
    return result
