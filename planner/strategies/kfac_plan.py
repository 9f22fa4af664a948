"""From a profile to a K-FAC plan: the timeline of a K-FAC step, the two solvers, baselines, lower bound.

The timeline model (DESIGN.md, "K-FAC"), with gradient layers in ready order and K-FAC layers in forward
order, on one communication channel shared by gradients and factors (FIFO in ready order):

- plain step (no factor or inverse update): the gradient plan's iteration F + max(R_L, E_last) + U,
  plus the preconditioning phase of the layout (planner.solvers.layout): each layer preconditioned by
  every worker, or by one that broadcasts the preconditioned gradient;
- factor step (one in `factor_update_steps`): A_l is computed right after layer l's forward (forward
  grows by a_l), G_l right before layer l's backward (backward grows by g_l); each factor's upper
  triangle is allreduced in its planned buffer (planner.solvers.fusion), on the channel with the gradient
  groups; the step ends at max(backward end, channel end) + folding the factors into their running
  averages + the preconditioning phase + U;
- inversion (one step in `inv_update_steps` also pays it): the layout's inversion phase, the later of the
  busiest worker's inversions and the last owner's broadcast, broadcasts overlapping later inversions as the
  runtime runs them (planner.solvers.placement); a factor whose layer its owner preconditions is not sent.

The average step is plain + (factor - plain) / factor_update_steps + inversion / inv_update_steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from planner.contracts.kfac_section import KFACLayerSpec, KFACPrediction, KFACSection, factor_name
from planner.contracts.plan import Plan
from planner.contracts.profile import KFACLayerTiming, KFACTiming, Profile
from planner.costmodel.costs import AffineCost
from planner.costmodel.curves import curve_model
from planner.costmodel.from_profile import gradient_problem
from planner.costmodel.problem import groups_of
from planner.costmodel.simulator import simulate
from planner.solvers import DenseDP, lower_bound
from planner.solvers.fusion import (
    FUSION_BASELINES,
    FactorBuffers,
    FixedBytes,
    FusionDP,
    FusionProblem,
    FusionTimeline,
    simulate_fusion,
)
from planner.solvers.layout import (
    CpSatLayout,
    EveryoneLayout,
    KaisaMemOpt,
    Layout,
    LayoutProblem,
    layout_lower_bound,
    layout_timelines,
)
from planner.solvers.packing import PackingDP, PackingProblem
from planner.solvers.placement import (
    PLACEMENT_BASELINES,
    PLACEMENT_SOLVERS,
    Everywhere,
    KfacPytorchRule,
    PlacementProblem,
)
from planner.strategies.gradients import make_plan
from planner.types import Collective, FactorKind, InvalidProfileError, InverseMethod, SolverError, Strategy

__all__ = [
    "DEFAULT_FACTOR_UPDATE_STEPS",
    "DEFAULT_INV_UPDATE_STEPS",
    "LOCAL_KFAC",
    "PLAN_EVERYONE",
    "KFACProblem",
    "calibrated_kfac",
    "interference_stretch",
    "kfac_problem",
    "local_kfac_prediction",
    "make_kfac_plan",
    "predict_kfac",
    "reference_sections",
    "section_layout",
    "stretched_channel_end",
]

DEFAULT_FACTOR_UPDATE_STEPS = 1
DEFAULT_INV_UPDATE_STEPS = 10
#: The baseline row of the plan's own buffers and owners with every worker preconditioning every layer.
PLAN_EVERYONE = "plan, everyone preconditions"
#: The best plan with factors sent the other way (the plan keeps the faster of the two).
PLAN_TRIANGLES, PLAN_WHOLE = "plan, upper triangles", "plan, whole factors"
#: The best plan with each buffer's format chosen (the plan keeps the fastest of the three).
PLAN_MIXED = "plan, formats per buffer"
#: The baseline row of K-FAC's compute with nothing sent: one worker alone computes every factor (as upper
#: triangles), folds, inverts and preconditions everything. Not a layout: what `planner bench` sets beside the
#: profile to show how far K-FAC's kernels moved since (as its local row does for forward and backward).
LOCAL_KFAC = "local K-FAC (no communication)"


def triangle_numel(dim: int) -> int:
    """Values in the upper triangle (with the diagonal) of a dim x dim matrix."""
    return dim * (dim + 1) // 2


def factor_numel(dim: int, *, whole: bool = False) -> int:
    """Values a factor's allreduce sends: its upper triangle, or all d^2 when factors travel whole."""
    return dim * dim if whole else triangle_numel(dim)


def gradient_numel(layer: KFACLayerSpec | Any) -> int:
    """Values of a layer's preconditioned gradient [W | b] as a preconditioner broadcasts it: g_dim x a_dim."""
    return int(layer.g_dim) * int(layer.a_dim)


def result_numel(dim: int, method: InverseMethod, *, whole: bool = False) -> int:
    """Values an owner broadcasts: eigenvectors and eigenvalues, or an inverse (as its factor travels)."""
    return factor_numel(dim, whole=whole) if method is InverseMethod.INVERSE else dim * dim + dim


