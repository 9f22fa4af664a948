"""The instance of the mixed solver: each group of layers may be sent by another compressor, and its timeline.

A group g (contiguous layers in ready order, N elements) sent by compressor c costs, on the compute stream
once its last gradient is ready, `prepare` (packing, and the compressor's own work: fp16 casting, top-k
selection, PowerSGD's P = M Q); then its first collective (fp32 or fp16 allreduce, top-k allgather,
PowerSGD's allreduce of the uncompressed tensors and the Ps) on the channel. A PowerSGD group that
compresses some matrix has a second round: the compute stream waits for the first collective, runs
`middle` (orthogonalising the Ps, Q = M^T P) with the channel idle, and launches the allreduce of the Qs.
After backward each group is decoded (fp16 cast back, top-k scattered, PowerSGD's P Q^T and error) once
its last collective is done, in ready order.

Clocks (seconds from the start of backward), as `planner.costmodel.simulator` has them for one compressor,
with sigma the interference (compute runs 1 + sigma times slower while a collective is in flight):

    C1 = advance(C, E, B_g + prepare_g)          E1 = max(C1, E) + T1_g
    second round:  C2 = E1 + middle_g            E2 = C2 + T2_g          (else C2, E2 = C1, E1)
    decode chain:  X_0 = C_G, X_g = advance(max(X_{g-1}, E2_g), E_G, decode_g)
    iteration = F + max(X_G, E_G) + U

With comm stretch kappa (collectives run 1 + kappa times slower while the compute stream works) the channel is
kept as `planner.costmodel.simulator` keeps it: as if compute never stopped, E1 = max(C1, E) + (1 + kappa) T1,
and read in real time where the compute stream stops. It stops at C_G, and where a group with a second round
waits for its first collective: there the channel is read in real time at C1 (`unstretched`, what it still owes
runs at full speed), the first collective runs at full speed too, and the middle round restarts the stretched
clock:

    second round, kappa:  E1 = max(C1, unstretched(E, C1)) + T1    C2 = E1 + middle_g    E2 = C2 + (1 + kappa) T2

The decodes see every collective end in real time.

With a single compressor this is exactly the dense or top-k timeline of `GradientProblem`. The
interference of a mixed problem is one sigma for the whole step, and its comm stretch one kappa: the largest of
the collectives its compressors use (a conservative choice; the profile measures both per collective). One
kappa, not one per compressor: what a queued collective still owes when the compute stream stops depends on
how much of it has run, which the clocks only hold for one rate.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from planner.contracts.plan import Prediction
from planner.costmodel.costs import CostModel
from planner.costmodel.problem import (
    INDEX_BYTES,
    GradientProblem,
    Grouping,
    advance,
    groups_of,
    topk_count_many,
    unstretched,
)
from planner.costmodel.simulator import validate_ends
from planner.types import DENSE_COMPRESSOR, Collective, Compressor, CompressorKind, SolverError, Strategy

__all__ = ["FP32_BYTES", "Choice", "CompressorCosts", "GroupCosts", "MixedEvent", "MixedProblem", "Sum", "costs_of",
           "simulate_mixed", "timeline_mixed", "validate_choice"]

#: Which compressor (an index into `MixedProblem.compressors`) sends each group of a grouping.
Choice = tuple[int, ...]

#: Bytes of one element in PowerSGD's allreduces and in fp16's.
FP32_BYTES, _FP16_BYTES = 4, 2
#: Seconds of preparation a group costs when it holds a layer its compressor may not send (`MixedProblem.forbidden`):
#: more than any step, so that no bound or search keeps such a group where another way exists (finite, so that
#: the bounds' arithmetic stays finite).
FORBIDDEN_S = 1e6


@dataclass(frozen=True, kw_only=True, eq=False)
class CompressorCosts:
    """What sending a group with one compressor costs: curves of the group's size and per-layer sums.

    Attributes:
        compressor: the compressor.
        collective: the kind of its first collective (what its interference is).
        comm: seconds of the first collective against the bytes one rank sends.
        prepare: compute-stream seconds once the group is complete, against its elements (packing, fp16
            casting, top-k selection); None: nothing.
        decode: seconds after its collectives, against its elements (fp16) or, for top-k, the P * k values
            gathered; None: nothing.
        second_comm: PowerSGD: seconds of the second allreduce against its bytes.
        layer_prepare, layer_middle, layer_decode: PowerSGD: each layer's share of the compression, of the
            middle round and of the decompression (measured per layer; a group pays the sum).
        layer_send, layer_second: PowerSGD: elements each layer adds to the first allreduce (tensors sent
            whole, and its Ps) and to the second (its Qs).
        layer_matrices: PowerSGD: matrices each layer has compressed (a group with none has no second round).
        hierarchical: the group crosses hosts hierarchically (`planner.kernels.hierarchical`); `comm` is then
            that exchange's cost (for top-k, merging and decoding included, so `decode` is None).
    """

    compressor: Compressor
    collective: Collective
    comm: CostModel
    prepare: CostModel | None = None
    decode: CostModel | None = None
    second_comm: CostModel | None = None
    layer_prepare: tuple[float, ...] = ()
    layer_middle: tuple[float, ...] = ()
    layer_decode: tuple[float, ...] = ()
    layer_send: tuple[int, ...] = ()
    layer_second: tuple[int, ...] = ()
    layer_matrices: tuple[int, ...] = ()
    hierarchical: bool = False

    @property
    def label(self) -> str:
        """The compressor's name, and how it crosses hosts where that is hierarchical ("fp16 hierarchical")."""
        return f"{self.compressor} hierarchical" if self.hierarchical else str(self.compressor)

    def __post_init__(self) -> None:
        per_layer = (self.layer_prepare, self.layer_middle, self.layer_decode, self.layer_send, self.layer_second,
                     self.layer_matrices)
        if self.compressor.kind is CompressorKind.POWERSGD:
            if len({len(x) for x in per_layer}) != 1 or self.second_comm is None:
                raise SolverError(f"{self.compressor} needs per-layer costs of equal length and a second collective")
        elif any(per_layer) or self.second_comm is not None:
            raise SolverError(f"only PowerSGD has per-layer costs and a second collective, not {self.compressor}")
        if any(not (math.isfinite(t) and t >= 0) for t in (*self.layer_prepare, *self.layer_middle,
                                                           *self.layer_decode)):
            raise SolverError(f"{self.compressor}: per-layer times must be finite and >= 0")


