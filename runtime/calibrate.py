"""The runtime measures its own work on the compute stream, for the profile's calibration
(`planner.contracts.profile.InSitu`):

- packing: `write_scaled` (a group's gradients into its flat buffer, divided by the world size)
  against the number of elements;
- in situ: `GradientExchange` itself (one group per layer, sending nothing) in real steps beside
  steps without it, against what the micro-benchmarked curves predict for the same groups; and
  PyTorch DDP with a comm hook that sends nothing, against packing on its default buckets;
- K-FAC: `KFACPreconditioner`'s factor hooks (sending nothing) in real forward and backward passes,
  against the per-layer factor micro-benchmarks.

`planner profile` runs these in its workers after the profilers' measurements.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from planner.contracts.fingerprint import ClusterInfo, model_info
from planner.contracts.kfac_section import KFACSection, kfac_layers
from planner.contracts.layers import LayerSpec
from planner.contracts.plan import Group, Plan, Prediction
from planner.contracts.profile import (
    KFAC_STEP_PARTS,
    Calibration,
    CompressTiming,
    FittedCurve,
    InSitu,
    KFACTiming,
    LayerTiming,
    TopkTiming,
)
from planner.costmodel.costs import AffineCost, CostModel
from planner.costmodel.curves import curve_model, fit_curve, select_model
from planner.costmodel.mixed_simulator import FP32_BYTES
from planner.costmodel.problem import GradientProblem, groups_for, groups_of, topk_count
from planner.kernels.compress import PowerSGDLayout
from planner.models import Workload
from planner.platform.hosts import count_hosts
from planner.platform.memory import collect_garbage
from planner.platform.phase import set_phase
from planner.platform.timing import gathered, median, slowest, stream_seconds, time_call
from planner.runtime.codecs import Link, write_scaled
from planner.runtime.ddp_hooks import has_unused_parameters, silent_hook
from planner.runtime.exchange import GradientExchange
from planner.runtime.preconditioner import KFACPreconditioner
from planner.solvers import BASELINES, DDP_BASELINE
from planner.types import Compressor, CompressorKind, InverseMethod, Strategy

__all__ = ["group_of_this_rank", "in_situ_runs", "kfac_steps_points", "measure_in_situ", "measure_kfac_in_situ",
           "measure_kfac_steps_in_situ", "measure_packing", "slowest_rank_extra", "slowest_rank_phases"]


def measure_packing(
    sizes: Sequence[int], world_size: int, device: torch.device, *, repeats: int, warmup: int,
    on_point: Callable[[], object] = lambda: None,
) -> FittedCurve:
    """Median seconds of `write_scaled` writing N gradient elements into a flat buffer, scaled by 1/P, for
    each N in `sizes`, with the affine fit."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    points = []
    for n in sizes:
        grad = torch.randn(n, generator=gen).to(device)
        flat = torch.empty(n, device=device)
        samples = time_call(functools.partial(write_scaled, grad, flat, 1.0 / world_size), device,
                            repeats=repeats, warmup=warmup)
        points.append((int(n), median(samples)))
        on_point()
    return fit_curve(points)


class _SilentLink(Link):
    """A link that sends nothing: each rank's message stands for every rank's (top-k decodes P copies of its own),
    so the codecs prepare and finish with all their usual work."""

    def sum(self, buffer: Tensor, hierarchical: bool) -> None:
        return None

    def gather(self, recv: Tensor, send: Tensor) -> None:
        if recv is not send:
            size = send.numel()
            for r in range(self.world_size):
                recv[r * size : (r + 1) * size].copy_(send)

    def across_hosts(self, buffer: Tensor, run: Callable[[], object] | None = None) -> Any:
        return None


class _SilentExchange(GradientExchange):
    """The runtime with every collective skipped (`_SilentLink`)."""

    _link_type = _SilentLink


