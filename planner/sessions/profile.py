"""`planner profile`: measure a model and the network on N workers and write one profile file."""

from __future__ import annotations

import datetime as dt
import functools
import itertools
import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
from rich.progress import Progress, TaskID

from planner.console import progress
from planner.contracts.errors import CompressionErrors
from planner.contracts.fingerprint import model_info
from planner.contracts.profile import (
    CompressTiming,
    FittedCurve,
    HostTiming,
    InSitu,
    KFACTiming,
    Profile,
    SlowdownSamples,
    TopkLeftOut,
    TopkTiming,
    WorkerThroughput,
)
from planner.contracts.unused import UnusedParams
from planner.costmodel.curves import curve_model
from planner.costmodel.resample import SOURCES
from planner.kernels.hierarchical import HostGroups
from planner.models import Workload, build_workload
from planner.platform import launch  # its launchers called through it: tests replace them there
from planner.platform.hosts import host_names, ranks_by_host
from planner.platform.launch import device_for, resolve_backend, under_torchrun
from planner.platform.link import LinkRate
from planner.platform.memory import PhaseMemory, available_bytes, gib
from planner.platform.slowdown import Slowdown
from planner.platform.timing import slowest
from planner.profilers.comm import (
    UNION_ROUNDS,
    collective_runs,
    fp16_sum_runs,
    host_runs,
    host_topk_sizes,
    log_sizes,
    measure_collectives,
    measure_fp16_sum,
    measure_host_topk,
    measure_hosts,
    measure_union_ratios,
    topk_budget,
)
from planner.profilers.compress import DEFAULT_POWERSGD_RANKS, compress_points, measure_compress
from planner.profilers.errors import ERROR_STEPS, ERROR_WARMUP, combine_error_runs, measure_errors
from planner.profilers.interference import INTERFERENCE_MESSAGE_BYTES, measure_interference
from planner.profilers.kfac_costs import DEFAULT_MAX_DIM, check_kfac_layers, kfac_points, measure_kfac
from planner.profilers.layers import (
    UNUSED_CHECK_BATCHES,
    LayerRun,
    LayerSummary,
    combine_ranks,
    gradient_counts,
    measure_layers,
    measure_throughput,
    throughput_batch_sizes,
    unused_params,
)
from planner.profilers.pooled import pooled_curve, pooled_runs, pooled_slowdown
from planner.profilers.probe import current_cluster
from planner.profilers.topk import measure_topk
from planner.runtime.calibrate import (
    in_situ_runs,
    kfac_steps_points,
    measure_in_situ,
    measure_kfac_in_situ,
    measure_kfac_steps_in_situ,
    measure_packing,
)
from planner.types import Collective, Compressor, CompressorKind, DistributedError, PlannerError

__all__ = ["DEFAULT_DENSITIES", "DEFAULT_EFFORT", "DEFAULT_LAYER_SECONDS", "QUICK_EFFORT", "Effort", "PlanScope",
           "ProfileConfig", "profile_worker", "run_profile", "topk_left_out"]

DEFAULT_DENSITIES = (0.001, 0.01, 0.1, 1.0)
#: Backward passes timed alone and with collectives in flight, per collective (interference).
INTERFERENCE_REPEATS = 5
#: Steps with and without the runtime, per configuration (in-situ calibration), and the top-k density
#: it is calibrated at (the nearest measured one).
IN_SITU_REPEATS = 8
#: How long the K-FAC hooks calibration's pairs of passes span at least (`measure_kfac_in_situ`'s `min_seconds`):
#: on the MLP, eight pairs (0.6 s) gave hooks 33-37 ms in one job, 64 pairs (4 s) 34-35 ms.
KFAC_HOOKS_SECONDS = 4.0
#: Measured K-FAC steps per inversion method in the in-situ calibration of folding, inverting and preconditioning
#: (fewer where inverting every factor takes long).
KFAC_STEPS_REPEATS = 10
IN_SITU_DENSITY = 0.01
#: How long the layer phase's whole steps span at least, by default (`measure_layers`' `min_seconds`).
DEFAULT_LAYER_SECONDS = 2.0