def costs_of(problem: GradientProblem) -> CompressorCosts:
    """The one compressor of a dense or top-k `GradientProblem`: its packing or selection, its collective and
    its decoding, so that a mixed problem holding it alone has the same timeline."""
    if problem.strategy is Strategy.DENSE:
        return CompressorCosts(compressor=DENSE_COMPRESSOR, collective=Collective.ALLREDUCE, comm=problem.comm,
                               prepare=problem.pack)
    if problem.strategy is not Strategy.TOPK:
        raise SolverError(f"a {problem.strategy.value} problem has no single compressor")
    assert problem.select is not None and problem.density is not None
    prepare: CostModel = problem.select
    if problem.pack is not None:
        prepare = Sum(parts=(problem.pack, problem.select))
    return CompressorCosts(compressor=Compressor(CompressorKind.TOPK, density=problem.density),
                           collective=Collective.ALLGATHER, comm=problem.comm, prepare=prepare, decode=problem.decode)


@dataclass(frozen=True, kw_only=True)
class Sum(CostModel):
    """The sum of cost models (packing then selection, say)."""

    parts: tuple[CostModel, ...]

    def cost(self, x: float) -> float:
        return sum(p.cost(x) for p in self.parts)

    def cost_many(self, xs: np.ndarray) -> np.ndarray:
        return np.sum([p.cost_many(xs) for p in self.parts], axis=0)


