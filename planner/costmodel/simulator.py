"""Event walk of one iteration under the timeline model (DESIGN.md "The timeline model").

The simulator is the reference the solvers are checked against: it walks the groups of a grouping in
ready order with scalar `CostModel.cost` calls and no shortcuts, so that it stays independent of the
vectorised dynamic programs in `planner.solvers`.

Clocks (seconds from the start of backward; the forward pass is not on them):

- compute stream: group g's work W_g = (backward of g's layers) + p(N_g), where p is top-k selection
  s(N) or dense packing (copying the gradients into the flat buffer); with interference sigma the work
  runs (1 + sigma) times slower while a collective is in flight:
  C_g = advance(C_{g-1}, E_{g-1}, W_g), C_0 = 0 (`planner.costmodel.problem.advance`; C_{g-1} + W_g when sigma = 0).
  From C_{g-1} on, the channel is busy exactly until E_{g-1} (group g-1 launched at C_{g-1} or queued
  behind a collective that ends later), so the two clocks determine the slowdown;
- communication channel: E_g = max(C_g, E_{g-1}) + T(N_g), E_0 = 0. With comm stretch kappa a collective
  runs (1 + kappa) times slower while the compute stream works, which it does without a break from 0 to
  C_G: the walk keeps E_g = max(C_g, E_{g-1}) + (1 + kappa) T(N_g) as if compute never ended, and reads it
  in real time at the end (`planner.costmodel.problem.unstretched`: what lies beyond C_G takes
  1 / (1 + kappa) of its length; top-k's decodes then see the collectives end in real time). The clocks stay
  exact for the solvers (`DenseDP`, `TopkParetoDP`): every transition is the same with T scaled, and the
  end, read in real time, is non-decreasing in every clock;
- top-k decoding, as the runtime's `synchronize` does it once backward is over: group by group in ready
  order, each right after its own allgather, overlapping the later ones: X_g = advance(max(X_{g-1}, E_g),
  E_G, d(P * k_g)), X_0 = C_G (a decode runs 1 + sigma times slower while collectives are still in
  flight, which they are until E_G). Dense: X_G = max(C_G, E_G) (nothing to decode).

iteration = F + X_G + U.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import SupportsIndex

from planner.contracts.plan import Prediction
from planner.costmodel.problem import GradientProblem, Grouping, advance, groups_of, unstretched
from planner.types import SolverError, Strategy

__all__ = ["GroupEvent", "simulate", "timeline", "validate_ends", "validate_grouping"]


@dataclass(frozen=True, kw_only=True)
class GroupEvent:
    """When one group's gradients are ready, selected and communicated (seconds from the start of backward).

    Attributes:
        index: position of the group in ready order (0-based).
        layers: the layer indices of the group.
        ready_s: when its last gradient is ready (top-k: when its selection starts).
        select_start_s: start of top-k selection (dense: packing) on the compute stream (= ready_s).
        select_end_s: end of selection or packing (= ready_s for dense without a packing cost).
        comm_start_s: start of its collective: max(select_end_s, end of the previous collective).
        comm_end_s: end of its collective.
        numel: gradient elements of the group, N_g.
        bytes: bytes one rank sends for the group, `problem.message_bytes(N_g)`.
        decode_start_s: start of its top-k decode: after backward, its collective and the previous decode
            (= decode_end_s = comm_end_s for dense).
        decode_end_s: end of its decode, X_g.
    """

    index: int
    layers: range
    ready_s: float
    select_start_s: float
    select_end_s: float
    comm_start_s: float
    comm_end_s: float
    numel: int
    bytes: int
    decode_start_s: float
    decode_end_s: float


def validate_ends(
    raw: Iterable[SupportsIndex], count: int, *, prefix: str = "", ends_name: str = "ends", unit: str = "group",
    count_name: str | None = None,
) -> Grouping:
    """Check that `raw` holds the exclusive ends of contiguous runs covering `count` items; return them as ints.

    The messages start with `prefix`, call the sequence `ends_name`, a run a `unit`, and the count `count_name`
    (its value when None), so each caller's errors name its own things.

    Raises:
        SolverError: empty, not ints, not strictly ascending, not starting after 0 or not ending at `count`.
    """
    items = tuple(raw)
    total = count_name or str(count)
    if not items:
        raise SolverError(f"{prefix}need at least one {unit}, but got {ends_name}={items} for {total}={count}")
    try:
        if any(isinstance(e, bool) for e in items):
            raise TypeError
        ends = tuple(operator.index(e) for e in items)  # ints, numpy integers
    except TypeError:
        raise SolverError(f"{prefix}ends must be ints, but got {ends_name}={items}") from None
    if ends[0] <= 0:
        raise SolverError(
            f"{prefix}`{ends_name}[0] > 0` must hold (no empty {unit}), but got {ends_name}[0]={ends[0]}"
        )
    bad = [(a, b) for a, b in itertools.pairwise(ends) if b <= a]
    if bad:
        raise SolverError(f"{prefix}ends must be strictly ascending, but got {bad[0][0]} then {bad[0][1]} in {ends}")
    if ends[-1] != count:
        raise SolverError(
            f"{prefix}`{ends_name}[-1] == {total}` must hold, but got ({ends_name}[-1]={ends[-1]}, {total}={count})"
        )
    return ends


def validate_grouping(problem: GradientProblem, grouping: Iterable[SupportsIndex]) -> Grouping:
    """Check that `grouping` holds exclusive group ends of `problem`; return it as a tuple of ints.

    Raises:
        SolverError: the grouping is empty, not strictly ascending, does not start after 0 or end at L.
    """
    return validate_ends(grouping, problem.num_layers, ends_name="grouping", count_name="L")


def timeline(problem: GradientProblem, grouping: Iterable[SupportsIndex]) -> list[GroupEvent]:
    """The events of every group of `grouping`, in ready order (see the module docstring for the clocks)."""
    ends = validate_grouping(problem, grouping)
    sigma, stretch = problem.interference, 1 + problem.comm_stretch
    clocks: list[tuple[range, int, int, float, float, float, float]] = []
    compute = 0.0  # C: the compute stream clock
    channel = 0.0  # E: the communication channel clock
    for layers in groups_of(ends):
        numel = sum(problem.numel[i] for i in layers)
        nbytes = problem.message_bytes(numel)
        ready = advance(compute, channel, sum(problem.backward_s[i] for i in layers), sigma)
        select_end = advance(ready, channel, problem.prepare_s(numel), sigma)
        comm_start = max(select_end, channel)
        comm_end = comm_start + stretch * problem.comm.cost(nbytes)  # as if compute never ended (kappa)
        clocks.append((layers, numel, nbytes, ready, select_end, comm_start, comm_end))
        compute, channel = select_end, comm_end
    events: list[GroupEvent] = []
    decoded = compute  # X_0 = C_G: decoding starts once backward (and the last selection) is over
    channel = unstretched(channel, compute, problem.comm_stretch)
    for index, (layers, numel, nbytes, ready, select_end, comm_start, comm_end) in enumerate(clocks):
        comm_start, comm_end = (unstretched(t, compute, problem.comm_stretch) for t in (comm_start, comm_end))
        decode_start = max(decoded, comm_end)
        decoded = advance(decode_start, channel, problem.decode_s(numel), sigma)  # slowed until E_G
        events.append(
            GroupEvent(
                index=index,
                layers=layers,
                ready_s=ready,
                select_start_s=ready,
                select_end_s=select_end,
                comm_start_s=comm_start,
                comm_end_s=comm_end,
                numel=numel,
                bytes=nbytes,
                decode_start_s=decode_start,
                decode_end_s=decoded,
            )
        )
    return events


def simulate(problem: GradientProblem, grouping: Iterable[SupportsIndex]) -> Prediction:
    """Predicted iteration time of `grouping` and its breakdown.

    Raises:
        SolverError: the grouping is not valid for `problem` (see `validate_grouping`).
    """
    events = timeline(problem, grouping)
    compute_end = events[-1].select_end_s  # C_G (= R_{L-1} for dense without packing or interference)
    end = max(events[-1].decode_end_s, events[-1].comm_end_s)  # X_G (dense: max(C_G, E_G))
    decode = selection = 0.0
    pack = 0.0 if problem.pack is None else sum(problem.pack.cost(e.numel) for e in events)
    if problem.strategy is Strategy.TOPK:
        assert problem.select is not None
        selection = sum(problem.select.cost(e.numel) for e in events)
        decode = sum(problem.decode_s(e.numel) for e in events)
    # The compute path: backward, packing, selection and decode as they ran (stretched by interference).
    decoding = sum(e.decode_end_s - e.decode_start_s for e in events)
    iteration = problem.forward_s + end + problem.update_s
    compute = problem.forward_s + compute_end + decoding + problem.update_s
    return Prediction(
        iteration_s=iteration,
        compute_s=compute,
        # Where communication hides entirely, the two sums differ only by rounding (they may add the same
        # terms in another order): a wait cannot be negative, and the plan schema refuses one that is.
        exposed_comm_s=max(0.0, iteration - compute),
        comm_s=sum(problem.comm.cost(e.bytes) for e in events),
        selection_s=selection,
        decode_s=decode,
        num_groups=len(events),
        pack_s=pack,
        interference_s=max(0.0, compute_end - sum(problem.backward_s) - selection - pack) + max(0.0, decoding - decode),
    )
