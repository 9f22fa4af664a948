"""`planner bench`: real training steps on N local workers, DDP against the runtime with and without the plan, and
each plan run both ways: in the project's runtime (`GradientExchange`, the row "plan X") and inside DDP
(`PlanHook`, the row "plan X via DDP"; a plan PlanHook does not run gets a note instead, `via_ddp_notes`).

Variants run interleaved in short blocks in the same processes, in an order drawn anew each round from a seed every
rank shares, so that the noise of a shared machine falls on all of them alike and no variant always follows the
same one (a fixed order makes what one variant leaves behind, caches or buffers, always another's cost); each step is
timed from a barrier to the end of `optimizer.step()`, and a step's time is the slowest rank's.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from planner.console import progress
from planner.contracts.fingerprint import model_info
from planner.contracts.layers import gradient_layers
from planner.contracts.plan import DDP_ROW, VIA_DDP_ROW, Group, Plan, Prediction
from planner.costmodel.problem import topk_count
from planner.models import Workload, build_workload
from planner.platform import launch  # its launchers called through it: tests replace them there
from planner.platform.hosts import count_hosts
from planner.platform.launch import check_gpus, device_for
from planner.runtime import GradientExchange, TopkHookState, topk_hook
from planner.runtime.ddp_hooks import has_unused_parameters
from planner.runtime.ddp_plan import PlanHook
from planner.spread import LEVEL, STATISTIC_DRAWS, percentile_interval
from planner.strategies.gradients import ALL_HIERARCHICAL
from planner.strategies.via_ddp import via_ddp_refusal
from planner.types import Compressor, CompressorKind, PlanMismatchError, PlannerError, Strategy

if TYPE_CHECKING:
    from collections.abc import Sequence

    from planner.platform.link import LinkRate
    from planner.platform.slowdown import Slowdown

__all__ = [
    "DEFAULT_PEERS",
    "LOCAL",
    "BenchConfig",
    "BenchResult",
    "Runner",
    "Variant",
    "WorkerSetup",
    "auto_tag",
    "bench_backend",
    "bench_variants",
    "bench_worker",
    "file_labels",
    "local_prediction",
    "machine_drift",
    "paired_speedup_interval",
    "per_layer_plan",
    "plan_in_ddp",
    "plan_labels",
    "plan_tag",
    "refuse_gpu_plans",
    "run_bench",
    "via_ddp_label",
    "via_ddp_notes",
]


#: The DDP hooks `planner bench` runs beside DDP unless told otherwise (`--peers`).
DEFAULT_PEERS = (Compressor.parse("fp16"), Compressor.parse("powersgd:1"), Compressor.parse("powersgd:4"))


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """Which plans to run, on which model, and how many steps."""

    plans: tuple[Plan, ...]
    model: str
    #: What users run instead, as PyTorch's own DDP communication hooks: fp16, PowerSGD at a rank (see
    #: `bench_variants`); the project's top-k hook joins for every top-k density a plan uses.
    peers: tuple[Compressor, ...] = DEFAULT_PEERS
    batch_size: int | None = None
    nproc: int = 2
    steps: int = 20
    warmup: int = 5
    block: int = 5
    #: The seed of the rounds' orders (the same on every rank: every rank must run the variants alike).
    seed: int = 0
    lr: float = 0.01
    show_progress: bool = True
    link: LinkRate | None = None
    slowdown: Slowdown | None = None
    hosts: int | None = None  # emulated hosts the local workers are spread over (`--hosts`)
    #: The row name of each plan ("plan dense", `plan_labels`); empty: `plan_labels(plans)`.
    labels: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class BenchResult:
    """One variant's measured step times (seconds), its predicted time, and its speedup over `reference`
    (a variant measured in the same run)."""

    name: str
    strategy: str
    median_s: float
    p25_s: float
    p75_s: float
    steps: int
    predicted_s: float | None
    speedup: float | None = None
    reference: str = "ddp"
    #: Hierarchical top-k groups: the pairs each host sent across over k, averaged over the measured steps and
    #: weighted by k (`GradientExchange.host_unions`); the profile predicted them at the union it measured.
    host_union: float | None = None
    #: The prediction's interval (low, high) from the plan (`Plan.intervals`); None where it has none.
    predicted_interval: tuple[float, float] | None = None
    #: The interval of `speedup` (`paired_speedup_interval`: the interleaved rounds resampled, each with its steps
    #: of both variants); None where the steps were not run in rounds beside the reference's.
    speedup_interval: tuple[float, float] | None = None
    #: The measured step times in the order they ran (each the slowest rank's), `block` to a round: what a paired
    #: comparison of two variants of the same bench needs (`paired_speedup_interval`). Empty: not kept.
    samples_s: tuple[float, ...] = ()
    block: int | None = None

    @property
    def inside(self) -> bool | None:
        """Whether the measured median falls inside the prediction's interval (None without one)."""
        if self.predicted_interval is None:
            return None
        low, high = self.predicted_interval
        return low <= self.median_s <= high

    @classmethod
    def from_samples(cls, name: str, strategy: str, samples: list[float], *, steps: int, predicted_s: float | None,
                     reference: str) -> BenchResult:
        """Median and quartiles of the samples (step times, or average step times over windows)."""
        q = statistics.quantiles(samples, n=4, method="inclusive") if len(samples) > 1 else [samples[0]] * 3
        return cls(name=name, strategy=strategy, median_s=statistics.median(samples), p25_s=q[0], p75_s=q[2],
                   steps=steps, predicted_s=predicted_s, reference=reference, samples_s=tuple(samples))

    @property
    def rel_error(self) -> float | None:
        if self.predicted_s is None:
            return None
        return abs(self.predicted_s - self.median_s) / self.median_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "strategy": self.strategy, "median_s": self.median_s, "p25_s": self.p25_s,
            "p75_s": self.p75_s, "steps": self.steps, "predicted_s": self.predicted_s,
            "speedup": self.speedup, "reference": self.reference, "rel_error": self.rel_error,
            **({"host_union": self.host_union} if self.host_union is not None else {}),
            **({} if self.predicted_interval is None else {"predicted_interval": list(self.predicted_interval),
                                                            "inside": self.inside}),
            **({} if self.speedup_interval is None else {"speedup_interval": list(self.speedup_interval)}),
            **({} if self.block is None else {"block": self.block, "samples_s": list(self.samples_s)}),
        }