@dataclass(frozen=True)
class GroupCosts:
    """The costs of groups (arrays over the groups asked for), as `MixedProblem.costs` gives them."""

    prepare: np.ndarray
    first: np.ndarray  # seconds of the first collective
    middle: np.ndarray  # compute seconds between the two collectives (0 without a second round)
    second: np.ndarray  # seconds of the second collective (0 without one)
    decode: np.ndarray
    second_round: np.ndarray  # bool: whether the group waits for its first collective and sends a second
    first_bytes: np.ndarray
    second_bytes: np.ndarray


@dataclass(frozen=True, kw_only=True, eq=False)
class MixedProblem:
    """Per-layer times and sizes, and the costs of every compressor a group may be sent by.

    Attributes:
        forward_s, update_s: F and U. backward_s: b_i per layer in ready order. numel: n_i.
        world_size: P. element_bytes: bytes of a gradient element (fp32: 4).
        density of top-k compressors and k: as `GradientProblem` (k = ceil(rho N), values and int32 indices).
        compressors: the compressors a group may be sent by (a choice indexes this tuple).
        interference: sigma >= 0 (see the module docstring).
        comm_stretch: kappa >= 0, collectives (1 + kappa) times slower while the compute stream works (see the
            module docstring); 0: none.
        names: the layers' names (optional).
        forbidden: (compressors, layers) bools, or None: layer l may not be sent by compressor c (a group holding
            it costs `FORBIDDEN_S` more preparation). A solver under an error budget forbids what alone exceeds
            the budget (`planner.solvers.compressor_choice.ErrorBudget.forbidden`): no plan within it changes, and
            the bounds no longer count on sending layers in ways the budget rules out.
    """

    forward_s: float
    update_s: float
    backward_s: tuple[float, ...]
    numel: tuple[int, ...]
    world_size: int
    compressors: tuple[CompressorCosts, ...]
    element_bytes: int = 4
    interference: float = 0.0
    comm_stretch: float = 0.0
    names: tuple[str, ...] = field(default=())
    forbidden: np.ndarray | None = None

    def __post_init__(self) -> None:
        if not self.numel:
            raise SolverError("the problem has no layers with gradients")
        if self.forbidden is not None and np.shape(self.forbidden) != (len(self.compressors), len(self.numel)):
            raise SolverError(f"forbidden must be (compressors, layers) = ({len(self.compressors)}, "
                              f"{len(self.numel)}), but got {np.shape(self.forbidden)}")
        if not (math.isfinite(self.comm_stretch) and self.comm_stretch >= 0):
            raise SolverError(f"`comm_stretch >= 0` (finite) must hold, but got comm_stretch={self.comm_stretch}")
        if len(self.backward_s) != len(self.numel):
            raise SolverError(f"`len(backward_s) == len(numel)` must hold, but got ({len(self.backward_s)}, "
                              f"{len(self.numel)})")
        if not self.compressors:
            raise SolverError("a mixed problem needs at least one compressor")
        named = [c.label for c in self.compressors]
        if len(set(named)) != len(named):
            raise SolverError(f"each compressor may be given once (once flat, once hierarchical), but got {named}")
        for c in self.compressors:
            if c.layer_prepare and len(c.layer_prepare) != len(self.numel):
                raise SolverError(f"{c.compressor} has per-layer costs for {len(c.layer_prepare)} layers, the problem "
                                  f"has {len(self.numel)}")
        if self.world_size < 1:
            raise SolverError(f"`world_size >= 1` must hold, but got world_size={self.world_size}")
        if not (math.isfinite(self.interference) and self.interference >= 0):
            raise SolverError(f"`interference >= 0` (finite) must hold, but got interference={self.interference}")

    @property
    def num_layers(self) -> int:
        return len(self.numel)

    @functools.cached_property
    def prefix_numel(self) -> np.ndarray:
        """S[m] = n_0 + ... + n_{m-1}, int64."""
        return np.concatenate(([0], np.cumsum(np.asarray(self.numel, dtype=np.int64))))

    @functools.cached_property
    def prefix_backward(self) -> np.ndarray:
        """Q[m] = b_0 + ... + b_{m-1}."""
        return np.concatenate(([0.0], np.cumsum(np.asarray(self.backward_s, dtype=float))))

    @functools.cached_property
    def _prefix_forbidden(self) -> np.ndarray | None:
        """Per compressor, prefix counts of the layers it may not send (None: none forbidden)."""
        if self.forbidden is None or not np.any(self.forbidden):
            return None
        counts = np.cumsum(np.asarray(self.forbidden, dtype=np.int64), axis=1)
        return np.concatenate((np.zeros((counts.shape[0], 1), dtype=np.int64), counts), axis=1)

    @functools.cached_property
    def _layer_sums(self) -> list[dict[str, np.ndarray] | None]:
        """Per compressor, prefix sums of its per-layer parts (None where it has none)."""
        out: list[dict[str, np.ndarray] | None] = []
        for c in self.compressors:
            if not c.layer_prepare:
                out.append(None)
                continue
            parts = {"prepare": c.layer_prepare, "middle": c.layer_middle, "decode": c.layer_decode,
                     "send": c.layer_send, "second": c.layer_second, "matrices": c.layer_matrices}
            out.append({k: np.concatenate(([0.0], np.cumsum(np.asarray(v, dtype=float)))) for k, v in parts.items()})
        return out

    @classmethod
    def of(cls, problem: GradientProblem, *more: CompressorCosts) -> MixedProblem:
        """The mixed problem with `problem`'s layers, times, interference and comm stretch, its compressor
        (`costs_of`) and `more`."""
        return cls(forward_s=problem.forward_s, update_s=problem.update_s, backward_s=problem.backward_s,
                   numel=problem.numel, world_size=problem.world_size, element_bytes=problem.element_bytes,
                   interference=problem.interference, comm_stretch=problem.comm_stretch, names=problem.names,
                   compressors=(costs_of(problem), *more))

    def index_of(self, compressor: Compressor, hierarchical: bool = False) -> int:
        """The index of `compressor` sent flat (or `hierarchical`) in `compressors` (SolverError if the problem
        has not got it)."""
        for i, c in enumerate(self.compressors):
            if c.compressor == compressor and c.hierarchical == hierarchical:
                return i
        have = ", ".join(c.label for c in self.compressors)
        way = " hierarchical" if hierarchical else ""
        raise SolverError(f"the problem has no {compressor}{way}; it has {have}")

    def indices_of(self, compressor: Compressor) -> tuple[int, ...]:
        """The indices of `compressor`, flat and hierarchical where the problem has both."""
        return tuple(i for i, c in enumerate(self.compressors) if c.compressor == compressor)

    def costs(self, which: int, starts: np.ndarray, ends: np.ndarray) -> GroupCosts:
        """The costs of the groups of layers starts[i]..ends[i] - 1 sent by compressor `which`."""
        c = self.compressors[which]
        starts = np.asarray(starts, dtype=np.int64)
        ends = np.asarray(ends, dtype=np.int64)
        numel = (self.prefix_numel[ends] - self.prefix_numel[starts]).astype(float)
        zeros = np.zeros(numel.shape)
        prepare = zeros if c.prepare is None else c.prepare.cost_many(numel)
        decode = zeros
        middle = second = second_bytes = zeros
        second_round = np.zeros(numel.shape, dtype=bool)
        match c.compressor.kind:
            case CompressorKind.DENSE:
                first_bytes = numel * self.element_bytes
            case CompressorKind.FP16:
                first_bytes = numel * _FP16_BYTES
                decode = zeros if c.decode is None else c.decode.cost_many(numel)
            case CompressorKind.TOPK:
                assert c.compressor.density is not None
                k = topk_count_many(numel, c.compressor.density)
                first_bytes = k * (self.element_bytes + INDEX_BYTES)
                decode = zeros if c.decode is None else c.decode.cost_many(self.world_size * k)
            case CompressorKind.POWERSGD:
                sums = self._layer_sums[which]
                assert sums is not None and c.second_comm is not None

                def span(part: str) -> np.ndarray:
                    return sums[part][ends] - sums[part][starts]

                prepare = prepare + span("prepare")
                middle, decode = span("middle"), span("decode")
                first_bytes = span("send") * FP32_BYTES
                second_bytes = span("second") * FP32_BYTES
                second_round = span("matrices") > 0.5
                second = np.where(second_round, c.second_comm.cost_many(second_bytes), 0.0)
                middle = np.where(second_round, middle, 0.0)
            case other:  # pragma: no cover - CompressorKind is closed
                raise SolverError(f"unknown compressor kind {other!r}")
        if (held := self._prefix_forbidden) is not None:
            prepare = prepare + FORBIDDEN_S * ((held[which, ends] - held[which, starts]) > 0)
        return GroupCosts(prepare=np.asarray(prepare, dtype=float), first=c.comm.cost_many(first_bytes),
                          middle=np.asarray(middle, dtype=float), second=np.asarray(second, dtype=float),
                          decode=np.asarray(decode, dtype=float), second_round=second_round,
                          first_bytes=np.asarray(first_bytes, dtype=float),
                          second_bytes=np.asarray(second_bytes, dtype=float))