@dataclass(frozen=True, kw_only=True)
class KFACProblem:
    """A K-FAC step of one model on one cluster, as the solvers see it."""

    layers: tuple[KFACLayerSpec, ...]
    method: InverseMethod
    fusion: FusionProblem
    layout: LayoutProblem
    sgd_step_s: float
    plain_step_s: float
    compute_end_s: float
    fold_s: float
    tail_s: float
    gradient_lower_bound_s: float
    #: the A and G factors' computation (with packing) on a factor-update step, in-situ calibrated
    factor_compute_s: float = 0.0
    #: sigma: compute runs (1 + sigma) times slower while a collective is in flight (the profile's allreduce)
    interference: float = 0.0
    #: kappa: collectives run (1 + kappa) times slower while the workers compute (the profile's allreduce)
    comm_stretch: float = 0.0

    @property
    def placement(self) -> PlacementProblem:
        return self.layout.placement

    @property
    def factor_names(self) -> list[str]:
        return [factor_name(lt.name, k) for lt in self.layers for k in FactorKind]


def _formats(whole_factors: bool | Mapping[str, bool]) -> Callable[[str, FactorKind], bool]:
    """Whether a layer's factor of a kind travels whole, from one format for all or a map of factor names."""
    if isinstance(whole_factors, bool):
        return lambda _layer, _kind: whole_factors
    return lambda layer, kind: bool(whole_factors[factor_name(layer, kind)])


def _layer_fold(lt: KFACLayerTiming, a_whole: bool, g_whole: bool) -> float:
    """Seconds to fold a layer's two factors, each in its format. The profile times both factors together;
    a layer with one factor of each format is charged each factor's share of d^2 at its format's time."""
    if a_whole == g_whole:
        return lt.fold(a_whole)
    a2, g2 = lt.a_dim**2, lt.g_dim**2
    return (lt.fold(a_whole) * a2 + lt.fold(g_whole) * g2) / (a2 + g2)


def _checked_kfac(profile: Profile) -> KFACTiming:
    if profile.kfac is None:
        raise InvalidProfileError(
            "this profile has no K-FAC measurements; profile again with `planner profile --kfac`"
        )
    by_name = {lt.name: i for i, lt in enumerate(profile.layers)}
    missing = [lt.name for lt in profile.kfac.layers if lt.name not in by_name]
    if missing:
        raise InvalidProfileError(f"profile.kfac names layers without gradient timings: {missing[:3]}")
    return calibrated_kfac(profile)


def calibrated_kfac(profile: Profile) -> KFACTiming:
    """The profile's K-FAC timings as its work runs inside real steps, where the profile has in-situ calibrations:
    the factor hooks (A and G, either format) scaled by `InSitu.kfac_factors`; folding, each method's inversion
    curve and preconditioning by `InSitu.kfac_steps`."""
    assert profile.kfac is not None
    situ = profile.in_situ
    if situ is None:
        return profile.kfac
    hooks, fold = situ.kfac_factor(), situ.kfac_step_factor("fold")
    eigen, inverse = (situ.kfac_step_factor(f"precondition:{m.value}") for m in (InverseMethod.EIGEN,
                                                                                InverseMethod.INVERSE))
    if hooks == fold == eigen == inverse == 1.0 and all(c.factor == 1.0 for c in situ.kfac_steps.values()):
        return profile.kfac

    def scaled(seconds: float | None, factor: float) -> float | None:
        return None if seconds is None else seconds * factor

    kf = profile.kfac
    return replace(kf, layers=tuple(
        replace(lt, a_compute_s=lt.a_compute_s * hooks, g_compute_s=lt.g_compute_s * hooks,
                a_compute_whole_s=scaled(lt.a_compute_whole_s, hooks),
                g_compute_whole_s=scaled(lt.g_compute_whole_s, hooks),
                fold_s=lt.fold_s * fold, fold_whole_s=scaled(lt.fold_whole_s, fold),
                precondition_eigen_s=lt.precondition_eigen_s * eigen,
                precondition_inverse_s=lt.precondition_inverse_s * inverse)
        for lt in kf.layers),
        eigen=kf.eigen.scaled(situ.kfac_step_factor("invert:eigen")),
        inverse=kf.inverse.scaled(situ.kfac_step_factor("invert:inverse")))