def paired_speedup_interval(reference_s: Sequence[float], samples_s: Sequence[float], block: int, *,
                            level: float = LEVEL, draws: int = STATISTIC_DRAWS, seed: int = 0
                            ) -> tuple[float, float]:
    """The interval of the speedup median(reference) / median(samples) of two variants benched interleaved, `block`
    steps of each to a round (the last round possibly shorter): the rounds are resampled with replacement, each
    keeping its steps of both variants, so that what a round's spell of noise did to both stays paired; the central
    `level` of the resampled speedups (a percentile bootstrap, deterministic by `seed`).

    Raises:
        ValueError: no steps, or two variants not run in the same rounds (their step counts differ)."""
    if len(reference_s) == 0 or len(reference_s) != len(samples_s) or block < 1:
        raise ValueError(f"a paired interval needs two variants' steps in the same rounds (got {len(reference_s)} "
                         f"and {len(samples_s)} steps, {block} to a round)")
    rounds = math.ceil(len(reference_s) / block)
    ref = np.full((rounds, block), np.nan)
    arm = np.full((rounds, block), np.nan)
    ref.flat[:len(reference_s)] = reference_s
    arm.flat[:len(samples_s)] = samples_s
    picks = np.random.default_rng(seed).integers(0, rounds, size=(draws, rounds))
    ratios = (np.nanmedian(ref[picks].reshape(draws, -1), axis=1)
              / np.nanmedian(arm[picks].reshape(draws, -1), axis=1))
    return percentile_interval(ratios, level)


def timed_step(
    model: torch.nn.Module,
    loss_fn: Any,
    batch: tuple[torch.Tensor, torch.Tensor],
    opt: torch.optim.Optimizer,
    *after_backward: Any,
) -> float:
    """Seconds of one training step from a barrier: forward, backward, `after_backward()` calls, update. On a GPU
    the clock is read once the device has finished the step (the barrier, too, waits for queued work)."""
    inputs, targets = batch
    cuda = inputs.is_cuda
    dist.barrier()
    if cuda:
        torch.cuda.synchronize(inputs.device)
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss_fn(model(inputs), targets).backward()
    for finish in after_backward:
        finish()
    opt.step()
    if cuda:
        torch.cuda.synchronize(inputs.device)
    return time.perf_counter() - t0


def slowest_rank(times: list[list[float]], device: torch.device | None = None) -> list[list[float]]:
    """Each step's time as the slowest rank's (a collective: every rank calls it; on `device`, a GPU for nccl)."""
    all_times = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(all_times, op=dist.ReduceOp.MAX)
    return all_times.tolist()


