"""The cost problems a profile poses: the measured curves and in-situ calibrations turned into the instances
the solvers take (`GradientProblem` for one strategy, `MixedProblem` for a choice of compressors per group).

The profile (`planner.contracts.profile`) is the file format and its checks; this module, in the cost model,
is how its measurements become costs: which curve times which collective, how top-k selection and decoding
interpolate in density, and how each in-situ calibration scales the micro-benchmarks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from planner.contracts.profile import CompressTiming, HostTiming, Profile
from planner.costmodel.costs import CheaperOf, CostModel, ScaledCost
from planner.costmodel.curves import curve_model, decode_model, select_model
from planner.costmodel.mixed_simulator import CompressorCosts, MixedProblem, Sum, costs_of
from planner.costmodel.problem import GradientProblem
from planner.kernels.compress import PowerSGDLayout
from planner.types import Collective, Compressor, CompressorKind, InvalidProfileError, SchemaError, Strategy

__all__ = ["ROUTES", "RUNTIMES", "gradient_problem", "hierarchical_groups", "mixed_problem"]


#: How a dense group may cross hosts: "best" (per group, flat or hierarchical, whichever the profile's curves
#: predict cheaper for its size), "flat" (one allreduce over every rank) or "hierarchical".
ROUTES = ("best", "flat", "hierarchical")

#: Who moves the gradients (see `gradient_problem`).
RUNTIMES = ("planner", "ddp", "planhook")


def gradient_problem(profile: Profile, strategy: Strategy, density: float | None = None, *, selector: str = "exact",
            runtime: str = "planner", route: str = "best") -> GradientProblem:
    """The gradient-grouping instance this profile describes; top-k selection costs are `selector`'s.

    `runtime` is who moves the gradients: "planner" (`planner.runtime.GradientExchange`: dense packs into its
    buffers, top-k adds straight into its residuals), "ddp" (PyTorch DDP copies every gradient into
    its buckets, at its own measured cost, before the top-k hook selects from them; always flat; PowerSGD is
    PyTorch's hook, at its own calibration) or "planhook" (a plan inside DDP, `planner.runtime.PlanHook`: DDP's
    buckets and packing, flat, and the project's compressors at their own calibrations).
    `route` (one of ROUTES) is how dense groups cross hosts, where the profile measured several
    (`profile.hosts`); the per-group choice of "best" is exact, since a shorter collective never makes a
    step longer on the timeline model, and `hierarchical_groups` reads it back.

    Raises:
        InvalidProfileError: top-k without top-k measurements (or without `selector`'s).
        SchemaError: top-k without a density, or an unknown selector.
    """
    dense = GradientProblem(
        strategy=Strategy.DENSE,
        forward_s=profile.forward_s,
        update_s=profile.update_s,
        backward_s=tuple(lt.backward_s for lt in profile.layers),
        numel=tuple(lt.numel for lt in profile.layers),
        comm=_dense_comm(profile, route if runtime == "planner" else "flat"),
        world_size=profile.cluster.world_size,
        element_bytes=profile.element_bytes,
        pack=None if profile.pack is None or profile.cluster.world_size == 1 else _calibrated(
            curve_model(profile.pack), profile.in_situ.pack_factor(_packer(runtime)) if profile.in_situ else 1.0),
        interference=profile.interference_for(Collective.ALLREDUCE),
        comm_stretch=profile.comm_stretch_for(Collective.ALLREDUCE),
        names=tuple(lt.name for lt in profile.layers),
    )
    match strategy:
        case Strategy.DENSE:
            return dense
        case Strategy.TOPK:
            if profile.topk is None:
                raise InvalidProfileError(_no_topk(profile, "top-k"))
            if density is None:
                raise SchemaError("top-k needs a density, e.g. --density 0.01")
            return replace(
                dense,
                strategy=strategy,
                comm=curve_model(profile.curve(Collective.ALLGATHER)),
                density=density,
                select=_calibrated(select_model(profile.topk, density, selector),
                                   profile.in_situ.select_factor(selector) if profile.in_situ else 1.0),
                decode=_calibrated(decode_model(profile.topk, density),
                                   profile.in_situ.decode_factor() if profile.in_situ else 1.0),
                pack=dense.pack if _packer(runtime) == "ddp" else None,
                interference=profile.interference_for(Collective.ALLGATHER),
                comm_stretch=profile.comm_stretch_for(Collective.ALLGATHER),
            )
        case _:
            raise SchemaError(f"unknown strategy {strategy!r}")


def _no_topk(profile: Profile, what: str) -> str:
    """Why a profile without top-k timings cannot plan `what`, and what to do."""
    if profile.topk_left_out is not None:
        return (f"{profile.topk_left_out.why()}, so it cannot plan {what}; profile again with `planner profile` "
                "(which times top-k)")
    return f"this profile has no top-k measurements, so it cannot plan {what}; profile again without `--only comm`"


def _packer(runtime: str) -> str:
    """Whose packing a runtime pays: DDP's for DDP and for a plan inside DDP, else the project's."""
    if runtime not in RUNTIMES:
        raise SchemaError(f"unknown runtime {runtime!r}; known: {', '.join(RUNTIMES)}")
    return "ddp" if runtime in ("ddp", "planhook") else "planner"


def _dense_comm(profile: Profile, route: str) -> CostModel:
    """The allreduce cost of a dense group sent by `route` (flat where the profile knows one host only)."""
    if route not in ROUTES:
        raise SchemaError(f"unknown route {route!r}; known: {', '.join(ROUTES)}")
    flat = curve_model(profile.curve(Collective.ALLREDUCE))
    if profile.hosts is None or route == "flat":
        return flat
    hierarchical = curve_model(profile.hosts.hierarchical)
    return hierarchical if route == "hierarchical" else CheaperOf(first=flat, second=hierarchical)


def hierarchical_groups(problem: GradientProblem, grouping: Sequence[int]) -> tuple[bool, ...]:
    """Per group of `grouping` (end indices): whether `problem` sends it hierarchically (its comm is the cheaper
    of flat and hierarchical, and hierarchical won at the group's size; all False otherwise)."""
    comm, out, start = problem.comm, [], 0
    for end in grouping:
        numel = sum(problem.numel[start:end])
        out.append(isinstance(comm, CheaperOf) and comm.second_wins(problem.message_bytes(numel)))
        start = end
    return tuple(out)


def mixed_problem(profile: Profile, compressors: Sequence[Compressor], *, selector: str = "exact",
                  runtime: str = "planner") -> MixedProblem:
    """The instance of the mixed solver: every group may be sent by any of `compressors` (top-k ones with
    `selector`'s selection cost). `runtime` as for `problem` ("ddp": DDP's buckets and packing, always flat).

    On a profile of several hosts (but for DDP) each compressor the runtime can send hierarchically comes
    twice, flat and hierarchical (`CompressorCosts.hierarchical`), so that the solver chooses the way across
    hosts with the compressor: dense and fp16 by the profile's hierarchical allreduce curve, top-k by its
    hierarchical top-k exchange at that density where it measured one (`HostTiming.topk_at`), PowerSGD with
    both of its allreduces (the Ps and the Qs) by that allreduce curve.

    Interference sigma and comm stretch kappa are each the largest of the collectives the compressors use (one
    of each per problem, `MixedProblem`); a problem whose compressors all allreduce has the dense problem's.

    Raises:
        InvalidProfileError: a compressor the profile did not measure: top-k without top-k points or at
            a density outside the measured ones, fp16 or PowerSGD without compressor timings, or a
            PowerSGD rank not measured.
        SchemaError: no compressor, or one named twice.
    """
    if not compressors:
        raise SchemaError("name at least one compressor, e.g. --compressors dense,fp16")
    if len(set(compressors)) != len(compressors):
        raise SchemaError(f"each compressor may be named once, but got {', '.join(map(str, compressors))}")
    dense = gradient_problem(profile, Strategy.DENSE, runtime=runtime, route="flat")
    hosts = profile.hosts if runtime == "planner" else None
    pack = None if profile.pack is None else _calibrated(
        curve_model(profile.pack), profile.in_situ.pack_factor(_packer(runtime)) if profile.in_situ else 1.0)
    costs: list[CompressorCosts] = []
    sigma = kappa = 0.0
    for c in compressors:
        match c.kind:
            case CompressorKind.DENSE:
                costs.append(costs_of(dense))
            case CompressorKind.TOPK:
                assert c.density is not None
                _check_topk(profile, c, selector)
                topk = gradient_problem(profile, Strategy.TOPK, c.density, selector=selector, runtime=runtime)
                costs.append(costs_of(topk))
            case CompressorKind.FP16:
                timing = _compress_timing(profile, c)
                costs.append(CompressorCosts(
                    compressor=c, collective=Collective.ALLREDUCE, comm=fp16_comm(dense.comm, timing),
                    prepare=_plus(pack, _calibrated(curve_model(timing.fp16_cast), _factor(profile, c, "prepare"))),
                    decode=_calibrated(curve_model(timing.fp16_uncast), _factor(profile, c, "decode"))))
            case CompressorKind.POWERSGD:
                costs.append(_powersgd_costs(profile, c, dense.comm, pack, runtime))
        if hosts is not None and (routed := _hierarchical_costs(hosts, costs[-1], profile.compress)) is not None:
            costs.append(routed)
        collective = Collective.ALLGATHER if c.kind is CompressorKind.TOPK else Collective.ALLREDUCE
        sigma = max(sigma, profile.interference_for(collective))
        kappa = max(kappa, profile.comm_stretch_for(collective))
    return MixedProblem(forward_s=dense.forward_s, update_s=dense.update_s, backward_s=dense.backward_s,
                        numel=dense.numel, world_size=dense.world_size, element_bytes=dense.element_bytes,
                        compressors=tuple(costs), interference=sigma, comm_stretch=kappa, names=dense.names)


def _hierarchical_costs(hosts: HostTiming, flat: CompressorCosts,
                        compress: CompressTiming | None) -> CompressorCosts | None:
    """`flat`'s compressor sent hierarchically (None: the profile has no cost for it, or the runtime cannot);
    `compress`: the profile's compressor timings (fp16's summing)."""
    c = flat.compressor
    match c.kind:
        case CompressorKind.DENSE:
            return replace(flat, comm=curve_model(hosts.hierarchical), hierarchical=True)
        case CompressorKind.FP16:
            return replace(flat, comm=fp16_comm(curve_model(hosts.hierarchical), compress), hierarchical=True)
        case CompressorKind.TOPK:
            assert c.density is not None
            measured = hosts.topk_at(c.density)
            if measured is None:
                return None
            return replace(flat, comm=curve_model(measured.exchange), decode=None, hierarchical=True)
        case CompressorKind.POWERSGD:
            return replace(flat, comm=curve_model(hosts.hierarchical), second_comm=curve_model(hosts.hierarchical),
                           hierarchical=True)


def fp16_comm(comm: CostModel, timing: CompressTiming | None) -> CostModel:
    """An fp16 group's allreduce: `comm` (an fp32 curve, read at the fp16 message's bytes) plus the profile's
    measured cost of summing fp16 values beyond it (`CompressTiming.fp16_sum`; nothing more in profiles from before
    it was measured)."""
    if timing is None or timing.fp16_sum is None:
        return comm
    return Sum(parts=(comm, curve_model(timing.fp16_sum)))


def _factor(profile: Profile, compressor: Compressor, part: str) -> float:
    return 1.0 if profile.in_situ is None else profile.in_situ.compress_factor(str(compressor), part)


def _compress_timing(profile: Profile, compressor: Compressor) -> CompressTiming:
    if profile.compress is None:
        raise InvalidProfileError(f"this profile has no fp16 or PowerSGD measurements, so it cannot plan "
                                  f"{compressor}; profile again with this planner (`planner profile`)")
    return profile.compress


def _check_topk(profile: Profile, compressor: Compressor, selector: str) -> None:
    if profile.topk is None:
        raise InvalidProfileError(_no_topk(profile, str(compressor)))
    densities = profile.topk.densities(selector)
    assert compressor.density is not None
    if densities and not densities[0] <= compressor.density <= densities[-1]:
        raise InvalidProfileError(
            f"this profile measured top-k at densities {densities[0]:g} to {densities[-1]:g}, not at "
            f"{compressor}; profile again with --densities including {compressor.density:g}")


def _powersgd_costs(profile: Profile, compressor: Compressor, comm: CostModel, pack: CostModel | None,
                    runtime: str = "planner") -> CompressorCosts:
    """PowerSGD at `compressor.rank` per layer: the measured steps, and what each layer sends. Its allreduces are
    scaled by what sending them took on the real process group (`InSitu.compress`, "send"): in the runtime (run on
    its own or inside DDP), or for DDP's hook (`runtime` "ddp") in the hook, whose every step is also scaled by
    its own calibration."""
    assert compressor.rank is not None
    timing = _compress_timing(profile, compressor)
    rows = timing.powersgd_at(compressor.rank)
    missing = [lt.name for lt in profile.layers if lt.name not in rows]
    if missing:
        measured = ", ".join(map(str, timing.ranks())) or "none"
        raise InvalidProfileError(
            f"this profile did not measure {compressor} (PowerSGD ranks measured: {measured}"
            + (f"; layer {missing[0]!r} is missing" if rows else "")
            + f"); profile again with --powersgd-ranks including {compressor.rank}")
    prepare, decode = _factor(profile, compressor, "prepare"), _factor(profile, compressor, "decode")
    if runtime != "ddp":  # the runtime's PowerSGD groups, on their own or inside DDP (PlanHook)
        comm = _calibrated(comm, _factor(profile, compressor, "send"))
    hook = f"ddp+{compressor}"
    if runtime == "ddp" and profile.in_situ is not None and hook in profile.in_situ.compress:
        prepare = decode = profile.in_situ.compress_factor(hook, "prepare")
        comm = _calibrated(comm, profile.in_situ.compress_factor(hook, "send"))
    send, second, matrices = [], [], []
    for lt in profile.layers:
        layout = PowerSGDLayout.of(rows[lt.name].shapes, compressor.rank)
        send.append(layout.send_numel)
        second.append(layout.q_numel)
        matrices.append(len(layout.matrices))
    return CompressorCosts(
        compressor=compressor, collective=Collective.ALLREDUCE, comm=comm, prepare=pack, second_comm=comm,
        layer_prepare=tuple(rows[lt.name].compress_s * prepare for lt in profile.layers),
        layer_middle=tuple(rows[lt.name].middle_s * prepare for lt in profile.layers),
        layer_decode=tuple(rows[lt.name].decompress_s * decode for lt in profile.layers),
        layer_send=tuple(send), layer_second=tuple(second), layer_matrices=tuple(matrices))


def _calibrated(model: CostModel, factor: float) -> CostModel:
    return model if factor == 1.0 else ScaledCost(inner=model, factor=factor)


def _plus(first: CostModel | None, second: CostModel) -> CostModel:
    """`second`, plus `first` when there is one."""
    return second if first is None else Sum(parts=(first, second))
