"""ABS-SGD plans: the micro-batch and round trigger for workers of different speeds, and the predictions of
ABS-SGD and of the synchronous baselines under one model.

The model. Worker i takes t_i(b) seconds for the forward and backward of a micro-batch of b samples: an affine fit
(alpha_i + beta_i * b) to the profile's per-worker throughput, measured at a few batch sizes on every rank at once
(`profile.throughput`), plus the runtime's pass adding each micro-batch's gradients into the round's sums (the
profile's micro-benchmarked packing of as many elements). Micro-batches smaller than the smallest measured size are
not considered (per-call overheads the fit does not see would dominate them). A round's exchange moves the plan's
dense gradient groups back to back: c = sum over groups of the measured allreduce cost. Every worker spends U (the
profile's optimizer update) at the end of each round.

- ABS-SGD (`simulate_abs`): a discrete-event run of the trigger the runtime uses, compute stretched by the
  profile's interference while an exchange is in flight. Worker i ends its round r at
  the end of its first micro-batch that is at least the min-th and ends after round r-1's exchange has
  finished (or at the max-th, then waiting for it); round r's exchange starts when the last worker has joined
  and round r-1's has finished, and takes c. Rounds are measured after a warm-up: seconds per round, each
  worker's samples and its waiting. The batch trigger is the same run with worker i computing a fixed number
  of micro-batches per round (`batch_trigger_counts`: its part of the global batch by speed), then waiting.
- The choice (`make_abs_plan`): the micro-batch and trigger with the most `progress_per_s`, samples per second
  counting at most the global batch of each round, among rounds of at most ON_TARGET x the global batch. Where
  the exchange outlasts a round's compute the exchange trigger stretches rounds to hide it (everyone busy, but
  larger rounds: samples the task may not use) and the batch trigger keeps rounds at the batch and waits.
- Synchronous SGD (`predict_sync`): worker i computes its batch b_i in one step; everybody waits for the
  slowest; the gradient exchange overlaps that worker's backward as the dense plan's timeline says (the
  profile's layer times scaled to the slowest worker's step); then U.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import replace

from planner.contracts.abs_section import TRIGGERS, ABSSection, VariantPrediction
from planner.contracts.layers import plan_grouping
from planner.contracts.plan import Plan
from planner.contracts.profile import Profile
from planner.costmodel.costs import AffineCost, CostModel, fit_affine
from planner.costmodel.curves import curve_model
from planner.costmodel.from_profile import gradient_problem
from planner.costmodel.problem import GradientProblem, advance, groups_of
from planner.costmodel.simulator import simulate
from planner.strategies.gradients import make_plan
from planner.types import InvalidProfileError, SchemaError, Strategy

__all__ = [
    "accumulate_s",
    "batch_trigger_counts",
    "equal_batches",
    "exchange_s",
    "make_abs_plan",
    "micro_batch_costs",
    "predict_abs",
    "predict_sync",
    "progress_per_s",
    "proportional_batches",
    "simulate_abs",
]

#: Rounds simulated, and how many of them are warm-up left out of the averages.
SIM_ROUNDS, SIM_WARMUP = 96, 16
#: Rounds of at most this many times the global batch are on target; among them the plan keeps the most
#: predicted progress per second. (Under the exchange trigger a round cannot be sized finer than the slowest
#: worker's micro-batch: the fast workers fill the time it takes, so rounds are rarely exactly the batch.)
ON_TARGET = 1.25


def micro_batch_costs(profile: Profile) -> list[AffineCost]:
    """Each worker's seconds per micro-batch as a function of its size, fitted to the profile's throughput."""
    tp = profile.throughput
    if tp is None:
        raise InvalidProfileError(
            "this profile has no per-worker throughput (it was made before planner measured it, or with "
            "`--only comm`); profile again: planner profile --model <MODEL> --nproc <N> [--slowdown RANK=FACTOR]")
    if len(tp.batch_sizes) == 1:
        (size,), costs = tp.batch_sizes, tp.step_s
        return [AffineCost(alpha=0.0, beta=row[0] / size) for row in costs]
    return [fit_affine(list(zip(tp.batch_sizes, row, strict=True)))[0] for row in tp.step_s]


def equal_batches(global_batch: int, world_size: int) -> tuple[int, ...]:
    """`global_batch` split as evenly as integers allow (the first ranks take the remainder)."""
    base, extra = divmod(global_batch, world_size)
    return tuple(base + (r < extra) for r in range(world_size))


def proportional_batches(global_batch: int, speeds: Sequence[float]) -> tuple[int, ...]:
    """`global_batch` split in proportion to `speeds` (samples/s), at least one sample each, rounded by
    largest remainder so the parts sum to `global_batch`."""
    n = len(speeds)
    if global_batch < n or any(not s > 0 for s in speeds):
        raise SchemaError(f"need global batch >= workers ({global_batch} < {n}) and speeds > 0, got {list(speeds)}")
    spare = global_batch - n  # one sample each first
    ideal = [spare * s / sum(speeds) for s in speeds]
    parts = [math.floor(x) for x in ideal]
    for r in sorted(range(n), key=lambda r: (parts[r] - ideal[r], r))[: spare - sum(parts)]:
        parts[r] += 1
    return tuple(1 + p for p in parts)


def simulate_abs(step_s: Sequence[float], *, micro_batch: int, min_micro_batches: int,
                 max_micro_batches: int | None, exchange_s: float, update_s: float, interference: float = 0.0,
                 fixed: Sequence[int] | None = None, rounds: int = SIM_ROUNDS,
                 warmup: int = SIM_WARMUP) -> VariantPrediction:
    """ABS-SGD's steady state under the trigger (see the module docstring); `step_s[i]` is worker i's seconds
    per micro-batch of `micro_batch` samples; compute runs 1 + `interference` times slower while an exchange
    is in flight (its CPU work competes with it: the profile's sigma of the allreduce). `fixed[i]`: the batch
    trigger instead, worker i computes exactly that many micro-batches per round, then waits."""
    if not 1 <= warmup < rounds or min_micro_batches < 1:
        raise SchemaError(f"need 1 <= warmup < rounds and min_micro_batches >= 1, got ({warmup}, {rounds}, "
                          f"{min_micro_batches})")
    if fixed is not None and (len(fixed) != len(step_s) or min(fixed) < 1):
        raise SchemaError(f"the batch trigger needs >= 1 micro-batch for each of {len(step_s)} workers, got "
                          f"{list(fixed)}")
    n = len(step_s)
    start = [0.0] * n
    done = -math.inf  # when the previous round's exchange finished
    counted = [0] * n
    waited = [0.0] * n
    began = 0.0
    for r in range(rounds):
        if r == warmup:
            began = done
        ends = []
        for i, t in enumerate(step_s):
            k, end = 0, start[i]
            while True:  # micro-batches run (1 + interference) times slower while the last exchange is on
                end = advance(end, done, t, interference)
                k += 1
                if fixed is not None:
                    if k >= fixed[i]:
                        break
                elif k >= min_micro_batches and (end >= done or (max_micro_batches is not None
                                                                 and k >= max_micro_batches)):
                    break
            ends.append(end)
            if r >= warmup:
                counted[i] += k
                waited[i] += max(0.0, done - end)
        finished = max(max(ends), done) + exchange_s
        start = [max(e, done) + update_s for e in ends]
        done = finished
    measured = rounds - warmup
    # the exchanges finish once per round: their clock is the round's
    return VariantPrediction(round_s=(done - began) / measured,
                             samples=tuple(micro_batch * c / measured for c in counted),
                             idle_s=tuple(w / measured for w in waited))


def predict_sync(step: Sequence[AffineCost], batches: Sequence[int], problem: GradientProblem,
                 grouping: Sequence[int]) -> VariantPrediction:
    """Synchronous SGD with worker i computing `batches[i]` samples per iteration (see the module docstring)."""
    compute = [cost.cost(b) for cost, b in zip(step, batches, strict=True)]
    slowest = max(compute)
    scale = slowest / (problem.forward_s + sum(problem.backward_s))
    scaled = replace(problem, forward_s=problem.forward_s * scale,
                     backward_s=tuple(b * scale for b in problem.backward_s))
    round_s = simulate(scaled, grouping).iteration_s
    return VariantPrediction(round_s=round_s, samples=tuple(float(b) for b in batches),
                             idle_s=tuple(max(0.0, round_s - c - problem.update_s) for c in compute))


def exchange_s(problem: GradientProblem, grouping: Sequence[int]) -> float:
    """Seconds of one round's exchange: every planned group's allreduce, back to back."""
    return math.fsum(problem.comm.cost(problem.message_bytes(sum(problem.numel[i] for i in group)))
                     for group in groups_of(tuple(grouping)))


def _micro_batch_sizes(global_batch: int, world_size: int, smallest: int = 1) -> list[int]:
    """Candidate micro-batches: powers of two from `smallest` (the least size whose speed was measured: below
    it per-call overheads the fit does not see dominate) up to a worker's equal share, and that share."""
    share = max(1, global_batch // world_size)
    sizes = {max(1, min(share, smallest)), share}
    b = 1
    while b < share:
        if b >= smallest:
            sizes.add(b)
        b *= 2
    return sorted(sizes)


def accumulate_s(pack: CostModel | None, problem: GradientProblem, grouping: Sequence[int]) -> float:
    """Seconds the runtime spends after each micro-batch adding its gradients into the round's sums: one pass
    over every group, priced by the profile's micro-benchmarked packing (`pack`, a pass over N elements; 0
    without one). Not the in-situ calibrated packing of the gradient plans, which is hidden in backward."""
    if pack is None:
        return 0.0
    return math.fsum(pack.cost(sum(problem.numel[i] for i in group)) for group in groups_of(tuple(grouping)))


def batch_trigger_counts(round_samples: int, micro_batch: int, step_s: Sequence[float]) -> tuple[int, ...]:
    """Each worker's micro-batches per round under the batch trigger, as the runtime ends them: its part of
    `round_samples` in proportion to its speed (`micro_batch / step_s[i]`), at the micro-batch nearest it (at
    least one)."""
    speeds = [micro_batch / t for t in step_s]
    return tuple(max(1, math.ceil(round_samples * v / sum(speeds) / micro_batch - 0.5)) for v in speeds)


def progress_per_s(pred: VariantPrediction, global_batch: int) -> float:
    """What the plan maximises: samples per second counting at most `global_batch` of each round. Samples beyond
    the batch the user chose are not assumed to speed training up (past a task's critical batch size they do
    not: on the digits, rounds of 188 samples needed 1.4x the samples of rounds of 128 to reach a loss)."""
    return min(sum(pred.samples), global_batch) / pred.round_s


def predict_abs(profile: Profile, section: ABSSection, grouping: Sequence[int]) -> VariantPrediction:
    """ABS-SGD's rounds under `section`'s micro-batch and trigger on `profile`, the plan's dense gradient groups
    (`grouping`) exchanged each round: what `make_abs_plan` predicts for the micro-batch and trigger it keeps."""
    step = micro_batch_costs(profile)
    problem = gradient_problem(profile, Strategy.DENSE)
    extra = accumulate_s(curve_model(profile.pack) if profile.pack is not None else None, problem, grouping)
    times = [cost.cost(section.micro_batch) + extra for cost in step]
    fixed = (None if section.round_samples is None
             else batch_trigger_counts(section.round_samples, section.micro_batch, times))
    return simulate_abs(times, micro_batch=section.micro_batch, min_micro_batches=section.min_micro_batches,
                        max_micro_batches=section.max_micro_batches, fixed=fixed,
                        exchange_s=exchange_s(problem, grouping), update_s=problem.update_s,
                        interference=problem.interference)


def make_abs_plan(profile: Profile, global_batch: int, *, trigger: str = "batch", source: str = "") -> Plan:
    """The ABS-SGD plan for `profile`: the dense plan's gradient groups, and the micro-batch and trigger with the
    highest predicted `progress_per_s` among rounds of at most `ON_TARGET` x `global_batch` samples. Triggers
    tried (`trigger`, one of TRIGGERS): "batch", rounds of `global_batch`; "exchange", the exchange trigger with
    each minimum round length; "best", both. The baselines split `global_batch` per iteration, equally and by
    the profile's speeds."""
    if trigger not in TRIGGERS:
        raise SchemaError(f"trigger must be one of {TRIGGERS}, got {trigger!r}")
    world = profile.cluster.world_size
    if global_batch < world:
        raise SchemaError(f"--global-batch {global_batch} is smaller than the world size {world}: every worker "
                          "needs at least one sample per round; give a larger --global-batch")
    step = micro_batch_costs(profile)
    dense = make_plan(profile, Strategy.DENSE, source=source, via_ddp=False)  # it does not run inside DDP
    problem = gradient_problem(profile, Strategy.DENSE)
    grouping = plan_grouping(dense, profile)
    exchange = exchange_s(problem, grouping)
    extra = accumulate_s(curve_model(profile.pack) if profile.pack is not None else None, problem, grouping)
    assert profile.throughput is not None  # micro_batch_costs refused a profile without it
    sim = functools.partial(simulate_abs, exchange_s=exchange, update_s=problem.update_s,
                            interference=problem.interference)

    # (micro-batch, minimum micro-batches of the exchange trigger or 0 for the batch trigger, prediction)
    candidates: list[tuple[int, int, VariantPrediction]] = []
    for b in _micro_batch_sizes(global_batch, world, profile.throughput.batch_sizes[0]):
        times = [cost.cost(b) + extra for cost in step]
        if trigger != "exchange":
            candidates.append((b, 0, sim(times, micro_batch=b, min_micro_batches=1, max_micro_batches=None,
                                         fixed=batch_trigger_counts(global_batch, b, times))))
        for m in range(1, global_batch // b + 2 if trigger != "batch" else 1):
            pred = sim(times, micro_batch=b, min_micro_batches=m, max_micro_batches=None)
            candidates.append((b, m, pred))
            if sum(pred.samples) > global_batch * ON_TARGET:
                break

    within = [c for c in candidates if sum(c[2].samples) <= global_batch * ON_TARGET]
    if within:
        b, m, chosen = max(within, key=lambda c: (progress_per_s(c[2], global_batch), c[0]))
    else:  # even one micro-batch of one sample per round is more: the smallest round
        b, m, chosen = min(candidates, key=lambda c: sum(c[2].samples))
    times = [cost.cost(b) + extra for cost in step]
    if m == 0:
        low, cap, round_samples = 1, None, global_batch
    else:
        # The cap holds rounds near the global batch when the exchange runs slower than predicted (the trigger
        # would stretch them to hide it, and larger rounds mean fewer updates): a worker computes at most
        # ON_TARGET times the micro-batches the fastest is predicted to, then waits.
        low, round_samples = m, None
        cap = max(m, math.ceil(ON_TARGET * max(chosen.samples) / b))
        chosen = sim(times, micro_batch=b, min_micro_batches=m, max_micro_batches=cap)
    share = global_batch / world
    speeds = [share / cost.cost(share) for cost in step]
    section = ABSSection(
        global_batch=global_batch, micro_batch=b, min_micro_batches=low, max_micro_batches=cap,
        round_samples=round_samples,
        predicted={
            "abs-sgd": chosen,
            "sync-equal": predict_sync(step, equal_batches(global_batch, world), problem, grouping),
            "sync-proportional": predict_sync(step, proportional_batches(global_batch, speeds), problem, grouping),
        },
    )
    return replace(dense, abs=section)
