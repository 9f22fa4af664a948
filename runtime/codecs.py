"""One codec per compressor: how one planned group (or one DDP bucket) is sent, with its own state.

Both drivers send through these: `GradientExchange` (a group per plan group, fed by parameter hooks) and `PlanHook`
(a DDP bucket per plan group, fed by DDP's `GradBucket`). A codec's steps, in order, each step:

1. the local gradient comes in. A *plain* group (no momentum, no clipping) takes it the cheapest way, parameter by
   parameter (`take`) or the whole bucket at once (`take_flat`): a dense group divides it by the world size into its
   flat buffer, a top-k group adds it into its residual. Otherwise the driver writes it into the flat buffer as it
   is, clips it, folds it into the velocity (`planner.runtime.engine.Momentum`) and hands the result to `prepare`;
2. `prepare(flat, source)`: compress into what is sent (`source` None: what `take` took). Returns the indices a
   top-k codec sent (momentum factor masking clears the velocity there), None for the others;
3. `launch(link, flat)`: start the collectives over `link` (a `Link`: the process group, its host groups, and the
   order hierarchical exchanges are issued in); returns the handle of the last one (None on one worker). PowerSGD
   waits for its first allreduce there and launches the second, so every rank issues both at the same point;
4. `finish(flat)`, once that handle is done: write the average into `flat`.

`error()` is the error a codec feeds back (top-k's residual, PowerSGD's error), `state()` / `load(entry)` what a
saved state holds of it. Adding a compressor means adding one codec here, one case in `make_codec`, and its tests
(tests/test_codecs.py).
"""

from __future__ import annotations

import abc
import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from planner.contracts.plan import Plan
from planner.costmodel.problem import topk_count
from planner.kernels.compress import PowerSGDGroup, PowerSGDLayout, fp16_compress, fp16_decompress
from planner.kernels.hierarchical import HierarchicalWork, HostGroups, hierarchical_topk_sum
from planner.kernels.topk import all_gather_flat, decode, pack, select_topk, take_topk
from planner.types import Compressor, CompressorKind, Strategy

__all__ = ["Codec", "DenseCodec", "DensityWarmup", "Fp16Codec", "Link", "PowerSGDCodec", "TopkCodec", "make_codec",
           "write_scaled"]

#: Steps of each hierarchical top-k group's host union kept (`TopkCodec.unions`).
UNION_HISTORY = 1024


def write_scaled(grad: Tensor | None, view: Tensor, scale: float) -> None:
    """Write `grad` times `scale` into `view` (of a flat buffer) in one pass: zeros for a missing gradient, in
    place for a gradient that already is the view. `planner profile` times this as the dense packing cost."""
    if grad is None:
        view.zero_()
    elif grad.data_ptr() == view.data_ptr() and grad.dtype == view.dtype and grad.stride() == view.stride():
        if scale != 1.0:
            view.mul_(scale)
    elif scale != 1.0 and grad.dtype == view.dtype:
        torch.mul(grad, scale, out=view)
    else:  # another dtype: convert first, so the scaling is done in fp32
        view.copy_(grad)
        if scale != 1.0:
            view.mul_(scale)


class Link:
    """What the codecs send over: the process group, its size, the subgroups of each host and across hosts (for
    hierarchical groups), and the hierarchical exchange started last, so that the next one starts after it and
    every rank issues the subgroups' collectives in the same order.

    On one worker nothing is sent: every collective's handle is None (the sum of one is itself)."""

    __slots__ = ("host_groups", "last_hierarchical", "process_group", "world_size")

    def __init__(self, process_group: Any, world_size: int, host_groups: HostGroups | None = None) -> None:
        self.process_group = process_group
        self.world_size = world_size
        self.host_groups = host_groups
        self.last_hierarchical: HierarchicalWork | None = None

    def sum(self, buffer: Tensor, hierarchical: bool) -> Any:
        """Start summing `buffer` in place over the group: one allreduce, or (hierarchical) inside each host, across
        hosts, inside again on a thread of its own. Its handle (`wait()`, `get_future()`), or None on one worker."""
        if self.world_size == 1:
            return None
        if hierarchical:
            return self.across_hosts(buffer)
        return dist.all_reduce(buffer, group=self.process_group, async_op=True)

    def gather(self, recv: Tensor, send: Tensor) -> Any:
        """Start gathering every rank's `send` into `recv`; its handle, or None on one worker."""
        if self.world_size == 1:
            return None
        return all_gather_flat(recv, send, group=self.process_group, async_op=True)

    def across_hosts(self, buffer: Tensor, run: Callable[[], object] | None = None) -> HierarchicalWork:
        """Sum `buffer` by host (or `run` another exchange over the host groups) after the hierarchical exchanges
        started before it."""
        assert self.host_groups is not None
        self.last_hierarchical = HierarchicalWork(buffer, self.host_groups, after=self.last_hierarchical, run=run)
        return self.last_hierarchical


