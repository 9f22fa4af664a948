"""The one engine both drivers of a gradient plan run on: `GradientExchange` (parameter hooks) and `PlanHook` (DDP's
communication hook) each feed it a group's (a bucket's) local gradient; it does what they share.

- binding the plan to the model: `planned_params` (the plan's parameters are the model's trainable ones),
  `find_unused` (`find_unused_parameters` as given or as the plan's profile says), `broadcast_from_rank0`;
- momentum correction (Deep Gradient Compression): `Engine.prepare` folds the local gradient into the group's
  velocity before its codec compresses it, and clears the velocity where top-k sent (momentum factor masking);
- the optimizer's checks: momentum applied once (`check_optimizer_momentum`), none on top-k groups without momentum
  correction (`check_topk_optimizer`), re-checked at every `optimizer.step()` through a step pre-hook;
- re-planning as training goes (`Engine.replan`, `planner.runtime.adaptive`), adopting a new plan (`Engine.adopt`
  checks it before anything changes) and flushing the error fed back (`Engine.mean_over_ranks`);
- the checks a saved state passes before anything changes (`StateCheck`).

How a group is sent is its codec's (`planner.runtime.codecs`); when and in which order is the driver's.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from planner.contracts.plan import Plan
from planner.runtime.adaptive import (
    ErrorWatch,
    Replan,
    Replanning,
    allowed_compressors,
    load_on_rank0,
    replan_on_every_rank,
    replannable,
)
from planner.runtime.codecs import Codec, Link
from planner.types import Compressor, CompressorKind, PlanMismatchError, PlannerError, Strategy

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from planner.contracts.fingerprint import ClusterInfo
    from planner.contracts.profile import Profile

__all__ = [
    "Engine",
    "EngineDriver",
    "StateCheck",
    "broadcast_from_rank0",
    "check_adaptive",
    "check_momentum_options",
    "check_optimizer_momentum",
    "check_topk_optimizer",
    "find_unused",
    "name_list",
    "planned_params",
    "world_size_of",
]


def world_size_of(process_group: Any) -> int:
    """Size of `process_group`, of the default group if None, or 1 when torch.distributed is not initialised."""
    if process_group is not None:
        return dist.get_world_size(process_group)
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def name_list(names: Sequence[str], limit: int = 3) -> str:
    """The first `limit` names, and how many more."""
    shown = ", ".join(names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def find_unused(plan: Plan, given: bool | None) -> bool:
    """`find_unused_parameters` as given, or as the plan says when not given (see `GradientExchange`)."""
    unused = plan.unused_params
    if unused is None or not unused.any:
        return bool(given)
    where = f"the plan's profile found parameters without a gradient in some of {unused.batches} batches"
    named = name_list(list(unused.names))
    if given is False:
        raise ValueError(
            f"find_unused_parameters=False, but {where} ({named}): their missing gradients would be averaged as "
            "zeros and the optimizer would move them where DDP leaves them alone; pass find_unused_parameters=True "
            "(or leave it out: the plan turns it on)"
        )
    if given is None:
        warnings.warn(
            f"find_unused_parameters is on: {where} ({named}), so, as in DDP, a parameter no rank had a gradient "
            "for keeps its .grad as it was (None stays None: the optimizer skips it, weight decay included); pass "
            "find_unused_parameters=True to say so and silence this note",
            RuntimeWarning,
            stacklevel=3,
        )
    return True


def planned_params(model: nn.Module, plan: Plan) -> dict[str, nn.Parameter]:
    """The model's parameters by name, after checking they are exactly the planned trainable ones."""
    params = dict(model.named_parameters())
    planned = plan.param_order
    replan = f"re-plan: {plan.replan_command()}"
    unknown = [n for n in planned if n not in params]
    if unknown:
        raise PlanMismatchError(
            f"the plan names parameter(s) the model does not have: {name_list(unknown)}; {replan}"
        )
    frozen = [n for n in planned if not params[n].requires_grad]
    if frozen:
        raise PlanMismatchError(
            f"the plan names frozen parameter(s) (requires_grad=False): {name_list(frozen)}; {replan}"
        )
    planned_set = set(planned)
    missing = [n for n, p in params.items() if p.requires_grad and n not in planned_set]
    if missing:
        raise PlanMismatchError(f"trainable parameter(s) missing from the plan: {name_list(missing)}; {replan}")
    for i, g in enumerate(plan.groups):
        numel = sum(params[n].numel() for n in g.params)
        if numel != g.numel:
            raise PlanMismatchError(
                f"plan group {i} says numel={g.numel}, but its parameters hold {numel} elements; {replan}"
            )
        devices = {params[n].device for n in g.params}
        if len(devices) > 1:
            raise ValueError(f"plan group {i} spans several devices {sorted(map(str, devices))}; one is needed")
    return params