def kfac_problem(
    profile: Profile, method: InverseMethod = InverseMethod.EIGEN, *,
    whole_factors: bool | Mapping[str, bool] = False, inv_update_steps: int = 1,
    grouping: tuple[int, ...] | None = None,
) -> KFACProblem:
    """The K-FAC instance a profile describes (it needs the K-FAC measurements of `planner profile`).

    `whole_factors`: factors (and damped inverses) travel as d^2 values, as kfac-pytorch sends them, instead
    of their upper triangles, and are packed and unpacked at the profile's whole-matrix times; a map from
    factor names says it per factor. `inv_update_steps` weighs the inversion phase in the layout's value.
    `grouping`: the gradient groups (exclusive ends), when a plan fixed them; by default the optimal ones
    (`DenseDP`)."""
    kf = _checked_kfac(profile)
    grad = gradient_problem(profile, Strategy.DENSE)
    grouping = grouping if grouping is not None else DenseDP().solve(grad)
    sgd_step = simulate(grad, grouping).iteration_s  # with the profile's kappa (`gradient_problem`)
    whole = _formats(whole_factors)
    a_cost = {lt.name: lt.a_compute(whole(lt.name, FactorKind.A)) for lt in kf.layers}
    g_cost = {lt.name: lt.g_compute(whole(lt.name, FactorKind.G)) for lt in kf.layers}

    # Forward: gradient layers run in reverse ready order; scale their own times up to the measured F.
    forward = np.array([lt.forward_s for lt in reversed(profile.layers)])
    scale = profile.forward_s / forward.sum() if forward.sum() > 0 else 0.0
    clock = 0.0
    a_done: dict[str, float] = {}
    for lt, f in zip(reversed(profile.layers), forward, strict=True):
        clock += f * scale + a_cost.get(lt.name, 0.0)
        a_done[lt.name] = clock
    forward_end = clock
    # Backward: G_l needs only the output gradient, so it is computed before layer l's own backward.
    g_done: dict[str, float] = {}
    grad_ready = []
    for lt in profile.layers:
        clock += g_cost.get(lt.name, 0.0)
        if lt.name in g_cost:
            g_done[lt.name] = clock
        clock += lt.backward_s
        grad_ready.append(clock)
    compute_end = clock

    order = [lt.name for lt in kf.layers]
    a_ready = np.maximum.accumulate([a_done[n] for n in order])
    g_ready = np.maximum.accumulate([max(g_done[n], forward_end) for n in reversed(order)])
    elem = profile.element_bytes
    allreduce = curve_model(profile.curve(Collective.ALLREDUCE))
    fusion = FusionProblem(
        a_ready_s=tuple(float(x) for x in a_ready),
        a_bytes=tuple(factor_numel(lt.a_dim, whole=whole(lt.name, FactorKind.A)) * elem for lt in kf.layers),
        g_ready_s=tuple(float(x) for x in g_ready),
        g_bytes=tuple(factor_numel(lt.g_dim, whole=whole(lt.name, FactorKind.G)) * elem
                      for lt in reversed(kf.layers)),
        grad_ready_s=tuple(grad_ready[r.stop - 1] for r in groups_of(grouping)),
        grad_bytes=tuple(sum(grad.numel[i] for i in r) * elem for r in groups_of(grouping)),
        allreduce=allreduce,
        a_names=tuple(order),
        g_names=tuple(reversed(order)),
    )
    invert = curve_model(kf.inverse if method is InverseMethod.INVERSE else kf.eigen)
    bcast = curve_model(profile.curve(Collective.BROADCAST))
    dims = [d for lt in kf.layers for d in (lt.a_dim, lt.g_dim)]
    sent_whole = [whole(lt.name, k) for lt in kf.layers for k in FactorKind]
    placement = PlacementProblem(
        inv_s=tuple(invert.cost(d) for d in dims),
        bcast_s=tuple(bcast.cost(result_numel(d, method, whole=w) * elem) for d, w in zip(dims, sent_whole,
                                                                                            strict=True)),
        dims=tuple(dims),
        world_size=profile.cluster.world_size,
        names=tuple(factor_name(lt.name, k) for lt in kf.layers for k in FactorKind),
    )
    layout = LayoutProblem(
        placement=placement,
        precondition_s=tuple(lt.precondition_s(method) for lt in kf.layers),
        grad_bcast_s=tuple(bcast.cost(gradient_numel(lt) * elem) for lt in kf.layers),
        inv_update_steps=inv_update_steps,
        layers=tuple(order),
    )
    problem = KFACProblem(
        layers=tuple(KFACLayerSpec(name=lt.name, a_dim=lt.a_dim, g_dim=lt.g_dim) for lt in kf.layers),
        method=method,
        fusion=fusion,
        layout=layout,
        sgd_step_s=sgd_step,
        plain_step_s=sgd_step,
        compute_end_s=compute_end,
        fold_s=sum(_layer_fold(lt, whole(lt.name, FactorKind.A), whole(lt.name, FactorKind.G)) for lt in kf.layers),
        tail_s=profile.update_s,
        gradient_lower_bound_s=lower_bound(grad),
        factor_compute_s=sum(a_cost.values()) + sum(g_cost.values()),
        interference=profile.interference_for(Collective.ALLREDUCE),
        comm_stretch=profile.comm_stretch_for(Collective.ALLREDUCE),
    )
    return problem


def section_layout(section: KFACSection) -> Layout:
    """The section's owners and preconditioners as a `Layout` (factors and layers in the section's order)."""
    return Layout(owners=tuple(section.owners[f] for f in section.factor_names()),
                  preconditioners=tuple(section.preconditioners[lt.name] for lt in section.layers))


def everyone_preconditions(problem: KFACProblem, owners: tuple[int | None, ...]) -> Layout:
    """`owners` for the inversions, every layer preconditioned on every worker."""
    return Layout(owners=owners, preconditioners=(None,) * len(problem.layers))


