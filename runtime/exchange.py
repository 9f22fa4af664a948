"""Execute a gradient plan: one fused collective per planned group, launched from gradient hooks.

    exchange = GradientExchange(model, plan)          # or GradientExchange.from_file(model, "plan.json")
    for batch in loader:
        loss = model(batch).sum()
        loss.backward()        # hooks launch each group's collective as soon as it is complete
        exchange.synchronize() # wait for them, write the averaged gradients into .grad
        optimizer.step()
        optimizer.zero_grad()

    # DGC momentum correction: the exchange applies momentum before top-k, the optimizer must not
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)   # momentum=0
    exchange = GradientExchange(model, plan, momentum=0.9, optimizer=optimizer)

Design (DESIGN.md, "Runtime principles"):

- Every planned parameter gets a `register_post_accumulate_grad_hook`, which takes its gradient into
  the group at once, while it is in cache, in one pass: a dense group's are written into the group's
  flat fp32 buffer divided by the world size (the allreduce sums them to the mean); a top-k group's are
  added into its residual. A group whose parameters are all ready is *prepared* inside the hook on the
  compute stream: top-k selects from the residual (error feedback) and packs. Prepared
  groups are *launched* (async collective) strictly in plan order: a group prepared early waits until
  every earlier group is launched, so all ranks issue the same collectives in the same order.
- Buffers are allocated once. After a step each parameter's `.grad` is a view into its group's
  flat buffer (as DDP's `gradient_as_bucket_view`): the result of the collective is the gradient, with
  no copy back. If the next backward accumulates into that view (`zero_grad(set_to_none=False)`) the
  copy into the buffer is skipped too; if `.grad` was replaced (the default `set_to_none=True`) it is
  copied in. A dense group's buffer has its gradients' dtype (bf16 gradients travel as bf16, as in DDP;
  a group of several dtypes is promoted); lossy groups work in fp32. Parameters of another dtype than
  their buffer's are copied in and out.
- A planned parameter with no gradient this step (unused in the forward) counts as zeros: its group
  is prepared and launched by `synchronize()`, and afterwards its `.grad` holds the average over ranks
  (zeros if no rank had a gradient). With `find_unused_parameters=True`, as DDP's option of that name
  (on by default where the plan's profile found parameters without a gradient), a parameter no rank
  had a gradient for keeps its `.grad` as it was (None stays None, so the optimizer skips it, weight
  decay included), at the cost of one small allreduce per step. Exception:
  a dense plan on world size 1 without momentum or clipping leaves gradients untouched.
- Momentum correction (Deep Gradient Compression, Lin et al., ICLR 2018; `momentum=`): momentum is
  accumulated locally, per group, *before* the exchange (u = m u + g; top-k then selects from the
  residual v += u and clears u where it sent), so a delayed entry keeps its momentum and the averaged
  result already is the momentum update; the optimizer must be SGD without momentum. Without
  `momentum`, `clip_norm` or `density_warmup` none of this state exists and the hot path is unchanged.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import hashlib
import math
import os
import threading
import time
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from planner.contracts.plan import Group, Plan, plan_simplicity
from planner.kernels.compress import PowerSGDLayout
from planner.kernels.hierarchical import HostGroups
from planner.platform.hosts import host_names, ranks_by_host
from planner.runtime.adaptive import Replanning
from planner.runtime.attach import resolve_plan
from planner.runtime.codecs import Codec, DensityWarmup, Link, PowerSGDCodec, TopkCodec, make_codec, write_scaled
from planner.runtime.crossover import DEFAULT_GATE_TIMEOUT_S, DeviceGate, ProbeSchedule, crossover_gate, device_idle
from planner.runtime.engine import (
    Engine,
    EngineDriver,
    StateCheck,
    broadcast_from_rank0,
    check_adaptive,
    check_momentum_options,
    find_unused,
    planned_params,
    world_size_of,
)
from planner.runtime.online_race import OnlineRace, OnlineRaceResult, RaceSchedule, check_race, saved_race
from planner.types import Compressor, CompressorKind, DistributedError, PlanMismatchError

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

__all__ = ["GradientExchange"]

STATE_KIND = "runtime.gradient_exchange"

#: How long the drain at interpreter exit waits for each collective still in flight (seconds).
EXIT_DRAIN_S = 10.0

#: Exchanges alive now (weakly held): their collectives in flight are waited for at interpreter exit.
_LIVE: weakref.WeakSet[GradientExchange] = weakref.WeakSet()


def _drain_at_exit() -> None:
    """Wait, at most `EXIT_DRAIN_S` each, for the collectives every live exchange still has in flight: work
    of the process group must not outlive the interpreter (its threads, torn down under a running
    collective, abort the process with "terminate called without an active exception")."""
    for exchange in list(_LIVE):
        exchange.drain(EXIT_DRAIN_S)


atexit.register(_drain_at_exit)


def _views(flat: Tensor, params: Sequence[Tensor]) -> list[Tensor]:
    """Consecutive slices of `flat` shaped like `params`."""
    views, offset = [], 0
    for p in params:
        views.append(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return views


class _GroupState:
    """One planned group: its flat buffer and the parameters' views of it, its codec, its velocity (momentum) and
    clipping share, and this step's progress."""

    __slots__ = ("as_view", "clip", "codec", "flat", "index", "names", "num_ready", "numel", "params", "plain",
                 "prepared", "ready", "velocity", "views", "work")

    def __init__(self, index: int, group: Group, params: list[nn.Parameter], codec: Codec, world_size: int, *,
                 momentum: bool = False, clip: float | None = None) -> None:
        kind = codec.kind
        self.index = index
        self.names = group.params
        self.params = params
        self.numel = group.numel
        self.codec = codec
        self.clip = clip  # this group's share of the local clipping threshold, or None
        # A plain group takes each gradient in the codec's own way as it comes (`Codec.take`).
        self.plain = clip is None and not momentum
        device = params[0].device
        # Dense on one worker without momentum or clipping leaves the gradients as they are; every lossy or
        # compressing way computes (a single worker too: its arithmetic is part of the method).
        needs_buffer = kind is not CompressorKind.DENSE or world_size > 1 or not self.plain
        # A plain dense group travels in its gradients' own dtype (bf16 as bf16, as DDP's buckets do; mixed dtypes
        # promoted); every other way computes in fp32 (residuals, velocities, casts and factorisations).
        dense = kind is CompressorKind.DENSE and self.plain
        dtype = functools.reduce(torch.promote_types, [p.dtype for p in params]) if dense else torch.float32
        self.flat: Tensor | None = torch.zeros(self.numel, dtype=dtype, device=device) if needs_buffer else None
        self.views = _views(self.flat, params) if self.flat is not None else []
        self.as_view = [p.dtype == dtype for p in params]
        self.velocity = torch.zeros(self.numel, dtype=torch.float32, device=device) if momentum else None
        self.ready = [False] * len(params)
        self.num_ready = 0
        self.prepared = False
        self.work: Any = None

    @property
    def hierarchical(self) -> bool:
        return self.codec.hierarchical

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.num_ready = 0
        self.prepared = False
        self.work = None