@dataclass(frozen=True, kw_only=True)
class Effort:
    """How hard `planner profile` measures: its repetitions and what it sweeps. The command line's flags
    (--repeats, --warmup, --layer-seconds, --densities, --powersgd-ranks) override the matching fields."""

    repeats: int
    warmup: int
    layer_seconds: float
    comm_repeats: int
    densities: tuple[float, ...]
    powersgd_ranks: tuple[int, ...]
    in_situ_repeats: int  # pairs of steps per in-situ configuration
    interference_repeats: int  # pairs of passes per collective (sigma, kappa)
    micro_repeats: int  # runs per point of the top-k, packing and compressor micro-benchmarks
    error_steps: int = ERROR_STEPS  # real steps each compressor's error is recorded over (after error_warmup)
    error_warmup: int = ERROR_WARMUP


#: The largest message (bytes) fp16's summing is timed at: its cost is work per element, which the fit carries on in
#: proportion beyond (`measure_fp16_sum`); larger messages would take seconds each behind a slow link.
FP16_SUM_LARGEST = 16 << 20

#: How long a profile's worker waits in one collective for the others by default (`--timeout`). Every phase
#: synchronises its workers every few steps, and the longest a rank waits there is how far the others lag: seconds,
#: minutes for a slowed worker on a large model. A hung worker fails the profile after this, naming its phase.
PROFILE_COLLECTIVE_TIMEOUT_S = 600.0

#: `planner profile` by default.
DEFAULT_EFFORT = Effort(repeats=10, warmup=3, layer_seconds=DEFAULT_LAYER_SECONDS, comm_repeats=7,
                        densities=DEFAULT_DENSITIES, powersgd_ranks=DEFAULT_POWERSGD_RANKS,
                        in_situ_repeats=IN_SITU_REPEATS, interference_repeats=INTERFERENCE_REPEATS, micro_repeats=5)
#: `planner profile --quick`: what a plan needs, measured fewer times (top-k at 1% only, PowerSGD at rank 4 only):
#: under a minute for a model like the built-in MLP on two workers of a 2-core machine. Fewer samples make wider
#: intervals, and plans made from it say so.
QUICK_EFFORT = Effort(repeats=5, warmup=1, layer_seconds=0.5, comm_repeats=3, densities=(0.01,), powersgd_ranks=(4,),
                      in_situ_repeats=4, interference_repeats=3, micro_repeats=3, error_steps=3, error_warmup=1)


@dataclass(frozen=True)
class PlanScope:
    """What the plans made from a profile will be (`planner demo`'s): solved over `compressors`, within `budget`'s
    error on every layer (None: no budget). Top-k is timed only where one of its compressors among them could be in
    such a plan (`topk_left_out`)."""

    compressors: tuple[Compressor, ...]
    budget: Compressor | None


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """What to measure and how hard. `only_comm` re-measures the network of an existing profile."""

    model: str
    output: Path
    batch_size: int | None = None
    nproc: int = 2
    backend: str = "auto"
    repeats: int = 10
    warmup: int = 3
    #: the layer phase's whole steps span at least this long: more than `repeats` on a fast model (`measure_layers`)
    layer_seconds: float = DEFAULT_LAYER_SECONDS
    comm_repeats: int = 7
    densities: tuple[float, ...] = DEFAULT_DENSITIES
    only_comm: bool = False
    kfac: bool = False
    max_dim: int = DEFAULT_MAX_DIM
    kfac_skip: str | None = None  # regular expression of K-FAC layers to leave out (as skip_layers)
    powersgd_ranks: tuple[int, ...] = DEFAULT_POWERSGD_RANKS  # () measures no compressor (fp16 and PowerSGD)
    base: Profile | None = field(default=None, repr=False)
    show_progress: bool = True
    link: LinkRate | None = None
    slowdown: Slowdown | None = None
    hosts: int | None = None  # emulated hosts the local workers are spread over (`--hosts`)
    #: `--quick`: measured with `QUICK_EFFORT` (recorded in the profile, whose intervals are wider).
    quick: bool = False
    in_situ_repeats: int = IN_SITU_REPEATS
    #: Calibrate the runtime's own work in real steps (`planner.runtime.calibrate.measure_in_situ`; `--calibrate`);
    #: without it the micro-benchmarks stand in for it, and a race settles what the predictions cannot.
    in_situ: bool = True
    interference_repeats: int = INTERFERENCE_REPEATS
    micro_repeats: int = 5
    error_steps: int = ERROR_STEPS
    error_warmup: int = ERROR_WARMUP
    #: how long one collective may wait for the other workers (`--timeout`): a hung worker fails the profile then
    collective_timeout: float = PROFILE_COLLECTIVE_TIMEOUT_S
    #: `--time`: measure in rounds for at most this many seconds: after the first round (every phase, at this
    #: configuration's effort), each round measures again what the finalists' open comparisons depend on most
    #: (`planner.strategies.focus`), until none is open or the next round would not fit. None: one round.
    time_s: float | None = None
    #: The plans the profile is made for (None: any plan). Where they send no top-k, top-k is not timed (its
    #: selection and decoding, its allgather's interference, a host's top-k exchange: about 40 s of the demo's profile
    #: of ResNet-18), and the profile says why (`Profile.topk_left_out`).
    scope: PlanScope | None = None

    @classmethod
    def at(cls, effort: Effort, *, quick: bool = False, **kwargs: object) -> ProfileConfig:
        """A configuration measuring with `effort` (`kwargs`: the other fields, and any of effort's to override)."""
        fields = {"repeats": effort.repeats, "warmup": effort.warmup, "layer_seconds": effort.layer_seconds,
                  "comm_repeats": effort.comm_repeats, "densities": effort.densities,
                  "powersgd_ranks": effort.powersgd_ranks, "in_situ_repeats": effort.in_situ_repeats,
                  "interference_repeats": effort.interference_repeats, "micro_repeats": effort.micro_repeats,
                  "error_steps": effort.error_steps, "error_warmup": effort.error_warmup}
        return cls(quick=quick, **{**fields, **kwargs})  # type: ignore[arg-type]


