"""Run a plan inside DDP: the plan's groups as DDP's buckets, its compressors as one communication hook.

    hook = PlanHook.from_file(model, "plan.json")                        # or PlanHook(model, plan)
    ddp = DistributedDataParallel(model, **hook.ddp_kwargs()); hook.register(ddp)
    # top-k groups with momentum: SGD(..., momentum=0) and PlanHook(model, plan, momentum=0.9, optimizer=opt)

`ddp_kwargs()` gives DDP one bucket cap per group (`bucket_cap_mb_list`, torch >= 2.13), so that DDP's buckets
are the plan's groups, and `find_unused_parameters` as the plan's profile found. `register` installs one comm hook
that sends each bucket the way its group says: fp32 allreduce mean, fp16, PowerSGD at rank r, or top-k with error
feedback, with DGC momentum correction when given `momentum=`, with the arithmetic of `GradientExchange`
(`planner.kernels.compress`, `planner.kernels.topk`), flat or, for a group marked hierarchical, across hosts as
`GradientExchange` sends it (`planner.kernels.hierarchical`).

How the caps make the groups. DDP's reducer fills a bucket parameter by parameter and closes it once its bytes
reach the bucket's cap (the caps are used in turn; the last one repeats). A group of G bytes whose smallest
parameter holds m bytes gets the cap G - m // 2 bytes: the bucket reaches it only with its last parameter,
whichever of the group's parameters arrives last. DDP lays out buckets twice:

- at construction, in registration order (the order of `model.parameters()`), with the caps in that order;
- after the first iteration it rebuilds them in the order the gradients became ready, the plan's order, with the
  same caps, unless `find_unused_parameters=True` (without `static_graph`): then the first layout stays. With
  `static_graph` the parameters that got no gradient in the first iteration come last, in registration order.

So the caps follow the plan's groups in plan order (with static_graph, the parameters the plan records as never
used moved last), or, where DDP will not rebuild, the runs of each group's parameters in registration order (a
group split there is several buckets). With a cap list DDP makes no small
first bucket (its `_DEFAULT_FIRST_BUCKET_BYTES` goes with its default cap only). Before the final layout (iteration 0
when DDP rebuilds) every bucket is sent as an fp32 allreduce mean, as PyTorch's PowerSGD hook does before
`start_powerSGD_iter`. At the first iteration of the final layout the hook checks each bucket against the groups,
parameter for parameter; a bucket that is not exactly one group (a plan whose ready order differs from this run's,
or DDP built with other caps) is sent with the compressor of the group that holds most of its elements, and one
warning names those buckets.

A PowerSGD bucket waits for its first allreduce inside the hook before launching the second (as `GradientExchange`
waits at the same point): both are then issued from the backward thread, in the same order on every rank. Its
layout follows the plan, not the bucket: DDP may hold a group's parameters in another order (ready order after its
rebuild, registration order with find_unused_parameters) or split it, so each bucket is laid out as the part of its
group it holds (`PowerSGDLayout.of(..., held=...)`): every matrix takes the first Q and the places in the packed
buffers that `GradientExchange` gives it.

Hierarchical groups use the subgroups of each host and across hosts (`HostGroups`, made when the hook is built, on
every rank: `new_group` is collective), from `hosts=` or the ranks' host names as `GradientExchange`'s. A
hierarchical bucket's three steps (or top-k's merged exchange) run on a thread of its own that starts after the
previous hierarchical bucket's (`HierarchicalWork`), so every rank issues the subgroups' collectives in bucket
order; the hook's future completes when that thread is done. Flat buckets go on the parent group from the backward
thread as before: gloo orders collectives per group, so the two kinds do not need to interleave alike.

Momentum correction (`momentum=`, `nesterov=`, `optimizer=`) is `GradientExchange`'s, on the same quantity: DDP
hands the hook each bucket holding this rank's gradient (summed over its micro-batches, not yet divided), and the
velocity u = m u + g is taken of it before anything is divided or sent, as the exchange takes it of its group's
local gradient. The optimizer is checked by the exchange's own checks. DDP's warm-up iteration applies none (its
buckets are not the final ones, whose velocities start at zero).

Under `ddp.no_sync()` DDP calls no hook: gradients accumulate locally and the next synced backward sends their
sum; `iteration` counts synced iterations only.

Re-planning as training goes (`adaptive=`, `planner.runtime.adaptive`): DDP's buckets are fixed once laid out, so
a re-plan keeps the plan's groups and chooses each one's compressor again under the plan's error budget
(`decide_replan(keep_grouping=True)`, exact). Over the measured iterations of a period the hook hands each bucket's
local gradient (`GradBucket.gradients()`, before momentum or averaging) to the `ErrorWatch`; the decision is taken
at the first bucket of the next synced iteration, before any of its collectives (every rank reaches it at the same
point): the errors are gathered, rank 0 re-solves, every rank takes its decision. A plan taken flushes the error fed
back (top-k residuals and PowerSGD errors, averaged over the ranks) into that iteration's averaged gradients, bucket
by bucket, so nothing held back is lost; momentum velocities stay with their buckets (the same parameters).
"""

from __future__ import annotations

