"""What the fp16 and PowerSGD compressors cost on this device: the runtime's own functions
(planner.kernels.compress), timed on their own.

fp16: casting a group into fp16 (divided by the world size) and back, against its elements. PowerSGD: its
three steps (compress, middle, decompress) on each layer's own tensors at each rank, since what is
compressed and how large P and Q are depend on the shapes. Layers with the same shapes are timed once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch

from planner.contracts.profile import CompressTiming, FittedCurve, PowerSGDLayerTiming
from planner.costmodel.curves import fit_curve
from planner.kernels.compress import PowerSGDGroup, PowerSGDLayout, fp16_compress, fp16_decompress
from planner.platform.timing import median, time_call

__all__ = ["DEFAULT_POWERSGD_RANKS", "compress_points", "fit_or_constant", "measure_compress"]

#: PowerSGD ranks `planner profile` measures unless told otherwise.
DEFAULT_POWERSGD_RANKS = (1, 2, 4)

Shapes = tuple[tuple[int, ...], ...]


def compress_points(sizes: Sequence[int], layers: Sequence[tuple[str, Shapes]], ranks: Sequence[int]) -> int:
    """How many times `measure_compress` calls its `on_point`."""
    return len(sizes) + len({shapes for _, shapes in layers}) * len(ranks)


def measure_compress(
    sizes: Sequence[int],
    layers: Sequence[tuple[str, Shapes]],
    ranks: Sequence[int],
    world_size: int,
    device: torch.device,
    *,
    repeats: int,
    warmup: int,
    on_point: Callable[[], object] = lambda: None,
) -> CompressTiming:
    """Median seconds of the fp16 casts at each size in `sizes` (elements), and of PowerSGD's steps on each
    layer's tensors (`layers`: name and parameter shapes, in ready order) at each rank in `ranks`."""
    gen = torch.Generator(device="cpu").manual_seed(3)
    cast, uncast = [], []
    for n in sizes:
        source = torch.randn(n, generator=gen).to(device)
        half = torch.empty(n, dtype=torch.float16, device=device)
        out = torch.empty(n, device=device)
        cast.append((int(n), median(time_call(partial(fp16_compress, source, half, world_size), device,
                                              repeats=repeats, warmup=warmup))))
        uncast.append((int(n), median(time_call(partial(fp16_decompress, half, out), device, repeats=repeats,
                                                warmup=warmup))))
        on_point()
    measured: dict[tuple[Shapes, int], tuple[float, float, float]] = {}
    rows = []
    for name, shapes in layers:
        for rank in ranks:
            key = (shapes, rank)
            if key not in measured:
                measured[key] = _powersgd_steps(shapes, rank, world_size, device, gen, repeats=repeats,
                                                warmup=warmup)
                on_point()
            compress_s, middle_s, decompress_s = measured[key]
            rows.append(PowerSGDLayerTiming(layer=name, rank=rank, shapes=shapes, compress_s=compress_s,
                                            middle_s=middle_s, decompress_s=decompress_s))
    return CompressTiming(fp16_cast=fit_or_constant(cast), fp16_uncast=fit_or_constant(uncast), powersgd=tuple(rows))


def _powersgd_steps(shapes: Shapes, rank: int, world_size: int, device: torch.device, gen: torch.Generator, *,
                    repeats: int, warmup: int) -> tuple[float, float, float]:
    """Median seconds of compress, middle and decompress of one group of tensors of `shapes` (warm start: the
    first, random step is left out of the timings)."""
    group = PowerSGDGroup(PowerSGDLayout.of(shapes, rank), device, seed=0)
    numel = group.layout.numel
    grads = [torch.randn(numel, generator=gen).to(device) for _ in range(2)]
    out = torch.empty(numel, device=device)
    times: tuple[list[float], list[float], list[float]] = ([], [], [])
    for i in range(max(1, warmup) + repeats):
        steps = (partial(group.compress, grads[i % 2]), partial(group.middle, world_size),
                 partial(group.decompress, out, world_size))
        for step, seconds in zip(steps, times, strict=True):
            elapsed = time_call(step, device, repeats=1, warmup=0)[0]
            if i >= max(1, warmup):
                seconds.append(elapsed)
    return median(times[0]), median(times[1]), median(times[2])


def fit_or_constant(points: list[tuple[int, float]]) -> FittedCurve:
    """The fit of (elements, seconds) points (a constant when fewer than two are above zero)."""
    if sum(t > 0 for _, t in points) >= 2 and len({n for n, _ in points}) >= 2:
        return fit_curve(points)
    return FittedCurve(points=tuple(points), alpha_s=max(t for _, t in points), beta_s_per_byte=0.0, fit_error=0.0)