class _BufferSyncHook:
    """The forward pre-hook of `GradientExchange(forward_sync_buffers=True)`, holding the exchange weakly.

    A copy of the model (`copy.deepcopy`, pickling) gets an inert hook: the copy is not the model the exchange
    serves, and the exchange (locks, process group) cannot be copied."""

    def __init__(self, exchange: GradientExchange | None) -> None:
        self._exchange = None if exchange is None else weakref.ref(exchange)

    def __call__(self, module: nn.Module, args: Any) -> None:
        exchange = None if self._exchange is None else self._exchange()
        if exchange is not None:
            exchange._before_forward(module, args)

    def __reduce__(self) -> tuple[Any, tuple[None]]:
        return (_BufferSyncHook, (None,))


class _GateHook:
    """Forward pre-hook of a crossed-over job: take the pair's gate before a training forward (released by
    `synchronize` once only collectives are left). Pickles as a no-op (a deep-copied model must not hold the
    original's gate)."""

    def __init__(self, exchange: GradientExchange | None) -> None:
        self.exchange = exchange

    def __call__(self, module: nn.Module, args: Any) -> None:
        if self.exchange is not None and self.exchange.gate is not None and torch.is_grad_enabled():
            self.exchange.gate.acquire()

    def __reduce__(self) -> tuple[Any, tuple[None]]:
        return (_GateHook, (None,))