def broadcast_from_rank0(tensors: Sequence[Tensor], process_group: Any = None) -> None:
    """Overwrite `tensors` with rank 0's values: one broadcast per dtype and device, of the flattened
    tensors (each distinct tensor once; tied parameters are one tensor)."""
    unique = list({id(t): t for t in tensors if t.numel() > 0}.values())
    by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in unique:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
    with torch.no_grad():
        for group in by_kind.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            dist.broadcast(flat, src, group=process_group)
            at = 0
            for t in group:
                t.copy_(flat[at : at + t.numel()].view_as(t))
                at += t.numel()


class Engine:
    """What both drivers share, for one plan at a time (`plan`, replaced by `adopt`).

    Args:
        plan: the plan in use.
        params: the model's planned parameters by name (`planned_params`).
        link: the process group the codecs send over.
        owner: the driver, as its messages name it ("GradientExchange", "PlanHook").
        momentum: DGC momentum correction's factor (0: none); `nesterov` its Nesterov variant.
        optimizer: the optimizer that steps the model, checked now and at every `step()` (None: unchecked).
        before_step: what the driver checks too at every `optimizer.step()` (called first).
        schedule: when to re-plan (None: never); `profile` what rank 0 re-solves from; `model` where the errors
            are measured, on `device`.
    """

    def __init__(self, plan: Plan, params: dict[str, nn.Parameter], link: Link, *, owner: str,
                 momentum: float = 0.0, nesterov: bool = False, optimizer: torch.optim.Optimizer | None = None,
                 before_step: Callable[[], None] | None = None, schedule: Replanning | None = None,
                 profile: Profile | str | Any = None, model: nn.Module | None = None,
                 device: torch.device | None = None) -> None:
        self.plan = plan
        self.link = link
        self.owner = owner
        self.momentum = float(momentum)
        self.nesterov = nesterov
        self._params = params
        self.planned_ids = frozenset(id(params[n]) for n in plan.param_order)
        self.topk_ids = self._topk_ids(plan)
        self.optimizer = optimizer
        self._before_step = before_step
        self._optimizer_hook: RemovableHandle | None = None
        if optimizer is not None:
            self.check_optimizer(optimizer)
            self._optimizer_hook = optimizer.register_step_pre_hook(self._on_optimizer_step)
        # Adaptive re-planning: rank 0 holds the profile it re-solves from; every rank measures its own gradients.
        self.replans: list[Replan] = []
        self.schedule = schedule
        self.watch: ErrorWatch | None = None
        self.profile: Profile | None = None
        self.allowed: tuple[Compressor, ...] = ()
        if schedule is not None:
            assert model is not None and device is not None
            self.profile = load_on_rank0(plan, profile, link.process_group, device)
            applies = optimizer is not None and any(
                group.get("momentum", 0) and any(id(p) in self.planned_ids for p in group["params"])
                for group in optimizer.param_groups)
            self.allowed = allowed_compressors(plan, topk=self.momentum > 0 or not applies)
            self.watch = ErrorWatch(model, [n for g in plan.groups for n in g.layers], self.allowed, schedule, device)

    def _topk_ids(self, plan: Plan) -> frozenset[int]:
        """The parameters `plan` sends by top-k."""
        return frozenset(id(self._params[n]) for g in plan.groups
                         if plan.compressor_of(g).kind is CompressorKind.TOPK for n in g.params)

    # -- the optimizer ----------------------------------------------------------------------------
    def check_optimizer(self, optimizer: torch.optim.Optimizer, topk_ids: frozenset[int] | None = None) -> None:
        """With momentum correction, no momentum in the optimizer on the planned parameters; without, none on the
        parameters sent by top-k (`topk_ids`, default the plan's): it would act on the sparse, delayed average."""
        if self.momentum > 0:
            check_optimizer_momentum(optimizer, self.planned_ids, self.momentum, self.owner)
        else:
            check_topk_optimizer(optimizer, self.topk_ids if topk_ids is None else topk_ids, self.owner)

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Step pre-hook: the driver's check, then the optimizer's again (its momentum may have been turned on
        since)."""
        if self._before_step is not None:
            self._before_step()
        self.check_optimizer(optimizer)

    def remove_hooks(self) -> None:
        """Remove the optimizer's step pre-hook."""
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None

    # -- one group's gradient ---------------------------------------------------------------------
    def prepare(self, codec: Codec, flat: Tensor, velocity: Tensor | None, *, taken: bool) -> None:
        """Compress this rank's gradient of one group into what its codec sends: as `codec.take` took it (`taken`),
        else from `flat` (this rank's gradient, as it is), folded into `velocity` first when there is one (u = m u +
        g; what is sent is u, or g + m u with Nesterov, computed in `flat`), top-k then clearing the velocity where
        it sent (momentum factor masking; not where it sends everything, k == numel: nothing is delayed there)."""
        if taken:
            codec.prepare(flat, None)
            return
        if velocity is None:
            codec.prepare(flat, flat)
            return
        velocity.mul_(self.momentum).add_(flat)
        source = flat.add_(velocity, alpha=self.momentum) if self.nesterov else velocity
        sent = codec.prepare(flat, source)
        if sent is not None and sent.numel() < codec.numel:
            velocity.index_fill_(0, sent.long(), 0.0)

    # -- re-planning --------------------------------------------------------------------------------
    def replan(self, step: int, *, keep_grouping: bool) -> Plan | None:
        """After the last measured step of a period (collective): gather the errors, rank 0 decides, every rank gets
        its decision; recorded in `replans`. The plan to take, or None to keep the one in use."""
        assert self.watch is not None and self.schedule is not None
        record = replan_on_every_rank(self.plan, self.profile, self.watch, self.schedule, self.allowed, step,
                                      self.link.process_group, keep_grouping=keep_grouping)
        self.replans.append(record)
        return record.plan

    def check_adoptable(self, plan: Plan, *, same_groups: bool) -> None:
        """Refuse, before anything changes, a new plan that does not keep the model and its parameters
        (`same_groups`: its groups, DDP's buckets), or that the optimizer may not run (its momentum on top-k)."""
        if same_groups:
            if plan.model.fingerprint != self.plan.model.fingerprint or \
                    [g.params for g in plan.groups] != [g.params for g in self.plan.groups]:
                raise PlanMismatchError("a re-plan inside DDP must keep the model and the plan's groups (DDP's "
                                        "buckets); the new plan has others")
        elif plan.model.fingerprint != self.plan.model.fingerprint or plan.param_order != self.plan.param_order:
            raise PlanMismatchError("a re-plan must keep the model and its parameters; the new plan has others")
        if self.optimizer is not None and self.momentum == 0:
            check_topk_optimizer(self.optimizer, self._topk_ids(plan), self.owner)

    def adopt(self, plan: Plan) -> None:
        """Make `plan` (checked by `check_adoptable`) the plan in use."""
        self.plan = plan
        self.topk_ids = self._topk_ids(plan)

    def mean_over_ranks(self, buffers: Sequence[Tensor]) -> list[Tensor]:
        """Each of `buffers` averaged over the ranks, in fp32, in one allreduce (the errors fed back, flushed when a
        new plan is taken)."""
        if not buffers:
            return []
        flat = torch.cat([b.reshape(-1).float() for b in buffers])
        if self.link.world_size > 1:
            dist.all_reduce(flat, group=self.link.process_group)
        flat.div_(self.link.world_size)
        means, at = [], 0
        for b in buffers:
            means.append(flat[at : at + b.numel()])
            at += b.numel()
        return means