def validate_choice(problem: MixedProblem, grouping: Sequence[int], choice: Sequence[int]) -> tuple[Grouping, Choice]:
    """Check a grouping of `problem`'s layers and a compressor index per group; return them as int tuples.

    Raises:
        SolverError: the grouping is not valid (`validate_ends`), or the choice has another length or an index
            outside the problem's compressors.
    """
    ends = validate_ends(grouping, problem.num_layers, ends_name="grouping", count_name="L")
    picks = tuple(int(c) for c in choice)
    if len(picks) != len(ends):
        raise SolverError(f"`len(choice) == len(grouping)` must hold, but got ({len(picks)}, {len(ends)})")
    bad = [c for c in picks if not 0 <= c < len(problem.compressors)]
    if bad:
        raise SolverError(f"compressor index {bad[0]} is outside 0..{len(problem.compressors) - 1}")
    return ends, picks


@dataclass(frozen=True, kw_only=True)
class MixedEvent:
    """One group of a mixed timeline (seconds from the start of backward; see the module docstring)."""

    index: int
    layers: range
    compressor: Compressor
    numel: int
    ready_s: float  # its last gradient ready (its preparation starts)
    prepared_s: float  # preparation done (C1)
    comm_start_s: float
    comm_end_s: float  # E1
    second_start_s: float  # the second round's middle work starts (= comm_end_s without one)
    second_end_s: float  # E2 (= comm_end_s without a second round)
    compute_end_s: float  # C2: the compute stream after the group (its middle round, else its preparation)
    decode_start_s: float
    decode_end_s: float
    prepare_s: float
    middle_s: float
    decode_s: float
    first_s: float
    second_s: float
    first_bytes: float
    second_bytes: float