class GradientExchange(EngineDriver):
    """Averages gradients across ranks as a plan says: fused dense allreduce or top-k allgather per group.

    Call order per step: `loss.backward()` (hooks prepare and launch groups), `synchronize()` (launch
    what is left, wait, write back), `optimizer.step()`. Use `no_sync()` around backward passes that
    only accumulate gradients locally.

    Args:
        model: the module the plan was made for (same trainable parameter names, shapes and dtypes).
        plan: the plan; its model fingerprint and world size must match.
        process_group: the group to average over; default: the default group, or none (world size 1)
            when torch.distributed is not initialised.
        model_name: name used for the model in error messages; default: the plan's model name.
        auto_retune: when the plan was made for another world size, backend or kind of device, re-plan
            from its stored profile and a quick probe of the group's network (rank 0 solves and
            broadcasts; see `planner.runtime.attach`) instead of refusing. The plan in use is `self.plan`.
        profile: the per-layer profile to re-plan from (a Profile or a path); default the plan's source.
        momentum: DGC momentum correction, `0 <= momentum < 1`. Each rank keeps a velocity u per group
            and sends the selection from v += u (u = m u + g) instead of v += g; momentum factor masking
            clears u where v was sent, except in a group that sends everything this step (k == numel):
            there nothing is delayed, so masking would only turn momentum into plain SGD. A dense plan
            does the same without selection (u = m u + g, then allreduce: the average of the u's is
            the momentum buffer of the averaged gradient, as `torch.optim.SGD(momentum=m)`), so top-k
            at density 1.0 and dense plans equal dense momentum SGD. Needs `optimizer`.
        nesterov: DGC's Nesterov variant: send from v += g + m u (torch's Nesterov SGD at density 1.0).
        optimizer: the optimizer that steps the model, required when momentum > 0, and useful always: a step
            pre-hook then refuses `optimizer.step()` between a backward and its `synchronize()`. Its param groups
            holding planned parameters must have momentum 0 (refused otherwise, and again at every
            `step()` through a step pre-hook, in case it is changed later). Without `momentum`, a plan
            with top-k groups refuses an optimizer with momentum on their parameters (pass the momentum
            here instead); dense, fp16 and PowerSGD groups keep the optimizer's momentum. Without
            `optimizer` none of this can be checked. Its weight decay is left to
            it: torch's SGD adds weight_decay * p to the averaged result at step time, so weight decay
            is neither sparsified nor momentum-accelerated (with momentum m its long-run effect is about
            (1 - m) times that of `SGD(momentum=m, weight_decay=wd)`; put the decay in the loss to have
            it accelerated and compressed like the gradient).
        clip_norm: DGC's local gradient clipping, before the gradient enters the velocity (or, without
            momentum, the residual). Groups are processed in gradient hooks as they become ready, so no
            whole-model norm is available without losing overlap: each group is clipped on its own to
            clip_norm * sqrt(numel_group / numel_total) / sqrt(world_size) (DGC's world_size**-0.5
            scaling, and the group's share of the total were the gradient spread evenly).
        density_warmup: (start_density, steps) for a top-k plan: over the first `steps` steps the
            density decays exponentially from start_density to the plan's density (DGC's warm-up, with
            a constant factor per step instead of 4x per epoch): density_t = start * (plan / start) **
            (t / steps), and each group sends k_t = max(plan k, topk_count(numel, density_t)), the same
            on every rank. Send and receive buffers are allocated for k_0 and shrunk to the plan's k
            when the warm-up ends. The step count is part of `state_dict()`. Not advised with `momentum`: at
            the warm-up's densities an entry is sent again a few steps later and momentum factor masking clears
            its velocity each time, so little momentum builds up (where every nonzero entry is sent each step,
            the exchange returns the plain gradient); on the digits it trained slower than no warm-up
            (docs/results/time-to-target.md).
        forward_sync_buffers: as DDP's option (torch >= 2.13; formerly `broadcast_buffers`), default True:
            before a forward pass, rank 0's buffers (BatchNorm running statistics, ...) are copied to every
            rank when the previous forward ran with autograd on and outside `no_sync()` (DDP's rule, so the
            first forward always syncs). With False, each rank keeps its own buffers between steps. Either
            way, as DDP does at construction, rank 0's parameters and buffers are copied to every rank once,
            so all ranks start from the same model.
        find_unused_parameters: as DDP's option: after each step's collectives, one allreduce of a byte
            per parameter tells which parameters no rank had a gradient for, and their `.grad` is left
            as it was instead of being set to the zeros that were averaged. (A parameter unused on some
            ranks only is averaged with zeros from the others either way, as in DDP. With `momentum`
            its velocity still decays that step.) Default None: as the plan says. A plan whose profile
            found parameters without a gradient in some of its batches (`Plan.unused_params`: a head the
            loss never touches, experts a router left out) turns it on, with a RuntimeWarning naming them;
            pass True to turn it on without the warning. False with such a plan is refused: their
            missing gradients would be averaged as zeros, and the optimizer's momentum and weight decay
            would move them where DDP leaves them alone. Other plans (and plans from profiles made before
            the check) leave it off.
        crossover: run crossed over with a paired job on the same devices (CrossoverScheduler): a pairing plan
            (`planner pair`; its path, or the loaded `PairingPlan`) naming this job's plan, or a
            `planner.runtime.crossover.DeviceGate`. The exchange then takes the pair's gate before each training
            forward and gives it back in `synchronize` once only collectives are left, so the partner computes
            while this job communicates. A job the pairing leaves alone runs as before. Default: no gate.
        crossover_job: this job's name in the pairing plan (needed only when several of its jobs run one plan).
        crossover_dir: the directory of the gate files (default: $PLANNER_GATE_DIR, else <tmp>/planner-gates).
        crossover_timeout_s: how long to wait for the partner to hand the device back (GateTimeoutError then).
        crossover_probe: True (default): the pair measures its throughput crossed over and side by side now and
            then (`planner.runtime.crossover.ProbeSchedule`: 20 s every 10 min, after 10 s) and runs the better, so
            crossing over never costs much where the device time-shares well or the collectives need it (gloo
            on CPU cores); a `ProbeSchedule` to set when; False: always crossed over.
        hosts: the ranks (of the process group) on each host, for the plan's hierarchical groups; default: read
            from the ranks' host names (`planner.platform.hosts`). Its length must be the plan's host count.
        adaptive: re-plan as training goes (`planner.runtime.adaptive`): True, or a `Replanning` to say when. A mixed
            plan solved under an error budget only. Every `every` steps (default 200) the ranks measure each allowed
            compressor's error on their own gradients of the last few steps, rank 0 re-solves from the plan's profile
            (`profile=`, default the plan's source file) and every rank takes the plan it broadcasts, when the one in
            use exceeds the budget on today's errors or a new one is predicted `gain` times faster. Taking a plan
            flushes the error fed back: every rank's top-k residuals and PowerSGD errors are averaged and added to
            that step's gradients (one allreduce of the model's size), so no gradient is lost and the new plan
            starts without error to feed back; momentum velocities carry over parameter by parameter. Top-k is
            left out of the re-plans where the optimizer applies momentum itself (pass `momentum` here instead).
            `self.plan` is the plan in use, `self.replans` what each re-plan decided; `state_dict()` holds the plan
            in use, so that a resumed run continues with it. Not with `density_warmup` or `crossover`.
        race: race the plan file's plan and its runners-up (`Plan.runners_up`, written by `planner solve --strategy
            auto`) in the first steps of training (`planner.runtime.online_race`): True, or an `OnlineRace` to say
            how. Every step trains; the ranks take turns on the same schedule, decide by the same rule as `planner
            race`, commit to the arm kept and say so in one log line (logger "planner.runtime", on rank 0);
            `self.race` then holds the result, and `self.plan` the plan kept. A runner-up the options cannot run
            (top-k under an optimizer's momentum) is left out with a RuntimeWarning. `state_dict()` holds the arm in
            use and the race's result, so that a resumed run continues with the arm kept (mid-race: the race starts
            again from the arm in use). Not with `adaptive`, `density_warmup` or `crossover`.

    Raises:
        PlanMismatchError: the plan was made for another model, or for another world size, backend or
            kind of device without `auto_retune`, or its parameters do not match the model's trainable
            parameters.
        ValueError: find_unused_parameters=False with a plan that records unused parameters; `race` with a plan
            without runners-up, or with `adaptive`, a density warm-up or crossover; `adaptive` with a plan
            that is not mixed under an error budget, or with a density warm-up or crossover;
            momentum, clipping or warm-up settings out of range, momentum without an optimizer,
            an optimizer that applies momentum itself (with `momentum`, or on top-k groups), or a density
            warm-up with a dense plan.
    """

    #: What the codecs send over (a calibration swaps in one that sends nothing).
    _link_type: type[Link] = Link

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        *,
        process_group: Any = None,
        model_name: str | None = None,
        auto_retune: bool = False,
        profile: Any = None,
        momentum: float = 0.0,
        nesterov: bool = False,
        optimizer: torch.optim.Optimizer | None = None,
        clip_norm: float | None = None,
        density_warmup: tuple[float, int] | None = None,
        find_unused_parameters: bool | None = None,
        forward_sync_buffers: bool = True,
        crossover: Any = None,
        crossover_job: str | None = None,
        crossover_dir: str | os.PathLike[str] | None = None,
        crossover_timeout_s: float = DEFAULT_GATE_TIMEOUT_S,
        crossover_probe: ProbeSchedule | bool = True,
        hosts: Sequence[Sequence[int]] | None = None,
        adaptive: bool | Replanning = False,
        race: bool | OnlineRace = False,
    ) -> None:
        layout = None if hosts is None else [list(h) for h in hosts]
        plan = resolve_plan(plan, model, process_group=process_group, model_name=model_name,
                            auto_retune=auto_retune, profile=profile,
                            host_count=None if layout is None else len(layout))
        self.process_group = process_group
        self.world_size = world_size_of(process_group)
        self._selector: str = getattr(plan, "selector", None) or "exact"
        self.momentum = float(momentum)
        self.nesterov = nesterov
        self.clip_norm = clip_norm
        self.find_unused_parameters = find_unused(plan, find_unused_parameters)
        self._warmup = self._check_options(plan, momentum, nesterov, optimizer, clip_norm, density_warmup)
        race_config = check_race(plan, race, adaptive, density_warmup, crossover)
        schedule = check_adaptive(plan, adaptive, density_warmup, crossover)
        params = planned_params(model, plan)
        self._params = params
        self._step = 0
        self._active = False
        self._device = next((params[n].device for g in plan.groups for n in g.params), torch.device("cpu"))
        self._link = self._link_type(process_group, self.world_size)
        self._host_layout = layout
        self._engine = Engine(plan, params, self._link, owner="GradientExchange", momentum=self.momentum,
                              nesterov=nesterov, optimizer=optimizer, before_step=self._refuse_open_step,
                              schedule=schedule, profile=profile, model=model, device=self._device)
        self._grad_hooks: list[RemovableHandle] = []
        self._build_groups(plan)
        self._set_step(0)
        self._next_launch = 0
        self._enabled = True
        self._lock = threading.Lock()
        self._hooks: list[RemovableHandle] = []
        self._model = model
        self.forward_sync_buffers = bool(forward_sync_buffers)
        self._sync_buffers_next = True  # DDP's require_forward_param_sync: the first forward syncs
        if self.world_size > 1:
            self._broadcast_from_rank0([*model.parameters(), *model.buffers()])
            if self.forward_sync_buffers:
                self._hooks.append(model.register_forward_pre_hook(_BufferSyncHook(self)))
        # after the buffer broadcast's hook: a rank holds the pair's gate only while it computes locally
        self.gate: DeviceGate | None = crossover_gate(crossover, plan, job=crossover_job, gate_dir=crossover_dir,
                                                      timeout_s=crossover_timeout_s, probe=crossover_probe)
        if self.gate is not None:
            self._hooks.append(model.register_forward_pre_hook(_GateHook(self)))
        #: The race in the first steps: its result once decided (`race=`; None before, or without a race).
        self.race: OnlineRaceResult | None = None
        self._race_config = race_config
        self._arms: dict[str, Plan] = {}
        self._arm = "plan"
        self._racing: RaceSchedule | None = None
        if self._race_config is not None:
            self._arms = self._race_arms(plan, optimizer)
            self._start_race("plan")
        _LIVE.add(self)

    # -- the race in the first steps ------------------------------------------------------------
    def _race_arms(self, plan: Plan, optimizer: torch.optim.Optimizer | None) -> dict[str, Plan]:
        """The plan and the runners-up this exchange can run, by arm name, simplest first (dense, then lossless,
        then lossy: the order the race keeps the simplest by)."""
        arms = {"plan": plan}
        for name, other in plan.runners_up.items():
            try:
                self._engine.check_adoptable(other, same_groups=False)
            except (PlanMismatchError, ValueError) as exc:
                warnings.warn(f"the race leaves out runner-up {name}: {exc}", RuntimeWarning, stacklevel=3)
                continue
            arms[f"runner-up {name}"] = other
        if len(arms) < 2:
            raise ValueError("race=True needs a runner-up this exchange can run beside the plan; none is left")
        return dict(sorted(arms.items(), key=lambda kv: plan_simplicity(kv[1])))

    def _start_race(self, arm: str) -> None:
        assert self._race_config is not None
        self._racing = RaceSchedule(list(self._arms), self._race_config, start=arm)
        self._race_clock = time.perf_counter()
        self._race_mark: float | None = None

    def _switch_to(self, arm: str) -> None:
        """Run `arm` from the next step (its selector, groups and codecs; the error fed back flushed)."""
        if arm == self._arm:
            return
        plan = self._arms[arm]
        self._selector = plan.selector or "exact"
        self._adopt(plan, flush=True)
        self._arm = arm

    def _race_step(self) -> None:
        """After a step while racing: time it, and at a round's end take the ranks' slowest times, let the rule
        decide, and run the arm the schedule says next (the one kept once decided)."""
        racing = self._racing
        assert racing is not None
        now = time.perf_counter()
        if racing.after_step(None if self._race_mark is None else now - self._race_mark):
            decided = racing.end_round(now - self._race_clock, self._device, self.process_group, self.world_size)
            if decided is not None:
                self.race, self._racing = decided, None
                self._switch_to(decided.kept)
                return
        self._switch_to(racing.current)
        self._race_mark = time.perf_counter()

    def _build_groups(self, plan: Plan) -> None:
        """The groups' buffers and codecs for `plan`, their hosts' subgroups where it crosses hosts hierarchically,
        and the gradient hooks that feed them (those of an earlier plan removed)."""
        for handle in self._grad_hooks:
            handle.remove()
        params = self._params
        total = sum(g.numel for g in plan.groups)
        # Hierarchical groups: the subgroups of each host and across hosts, made once (collective).
        crosses = self.world_size > 1 and any(g.hierarchical for g in plan.groups)
        if crosses and self._link.host_groups is None:
            if self._host_layout is None:
                self._host_layout = ranks_by_host(host_names(self.process_group))
            self._link.host_groups = HostGroups.build(self._host_layout, self.process_group)
        # PowerSGD's first random Qs: one seed per group, drawn in plan order as PyTorch's hook draws one per bucket
        # (`PowerSGDState.rng`, a RandomState of seed 0), so every rank draws the same.
        seeds = np.random.RandomState(0)
        self._groups = []
        for i, g in enumerate(plan.groups):
            compressor = plan.compressor_of(g)
            group_params = [params[n] for n in g.params]
            codec = self._codec(g, compressor, group_params,
                                int(seeds.randint(1_000_000_000)) if compressor.kind is CompressorKind.POWERSGD else 0)
            clip = None if self.clip_norm is None else self.clip_norm * math.sqrt(g.numel / total / self.world_size)
            self._groups.append(_GroupState(i, g, group_params, codec, self.world_size, momentum=self.momentum > 0,
                                            clip=clip))
        self._grad_hooks = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, st.index, j))
            for st in self._groups
            for j, p in enumerate(st.params)
        ]

    def _codec(self, group: Group, compressor: Compressor, params: list[nn.Parameter], seed: int) -> Codec:
        """The codec that sends `group` by `compressor` (its density warm-up's largest k allocated for top-k)."""
        layout = None
        if compressor.kind is CompressorKind.POWERSGD:
            assert compressor.rank is not None
            layout = PowerSGDLayout.of([p.shape for p in params], compressor.rank)
        k_max = self._warmup.k_at(group.numel, group.k, 0) if self._warmup is not None and group.k is not None \
            else None
        return make_codec(compressor, group.numel, self.world_size, params[0].device,
                          hierarchical=group.hierarchical and self.world_size > 1, k=group.k, k_max=k_max,
                          selector=self._selector, shapes=[p.shape for p in params], layout=layout, seed=seed)

    @classmethod
    def from_file(cls, model: nn.Module, path: str | os.PathLike[str], **kwargs: Any) -> GradientExchange:
        """Load the plan at `path` (validated, see `Plan.load`) and build the exchange."""
        return cls(model, Plan.load(path), **kwargs)

    @staticmethod
    def _check_options(
        plan: Plan,
        momentum: float,
        nesterov: bool,
        optimizer: torch.optim.Optimizer | None,
        clip_norm: float | None,
        density_warmup: tuple[float, int] | None,
    ) -> DensityWarmup | None:
        """Validate the momentum, clipping and warm-up arguments; return the warm-up."""
        check_momentum_options(momentum, nesterov, optimizer, "GradientExchange")
        if clip_norm is not None and not (math.isfinite(clip_norm) and clip_norm > 0):
            raise ValueError(f"`0 < clip_norm < inf` must hold, but got clip_norm={clip_norm}")
        return None if density_warmup is None else DensityWarmup.of(plan, density_warmup)

    def _refuse_open_step(self) -> None:
        """Before every `optimizer.step()`: refuse a step between a backward and its `synchronize()` (it would apply
        this rank's own gradients). The engine then checks the optimizer's momentum again."""
        if self._active:
            raise DistributedError(
                "optimizer.step() was called after backward but before exchange.synchronize(): it would apply "
                "this rank's own gradients; call exchange.synchronize() between loss.backward() and optimizer.step()"
            )

    def _set_step(self, step: int) -> None:
        """Set the step count and each top-k group's k for it; shrink the buffers once the warm-up is over."""
        self._step = step
        if self._warmup is None:
            return
        for st in self._groups:
            if isinstance(st.codec, TopkCodec):
                self._warmup.set_step(st.codec, step)

    @property
    def step(self) -> int:
        """Number of steps (synchronize calls that exchanged gradients) so far, or loaded by `load_state_dict`."""
        return self._step

    @property
    def host_unions(self) -> dict[int, list[float]]:
        """Per hierarchical top-k group (its index in the plan): the pairs each host sent across at each of the
        latest `UNION_HISTORY` steps, over k (the hosts' largest union of picks, padded to a multiple of the host
        size: from 1, when a host's workers picked the same entries, to the host size, when they picked disjoint
        ones). The profile predicts these exchanges at the union it measured (`HostTopk.union_ratio`); this is
        what training made of it. Copies; empty without such groups."""
        return {st.index: list(st.codec.unions) for st in self._groups
                if isinstance(st.codec, TopkCodec) and st.codec.hierarchical and st.codec.unions}

    @property
    def current_density(self) -> float | None:
        """Density the next step sends: the warm-up's, else the plan's; None for a dense plan."""
        if self._warmup is None:
            return self.plan.density
        return self._warmup.density_at(self._step)

    # -- buffers (DDP's forward_sync_buffers) -----------------------------------------------------
    def _broadcast_from_rank0(self, tensors: Sequence[Tensor]) -> None:
        broadcast_from_rank0(tensors, self.process_group)

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        """Forward pre-hook: copy rank 0's buffers when the previous forward would have synchronised (DDP's rule:
        autograd on and outside `no_sync()`); buffers are read afresh, in case the model reassigned one."""
        if self._sync_buffers_next:
            buffers = list(self._model.buffers())
            if buffers:
                self._broadcast_from_rank0(buffers)
        self._sync_buffers_next = torch.is_grad_enabled() and self._enabled

    # -- hooks and launching ---------------------------------------------------------------------
    def _on_grad_ready(self, group_index: int, param_index: int, param: Tensor) -> None:
        """Post-accumulate-grad hook: gather the gradient now; prepare its group when complete, launch in order."""
        if not self._enabled:
            return
        with self._lock:
            st = self._groups[group_index]
            fix = "call synchronize() after every backward, or accumulate inside `with exchange.no_sync():`"
            if st.prepared:
                raise DistributedError(
                    f"the gradient of {st.names[param_index]} became ready again after its group was sent; {fix}"
                )
            if st.ready[param_index]:
                raise DistributedError(f"the gradient of {st.names[param_index]} became ready twice; {fix}")
            self._active = True
            st.ready[param_index] = True
            st.num_ready += 1
            watch = self._engine.watch
            if watch is not None and watch.measuring(self._step):
                watch.take(param, param.grad)
            self._gather(st, param_index, param.grad)
            if st.num_ready == len(st.params):
                self._prepare(st)
                self._launch_prepared()

    def _gather(self, st: _GroupState, j: int, grad: Tensor | None) -> None:
        """Take parameter j's gradient into its group, in one pass, while it is still in cache (as DDP's reducer
        copies each gradient into its bucket as soon as it is ready).

        A plain group (no clipping, no momentum) takes it as its codec does (`Codec.take`: top-k adds it straight
        into the residual, dense writes it into the flat buffer already divided by the world size, so that the
        allreduce sums to the mean as DDP's does); otherwise the flat buffer takes the local gradient, clipped and
        folded into the velocity once the group is complete. A missing gradient (None) counts as zeros.
        """
        if st.flat is None:
            return
        if st.plain:
            st.codec.take(j, grad, st.views[j])
        else:
            write_scaled(grad, st.views[j], 1.0)

    def _prepare(self, st: _GroupState) -> None:
        """Complete the group for its collective: gather the parameters that had no gradient (zeros), then clip,
        and let the engine fold it into the velocity and the codec compress it.
        """
        for j, ready in enumerate(st.ready):
            if not ready:
                self._gather(st, j, None)
        if st.flat is not None:
            if st.clip is not None:  # as clip_grad_norm_, without a host sync: scale by min(1, c / norm)
                st.flat.mul_(torch.clamp(st.clip / (torch.linalg.vector_norm(st.flat) + 1e-6), max=1.0))
            self._engine.prepare(st.codec, st.flat, st.velocity, taken=st.plain)
        st.prepared = True

    def _launch_prepared(self) -> None:
        """Launch every prepared group that directly follows the launched ones, in plan order."""
        while self._next_launch < len(self._groups) and self._groups[self._next_launch].prepared:
            st = self._groups[self._next_launch]
            st.work = self._start(st)
            self._next_launch += 1

    def _start(self, st: _GroupState) -> Any:
        """Start the group's collectives; the handle of the last (None where nothing is sent)."""
        if st.flat is None:  # dense on world size 1: nothing to send
            return None
        return st.codec.launch(self._link, st.flat)

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait for the collectives in flight, at most `timeout_s` each (None: as long as the process group's
        own timeout), without touching `.grad`; the step stays open (`synchronize` still finishes it). Run
        at interpreter exit for every live exchange. A collective that fails or times out (a peer is gone)
        is left as it is."""
        wait = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
        for work in (st.work for st in self._groups if st.work is not None):
            with contextlib.suppress(RuntimeError):
                if wait is None:
                    work.wait()
                else:
                    work.wait(wait)

    # -- the step --------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Launch the groups not yet launched, wait for all, write the averaged gradients into `.grad`.

        A no-op when no gradient became ready since the last call.
        """
        with self._lock:
            if not self._active:
                if self.gate is not None:
                    self.gate.release()
                return
            for st in self._groups:
                if not st.prepared:
                    self._prepare(st)
            self._launch_prepared()
            if self.gate is not None:  # the partner computes while these collectives run
                if self.gate.held:  # once the device has run this backward (CUDA runs it after queuing it)
                    device_idle(self._device)
                self.gate.release()
            try:
                used = self._used_anywhere() if self.find_unused_parameters else None
                for st in self._groups:
                    if st.work is not None:
                        st.work.wait()
                    self._finish(st, None if used is None else used[st.index])
            finally:
                for st in self._groups:
                    st.reset()
                self._link.last_hierarchical = None
                self._next_launch = 0
                self._active = False
                self._set_step(self._step + 1)
            if self._racing is not None:
                self._race_step()
            watch = self._engine.watch
            if watch is not None and watch.observe(self._step - 1):
                self._replan(self._step - 1)

    # -- adaptive re-planning --------------------------------------------------------------------
    def _replan(self, step: int) -> None:
        """After the last measured step of a period: gather the errors, rank 0 decides, every rank takes its plan."""
        plan = self._engine.replan(step, keep_grouping=False)
        if plan is not None:
            self._adopt(plan, flush=True)

    def _adopt(self, plan: Plan, *, flush: bool) -> None:
        """Run `plan` from the next step: flush the error fed back (averaged over ranks into this step's
        gradients), carry the momentum velocities over parameter by parameter, rebuild the groups."""
        self._engine.check_adoptable(plan, same_groups=False)
        if flush:
            self._flush_error_feedback()
        velocities = {name: view.clone() for st in self._groups if st.velocity is not None
                      for name, view in zip(st.names, _views(st.velocity, st.params), strict=True)}
        self._engine.adopt(plan)
        self._build_groups(plan)
        for st in self._groups:
            if st.velocity is not None and velocities:
                for name, view in zip(st.names, _views(st.velocity, st.params), strict=True):
                    view.copy_(velocities[name])

    def _flush_error_feedback(self) -> None:
        """Add every rank's error fed back (top-k residuals, PowerSGD errors), averaged, to this step's gradients,
        and clear it: what the compressors held back is applied now instead of at later steps."""
        held = [(st, error) for st in self._groups if (error := st.codec.error()) is not None]
        for (st, error), mean in zip(held, self._engine.mean_over_ranks([e for _, e in held]), strict=True):
            for p, view in zip(st.params, _views(mean, st.params), strict=True):
                if p.grad is None:
                    if torch.count_nonzero(view):
                        p.grad = view.to(p.dtype, copy=True)
                else:
                    p.grad.add_(view.to(p.grad.dtype))
            error.zero_()

    def _used_anywhere(self) -> list[list[bool]]:
        """Per group and parameter: whether any rank had a gradient for it this step (one allreduce, queued
        behind the groups' collectives)."""
        flags = torch.tensor([r for st in self._groups for r in st.ready], dtype=torch.uint8)
        if self.world_size > 1:
            device = self._groups[0].params[0].device
            flags = flags.to(device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.process_group)
        values = flags.tolist()
        out, at = [], 0
        for st in self._groups:
            out.append([bool(v) for v in values[at : at + len(st.params)]])
            at += len(st.params)
        return out

    def _finish(self, st: _GroupState, used: list[bool] | None = None) -> None:
        """Turn the collective's result into the averaged gradient and make it each parameter's `.grad`
        (only of the parameters some rank had a gradient for, when `used` says)."""
        if st.flat is None:  # dense on world size 1: the local gradient already is the average
            return
        st.codec.finish(st.flat)
        for j, (p, view, as_view) in enumerate(zip(st.params, st.views, st.as_view, strict=True)):
            if used is not None and not used[j]:
                continue
            if as_view:
                if p.grad is None or p.grad.data_ptr() != view.data_ptr() or p.grad.stride() != view.stride():
                    p.grad = view
            elif p.grad is None:
                p.grad = view.to(p.dtype, copy=True)
            else:
                p.grad.copy_(view)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate into `.grad`; the next backward outside communicates."""
        previous, self._enabled = self._enabled, False
        try:
            yield
        finally:
            self._enabled = previous

    # -- state -----------------------------------------------------------------------------------
    def _layout_digest(self, plan: Plan | None = None) -> str:
        """A digest of `plan`'s groups (default the plan in use): what a state's buffers are laid out by."""
        plan = self.plan if plan is None else plan
        h = hashlib.sha256(plan.strategy.value.encode())
        for g in plan.groups:
            sent = "" if g.compressor is None else f":{g.compressor}"  # dense and top-k plans keep their old digest
            h.update(f"{','.join(g.params)}:{g.k}{sent}\n".encode())
        return h.hexdigest()[:16]

    def state_dict(self) -> dict[str, Any]:
        """What resuming needs (copies, tied to the plan): this rank's residuals, velocities, PowerSGD's state and
        the step count.

        Residuals (top-k), velocities (momentum) and PowerSGD's errors and Qs (with whether its Qs are still to
        be drawn) are keyed by group index; the step count drives the density warm-up.
        """
        state: dict[str, Any] = {
            "kind": STATE_KIND,
            "model_fingerprint": self.plan.model.fingerprint,
            "layout": self._layout_digest(),
            "residuals": {st.index: st.codec.state()["residual"] for st in self._groups
                          if isinstance(st.codec, TopkCodec)},
            "velocities": {st.index: st.velocity.detach().clone() for st in self._groups if st.velocity is not None},
            "step": self._step,
        }
        if self._engine.schedule is not None:  # the plan in use: a resumed adaptive run continues with it
            state["plan"] = self.plan.to_dict()
        if self._race_config is not None:  # the arm in use, and what the race decided: a resumed run keeps them
            state["race_arm"] = self._arm
            if self.race is not None:
                state["race"] = self.race.to_dict()
        powersgd = {st.index: st.codec.state() for st in self._groups if isinstance(st.codec, PowerSGDCodec)}
        if powersgd:
            state["powersgd"] = powersgd
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved for the same model and plan groups (PlanMismatchError else, in one line,
        before anything changes: every entry's type and shape is checked first).

        A state saved without velocities (before momentum existed, or with momentum=0) loads into an
        exchange with momentum as zero velocities; without a step count it resumes at step 0. A state
        with velocities is refused by an exchange without momentum, which would drop them. With `adaptive`, the
        plan the state holds is taken (checked as the first plan was: same model and parameters, this cluster, a
        mixed plan under an error budget).
        """
        kind = state.get("kind") if isinstance(state, dict) else type(state).__name__
        if kind != STATE_KIND:
            raise PlanMismatchError(f"not a GradientExchange state: kind is {kind!r}, expected {STATE_KIND!r}")
        check = StateCheck("exchange", "load the state saved with this plan, or start without one")
        check.fingerprint(state, self.plan)
        plan = self.plan
        if self._engine.schedule is not None and "plan" in state:
            plan = check.plan(state["plan"], self.plan, self.world_size, same_groups=False)
        arm, raced = saved_race(state, check, self._arms) if self._race_config is not None else (None, None)
        if arm is not None:
            plan = self._arms[arm]
        if state.get("layout") != self._layout_digest(plan):
            raise check.refuse(f"this exchange state was saved for other plan groups (layout {state.get('layout')}, "
                               f"this plan {self._layout_digest(plan)})")
        numel = {i: g.numel for i, g in enumerate(plan.groups)}
        kinds = {i: plan.compressor_of(g) for i, g in enumerate(plan.groups)}
        residuals = check.group_buffers(state, "residuals", "residual", numel,
                                        {i for i, c in kinds.items() if c.kind is CompressorKind.TOPK})
        velocities = check.group_buffers(state, "velocities", "velocity", numel,
                                         set(numel) if self.momentum > 0 else set())
        layouts = {i: PowerSGDLayout.of([self._params[n].shape for n in g.params], c.rank)
                   for (i, c), g in zip(kinds.items(), plan.groups, strict=True)
                   if c.kind is CompressorKind.POWERSGD and c.rank is not None}
        powersgd = check.powersgd_groups(state, {i: (layout.numel, layout.q_numel) for i, layout in layouts.items()})
        step = state.get("step", 0)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise check.refuse(f"the state's step count must be an integer >= 0, but got step={step!r}")
        if arm is not None and arm != self._arm:
            self._selector = plan.selector or "exact"
            self._adopt(plan, flush=False)
            self._arm = arm
        elif plan is not self.plan and plan.to_dict() != self.plan.to_dict():
            self._adopt(plan, flush=False)  # its own check (the optimizer's momentum) comes before any change
        for st in self._groups:  # everything checked: now copy
            if isinstance(st.codec, TopkCodec):
                st.codec.load({"residual": residuals[st.index]})
            if st.velocity is not None:
                if velocities:
                    st.velocity.copy_(velocities[st.index])
                else:
                    st.velocity.zero_()
            if isinstance(st.codec, PowerSGDCodec):
                st.codec.load(powersgd[st.index])
        self._set_step(step)
        if arm is not None:  # decided: no race; mid-race: the race starts again from the arm in use
            self.race = raced
            if raced is None:
                self._start_race(arm)
            else:
                self._racing = None

    # -- teardown --------------------------------------------------------------------------------
    def remove_hooks(self) -> None:
        """Remove the gradient and forward hooks (and the optimizer's step pre-hook); the exchange no longer
        reacts."""
        for handle in (*self._grad_hooks, *self._hooks):
            handle.remove()
        self._grad_hooks.clear()
        self._hooks.clear()
        self._engine.remove_hooks()

    def close(self) -> None:
        """Wait (at most `EXIT_DRAIN_S` each) for the collectives in flight, then remove the hooks."""
        self.drain(EXIT_DRAIN_S)
        self.remove_hooks()
        if self.gate is not None:
            self.gate.close()
        _LIVE.discard(self)

    def __enter__(self) -> GradientExchange:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
