"""Tests of the timeline simulator: hand-worked iterations, invariants of the event walk, bad groupings."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.costmodel.costs import AffineCost, ScaledCost
from planner.costmodel.problem import GradientProblem, advance, advance_many
from planner.costmodel.simulator import GroupEvent, simulate, timeline, validate_grouping
from planner.testing import random_problem
from planner.types import GROUPING_STRATEGIES, SolverError, Strategy
from tests.factories import examples


def _three_layers(strategy: Strategy) -> GradientProblem:
    """F = 1, U = 0.5, b = (2, 1, 3), n = (100, 200, 300), 4-byte elements."""
    topk = strategy is Strategy.TOPK
    return GradientProblem(
        strategy=strategy,
        forward_s=1.0,
        update_s=0.5,
        backward_s=(2.0, 1.0, 3.0),
        numel=(100, 200, 300),
        comm=AffineCost(alpha=1.0, beta=0.01 if topk else 0.001),
        world_size=2,
        density=0.1 if topk else None,
        select=AffineCost(alpha=0.5, beta=0.01) if topk else None,
        decode=AffineCost(alpha=0.2, beta=0.01) if topk else None,
    )


def test_dense_three_layers_by_hand() -> None:
    """Grouping (1, 3) of a dense 3-layer problem, worked out by hand."""
    problem = _three_layers(Strategy.DENSE)
    # Ready times R = (2, 3, 6). T(x bytes) = 1 + 0.001 x.
    # Group 0 = layer 0: N = 100, 400 bytes, T = 1.4; starts at R_0 = 2, ends E_1 = 3.4.
    # Group 1 = layers 1, 2: N = 500, 2000 bytes, T = 3.0; starts at max(R_2, E_1) = max(6, 3.4) = 6, ends E_2 = 9.
    # iteration = F + max(R_2, E_2) + U = 1 + 9 + 0.5 = 10.5; compute = 1 + 6 + 0.5 = 7.5; exposed = 3.0.
    # comm_s = 1.4 + 3.0 = 4.4.
    prediction = simulate(problem, (1, 3))
    assert prediction.iteration_s == pytest.approx(10.5)
    assert prediction.compute_s == pytest.approx(7.5)
    assert prediction.exposed_comm_s == pytest.approx(3.0)
    assert prediction.comm_s == pytest.approx(4.4)
    assert prediction.selection_s == 0.0 and prediction.decode_s == 0.0
    assert prediction.num_groups == 2

    first, second = timeline(problem, (1, 3))
    assert (first.ready_s, first.comm_start_s, first.comm_end_s) == pytest.approx((2.0, 2.0, 3.4))
    assert first.select_start_s == first.select_end_s == first.ready_s  # dense selects nothing
    assert (second.ready_s, second.comm_start_s, second.comm_end_s) == pytest.approx((6.0, 6.0, 9.0))
    assert (first.numel, first.bytes, second.numel, second.bytes) == (100, 400, 500, 2000)
    assert (first.layers, second.layers) == (range(0, 1), range(1, 3))

    # One group: T(2400 bytes) = 3.4 after R_2 = 6: 1 + 9.4 + 0.5 = 10.9. One per layer:
    # E = 2 + 1.4 = 3.4; max(3, 3.4) + 1.8 = 5.2; max(6, 5.2) + 2.2 = 8.2 -> 1 + 8.2 + 0.5 = 9.7.
    assert simulate(problem, (3,)).iteration_s == pytest.approx(10.9)
    assert simulate(problem, (1, 2, 3)).iteration_s == pytest.approx(9.7)


def test_topk_three_layers_by_hand() -> None:
    """Grouping (1, 3) of a top-k 3-layer problem (density 0.1, P = 2), worked out by hand."""
    problem = _three_layers(Strategy.TOPK)
    # k(100) = 10, k(500) = 50; bytes = 8 k (4-byte value + 4-byte index): 80 and 400.
    # T(x) = 1 + 0.01 x: 1.8 and 5.0. s(N) = 0.5 + 0.01 N: 1.5 and 5.5. d(P k) = 0.2 + 0.01 P k: 0.4 and 1.2.
    # Group 0: ready at 2, selected until C_1 = 2 + 1.5 = 3.5, sent 3.5 -> E_1 = 5.3.
    # Group 1: ready at C_1 + b_1 + b_2 = 3.5 + 4 = 7.5, selected until C_2 = 13, sent max(13, 5.3) = 13 -> E_2 = 18.
    # Decode once backward is over (C_2 = 13), each group after its own allgather: group 0 from
    # max(13, 5.3) = 13 to 13.4, group 1 from max(13.4, 18) = 18 to 19.2 (D = 0.4 + 1.2 = 1.6).
    # iteration = F + X_2 + U = 1 + 19.2 + 0.5 = 20.7 (decoding everything after the last allgather: 21.1).
    # compute = 1 + 13 + 1.6 + 0.5 = 16.1, exposed = 4.6, comm = 6.8, selection = 7.0.
    prediction = simulate(problem, (1, 3))
    assert prediction.iteration_s == pytest.approx(20.7)
    assert prediction.compute_s == pytest.approx(16.1)
    assert prediction.exposed_comm_s == pytest.approx(4.6)
    assert prediction.comm_s == pytest.approx(6.8)
    assert prediction.selection_s == pytest.approx(7.0)
    assert prediction.decode_s == pytest.approx(1.6)
    assert prediction.num_groups == 2

    first, second = timeline(problem, (1, 3))
    assert (first.ready_s, first.select_end_s, first.comm_start_s, first.comm_end_s) == pytest.approx(
        (2.0, 3.5, 3.5, 5.3)
    )
    assert (second.ready_s, second.select_end_s, second.comm_start_s, second.comm_end_s) == pytest.approx(
        (7.5, 13.0, 13.0, 18.0)
    )
    assert (first.bytes, second.bytes) == (80, 400)
    assert (first.decode_start_s, first.decode_end_s, second.decode_start_s, second.decode_end_s) == pytest.approx(
        (13.0, 13.4, 18.0, 19.2)
    )


def test_comm_bound_topk_by_hand() -> None:
    """When the channel is behind, a collective waits for the previous one, not for its selection."""
    problem = GradientProblem(
        strategy=Strategy.TOPK,
        forward_s=0.0,
        update_s=0.0,
        backward_s=(1.0, 1.0),
        numel=(10, 10),
        comm=AffineCost(alpha=5.0, beta=0.0),
        world_size=1,
        density=1.0,
        select=AffineCost(alpha=1.0, beta=0.0),
        decode=AffineCost(alpha=0.5, beta=0.0),
    )
    # C_1 = 1 + 1 = 2, E_1 = 2 + 5 = 7; C_2 = 2 + 1 + 1 = 4, E_2 = max(4, 7) + 5 = 12; decodes 7 to 7.5
    # (during the second allgather) and 12 to 12.5. iteration = 12.5, compute = 4 + 1 = 5, exposed = 7.5.
    prediction = simulate(problem, (1, 2))
    assert (prediction.iteration_s, prediction.compute_s, prediction.exposed_comm_s) == pytest.approx((12.5, 5, 7.5))
    assert timeline(problem, (1, 2))[1].comm_start_s == pytest.approx(7.0)


@pytest.mark.parametrize(
    ("grouping", "fragment"),
    [
        ((), "at least one group"),
        ((0, 3), "grouping[0] > 0"),
        ((-1, 3), "grouping[0] > 0"),
        ((2, 2, 3), "strictly ascending"),
        ((2, 1, 3), "strictly ascending"),
        ((1, 2), "grouping[-1] == L"),
        ((1, 2, 4), "grouping[-1] == L"),
        ((1.5, 3), "ints"),
        ((True, 3), "ints"),
    ],
)
def test_bad_grouping_is_rejected(grouping: tuple[int, ...], fragment: str) -> None:
    """Invalid groupings raise SolverError naming the invariant and the bad values."""
    problem = _three_layers(Strategy.DENSE)
    with pytest.raises(SolverError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        simulate(problem, grouping)
    with pytest.raises(SolverError):
        timeline(problem, grouping)


def test_numpy_group_ends_are_accepted() -> None:
    problem = _three_layers(Strategy.DENSE)
    assert validate_grouping(problem, np.array([1, 3])) == (1, 3)
    assert simulate(problem, np.array([1, 3])) == simulate(problem, (1, 3))


@st.composite
def _problem_and_grouping(draw: st.DrawFn) -> tuple[GradientProblem, tuple[int, ...]]:
    num_layers = draw(st.integers(1, 8))
    strategy = draw(st.sampled_from(list(GROUPING_STRATEGIES)))
    topk = strategy is Strategy.TOPK
    times = st.floats(0.0, 10.0, allow_nan=False)
    cuts = draw(st.sets(st.integers(1, num_layers - 1))) if num_layers > 1 else set()
    problem = GradientProblem(
        strategy=strategy,
        forward_s=draw(times),
        update_s=draw(times),
        backward_s=tuple(draw(st.lists(times, min_size=num_layers, max_size=num_layers))),
        numel=tuple(draw(st.lists(st.integers(1, 10**6), min_size=num_layers, max_size=num_layers))),
        comm=AffineCost(alpha=draw(times), beta=draw(st.floats(0.0, 1e-3))),
        world_size=draw(st.integers(1, 8)),
        density=draw(st.sampled_from([0.001, 0.1, 1.0])) if topk else None,
        select=AffineCost(alpha=draw(times), beta=draw(st.floats(0.0, 1e-4))) if topk else None,
        decode=AffineCost(alpha=draw(times), beta=draw(st.floats(0.0, 1e-4))) if topk else None,
    )
    return problem, (*sorted(cuts), num_layers)


@settings(deadline=None, max_examples=examples(150))
@given(_problem_and_grouping())
def test_timeline_invariants(case: tuple[GradientProblem, tuple[int, ...]]) -> None:
    """Events tile the layers in order; one channel, used in order; the breakdown adds up."""
    problem, grouping = case
    events = timeline(problem, grouping)
    assert [e.index for e in events] == list(range(len(grouping)))
    assert [i for e in events for i in e.layers] == list(range(problem.num_layers))
    previous: GroupEvent | None = None
    for event in events:
        assert event.numel == sum(problem.numel[i] for i in event.layers)
        assert event.bytes == problem.message_bytes(event.numel)
        assert event.ready_s <= event.select_end_s <= event.comm_start_s <= event.comm_end_s
        if previous is not None:
            assert event.comm_start_s >= previous.comm_end_s
            assert event.ready_s >= previous.select_end_s
            assert event.comm_start_s == max(event.select_end_s, previous.comm_end_s)
        previous = event

    prediction = simulate(problem, grouping)
    assert prediction.num_groups == len(grouping)
    assert prediction.exposed_comm_s >= 0.0  # exactly: a plan holding -3e-18 s fails to load
    assert prediction.iteration_s == pytest.approx(prediction.compute_s + prediction.exposed_comm_s)
    assert math.isclose(
        prediction.comm_s, sum(problem.comm.cost(e.bytes) for e in events), rel_tol=1e-12, abs_tol=1e-12
    )
    # Decoding starts after backward and runs group by group, each after its own collective; it ends no
    # later than if it all ran after the last collective (the model before per-group decode).
    last = events[-1]
    decoded = last.select_end_s
    for event in events:
        assert event.decode_start_s == max(decoded, event.comm_end_s)
        assert event.decode_end_s == pytest.approx(event.decode_start_s + problem.decode_s(event.numel))
        decoded = event.decode_end_s
    expected = problem.forward_s + max(decoded, last.comm_end_s) + problem.update_s
    assert prediction.iteration_s == pytest.approx(expected)
    after_all = problem.forward_s + max(last.select_end_s, last.comm_end_s) + prediction.decode_s + problem.update_s
    assert prediction.iteration_s <= after_all * (1 + 1e-12)
    if problem.strategy is Strategy.DENSE:
        assert prediction.compute_s == pytest.approx(problem.forward_s + sum(problem.backward_s) + problem.update_s)


# ----------------------------------------------------------------------------------------------------
# Packing and interference


def test_advance_runs_slower_only_while_the_channel_is_busy() -> None:
    """Work of W s from C with the channel busy until E, sigma = 1 (half speed while busy)."""
    assert advance(0.0, 2.0, 1.0, 1.0) == pytest.approx(2.0)  # all of it at half speed
    assert advance(0.0, 2.0, 3.0, 1.0) == pytest.approx(4.0)  # 1 s of work by t = 2, then 2 s at full speed
    assert advance(5.0, 2.0, 3.0, 1.0) == pytest.approx(8.0)  # the channel was free already
    assert advance(0.0, 2.0, 3.0, 0.0) == pytest.approx(3.0)  # no interference
    assert advance(1.0, 4.0, 0.0, 2.0) == pytest.approx(1.0)  # no work


@settings(deadline=None, max_examples=examples(200))
@given(
    comp=st.floats(0, 10), chan=st.floats(0, 10), a=st.floats(0, 5), b=st.floats(0, 5), sigma=st.floats(0, 4),
    more=st.floats(0, 3),
)
def test_advance_composes_and_is_monotone(comp: float, chan: float, a: float, b: float, sigma: float,
                                          more: float) -> None:
    """Splitting the work changes nothing; starting later, a busier channel or more interference never ends
    earlier; the vectorised form agrees."""
    whole = advance(comp, chan, a + b, sigma)
    assert advance(advance(comp, chan, a, sigma), chan, b, sigma) == pytest.approx(whole, abs=1e-9)
    assert advance(comp + more, chan, a, sigma) >= advance(comp, chan, a, sigma) - 1e-12
    assert advance(comp, chan + more, a, sigma) >= advance(comp, chan, a, sigma) - 1e-12
    assert advance(comp, chan, a, sigma + more) >= advance(comp, chan, a, sigma) - 1e-12
    many = advance_many(np.array([comp]), np.array([chan]), np.array([a]), sigma)
    assert many[0] == pytest.approx(advance(comp, chan, a, sigma), abs=1e-12)


def test_dense_packing_and_interference_by_hand() -> None:
    """Grouping (1, 3) of the dense 3-layer problem with packing p(N) = 0.001 N and sigma = 1."""
    problem = dataclasses.replace(_three_layers(Strategy.DENSE), pack=AffineCost(alpha=0.0, beta=0.001),
                                  interference=1.0)
    # Group 0: backward 2 + packing 0.1, channel idle: C_1 = 2.1; T(400 B) = 1.4: E_1 = 3.5.
    # Group 1: work 1 + 3 + packing 0.5 = 4.5 from 2.1 with the channel busy until 3.5: 1.4 s of wall time
    # at half speed does 0.7 s of work, the remaining 3.8 s at full speed: C_2 = 3.5 + 3.8 = 7.3.
    # T(2000 B) = 3.0: E_2 = max(7.3, 3.5) + 3 = 10.3. iteration = 1 + 10.3 + 0.5 = 11.8.
    prediction = simulate(problem, (1, 3))
    assert prediction.iteration_s == pytest.approx(11.8)
    assert prediction.compute_s == pytest.approx(1 + 7.3 + 0.5)
    assert prediction.pack_s == pytest.approx(0.6)
    assert prediction.interference_s == pytest.approx(0.7)  # 7.3 - (6 backward + 0.6 packing)
    first, second = timeline(problem, (1, 3))
    assert (first.ready_s, first.select_end_s, first.comm_end_s) == pytest.approx((2.0, 2.1, 3.5))
    assert second.ready_s == pytest.approx(3.5 + (4.0 - 0.7))  # the backward ends before the packing
    assert second.select_end_s == pytest.approx(7.3)


def test_decode_runs_slower_while_collectives_are_in_flight() -> None:
    """sigma = 1: a decode that overlaps the next allgather runs at half speed until the channel frees up."""
    problem = GradientProblem(
        strategy=Strategy.TOPK, forward_s=0.0, update_s=0.0, backward_s=(1.0, 1.0), numel=(10, 10),
        comm=AffineCost(alpha=5.0, beta=0.0), world_size=1, density=1.0,
        select=AffineCost(alpha=1.0, beta=0.0), decode=AffineCost(alpha=2.0, beta=0.0), interference=1.0,
    )
    # C_1 = 2, E_1 = 7; group 1's backward and selection (2 s) run from 2 at half speed: C_2 = 6, E_2 = 12.
    # Decode 0 from max(6, 7) = 7: its 2 s of work at half speed take 4 s, ending at 11, before the channel
    # frees up at 12. Decode 1 from max(11, 12) = 12, channel free: ends at 14.
    first, second = timeline(problem, (1, 2))
    assert (first.comm_end_s, second.select_end_s, second.comm_end_s) == pytest.approx((7.0, 6.0, 12.0))
    assert (first.decode_start_s, first.decode_end_s) == pytest.approx((7.0, 11.0))
    assert (second.decode_start_s, second.decode_end_s) == pytest.approx((12.0, 14.0))
    prediction = simulate(problem, (1, 2))
    assert prediction.iteration_s == pytest.approx(14.0)
    assert prediction.decode_s == pytest.approx(4.0)
    # Stretched: group 1's work (2 s more) and decode 0 (2 s more).
    assert prediction.interference_s == pytest.approx(4.0)


@settings(deadline=None, max_examples=examples(100))
@given(sigma=st.floats(0.0, 3.0), seed=st.integers(0, 1000), cut=st.integers(1, 7))
def test_interference_never_makes_a_grouping_faster(sigma: float, seed: int, cut: int) -> None:
    for strategy in GROUPING_STRATEGIES:
        plain = random_problem(8, strategy, seed=seed)
        slowed = dataclasses.replace(plain, interference=sigma)
        for grouping in ((cut, 8), (8,), tuple(range(1, 9))):
            grouping = tuple(dict.fromkeys(grouping))
            assert simulate(slowed, grouping).iteration_s >= simulate(plain, grouping).iteration_s * (1 - 1e-12)


def test_collectives_run_slower_only_while_backward_runs_by_hand() -> None:
    """kappa = 1 on the dense 3-layer problem: a collective runs at half speed until backward ends at C_G = 6."""
    problem = dataclasses.replace(_three_layers(Strategy.DENSE), comm_stretch=1.0)
    # One per layer, T = (1.4, 1.8, 2.2). Layer 0's from 2, at half speed all along: ends at 4.8. Layer 1's
    # from 4.8: 1.2 s at half speed to 6 do 0.6 s of it, the other 1.2 s at full speed: ends at 7.2. Layer 2's
    # from 7.2, after backward: ends at 9.4. iteration = 1 + 9.4 + 0.5 = 10.9 (9.7 without the stretch).
    events = timeline(problem, (1, 2, 3))
    assert [t for e in events for t in (e.comm_start_s, e.comm_end_s)] == pytest.approx([2.0, 4.8, 4.8, 7.2, 7.2, 9.4])
    prediction = simulate(problem, (1, 2, 3))
    assert prediction.iteration_s == pytest.approx(10.9)
    assert prediction.comm_s == pytest.approx(5.4)  # the collectives' own seconds, alone
    # Grouping (1, 3): layer 0's ends at 4.8, the rest starts after backward and runs at full speed: 10.5.
    assert simulate(problem, (1, 3)).iteration_s == pytest.approx(10.5)
    assert timeline(problem, (1, 3))[0].comm_end_s == pytest.approx(4.8)


def test_a_comm_stretch_is_charged_on_both_strategies_and_never_negative() -> None:
    assert dataclasses.replace(_three_layers(Strategy.TOPK), comm_stretch=0.5).comm_stretch == 0.5
    with pytest.raises(SolverError, match="comm_stretch >= 0"):
        dataclasses.replace(_three_layers(Strategy.DENSE), comm_stretch=-0.1)


@settings(deadline=None, max_examples=examples(100))
@given(kappa=st.floats(0.0, 3.0), sigma=st.sampled_from([0.0, 0.7]), seed=st.integers(0, 1000),
       cut=st.integers(1, 7), strategy=st.sampled_from([Strategy.DENSE, Strategy.TOPK]))
def test_a_comm_stretch_never_makes_a_grouping_faster(kappa: float, sigma: float, seed: int, cut: int,
                                                     strategy: Strategy) -> None:
    """Nor slower than every collective (1 + kappa) times as long all along (a stretch that never stops)."""
    plain = random_problem(8, strategy, seed=seed, interference=sigma)
    slowed = dataclasses.replace(plain, comm_stretch=kappa)
    always = dataclasses.replace(plain, comm=ScaledCost(inner=plain.comm, factor=1 + kappa))
    for grouping in dict.fromkeys(((cut, 8), (8,), tuple(range(1, 9)))):
        at = simulate(slowed, grouping).iteration_s
        assert simulate(plain, grouping).iteration_s * (1 - 1e-12) <= at
        assert at <= simulate(always, grouping).iteration_s * (1 + 1e-12)
