"""Re-plan a mixed plan as training goes: measure each compressor's error on the gradients of now, and re-solve under
the plan's error budget when the plan no longer fits it or a faster one does (`GradientExchange(adaptive=True)`,
`PlanHook(adaptive=True)`: inside DDP the groups are DDP's buckets, fixed, so a re-plan keeps them and chooses
each one's compressor only).

A mixed plan kept within an error budget (`planner solve --strategy mixed|auto --error-budget`) was chosen with the
errors `planner profile` measured in its first few steps. Gradients change as training goes (their scale, how
low-rank they are, which layers carry their energy), and so do the compressors' errors. L-GreCo re-solves its
per-layer choice periodically for that reason; this does the same on the planner's timeline model:

- every `Replanning.every` steps, over the last `warmup + steps` steps before it, every rank hands each layer's own
  gradient (before averaging) to a `planner.kernels.error.ErrorMeter` per allowed compressor, exactly as
  `planner profile` measures (`profilers.errors`), error feedback built up over the warm-up steps;
- the ranks gather their squared norms (one all-gather of a small float64 tensor); rank 0 puts them into the
  source profile in place of its errors and re-solves the plan of the same compressors under the same budget (a
  budget given as a compressor, `--error-budget powersgd:4`, is that compressor's error measured again: no more error
  than it would make on today's gradients);
- rank 0 keeps the new plan when the current one exceeds the budget on the new errors, or when the new one is
  predicted at least `gain` times faster; else it keeps the current plan. It broadcasts its decision as JSON (data,
  never a pickle), so every rank holds the same plan after it.

The step times come from the profile: they do not change with the errors, so the plan in use stays the fastest
within the budget until the errors move.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from planner.contracts.errors import CompressionErrors
from planner.contracts.layers import gradient_layers, plan_grouping
from planner.contracts.plan import Plan
from planner.contracts.profile import Profile
from planner.kernels.error import ErrorMeter, squared_norm
from planner.platform.launch import broadcast_json
from planner.types import Compressor, CompressorKind, PlannerError, Strategy

__all__ = ["ErrorWatch", "Replan", "Replanning", "decide_replan", "replan_on_every_rank", "replannable"]


@dataclass(frozen=True, kw_only=True)
class Replanning:
    """When the runtime measures the errors and how much faster a new plan must be to be taken.

    Attributes:
        every: steps between two re-plans; the errors are measured over the last `warmup + steps` steps before
            each (so the first re-plan follows step `every`).
        steps: steps whose errors are recorded, as `planner profile --error-steps`.
        warmup: steps before them that build up the error fed back (not recorded).
        gain: a plan still within the budget is replaced only by one predicted at least this many times faster.
        time_limit_s: seconds rank 0's solve may take (None: until proven optimal).
    """

    every: int = 200
    steps: int = 6
    warmup: int = 2
    gain: float = 1.05
    time_limit_s: float | None = 1.0

    def __post_init__(self) -> None:
        for name in ("every", "steps", "warmup"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"Replanning.{name} must be an integer, but got {value!r}")
        if self.steps < 1 or self.warmup < 0 or self.every < self.steps + self.warmup:
            raise ValueError(f"Replanning needs steps >= 1, warmup >= 0 and every >= steps + warmup (the errors are "
                             f"measured inside each period), but got every={self.every}, steps={self.steps}, "
                             f"warmup={self.warmup}")
        if not self.gain >= 1:
            raise ValueError(f"Replanning.gain must be >= 1 (a new plan at least as fast), but got {self.gain}")
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise ValueError(f"Replanning.time_limit_s must be > 0 or None, but got {self.time_limit_s}")

    def position(self, step: int) -> int | None:
        """Where step `step` (0-based) falls in its period's measurement: 0 for its first warm-up step, up to
        `warmup + steps - 1` for the step after which the plan is re-solved; None outside the measurement."""
        at = step % self.every - (self.every - self.warmup - self.steps)
        return at if at >= 0 else None


@dataclass(frozen=True)
class Replan:
    """One re-plan the runtime made (or declined): after which step, what rank 0 decided and why, and the errors."""

    step: int
    changed: bool
    reason: str
    error_before: float | None  # the plan in use, on the new errors
    error_after: float | None  # the plan kept, on the new errors
    budget: float | None  # the budget on the new errors
    plan: Plan | None = None  # the plan taken (None: kept the one in use)


def replannable(plan: Plan) -> str:
    """Why `plan` cannot be re-planned as training goes ("" when it can)."""
    if plan.strategy is not Strategy.MIXED:
        return (f"adaptive re-planning re-solves a mixed plan under its error budget, but this plan's strategy is "
                f"{plan.strategy.value}; solve with --strategy mixed (or auto) --error-budget B")
    if plan.error is None or plan.error.budget is None:
        return ("adaptive re-planning keeps the plan within its error budget, but this plan was solved without one; "
                "solve with --error-budget B (a number, or a compressor such as powersgd:4)")
    return ""


def allowed_compressors(plan: Plan, *, topk: bool = True) -> tuple[Compressor, ...]:
    """The compressors a re-plan may choose among: the plan's allowed set (without top-k where `topk` is False)."""
    allowed = plan.compressors or tuple(dict.fromkeys(plan.compressor_of(g) for g in plan.groups))
    kept = tuple(c for c in allowed if topk or c.kind is not CompressorKind.TOPK)
    return kept or (Compressor.parse("dense"),)