def measure_in_situ(
    workload: Workload,
    device: torch.device,
    layers: Sequence[LayerTiming],
    world_size: int,
    *,
    pack: CostModel,
    topk: TopkTiming | None,
    density: float,
    repeats: int,
    compress: CompressTiming | None = None,
    comm: CostModel | None = None,
    process_group: Any = None,
    on_point: Callable[[], object] = lambda: None,
    on_more: Callable[[int], object] = lambda more: None,
) -> InSitu:
    """Calibrate packing, each selector, decoding and each compressor against the runtime in real steps (every
    rank calls it).

    For dense, for top-k at `density` with each selector `topk` measured, and for fp16 and each PowerSGD rank
    `compress` measured, the runtime with one group per layer (in `layers`' ready order) and a plain copy of
    the model run alternately, `repeats` pairs of steps after one unmeasured pair. Each pair's difference (the
    runtime's extra backward time: its hooks pack, select or compress; less packing for a compressor, packing
    being calibrated first) is a sample, and so is each synchronize call's time (decoding); every rank's samples
    are kept (`Calibration.samples_s`), against the curves' sum over the same groups. With more than one worker,
    PyTorch DDP with a comm hook that sends nothing is measured the same way against packing on its default
    buckets (`InSitu.ddp_pack`), and PyTorch's PowerSGD hook at each rank twice: on a process group of each rank
    alone (its work) and, given `comm` (the allreduce's curve on the real links), on the real process group, where
    what sending added is calibrated against `comm`'s prediction for the hook's allreduces ("send"). Given
    `comm`, the runtime's own PowerSGD at each rank is calibrated the same way, with one group of every layer
    measured sending nothing and then sending (its "send").
    A configuration whose calibration the cost model would not use (its interval
    includes no effect, or it is implausible: `planner.spread.calibration_use`) is measured once more
    (`on_more` hears how many more pairs), and the second measurement kept. `on_point` is called after each pair.
    """
    specs = [LayerSpec(name=lt.name, params=lt.params, numel=lt.numel) for lt in layers]
    per_layer = tuple(range(1, len(specs) + 1))
    inputs, targets = (t.to(device) for t in workload.batch(seed=2468))
    plain = workload.module.to(device)
    run = functools.partial(_runtime_samples, workload, plain, inputs, targets, device, world_size, repeats,
                            process_group, on_point)

    def calibrate(what: str, measure: Callable[[], Any],
                  build: Callable[[Any, int], dict[str, Calibration]]) -> dict[str, Calibration]:
        set_phase(f"the runtime in real steps: {what}")  # where a worker that fails or hangs was
        return _until_usable(measure, build, lambda: on_more(repeats), process_group=process_group)

    sizes = [s.numel for s in specs]
    pack_calibration = calibrate(
        "packing",
        functools.partial(run, Strategy.DENSE, groups_for(specs, per_layer, Strategy.DENSE, None), None, None),
        functools.partial(_work_calibrations, sum(pack.cost(n) for n in sizes), 0.0))["prepare"]
    ddp_calibration = None
    if world_size > 1:
        ddp_calibration = calibrate(
            "DDP's buckets",
            functools.partial(_ddp_extra_samples, workload, plain, inputs, targets, device, repeats, process_group,
                              on_point),
            functools.partial(_hook_calibration, sum(pack.cost(b) for b in _ddp_buckets(sizes)), 0.0))["prepare"]
    decode_calibration = None
    select_calibration: dict[str, Calibration] = {}
    decode_s = 0.0 if topk is None else sum(curve_model(topk.decode).cost(world_size * topk_count(n, density))
                                            for n in sizes)
    for selector in topk.selectors() if topk is not None else ():
        assert topk is not None
        select_s = sum(select_model(topk, density, selector).cost(n) for n in sizes)
        found = calibrate(f"top-k ({selector})",
                          functools.partial(run, Strategy.TOPK, groups_for(specs, per_layer, Strategy.TOPK, density),
                                            density, selector),
                          functools.partial(_work_calibrations, select_s, decode_s, names=("select", "decode")))
        select_calibration[selector] = found["select"]
        # The same decode for either selector: the first measured, or a later one where that one is usable instead.
        if decode_calibration is None or (not decode_calibration.use.used and found["decode"].use.used):
            decode_calibration = found["decode"]
    compress_calibration: dict[str, dict[str, Calibration]] = {}
    packing = pack_calibration.factor * sum(pack.cost(n) for n in sizes)
    work = _compressor_work(compress, specs)
    for compressor, prepare_s, unpack_s in work:
        groups = tuple(Group(layers=(s.name,), params=s.params, numel=s.numel, compressor=compressor) for s in specs)
        compress_calibration[str(compressor)] = calibrate(
            str(compressor), functools.partial(run, Strategy.MIXED, groups, None, None),
            functools.partial(_work_calibrations, prepare_s, unpack_s, less_s=packing))
    if world_size > 1 and any(c.kind is CompressorKind.POWERSGD for c, _, _ in work):
        # PyTorch's PowerSGD hook on DDP's one bucket (as the bench runs it on gloo): its own way of doing the
        # same arithmetic (a copy of the bucket, a new error tensor each step, its callbacks) in real steps, on
        # a process group of this rank alone so that nothing is sent.
        solos = [dist.new_group([r]) for r in range(world_size)]  # every rank makes every group, in order
        alone = solos[dist.get_rank(process_group) if process_group is not None else dist.get_rank()]
        ddp_packing = (ddp_calibration.factor if ddp_calibration is not None else 1.0) * pack.cost(sum(sizes))
        for compressor, prepare_s, unpack_s in work:
            if compressor.kind is not CompressorKind.POWERSGD:
                continue
            assert compressor.rank is not None
            hook = compress_calibration[f"ddp+{compressor}"] = calibrate(
                f"PyTorch's {compressor} hook alone",
                functools.partial(_ddp_powersgd_extra_samples, workload, plain, inputs, targets, device, repeats,
                                  alone, compressor.rank, process_group, on_point),
                functools.partial(_hook_calibration, prepare_s + unpack_s, ddp_packing))
            if comm is None or compress is None:
                continue
            # The same hook sending on the real process group: what that adds to its work alone (the median of
            # the samples above), against the curve's prediction for its two allreduces.
            layouts = [PowerSGDLayout.of(compress.powersgd_at(compressor.rank)[s.name].shapes, compressor.rank)
                       for s in specs]
            sends = [sum(x.send_numel for x in layouts), sum(x.q_numel for x in layouts)]
            modelled = sum(comm.cost(FP32_BYTES * n) for n in sends if n)
            worked = hook["prepare"].measured_s + ddp_packing
            hook.update(calibrate(
                f"PyTorch's {compressor} hook sending",
                functools.partial(_ddp_powersgd_extra_samples, workload, plain, inputs, targets, device, repeats,
                                  process_group, compressor.rank, process_group, on_point),
                functools.partial(_sent_calibration, modelled, worked)))
            # The runtime's own PowerSGD the same way: one group of every layer (ready when the backward pass
            # ends, as the hook's bucket), alone and then sending; what sending added against the same curve.
            whole = (Group(layers=tuple(s.name for s in specs), params=tuple(p for s in specs for p in s.params),
                           numel=sum(sizes), compressor=compressor),)
            worked = median(_whole_steps(run, whole, sending=False))
            compress_calibration[str(compressor)].update(calibrate(
                f"{compressor} sending",
                functools.partial(_whole_steps, run, whole, sending=True),
                functools.partial(_sent_calibration, modelled, worked)))
    return InSitu(pack=pack_calibration, select=select_calibration, decode=decode_calibration,
                  ddp_pack=ddp_calibration, compress=compress_calibration)


