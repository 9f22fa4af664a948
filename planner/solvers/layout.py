"""K-FAC layout: who inverts each factor and who preconditions each layer (KAISA's gradient workers, per layer).

A layer l has two factors, A_l and G_l: factors 2l and 2l + 1 of the layout's `PlacementProblem`. Each
layer is preconditioned either

- everywhere (None): every worker preconditions it (p_l on each, nothing sent), and its factors' owners
  are free, as in planner.solvers.placement (a rank that inverts and broadcasts the result, or None:
  every worker inverts it); this is kfac-pytorch's COMM_OPT when every layer is so;
- by one rank r, which then inverts both its factors, preconditions the gradient and broadcasts the
  preconditioned gradient (q_l on the shared channel): the factors' results never travel. This is
  kfac-pytorch's MEM_OPT when every layer is so (a layer's factors colocated on its gradient worker).

A layout costs two phases, each as the runtime (`planner.runtime.KFACPreconditioner`) runs it, with the same rule
as the inversion step of planner.solvers.placement: each worker first does the work it owns in order,
posting each owned item's broadcast as soon as it is done (broadcasts are serialised on one channel in
order), then the work every worker does:

- inversion (one step in inv_update_steps): factors in order; a factor of a layer preconditioned by its
  owner is inverted but not broadcast;
- preconditioning (every step, after the gradients are averaged): layers in order; a layer preconditioned
  by a rank broadcasts its preconditioned gradient.

Each phase ends at max(max over workers of (owned work) + (work everywhere), last broadcast). The value of a
layout is inversion / inv_update_steps + preconditioning: the layout-dependent part of the average step.

`CpSatLayout` solves it exactly in OR-Tools CP-SAT: binaries x[f, w] (factor f on owner w), y[f] (f
everywhere), m[l, w] (l preconditioned by w), r[l] (l everywhere); sum_w x[f, w] + y[f] = 1, sum_w m[l, w] +
r[l] = 1, m[l, w] <= x[f, w] for both factors of l; per phase, T >= (everywhere work) + (w's owned work) for
every w, the channel E_k >= E_{k-1} + b_k (whether k is broadcast) and, when k is owned by w and broadcast,
E_k >= (w's owned work up to k) + b_k; T >= E_last; minimise T_inv + inv_update_steps * T_pre. Workers are
relabelled in the order of the first factor they own, factors by inversion time descending (a layer's
preconditioner owns its factors, so the factors alone fix the labels). It starts from the best baseline,
and the answer is never worse than it. `planner.testing.brute_force_layout` enumerates every layout
(tests).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from planner.solvers.placement import (
    WALL_BACKSTOP,
    CpSatPlacement,
    InversionTimeline,
    Placement,
    PlacementProblem,
    largest_first,
    placement_lower_bound,
)
from planner.types import SolverError

# ortools is imported by the methods that solve, not here: `planner` starting, a command's workers and a training job
# never load it (tests/test_packaging.py).

__all__ = [
    "LAYOUT_BASELINES",
    "LAYOUT_SOLVERS",
    "CpSatLayout",
    "EveryoneLayout",
    "EverywhereLayout",
    "KaisaCommOpt",
    "KaisaMemOpt",
    "Layout",
    "LayoutProblem",
    "LayoutResult",
    "LayoutSolver",
    "canonical_layout",
    "layout_lower_bound",
    "layout_timelines",
    "layout_value",
]

#: A value within this relative distance of a lower bound is reported as proven optimal.
_OPTIMAL_RTOL = 1e-9


@dataclass(frozen=True, kw_only=True)
class LayoutProblem:
    """The layers of one K-FAC model on P workers, as the layout solvers see them.

    Attributes:
        placement: the factors' inversion and broadcast times; factors 2l and 2l + 1 are layer l's A and G.
        precondition_s: p_l, seconds to precondition layer l's gradient on one worker.
        grad_bcast_s: q_l, seconds to broadcast layer l's preconditioned gradient from one worker.
        inv_update_steps: how many steps share one inversion step (its weight in the average step).
        layers: optional layer names, empty or one per layer.
    """

    placement: PlacementProblem
    precondition_s: tuple[float, ...]
    grad_bcast_s: tuple[float, ...]
    inv_update_steps: int = 1
    layers: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "precondition_s", tuple(float(v) for v in self.precondition_s))
        object.__setattr__(self, "grad_bcast_s", tuple(float(v) for v in self.grad_bcast_s))
        object.__setattr__(self, "layers", tuple(self.layers))
        n = len(self.precondition_s)
        if n == 0 or self.placement.num_factors != 2 * n or len(self.grad_bcast_s) != n:
            raise SolverError(
                "`num_factors == 2 * len(precondition_s) == 2 * len(grad_bcast_s) > 0` must hold, but got "
                f"({self.placement.num_factors}, {len(self.precondition_s)}, {len(self.grad_bcast_s)})"
            )
        if self.layers and len(self.layers) != n:
            raise SolverError(f"`len(layers) in (0, {n})` must hold, but got {len(self.layers)}")
        for label, values in (("precondition_s", self.precondition_s), ("grad_bcast_s", self.grad_bcast_s)):
            for i, v in enumerate(values):
                if not (np.isfinite(v) and v >= 0):
                    raise SolverError(f"`{label}[{i}] >= 0` (finite) must hold, but got {v!r}")
        if not isinstance(self.inv_update_steps, int) or self.inv_update_steps < 1:
            raise SolverError(f"`inv_update_steps >= 1` must hold, but got {self.inv_update_steps!r}")

    @property
    def num_layers(self) -> int:
        return len(self.precondition_s)

    @property
    def world_size(self) -> int:
        return self.placement.world_size

    def name(self, layer: int) -> str:
        return self.layers[layer] if self.layers else f"layer {layer}"


@dataclass(frozen=True)
class Layout:
    """Owner rank of each factor (None: every worker inverts it) and preconditioner of each layer (None:
    every worker preconditions it; a rank must own both of the layer's factors)."""

    owners: Placement
    preconditioners: tuple[int | None, ...]


def check_layout(problem: LayoutProblem, layout: Layout) -> None:
    """Refuse a layout of the wrong length, with ranks outside 0..P-1, or a preconditioner that does not own
    both of its layer's factors."""
    world = problem.world_size
    if len(layout.owners) != problem.placement.num_factors or len(layout.preconditioners) != problem.num_layers:
        raise SolverError(
            f"a layout of {problem.num_layers} layers has {2 * problem.num_layers} owners and "
            f"{problem.num_layers} preconditioners, but got ({len(layout.owners)}, {len(layout.preconditioners)})"
        )
    for rank in (*layout.owners, *layout.preconditioners):
        if rank is not None and not (isinstance(rank, int | np.integer) and 0 <= rank < world):
            raise SolverError(f"`rank is None or 0 <= rank < world_size` must hold, but got ({rank!r}, {world})")
    for layer, rank in enumerate(layout.preconditioners):
        if rank is not None and layout.owners[2 * layer : 2 * layer + 2] != (rank, rank):
            raise SolverError(
                f"{problem.name(layer)} is preconditioned by rank {rank}, which must invert both its factors, but "
                f"the owners are {layout.owners[2 * layer : 2 * layer + 2]}"
            )


def _phase(work: Sequence[float], send: Sequence[float], owners: Sequence[int | None], broadcast: Sequence[bool],
           world_size: int) -> InversionTimeline:
    """One phase: item k on `owners[k]` (None: every worker), broadcast after it when `broadcast[k]`."""
    loads = [0.0] * world_size
    everywhere = channel = 0.0
    sent: list[tuple[int, float, float]] = []
    for k, owner in enumerate(owners):
        if owner is None:
            everywhere += work[k]
            continue
        loads[owner] += work[k]
        if broadcast[k]:
            start = max(channel, loads[owner])
            channel = start + send[k]
            sent.append((k, start, channel))
    return InversionTimeline(owned_load_s=tuple(loads), everywhere_s=everywhere, broadcasts=tuple(sent))


def layout_timelines(problem: LayoutProblem, layout: Layout) -> tuple[InversionTimeline, InversionTimeline]:
    """The inversion phase (items: factors) and the preconditioning phase (items: layers) of `layout`."""
    check_layout(problem, layout)
    pre = layout.preconditioners
    inversion = _phase(problem.placement.inv_s, problem.placement.bcast_s, layout.owners,
                       [owner is not None and pre[f // 2] is None for f, owner in enumerate(layout.owners)],
                       problem.world_size)
    preconditioning = _phase(problem.precondition_s, problem.grad_bcast_s, pre, [r is not None for r in pre],
                             problem.world_size)
    return inversion, preconditioning


def layout_value(problem: LayoutProblem, layout: Layout) -> float:
    """inversion / inv_update_steps + preconditioning, in seconds per step."""
    inversion, preconditioning = layout_timelines(problem, layout)
    return inversion.makespan_s / problem.inv_update_steps + preconditioning.makespan_s


def layout_lower_bound(problem: LayoutProblem) -> float:
    """No layout's value is below this: the inversion phase at least as with every broadcast free, and the
    preconditioning phase at least max(largest p, sum p / P) (its work spread perfectly)."""
    p = problem.placement
    free = PlacementProblem(inv_s=p.inv_s, bcast_s=(0.0,) * p.num_factors, dims=p.dims, world_size=p.world_size)
    pre = max(max(problem.precondition_s), sum(problem.precondition_s) / problem.world_size)
    return placement_lower_bound(free) / problem.inv_update_steps + pre


def canonical_layout(problem: LayoutProblem, layout: Layout) -> Layout:
    """The same layout with ranks relabelled 0, 1, ... in order of first use, visiting factors by inversion
    time descending (a preconditioner owns its layer's factors, so every rank in use is met)."""
    check_layout(problem, layout)
    relabel: dict[int, int] = {}
    for f in np.argsort(-np.asarray(problem.placement.inv_s), kind="stable"):
        owner = layout.owners[int(f)]
        if owner is not None and owner not in relabel:
            relabel[owner] = len(relabel)
    return Layout(owners=tuple(None if o is None else relabel[o] for o in layout.owners),
                  preconditioners=tuple(None if r is None else relabel[r] for r in layout.preconditioners))


# ----------------------------------------------------------------------------------------------------
# Results and solvers


@dataclass(frozen=True, kw_only=True)
class LayoutResult:
    """A solver's layout, its value and phases, and how far from optimal it is proven to be.

    Attributes:
        layout: canonically labelled.
        value_s: `layout_value(problem, layout)`.
        inversion_s, precondition_s: the two phases' makespans.
        lower_bound_s: best proven lower bound on the optimum (== value_s when proven optimal).
        gap: (value_s - lower_bound_s) / value_s; 0.0 when proven optimal.
    """

    layout: Layout
    value_s: float
    inversion_s: float
    precondition_s: float
    lower_bound_s: float
    gap: float
    optimal: bool
    solver: str
    seconds: float


def _result(problem: LayoutProblem, layout: Layout, *, solver: str, started: float, bound: float,
            optimal: bool = False) -> LayoutResult:
    canonical = canonical_layout(problem, layout)
    inversion, preconditioning = layout_timelines(problem, canonical)
    value = inversion.makespan_s / problem.inv_update_steps + preconditioning.makespan_s
    bound = min(max(bound, 0.0), value)
    if optimal or value - bound <= _OPTIMAL_RTOL * value:
        optimal, bound = True, value
    return LayoutResult(
        layout=canonical, value_s=value, inversion_s=inversion.makespan_s, precondition_s=preconditioning.makespan_s,
        lower_bound_s=bound, gap=0.0 if optimal or value <= 0 else (value - bound) / value, optimal=optimal,
        solver=solver, seconds=time.perf_counter() - started,
    )  # fmt: skip


class LayoutSolver(abc.ABC):
    """A way to lay out a `LayoutProblem`; construct once, then `solve` any number of times.

    Attributes:
        name: short name used in plans and tables.
        description: one line for tables.
    """

    name: ClassVar[str]
    description: ClassVar[str]

    @abc.abstractmethod
    def solve(self, problem: LayoutProblem) -> LayoutResult:
        """The layout and its value."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _everywhere(problem: LayoutProblem) -> tuple[None, ...]:
    return (None,) * problem.num_layers


class EverywhereLayout(LayoutSolver):
    """Every worker inverts every factor and preconditions every layer: nothing sent."""

    name = "everywhere"
    description = "every factor inverted and every layer preconditioned on every worker"

    def solve(self, problem: LayoutProblem) -> LayoutResult:
        started = time.perf_counter()
        return _result(problem, Layout(owners=(None,) * problem.placement.num_factors,
                                       preconditioners=_everywhere(problem)),
                       solver=self.name, started=started, bound=layout_lower_bound(problem))


class EveryoneLayout(LayoutSolver):
    """The best inversion placement alone (CP-SAT, planner.solvers.placement) with every layer preconditioned
    everywhere: what K-FAC plans were before the preconditioning was placed."""

    name = "everyone-preconditions"
    description = "the exact inversion placement, every worker preconditioning every layer"

    def __init__(self, *, time_limit_s: float = 1.5) -> None:
        self.time_limit_s = time_limit_s

    def solve(self, problem: LayoutProblem) -> LayoutResult:
        started = time.perf_counter()
        owners = CpSatPlacement(time_limit_s=self.time_limit_s).solve(problem.placement).placement
        return _result(problem, Layout(owners=owners, preconditioners=_everywhere(problem)), solver=self.name,
                       started=started, bound=layout_lower_bound(problem))


def _kaisa_owners(problem: LayoutProblem) -> Placement:
    """kfac-pytorch's assignment (`KfacPytorchRule`, by layer index rather than by factor name): layers by
    summed d³ descending to the least-loaded worker, A and G together."""
    dims = problem.placement.dims
    work = [dims[2 * layer] ** 3 + dims[2 * layer + 1] ** 3 for layer in range(problem.num_layers)]
    rank_of = largest_first(work, range(problem.num_layers), problem.world_size)
    return tuple(rank_of[f // 2] for f in range(problem.placement.num_factors))


class KaisaCommOpt(LayoutSolver):
    """kfac-pytorch's COMM_OPT (gradient-worker fraction 1): its inverse workers broadcast the inverses and
    every worker preconditions every layer."""

    name = "kaisa-comm-opt"
    description = "kfac-pytorch COMM_OPT: inverses broadcast, every worker preconditions"

    def solve(self, problem: LayoutProblem) -> LayoutResult:
        started = time.perf_counter()
        return _result(problem, Layout(owners=_kaisa_owners(problem), preconditioners=_everywhere(problem)),
                       solver=self.name, started=started, bound=layout_lower_bound(problem))


class KaisaMemOpt(LayoutSolver):
    """kfac-pytorch's MEM_OPT (gradient-worker fraction 1/P): each layer's inverse worker preconditions it
    and broadcasts the preconditioned gradient; inverses never travel."""

    name = "kaisa-mem-opt"
    description = "kfac-pytorch MEM_OPT: each layer's inverse worker preconditions and broadcasts the gradient"

    def solve(self, problem: LayoutProblem) -> LayoutResult:
        started = time.perf_counter()
        owners = _kaisa_owners(problem)
        pre = tuple(owners[2 * layer] for layer in range(problem.num_layers))
        return _result(problem, Layout(owners=owners, preconditioners=pre), solver=self.name, started=started,
                       bound=layout_lower_bound(problem))


#: The baselines every layout is compared with (and the exact solver starts from).
LAYOUT_BASELINES: tuple[type[LayoutSolver], ...] = (KaisaCommOpt, KaisaMemOpt, EveryoneLayout, EverywhereLayout)


class CpSatLayout(LayoutSolver):
    """Exact layout by the integer program of the module docstring in OR-Tools CP-SAT, times scaled to integers.

    Times are rounded to units of (largest time) / `max_units` (2^24: 6e-8 of the largest time; at 2^30
    CP-SAT's presolve returned a wrong optimum); the bound CP-SAT proves is lowered by the most rounding can
    move a value before it is used, so "optimal" means optimal for the rounded times, within
    `tolerance_s(problem)` of the true optimum. The answer is the better of the model's incumbent and the
    best baseline. One search worker with a fixed seed (the default) and a budget in CP-SAT's deterministic time
    (`time_limit_s`, about seconds on an unloaded core; the wall limit is `WALL_BACKSTOP` times it) give the same
    answer on every call however loaded the machine: optimal layouts often tie, and parallel workers or a wall
    clock pick among them by timing (a plan solved under CI's load once differed from the same plan solved idle).
    """

    name = "cp-sat"
    description = "inversion owners and preconditioners together, in CP-SAT"

    def __init__(self, *, time_limit_s: float = 2.0, num_workers: int | None = None, max_units: int = 2**24) -> None:
        if time_limit_s <= 0 or max_units < 1 or (num_workers is not None and num_workers < 1):
            raise SolverError(
                "`time_limit_s > 0 and max_units >= 1 and num_workers >= 1` must hold, but got "
                f"(time_limit_s={time_limit_s}, max_units={max_units}, num_workers={num_workers})"
            )
        self.time_limit_s = time_limit_s
        self.num_workers = num_workers or 1
        self.max_units = max_units

    def tolerance_s(self, problem: LayoutProblem) -> float:
        """How far above the optimum an answer reported optimal can be: every rounded term (half a unit each,
        in each phase's makespan, for the answer and for the optimum) at its worst."""
        pl = problem.placement
        largest = max(*pl.inv_s, *pl.bcast_s, *problem.precondition_s, *problem.grad_bcast_s)
        return 2 * (2 * pl.num_factors + 2 * problem.num_layers) * largest / self.max_units

    def solve(self, problem: LayoutProblem) -> LayoutResult:
        from ortools.sat.python import cp_model  # deferred: a command's workers load no ortools

        started = time.perf_counter()
        baselines = [cls().solve(problem) for cls in LAYOUT_BASELINES]
        start = min(baselines, key=lambda r: r.value_s)
        bound = layout_lower_bound(problem)
        if start.value_s - bound <= _OPTIMAL_RTOL * start.value_s:
            return _result(problem, start.layout, solver=self.name, started=started, bound=bound, optimal=True)
        built = _LayoutModel(problem, self.max_units)
        if built.largest <= 0:
            return _result(problem, start.layout, solver=self.name, started=started, bound=0.0, optimal=True)
        built.hint(start.layout)
        solver = cp_model.CpSolver()
        solver.parameters.max_deterministic_time = self.time_limit_s
        solver.parameters.max_time_in_seconds = WALL_BACKSTOP * self.time_limit_s
        solver.parameters.num_workers = self.num_workers
        solver.parameters.random_seed = 0
        status = solver.solve(built.model)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return _result(problem, start.layout, solver=self.name, started=started, bound=bound)
        found = built.decode(solver)
        ius = problem.inv_update_steps
        proven = max(bound, built.seconds(solver.best_objective_bound - built.rounding * ius) / ius)
        best = min((found, start.layout), key=lambda lay: layout_value(problem, lay))
        optimal = status == cp_model.OPTIMAL and best is found
        return _result(problem, best, solver=self.name, started=started, bound=proven, optimal=optimal)


class _LayoutModel:
    """The integer program of the module docstring for one problem, times in integer units."""

    def __init__(self, problem: LayoutProblem, max_units: int) -> None:
        from ortools.sat.python import cp_model  # deferred: a command's workers load no ortools

        pl = problem.placement
        nf, nl, ius = pl.num_factors, problem.num_layers, problem.inv_update_steps
        self.largest = max(*pl.inv_s, *pl.bcast_s, *problem.precondition_s, *problem.grad_bcast_s)
        self.max_units = max_units
        self.rounding = 2 * nf + 2 * nl  # half a unit per rounded term, in each phase's makespan
        c, b = [self.units(v) for v in pl.inv_s], [self.units(v) for v in pl.bcast_s]
        p, q = [self.units(v) for v in problem.precondition_s], [self.units(v) for v in problem.grad_bcast_s]
        workers = min(pl.world_size, nf)
        # Workers in order of first use by factors sorted by c descending: the i-th may use ranks 0..i.
        limit = [0] * nf
        for i, f in enumerate(np.argsort(-np.asarray(pl.inv_s), kind="stable")):
            limit[int(f)] = min(i + 1, workers)
        model = cp_model.CpModel()
        y = [model.new_bool_var(f"y{f}") for f in range(nf)]
        x = [[model.new_bool_var(f"x{f}_{w}") for w in range(limit[f])] for f in range(nf)]
        r = [model.new_bool_var(f"r{k}") for k in range(nl)]
        m = [[model.new_bool_var(f"m{k}_{w}") for w in range(min(limit[2 * k], limit[2 * k + 1]))] for k in range(nl)]
        for f in range(nf):
            model.add_exactly_one([*x[f], y[f]])
        for k in range(nl):
            model.add_exactly_one([*m[k], r[k]])
            for w, mw in enumerate(m[k]):
                model.add_implication(mw, x[2 * k][w])
                model.add_implication(mw, x[2 * k + 1][w])
        t_inv = self._phase(model, "inv", c, b, x, y, [m[f // 2] for f in range(nf)], workers)
        t_pre = self._phase(model, "pre", p, q, m, r, [[] for _ in range(nl)], workers)
        model.minimize(t_inv + ius * t_pre)
        self.model, self.x, self.y, self.m, self.r = model, x, y, m, r
        self.t_inv, self.t_pre = t_inv, t_pre

    @staticmethod
    def _phase(model: Any, tag: str, work: list[int], send: list[int], on: list[list[Any]], everywhere: list[Any],
               kept: list[list[Any]], workers: int) -> Any:
        """The makespan variable of one phase: item k on worker w when on[k][w], everywhere when
        everywhere[k]; broadcast when owned, unless kept[k][w] (its layer preconditioned by its owner)."""
        from ortools.sat.python import cp_model  # deferred: a command's workers load no ortools

        horizon = sum(work) + sum(send)
        end = model.new_int_var(0, horizon, f"t_{tag}")
        shared = cp_model.LinearExpr.weighted_sum(everywhere, work)
        for w in range(workers):
            members = [k for k in range(len(work)) if w < len(on[k])]
            model.add(end >= shared + cp_model.LinearExpr.weighted_sum([on[k][w] for k in members],
                                                                        [work[k] for k in members]))
        channel: Any = 0
        loads: list[Any] = [0] * workers
        for k in range(len(work)):
            sent = model.new_bool_var(f"sent_{tag}{k}")
            model.add(sent == 1 - everywhere[k] - sum(kept[k]))
            e = model.new_int_var(0, horizon, f"e_{tag}{k}")
            model.add(e >= channel + send[k] * sent)
            for w in range(len(on[k])):
                grown = model.new_int_var(0, sum(work), f"load_{tag}{k}_{w}")
                model.add(grown == loads[w] + work[k] * on[k][w])
                loads[w] = grown
                condition = [on[k][w]] if w >= len(kept[k]) else [on[k][w], kept[k][w].Not()]
                model.add(e >= loads[w] + send[k]).only_enforce_if(condition)
            channel = e
        model.add(end >= channel)
        return end

    def units(self, seconds: float) -> int:
        return round(seconds / self.largest * self.max_units) if self.largest > 0 else 0

    def seconds(self, units: float) -> float:
        return units * self.largest / self.max_units

    def hint(self, layout: Layout) -> None:
        for f, (xs, yf) in enumerate(zip(self.x, self.y, strict=True)):
            self.model.add_hint(yf, layout.owners[f] is None)
            for w, v in enumerate(xs):
                self.model.add_hint(v, layout.owners[f] == w)
        for k, (ms, rk) in enumerate(zip(self.m, self.r, strict=True)):
            self.model.add_hint(rk, layout.preconditioners[k] is None)
            for w, v in enumerate(ms):
                self.model.add_hint(v, layout.preconditioners[k] == w)

    def fix(self, layout: Layout) -> None:
        """Constrain the model to `layout` (canonically labelled): tests read its objective."""
        for f, (xs, yf) in enumerate(zip(self.x, self.y, strict=True)):
            self.model.add(yf == int(layout.owners[f] is None))
            for w, v in enumerate(xs):
                self.model.add(v == int(layout.owners[f] == w))
        for k, (ms, rk) in enumerate(zip(self.m, self.r, strict=True)):
            self.model.add(rk == int(layout.preconditioners[k] is None))
            for w, v in enumerate(ms):
                self.model.add(v == int(layout.preconditioners[k] == w))

    def decode(self, solver: Any) -> Layout:
        def rank_of(flags: list[Any], everywhere: Any) -> int | None:
            if solver.boolean_value(everywhere):
                return None
            return next(w for w, v in enumerate(flags) if solver.boolean_value(v))

        return Layout(owners=tuple(rank_of(xs, yf) for xs, yf in zip(self.x, self.y, strict=True)),
                      preconditioners=tuple(rank_of(ms, rk) for ms, rk in zip(self.m, self.r, strict=True)))


#: The exact layout solvers by name.
LAYOUT_SOLVERS: dict[str, type[CpSatLayout]] = {"cp-sat": CpSatLayout}