def predict_kfac(
    problem: KFACProblem,
    buffers: FactorBuffers,
    layout: Layout,
    *,
    factor_update_steps: int,
    inv_update_steps: int,
) -> KFACPrediction:
    """Predicted times of one K-FAC configuration under the timeline model."""
    timeline = simulate_fusion(problem.fusion, buffers)
    inversion, preconditioning = layout_timelines(problem.layout, layout)
    pre = preconditioning.makespan_s
    stretch = interference_stretch(problem.compute_end_s, timeline, problem.interference)
    channel_end = stretched_channel_end(timeline, problem.compute_end_s + stretch, problem.comm_stretch)
    factor_step = max(problem.compute_end_s + stretch, channel_end) + problem.fold_s + pre + problem.tail_s
    plain = problem.plain_step_s + pre
    return KFACPrediction(
        step_s=plain + (factor_step - plain) / factor_update_steps + inversion.makespan_s / inv_update_steps,
        plain_step_s=plain,
        factor_step_s=factor_step,
        inversion_s=inversion.makespan_s,
        factor_comm_s=timeline.factor_comm_s,
        broadcast_s=sum(problem.placement.bcast_s[f] for f, _, _ in inversion.broadcasts),
        num_buffers=timeline.num_buffers,
        precondition_s=pre,
        factor_compute_s=problem.factor_compute_s,
        interference_s=stretch,
    )


def interference_stretch(compute_end_s: float, channel: FusionTimeline, interference: float) -> float:
    """How much longer a factor-update step's forward and backward run because collectives (factor buffers and
    gradient groups) were in flight during them: compute runs (1 + sigma) times slower while the channel is busy,
    so b busy seconds before `compute_end_s` cost sigma b / (1 + sigma) more. The channel's times are those of
    the unstretched compute stream (the stretch does not move when factors are ready), and the fusion and packing
    solvers choose buffers and formats without this term."""
    busy = sum(max(0.0, min(e.end_s, compute_end_s) - e.start_s) for e in channel.events)
    return interference * busy / (1 + interference)


def stretched_channel_end(channel: FusionTimeline, compute_end_s: float, comm_stretch: float) -> float:
    """When the channel is free once collectives in flight while the workers compute run (1 + kappa) times slower:
    each collective starts when it is ready and the channel is free, and the part of it before `compute_end_s`
    (the end of backward, stretched by interference) takes 1 + kappa times as long. The ready times are those of
    the unstretched compute stream, as in `interference_stretch`. kappa = 0 gives `channel.end_s`."""
    if comm_stretch == 0:
        return channel.end_s
    return stretched_end(((e.ready_s, e.end_s - e.start_s) for e in channel.events), compute_end_s, comm_stretch)


def stretched_end(collectives: Iterable[tuple[float, float]], compute_end_s: float, comm_stretch: float) -> float:
    """`stretched_channel_end` of collectives given as (ready seconds, seconds alone), in channel order."""
    free = 0.0
    for ready_s, seconds in collectives:
        start = max(ready_s, free)
        slowed = max(0.0, compute_end_s - start) / (1 + comm_stretch)  # its seconds that fit before compute ends
        if seconds <= slowed:
            free = start + seconds * (1 + comm_stretch)
        else:
            free = max(start, compute_end_s) + seconds - slowed
    return free


def kfac_lower_bound(problem: KFACProblem, *, factor_update_steps: int, inv_update_steps: int) -> float:
    """No plan's average step can be shorter: each kind of step bounded by its compute path (or the gradient
    bound), plus the layout bound (inversions and preconditioning spread perfectly, broadcasts free)."""
    plain = problem.gradient_lower_bound_s
    factor = max(plain, problem.compute_end_s + problem.fold_s + problem.tail_s)
    layout = layout_lower_bound(replace(problem.layout, inv_update_steps=inv_update_steps))
    return plain + (factor - plain) / factor_update_steps + layout


def packing_problem(profile: Profile) -> tuple[PackingProblem, list[str], list[str]]:
    """The factor-update step of `kfac_problem` with each factor's format left open (planner.solvers.packing),
    and the A and G factor names in its order. The same clocks, with each factor computed at the cheaper of its
    two measured times and the difference charged as that format's packing; a layer's folding is split between
    its factors by d^2."""
    kf = _checked_kfac(profile)
    grad = gradient_problem(profile, Strategy.DENSE)
    grouping = DenseDP().solve(grad)
    a_pair = {lt.name: (lt.a_compute(False), lt.a_compute(True)) for lt in kf.layers}
    g_pair = {lt.name: (lt.g_compute(False), lt.g_compute(True)) for lt in kf.layers}
    forward = np.array([lt.forward_s for lt in reversed(profile.layers)])
    scale = profile.forward_s / forward.sum() if forward.sum() > 0 else 0.0
    clock = 0.0
    a_done: dict[str, float] = {}
    for lt, f in zip(reversed(profile.layers), forward, strict=True):
        clock += f * scale + min(a_pair.get(lt.name, (0.0, 0.0)))
        a_done[lt.name] = clock
    g_done: dict[str, float] = {}
    grad_ready, g_before = [], []
    for lt in profile.layers:
        clock += min(g_pair.get(lt.name, (0.0, 0.0)))
        if lt.name in g_pair:
            g_done[lt.name] = clock
        clock += lt.backward_s
        grad_ready.append(clock)
        g_before.append(len(g_done))
    order = [lt.name for lt in kf.layers]
    elem = profile.element_bytes

    def pack(pair: tuple[float, float]) -> tuple[float, float]:
        return pair[0] - min(pair), pair[1] - min(pair)

    def folds(lt: KFACLayerTiming, kind: FactorKind) -> tuple[float, float]:
        dim = lt.a_dim if kind is FactorKind.A else lt.g_dim
        dim2 = dim**2 / (lt.a_dim**2 + lt.g_dim**2)
        return lt.fold(False) * dim2, lt.fold(True) * dim2

    timing = {lt.name: lt for lt in kf.layers}
    ends = [r.stop - 1 for r in groups_of(grouping)]
    problem = PackingProblem(
        a_ready_s=tuple(np.maximum.accumulate([a_done[n] for n in order])),
        g_ready_s=tuple(np.maximum.accumulate([g_done[n] for n in reversed(order)])),
        a_bytes=tuple((factor_numel(timing[n].a_dim) * elem, factor_numel(timing[n].a_dim, whole=True) * elem)
                      for n in order),
        g_bytes=tuple((factor_numel(timing[n].g_dim) * elem, factor_numel(timing[n].g_dim, whole=True) * elem)
                      for n in reversed(order)),
        a_pack_s=tuple(pack(a_pair[n]) for n in order),
        g_pack_s=tuple(pack(g_pair[n]) for n in reversed(order)),
        a_fold_s=tuple(folds(timing[n], FactorKind.A) for n in order),
        g_fold_s=tuple(folds(timing[n], FactorKind.G) for n in reversed(order)),
        grad_ready_s=tuple(grad_ready[e] for e in ends),
        grad_bytes=tuple(sum(grad.numel[i] for i in r) * elem for r in groups_of(grouping)),
        grad_after_g=tuple(g_before[e] for e in ends),
        compute_end_s=clock,
        allreduce=curve_model(profile.curve(Collective.ALLREDUCE)),
    )
    a_names = [factor_name(n, FactorKind.A) for n in order]
    return problem, a_names, [factor_name(n, FactorKind.G) for n in reversed(order)]