class EngineDriver:
    """What both drivers show of the engine they run (`_engine`): the plan in use and the re-plans."""

    __slots__ = ()
    _engine: Engine

    @property
    def plan(self) -> Plan:
        """The plan in use (a re-plan, `adaptive=`, replaces it)."""
        return self._engine.plan

    @property
    def replans(self) -> list[Replan]:
        """What each re-plan decided (`adaptive=`)."""
        return self._engine.replans


# -- the arguments' checks, shared by both drivers (`owner` names the one that applies momentum) ----------------------
def check_adaptive(plan: Plan, adaptive: bool | Replanning, density_warmup: Any, crossover: Any) -> Replanning | None:
    """`adaptive` as a schedule (None: off), refused where it cannot run."""
    if adaptive is False:
        return None
    schedule = adaptive if isinstance(adaptive, Replanning) else Replanning() if adaptive is True else None
    if schedule is None:
        raise ValueError(f"adaptive must be True, False or a Replanning, but got {adaptive!r}")
    why = replannable(plan)
    if why:
        raise ValueError(why)
    if density_warmup is not None or crossover is not None:
        raise ValueError("adaptive re-planning runs without a density warm-up and without crossover; leave one out")
    return schedule


def check_momentum_options(momentum: float, nesterov: bool, optimizer: torch.optim.Optimizer | None,
                           owner: str, *, optimizer_later: bool = False) -> None:
    """Refuse momentum out of range, nesterov without momentum, and momentum without the optimizer to check
    (unless `optimizer_later`: the caller checks the optimizer once it exists, as Lightning's strategy does)."""
    if isinstance(momentum, bool) or not isinstance(momentum, int | float) or not 0 <= momentum < 1:
        raise ValueError(f"`0 <= momentum < 1` must hold, but got momentum={momentum!r}")
    if not isinstance(nesterov, bool):
        raise ValueError(f"nesterov must be True or False, but got nesterov={nesterov!r}")
    if nesterov and momentum == 0:
        raise ValueError("nesterov=True needs momentum > 0, but got momentum=0")
    if momentum > 0 and optimizer is None and not optimizer_later:
        raise ValueError(
            f"momentum={momentum} needs optimizer=: {owner} applies momentum, so it must check that the optimizer "
            "does not apply it again; pass the optimizer that steps this model"
        )


