"""A DDP communication hook with the runtime's top-k sparsification and error feedback.

    state = TopkHookState(density=0.01)
    ddp_model.register_comm_hook(state, topk_hook)

DDP groups gradients into its own buckets (not the plan's groups); each bucket is one top-k group:
k = topk_count(numel, density) values and indices travel in one allgather, and what was not sent stays
in the bucket's residual. DDP rebuilds its buckets from the observed ready order after the first
iteration, so, as PowerSGD's `start_powerSGD_iter`, the first `start_iter` iterations use a plain
allreduce mean and no residual is tied to the first bucket layout.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from planner.costmodel.problem import topk_count
from planner.kernels.topk import SELECTORS, all_gather_flat, decode, pack, select_topk

__all__ = ["TopkHookState", "has_unused_parameters", "silent_hook", "topk_hook"]


class TopkHookState:
    """State of `topk_hook`: density, process group, and one residual per DDP bucket index.

    Args:
        density: fraction of each bucket sent, in (0, 1].
        process_group: the group DDP averages over; None for the default group.
        start_iter: iterations that use a plain allreduce before top-k starts; at least 2 because DDP
            rebuilds its buckets after iteration 1.
        selector: how each bucket's top-k is found (`planner.kernels.topk.SELECTORS`): "exact" torch.topk or
            "sampled" threshold; both send the same entries.

    Attributes:
        iteration: iterations this state has seen since it was created (not saved: a resumed run's new
            DDP module rebuilds its buckets again, so it warms up again, keeping the loaded residuals
            until its buckets have their final, identical layout).
    """

    __slots__ = ("density", "iteration", "process_group", "residuals", "selector", "start_iter")

    def __init__(
        self, density: float, process_group: Any = None, *, start_iter: int = 2, selector: str = "exact"
    ) -> None:
        if not 0 < density <= 1:
            raise ValueError(f"`0 < density <= 1` must hold, but got density={density}")
        _check_selector(selector)
        if start_iter < 2:
            raise ValueError(f"`start_iter >= 2` must hold (DDP rebuilds buckets after iteration 1), got {start_iter}")
        self.density = density
        self.process_group = process_group
        self.residuals: dict[int, Tensor] = {}
        self.start_iter = start_iter
        self.selector = selector
        self.iteration = 0

    def state_dict(self) -> dict[str, Any]:
        """Density, start_iter, selector and copies of this rank's residuals by bucket index."""
        return {
            "density": self.density,
            "start_iter": self.start_iter,
            "selector": self.selector,
            "residuals": {i: r.detach().clone() for i, r in self.residuals.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved (residuals are copied); a residual whose bucket turns out to
        have another size is dropped when that bucket is first sparsified. A state saved before the
        selector was recorded loads as "exact"."""
        selector = state.get("selector", "exact")
        _check_selector(selector)
        self.selector = selector
        self.density = float(state["density"])
        self.start_iter = int(state["start_iter"])
        self.residuals = {int(i): r.detach().clone() for i, r in state["residuals"].items()}


def _check_selector(selector: object) -> None:
    if selector not in SELECTORS:
        raise ValueError(f"unknown top-k selector {selector!r}; valid selectors: {', '.join(SELECTORS)}")


def topk_hook(state: TopkHookState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """Average the bucket's gradients by top-k allgather with error feedback (plain allreduce at first)."""
    pg = state.process_group
    world_size = dist.get_world_size(pg)
    flat = bucket.buffer()
    warmup = state.iteration < state.start_iter
    if bucket.is_last():  # DDP calls the hook bucket by bucket in order; the last one ends the iteration
        state.iteration += 1
    if warmup:
        fut = dist.all_reduce(flat, group=pg, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0].div_(world_size))
    grad = flat if flat.dtype == torch.float32 else flat.float()
    numel = grad.numel()
    residual = state.residuals.get(bucket.index())
    if residual is not None and residual.device != grad.device:  # loaded from a checkpoint on another device
        residual = state.residuals[bucket.index()] = residual.to(grad.device)
    if residual is None or residual.shape != grad.shape:  # new bucket, or a layout unlike the saved one
        residual = state.residuals[bucket.index()] = torch.zeros_like(grad)
    k = topk_count(numel, state.density)
    send = pack(*select_topk(grad, residual, k, selector=state.selector))
    recv = torch.empty(world_size * 2 * k, dtype=torch.float32, device=grad.device)
    fut = all_gather_flat(recv, send, group=pg, async_op=True).get_future()

    def _decode(f: torch.futures.Future[Any]) -> Tensor:
        f.value()  # raises if the allgather failed
        dense = decode(recv, k, numel, world_size, out=grad)
        if dense is not flat:
            flat.copy_(dense)
        return flat

    return fut.then(_decode)


def silent_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """Send nothing: every rank keeps its own bucket. `planner profile` registers it to time DDP's own work
    (copying gradients into its buckets and back) apart from communication."""
    future: torch.futures.Future[Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


# DDP's register_comm_hook compares the annotations with the real objects; `from __future__ import
# annotations` leaves strings, so resolve them here.
topk_hook.__annotations__.update(
    {"state": TopkHookState, "bucket": dist.GradBucket, "return": torch.futures.Future[Tensor]}
)
silent_hook.__annotations__.update({"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[Tensor]})


def has_unused_parameters(module: torch.nn.Module, loss: Callable[[torch.nn.Module], Any]
                          | Sequence[Callable[[torch.nn.Module], Any]], group: Any = None) -> bool:
    """Whether some trainable parameter of `module` gets no gradient from `loss(copy)` (a scalar, run on a
    copy of the module; or from any of several such losses, one per batch: a mixture-of-experts router leaves
    other experts unused in each batch) on any rank of `group`: what
    `DistributedDataParallel(find_unused_parameters=...)` and `GradientExchange(find_unused_parameters=...)` must
    be told, the same on every rank."""
    probe = copy.deepcopy(module)
    found = False
    for one in [loss] if callable(loss) else loss:
        probe.zero_grad(set_to_none=True)
        one(probe).backward()
        found = found or any(p.grad is None for p in probe.parameters() if p.requires_grad)
    unused = torch.tensor([int(found)])
    if dist.is_available() and dist.is_initialized():
        device = next(module.parameters()).device
        unused = unused.to(device)
        dist.all_reduce(unused, op=dist.ReduceOp.MAX, group=group)
    return bool(unused.item())