def per_buffer_formats(profile: Profile) -> tuple[dict[str, bool], FactorBuffers] | None:
    """Whether each factor travels whole, chosen per buffer with the buffers (`PackingDP`), and those buffers;
    None where the exact search gives up (then one format for every buffer is what the plan compares)."""
    try:
        problem, a_names, g_names = packing_problem(profile)
        (buffers, whole), _ = PackingDP().solve_with_value(problem)
    except SolverError:
        return None
    formats: dict[str, bool] = {}
    for names, ends, flags in ((a_names, buffers[0], whole[0]), (g_names, buffers[1], whole[1])):
        for members, w in zip(groups_of(ends), flags, strict=True):
            formats.update((names[i], w) for i in members)
    return formats, buffers


def cheapest_formats(profile: Profile) -> dict[str, bool]:
    """Each factor in the format whose packing and folding cost least (for the lower bound: traffic aside,
    no choice of formats computes and folds faster)."""
    problem, a_names, g_names = packing_problem(profile)
    pairs = zip(problem.a_pack_s + problem.g_pack_s, problem.a_fold_s + problem.g_fold_s, strict=True)
    return {name: p[1] + f[1] < p[0] + f[0] for name, (p, f) in zip(a_names + g_names, pairs, strict=True)}


def _section(
    problem: KFACProblem,
    buffers: FactorBuffers,
    layout: Layout,
    *,
    factor_update_steps: int,
    inv_update_steps: int,
) -> KFACSection:
    a_names, g_names = problem.fusion.a_names, problem.fusion.g_names
    return KFACSection.simple(
        list(problem.layers),
        method=problem.method,
        factor_update_steps=factor_update_steps,
        inv_update_steps=inv_update_steps,
        a_buffers=tuple(tuple(a_names[i] for i in r) for r in groups_of(buffers[0])),
        g_buffers=tuple(tuple(g_names[i] for i in r) for r in groups_of(buffers[1])),
        owners=dict(zip(problem.factor_names, layout.owners, strict=True)),
        preconditioners=dict(zip((lt.name for lt in problem.layers), layout.preconditioners, strict=True)),
    )


def _sgd_prediction(problem: KFACProblem) -> KFACPrediction:
    s = problem.sgd_step_s
    return KFACPrediction(step_s=s, plain_step_s=s, factor_step_s=s, inversion_s=0.0, factor_comm_s=0.0,
                          broadcast_s=0.0, num_buffers=0)


def local_kfac_prediction(problem: KFACProblem, *, factor_update_steps: int,
                          inv_update_steps: int) -> KFACPrediction:
    """`LOCAL_KFAC`'s times on `problem` (factors as it sends them): forward, backward and update with every
    factor computed and folded on a factor-update step, every factor inverted on an inversion step and every
    layer preconditioned on every step, nothing sent and nothing overlapped."""
    local = problem.compute_end_s - problem.factor_compute_s + problem.tail_s
    pre = sum(problem.layout.precondition_s)
    plain = local + pre
    factor_step = plain + problem.factor_compute_s + problem.fold_s
    inversion = sum(problem.placement.inv_s)
    return KFACPrediction(
        step_s=plain + (factor_step - plain) / factor_update_steps + inversion / inv_update_steps,
        plain_step_s=plain, factor_step_s=factor_step, inversion_s=inversion, factor_comm_s=0.0, broadcast_s=0.0,
        num_buffers=0, precondition_s=pre, factor_compute_s=problem.factor_compute_s, interference_s=0.0)


