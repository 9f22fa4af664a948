"""Top-k selection time against size and density (for each selector), and decode time against gathered values.

Times the runtime's own functions (planner.kernels.topk), so the profile measures what the runtime does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial

import torch

from planner.contracts.profile import FittedCurve, TopkTiming
from planner.costmodel.curves import fit_curve
from planner.costmodel.problem import topk_count
from planner.kernels.topk import SELECTORS, decode, pack, select_topk
from planner.platform.timing import median, time_call

__all__ = ["measure_topk", "topk_point_bytes"]


def topk_point_bytes(numel: int, density: float, world_size: int) -> int:
    """Memory one (size, density) point of `measure_topk` takes at its peak, about: the gradient, residual and
    output (3 x 4 bytes per element), the selectors' working copies and sort (about 28 bytes per element,
    measured on a CPU), and per selected value its index and value twice (24 bytes) and the P packed
    messages and their concatenation (16 P bytes). 8 M elements on 2 workers measured 42, 36 and 85 bytes
    per element at densities 0.01, 0.1 and 1; this gives 40, 46 and 84."""
    k = topk_count(numel, density)
    return 40 * numel + (24 + 16 * world_size) * k


def measure_topk(
    sizes: Sequence[int],
    densities: Sequence[float],
    world_size: int,
    device: torch.device,
    *,
    repeats: int,
    warmup: int,
    max_point_bytes: int | None = None,
    on_point: Callable[[], object] = lambda: None,
) -> TopkTiming:
    """Median seconds of `select_topk` with each selector for each (size, density), and of `decode` of the
    P*k values gathered at each (size, density). `on_point` is called once per (size, density), after
    every selector and the decode.

    `max_point_bytes`: a (size, density) point estimated to take more memory (`topk_point_bytes`) is not
    measured, except the two smallest sizes (a curve needs two points); the cost curves extend the largest
    measured sizes linearly to it. None: every point."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    select: dict[str, list[tuple[int, float, float]]] = {s: [] for s in SELECTORS}
    decode_points = []
    smallest = sorted(set(sizes))[:2]
    for n in sizes:
        fits = [d for d in densities
                if max_point_bytes is None or n in smallest or topk_point_bytes(n, d, world_size) <= max_point_bytes]
        for _ in range(len(densities) - len(fits)):
            on_point()
        if not fits:
            continue
        grad = torch.randn(n, generator=gen).to(device)
        residual = torch.zeros(n, device=device)
        out = torch.empty(n, device=device)
        for d in fits:
            k = topk_count(n, d)
            for selector in SELECTORS:
                call = partial(select_topk, grad, residual, k, selector=selector)
                samples = time_call(call, device, repeats=repeats, warmup=warmup, before=residual.zero_)
                select[selector].append((n, float(d), median(samples)))
            # Decode of what P ranks sent at this density: P*k values scattered into n zeroed elements.
            msgs = []
            for _ in range(world_size):
                values, idx = select_topk(torch.randn(n, generator=gen).to(device), None, k)
                msgs.append(pack(values, idx))
            gathered = torch.cat(msgs)
            samples = time_call(partial(decode, gathered, k, n, world_size, out=out), device,
                                repeats=repeats, warmup=warmup)
            decode_points.append((world_size * k, float(d), median(samples)))
            on_point()
    # `decode` (the affine fit older profiles carry alone) at the density nearest 1%; over every density
    # when small layers leave fewer than two distinct sizes there (k clamped to 1), constant for one.
    nearest = min({d for _, d, _ in decode_points}, key=lambda d: abs(math.log(d / 0.01)))
    points = _dedupe([(x, t) for x, d, t in decode_points if d == nearest])
    if len(points) < 2:
        points = _dedupe([(x, t) for x, _, t in decode_points])
    fitted = (fit_curve(points) if len(points) >= 2 and sum(t > 0 for _, t in points) >= 2
              else FittedCurve(points=tuple(points), alpha_s=max(t for _, t in points), beta_s_per_byte=0.0,
                               fit_error=0.0))
    return TopkTiming(select=tuple(select["exact"]), select_sampled=tuple(select["sampled"]),
                      decode=fitted, decode_points=tuple(decode_points))


def _dedupe(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    best: dict[int, float] = {}
    for x, t in points:
        best[x] = min(t, best.get(x, t))
    return sorted(best.items())