import inspect
import math
import os
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from planner.contracts.plan import Plan
from planner.costmodel.problem import topk_count
from planner.kernels.compress import PowerSGDLayout
from planner.kernels.hierarchical import HostGroups
from planner.platform.hosts import host_names, ranks_by_host
from planner.runtime.adaptive import Replanning
from planner.runtime.attach import resolve_plan
from planner.runtime.codecs import Codec, DenseCodec, Link, make_codec
from planner.runtime.engine import (
    Engine,
    EngineDriver,
    StateCheck,
    check_adaptive,
    check_momentum_options,
    find_unused,
    name_list,
    planned_params,
    world_size_of,
)
from planner.runtime.online_race import OnlineRace, OnlineRaceResult, RaceSchedule, bucket_arms, check_race, saved_race
from planner.types import Compressor, CompressorKind, PlanMismatchError

__all__ = ["STATE_KIND", "SUPPORTED_KINDS", "PlanHook", "bucket_caps", "plan_hook", "trainable_ids"]

STATE_KIND = "runtime.plan_hook"

#: The group kinds the hook sends.
SUPPORTED_KINDS = (CompressorKind.DENSE, CompressorKind.FP16, CompressorKind.POWERSGD, CompressorKind.TOPK)

#: Bytes in DDP's MB (`bucket_cap_mb` is in MiB).
_MIB = 1 << 20

_RUN_ELSEWHERE = "run it with GradientExchange(model, plan) instead of DDP"


def _has_cap_list() -> bool:
    """Whether this torch's DDP takes one cap per bucket (`bucket_cap_mb_list`, torch >= 2.13)."""
    return "bucket_cap_mb_list" in inspect.signature(DistributedDataParallel.__init__).parameters