class Codec(abc.ABC):
    """How one group is sent; see the module docstring for the call order.

    Attributes:
        numel: the group's elements.
        world_size: the ranks it is averaged over.
        hierarchical: sent inside each host, across hosts, inside again.
    """

    kind: ClassVar[CompressorKind]

    def __init__(self, numel: int, world_size: int, hierarchical: bool) -> None:
        self.numel = numel
        self.world_size = world_size
        self.hierarchical = hierarchical

    def take(self, j: int, grad: Tensor | None, view: Tensor) -> None:
        """Take parameter j's local gradient (None: zeros) into its `view` of the flat buffer (a plain group)."""
        write_scaled(grad, view, 1.0)

    @abc.abstractmethod
    def take_flat(self, flat: Tensor) -> None:
        """Take a whole bucket's local gradient, already in `flat` (a plain group)."""

    @abc.abstractmethod
    def prepare(self, flat: Tensor, source: Tensor | None) -> Tensor | None:
        """Compress what is sent from `source` (None: what `take` took); the indices sent by top-k, else None."""

    @abc.abstractmethod
    def launch(self, link: Link, flat: Tensor) -> Any:
        """Start the collectives; the handle of the last (None on one worker)."""

    @abc.abstractmethod
    def finish(self, flat: Tensor) -> None:
        """Once the last collective is done: write the average into `flat`."""

    def error(self) -> Tensor | None:
        """The error fed back (flat fp32, the group's elements), or None."""
        return None

    def state(self) -> dict[str, Any]:
        """Copies of what a saved state holds of this codec (its error fed back; nothing where it keeps none)."""
        return {}

    def load(self, entry: dict[str, Any]) -> None:
        """Take back what `state` saved (checked by the caller)."""
        if entry:
            raise ValueError(f"a {self.kind.value} codec keeps no state, but was given {sorted(entry)}")


class DenseCodec(Codec):
    """An allreduce mean of the gradients, in the flat buffer's dtype, divided before the sum as DDP divides."""

    kind = CompressorKind.DENSE

    def take(self, j: int, grad: Tensor | None, view: Tensor) -> None:
        write_scaled(grad, view, 1.0 / self.world_size)

    def take_flat(self, flat: Tensor) -> None:
        flat.mul_(1.0 / self.world_size)

    def prepare(self, flat: Tensor, source: Tensor | None) -> None:
        if source is not None:
            torch.mul(source, 1.0 / self.world_size, out=flat)

    def launch(self, link: Link, flat: Tensor) -> Any:
        return link.sum(flat, self.hierarchical)

    def finish(self, flat: Tensor) -> None:
        """Nothing to do: the allreduce left the mean in `flat`."""


class Fp16Codec(Codec):
    """Cast to fp16 and divide by the world size, allreduce, cast back (DDP's `fp16_compress_hook`)."""

    kind = CompressorKind.FP16

    def __init__(self, numel: int, world_size: int, hierarchical: bool, device: torch.device) -> None:
        super().__init__(numel, world_size, hierarchical)
        self.half = torch.empty(numel, dtype=torch.float16, device=device)

    def take_flat(self, flat: Tensor) -> None:
        """Nothing to do: it compresses from `flat`."""

    def prepare(self, flat: Tensor, source: Tensor | None) -> None:
        fp16_compress(flat if source is None else source, self.half, self.world_size)

    def launch(self, link: Link, flat: Tensor) -> Any:
        return link.sum(self.half, self.hierarchical)

    def finish(self, flat: Tensor) -> None:
        fp16_decompress(self.half, flat)