def make_kfac_plan(
    profile: Profile,
    *,
    method: InverseMethod = InverseMethod.EIGEN,
    factor_update_steps: int = DEFAULT_FACTOR_UPDATE_STEPS,
    inv_update_steps: int = DEFAULT_INV_UPDATE_STEPS,
    placement_solver: str = "cp-sat",
    time_limit_s: float = 2.0,
    source: str = "",
) -> Plan:
    """The K-FAC plan for `profile`: gradient groups (dense DP), factor buffers (fusion DP), the layout of
    inversion owners and preconditioners (CP-SAT, planner.solvers.layout), and whether factors travel as upper
    triangles or whole (both solved, the faster kept: packing a triangle saves traffic and costs gathers and
    scatters, both measured), with every baseline and the lower bound predicted by the same model.
    `placement_solver` solves the inversions alone for the "everyone-preconditions" row (the plan before
    preconditioning was placed)."""
    if placement_solver not in PLACEMENT_SOLVERS:
        raise SolverError(f"unknown placement solver {placement_solver!r}; choose from {sorted(PLACEMENT_SOLVERS)}")
    triangles = kfac_problem(profile, method)
    KFACSection.simple(  # validates the intervals before solving
        list(triangles.layers), factor_update_steps=factor_update_steps, inv_update_steps=inv_update_steps
    )
    triangles = replace(triangles, layout=replace(triangles.layout, inv_update_steps=inv_update_steps))
    whole = kfac_problem(profile, method, whole_factors=True, inv_update_steps=inv_update_steps)
    intervals = {"factor_update_steps": factor_update_steps, "inv_update_steps": inv_update_steps}
    t0 = time.perf_counter()
    candidates: dict[str, KFACProblem] = {PLAN_TRIANGLES: triangles, PLAN_WHOLE: whole}
    per_buffer = per_buffer_formats(profile)
    mixed = per_buffer[0] if per_buffer is not None and len(set(per_buffer[0].values())) > 1 else None
    if mixed is not None:
        candidates[PLAN_MIXED] = kfac_problem(profile, method, whole_factors=mixed, inv_update_steps=inv_update_steps)
    solved = {}
    for name, candidate in candidates.items():
        # with formats per buffer, the buffers they were chosen for (the fusion DP could merge two formats)
        bufs = per_buffer[1] if name == PLAN_MIXED and per_buffer else FusionDP().solve(candidate.fusion)
        result = CpSatLayout(time_limit_s=time_limit_s).solve(candidate.layout)
        solved[name] = (bufs, result, predict_kfac(candidate, bufs, result.layout, **intervals))
    seconds = time.perf_counter() - t0
    chosen = min(solved, key=lambda w: solved[w][2].step_s)
    problem = candidates[chosen]
    buffers, laid, predicted = solved[chosen]

    baseline_buffers = {b.name: b.solve(problem.fusion) for b in FUSION_BASELINES}
    baseline_owners = {cls.name: cls().solve(problem.placement).placement for cls in PLACEMENT_BASELINES}
    baselines = {"sgd": _sgd_prediction(problem), LOCAL_KFAC: local_kfac_prediction(triangles, **intervals)}
    baselines.update((name, prediction) for name, (_, _, prediction) in solved.items() if name != chosen)
    for name, bufs in baseline_buffers.items():
        baselines[f"fusion:{name}"] = predict_kfac(problem, bufs, laid.layout, **intervals)
    for name, owners in baseline_owners.items():
        baselines[f"placement:{name}"] = predict_kfac(problem, buffers, everyone_preconditions(problem, owners),
                                                      **intervals)
    placed = PLACEMENT_SOLVERS[placement_solver](time_limit_s=time_limit_s).solve(problem.placement)
    baselines[EveryoneLayout.name] = predict_kfac(problem, buffers, everyone_preconditions(problem, placed.placement),
                                                  **intervals)
    baselines[PLAN_EVERYONE] = predict_kfac(problem, buffers, everyone_preconditions(problem, laid.layout.owners),
                                            **intervals)
    for name, (bufs, layout, sends_whole) in _reference_layouts(triangles, whole).items():
        baselines[name] = predict_kfac(whole if sends_whole else triangles, bufs, layout, **intervals)

    cheapest = kfac_problem(profile, method, whole_factors=cheapest_formats(profile))
    section = replace(
        _section(problem, buffers, laid.layout, **intervals),
        whole_factors=chosen == PLAN_WHOLE,
        mixed_whole=frozenset(f for f, w in mixed.items() if w) if chosen == PLAN_MIXED and mixed else None,
        fusion_solver=PackingDP.name if chosen == PLAN_MIXED else FusionDP.name,
        placement_solver=laid.solver,
        solve_seconds=seconds,
        placement_gap=laid.gap,
        predicted=predicted,
        baselines=baselines,
        lower_bound_s=min(kfac_lower_bound(p, **intervals) for p in (triangles, whole, cheapest)),
        skip=profile.kfac.skip if profile.kfac is not None else None,
        left_out=profile.kfac.left_out if profile.kfac is not None else (),
    )
    gradient_plan = make_plan(profile, Strategy.DENSE, source=source, via_ddp=False)  # it does not run inside DDP
    return replace(gradient_plan, kfac=section)