@dataclass(slots=True)
class _Walked:
    """One group as `timeline_mixed` walks it (its channel times stretched until read in real time)."""

    layers: range
    which: int
    ready: float
    prepared: float
    prepare: float
    middle: float
    decode: float
    first: float
    second: float
    first_bytes: float
    second_bytes: float
    comm_start: float = 0.0
    comm_end: float = 0.0
    second_start: float = 0.0
    done: float = 0.0  # E2: its last collective ends
    after: float = 0.0  # C2: the compute stream after it


def timeline_mixed(problem: MixedProblem, grouping: Sequence[int], choice: Sequence[int]) -> list[MixedEvent]:
    """Walk the groups one by one with scalar arithmetic (the reference the mixed solver is checked against)."""
    ends, picks = validate_choice(problem, grouping, choice)
    sigma, kappa = problem.interference, problem.comm_stretch
    stretch = 1 + kappa
    rows: list[_Walked] = []
    # The rows whose channel times are kept stretched (as if compute never stopped), with whether all of them are
    # (else only the end of a second round); they are read in real time where the compute stream next stops (a
    # second round's wait, or C_G).
    stretched: list[tuple[_Walked, bool]] = []

    def settle(compute_end: float) -> None:
        for row, every in stretched:
            if every:
                row.comm_start = unstretched(row.comm_start, compute_end, kappa)
                row.comm_end = row.second_start = unstretched(row.comm_end, compute_end, kappa)
            row.done = unstretched(row.done, compute_end, kappa)
        stretched.clear()

    compute = channel = 0.0
    for layers, which in zip(groups_of(ends), picks, strict=True):
        costs = problem.costs(which, np.array([layers.start]), np.array([layers.stop]))
        ready = advance(compute, channel, float(sum(problem.backward_s[i] for i in layers)), sigma)
        prepare = float(costs.prepare[0])
        row = _Walked(layers=layers, which=which, ready=ready, prepared=advance(ready, channel, prepare, sigma),
                      prepare=prepare, middle=float(costs.middle[0]), decode=float(costs.decode[0]),
                      first=float(costs.first[0]), second=float(costs.second[0]),
                      first_bytes=float(costs.first_bytes[0]), second_bytes=float(costs.second_bytes[0]))
        rows.append(row)
        if bool(costs.second_round[0]):  # wait for the first collective, then the middle work with the channel idle
            settle(row.prepared)  # the compute stream stops: what the channel owes runs at full speed
            row.comm_start = max(row.prepared, unstretched(channel, row.prepared, kappa))
            row.comm_end = row.second_start = row.comm_start + row.first
            compute = row.second_start + row.middle
            channel = row.done = compute + stretch * row.second
            stretched.append((row, False))
        else:
            row.comm_start = max(row.prepared, channel)
            row.comm_end = row.second_start = row.done = channel = row.comm_start + stretch * row.first
            compute = row.prepared
            stretched.append((row, True))
        row.after = compute
    settle(compute)  # C_G: backward is over
    channel = unstretched(channel, compute, kappa)
    events = []
    decoded = compute  # X_0 = C_G
    for index, row in enumerate(rows):
        start = max(decoded, row.done)
        decoded = advance(start, channel, row.decode, sigma)  # slowed until E_G
        events.append(MixedEvent(
            index=index, layers=row.layers, compressor=problem.compressors[row.which].compressor,
            numel=int(sum(problem.numel[i] for i in row.layers)), ready_s=row.ready, prepared_s=row.prepared,
            comm_start_s=row.comm_start, comm_end_s=row.comm_end, second_start_s=row.second_start,
            second_end_s=row.done, compute_end_s=row.after, decode_start_s=start, decode_end_s=decoded,
            prepare_s=row.prepare, middle_s=row.middle, decode_s=row.decode, first_s=row.first, second_s=row.second,
            first_bytes=row.first_bytes, second_bytes=row.second_bytes))
    return events