class PowerSGDCodec(Codec):
    """PowerSGD at the plan's rank with error feedback and warm start (`PowerSGDGroup`): two allreduces, of the Ps
    (with the tensors sent whole) and of the Qs."""

    kind = CompressorKind.POWERSGD

    def __init__(self, layout: PowerSGDLayout, world_size: int, hierarchical: bool, device: torch.device,
                 seed: int) -> None:
        super().__init__(layout.numel, world_size, hierarchical)
        self.group = PowerSGDGroup(layout, device, seed)

    def take_flat(self, flat: Tensor) -> None:
        """Nothing to do: it compresses from `flat`."""

    def prepare(self, flat: Tensor, source: Tensor | None) -> None:
        self.group.compress(flat if source is None else source)

    def launch(self, link: Link, flat: Tensor) -> Any:
        first = link.sum(self.group.send, self.hierarchical)
        if not self.group.layout.compresses:  # nothing approximated: the first allreduce is all
            return first
        if first is not None:  # the middle round needs the sums (the backward thread waits here, on every rank)
            first.wait()
        return link.sum(self.group.middle(self.world_size), self.hierarchical)

    def finish(self, flat: Tensor) -> None:
        if not self.group.layout.compresses:  # no second round: its middle only averages what was sent whole
            self.group.middle(self.world_size)
        self.group.decompress(flat, self.world_size)

    def error(self) -> Tensor:
        return self.group.error

    def state(self) -> dict[str, Any]:
        return {"error": self.group.error.detach().clone(), "q": self.group.q.detach().clone(),
                "fresh": self.group.fresh}

    def load(self, entry: dict[str, Any]) -> None:
        self.group.error.copy_(entry["error"])
        self.group.q.copy_(entry["q"])
        self.group.fresh = bool(entry["fresh"])


class TopkCodec(Codec):
    """The k largest of gradient plus residual (error feedback) from every rank, in one allgather, averaged; or,
    across hosts, merged inside each host and sent across once per host (`hierarchical_topk_sum`).

    Args:
        k: the plan's count.
        k_max: what the send and receive buffers hold (a density warm-up sends more than k at first).
        selector: "exact" or "sampled" (`planner.kernels.topk.select_topk`).
        shapes: the group's tensors' shapes, for `take` (views of the residual).
    """

    kind = CompressorKind.TOPK

    def __init__(self, numel: int, world_size: int, hierarchical: bool, device: torch.device, *, k: int,
                 k_max: int | None = None, selector: str = "exact", shapes: Sequence[torch.Size] = ()) -> None:
        super().__init__(numel, world_size, hierarchical)
        self.k = k
        self.k_now = k  # what this step sends: the plan's k, or more during a density warm-up
        self.selector = selector
        self.residual = torch.zeros(numel, dtype=torch.float32, device=device)
        self.residual_views: list[Tensor] = []
        at = 0
        for shape in shapes:
            size = shape.numel()
            self.residual_views.append(self.residual[at : at + size].view(shape))
            at += size
        #: Per step: the pairs each host sent across, over k (hierarchical only; `GradientExchange.host_unions`).
        self.unions: collections.deque[float] = collections.deque(maxlen=UNION_HISTORY)
        self.k_max = k
        self.send = self.recv = torch.empty(0)
        self.allocate(k if k_max is None else k_max)

    def allocate(self, k: int) -> None:
        """(Re)allocate the send and receive buffers for messages of up to k values."""
        device = self.residual.device
        self.k_max = k
        self.send = torch.empty(2 * k, dtype=torch.float32, device=device)
        # one worker reads its own message; a hierarchical exchange gathers into buffers of its own
        self.recv = self.send if self.world_size == 1 or self.hierarchical else \
            torch.empty(self.world_size * 2 * k, dtype=torch.float32, device=device)

    def take(self, j: int, grad: Tensor | None, view: Tensor) -> None:
        if grad is not None:
            self.residual_views[j].add_(grad)

    def take_flat(self, flat: Tensor) -> None:
        self.residual.add_(flat)

    def prepare(self, flat: Tensor, source: Tensor | None) -> Tensor:
        k = self.k_now
        if source is None:
            values, indices = take_topk(self.residual, k, selector=self.selector)
        else:
            values, indices = select_topk(source, self.residual, k, selector=self.selector)
        pack(values, indices, out=self.send if k == self.k_max else self.send[: 2 * k])
        return indices

    def launch(self, link: Link, flat: Tensor) -> Any:
        if link.world_size == 1:
            return None
        k, send = self.k_now, self.send[: 2 * self.k_now]
        if self.hierarchical:  # the average lands in flat
            groups, unions, world_size = link.host_groups, self.unions, self.world_size
            assert groups is not None

            def exchange() -> None:  # on the exchange's thread; one group's exchanges run one after another
                unions.append(hierarchical_topk_sum(send, k, flat, groups, world_size) / k)

            return link.across_hosts(send, exchange)
        if k == self.k_max:
            return link.gather(self.recv, self.send)
        return link.gather(self.recv[: self.world_size * 2 * k], send)

    def finish(self, flat: Tensor) -> None:
        if self.hierarchical and self.world_size > 1:
            return  # the exchange wrote the average into flat
        k = self.k_now
        gathered = self.recv if k == self.k_max else self.recv[: self.world_size * 2 * k]
        decode(gathered, k, self.numel, self.world_size, out=flat)

    def error(self) -> Tensor:
        return self.residual

    def state(self) -> dict[str, Any]:
        return {"residual": self.residual.detach().clone()}

    def load(self, entry: dict[str, Any]) -> None:
        self.residual.copy_(entry["residual"])