def refuse_gpu_plans(plans: Sequence[Plan], what: str,
                     instead: str = "on GPUs, bench step times with --strategy gradients or kfac") -> None:
    """`what` runs its workers on the CPU (gloo) only: a plan made on GPUs is refused in one line rather than
    measured somewhere else than it was planned for."""
    if any(p.cluster.backend != "gloo" for p in plans):
        raise PlanMismatchError(f"{what} runs its workers on the CPU (gloo) only, and the plan was made on GPUs "
                                f"(backend nccl): {instead}")


def bench_backend(plans: tuple[Plan, ...]) -> str:
    """The backend the bench runs on: the one the plans were profiled on. nccl puts each worker on its own GPU,
    gloo on the CPU; a plan made on GPUs is not benched on CPUs (its predictions are for the GPUs)."""
    backends = sorted({p.cluster.backend for p in plans})
    if len(backends) > 1:
        raise PlanMismatchError(f"the plans were made on different backends ({', '.join(backends)}): bench plans "
                                f"solved from profiles of the same machine")
    backend = backends[0]
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise PlanMismatchError("the plan was made on GPUs (backend nccl), and no GPU is visible here: bench it "
                                    f"where it was profiled, or profile this machine and re-plan: "
                                    f"{plans[0].replan_command()}")
        check_gpus(backend, plans[0].cluster.world_size,
                   fix="bench it where it was profiled, or profile with fewer workers and re-plan")
    elif backend != "gloo":
        raise PlanMismatchError(f"the plan was made on backend {backend!r}; the bench runs gloo or nccl")
    return backend


def per_layer_plan(plan: Plan, module: torch.nn.Module) -> Plan:
    """The same plan with one collective per layer (the WFBP baseline), in the plan's ready order."""
    spec = {s.name: s for s in gradient_layers(module)}
    groups = []
    for name in (lay for g in plan.groups for lay in g.layers):
        if name not in spec:
            raise PlanMismatchError(f"layer {name!r} of the plan is not a layer of the model")
        s = spec[name]
        k = None
        if plan.strategy is Strategy.TOPK:
            assert plan.density is not None
            k = topk_count(s.numel, plan.density)
        groups.append(Group(layers=(name,), params=s.params, numel=s.numel, k=k))
    wfbp = plan.baselines.get("wfbp", plan.predicted)
    bound = plan.lower_bound_s
    gap = max(0.0, wfbp.iteration_s / bound - 1) if bound > 0 else 0.0
    return replace(plan, groups=tuple(groups), solver="wfbp", predicted=wfbp, optimal=False, gap=gap)


@dataclass(frozen=True)
class Variant:
    """One benched configuration: DDP (plan None), DDP with a communication hook (`hook`: PyTorch's fp16 or
    PowerSGD hook, or the project's top-k hook), the runtime executing `plan` (`via_ddp`: DDP executing it, with
    `PlanHook`), or local steps that communicate nothing (`local`: each rank trains on its own, the compute every
    prediction is built on); `predicted_s` is the model's time for it."""

    name: str
    plan: Plan | None
    predicted_s: float | None
    hook: Compressor | None = None
    local: bool = False
    selector: str = "exact"
    interval: tuple[float, float] | None = None
    via_ddp: bool = False
    adaptive: bool = False  # the plan re-planned as training goes (the time-to-target bench's `--adaptive`)


#: SGD's momentum in every step bench times (where it goes: `sgd_as_advised`).
BENCH_MOMENTUM = 0.9
#: Name of the variant of local steps (no communication).
LOCAL = "local (no communication)"


def local_prediction(plan: Plan | Prediction) -> float:
    """The profile's forward + backward + update, as a prediction of a plan that compresses nothing (a dense
    plan's, or DDP's baseline row) holds it: its compute path less packing and interference (the whole step
    when nothing is communicated)."""
    p = plan.predicted if isinstance(plan, Plan) else plan
    return p.compute_s - p.pack_s - p.interference_s - p.selection_s - p.decode_s


def machine_drift(results: list[BenchResult]) -> float | None:
    """How much slower (> 0) or faster the local steps ran than the profile predicts, or None without them:
    a shared machine that is busier now than when it was profiled makes every prediction off as much."""
    local = next((r for r in results if r.name == LOCAL), None)
    if local is None or not local.predicted_s:
        return None
    return local.median_s / local.predicted_s - 1