def _reference_layouts(
    problem: KFACProblem, whole: KFACProblem
) -> dict[str, tuple[FactorBuffers, Layout, bool]]:
    """The layouts the benchmark runs against, with whether factors travel whole: kfac-pytorch's defaults
    (whole factors in 25 MB buckets, each layer's two factors on one worker chosen largest-first by summed d^3;
    `whole` is `problem` with whole-factor message sizes) in its COMM_OPT mode (inverses broadcast, every
    worker preconditions: "kfac-pytorch") and its MEM_OPT mode (each layer's inverse worker preconditions it
    and broadcasts the gradient: "kaisa-mem-opt"; with 2 workers HYBRID_OPT, a gradient-worker fraction of
    1/2, is the same layout), and this runtime's upper triangles in 25 MB buckets with every factor inverted
    and every layer preconditioned everywhere. None depends on measured times."""
    comm_owners = KfacPytorchRule().solve(whole.placement).placement
    mem = KaisaMemOpt().solve(whole.layout).layout
    return {
        "kfac-pytorch": (FixedBytes().solve(whole.fusion), everyone_preconditions(whole, comm_owners), True),
        KaisaMemOpt.name: (FixedBytes().solve(whole.fusion), mem, True),
        "everywhere": (FixedBytes().solve(problem.fusion),
                       everyone_preconditions(problem, Everywhere().solve(problem.placement).placement), False),
    }


def reference_sections(plan: Plan) -> dict[str, KFACSection]:
    """K-FAC sections of the reference layouts for the plan's model and cluster, with its method and intervals.

    Built from the plan alone (factor sizes, world size); their predictions are in the plan's baselines.
    """
    section = plan.kfac
    if section is None:
        raise SolverError("the plan has no kfac section; make one with `planner solve PROFILE --strategy kfac`")
    intervals = {
        "factor_update_steps": section.factor_update_steps,
        "inv_update_steps": section.inv_update_steps,
    }
    triangles, whole = (_layout_stub(section, plan.cluster.world_size, whole=w) for w in (False, True))
    predicted = section.baselines or {}
    sections = {
        name: replace(_section(triangles, bufs, layout, **intervals), whole_factors=sends_whole,
                      predicted=predicted.get(name))
        for name, (bufs, layout, sends_whole) in _reference_layouts(triangles, whole).items()
    }
    if any(rank is not None for rank in section.preconditioners.values()):
        sections[PLAN_EVERYONE] = replace(section, preconditioners={}, predicted=predicted.get(PLAN_EVERYONE))
    return sections


def _layout_stub(section: KFACSection, world_size: int, *, whole: bool) -> KFACProblem:
    """A K-FAC problem with the section's layers and message sizes and no times: enough for the layouts that
    depend on sizes alone."""
    elem = 4
    layers = section.layers
    n = len(layers)
    fusion = FusionProblem(
        a_ready_s=(0.0,) * n,
        a_bytes=tuple(factor_numel(lt.a_dim, whole=whole) * elem for lt in layers),
        g_ready_s=(0.0,) * n,
        g_bytes=tuple(factor_numel(lt.g_dim, whole=whole) * elem for lt in reversed(layers)),
        grad_ready_s=(),
        grad_bytes=(),
        allreduce=AffineCost(alpha=0.0, beta=0.0),
        a_names=tuple(lt.name for lt in layers),
        g_names=tuple(lt.name for lt in reversed(layers)),
    )
    dims = tuple(d for lt in layers for d in (lt.a_dim, lt.g_dim))
    placement = PlacementProblem(
        inv_s=tuple(float(d) ** 3 for d in dims), bcast_s=(0.0,) * len(dims), dims=dims, world_size=world_size,
        names=tuple(factor_name(lt.name, k) for lt in layers for k in FactorKind),
    )
    layout = LayoutProblem(placement=placement, precondition_s=(0.0,) * n, grad_bcast_s=(0.0,) * n,
                           layers=tuple(lt.name for lt in layers))
    return KFACProblem(
        layers=layers, method=section.method, fusion=fusion, layout=layout,
        sgd_step_s=0.0, plain_step_s=0.0, compute_end_s=0.0, fold_s=0.0, tail_s=0.0,
        gradient_lower_bound_s=0.0,
    )


# ----------------------------------------------------------------------------------------------------
# One factor-update step of a plan, span by span (what `planner report` draws)

import itertools  # noqa: E402

from planner.costmodel.simulator import validate_grouping  # noqa: E402
from planner.types import PlanMismatchError  # noqa: E402

__all__ += ["ComputeSpan", "FactorStepTimeline", "factor_step_timeline"]


@dataclass(frozen=True, kw_only=True)
class ComputeSpan:
    """One span of the compute stream of a factor-update step (seconds from the start of forward).

    Attributes:
        kind: "forward" (a layer's forward), "A" (its A factor), "G" (its G factor) or "backward".
        layer: the layer's name.
    """

    kind: str
    layer: str
    start_s: float
    end_s: float


