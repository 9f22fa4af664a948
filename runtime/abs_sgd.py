"""ABS-SGD: delayed synchronous SGD whose per-worker batch adapts to each worker's speed.

Training runs in rounds. In a round every rank computes micro-batches on the current parameters and sums
their gradients (`step` after each micro-batch's backward). The round ends on the trigger, the same rule on
every rank: at least `min_micro_batches` micro-batches, then more until the previous round's exchange has
finished, at most `max_micro_batches`. At the end of a round a rank starts the exchange of (the sum of its
gradients, its sample count) without waiting for it, and applies the previous round's exchange: the
sample-weighted mean of every rank's gradients, sum over ranks of the sums divided by the sum of the counts.
Updates are therefore delayed by exactly one round, fast ranks contribute more samples, and nobody waits for
the allreduce while it runs. `finish()` applies what is still pending (the last exchange, then the partial
round), so no sample is dropped and none applied twice.

With the batch trigger (`round_samples`, which plans choose where the exchange outlasts a round's compute) a
round ends by size instead: each rank computes its part of `round_samples`, in proportion to its measured
speed, then waits for the previous exchange if it is still running. Rounds stay at the batch the user chose.

    abs_sgd = ABSSGD(model, optimizer, plan=Plan.load("plan.json"))
    while abs_sgd.round < rounds:
        x, y = next(batches)                     # this rank's micro-batch of plan.abs.micro_batch samples
        F.cross_entropy(model(x), y).backward()  # a mean loss (loss_reduction="mean", the default)
        abs_sgd.step(len(x))                     # accumulates; at a round end, updates the parameters
    abs_sgd.finish()

The exchange moves the plan's gradient groups (one allreduce per group) and one count. Do not call
`optimizer.step()` or `zero_grad()` yourself: `step` takes the gradients out of `.grad` after each
micro-batch and the update happens inside it. Parameters and buffers are broadcast from rank 0 at
construction (as DDP does); buffers (BatchNorm statistics) are not synchronised during training, unlike
DDP: call `sync_buffers()` before evaluating or saving. Parameters no rank computed a gradient for in a
round take a zero gradient in the mean (DDP without `find_unused_parameters` would refuse such a model).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from planner.contracts.plan import Plan
from planner.runtime.attach import resolve_plan
from planner.runtime.engine import broadcast_from_rank0, planned_params
from planner.types import PlanMismatchError

__all__ = ["ABSSGD", "RoundRecord"]

STATE_KIND = "runtime.abs_sgd"
#: How much less each earlier round weighs in a rank's measured speed (the batch trigger's parts): rounds are
#: short and a throttled worker's speed is bursty within one, so one round alone makes noisy parts; at 0.8 a
#: changed speed shows fully after about ten rounds.
SPEED_DECAY = 0.8


@dataclass(frozen=True)
class RoundRecord:
    """What one round was on this rank (times in seconds, from `time.perf_counter`)."""

    round: int
    micro_batches: int
    samples: int  # this rank's samples in the round
    applied_samples: int  # all ranks' samples in the update applied at this round's end (0: none applied)
    ended_at: float
    wait_s: float  # blocked waiting for the previous round's exchange
    update_s: float  # applying the update


class ABSSGD:
    """One-round-delayed, sample-weighted synchronous SGD with a per-rank batch set by the round trigger.

    Args:
        model: the module being trained (the same architecture on every rank).
        optimizer: the optimizer of `model`'s parameters; `step` calls its `step()` with the mean gradient.
        plan: a plan with an `abs` section (`planner solve --strategy abs`): its trigger and gradient groups.
            None: one group of every trainable parameter, and the trigger given here.
        min_micro_batches: the trigger (overrides the plan's): a round ends after at least this many
            micro-batches once the previous exchange has finished.
        max_micro_batches: ... and at the latest after this many (None: no cap). Equal values make a fixed
            count per round.
        round_samples: the batch trigger instead (overrides the plan's `round_samples`): every round is about this
            many samples over all ranks, each rank's part in proportion to its measured speed; a rank ends its
            round at the micro-batch that brings it nearest its part, whether or not the previous exchange has
            finished (it then waits for it). Speeds are each rank's samples per second of its own time between
            `step` calls (waits and updates left out), exchanged with the counts, so the parts follow a worker
            whose speed changes, two rounds late. Until then, the plan's predicted shares (equal without a plan).
        loss_reduction: "mean" when each micro-batch's loss is its samples' mean (PyTorch's default; the
            gradient is multiplied by the sample count before summing) or "sum".
        process_group: the group to train on (default: the default group; a single process without one).
        model_name: the model's name in messages (default its class name).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        plan: Plan | None = None,
        *,
        min_micro_batches: int | None = None,
        max_micro_batches: int | None = None,
        round_samples: int | None = None,
        loss_reduction: str = "mean",
        process_group: Any = None,
        model_name: str | None = None,
    ) -> None:
        if plan is not None and plan.abs is None:
            raise PlanMismatchError(
                "this plan has no abs section (it is a plan for synchronous gradient exchange); make one with "
                "`planner solve PROFILE --strategy abs --global-batch B -o plan.json`")
        if plan is not None:
            plan = resolve_plan(plan, model, process_group=process_group, model_name=model_name)
        section = plan.abs if plan is not None else None
        low = min_micro_batches if min_micro_batches is not None else section.min_micro_batches if section else 1
        high = (max_micro_batches if max_micro_batches is not None or min_micro_batches is not None
                else section.max_micro_batches if section else None)
        if low < 1 or (high is not None and high < low):
            raise ValueError(f"`1 <= min_micro_batches <= max_micro_batches` must hold, but got ({low}, {high})")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if round_samples is None and section is not None:
            round_samples = section.round_samples
        self.plan = plan
        self.model = model
        self.optimizer = optimizer
        self.min_micro_batches = int(low)
        self.max_micro_batches = None if high is None else int(high)
        self.loss_reduction = loss_reduction
        self.process_group = process_group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(process_group) if self.distributed else 1
        rank = dist.get_rank(process_group) if self.distributed else 0
        if round_samples is not None and not (isinstance(round_samples, int) and round_samples >= self.world_size):
            raise ValueError(f"round_samples must be a whole number >= the world size {self.world_size}, got "
                             f"{round_samples!r}")
        self.round_samples = round_samples
        shares = (section.predicted["abs-sgd"].shares if section is not None
                  else (1.0 / self.world_size,) * self.world_size)
        #: this rank's part of `round_samples` (the batch trigger), from the last exchanged speeds
        self.target_samples = None if round_samples is None else round_samples * shares[rank]
        self._groups = self._param_groups(model, plan)
        self._check_optimizer(optimizer)
        like = self._groups[0][0]
        self._acc = [torch.zeros(sum(p.numel() for p in g), dtype=like.dtype, device=like.device)
                     for g in self._groups]
        self._sent = [torch.zeros_like(t) for t in self._acc]
        self._acc_count = 0
        # sent with the sums: [samples, this rank's speed (samples/s; 0: not measured), ranks with a speed]
        self._sent_count = torch.zeros(3, dtype=torch.float64, device=like.device)
        self._spare_count = torch.zeros_like(self._sent_count)
        self._works: list[Any] = []
        self._pending = False  # `_sent` holds an exchange not yet applied
        self._micro = 0
        self._timer: float | None = None  # when this rank's previous `step` returned (None: no previous one)
        self._compute_s = 0.0  # this round's seconds between `step`s
        self._timed_samples = 0  # the samples of those
        self._sent_speed = 0.0  # this rank's speed as sent with the exchange in flight
        self._speed_samples = self._speed_s = 0.0  # decayed sums of timed samples and their seconds
        self.round = 0  # rounds ended (exchanges started) on every rank
        self.samples = 0  # this rank's samples handed to `step`
        self.applied_samples = 0  # every rank's samples in the updates applied so far
        self.updates: list[int] = []  # every rank's samples in each update applied, in order (this session)
        self.records: list[RoundRecord] = []
        if self.world_size > 1:
            broadcast_from_rank0([*model.parameters(), *model.buffers()], process_group)

    # -- set-up ------------------------------------------------------------------------------------
    @staticmethod
    def _param_groups(model: nn.Module, plan: Plan | None) -> list[list[nn.Parameter]]:
        if plan is None:  # a tied parameter once, under its first name
            return [[p for p in model.parameters() if p.requires_grad]]
        params = planned_params(model, plan)
        return [[params[n] for n in g.params] for g in plan.groups]

    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        ours = {id(p) for g in self._groups for p in g}
        theirs = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if not ours <= theirs:
            raise ValueError("the optimizer does not hold every trainable parameter of the model; pass the "
                             "optimizer built from model.parameters()")

    def sync_buffers(self) -> None:
        """Overwrite every rank's buffers (BatchNorm statistics) with rank 0's (a collective)."""
        if self.world_size > 1:
            broadcast_from_rank0(list(self.model.buffers()), self.process_group)

    # -- training ------------------------------------------------------------------------------------
    def step(self, num_samples: int) -> bool:
        """Take this micro-batch's gradients (of `num_samples` samples) out of `.grad` into the round's sum;
        end the round if the trigger says so. Returns whether a round ended (and the parameters changed)."""
        if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
            raise ValueError(f"num_samples must be a positive int (the micro-batch's samples), got {num_samples!r}")
        scale = float(num_samples) if self.loss_reduction == "mean" else 1.0
        with torch.no_grad():
            for group, flat in zip(self._groups, self._acc, strict=True):
                at = 0
                for p in group:
                    n = p.numel()
                    if p.grad is not None:
                        flat[at : at + n].add_(p.grad.reshape(-1), alpha=scale)
                        p.grad = None
                    at += n
        now = time.perf_counter()
        if self._timer is not None:
            self._compute_s += now - self._timer
            self._timed_samples += num_samples
        self._timer = now
        self._acc_count += num_samples
        self.samples += num_samples
        self._micro += 1
        if self._micro < self.min_micro_batches:
            return False
        capped = self.max_micro_batches is not None and self._micro >= self.max_micro_batches
        if self.target_samples is not None:  # the batch trigger: the micro-batch nearest this rank's part
            done = self._acc_count >= self.target_samples - num_samples / 2
        else:  # the exchange trigger
            done = all(w.is_completed() for w in self._works)
        if capped or done:
            self._end_round()
            self._timer = time.perf_counter()  # the wait and the update are not this rank's compute
            return True
        return False

    def _launch(self) -> list[Any]:
        """Start the exchange of this round's sums and count (async) and make them the sent ones; the
        previously sent sums become the accumulator (the caller applies them, then zeroes them). Returns the
        previous exchange's work handles."""
        previous = self._works
        self._acc, self._sent = self._sent, self._acc
        self._sent_count, self._spare_count = self._spare_count, self._sent_count
        # this rank's speed: samples over compute seconds, each earlier round weighing SPEED_DECAY times less
        self._speed_samples = SPEED_DECAY * self._speed_samples + self._timed_samples
        self._speed_s = SPEED_DECAY * self._speed_s + self._compute_s
        speed = self._speed_samples / self._speed_s if self._speed_s > 0 and self._speed_samples > 0 else 0.0
        self._sent_count[0], self._sent_count[1], self._sent_count[2] = float(self._acc_count), speed, float(speed > 0)
        self._sent_speed = speed
        self._acc_count, self._compute_s, self._timed_samples = 0, 0.0, 0
        self._works = []
        if self.world_size > 1:
            ops = [*self._sent, self._sent_count]
            self._works = [dist.all_reduce(t, group=self.process_group, async_op=True) for t in ops]
        return previous

    @staticmethod
    def _wait(works: Sequence[Any]) -> float:
        started = time.perf_counter()
        for w in works:
            w.wait()
        return time.perf_counter() - started

    def _apply(self, sums: Sequence[Tensor], count: float) -> int:
        """Set `.grad` to sums / count, step the optimizer, clear `.grad` and zero `sums`; nothing is applied
        for a count of 0. Returns the samples applied."""
        if count > 0:
            with torch.no_grad():
                for group, flat in zip(self._groups, sums, strict=True):
                    flat.div_(count)  # in place: `.grad` are views of the mean, no copies
                    at = 0
                    for p in group:
                        n = p.numel()
                        p.grad = flat[at : at + n].view_as(p)
                        at += n
            self.optimizer.step()
            for group in self._groups:
                for p in group:
                    p.grad = None
            self.applied_samples += round(count)
            self.updates.append(round(count))
        for t in sums:
            t.zero_()
        return round(count)

    def _rotate(self) -> tuple[int, float, float]:
        """Start this round's exchange, then wait for and apply the previous one (if any). Returns the samples
        applied, the seconds waited and the seconds the update took."""
        pending, sums, count, speed = self._pending, self._sent, self._sent_count, self._sent_speed
        works = self._launch()  # `sums` and `count` are now the accumulator and the spare count
        self._pending = True
        wait = self._wait(works)
        started = time.perf_counter()
        total, speeds, timed = count.tolist()
        if self.round_samples is not None and pending and timed == self.world_size and speeds > 0:
            self.target_samples = self.round_samples * speed / speeds
        applied = self._apply(sums, total) if pending else 0
        return applied, wait, time.perf_counter() - started

    def _end_round(self) -> None:
        micro, samples = self._micro, self._acc_count
        applied, wait, update = self._rotate()
        self._micro = 0
        self.records.append(RoundRecord(round=self.round, micro_batches=micro, samples=samples,
                                        applied_samples=applied, ended_at=time.perf_counter(), wait_s=wait,
                                        update_s=update))
        self.round += 1

    def finish(self) -> None:
        """Apply everything pending, on every rank (a collective: every rank calls it): the last exchange,
        then the round in progress (its exchange, however few samples each rank has; ranks with none send 0).
        One record covers both; the round counts only if some rank had samples in it."""
        micro, samples = self._micro, self._acc_count
        applied, wait, update = self._rotate()
        wait += self._wait(self._works)
        self._works = []
        count = float(self._sent_count[0].item())
        started = time.perf_counter()
        applied += self._apply(self._sent, count)
        update += time.perf_counter() - started
        self._pending = False
        self._micro = 0
        self.records.append(RoundRecord(round=self.round, micro_batches=micro, samples=samples,
                                        applied_samples=applied, ended_at=time.perf_counter(), wait_s=wait,
                                        update_s=update))
        if count > 0:
            self.round += 1

    # -- resuming ------------------------------------------------------------------------------------
    def _layout_digest(self) -> str:
        h = hashlib.sha256()
        for g in self._groups:
            h.update(",".join(f"{tuple(p.shape)}" for p in g).encode() + b"\n")
        return h.hexdigest()[:16]

    def state_dict(self) -> dict[str, Any]:
        """What resuming needs, as copies: the round number, this rank's partial round (its sums, samples and
        micro-batches) and the exchanged sums and count not yet applied (waited for first). The model's and
        the optimizer's states are saved as usual beside it. Saved at a round end, every rank's state is the
        same but for `samples`."""
        self._wait(self._works)
        self._works = []
        return {
            "kind": STATE_KIND,
            "layout": self._layout_digest(),
            "round": self.round,
            "micro_batches": self._micro,
            "partial_sums": [t.detach().clone() for t in self._acc],
            "partial_samples": self._acc_count,
            "pending_sums": [t.detach().clone() for t in self._sent] if self._pending else None,
            "pending_samples": float(self._sent_count[0].item()) if self._pending else 0.0,
            "samples": self.samples,
            "applied_samples": self.applied_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved for a model of the same parameter shapes and groups."""
        kind = state.get("kind") if isinstance(state, dict) else type(state).__name__
        if kind != STATE_KIND:
            raise PlanMismatchError(f"not an ABSSGD state: kind is {kind!r}, expected {STATE_KIND!r}")
        if state.get("layout") != self._layout_digest():
            raise PlanMismatchError("this ABSSGD state was saved for other parameter shapes or groups; load the "
                                    "state saved with this model and plan")
        self._wait(self._works)
        self._works = []
        with torch.no_grad():
            for t, saved in zip(self._acc, state["partial_sums"], strict=True):
                t.copy_(saved)
            pending = state["pending_sums"]
            for i, t in enumerate(self._sent):
                t.copy_(pending[i]) if pending is not None else t.zero_()
        self._acc_count = int(state["partial_samples"])
        self._sent_count.zero_()  # the speeds sent with it are not kept: the parts change at the next exchange
        self._sent_count[0] = float(state["pending_samples"])
        self._pending = pending is not None
        self._micro = int(state["micro_batches"])
        self.round = int(state["round"])
        self.samples = int(state["samples"])
        self.applied_samples = int(state["applied_samples"])