def plan_tag(plan: Plan) -> str:
    """How the bench names a plan by its strategy and what it sends: "dense", "topk@D", "mixed (C1, C2)" (the
    compressors its groups are sent with, in the order it was allowed them); on several hosts, how its groups cross
    them ("dense, flat")."""
    match plan.strategy:
        case Strategy.TOPK:
            tag = f"topk@{plan.density:g}"
        case Strategy.MIXED:
            tag = f"mixed ({sends(plan)})"
        case _:
            tag = plan.strategy.value
    return tag if plan.cluster.host_count < 2 else f"{tag}, {_route(plan)}"


def auto_tag(plan: Plan) -> str:
    """How the bench names the plan `--strategy auto` kept: "auto (fp16)", by what it sends (and on several hosts,
    how its groups cross them)."""
    tag = f"auto ({sends(plan)})"
    return tag if plan.cluster.host_count < 2 else f"{tag}, {_route(plan)}"


def sends(plan: Plan) -> str:
    """The compressors a plan's groups are sent with, in the order it was allowed them: "fp16, powersgd:1"."""
    used = {plan.compressor_of(g) for g in plan.groups}
    order = [*(plan.compressors or ()), *(plan.compressor_of(g) for g in plan.groups)]
    return ", ".join(str(c) for c in dict.fromkeys(order) if c in used)


def plan_labels(plans: Sequence[Plan], stems: Sequence[str] = (), tags: Sequence[str | None] = ()) -> list[str]:
    """The bench's row name of each plan: "plan " and its tag (`plan_tag`, or `tags[i]` where given); plans whose
    names would be the same are told apart by their files' stems (`stems`, e.g. "plan dense (dense1)"), or where
    those are the same too or not given, by their paths' order among the plans ("plan dense (plan 2 of 3)").

    Raises:
        PlannerError: `stems` or `tags` of another length than `plans`.
    """
    if (stems and len(stems) != len(plans)) or (tags and len(tags) != len(plans)):
        raise PlannerError(f"{len(plans)} plans, but {len(stems)} file names and {len(tags)} tags to name them by")
    names = [f"plan {(tags[i] if tags else None) or plan_tag(p)}" for i, p in enumerate(plans)]
    clash = {n for n in names if names.count(n) > 1}
    if not clash:
        return names
    by_stem = [f"{n} ({stems[i]})" if stems and n in clash else n for i, n in enumerate(names)]
    return [f"{n} (plan {i + 1} of {len(plans)})" if by_stem.count(n) > 1 else n for i, n in enumerate(by_stem)]


def file_labels(plans: Sequence[Plan], paths: Sequence[str | os.PathLike[str]]) -> tuple[str, ...]:
    """The bench's row name of each plan read from `paths` (`planner bench --plan`): by its strategy and what it
    sends, and where two would read the same, by its file's stem ("plan dense (dense1)"; by its path where the
    stems are the same too)."""
    stems = [Path(p).stem for p in paths]
    return tuple(plan_labels(plans, [str(p) if stems.count(stem) > 1 else stem for p, stem in zip(paths, stems,
                                                                                                 strict=True)]))


def _route(plan: Plan) -> str:
    """How a multi-host plan's groups cross hosts: flat, hierarchical, or how many of them hierarchically."""
    routed = sum(g.hierarchical for g in plan.groups)
    return ("flat" if routed == 0 else "hierarchical" if routed == len(plan.groups)
            else f"{routed} of {len(plan.groups)} groups hierarchical")


def via_ddp_label(label: str) -> str:
    """The bench's row name of the plan named `label` run inside DDP: "plan dense via DDP"."""
    return f"{label} via DDP"


def via_ddp_notes(plans: Sequence[Plan], labels: Sequence[str] = ()) -> list[str]:
    """One line per plan the bench does not run inside DDP (`PlanHook` does not run it), saying why."""
    labels = list(labels) or plan_labels(plans)
    return [f"no row {via_ddp_label(label)!r}: {why}" for plan, label in zip(plans, labels, strict=True)
            if (why := via_ddp_refusal(plan)) is not None]