def _work_calibrations(prepare_s: float, decode_s: float, got: tuple[list[float], list[float]], attempt: int, *,
                       less_s: float = 0.0, names: tuple[str, str] = ("prepare", "decode")) -> dict[str, Calibration]:
    """The two calibrations of one configuration of the runtime (`_runtime_samples`' extra backward time, less
    `less_s` of it that is calibrated apart, and its synchronize time) against their micro-benchmarks."""
    extra, finish = got
    return {names[0]: Calibration.of_samples([e - less_s for e in extra], prepare_s, attempt),
            names[1]: Calibration.of_samples(finish, decode_s, attempt)}


def _hook_calibration(modelled_s: float, less_s: float, extra: list[float], attempt: int) -> dict[str, Calibration]:
    """PyTorch's PowerSGD hook on DDP: its extra backward time less DDP's own packing, against the micro-benchmarks
    of all of PowerSGD's work."""
    return {"prepare": Calibration.of_samples([e - less_s for e in extra], modelled_s, attempt)}


def _whole_steps(run: Callable[..., tuple[list[float], list[float]]], groups: tuple[Group, ...], *,
                 sending: bool) -> list[float]:
    """`run`'s samples (`_runtime_samples`) for a plan of `groups`: the backward pass's extra time and the
    synchronize call's together, sample by sample."""
    extra, finish = run(Strategy.MIXED, groups, None, None, sending=sending)
    return [e + f for e, f in zip(extra, finish, strict=True)]