def bucket_caps(runs: Sequence[Sequence[int]]) -> list[float]:
    """The `bucket_cap_mb_list` that closes one DDP bucket per run of parameter sizes (bytes, in the order DDP
    fills them): per run, its bytes less half its smallest parameter's, in MiB (exact: a power of two divides)."""
    caps = []
    for sizes in runs:
        nonzero = [s for s in sizes if s > 0]
        total = sum(nonzero)
        caps.append((total - (min(nonzero) // 2 if nonzero else 0)) / _MIB)
    return caps


@dataclass(frozen=True)
class _Route:
    """How one DDP bucket is sent: its parameters' names, the group it is (None: not exactly one group), the
    group holding most of its elements, and that group's compressor, top-k count, PowerSGD seed and whether it
    crosses hosts hierarchically."""

    names: tuple[str, ...]
    group: int | None
    majority: int
    compressor: Compressor
    k: int | None
    seed: int
    hierarchical: bool = False


class PlanHook(EngineDriver):
    """A plan as DDP keyword arguments and one DDP communication hook; see the module docstring.

    Construct it on every rank, with the same plan, before DDP (`ddp_kwargs()` feeds DDP's constructor), then
    `register` it on the DDP module. Supports plans whose groups are sent dense, fp16, PowerSGD or top-k, flat or
    hierarchically across hosts; K-FAC and ABS-SGD plans are refused (`GradientExchange` runs them).

    Args:
        model: the module the plan was made for (the one DDP will wrap).
        plan: the plan; its model fingerprint and world size must match.
        process_group: the group DDP averages over (default: the default group).
        find_unused_parameters: as `GradientExchange`'s: default None, as the plan says (on where the plan's profile
            found parameters without a gradient, with a RuntimeWarning naming them); False with such a plan is
            refused.
        auto_retune: re-plan when the plan was made for another world size, backend or kind of device (see
            `GradientExchange`).
        profile: the profile to re-plan from with `auto_retune` (default the plan's source).
        hosts: the ranks (of the process group) on each host, for the plan's hierarchical groups, as
            `GradientExchange`'s: default read from the ranks' host names. Its length must be the plan's host count.
        momentum: DGC momentum correction, as `GradientExchange`'s, `0 <= momentum < 1`: a velocity u per bucket,
            u = m u + g on this rank's gradient g before anything is sent; a top-k bucket selects from v += u and
            clears u where it sent (momentum factor masking, except at k == numel), a dense, fp16 or PowerSGD
            bucket sends u. Needs `optimizer`. Not applied in DDP's warm-up iteration (see the module docstring).
        nesterov: DGC's Nesterov variant, as `GradientExchange`'s: send from g + m u.
        optimizer: the optimizer that steps the model, checked as `GradientExchange` checks it (and again at every
            `step()`, through a step pre-hook): with `momentum`, its param groups holding planned parameters must
            have momentum 0; without, it must have none on the parameters of the plan's top-k groups (pass the
            momentum here instead). Required with momentum > 0.
        adaptive: re-plan as training goes (see the module docstring): True, or a `Replanning` to say when. A mixed
            plan solved with an error budget only. Its groups stay (DDP's buckets); each one's compressor is chosen
            again among the plan's allowed ones (top-k left out where `optimizer` applies momentum itself). Rank 0
            needs `profile` (default the plan's source profile). `self.plan` is the plan in use, `self.replans` what
            each re-plan decided; `state_dict()` holds the plan in use and `load_state_dict` takes it back.
        race: race the plan against the same buckets each sent dense and each sent fp16 (what DDP and its fp16 hook
            send) in the first iterations of training (`planner.runtime.online_race`; DDP's buckets are fixed, so
            the arms differ in what each bucket sends): True, or an `OnlineRace` to say how. As
            `GradientExchange(race=...)`: every iteration trains, every rank commits to the arm kept and says so in
            one log line, `self.race` holds the result and `self.plan` the plan kept, and `state_dict()` holds the
            arm. Each step is timed from one iteration's last bucket to the next. Not with `adaptive`.

    Raises:
        PlanMismatchError: the plan was made for another model or cluster, its parameters are not the model's
            trainable ones, or it has what the hook does not run (named in the message).
        ValueError: find_unused_parameters=False with a plan that records unused parameters; momentum out of range,
            nesterov without momentum, momentum without an optimizer, or an optimizer that applies momentum
            itself (with `momentum`, or on top-k groups); `adaptive` with a plan that is not mixed or has no error
            budget; `race` with `adaptive`.
        PlannerError: `adaptive` and rank 0 cannot load the profile to re-plan from.
    """

    __slots__ = ("_arm", "_arms", "_carry", "_checked", "_codecs", "_engine", "_final_iteration", "_iteration", "_link",
                 "_names_of", "_pending", "_race_clock", "_race_config", "_race_due", "_race_mark", "_racing",
                 "_replan_due", "_routes", "_seeds", "_selector", "_shapes", "_static", "_velocities",
                 "find_unused_parameters", "model", "momentum", "nesterov", "process_group", "race")

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        *,
        process_group: Any = None,
        find_unused_parameters: bool | None = None,
        auto_retune: bool = False,
        profile: Any = None,
        hosts: Sequence[Sequence[int]] | None = None,
        momentum: float = 0.0,
        nesterov: bool = False,
        optimizer: torch.optim.Optimizer | None = None,
        adaptive: bool | Replanning = False,
        race: bool | OnlineRace = False,
    ) -> None:
        _check_supported(plan)
        check_momentum_options(momentum, nesterov, optimizer, "PlanHook")
        race_config = check_race(plan, race, adaptive, None, None, needs_runners_up=False)
        schedule = check_adaptive(plan, adaptive, None, None)
        layout = None if hosts is None else [list(h) for h in hosts]
        plan = resolve_plan(plan, model, process_group=process_group, auto_retune=auto_retune, profile=profile,
                            host_count=None if layout is None else len(layout))
        _check_supported(plan)  # a re-tuned plan too
        params = planned_params(model, plan)
        planned = set(plan.param_order)
        kinds = sorted({(str(p.dtype), str(p.device)) for n, p in params.items() if n in planned})
        if len(kinds) > 1:
            found = ", ".join(f"{d} on {v}" for d, v in kinds)
            raise PlanMismatchError(
                f"the planned parameters are of several dtypes or devices ({found}), which DDP buckets apart, so "
                f"its buckets cannot be the plan's groups; {_RUN_ELSEWHERE}"
            )
        self.model = model
        self.process_group = process_group
        self.find_unused_parameters = find_unused(plan, find_unused_parameters)
        self._names_of = {id(p): n for n, p in params.items() if n in planned}
        self._shapes = {n: tuple(p.shape) for n, p in params.items() if n in planned}
        self.momentum = float(momentum)
        self.nesterov = nesterov
        self._selector = plan.selector or "exact"
        self._seeds = _powersgd_seeds(plan)
        self._iteration = 0
        self._final_iteration = 1
        self._checked = False
        self._static = False
        self._routes: dict[int, _Route] = {}
        self._codecs: dict[int, Codec] = {}  # per bucket of the final layout, made as it first arrives
        self._velocities: dict[int, Tensor] = {}
        self._pending: dict[int, dict[str, Any]] = {}
        # Hierarchical groups: the subgroups of each host and across hosts, made here, before DDP, on every rank
        # (`new_group` is collective), as GradientExchange makes them.
        self._link = Link(process_group, world_size_of(process_group))
        crosses = any(g.hierarchical for g in plan.groups)
        if schedule is not None:  # a re-plan may send a group across hosts hierarchically
            crosses = crosses or plan.cluster.host_count > 1
        if crosses and dist.is_initialized() and dist.get_world_size(process_group) > 1:
            if layout is None:
                layout = ranks_by_host(host_names(process_group))
            self._link.host_groups = HostGroups.build(layout, process_group)
        # Adaptive re-planning (the engine's): the measured iteration whose errors await a decision, and per bucket
        # the error fed back, flushed into its next average.
        self._replan_due: int | None = None
        self._carry: dict[int, Tensor] = {}
        device = next((p.device for n, p in params.items() if n in planned), torch.device("cpu"))
        self._engine = Engine(plan, params, self._link, owner="PlanHook", momentum=self.momentum, nesterov=nesterov,
                              optimizer=optimizer, schedule=schedule, profile=profile, model=model, device=device)
        #: The race in the first iterations: its result once decided (`race=`; None before, or without a race).
        self.race: OnlineRaceResult | None = None
        self._race_config = race_config
        self._arms: dict[str, Plan] = bucket_arms(plan) if race_config is not None else {}
        self._arm = "plan"
        self._racing: RaceSchedule | None = None
        self._race_due: str | None = None  # "round" or "switch": at the next iteration's first bucket
        self._race_mark: float | None = None
        self._race_clock = 0.0
        if race_config is not None:
            self._racing = RaceSchedule(list(self._arms), race_config, start="plan")

    @classmethod
    def from_file(cls, model: nn.Module, path: str | os.PathLike[str], **kwargs: Any) -> PlanHook:
        """Load the plan at `path` (validated, see `Plan.load`) and build the hook."""
        return cls(model, Plan.load(path), **kwargs)

    def remove_hooks(self) -> None:
        """Remove the optimizer's step pre-hook (DDP keeps the comm hook for as long as it lives)."""
        self._engine.remove_hooks()

    # -- DDP's arguments --------------------------------------------------------------------------
    def _registration_order(self) -> list[str]:
        """The planned parameters in the order DDP takes them (`model.parameters()`, trainable, each once)."""
        return [self._names_of[id(p)] for p in self.model.parameters() if id(p) in self._names_of]

    def bucket_runs(self, *, static_graph: bool = False) -> list[list[str]]:
        """The parameters of each bucket the caps of `ddp_kwargs()` make, in the order DDP fills them: the plan's
        groups in plan order; with static_graph, the parameters the plan's profile never saw a gradient for
        moved last (DDP's final layout puts them there), each group's in a run of its own; where DDP keeps its
        first layout (find_unused_parameters without static_graph), each run of one group's parameters in
        registration order."""
        if static_graph:
            never = self._never_used()
            used = [[n for n in g.params if n not in never] for g in self.plan.groups]
            return [run for run in used if run] + self._runs([n for n in self._registration_order() if n in never])
        if not self.find_unused_parameters:
            return [list(g.params) for g in self.plan.groups]
        return self._runs(self._registration_order())

    def _runs(self, names: Sequence[str]) -> list[list[str]]:
        """`names` cut where the group changes."""
        group_of = self._group_of()
        runs: list[list[str]] = []
        last = None
        for name in names:
            if group_of[name] != last:
                runs.append([])
                last = group_of[name]
            runs[-1].append(name)
        return runs

    def _never_used(self) -> set[str]:
        """The planned parameters the plan's profile saw no gradient for in any batch."""
        unused = self.plan.unused_params
        return set(unused.never) & set(self._names_of.values()) if unused is not None else set()

    def ddp_kwargs(self, *, static_graph: bool = False) -> dict[str, Any]:
        """Keyword arguments of `DistributedDataParallel` that make its buckets the plan's groups:
        `bucket_cap_mb_list` (one cap per bucket, see `bucket_runs`), `find_unused_parameters` as the plan says,
        and `gradient_as_bucket_view=True` (the hook writes each average into the bucket in place, so the
        gradients need no copy; every planned parameter is dense and of one dtype, checked at construction).
        Pass `static_graph=True` here rather than to DDP alone: it changes when DDP lays out its buckets, so the
        caps with it. On a torch without `bucket_cap_mb_list` (before 2.13) the median cap is given as
        `bucket_cap_mb`, with a warning. With static_graph, DDP finds the unused parameters itself (so
        `find_unused_parameters` is False: DDP warns if given both) and its final layout puts the parameters that
        got no gradient in its first iteration last, in registration order: the caps follow that for the
        parameters the plan records as never used (`bucket_runs`), so a group of used parameters only is still one
        bucket, and a group that holds never-used parameters beside used ones is two, each sent with the
        group's compressor (the hook expects them and does not warn)."""
        params = dict(self.model.named_parameters())
        runs = self.bucket_runs(static_graph=static_graph)
        caps = bucket_caps([[params[n].numel() * params[n].element_size() for n in run] for run in runs])
        kwargs: dict[str, Any] = {"bucket_cap_mb_list": caps,
                                  "find_unused_parameters": self.find_unused_parameters and not static_graph,
                                  "gradient_as_bucket_view": True}
        if not _has_cap_list():
            del kwargs["bucket_cap_mb_list"]
            kwargs["bucket_cap_mb"] = statistics.median(caps)
            warnings.warn(
                f"this torch ({torch.__version__}) has no bucket_cap_mb_list (torch >= 2.13), so DDP gets one "
                f"bucket_cap_mb={kwargs['bucket_cap_mb']:.4g} (the median group's) and its buckets are not the plan's "
                "groups: each is sent with the compressor of the group holding most of its elements; install torch "
                ">= 2.13 to send the plan's groups", RuntimeWarning, stacklevel=2,
            )
        if static_graph:
            kwargs["static_graph"] = True
        return kwargs

    # -- registering ------------------------------------------------------------------------------
    def register(self, ddp_model: nn.Module) -> None:
        """Register the hook on `ddp_model`, before its first step: the DDP module wrapping this hook's model, or
        a module holding exactly its trainable parameters in the same order (a framework's wrapper of it, as a
        LightningModule holds the network the plan was made for)."""
        if not isinstance(ddp_model, DistributedDataParallel):
            raise TypeError(f"register needs the DistributedDataParallel module, but got {type(ddp_model).__name__}; "
                            "build it with DistributedDataParallel(model, **hook.ddp_kwargs())")
        if ddp_model.module is not self.model and trainable_ids(ddp_model.module) != trainable_ids(self.model):
            raise PlanMismatchError("the DDP module wraps another model than this hook's (not the same trainable "
                                    "parameters in the same order); build the hook with the model DDP wraps "
                                    "(ddp.module)")
        if self.find_unused_parameters and not (ddp_model.find_unused_parameters or ddp_model.static_graph):
            assert self.plan.unused_params is not None
            raise PlanMismatchError(
                f"the plan's profile found parameters without a gradient ({name_list(self.plan.unused_params.names)})"
                ", but DDP was built with find_unused_parameters=False; build it with **hook.ddp_kwargs()"
            )
        if self._link.host_groups is not None and self.process_group is None and ddp_model.process_group is not None \
                and ddp_model.process_group is not dist.group.WORLD:
            raise PlanMismatchError("DDP averages over another process group than the one this hook made its host "
                                    "groups for; pass DDP's process_group to PlanHook too")
        if ddp_model.process_group is not None and self.process_group is None:
            self.process_group = ddp_model.process_group
        self._link.process_group = self.process_group
        self._link.world_size = dist.get_world_size(self.process_group)
        # DDP keeps its first layout with find_unused_parameters (unless the graph is static); else it rebuilds
        # its buckets in ready order after iteration 0.
        keeps = ddp_model.find_unused_parameters and not ddp_model.static_graph
        self._final_iteration = 0 if keeps else 1
        self._static = bool(ddp_model.static_graph)
        ddp_model.register_comm_hook(self, plan_hook)

    @property
    def buckets(self) -> list[tuple[str, ...]]:
        """The parameters of each DDP bucket of the final layout, by bucket index (empty until the hook sees it)."""
        return [self._routes[i].names for i in sorted(self._routes)]

    @property
    def bucket_groups(self) -> list[int | None]:
        """Per bucket of `buckets`: the plan group it is exactly, or None (sent as its majority group)."""
        return [self._routes[i].group for i in sorted(self._routes)]

    @property
    def iteration(self) -> int:
        """Iterations the hook has sent since it was created (not saved: a new DDP module lays out again)."""
        return self._iteration

    # -- routing ----------------------------------------------------------------------------------
    def _route(self, index: int, params: Sequence[Tensor]) -> _Route:
        return self._route_of(tuple(self._names_of[id(p)] for p in params), self.plan, self._seeds)

    def _route_of(self, names: tuple[str, ...], plan: Plan, seeds: Sequence[int]) -> _Route:
        """How `plan` sends a bucket of the parameters `names` (its PowerSGD seeds: `seeds`)."""
        held: dict[int, int] = {}
        group_of = _group_of(plan)
        for name in names:
            held[group_of[name]] = held.get(group_of[name], 0) + math.prod(self._shapes[name])
        majority = max(held, key=lambda i: (held[i], -i))
        group = plan.groups[majority]
        exact = set(names) == set(group.params)
        compressor = plan.compressor_of(group)
        numel = sum(held.values())
        k = None
        if compressor.kind is CompressorKind.TOPK:
            assert compressor.density is not None
            k = group.k if exact and group.k is not None else topk_count(numel, compressor.density)
        return _Route(names=names, group=majority if exact else None, majority=majority, compressor=compressor, k=k,
                      seed=seeds[majority], hierarchical=group.hierarchical and self._link.host_groups is not None)

    def _expected_part(self, route: _Route) -> bool:
        """Whether the bucket is the part of one group that static_graph lays out apart (`bucket_runs`): all its
        used parameters, or all its never-used ones."""
        if not self._static:
            return False
        never = self._never_used()
        group = set(self.plan.groups[route.majority].params)
        return set(route.names) in ({n for n in group if n not in never}, group & never)

    def _group_of(self) -> dict[str, int]:
        return _group_of(self.plan)

    def _report(self) -> None:
        """Warn once, in one line, about the buckets that are not exactly one of the plan's groups."""
        self._checked = True
        odd = [(i, r) for i, r in sorted(self._routes.items()) if r.group is None and not self._expected_part(r)]
        if not odd:
            return
        group_of = self._group_of()
        parts = []
        for i, r in odd[:3]:
            groups = sorted({group_of[n] for n in r.names})
            where = f"spans groups {groups}" if len(groups) > 1 else f"is part of group {groups[0]}"
            parts.append(f"bucket {i} [{name_list(list(r.names), 2)}] {where}")
        more = f" and {len(odd) - 3} more" if len(odd) > 3 else ""
        warnings.warn(
            f"DDP's buckets are not the plan's groups: {'; '.join(parts)}{more}; each such bucket is sent with the "
            "compressor of the group holding most of its elements. Build DDP with **hook.ddp_kwargs(), and re-plan "
            "if this run's gradients become ready in another order than the profile's",
            RuntimeWarning, stacklevel=2,
        )

    # -- sending ----------------------------------------------------------------------------------
    def send(self, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        """Send one bucket (the body of `plan_hook`): an fp32 allreduce mean before DDP's final layout, then with
        the codec of its route."""
        index = bucket.index()
        step = self._iteration
        final = step >= self._final_iteration
        if self._replan_due is not None:  # the first bucket of the iteration after a measured period: decide
            self._replan(self._replan_due)
        if self._race_due is not None:  # the first bucket of the iteration after a race's step: its next arm
            self._race_turn(bucket.buffer().device)
        if final and index not in self._routes:
            self._routes[index] = self._route(index, bucket.parameters())
        watch = self._engine.watch if final and self._engine.watch is not None and \
            self._engine.watch.measuring(step) else None
        if watch is not None:  # this rank's gradients, before momentum or averaging
            for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
                watch.take(param, grad)
        if bucket.is_last():  # DDP calls the hook bucket by bucket in order; the last one ends the iteration
            if final and not self._checked:
                self._report()
            if final and self._racing is not None:
                self._race_step()
            self._iteration += 1
            if watch is not None and watch.observe(step):
                self._replan_due = step
        flat = bucket.buffer()
        if not final:  # DDP's first layout is not the groups': every bucket flat, in fp32
            return self._send(DenseCodec(flat.numel(), self._link.world_size, hierarchical=False), flat, None)
        route = self._routes[index]
        codec = self._codecs.get(index)
        if codec is None:
            codec = self._codecs[index] = self._codec(index, route, flat)
        velocity = None
        if self.momentum > 0:
            velocity = self._velocities.get(index)
            if velocity is None:
                velocity = self._velocities[index] = self._restore_velocity(index, route, flat)
        sent = self._send(codec, flat, velocity)
        carry = self._carry.pop(index, None)
        if carry is None:
            return sent

        def _add_carry(f: torch.futures.Future[Tensor]) -> Tensor:
            out = f.value()
            return out.add_(carry.to(out.dtype))

        return sent.then(_add_carry)

    def _send(self, codec: Codec, flat: Tensor, velocity: Tensor | None) -> torch.futures.Future[Tensor]:
        """Send the bucket `flat` (this rank's gradient, summed over its micro-batches) with `codec`, folded into
        `velocity` first when there is one (the engine's momentum correction); a future of `flat` holding the
        average. A plain dense or fp16 bucket is sent in its own dtype, as DDP's hooks send it; everything else works
        in fp32 (a copy of a bucket of another dtype, copied back)."""
        plain = velocity is None
        in_place = flat.dtype == torch.float32 or (plain and codec.kind in (CompressorKind.DENSE, CompressorKind.FP16))
        work = flat if in_place else flat.float()
        if plain:
            codec.take_flat(work)
        self._engine.prepare(codec, work, velocity, taken=plain)
        handle = codec.launch(self._link, work)

        def _finish(f: torch.futures.Future[Any] | None = None) -> Tensor:
            if f is not None:
                f.value()  # re-raises what the collective raised
            codec.finish(work)
            if work is not flat:
                flat.copy_(work)
            return flat

        if handle is None:  # one worker: nothing was sent
            done: torch.futures.Future[Tensor] = torch.futures.Future()
            done.set_result(_finish())
            return done
        return handle.get_future().then(_finish)

    def _codec(self, index: int, route: _Route, flat: Tensor) -> Codec:
        """Bucket `index`'s codec, as its route says, with what a loaded state saved for it (same parameters)."""
        kind = route.compressor.kind
        if kind not in SUPPORTED_KINDS:
            raise PlanMismatchError(f"a bucket is sent by {kind}, which the hook does not run; {_RUN_ELSEWHERE}")
        layout = self._powersgd_layout(route, self.plan) if kind is CompressorKind.POWERSGD else None
        codec = make_codec(route.compressor, flat.numel(), self._link.world_size, flat.device,
                           hierarchical=route.hierarchical, k=route.k, selector=self._selector, layout=layout,
                           seed=route.seed)
        fresh = codec.state()  # what the codec keeps, to match a saved entry against (nothing for dense and fp16)
        entry = self._saved(index, route, set(fresh)) if fresh else None
        if entry is not None and all(entry[key].shape == value.shape for key, value in fresh.items()
                                     if isinstance(value, Tensor)):
            codec.load(entry)
        return codec

    # -- the race in the first iterations ------------------------------------------------------
    def _race_step(self) -> None:
        """At an iteration's last bucket while racing: time the iteration (from the last one's last bucket), and say
        what the next iteration's first bucket does: the round's all-reduce, or a switch to the next arm."""
        racing = self._racing
        assert racing is not None
        now = time.perf_counter()
        if self._race_mark is None:
            self._race_clock = now
        if racing.after_step(None if self._race_mark is None else now - self._race_mark):
            self._race_due = "round"
        elif racing.current != self._arm:
            self._race_due = "switch"
        self._race_mark = now

    def _race_turn(self, device: torch.device) -> None:
        """Before the first collective of an iteration: at a round's end, the ranks' slowest times and the rule's
        decision (the arm kept, committed and said in one log line); then the arm the schedule says next."""
        due, self._race_due = self._race_due, None
        racing = self._racing
        assert racing is not None
        if due == "round":
            decided = racing.end_round(time.perf_counter() - self._race_clock, device, self.process_group,
                                       self._link.world_size)
            if decided is not None:
                self.race, self._racing = decided, None
                self._race_switch(decided.kept)
                return
        self._race_switch(racing.current)
        self._race_mark = time.perf_counter()  # the switch is not the next iteration's (its first: untimed anyway)

    def _race_switch(self, arm: str) -> None:
        if arm != self._arm:
            plan = self._arms[arm]
            self._selector = plan.selector or "exact"
            self._adopt(plan, flush=True)
            self._arm = arm

    # -- adaptive re-planning --------------------------------------------------------------------
    def _replan(self, step: int) -> None:
        """Gather the errors of the period that ended at iteration `step`, let rank 0 decide, take its decision on
        every rank (called at the first bucket of the next synced iteration, before its collectives)."""
        self._replan_due = None
        plan = self._engine.replan(step, keep_grouping=True)
        if plan is not None:
            self._adopt(plan, flush=True)

    def _adopt(self, plan: Plan, *, flush: bool) -> None:
        """Send with `plan` from now on: the same groups (DDP's buckets), each with its new compressor. With `flush`,
        the error fed back is averaged over the ranks and added to each bucket's next average; the codecs start
        afresh, the momentum velocities stay (the same parameters per bucket)."""
        self._engine.check_adoptable(plan, same_groups=True)
        if flush:
            self._flush_error_feedback()
        self._codecs.clear()
        self._engine.adopt(plan)
        self._seeds = _powersgd_seeds(plan)
        self._routes.clear()  # made again, bucket by bucket, as the buckets arrive

    def _flush_error_feedback(self) -> None:
        """Every rank's error fed back (top-k residuals, PowerSGD errors), averaged over the ranks (one allreduce),
        kept per bucket to be added to its next average."""
        held = [(index, error) for index, codec in self._codecs.items() if (error := codec.error()) is not None]
        for (index, _), mean in zip(held, self._engine.mean_over_ranks([e for _, e in held]), strict=True):
            self._carry[index] = self._carry[index] + mean if index in self._carry else mean.clone()

    def _powersgd_layout(self, route: _Route, plan: Plan) -> PowerSGDLayout:
        """The bucket's PowerSGD layout (`route` of `plan`, sent by PowerSGD), in the plan's order whatever the
        bucket's: a bucket of one group's parameters (all of them, or the part DDP put in it) is that group's
        tensors held in the bucket's order, so each takes the first Q and the places in the packed buffers that
        GradientExchange gives it; a bucket spanning groups is its own tensors in plan order."""
        assert route.compressor.rank is not None
        group_of = _group_of(plan)
        homes = {group_of[n] for n in route.names}
        if len(homes) == 1:
            universe = list(plan.groups[homes.pop()].params)
        else:
            position = {n: i for i, n in enumerate(plan.param_order)}
            universe = sorted(route.names, key=position.__getitem__)
        at = {n: i for i, n in enumerate(universe)}
        return PowerSGDLayout.of([self._shapes[n] for n in universe], route.compressor.rank,
                                 held=[at[n] for n in route.names])

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Copies of this rank's top-k residuals, momentum velocities and PowerSGD errors and Qs, by DDP bucket,
        each with its parameters' names (a resumed run's buckets are matched by them)."""
        buckets: dict[int, dict[str, Any]] = {}

        def entry(index: int) -> dict[str, Any]:
            return buckets.setdefault(index, {"params": list(self._routes[index].names)})

        for index, codec in self._codecs.items():
            saved = codec.state()
            if saved:
                entry(index).update(saved)
        for index, velocity in self._velocities.items():
            entry(index)["velocity"] = velocity.detach().clone()
        state: dict[str, Any] = {"kind": STATE_KIND, "model_fingerprint": self.plan.model.fingerprint,
                                 "buckets": buckets}
        if self._engine.schedule is not None:  # the plan in use: a resumed adaptive run continues with it
            state["plan"] = self.plan.to_dict()
        if self._race_config is not None:  # the arm in use, and what the race decided: a resumed run keeps them
            state["race_arm"] = self._arm
            if self.race is not None:
                state["race"] = self.race.to_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep what `state_dict` saved, for the buckets of the final layout: each bucket of the same parameters
        continues from it (restored when it is first compressed); a bucket of other parameters starts afresh. As
        GradientExchange's: every entry's type and shape is checked before anything changes (PlanMismatchError, one
        line), a state without velocities gives a hook with momentum zero velocities, a state with velocities is
        refused by a hook without momentum, which would drop them, and with `adaptive` the plan the state holds is
        taken (checked as the first plan was, with the same groups)."""
        kind = state.get("kind") if isinstance(state, dict) else type(state).__name__
        if kind != STATE_KIND:
            raise PlanMismatchError(f"not a PlanHook state: kind is {kind!r}, expected {STATE_KIND!r}")
        check = StateCheck("hook", "load the state PlanHook.state_dict() saved with this plan, or start without one")
        check.fingerprint(state, self.plan)
        buckets = check.mapping(state.get("buckets"), "buckets")
        with_velocity = sorted(i for i, e in buckets.items() if isinstance(e, dict) and "velocity" in e)
        if with_velocity and self.momentum == 0:
            raise PlanMismatchError(
                f"this hook state holds momentum velocities for buckets {with_velocity}, but the hook has momentum=0; "
                "pass the momentum it was saved with, or start without the state"
            )
        plan = self.plan
        if self._engine.schedule is not None and "plan" in state:
            plan = check.plan(state["plan"], self.plan, world_size_of(self.process_group), same_groups=True)
            _check_supported(plan)
        config = self._race_config
        arm, raced = saved_race(state, check, self._arms) if config is not None else (None, None)
        if arm is not None:
            plan = self._arms[arm]
        seeds = _powersgd_seeds(plan)
        pending = {i: self._checked_entry(check, i, entry, plan, seeds) for i, entry in buckets.items()}
        if arm is not None and config is not None:  # decided: no race; mid-race: it starts again from the arm in use
            if arm != self._arm:
                self._selector = plan.selector or "exact"
                self._adopt(plan, flush=False)
                self._arm = arm
            self.race = raced
            self._racing = None if raced is not None else RaceSchedule(list(self._arms), config, start=arm)
            self._race_mark = None
        elif plan is not self.plan and plan.to_dict() != self.plan.to_dict():  # everything checked: now take it
            self._adopt(plan, flush=False)
        self._pending = pending
        self._codecs.clear()
        self._velocities.clear()

    def _checked_entry(self, check: StateCheck, index: int, value: Any, plan: Plan, seeds: Sequence[int]
                       ) -> dict[str, Any]:
        """Bucket `index`'s saved entry, checked (its parameters this model's planned ones, each buffer a flat
        tensor of their elements, PowerSGD's Q of the size `plan` gives it), as copies."""
        where = f"bucket {index}'s state"
        entry = check.entry(value, where)
        extra = sorted(map(str, set(entry) - {"params", "residual", "velocity", "error", "q", "fresh"}))
        if extra:
            raise check.refuse(f"{where} holds {extra}, which PlanHook.state_dict() does not save")
        names = entry.get("params")
        if (not isinstance(names, list | tuple) or not names or not all(isinstance(n, str) for n in names)
                or len(set(names)) != len(names)):
            raise check.refuse(f"{where} must name its parameters (a list of distinct names), but got {names!r}")
        unknown = [n for n in names if n not in self._shapes]
        if unknown:
            raise check.refuse(f"{where} names {name_list(unknown)}, which are not this model's planned parameters")
        names = tuple(names)
        numel = sum(math.prod(self._shapes[n]) for n in names)
        out: dict[str, Any] = {"params": list(names)}
        for key in ("residual", "velocity", "error"):
            if key in entry:
                out[key] = check.tensor(entry[key], f"bucket {index}'s {key}", numel).detach().clone()
        powersgd = {"error", "q", "fresh"} & set(entry)
        if powersgd and powersgd != {"error", "q", "fresh"}:
            raise check.refuse(f"{where} must hold PowerSGD's error, q and fresh together, but holds "
                               f"{sorted(powersgd)}")
        if powersgd:
            route = self._route_of(names, plan, seeds)
            # a bucket `plan` does not send by PowerSGD never restores its Q: any flat one then
            q_numel = self._powersgd_layout(route, plan).q_numel if route.compressor.kind is CompressorKind.POWERSGD \
                else None
            out["q"] = check.tensor(entry["q"], f"bucket {index}'s q", q_numel).detach().clone()
            out["fresh"] = check.flag(entry["fresh"], f"bucket {index}'s fresh")
        return out

    def _saved(self, index: int, route: _Route, keys: set[str]) -> dict[str, Any] | None:
        """Take `keys` of bucket `index`'s saved entry, when it was saved for the same parameters. Each key is taken
        once (a top-k or PowerSGD bucket with momentum restores its velocity and its residual or error apart)."""
        entry = self._pending.get(index)
        if entry is None:
            return None
        if tuple(entry.get("params", ())) != route.names:
            del self._pending[index]
            return None
        if not keys <= set(entry):
            return None
        taken = {key: entry.pop(key) for key in keys}
        if set(entry) <= {"params"}:
            del self._pending[index]
        return taken

    def _restore_velocity(self, index: int, route: _Route, flat: Tensor) -> Tensor:
        """Bucket `index`'s velocity (fp32): as a loaded state saved it for the same parameters, else zeros."""
        entry = self._saved(index, route, {"velocity"})
        if entry is not None and entry["velocity"].shape == flat.shape:
            return entry["velocity"].to(device=flat.device, dtype=torch.float32)
        return torch.zeros_like(flat, dtype=torch.float32)


def _powersgd_seeds(plan: Plan) -> list[int]:
    """PowerSGD's first random Qs: one seed per PowerSGD group in plan order, as GradientExchange draws them."""
    seeds = np.random.RandomState(0)
    return [int(seeds.randint(1_000_000_000)) if plan.compressor_of(g).kind is CompressorKind.POWERSGD else 0
            for g in plan.groups]


def _group_of(plan: Plan) -> dict[str, int]:
    """Each planned parameter's group index."""
    return {n: i for i, g in enumerate(plan.groups) for n in g.params}


def trainable_ids(module: nn.Module) -> list[int]:
    """The identities of `module`'s trainable parameters, in the order DDP takes them."""
    return [id(p) for p in module.parameters() if p.requires_grad]


def plan_hook(state: PlanHook, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP communication hook: send `bucket` as `state`'s plan says (`PlanHook.send`)."""
    return state.send(bucket)


# DDP's register_comm_hook compares the annotations with the real objects; `from __future__ import annotations`
# leaves strings, so resolve them here.
plan_hook.__annotations__.update(
    {"state": PlanHook, "bucket": dist.GradBucket, "return": torch.futures.Future[Tensor]}
)


def _check_supported(plan: Plan) -> None:
    """Refuse, in one line, a plan with what the hook does not run."""
    supported = "PlanHook runs plans of dense, fp16, PowerSGD and top-k groups (flat or across hosts)"
    what = None
    if plan.kfac is not None:
        what = "is a K-FAC plan"
    elif plan.abs is not None:
        what = "is an ABS-SGD plan"
    else:
        kinds = sorted({str(plan.compressor_of(g)) for g in plan.groups
                        if plan.compressor_of(g).kind not in SUPPORTED_KINDS})
        if kinds:
            what = f"sends groups by {', '.join(kinds)}"
    if what is not None:
        raise PlanMismatchError(f"{supported}, but this plan {what}; {_RUN_ELSEWHERE}")