def bench_variants(plans: tuple[Plan, ...], module: torch.nn.Module,
                   peers: tuple[Compressor, ...] = DEFAULT_PEERS, labels: Sequence[str] = ()) -> list[Variant]:
    """Every variant the bench runs: DDP; local steps (with a dense plan); per plan one group per layer (dense and
    top-k plans), the plan itself (named `labels[i]`, default `plan_labels`) and, where `PlanHook` runs it, the
    plan inside DDP (`via_ddp_label`, predicted by the plan's row `VIA_DDP_ROW`); then DDP with each peer hook and
    with the top-k hook at every density a plan uses, each predicted by the first plan that predicts it (its "ddp+C"
    row: a top-k plan's DDP row, a mixed plan's rows of DDP's hooks)."""
    dense = next((p for p in plans if p.strategy is Strategy.DENSE), None)
    # Plain DDP's prediction: a dense or mixed plan's "ddp" row (a top-k plan's DDP row has the top-k hook).
    plain = dense or next((p for p in plans if p.strategy is not Strategy.TOPK), None)
    ddp_pred = plain.baselines.get(DDP_ROW) if plain is not None else None
    out = [Variant(DDP_ROW, None, ddp_pred.iteration_s if ddp_pred else None,
                   interval=_interval(plain, DDP_ROW) if ddp_pred else None)]
    compute = dense if dense is not None else ddp_pred  # the profile's compute alone, beside the machine's now
    if compute is not None:
        out.append(Variant(LOCAL, None, local_prediction(compute), local=True))
    # The peers asked for, and every DDP hook a plan's verdict weighed it against (the bench measures what the
    # verdict compared).
    weighed_hooks = [Compressor.parse(name.removeprefix("ddp+")) for p in plans if p.verdict is not None
                     for name in (p.verdict.keep, p.verdict.against) if name.startswith("ddp+")]
    hooks: dict[Compressor, tuple[float | None, str, tuple[float, float] | None]] = {
        c: (None, "exact", None) for c in dict.fromkeys((*peers, *weighed_hooks))}
    labels = list(labels) or plan_labels(plans)
    if len(labels) != len(plans):
        raise PlannerError(f"{len(plans)} plans, but {len(labels)} names for them")
    per_layer: set[Strategy] = set()
    for plan, label in zip(plans, labels, strict=True):
        if plan.strategy is not Strategy.MIXED and plan.strategy not in per_layer:  # one per strategy
            per_layer.add(plan.strategy)
            pl = per_layer_plan(plan, module)
            out.append(Variant(f"per-layer {plan_tag(pl)}", pl, pl.predicted.iteration_s,
                               interval=_interval(plan, "wfbp") if "wfbp" in plan.baselines else None))
        out.append(Variant(label, plan, plan.predicted.iteration_s, interval=_interval(plan, "plan")))
        if via_ddp_refusal(plan) is None:
            via = plan.baselines.get(VIA_DDP_ROW)  # None: a plan made before it was predicted
            out.append(Variant(via_ddp_label(label), plan, via.iteration_s if via is not None else None,
                               interval=_interval(plan, VIA_DDP_ROW), via_ddp=True))
        if (plan.strategy is Strategy.TOPK and plan.cluster.host_count > 1 and ALL_HIERARCHICAL not in plan.baselines
                and not any(g.hierarchical for g in plan.groups)):
            # The same groups merged inside each host and sent across once per host. A profile that measured the
            # hierarchical top-k exchange lets the solver choose the way per group; without it, measured only.
            twin = replace(plan, groups=tuple(replace(g, hierarchical=True) for g in plan.groups))
            name = label.replace(", flat", ", hierarchical", 1) if ", flat" in label else f"{label}, hierarchical"
            out.append(Variant(f"{name} (not modelled)", twin, None))
        if plan.strategy is Strategy.TOPK:  # DDP with the top-k hook runs for every top-k plan
            assert plan.density is not None
            hooks.setdefault(Compressor(CompressorKind.TOPK, density=plan.density), (None, "exact", None))
        for name, prediction in plan.baselines.items():
            if name.startswith("ddp+"):
                c = Compressor.parse(name.removeprefix("ddp+"))
                wanted = c in hooks or c.kind is CompressorKind.TOPK  # the peers asked for, and top-k's hook
                if wanted and hooks.get(c, (None, "", None))[0] is None:
                    # A mixed plan's table predicts DDP's top-k hook with the selector the profile predicts faster,
                    # which its verdict records; a top-k plan's, with the plan's own.
                    selector = (_verdict_selector((plan,), c) if plan.strategy is Strategy.MIXED else None) \
                        or plan.selector or "exact"
                    hooks[c] = (prediction.iteration_s, selector, _interval(plan, name))
    # A hook no plan's table predicts: the verdict's prediction of it, where a plan weighed itself against it (for
    # top-k, with the selector the verdict took: the one predicted faster).
    for c, (predicted, selector, _) in list(hooks.items()):
        weighed = _weighed(plans, f"ddp+{c}")
        if predicted is None and weighed is not None:
            hooks[c] = (weighed[0], _verdict_selector(plans, c) or selector, (weighed[1], weighed[2]))
    if out[0].predicted_s is None and (weighed := _weighed(plans, "ddp")) is not None:
        out[0] = replace(out[0], predicted_s=weighed[0], interval=(weighed[1], weighed[2]))
    out += [Variant(f"ddp+{c}", None, predicted, hook=c, selector=selector, interval=interval)
            for c, (predicted, selector, interval) in hooks.items()]
    return out