def _sent_calibration(modelled_s: float, worked_s: float, extra: list[float], attempt: int
                      ) -> dict[str, Calibration]:
    """PowerSGD sending on the real process group (PyTorch's hook, or the runtime with one group): its extra time
    less `worked_s` (its work, and DDP's packing for the hook, measured alone), against the collective curve's
    `modelled_s` for its allreduces."""
    return {"send": Calibration.of_samples([e - worked_s for e in extra], modelled_s, attempt)}


def _until_usable(measure: Callable[[], Any], build: Callable[[Any, int], dict[str, Calibration]],
                  before_again: Callable[[], object] = lambda: None, *, process_group: Any = None,
                  ) -> dict[str, Calibration]:
    """The calibrations `build` makes of one measurement (`measure()`, every rank's samples); where one of them is
    not usable (`Calibration.use`) while it had something to calibrate, the configuration is measured once more and
    those calibrations are taken from the second measurement (attempt 2), used or not: the cost model then falls
    back on the micro-benchmark, and the profile says so. Every rank calls it (`measure` runs collectives) and
    measures again when any rank would: each rank micro-benchmarked on its own, so their models differ. A calibration
    is taken from the second measurement on every rank when it is on any, so that the ranks keep the same samples."""
    first = build(measure(), 1)
    names = sorted(first)
    again = [name for name in names if not first[name].use.used and first[name].modelled_s > 0]
    if dist.is_initialized() and dist.get_world_size(process_group) > 1:
        again = [name for name in names if slowest(float(name in again), process_group) > 0]
    if not again:
        return first
    before_again()
    second = build(measure(), 2)
    return {name: second[name] if name in again else c for name, c in first.items()}


class _SilentKFAC(KFACPreconditioner):
    """The K-FAC runtime's factor hooks with nothing sent (each rank's factors stand for the average); `discard`
    drops a pass's factors where `step()` would average and fold them."""

    def _start_allreduce(self, st: Any) -> Any:
        return None

    def discard(self) -> None:
        for st in self._buffers:
            st.reset()
        self._next_launch = 0
        self._active = False


#: The most pairs of passes `measure_kfac_in_situ` extends to when they should span `min_seconds`.
MAX_HOOK_PAIRS = 64