def profile_worker(rank: int, world_size: int, config: ProfileConfig) -> Profile | None:
    """Body run on every rank of an initialised process group; rank 0 returns the profile."""
    return _Session(rank, world_size, config).run()


@dataclass
class _Model:
    """What the model phase measured: per-layer compute, parameters without a gradient, compression errors, and each
    worker's throughput."""

    layers: LayerSummary
    unused: UnusedParams | None
    errors: CompressionErrors | None
    throughput: WorkerThroughput


@dataclass
class _Network:
    """What the network phase measured: the collectives' curves, the hosts and their levels where there are
    several."""

    curves: dict[Collective, FittedCurve]
    layout: list[list[int]]
    hosts: HostTiming | None = None


@dataclass
class _Costs:
    """What the runtime's costs phase measured: top-k, packing, the compressors, the runtime in real steps, and
    communication's interference with compute."""

    topk: TopkTiming | None = None
    pack: FittedCurve | None = None
    compress: CompressTiming | None = None
    in_situ: InSitu | None = None
    interference: dict[Collective, float] | None = None
    comm_stretch: dict[Collective, float] | None = None
    slowdown_samples: dict[Collective, SlowdownSamples] | None = None


class _Session:
    """One rank's profile, phase by phase: the model (`_model`), the network (`_network`), the runtime's costs
    (`_costs`) and K-FAC (`_kfac`); rank 0 puts them together (`_profile`). Every rank runs every phase's
    collectives in the same order."""

    def __init__(self, rank: int, world_size: int, config: ProfileConfig) -> None:
        self.started = time.perf_counter()
        self.rank, self.world_size, self.config = rank, world_size, config
        self.layer_runs: list[LayerRun] = []  # every rank's, from the layer phase: later rounds pool with them
        self.device = device_for(dist.get_backend())
        self.memory = PhaseMemory()
        self.workload: Workload | None = None
        if not config.only_comm:
            self.workload = build_workload(config.model, batch_size=config.batch_size)
            self.info = model_info(self.workload.module, config.model)
            numel_total = self.info.numel
            max_layer = max(p.numel() for p in self.workload.module.parameters())
        else:
            assert config.base is not None
            numel_total = config.base.model.numel
            max_layer = max(lt.numel for lt in config.base.layers)
        self.numel_total = numel_total
        # Message sizes from 1 KiB to the whole gradient, and top-k sizes up to the whole model (4 Ki at least).
        self.sizes = log_sizes(1 << 10, max(numel_total * 4, 1 << 20))
        self.topk_sizes = log_sizes(1 << 10, max(numel_total, max_layer, 1 << 12), factor=4)  # two sizes at least
        self.topk_left_out: TopkLeftOut | None = None  # decided after the model phase's errors (`_leave_out_topk`)

    def run(self) -> Profile | None:
        config = self.config
        model = costs = None
        kfac = config.base.kfac if config.base is not None else None
        with progress(enabled=config.show_progress and self.rank == 0) as bar:
            if self.workload is not None:
                model = self._model(bar, self.workload)
                self.topk_left_out = self._leave_out_topk(model.errors)
            network = self._network(bar)
            if self.workload is not None and model is not None:
                costs = self._costs(bar, self.workload, model.layers, network.curves)
                if config.kfac:
                    kfac = self._kfac(bar, self.workload, costs)
                if config.time_s is not None:
                    self._rounds(bar, self.workload, model, network, costs)
            self.memory.end()
        peaks: list[object] = [None] * self.world_size
        dist.all_gather_object(peaks, self.memory.peaks)
        if self.rank != 0:
            return None
        every_rank: list[dict[str, int]] = peaks  # type: ignore[assignment]
        peak_memory = {name: max(p.get(name, 0) for p in every_rank) for name in self.memory.peaks}
        return self._profile(model, network, costs or _Costs(), kfac, peak_memory)

    def _gathered(self, mine: object) -> list[object]:
        """Every rank's `mine`, by rank."""
        every: list[object] = [None] * self.world_size
        dist.all_gather_object(every, mine)
        return every

    def _model(self, bar: Progress, workload: Workload) -> _Model:
        config, device = self.config, self.device
        self.memory.begin("layers")
        task = bar.add_task(f"layers of {config.model}", total=config.warmup + config.repeats)
        run = measure_layers(
            workload, device, repeats=config.repeats, warmup=config.warmup,
            barrier=dist.barrier, on_step=lambda: bar.advance(task), min_seconds=config.layer_seconds,
            agree=slowest, on_total=lambda total: bar.update(task, total=total),
        )
        self.layer_runs = self._gathered(run)  # type: ignore[assignment]
        layers = combine_ranks(self.layer_runs)
        # Parameters without a gradient, over batches of their own on every rank (a router's choice varies).
        first = 1_000_000 + self.rank * UNUSED_CHECK_BATCHES
        counts = self._gathered(gradient_counts(workload, device, range(first, first + UNUSED_CHECK_BATCHES)))
        unused = unused_params(counts, UNUSED_CHECK_BATCHES)  # type: ignore[arg-type]
        errors = _measure_errors(config, workload, device, layers, self.rank, self.world_size, bar)
        # Each worker's own speed at a few micro-batch sizes (heterogeneous workers differ).
        sizes_tp = throughput_batch_sizes(workload.batch_size)
        mine = measure_throughput(workload, device, sizes_tp, repeats=max(3, config.repeats // 2), warmup=1,
                                  barrier=dist.barrier)
        throughput = WorkerThroughput(batch_sizes=sizes_tp,
                                      step_s=tuple(tuple(row) for row in self._gathered(mine)))  # type: ignore[arg-type]
        return _Model(layers=layers, unused=unused, errors=errors, throughput=throughput)

    def _leave_out_topk(self, errors: CompressionErrors | None) -> TopkLeftOut | None:
        """`topk_left_out` of the scope on the errors just measured, decided on rank 0 and sent to every rank (the
        profile's summary says so)."""
        left_out = None
        if self.rank == 0 and self.config.scope is not None:
            left_out = topk_left_out(self.config.scope, errors)
        decided: list[object] = [left_out]
        dist.broadcast_object_list(decided, src=0)
        return decided[0]  # type: ignore[return-value]

    def _network(self, bar: Progress) -> _Network:
        config, device = self.config, self.device
        colls = [Collective.ALLREDUCE, Collective.ALLGATHER, Collective.BROADCAST]
        self.memory.begin("collectives")
        task = bar.add_task("collectives", total=collective_runs(len(colls), self.sizes, repeats=config.comm_repeats,
                                                                 warmup=2))
        curves = measure_collectives(
            colls, self.sizes, device, repeats=config.comm_repeats, warmup=2, on_run=lambda: bar.advance(task)
        )
        network = _Network(curves=curves, layout=ranks_by_host(host_names()))
        layout = network.layout
        if not (len(layout) > 1 and len({len(h) for h in layout}) == 1):  # hosts of equal size: every level too
            return network
        groups = HostGroups.build(layout)
        task = bar.add_task("allreduce inside, across and over hosts",
                            total=host_runs(self.sizes, layout, repeats=config.comm_repeats, warmup=2))
        network.hosts = measure_hosts(groups, self.sizes, device, repeats=config.comm_repeats, warmup=2,
                                      on_run=lambda: bar.advance(task))
        if self.topk_left_out is not None:
            return network
        self.memory.begin("hierarchical top-k")  # the top-k exchange merged inside each host, at the picks' overlap
        if self.workload is None:
            ratios = _known_union_ratios(config, groups, device)
        else:
            task = bar.add_task("a host's union of top-k picks", total=UNION_ROUNDS)
            ratios = measure_union_ratios(self.workload, groups, config.densities, device,
                                          on_round=lambda: bar.advance(task))
        if ratios:
            fitting = host_topk_sizes(self.topk_sizes, self.world_size, topk_budget(self.world_size, device))
            task = bar.add_task("top-k merged inside hosts", total=len(ratios) * len(fitting))
            network.hosts = replace(network.hosts, topk=measure_host_topk(
                groups, fitting, ratios, device, repeats=config.micro_repeats, warmup=1,
                on_point=lambda: bar.advance(task)))
        return network

    def _costs(self, bar: Progress, workload: Workload, layers: LayerSummary,
               curves: dict[Collective, FittedCurve]) -> _Costs:
        config, device, world_size, topk_sizes = self.config, self.device, self.world_size, self.topk_sizes
        costs = _Costs()
        if self.topk_left_out is None:
            self.memory.begin("top-k")
            task = bar.add_task("top-k selection and decode", total=len(config.densities) * len(topk_sizes))
            costs.topk = measure_topk(
                topk_sizes, config.densities, world_size, device, repeats=config.micro_repeats, warmup=1,
                max_point_bytes=topk_budget(world_size, device), on_point=lambda: bar.advance(task),
            )
        task = bar.add_task("packing", total=len(topk_sizes))
        costs.pack = measure_packing(topk_sizes, world_size, device, repeats=config.micro_repeats, warmup=1,
                                     on_point=lambda: bar.advance(task))
        if config.powersgd_ranks:
            self.memory.begin("fp16 and PowerSGD")
            params = dict(workload.module.named_parameters())
            shaped = [(lt.name, tuple(tuple(params[p].shape) for p in lt.params)) for lt in layers.layers]
            task = bar.add_task("fp16 and PowerSGD", total=compress_points(topk_sizes, shaped, config.powersgd_ranks))
            costs.compress = measure_compress(topk_sizes, shaped, config.powersgd_ranks, world_size, device,
                                              repeats=config.micro_repeats, warmup=1,
                                              on_point=lambda: bar.advance(task))
            if world_size > 1:  # the fp16 allreduce's own summing, beyond the fp32 curve's bytes
                sizes = [b for b in self.sizes if b <= FP16_SUM_LARGEST] or self.sizes[:2]
                task = bar.add_task("fp16 allreduce", total=fp16_sum_runs(sizes, repeats=config.comm_repeats,
                                                                          warmup=1))
                costs.compress = replace(costs.compress, fp16_sum=measure_fp16_sum(
                    sizes, device, repeats=config.comm_repeats, warmup=1, on_run=lambda: bar.advance(task)))
        if config.in_situ:
            self.memory.begin("the runtime in real steps")
            task = bar.add_task("the runtime in real steps",
                                total=config.in_situ_repeats * in_situ_runs(
                                    world_size, costs.topk, costs.compress, sending=Collective.ALLREDUCE in curves))
            costs.in_situ = measure_in_situ(
                workload, device, layers.layers, world_size, pack=curve_model(costs.pack), topk=costs.topk,
                density=min(config.densities, key=lambda d: abs(math.log(d / IN_SITU_DENSITY))),
                repeats=config.in_situ_repeats, compress=costs.compress, on_point=lambda: bar.advance(task),
                on_more=functools.partial(_more, bar, task),
                comm=curve_model(curves[Collective.ALLREDUCE]) if Collective.ALLREDUCE in curves else None,
            )
        if world_size > 1:
            self.memory.begin("compute while communicating")
            # top-k sends by allgather: left out, only the allreduce's interference is priced
            interfering = [Collective.ALLREDUCE] + ([Collective.ALLGATHER] if self.topk_left_out is None else [])
            task = bar.add_task("compute while communicating", total=len(interfering) * config.interference_repeats)
            both_ways = measure_interference(
                workload, device, interfering, repeats=config.interference_repeats,
                message_bytes=min(INTERFERENCE_MESSAGE_BYTES, self.numel_total * 4),
                on_point=lambda: bar.advance(task),
            )
            costs.interference, costs.comm_stretch = both_ways.sigma, both_ways.comm_stretch
            costs.slowdown_samples = both_ways.samples
        return costs

    def _rounds(self, bar: Progress, workload: Workload, model: _Model, network: _Network, costs: _Costs) -> None:
        """`--time`: after the first round, measure again, round by round, the source of samples the finalists' open
        comparisons depend on most (`planner.strategies.focus`, decided on rank 0 and sent to every rank), pooled
        with the earlier rounds' samples; stop when none is open, or when the next round, as long as that source's
        last one, would end past the budget. Rank 0 says what each round measures and why."""
        from planner.strategies.focus import Finalists, focus  # deferred: a profile without --time solves nothing

        assert self.config.time_s is not None
        deadline = self.started + self.config.time_s
        took: dict[str, float] = {}  # each source's last round, seconds
        finalists = None
        for number in itertools.count(2):
            choice: list[object] = [None]
            if self.rank == 0:
                profile = self._profile(model, network, costs, None, {})
                finalists = finalists or Finalists.of(profile, source=str(self.config.output))
                source, why = focus(profile, finalists).next_round(took, deadline - time.perf_counter())
                _say(bar, f"profile round {number}: {why}" if source is not None
                     else f"profile rounds: {why}; done after {number - 1} round(s)")
                choice = [source]
            dist.broadcast_object_list(choice, src=0)
            if choice[0] is None:
                return
            chosen = str(choice[0])
            began = time.perf_counter()
            self._again(bar, chosen, workload, model, network, costs)
            took[chosen] = time.perf_counter() - began

    def _again(self, bar: Progress, source: str, workload: Workload, model: _Model, network: _Network,
               costs: _Costs) -> None:
        """Measure `source` again as its phase did (`planner.costmodel.resample.SOURCES`), and pool the samples."""
        config, device = self.config, self.device
        if source == SOURCES[0]:  # the layer phase's steps
            task = bar.add_task(f"layers of {config.model}, again", total=config.warmup + config.repeats)
            run = measure_layers(
                workload, device, repeats=config.repeats, warmup=config.warmup, barrier=dist.barrier,
                on_step=lambda: bar.advance(task), min_seconds=config.layer_seconds, agree=slowest,
                on_total=lambda total: bar.update(task, total=total))
            self.layer_runs = pooled_runs(self.layer_runs, self._gathered(run))  # type: ignore[arg-type]
            model.layers = combine_ranks(self.layer_runs)
        elif source == SOURCES[1]:  # the collectives
            colls = list(network.curves)
            task = bar.add_task("collectives, again", total=collective_runs(len(colls), self.sizes,
                                                                            repeats=config.comm_repeats, warmup=2))
            again = measure_collectives(colls, self.sizes, device, repeats=config.comm_repeats, warmup=2,
                                        on_run=lambda: bar.advance(task))
            network.curves = {c: pooled_curve(network.curves[c], again[c]) for c in colls}
        elif source == SOURCES[3] and costs.slowdown_samples:  # the pairs sigma and kappa are taken from
            colls = list(costs.slowdown_samples)
            task = bar.add_task("compute while communicating, again", total=len(colls) * config.interference_repeats)
            both_ways = measure_interference(workload, device, colls, repeats=config.interference_repeats,
                                             message_bytes=min(INTERFERENCE_MESSAGE_BYTES, self.numel_total * 4),
                                             on_point=lambda: bar.advance(task))
            pooled = {c: pooled_slowdown(costs.slowdown_samples[c], both_ways.samples[c]) for c in colls}
            costs.slowdown_samples = pooled
            costs.interference = {c: samples.sigma() for c, samples in pooled.items()}
            costs.comm_stretch = {c: samples.kappa() for c, samples in pooled.items()}
        else:
            raise ValueError(f"a round cannot measure {source!r} again")

    def _kfac(self, bar: Progress, workload: Workload, costs: _Costs) -> KFACTiming:
        """K-FAC's factors and inversions, and its hooks and steps in real steps (into `costs.in_situ`)."""
        config, device = self.config, self.device
        self.memory.begin("K-FAC")
        task = bar.add_task("K-FAC factors and inversions",
                            total=kfac_points(workload, config.max_dim, config.kfac_skip))
        kfac = measure_kfac(
            workload, device, repeats=config.repeats, warmup=config.warmup, max_dim=config.max_dim,
            skip=config.kfac_skip, on_point=lambda: bar.advance(task),
        )
        task = bar.add_task("K-FAC factor hooks in real steps", total=config.in_situ_repeats)
        hooks = measure_kfac_in_situ(workload, device, kfac, repeats=config.in_situ_repeats,
                                     min_seconds=KFAC_HOOKS_SECONDS, on_point=lambda: bar.advance(task),
                                     on_total=lambda total: bar.update(task, total=total))
        task = bar.add_task("K-FAC folding, inverting, preconditioning in real steps",
                            total=kfac_steps_points(kfac, KFAC_STEPS_REPEATS))
        steps = measure_kfac_steps_in_situ(workload, device, kfac, steps=KFAC_STEPS_REPEATS,
                                           on_point=lambda: bar.advance(task))
        costs.in_situ = replace(costs.in_situ or InSitu(), kfac_factors=hooks, kfac_steps=steps)
        return kfac

    def _profile(self, model: _Model | None, network: _Network, costs: _Costs, kfac: KFACTiming | None,
                 peak_memory: dict[str, int]) -> Profile:
        """Rank 0: the profile of what every phase measured (`--only comm`: the base profile with the network's)."""
        config = self.config
        cluster = current_cluster(self.device, hosts=len(network.layout))
        created = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        if model is None:
            base = config.base
            assert base is not None
            new = Profile(
                model=base.model, cluster=cluster, created=created, torch_version=torch.__version__,
                batch_size=base.batch_size, forward_s=base.forward_s, backward_s=base.backward_s,
                update_s=base.update_s, layers=base.layers, collectives=network.curves, topk=None,
                hosts=network.hosts,
            )
            return base.with_comm(new)
        assert self.workload is not None
        summary = model.layers
        return Profile(
            model=self.info, cluster=cluster, created=created, torch_version=torch.__version__,
            batch_size=self.workload.batch_size, forward_s=summary.forward_s, backward_s=summary.backward_s,
            update_s=summary.update_s, layers=tuple(summary.layers), collectives=network.curves, topk=costs.topk,
            kfac=kfac, step_s=summary.step_s, parts_scale=summary.scale, pack=costs.pack,
            interference=costs.interference, comm_stretch=costs.comm_stretch, throughput=model.throughput,
            in_situ=costs.in_situ, compress=costs.compress, peak_memory=peak_memory or None, hosts=network.hosts,
            steps=summary.steps, slowdown_samples=costs.slowdown_samples, quick=config.quick,
            unused_params=model.unused, errors=model.errors, topk_left_out=self.topk_left_out,
        )


def _say(bar: Progress, line: str) -> None:
    """A line above the progress display (rank 0's)."""
    bar.console.print(line, markup=False, soft_wrap=True, highlight=False)


def topk_left_out(scope: PlanScope, errors: CompressionErrors | None) -> TopkLeftOut | None:
    """Whether the plans of `scope` leave top-k out: it names no top-k compressor below density 1, or none of them is
    within reach of its budget on `errors` (`planner.strategies.budget.within_reach`). None: top-k is timed (also
    where the budget's error or a compressor's was not measured: nothing to decide from)."""
    from planner.strategies.budget import within_reach  # deferred: a profile without a scope solves nothing

    topk = tuple(c for c in dict.fromkeys(scope.compressors)
                 if c.kind is CompressorKind.TOPK and c.density is not None and c.density < 1)
    if not topk:
        return TopkLeftOut(compressors=(), budget=None)
    if scope.budget is None or errors is None or not all(errors.has(c) for c in (scope.budget, *scope.compressors)):
        return None
    reach = within_reach(errors, scope.compressors, scope.budget)
    return None if any(c in reach for c in topk) else TopkLeftOut(compressors=topk, budget=scope.budget)


def error_compressors(config: ProfileConfig) -> list[Compressor]:
    """The compressors whose error `planner profile` measures: those it times (fp16 and PowerSGD at its ranks,
    where it measures compressors; top-k at its densities below 1)."""
    chosen = [Compressor.parse("fp16")] if config.powersgd_ranks else []
    chosen += [Compressor.parse(f"powersgd:{r}") for r in config.powersgd_ranks]
    return chosen + [Compressor.parse(f"topk:{d!r}") for d in config.densities if d < 1]


def _measure_errors(config: ProfileConfig, workload: Workload, device: torch.device, layers: LayerSummary, rank: int,
                    world_size: int, bar: Progress) -> CompressionErrors | None:
    """Each compressor's error on each layer over real steps of every rank (`profilers.errors`), gathered."""
    compressors = error_compressors(config)
    if not compressors or config.error_steps < 1:
        return None
    task = bar.add_task("compression error in real steps", total=config.error_warmup + config.error_steps)
    run = measure_errors(workload, device, [(lt.name, lt.params) for lt in layers.layers], compressors, rank=rank,
                         steps=config.error_steps, warmup=config.error_warmup, on_step=lambda: bar.advance(task))
    runs: list[object] = [None] * world_size
    dist.all_gather_object(runs, run)
    return combine_error_runs(runs, [lt.name for lt in layers.layers], config.error_warmup)  # type: ignore[arg-type]


def _more(bar: Progress, task: TaskID, more: int) -> None:
    """Add `more` to the total of a progress task (a phase measured again)."""
    total = next(t.total for t in bar.tasks if t.id == task)
    bar.update(task, total=(total or 0) + more)


def _known_union_ratios(config: ProfileConfig, groups: HostGroups, device: torch.device) -> dict[float, float]:
    """For `--only comm`: how much a host's top-k picks overlap at each density of the base profile's top-k
    measurements, so that the hierarchical top-k exchange is timed again on the new network. The overlap belongs
    to the model and its data: it is the base profile's where that was measured on hosts of as many ranks, else
    measured on the model given as --model when it is the profile's (never the one the file names: loading a
    profile runs no code); densities of neither are left out (`skipped_topk_densities`). Every rank calls it."""
    base = config.base
    assert base is not None
    if base.topk is None:
        return {}
    wanted = base.topk.densities()
    known = base.hosts.union_ratios(groups.local_size) if base.hosts is not None else {}
    missing = [d for d in wanted if d not in known]
    if missing:
        workload = build_workload(config.model, batch_size=base.batch_size)
        if model_info(workload.module, config.model).fingerprint == base.model.fingerprint:
            known = {**known, **measure_union_ratios(workload, groups, missing, device)}
        del workload
    return {d: known[d] for d in wanted if d in known}


def skipped_topk_densities(base: Profile, new: Profile) -> list[float]:
    """The densities of `base`'s top-k measurements at which `--only comm` could not time the hierarchical top-k
    exchange on `new`'s hosts (`_known_union_ratios`), so top-k groups there cross hosts flat."""
    if new.hosts is None or base.topk is None:
        return []
    return [d for d in base.topk.densities() if new.hosts.topk_at(d) is None]


def memory_floor(model_bytes: int, world_size: int) -> int:
    """Bytes one worker of `planner profile` holds at the least, activations aside: the model, its gradients and
    momentum, the in-situ runs' copy of the model with its gradients and flat buffer, and the largest
    collective, an allgather of the whole gradient (P + 1 copies): (7 + P) times the model."""
    return (7 + world_size) * model_bytes


def check_memory(model: str, batch_size: int | None, local_workers: int, *, world_size: int) -> None:
    """Refuse, before any worker starts, a profile whose workers on this host cannot fit in the memory
    available (`memory_floor` each); nothing where the memory cannot be read."""
    available = available_bytes()
    if available is None:
        return
    module = build_workload(model, batch_size=batch_size).module
    model_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    del module
    need = local_workers * memory_floor(model_bytes, world_size)
    if need > available:
        raise PlannerError(
            f"profiling {model} with {local_workers} worker(s) on this host needs at least {gib(need)} ("
            f"{7 + world_size} copies of its {gib(model_bytes)} of parameters per worker: weights, gradients, "
            f"momentum, the in-situ copy and buffer, the gathered gradient), but {gib(available)} is available: "
            "use fewer --nproc, free memory, or profile on a larger machine")


def run_profile(config: ProfileConfig) -> Profile:
    """Profile under torchrun (this process is one rank) or by starting `config.nproc` local workers."""
    if config.only_comm and config.base is None:
        raise PlannerError(f"--only comm updates an existing profile, but {config.output} does not exist")
    if config.nproc < 1:
        raise PlannerError(f"`--nproc >= 1` must hold, but got --nproc {config.nproc}")
    backend = resolve_backend(config.backend)
    if not config.only_comm and backend == "gloo":
        check_memory(config.model, config.batch_size, config.nproc if not under_torchrun() else
                     int(os.environ.get("LOCAL_WORLD_SIZE", "1")), world_size=config.nproc)
    if config.kfac and not config.only_comm:  # a layer K-FAC cannot take is refused now, not after minutes of workers
        check_kfac_layers(build_workload(config.model, batch_size=config.batch_size), config.kfac_skip)
    profile = launch.run_job(profile_worker, config.nproc, config, backend=backend, link=config.link,
                             slowdown=config.slowdown, hosts=config.hosts, collective_timeout=config.collective_timeout)
    if profile is None and under_torchrun():  # not rank 0: nothing to write
        raise SystemExit(0)
    if not isinstance(profile, Profile):
        raise DistributedError("rank 0 returned no profile")
    return profile