def _verdict_selector(plans: tuple[Plan, ...], hook: Compressor) -> str | None:
    """The top-k selector of the verdict that weighed `hook` (a top-k hook: the profile's faster selector for it)."""
    if hook.kind is not CompressorKind.TOPK:
        return None
    return next((p.verdict.topk_selector for p in plans if p.verdict is not None
                 and f"ddp+{hook}" in p.verdict.variants), None)


def _weighed(plans: tuple[Plan, ...], variant: str) -> tuple[float, float, float] | None:
    """A DDP variant's (step, low, high) from the first plan whose verdict weighed it (None: none did)."""
    return next((p.verdict.variants[variant] for p in plans if p.verdict is not None and variant in p.verdict.variants),
                None)


def _interval(plan: Plan | None, row: str) -> tuple[float, float] | None:
    """The interval of one of the plan's rows ("plan" or a baseline's name), where it has one."""
    if plan is None or plan.intervals is None:
        return None
    return plan.intervals.rows.get(row)


def ddp_with_hook(module: torch.nn.Module, hook: Compressor | None, *, find_unused: bool,
                  selector: str = "exact") -> torch.nn.Module:
    """`module` in DDP with `hook`'s communication hook: PyTorch's `fp16_compress_hook` or `powerSGD_hook` (rank r,
    error feedback and warm start, compressing from the third iteration, the earliest DDP allows), or the
    project's top-k hook. On gloo DDP's PowerSGD hook aborts with a collective mismatch when a step has several
    buckets (its second round is launched from a callback thread while the next bucket's allreduce is
    launched from the backward pass), so there it runs with one bucket holding every gradient; and with
    `find_unused` its second round races DDP's allreduce of the used-parameter map (a collective mismatch or a
    hang), so there it runs with `static_graph=True`: DDP finds the unused parameters in the first iteration,
    while the hook still allreduces plainly, and sends no map after it."""
    one_bucket = hook is not None and hook.kind is CompressorKind.POWERSGD and dist.get_backend() == "gloo"
    size_mb = sum(p.numel() * p.element_size() for p in module.parameters()) / 2**20
    static = one_bucket and find_unused
    wrapped = DistributedDataParallel(module, find_unused_parameters=find_unused and not static, static_graph=static,
                                      bucket_cap_mb=size_mb + 1 if one_bucket else None)
    if hook is None:
        return wrapped
    match hook.kind:
        case CompressorKind.FP16:
            wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)
        case CompressorKind.POWERSGD:
            state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=hook.rank, start_powerSGD_iter=2)
            wrapped.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        case CompressorKind.TOPK:
            assert hook.density is not None
            wrapped.register_comm_hook(TopkHookState(hook.density, selector=selector), topk_hook)
        case _:
            pass
    return wrapped


def plan_in_ddp(module: torch.nn.Module, plan: Plan, *, find_unused: bool, momentum: float = 0.0,
                optimizer: torch.optim.Optimizer | None = None) -> torch.nn.Module:
    """`module` in DDP running `plan` as README shows: its groups as DDP's buckets, its compressors as one
    communication hook (`PlanHook`); `find_unused` as the bench found the model (else as the plan says);
    `momentum` and `optimizer` as `PlanHook`'s (momentum correction in the hook)."""
    return plan_hook_in_ddp(module, plan, find_unused=find_unused, momentum=momentum, optimizer=optimizer)[0]


def plan_hook_in_ddp(module: torch.nn.Module, plan: Plan, *, find_unused: bool, momentum: float = 0.0,
                     optimizer: torch.optim.Optimizer | None = None, adaptive: Any = None
                     ) -> tuple[torch.nn.Module, Any]:
    """`plan_in_ddp`'s DDP module and its `PlanHook`; `adaptive`: a `Replanning` for the hook (None: none)."""
    hook = PlanHook(module, plan, find_unused_parameters=True if find_unused else None, momentum=momentum,
                    optimizer=optimizer, adaptive=adaptive or False)
    wrapped = DistributedDataParallel(module, **hook.ddp_kwargs())
    hook.register(wrapped)
    return wrapped, hook