def measure_kfac_in_situ(workload: Workload, device: torch.device, kfac: KFACTiming, *, repeats: int,
                         process_group: Any = None, on_point: Callable[[], object] = lambda: None,
                         min_seconds: float = 0.0, max_repeats: int = MAX_HOOK_PAIRS,
                         on_total: Callable[[int], object] = lambda total: None) -> Calibration:
    """Calibrate K-FAC's factor computation against the runtime in real steps (every rank calls it).

    A plain copy of the model and one with `KFACPreconditioner`'s hooks (every pass a factor update, factors
    as upper triangles, nothing sent; layers under `kfac.skip` left out as profiled) run their forward and
    backward passes alternately, `repeats` times each after one of each unmeasured, each pass started from a
    barrier on every rank. The hooks' extra time (A from each layer's input, G from its output gradient, each
    packed into its buffer) is compared with the sum of the micro-benchmarked `a_compute_s` and `g_compute_s`.
    It is taken as a bench takes a step: for each pair, the slowest rank's pass with the hooks less the slowest
    rank's plain pass (`slowest_rank_extra`, the samples kept), then the median over the pairs; a calibration the
    cost model would not use is measured once more (`_until_usable`; `on_total` hears the doubled count). The hooks
    run slower inside a step than alone (the caches hold the step's activations, not only the layer's).

    With `min_seconds`, a model whose pairs of passes are short gets more of them (up to `max_repeats`;
    `on_total` is told the new count) so that they span about that long: the median of a few differences of
    short passes is noisy. The count comes from the unmeasured pair on the slowest rank, so every rank runs as
    many."""
    inputs, targets = (t.to(device) for t in workload.batch(seed=2468))
    plain = workload.module.to(device)
    plain.train()
    hooked = copy.deepcopy(plain)
    kfac_rt = _SilentKFAC(hooked, skip_layers=kfac.skip, process_group=process_group, exchange_gradients=False,
                          factor_update_steps=1, inv_update_steps=1)

    world = dist.get_world_size(process_group) if dist.is_initialized() else 1

    def timed(model: torch.nn.Module) -> float:
        if world > 1:
            dist.barrier(group=process_group)
        return _forward_backward_seconds(workload, model, inputs, targets, device)

    def with_hooks() -> float:
        seconds = timed(hooked)
        kfac_rt.discard()
        return seconds

    def measure() -> list[float]:
        nonlocal repeats
        pairs: list[tuple[float, float]] = []  # (with the hooks, plain)
        i = 0
        while i <= repeats:
            if i % 2:
                hooks_s = with_hooks()
                alone = timed(plain)
            else:
                alone = timed(plain)
                hooks_s = with_hooks()
            if i:
                pairs.append((hooks_s, alone))
                on_point()
            elif min_seconds > 0:
                pair_s = slowest(hooks_s + alone, process_group) if world > 1 else hooks_s + alone
                wanted = min(max_repeats, math.ceil(min_seconds / pair_s) if pair_s > 0 else max_repeats)
                if wanted > repeats:
                    repeats = wanted
                    on_total(repeats)
            i += 1
        every_rank: list[Any] = [pairs]
        if world > 1:
            every_rank = [None] * world
            dist.all_gather_object(every_rank, pairs, group=process_group)
        return slowest_rank_extra(every_rank)

    modelled = sum(lt.a_compute_s + lt.g_compute_s for lt in kfac.layers)
    try:
        return _until_usable(measure, lambda extra, n: {"hooks": Calibration.of_samples(extra, modelled, n)},
                             lambda: on_total(2 * repeats), process_group=process_group,
                             )["hooks"]
    finally:
        kfac_rt.close()


def slowest_rank_extra(every_rank: Sequence[Sequence[tuple[float, float]]]) -> list[float]:
    """Per pair of passes (`every_rank[r][i]`: rank r's i-th pair, with the hooks and plain; every rank the same
    pairs), the slowest rank's pass with the hooks less the slowest rank's plain pass."""
    return [max(hooked for hooked, _ in pair) - max(alone for _, alone in pair)
            for pair in zip(*every_rank, strict=True)]


#: About how long `measure_kfac_steps_in_situ` may invert on each rank, per method: every step inverts every
#: factor, so a model whose inversions take long gets fewer measured steps (one at least).
KFAC_STEPS_BUDGET_S = 20.0