@dataclass(frozen=True, kw_only=True)
class FactorStepTimeline:
    """A factor-update step under a K-FAC section and a gradient grouping, as `predict_kfac` models it.

    Attributes:
        compute: the compute stream up to the end of backward, span by span in time order.
        channel: the factor buffers and gradient collectives on the channel (same clock, as they would run
            beside no compute: `channel_end_s` is when the last one ends, slowed by compute).
        compute_end_s: end of backward (with the G factors), as the compute stream would run alone.
        interference_s: how much longer it runs because collectives were in flight (`interference_stretch`).
        fold_s, precondition_s, update_s: the work after the channel is done, in that order.
    """

    compute: tuple[ComputeSpan, ...]
    channel: FusionTimeline
    compute_end_s: float
    fold_s: float
    precondition_s: float
    update_s: float
    interference_s: float = 0.0
    #: kappa: the channel's collectives run (1 + kappa) times slower while backward runs (`stretched_channel_end`)
    comm_stretch: float = 0.0

    @property
    def channel_end_s(self) -> float:
        """When the last collective ends, slowed by compute (`stretched_channel_end`)."""
        return stretched_channel_end(self.channel, self.compute_end_s + self.interference_s, self.comm_stretch)

    @property
    def comm_end_s(self) -> float:
        """When the compute stream can fold the factors: the end of backward and of every collective."""
        return max(self.compute_end_s + self.interference_s, self.channel_end_s)

    @property
    def step_s(self) -> float:
        """The factor-update step: `KFACPrediction.factor_step_s` when the grouping is the plan's."""
        return self.comm_end_s + self.fold_s + (self.precondition_s + self.update_s)


def factor_step_timeline(profile: Profile, section: KFACSection, grouping: tuple[int, ...]) -> FactorStepTimeline:
    """The factor-update step of `section` with the gradient groups `grouping` (exclusive ends, profile order).

    The clocks are those of `kfac_problem` (forward with each layer's A factor after it, backward with each
    layer's G factor before it); the channel is `simulate_fusion` with the section's buffers.

    Raises:
        PlanMismatchError: the section's K-FAC layers (names, order, dimensions) are not the profile's.
        InvalidProfileError: the profile has no K-FAC measurements.
    """
    problem = kfac_problem(profile, section.method, whole_factors=section.factor_formats())
    if tuple(section.layers) != problem.layers:
        planned = [(lt.name, lt.a_dim, lt.g_dim) for lt in section.layers]
        measured = [(lt.name, lt.a_dim, lt.g_dim) for lt in problem.layers]
        diff = next((f"{a} != {b}" for a, b in zip(planned, measured, strict=False) if a != b),
                    f"{len(planned)} layers planned, {len(measured)} profiled")
        raise PlanMismatchError(
            f"the plan's K-FAC layers (name, a_dim, g_dim) differ from the profile's (first difference: {diff}); "
            "profile this model with `planner profile --kfac` and re-plan with `planner solve --strategy kfac`"
        )
    kf = calibrated_kfac(profile)  # kfac_problem checked it
    ends = validate_grouping(gradient_problem(profile, Strategy.DENSE), grouping)
    a_cost = {lt.name: lt.a_compute(section.sends_whole(factor_name(lt.name, FactorKind.A))) for lt in kf.layers}
    g_cost = {lt.name: lt.g_compute(section.sends_whole(factor_name(lt.name, FactorKind.G))) for lt in kf.layers}
    spans: list[ComputeSpan] = []
    # The same additions as kfac_problem, so that the clocks agree to the last bit.
    forward = np.array([lt.forward_s for lt in reversed(profile.layers)])
    scale = profile.forward_s / forward.sum() if forward.sum() > 0 else 0.0
    clock = 0.0
    for lt, f in zip(reversed(profile.layers), forward, strict=True):
        start, own = clock, float(f * scale)
        clock += f * scale + a_cost.get(lt.name, 0.0)
        spans.append(ComputeSpan(kind="forward", layer=lt.name, start_s=start, end_s=start + own))
        if lt.name in a_cost:
            spans.append(ComputeSpan(kind="A", layer=lt.name, start_s=start + own, end_s=clock))
    grad_ready = []
    for lt in profile.layers:
        start = clock
        clock += g_cost.get(lt.name, 0.0)
        if lt.name in g_cost:
            spans.append(ComputeSpan(kind="G", layer=lt.name, start_s=start, end_s=clock))
        start = clock
        clock += lt.backward_s
        spans.append(ComputeSpan(kind="backward", layer=lt.name, start_s=start, end_s=clock))
        grad_ready.append(clock)
    elem = profile.element_bytes
    fusion = replace(
        problem.fusion,
        grad_ready_s=tuple(grad_ready[r.stop - 1] for r in groups_of(ends)),
        grad_bytes=tuple(sum(profile.layers[i].numel for i in r) * elem for r in groups_of(ends)),
    )
    buffers = (
        tuple(itertools.accumulate(len(b) for b in section.a_buffers)),
        tuple(itertools.accumulate(len(b) for b in section.g_buffers)),
    )
    channel = simulate_fusion(fusion, buffers)
    return FactorStepTimeline(
        compute=tuple(spans),
        channel=channel,
        compute_end_s=clock,
        interference_s=interference_stretch(clock, channel, problem.interference),
        comm_stretch=problem.comm_stretch,
        fold_s=problem.fold_s,
        precondition_s=layout_timelines(problem.layout, section_layout(section))[1].makespan_s,
        update_s=profile.update_s,
    )