def check_optimizer_momentum(optimizer: torch.optim.Optimizer, planned_ids: frozenset[int], momentum: float,
                             owner: str) -> None:
    """With momentum correction (`momentum` > 0, applied by `owner`): refuse an optimizer that holds none of the
    planned parameters, or would apply momentum to them a second time."""
    planned_groups = [
        (i, group) for i, group in enumerate(optimizer.param_groups)
        if any(id(p) in planned_ids for p in group["params"])
    ]  # fmt: skip
    if not planned_groups:
        raise ValueError(
            f"the optimizer ({type(optimizer).__name__}) holds none of the planned parameters; "
            "pass the optimizer that steps this model"
        )
    for i, group in planned_groups:
        if "momentum" not in group:
            raise ValueError(
                f"momentum correction needs an SGD-like optimizer with a momentum setting, but "
                f"{type(optimizer).__name__} has none (param group {i}); use torch.optim.SGD with momentum=0"
            )
        if group["momentum"] != 0:
            raise ValueError(
                f"optimizer param group {i} has momentum={group['momentum']}, but {owner} already applies "
                f"momentum={momentum}, so it would be applied twice; use momentum=0 in the optimizer; {owner} "
                "applies momentum"
            )


def check_topk_optimizer(optimizer: torch.optim.Optimizer, topk_ids: frozenset[int], owner: str) -> None:
    """Without momentum correction: refuse an optimizer with momentum on parameters sent by top-k. Its momentum
    would act on the sparse, delayed average, the mistake DGC's momentum correction is for."""
    if not topk_ids:
        return
    for i, group in enumerate(optimizer.param_groups):
        m = group.get("momentum") or 0
        if m and any(id(p) in topk_ids for p in group["params"]):
            nesterov = ", nesterov=True" if group.get("nesterov") else ""
            raise ValueError(
                f"optimizer param group {i} has momentum={m}, but the plan sends its parameters by top-k, where "
                f"the optimizer's momentum acts on a sparse, delayed average; pass momentum={m}{nesterov} to "
                f"{owner} and momentum=0 to the optimizer ({owner} applies it before top-k)"
            )