class _TimedKFAC(KFACPreconditioner):
    """The K-FAC runtime timing what `step()` does after the gradients: folding the new factors, inverting and
    preconditioning (host seconds; on a GPU each phase is synchronised first)."""

    def __init__(self, *args: Any, device: torch.device, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.device = device
        self.phase_s: dict[str, float] = {}

    def _timed(self, part: str, fn: Callable[[], None]) -> None:
        self.phase_s[part] = self.phase_s.get(part, 0.0) + stream_seconds(fn, self.device)

    def _finish_factors(self) -> None:
        self._timed("fold", super()._finish_factors)

    def _update_inverses(self, communicate: bool) -> None:
        self._timed("invert", lambda: super(_TimedKFAC, self)._update_inverses(communicate))

    def _precondition(self) -> None:
        self._timed("precondition", super()._precondition)


def measure_kfac_steps_in_situ(
    workload: Workload, device: torch.device, kfac: KFACTiming, *, steps: int, process_group: Any = None,
    on_point: Callable[[], object] = lambda: None,
) -> dict[str, Calibration]:
    """Calibrate what K-FAC's `step()` does after the gradients, in real training steps (every rank calls it).

    A copy of the model trains with `KFACPreconditioner` on a process group of this rank alone, so nothing is
    sent and the rank does all the work itself: it folds every factor (upper triangles), inverts every factor and
    preconditions every layer, every step. It runs one unmeasured step and then up to `steps` measured ones
    (fewer when inverting every factor is predicted to take long, `KFAC_STEPS_BUDGET_S`), once per inversion
    method. Each phase is compared with the micro-benchmarks' sum for the same work: `fold_s`, the method's
    inversion curve at every factor's dimension, and `precondition_s(method)`. The micro-benchmarks time one layer's
    kernel in a loop on random matrices; a step runs the kernels on the model's own factors after its forward and
    backward passes, and the preconditioning also clips and writes `.grad`, with every other worker doing the same
    on the other cores. Every step starts from a barrier on every rank and is taken as a bench takes it: at each
    step the rank whose phases took longest in all, then the median of its phases over the steps
    (`slowest_rank_phases`). Keys: `KFAC_STEP_PARTS`."""

    inputs, targets = (t.to(device) for t in workload.batch(seed=1357))
    alone = group_of_this_rank(process_group)
    world = dist.get_world_size(process_group) if dist.is_initialized() else 1
    modelled = {"fold": sum(lt.fold_s for lt in kfac.layers)}
    phases: list[dict[str, float]] = []  # this rank's measured steps, every method in turn
    for method in InverseMethod:
        modelled[f"invert:{method.value}"], measured = _inversion_and_steps(kfac, method, steps)
        if world > 1:  # each rank's own timings may differ: every rank measures as many steps as the fewest
            count = torch.tensor([measured])
            dist.all_reduce(count, op=dist.ReduceOp.MIN, group=process_group)
            measured = int(count.item())
        modelled[f"precondition:{method.value}"] = sum(lt.precondition_s(method) for lt in kfac.layers)
        model = copy.deepcopy(workload.module).to(device)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        section = KFACSection.simple(kfac_layers(model, kfac.skip), method=method)  # everything everywhere
        runtime = _TimedKFAC(model, device=device, kfac=section, skip_layers=kfac.skip, process_group=alone,
                             lr=1e-4)
        try:
            for i in range(measured + 1):
                runtime.phase_s = {}
                if world > 1:
                    dist.barrier(group=process_group)
                opt.zero_grad(set_to_none=True)
                workload.loss_fn(model(inputs), targets).backward()
                runtime.step()
                opt.step()
                if i:
                    phases.append({phase if phase == "fold" else f"{phase}:{method.value}": seconds
                                   for phase, seconds in runtime.phase_s.items()})
                    on_point()
        finally:
            runtime.close()
            del runtime, model, opt
            collect_garbage()
    every_rank: list[Any] = [phases]
    if world > 1:
        every_rank = [None] * world
        dist.all_gather_object(every_rank, phases, group=process_group)
    slowest = slowest_rank_phases(every_rank)
    return {part: Calibration.of_samples(slowest[part], modelled[part]) for part in KFAC_STEP_PARTS
            if slowest.get(part)}


def slowest_rank_phases(every_rank: Sequence[Sequence[Mapping[str, float]]]) -> dict[str, list[float]]:
    """Each phase's seconds at every step, taken from that step's slowest rank: the one whose phases took longest
    in all (`every_rank[r][i]`: rank r's phases at step i; every rank the same steps)."""
    out: dict[str, list[float]] = {}
    for step in zip(*every_rank, strict=True):
        for phase, seconds in max(step, key=lambda phases: sum(phases.values())).items():
            out.setdefault(phase, []).append(seconds)
    return out


def kfac_steps_points(kfac: KFACTiming, steps: int) -> int:
    """How many times `measure_kfac_steps_in_situ` calls `on_point` (its measured steps, both methods)."""

    return sum(_inversion_and_steps(kfac, method, steps)[1] for method in InverseMethod)


def _inversion_and_steps(kfac: KFACTiming, method: Any, steps: int) -> tuple[float, int]:
    """The micro-benchmarked seconds of inverting every factor with `method`, and how many steps (of at most
    `steps`, one at least) `measure_kfac_steps_in_situ` measures with it within `KFAC_STEPS_BUDGET_S`."""

    curve = curve_model(kfac.inverse if method is InverseMethod.INVERSE else kfac.eigen)
    seconds = sum(curve.cost(d) for lt in kfac.layers for d in (lt.a_dim, lt.g_dim))
    return seconds, max(1, min(steps, int(KFAC_STEPS_BUDGET_S / max(seconds, 1e-9)) - 1))


def group_of_this_rank(process_group: Any) -> Any:
    """A process group of this rank alone (every rank of the default group makes every such group, in order),
    or None without torch.distributed (a runtime on no group is alone already)."""
    if not dist.is_initialized():
        return None
    solos = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return solos[dist.get_rank()]


def _forward_backward_seconds(workload: Workload, model: torch.nn.Module, inputs: torch.Tensor,
                              targets: torch.Tensor, device: torch.device) -> float:
    """Seconds of one forward and backward pass of `model` (gradients dropped first)."""
    model.zero_grad(set_to_none=True)
    return stream_seconds(lambda: workload.loss_fn(model(inputs), targets).backward(), device)


def in_situ_runs(world_size: int, topk: TopkTiming | None, compress: CompressTiming | None, *,
                 sending: bool = True) -> int:
    """How many configurations `measure_in_situ` runs (each `repeats` times): dense, DDP on several workers, each
    top-k selector, fp16 and each PowerSGD rank (on several workers also PyTorch's PowerSGD hook at each alone,
    and given the allreduce's curve (`sending`) the hook sending and the runtime's one group alone and sending)."""
    ranks = 0 if compress is None else len(compress.ranks())
    compressors = 0 if compress is None else 1 + ranks * ((5 if sending else 2) if world_size > 1 else 1)
    return 1 + (world_size > 1) + (len(topk.selectors()) if topk is not None else 0) + compressors


def _compressor_work(compress: CompressTiming | None, specs: Sequence[Any]) -> list[tuple[Compressor, float, float]]:
    """Each compressor the profile measured, with its modelled work over one group per layer: the compute-stream
    part (fp16's cast; PowerSGD's compression and middle round) and the decoding."""
    if compress is None:
        return []
    out = [(Compressor(CompressorKind.FP16), sum(curve_model(compress.fp16_cast).cost(s.numel) for s in specs),
            sum(curve_model(compress.fp16_uncast).cost(s.numel) for s in specs))]
    for rank in compress.ranks():
        rows = compress.powersgd_at(rank)
        if all(s.name in rows for s in specs):
            out.append((Compressor(CompressorKind.POWERSGD, rank=rank),
                        sum(rows[s.name].compress_s + rows[s.name].middle_s for s in specs),
                        sum(rows[s.name].decompress_s for s in specs)))
    return out


def _runtime_samples(workload: Workload, plain: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                     device: torch.device, world_size: int, repeats: int, process_group: Any,
                     on_point: Callable[[], object], strategy: Strategy, groups: tuple[Group, ...],
                     density: float | None, selector: str | None, *, sending: bool = False
                     ) -> tuple[list[float], list[float]]:
    """Every rank's samples of how much longer the backward pass is with the runtime than without it (one per pair
    of passes), and of its synchronize call, for a plan of `groups`: sending nothing, or (`sending`) sending on
    `process_group` as in training."""

    plan = Plan(
        strategy=strategy, density=density, selector=selector, model=model_info(plain, workload.name),
        cluster=ClusterInfo(world_size=world_size, backend=dist.get_backend(process_group), device=str(device),
                            host_count=count_hosts(process_group)),
        groups=groups, predicted=Prediction(iteration_s=0, compute_s=0, exposed_comm_s=0, comm_s=0), baselines={},
        lower_bound_s=0.0, solver="in-situ", solve_seconds=0.0, source_profile="", profiled="", created="",
    )
    hooked = copy.deepcopy(plain)
    exchange = (GradientExchange if sending else _SilentExchange)(hooked, plan, process_group=process_group)
    extra, finish = [], []
    try:
        for i in range(repeats + 1):
            alone, with_hooks = _pair(workload, plain, hooked, inputs, targets, device, flip=bool(i % 2))
            synchronize = stream_seconds(exchange.synchronize, device)
            if i:
                extra.append(with_hooks - alone)
                finish.append(synchronize)
                on_point()
    finally:
        exchange.close()
        del exchange, hooked
        collect_garbage()  # the copy and its hooks form cycles: free them before the next configuration copies again
    return gathered(extra, process_group), gathered(finish, process_group)


def _ddp_extra_samples(workload: Workload, plain: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                       device: torch.device, repeats: int, group: Any, on_point: Callable[[], object]) -> list[float]:
    """Every rank's samples of how much longer DDP's backward pass is than `plain`'s (one per pair of passes), when
    its comm hook sends nothing: DDP's own work, copying gradients into its buckets and back."""

    unused = has_unused_parameters(plain, lambda m: workload.loss_fn(m(inputs), targets), group)
    wrapped = DistributedDataParallel(copy.deepcopy(plain), process_group=group, find_unused_parameters=unused)
    wrapped.register_comm_hook(None, silent_hook)
    extra = []
    for i in range(repeats + 1):
        alone, with_ddp = _pair(workload, plain, wrapped, inputs, targets, device, flip=bool(i % 2))
        if i:
            extra.append(with_ddp - alone)
            on_point()
    del wrapped
    collect_garbage()
    return gathered(extra, group)


def _ddp_powersgd_extra_samples(workload: Workload, plain: torch.nn.Module, inputs: torch.Tensor,
                                targets: torch.Tensor, device: torch.device, repeats: int, alone: Any, rank: int,
                                group: Any, on_point: Callable[[], object]) -> list[float]:
    """Every rank of `group`'s samples of how much longer DDP's backward pass is than `plain`'s with PyTorch's
    PowerSGD hook at `rank` on one bucket, on the process group `alone` (this rank only: nothing is sent; or
    `group` itself, sending).

    Built as the bench builds it (`planner.sessions.bench.ddp_with_hook`): one bucket, and where some rank leaves
    parameters without a gradient, `static_graph=True` rather than `find_unused_parameters=True`. With the latter
    the hook's second allreduce, launched from a callback thread, races DDP's allreduce of the used-parameter map
    from the backward pass, and ranks that issue the two in different orders abort on a collective mismatch or
    hang. With a static graph DDP finds the unused parameters in the first iteration, while the hook still
    allreduces plainly, and sends no map after it; the batch here is the same every iteration, so the graph is."""

    size_mb = sum(p.numel() * p.element_size() for p in plain.parameters()) / 2**20
    unused = has_unused_parameters(plain, lambda m: workload.loss_fn(m(inputs), targets), group)
    wrapped = DistributedDataParallel(copy.deepcopy(plain), process_group=alone, bucket_cap_mb=size_mb + 1,
                                      static_graph=unused)
    state = powerSGD_hook.PowerSGDState(alone, matrix_approximation_rank=rank, start_powerSGD_iter=2)
    wrapped.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    for _ in range(2):  # the hook allreduces plainly for two iterations
        _backward_seconds(workload, wrapped, inputs, targets, device)
    extra = []
    for i in range(repeats + 1):
        alone_s, with_ddp = _pair(workload, plain, wrapped, inputs, targets, device, flip=bool(i % 2))
        if i:
            extra.append(with_ddp - alone_s)
            on_point()
    del wrapped, state
    collect_garbage()
    return gathered(extra, group)


def _ddp_buckets(sizes: Sequence[int]) -> list[int]:
    """Elements of each of DDP's default buckets over layers of `sizes` elements, in ready order (as the
    grouping rule `DDP_BASELINE` forms them)."""

    problem = GradientProblem(strategy=Strategy.DENSE, forward_s=0.0, update_s=0.0, backward_s=(0.0,) * len(sizes),
                              numel=tuple(sizes), comm=AffineCost(alpha=0.0, beta=0.0), world_size=2)
    ddp = next(b for b in BASELINES[Strategy.DENSE] if b.name == DDP_BASELINE)
    return [sum(sizes[i] for i in r) for r in groups_of(ddp.solve(problem))]


def _pair(workload: Workload, plain: torch.nn.Module, other: torch.nn.Module, inputs: torch.Tensor,
          targets: torch.Tensor, device: torch.device, *, flip: bool) -> tuple[float, float]:
    """Backward seconds of `plain` and of `other`, one after the other; `flip` runs `other` first (the
    second of two passes in a row tends to be a little slower: alternating cancels that out)."""
    if flip:
        second = _backward_seconds(workload, other, inputs, targets, device)
        return _backward_seconds(workload, plain, inputs, targets, device), second
    first = _backward_seconds(workload, plain, inputs, targets, device)
    return first, _backward_seconds(workload, other, inputs, targets, device)


def _backward_seconds(workload: Workload, model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                      device: torch.device) -> float:
    """Seconds of one backward pass of `model` (gradients dropped first, forward untimed)."""
    model.zero_grad(set_to_none=True)
    loss = workload.loss_fn(model(inputs), targets)
    return stream_seconds(loss.backward, device)