@dataclass(frozen=True)
class DensityWarmup:
    """DGC's density warm-up for a top-k plan (`GradientExchange(density_warmup=(start, steps))`): over the first
    `steps` steps the density decays exponentially from `start` to the plan's `final` one, and each group sends
    k_t = max(plan k, topk_count(numel, density_t)), the same on every rank."""

    start: float
    steps: int
    final: float

    @classmethod
    def of(cls, plan: Plan, density_warmup: Any) -> DensityWarmup:
        """The warm-up `density_warmup` = (start_density, steps) asks of `plan`, checked (ValueError, one line)."""
        if plan.strategy is not Strategy.TOPK or plan.density is None:
            raise ValueError(f"density_warmup needs a top-k plan, but the plan's strategy is {plan.strategy.value}")
        try:
            start, steps = density_warmup
        except (TypeError, ValueError):
            raise ValueError(f"density_warmup must be (start_density, steps), but got {density_warmup!r}") from None
        if not plan.density < start <= 1:
            raise ValueError(f"`plan density < start_density <= 1` must hold, but got (start_density={start}, "
                             f"plan density={plan.density})")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"the warm-up needs an integer `steps >= 1`, but got steps={steps!r}")
        return cls(float(start), steps, plan.density)

    def density_at(self, step: int) -> float:
        """The density sent at `step`."""
        if step >= self.steps:
            return self.final
        return self.start * (self.final / self.start) ** (step / self.steps)

    def k_at(self, numel: int, k: int, step: int) -> int:
        """The k a group of `numel` elements and plan count `k` sends at `step` (never below k)."""
        if step >= self.steps:
            return k
        return max(k, topk_count(numel, self.density_at(step)))

    def set_step(self, codec: TopkCodec, step: int) -> None:
        """Set the codec's k for `step`; grow its buffers when needed, shrink them once the warm-up is over."""
        codec.k_now = self.k_at(codec.numel, codec.k, step)
        if codec.k_now > codec.k_max or (codec.k_now == codec.k and codec.k_max != codec.k):
            codec.allocate(codec.k_now)


def make_codec(compressor: Compressor, numel: int, world_size: int, device: torch.device, *, hierarchical: bool,
               k: int | None = None, k_max: int | None = None, selector: str = "exact",
               shapes: Sequence[torch.Size] = (), layout: PowerSGDLayout | None = None, seed: int = 0) -> Codec:
    """The codec that sends a group of `numel` elements by `compressor` (top-k: `k`, PowerSGD: `layout`, `seed`)."""
    match compressor.kind:
        case CompressorKind.DENSE:
            return DenseCodec(numel, world_size, hierarchical)
        case CompressorKind.FP16:
            return Fp16Codec(numel, world_size, hierarchical, device)
        case CompressorKind.POWERSGD:
            assert layout is not None
            return PowerSGDCodec(layout, world_size, hierarchical, device, seed)
        case CompressorKind.TOPK:
            assert k is not None
            return TopkCodec(numel, world_size, hierarchical, device, k=k, k_max=k_max, selector=selector,
                             shapes=shapes)
        case kind:
            raise ValueError(f"no codec sends by {kind}")