def sgd_as_advised(model: torch.nn.Module, plan: Plan | None, *, lr: float, momentum: float, find_unused: bool,
                   model_name: str | None = None, density_warmup: tuple[float, int] | None = None,
                   adaptive: Any = None) -> tuple[torch.optim.SGD, Any]:
    """SGD with `momentum` as a user runs each variant: in the optimizer for DDP, its hooks and plans without
    top-k groups; for a plan that sends top-k, in the exchange (momentum correction) with the optimizer's at 0,
    as README's "Top-k with momentum" advises. `density_warmup` is given to the exchange of a top-k plan
    (`GradientExchange(density_warmup=)`); the other variants run without it. `adaptive`: a `Replanning` for the
    exchange (its re-plans then keep top-k out where the optimizer holds the momentum). Returns the optimizer and the
    plan's exchange (None without one)."""
    in_exchange = plan is not None and plan.sends_topk
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0 if in_exchange else momentum)
    if plan is None:
        return opt, None
    warmup = density_warmup if plan.strategy is Strategy.TOPK and plan.density is not None else None
    exchange = GradientExchange(model, plan, model_name=model_name, find_unused_parameters=find_unused or None,
                                momentum=momentum if in_exchange else 0.0,
                                optimizer=opt if in_exchange or adaptive is not None else None,
                                density_warmup=warmup, adaptive=adaptive or False)
    return opt, exchange


#: Warm-up steps of a DDP PowerSGD variant at least (its hook allreduces plainly for two iterations).
POWERSGD_HOOK_WARMUP = 2