def simulate_mixed(problem: MixedProblem, grouping: Sequence[int], choice: Sequence[int]) -> Prediction:
    """Predicted iteration time of `grouping` with group g sent by `problem.compressors[choice[g]]`.

    `selection_s` holds the compressors' compute-stream work (preparation and middle rounds) and `decode_s`
    their decoding, so that `Prediction` reads as for the other strategies.
    """
    events = timeline_mixed(problem, grouping, choice)
    channel_end = events[-1].second_end_s  # E_G: collectives end in order
    end = max(events[-1].decode_end_s, channel_end)
    decoding = sum(e.decode_end_s - e.decode_start_s for e in events)
    decode = sum(e.decode_s for e in events)
    work = sum(e.prepare_s + e.middle_s for e in events)
    backward = float(sum(problem.backward_s))
    # Backward and preparation as they ran (stretched by interference); the waits before a middle round are
    # communication, and the middle round itself runs with the channel idle.
    previous, ran = 0.0, 0.0
    for e in events:
        ran += e.prepared_s - previous
        previous = e.compute_end_s
    stretched = max(0.0, ran - backward - sum(e.prepare_s for e in events))
    iteration = problem.forward_s + end + problem.update_s
    compute = problem.forward_s + backward + work + stretched + decoding + problem.update_s
    return Prediction(
        iteration_s=iteration,
        compute_s=compute,
        exposed_comm_s=max(0.0, iteration - compute),
        comm_s=sum(e.first_s + e.second_s for e in events),
        selection_s=work,
        decode_s=decode,
        num_groups=len(events),
        interference_s=stretched + max(0.0, decoding - decode),
    )