class ErrorWatch:
    """Each layer's local gradients over the measured steps of a period, through a meter per lossy compressor.

    Args:
        model: the planned module (its layers as `planner.contracts.layers.gradient_layers` finds them).
        layers: the plan's layers, in its (ready) order.
        compressors: the compressors a re-plan may choose (dense has no error and is not metered).
        schedule: when to measure.
        device: where the meters' state lives.
    """

    def __init__(self, model: nn.Module, layers: Sequence[str], compressors: Sequence[Compressor],
                 schedule: Replanning, device: torch.device) -> None:
        specs = {s.name: s for s in gradient_layers(model)}
        params = dict(model.named_parameters())
        missing = [n for n in layers if n not in specs]
        if missing:
            raise PlannerError(f"the plan's layers {missing[:3]} are not layers of the model; pass the planned module")
        self.layers = tuple(layers)
        self.schedule = schedule
        self.device = device
        self._params = [[params[p] for p in specs[n].params] for n in self.layers]
        self.compressors = tuple(c for c in compressors if c.kind is not CompressorKind.DENSE
                                 and not (c.kind is CompressorKind.TOPK and c.density is not None and c.density >= 1))
        self._taken: dict[int, Tensor] = {}
        self._meters: list[list[ErrorMeter]] = []
        self._norms = np.zeros((0, 0, 0))

    def measuring(self, step: int) -> bool:
        """Whether step `step`'s local gradients are to be taken."""
        return self.schedule.position(step) is not None

    def take(self, param: Tensor, grad: Tensor | None) -> None:
        """Keep a copy of `param`'s local gradient of this step (None: zeros)."""
        if grad is not None:
            self._taken[id(param)] = grad.detach().reshape(-1).float().clone()

    def observe(self, step: int) -> bool:
        """Feed the taken gradients of step `step` to the meters (fresh ones at a period's first step); True once
        the period's last measured step is in."""
        at = self.schedule.position(step)
        if at is None:
            self._taken.clear()
            return False
        if at == 0 or not self._meters:
            self._start()
        with torch.no_grad():
            for i, params in enumerate(self._params):
                flat = torch.cat([self._taken.get(id(p), torch.zeros(p.numel(), device=self.device)).to(self.device)
                                  for p in params])
                grad_sq = squared_norm(flat)  # once per layer, for every meter of it
                for c, meter in enumerate(self._meters[i]):
                    sample = meter.observe(flat, grad_sq)
                    if at >= self.schedule.warmup:
                        self._norms[1 + 2 * c : 3 + 2 * c, i, at - self.schedule.warmup] = sample[1:]
                if at >= self.schedule.warmup:
                    self._norms[0, i, at - self.schedule.warmup] = grad_sq
        self._taken.clear()
        return at == self.schedule.warmup + self.schedule.steps - 1

    def _start(self) -> None:
        from planner.profilers.errors import layer_k  # deferred: importing the runtime loads no profilers

        shapes = [[tuple(p.shape) for p in params] for params in self._params]
        self._meters = [[ErrorMeter(s, c, self.device, k=layer_k(c, s), seed=i) for c in self.compressors]
                        for i, s in enumerate(shapes)]
        self._norms = np.zeros((1 + 2 * len(self.compressors), len(self.layers), self.schedule.steps))

    def gather(self, process_group: Any = None) -> CompressionErrors:
        """Every rank's squared norms of the period just measured (collective: every rank calls it)."""
        mine = torch.from_numpy(self._norms).to(self.device)
        world = dist.get_world_size(process_group) if dist.is_available() and dist.is_initialized() else 1
        every = [mine]
        if world > 1:
            every = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(every, mine, group=process_group)
        stack = np.stack([t.cpu().numpy() for t in every])  # (ranks, 1 + 2C, layers, steps)
        names = [str(c) for c in self.compressors]
        return CompressionErrors(layers=self.layers, warmup=self.schedule.warmup, grad_sq=stack[:, 0],
                                 input_sq={c: stack[:, 1 + 2 * i] for i, c in enumerate(names)},
                                 error_sq={c: stack[:, 2 + 2 * i] for i, c in enumerate(names)})