@dataclass
class Runner:
    """One variant built to run in this worker: its own copy of the model (the same weights on every rank), the
    model as the variant wraps it (plain, in DDP with a hook, in DDP with the plan's `PlanHook`), the plan's
    exchange where the runtime runs it, and the optimizer."""

    workload: Workload
    model: torch.nn.Module
    exchange: Any
    opt: torch.optim.Optimizer

    @classmethod
    def build(cls, v: Variant, model_name: str, *, batch_size: int | None, lr: float, device: torch.device,
              find_unused: bool) -> Runner:
        wl = build_workload(model_name, batch_size=batch_size)  # same seed: same weights on every rank
        wl.module.to(device)
        if v.via_ddp:
            assert v.plan is not None
            # The algorithm of the plan's own row: SGD's momentum where `sgd_as_advised` puts it for the plan, in
            # momentum correction (here the hook's) for a plan that sends top-k, else in the optimizer.
            in_hook = v.plan.sends_topk
            opt = torch.optim.SGD(wl.module.parameters(), lr=lr, momentum=0.0 if in_hook else BENCH_MOMENTUM)
            model = plan_in_ddp(wl.module, v.plan, find_unused=find_unused,
                                momentum=BENCH_MOMENTUM if in_hook else 0.0, optimizer=opt if in_hook else None)
            return cls(wl, model, None, opt)
        if v.local or v.plan is not None:
            model = wl.module
        else:
            model = ddp_with_hook(wl.module, v.hook, find_unused=find_unused, selector=v.selector)
        opt, exchange = sgd_as_advised(model, v.plan, lr=lr, momentum=BENCH_MOMENTUM, find_unused=find_unused)
        return cls(wl, model, exchange, opt)

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        """One timed training step (`timed_step`)."""
        return timed_step(self.model, self.workload.loss_fn, batch, self.opt,
                          *([self.exchange.synchronize] if self.exchange else []))

    def warm_up(self, v: Variant, steps: int, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
        """Untimed steps before the measured ones: `steps`, and for DDP's PowerSGD hook at least the plain
        iterations it starts with. Returns how many ran."""
        powersgd = v.hook is not None and v.hook.kind is CompressorKind.POWERSGD
        ran = max(steps, POWERSGD_HOOK_WARMUP) if powersgd else steps
        for _ in range(ran):
            self.step(batch)
        return ran

    def close(self) -> None:
        if self.exchange is not None:
            self.exchange.close()


@dataclass(frozen=True)
class WorkerSetup:
    """What a step-timing worker (the bench's, the race's) prepares before building its variants: the device, the
    model as built once (its module for the variants' names and checks), this rank's one batch, and whether DDP and
    the exchange must be told that some parameters go unused."""

    device: torch.device
    base: Workload
    batch: tuple[torch.Tensor, torch.Tensor]
    find_unused: bool

    @classmethod
    def on_this_rank(cls, rank: int, world_size: int, model: str, batch_size: int | None,
                     plans: Sequence[Plan]) -> WorkerSetup:
        torch.manual_seed(0)
        backend = dist.get_backend()
        device = device_for(backend)
        base = build_workload(model, batch_size=batch_size)
        hosts = count_hosts()
        for plan in plans:
            plan.check_compatible(model_info(base.module, model), world_size, hosts=hosts, backend=backend)
        gen = torch.Generator().manual_seed(1000 + rank)
        inputs, targets = base.make_batch(base.batch_size, gen)
        batch = (inputs.to(device), targets.to(device))
        base.module.to(device)
        # A model with parameters the loss does not use: DDP and the exchange must be told (as a user would).
        unused = has_unused_parameters(base.module, lambda m: base.loss_fn(m(batch[0]), batch[1])) or any(
            p.unused_params is not None and p.unused_params.any for p in plans)  # unused in other batches
        return cls(device, base, batch, unused)


def bench_worker(rank: int, world_size: int, config: BenchConfig) -> list[BenchResult] | None:
    """Run every variant on this rank; rank 0 returns the results."""
    setup = WorkerSetup.on_this_rank(rank, world_size, config.model, config.batch_size, config.plans)
    device, batch, unused = setup.device, setup.batch, setup.find_unused
    variants = bench_variants(config.plans, setup.base.module, config.peers, config.labels)
    runners = [Runner.build(v, config.model, batch_size=config.batch_size, lr=config.lr, device=device,
                            find_unused=unused) for v in variants]

    def step(i: int) -> float:
        return runners[i].step(batch)

    n = len(variants)
    times: list[list[float]] = [[] for _ in range(n)]
    show = config.show_progress and rank == 0
    with progress(enabled=show) as bar:
        task = bar.add_task("bench steps", total=n * (config.warmup + config.steps))
        for runner, v in zip(runners, variants, strict=True):
            bar.advance(task, runner.warm_up(v, config.warmup, batch))
        order = random.Random(config.seed)
        while any(len(t) < config.steps for t in times):
            for i in order.sample(range(n), n):
                for _ in range(min(config.block, config.steps - len(times[i]))):
                    times[i].append(step(i))
                    bar.advance(task)
    unions = [None if r.exchange is None else measured_union(r.exchange, config.steps) for r in runners]
    for r in runners:
        r.close()
    slowest = slowest_rank(times, device)
    if rank != 0:
        return None
    results = [
        BenchResult.from_samples(v.name, "local" if v.local else "ddp" if v.plan is None else v.plan.strategy.value,
                                 row, steps=len(row),
                                 predicted_s=v.predicted_s, reference="ddp")
        for v, row in zip(variants, slowest, strict=True)
    ]
    results = [replace(r, host_union=u, predicted_interval=v.interval, block=config.block)
               for r, u, v in zip(results, unions, variants, strict=True)]
    ddp = results[0]
    return [replace(r, speedup=ddp.median_s / r.median_s,
                    speedup_interval=paired_speedup_interval(ddp.samples_s, r.samples_s, config.block))
            for r in results]


def measured_union(exchange: Any, steps: int) -> float | None:
    """The pairs each host sent across over k in `exchange`'s hierarchical top-k groups, over its last `steps`
    steps (the measured ones) and weighted by each group's k; None without such groups. The same on every rank
    (each host sends its largest union, agreed across hosts)."""
    means = {i: statistics.fmean(u[-steps:]) for i, u in exchange.host_unions.items() if u}
    ks = {i: exchange.plan.groups[i].k or 0 for i in means}
    total = sum(ks.values())
    return sum(ks[i] * m for i, m in means.items()) / total if total else None


def run_bench(config: BenchConfig) -> list[BenchResult] | None:
    """Bench every variant on `config.nproc` local workers (on the backend the plans were profiled on: gloo on
    the CPU, nccl on a GPU each), or on torchrun's group (possibly across hosts) when launched by torchrun; the
    results on rank 0, None on the other torchrun ranks."""
    for plan in config.plans:
        if plan.cluster.world_size != config.nproc:
            raise PlanMismatchError(
                f"the plan was made for world size {plan.cluster.world_size}, but --nproc is {config.nproc}; "
                f"re-plan: {plan.replan_command()}"
            )

    return launch.run_job(bench_worker, config.nproc, config, backend=bench_backend(config.plans), link=config.link,
                          slowdown=config.slowdown, hosts=config.hosts)