# -- saved states' checks, shared by both drivers ------------------------------------------------------------------
class StateCheck:
    """The checks `load_state_dict` makes of a saved state before anything changes, in both drivers: each entry's
    type and shape, and the plan an adaptive run saved. Every refusal is one line (PlanMismatchError) saying what is
    wrong, then `fix`.

    Args:
        owner: the driver loading it, as its messages name it ("exchange", "hook").
        fix: what to do instead, ending every message.
    """

    __slots__ = ("fix", "owner")

    def __init__(self, owner: str, fix: str) -> None:
        self.owner = owner
        self.fix = fix

    def refuse(self, what: str) -> PlanMismatchError:
        """The error to raise: `what` is wrong, then what to do."""
        return PlanMismatchError(f"{what}; {self.fix}")

    def mapping(self, value: Any, where: str) -> dict[int, Any]:
        """`value`, a dict by index (group or bucket, an int or its decimal string), with int keys."""
        if not isinstance(value, dict):
            raise self.refuse(f"the state's {where} must be a dict by index, but got {type(value).__name__}")
        out = {}
        for key, item in value.items():
            if isinstance(key, bool) or not (isinstance(key, int) or (isinstance(key, str) and key.isdecimal())):
                raise self.refuse(f"the state's {where} must be keyed by index, but holds the key {key!r}")
            out[int(key)] = item
        return out

    def entry(self, value: Any, where: str) -> dict[str, Any]:
        """`value`, a dict by name."""
        if not isinstance(value, dict):
            raise self.refuse(f"{where} must be a dict, but got {type(value).__name__}")
        return value

    def tensor(self, value: Any, where: str, numel: int | None) -> Tensor:
        """`value`, a 1-D floating tensor (a flat buffer as `state_dict` saves it) of `numel` elements (None: any)."""
        if not isinstance(value, Tensor):
            raise self.refuse(f"{where} must be a tensor, but got {type(value).__name__}")
        if not value.is_floating_point() or value.dim() != 1 or (numel is not None and value.numel() != numel):
            size = "" if numel is None else f" of {numel} elements"
            raise self.refuse(f"{where} must be a 1-D floating tensor{size}, but got "
                              f"{str(value.dtype).removeprefix('torch.')} of shape {tuple(value.shape)}")
        return value

    def flag(self, value: Any, where: str) -> bool:
        """`value`, True or False."""
        if not isinstance(value, bool):
            raise self.refuse(f"{where} must be True or False, but got {value!r}")
        return value

    def group_buffers(self, state: dict[str, Any], key: str, what: str, numel: dict[int, int], expected: set[int]
                      ) -> dict[int, Tensor]:
        """A `GradientExchange` state's per-group `key` ("residuals" or "velocities"), checked against the groups
        `expected` to hold one (of `numel` elements each). Velocities may be absent (an older state, or saved with
        momentum=0): then {} is returned."""
        saved = self.mapping(state.get(key, {}), key)
        if key == "velocities" and not saved:
            return saved
        if key == "velocities" and not expected:
            raise PlanMismatchError(f"the state holds momentum velocities for groups {sorted(saved)}, but this "
                                    f"{self.owner} has momentum=0; pass the momentum it was saved with, or {self.fix}")
        if set(saved) != expected:
            kind = "top-k groups" if key == "residuals" else "groups"
            raise self.refuse(f"the state holds {key} for groups {sorted(saved)}, but the plan's {kind} are "
                              f"{sorted(expected)}")
        for i in sorted(expected):
            self.tensor(saved[i], f"{what} of group {i}", numel[i])
        return saved

    def powersgd_groups(self, state: dict[str, Any], expected: dict[int, tuple[int, int]]) -> dict[int, dict[str, Any]]:
        """A `GradientExchange` state's PowerSGD errors and Qs, checked against the plan's PowerSGD groups
        (`expected`: by group, its elements and its Qs' elements)."""
        saved = self.mapping(state.get("powersgd", {}), "powersgd entry")
        if set(saved) != set(expected):
            raise self.refuse(f"the state holds PowerSGD state for groups {sorted(saved)}, but the plan's PowerSGD "
                              f"groups are {sorted(expected)}")
        for i, (numel, q_numel) in expected.items():
            entry = self.entry(saved[i], f"PowerSGD state of group {i}")
            if set(entry) != {"error", "q", "fresh"}:
                raise self.refuse(f"PowerSGD state of group {i} must hold error, q and fresh, but holds "
                                  f"{sorted(map(str, entry))}")
            self.tensor(entry["error"], f"PowerSGD error of group {i}", numel)
            self.tensor(entry["q"], f"PowerSGD q of group {i}", q_numel)
            self.flag(entry["fresh"], f"PowerSGD fresh of group {i}")
        return saved

    def fingerprint(self, state: dict[str, Any], in_use: Plan) -> None:
        """Refuse a state saved for another model."""
        if state.get("model_fingerprint") != in_use.model.fingerprint:
            raise PlanMismatchError(
                f"this {self.owner} state was saved for model fingerprint {state.get('model_fingerprint')}, but the "
                f"plan is for {in_use.model.describe()}; {self.fix}"
            )

    def plan(self, value: Any, in_use: Plan, world_size: int, *, same_groups: bool) -> Plan:
        """The plan an adaptive run saved, checked as the plan it replaces was at construction: a plan (a dict
        `Plan.to_dict` wrote), of the same model and parameters (with `same_groups`, the same groups: DDP's
        buckets), for the cluster the plan in use runs on, and one the re-planner can continue (mixed, under an
        error budget)."""
        if not isinstance(value, dict):
            raise self.refuse(f"the state's plan must be a dict (Plan.to_dict), but got {type(value).__name__}")
        try:
            plan = Plan.from_dict(value)
        except (PlannerError, ValueError, TypeError, KeyError) as exc:
            raise self.refuse(f"the state's plan is not a valid plan ({exc})") from exc
        if plan.model.fingerprint != in_use.model.fingerprint:
            raise self.refuse(f"the state's plan is for model {plan.model.describe()}, but this {self.owner} runs "
                              f"{in_use.model.describe()}")
        if same_groups and [g.params for g in plan.groups] != [g.params for g in in_use.groups]:
            raise self.refuse(f"the state's plan has other groups than this {self.owner}'s plan, and a plan inside "
                              "DDP keeps its groups (DDP's buckets)")
        if not same_groups and plan.param_order != in_use.param_order:
            raise self.refuse(f"the state's plan orders the parameters otherwise than this {self.owner}'s plan")
        here, there = in_use.cluster, plan.cluster
        if (there.world_size, there.host_count, there.backend, there.device_kind) != (
                world_size, here.host_count, here.backend, here.device_kind):
            raise self.refuse(f"the state's plan was made for {_cluster_text(there.world_size, there)}, but this "
                              f"{self.owner} runs on {_cluster_text(world_size, here)}")
        if replannable(plan):
            what = "a mixed plan without an error budget" if plan.strategy is Strategy.MIXED else \
                f"a {plan.strategy.value} plan"
            raise self.refuse(f"the state holds {what}, but re-planning (adaptive=) continues a mixed plan under an "
                              "error budget only")
        return plan


def _cluster_text(world_size: int, cluster: ClusterInfo) -> str:
    """`cluster` as the checks compare it, at `world_size` workers (the process group's, or the plan's)."""
    hosts = f"{cluster.host_count} host{'s' if cluster.host_count > 1 else ''}"
    return f"world size {world_size} on {hosts} ({cluster.backend} on {cluster.device_kind})"