def decide_replan(plan: Plan, profile: Profile, errors: CompressionErrors, *, allowed: Sequence[Compressor],
                  gain: float, time_limit_s: float | None, keep_grouping: bool = False
                  ) -> tuple[Plan | None, str, dict[str, float | None]]:
    """Rank 0's decision on the errors measured now: the plan to take (None: keep `plan`), why, and the errors.
    With `keep_grouping` the new plan keeps the plan's groups and chooses each one's compressor only (a plan run
    inside DDP, whose buckets are fixed).

    Raises:
        PlannerError: the profile cannot be solved from, or no plan of `allowed` fits the budget.
    """
    # Rank 0 only, at a re-plan: a training job that never re-plans does not load the solvers.
    from planner.strategies.budget import (  # deferred: importing the runtime loads no strategies
        plan_error,
        resolve_budget,
    )
    from planner.strategies.mixed_plan import make_mixed_plan  # deferred: importing the runtime loads no strategies
    from planner.strategies.retune_plan import current_profile  # deferred: importing the runtime loads no strategies

    assert plan.error is not None and plan.error.budget is not None
    now = replace(current_profile(profile, cluster=plan.cluster), errors=errors)
    spec = plan.error.budget_of if plan.error.budget_of is not None else plan.error.budget
    budget = resolve_budget(now, spec)
    before = plan_error(now, plan.groups, [plan.compressor_of(g) for g in plan.groups], budget)
    # The runtime's top-k selector is the plan's first (it does not change with a re-plan); the rows beside the plan
    # are not solved (a re-plan takes the plan alone).
    selector = (plan.selector or "exact") if any(c.kind is CompressorKind.TOPK for c in allowed) else None
    candidate = make_mixed_plan(now, allowed, source=plan.source_profile, selector=selector,
                                time_limit_s=time_limit_s, error_budget=spec,
                                grouping=plan_grouping(plan, now) if keep_grouping else None, rows=False)
    after = candidate.error
    figures = {"before": None if before is None else before.predicted, "budget": budget[0],
               "after": None if after is None else after.predicted}
    same = [(g.params, plan.compressor_of(g), g.hierarchical) for g in plan.groups] == [
        (g.params, candidate.compressor_of(g), g.hierarchical) for g in candidate.groups]
    if same:
        return None, "the fastest plan within the budget is the one in use", figures
    if before is not None and before.predicted > budget[0]:
        return candidate, (f"the plan in use exceeds the budget on the gradients of now ({before.predicted:.3g} > "
                           f"{budget[0]:.3g})"), figures
    speedup = plan.predicted.iteration_s / candidate.predicted.iteration_s
    if speedup >= gain:
        return candidate, f"a plan within the budget is predicted {speedup:.2f}x faster", figures
    figures["after"] = figures["before"]
    return None, (f"the plan in use fits the budget; the fastest within it is predicted only {speedup:.2f}x faster "
                  f"(taken from {gain:.2f}x)"), figures


def replan_on_every_rank(plan: Plan, profile: Profile | None, watch: ErrorWatch, schedule: Replanning,
                         allowed: Sequence[Compressor], step: int, process_group: Any = None,
                         keep_grouping: bool = False) -> Replan:
    """After the last measured step of a period (collective: every rank calls it at the same point): gather the
    errors, rank 0 decides (`decide_replan`, from `profile`, which only rank 0 holds), every rank gets its decision
    as JSON. A decision rank 0 could not take keeps the plan in use, with a RuntimeWarning on every rank."""
    errors = watch.gather(process_group)
    world = dist.get_world_size(process_group) if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank(process_group) if world > 1 else 0
    payload: dict[str, Any] = {}
    if rank == 0:
        assert profile is not None
        try:
            new, reason, figures = decide_replan(plan, profile, errors, allowed=allowed, gain=schedule.gain,
                                                 time_limit_s=schedule.time_limit_s, keep_grouping=keep_grouping)
            payload = {"reason": reason, **figures, "plan": None if new is None else new.to_dict()}
        except PlannerError as exc:
            payload = {"reason": f"rank 0 could not re-plan, the plan in use is kept: {exc}", "plan": None}
    if world > 1:
        device = watch.device
        payload = broadcast_json(payload, group=process_group, device=device if device.type == "cuda" else None)
    data = payload.get("plan")
    if data is None and str(payload.get("reason", "")).startswith("rank 0 could not"):
        warnings.warn(payload["reason"], RuntimeWarning, stacklevel=3)
    return Replan(step=step, changed=data is not None, reason=str(payload.get("reason", "")),
                  error_before=payload.get("before"), error_after=payload.get("after"), budget=payload.get("budget"),
                  plan=None if data is None else Plan.from_dict(data))


def load_on_rank0(plan: Plan, profile: Profile | str | os.PathLike[str] | None, process_group: Any,
                  device: torch.device) -> Profile | None:
    """The profile a re-plan solves from, loaded on rank 0 (None elsewhere); every rank raises rank 0's error."""
    from planner.strategies.retune_plan import (  # deferred: importing the runtime loads no strategies
        load_source_profile,
    )

    rank = dist.get_rank(process_group) if dist.is_available() and dist.is_initialized() else 0
    loaded, reason = None, ""
    if rank == 0:
        try:
            loaded = load_source_profile(plan, profile)
        except (PlannerError, OSError) as exc:
            reason = f"adaptive re-planning needs the plan's profile on rank 0: {exc}"
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1:
        reason = broadcast_json(reason, group=process_group, device=device if device.type == "cuda" else None)
    if reason:
        raise PlannerError(reason)
    return loaded
