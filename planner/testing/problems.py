"""Random but realistic instances of the solvers' problems, reproducible from a seed: what the tests check the
solvers on, and what `planner bench-solvers` times them on (`planner.sessions.solver_bench`).

- `random_problem`: gradient grouping (`GradientProblem`, either strategy), made up but shaped like real ones:
  layer sizes spread over four decades, backward time roughly proportional to size, collectives with a start-up
  cost between 50 us and 1 ms, and top-k selection that grows faster than linearly (N log N);
- `random_placement_problem`: K-FAC inversion placement; `random_layout_problem`: K-FAC layout (placement and
  preconditioning);
- `random_fusion_problem`: K-FAC factor fusion; `random_packing_problem`: factor packing.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from planner.costmodel.costs import AffineCost, PiecewiseLinearCost
from planner.costmodel.problem import GradientProblem, groups_of
from planner.solvers.fusion import FusionProblem
from planner.solvers.layout import LayoutProblem
from planner.solvers.packing import PackingProblem
from planner.solvers.placement import PlacementProblem
from planner.types import SolverError, Strategy

__all__ = ["random_fusion_problem", "random_layout_problem", "random_packing_problem", "random_placement_problem",
           "random_problem"]


def random_problem(
    num_layers: int,
    strategy: Strategy,
    *,
    seed: int,
    density: float = 0.01,
    world_size: int = 2,
    interference: float = 0.0,
    comm_stretch: float = 0.0,
) -> GradientProblem:
    """A random but realistic `GradientProblem` with `num_layers` layers, reproducible from `seed`.

    numel is log-uniform in [1e2, 3e6]; backward is ~1 ns per element with noise plus 10 us; the collective
    is alpha + beta * bytes with alpha in [50 us, 1 ms] and beta in [1e-10, 1e-9] s/byte (log-uniform);
    top-k selection is interpolated from 20 us + c * N log2 N (superlinear) with c in [0.02, 0.3] ns,
    decoding is affine. With `interference` > 0 the compute stream runs that much slower while a
    collective is in flight, and dense groups pay a packing cost (2 us + 0.7 ns per element), as a
    measured CPU profile has them. `comm_stretch`: collectives run that much slower while backward
    runs.
    """
    if num_layers < 1:
        raise SolverError(f"`num_layers >= 1` must hold, but got num_layers={num_layers}")
    rng = np.random.default_rng(seed)
    numel = np.round(np.exp(rng.uniform(math.log(1e2), math.log(3e6), num_layers))).astype(np.int64)
    noise = rng.lognormal(mean=0.0, sigma=0.3, size=num_layers)
    backward = 1e-9 * numel * noise + 10e-6
    comm = AffineCost(
        alpha=float(np.exp(rng.uniform(math.log(50e-6), math.log(1e-3)))),
        beta=float(np.exp(rng.uniform(math.log(1e-10), math.log(1e-9)))),
    )
    select = decode = None
    topk = strategy is Strategy.TOPK
    if topk:
        sizes = [float(2**e) for e in range(6, 31, 2)]
        per_op = float(np.exp(rng.uniform(math.log(0.02e-9), math.log(0.3e-9))))
        select = PiecewiseLinearCost(xs=tuple(sizes), ys=tuple(20e-6 + per_op * x * math.log2(x) for x in sizes))
        decode = AffineCost(alpha=5e-6, beta=0.5e-9)
    return GradientProblem(
        strategy=strategy,
        forward_s=0.5 * float(backward.sum()),
        update_s=2e-9 * float(numel.sum()) + 50e-6,
        backward_s=tuple(float(b) for b in backward),
        numel=tuple(int(n) for n in numel),
        comm=comm,
        world_size=world_size,
        density=density if topk else None,
        select=select,
        decode=decode,
        pack=AffineCost(alpha=2e-6, beta=0.7e-9) if interference > 0 and not topk else None,
        interference=interference,
        comm_stretch=comm_stretch,
    )


def random_placement_problem(n: int, world_size: int, seed: int) -> PlacementProblem:
    """A random but realistic `PlacementProblem` with `n` factors, reproducible from `seed`.

    Dimensions: 70% small (16..256), 30% large (512..4096), log-uniform. Inversion: c = (alpha + beta d^3)
    times 10% noise, alpha in [50 us, 500 us], beta in [2e-13, 2e-11] s (a fast GPU to a CPU). Broadcast:
    b = a (1 + log2 P) + bytes * beta_net with bytes = 4 d (d + 1) / 2 (the packed triangle), a in [10 us, 50 us]
    and a bandwidth in [1, 25] GB/s. Constants are drawn once per instance, log-uniform.
    """
    if n < 1 or world_size < 1:
        raise SolverError(f"`n >= 1 and world_size >= 1` must hold, but got (n={n}, world_size={world_size})")
    rng = np.random.default_rng(seed)

    def log_uniform(low: float, high: float, size: int | None = None) -> Any:
        return np.exp(rng.uniform(math.log(low), math.log(high), size))

    large = rng.random(n) < 0.3
    dims = np.where(large, np.round(log_uniform(512, 4096, n)), np.round(log_uniform(16, 256, n))).astype(np.int64)
    cubes = dims.astype(float) ** 3
    inv = (log_uniform(50e-6, 500e-6) + log_uniform(2e-13, 2e-11) * cubes) * rng.lognormal(0.0, 0.1, n)
    packed_bytes = 4.0 * dims * (dims + 1) / 2
    bcast = log_uniform(10e-6, 50e-6) * (1 + math.log2(world_size)) + packed_bytes / log_uniform(1e9, 25e9)
    return PlacementProblem(
        inv_s=tuple(float(v) for v in inv),
        bcast_s=tuple(float(v) for v in bcast),
        dims=tuple(int(d) for d in dims),
        world_size=world_size,
    )


def random_layout_problem(layers: int, world_size: int, seed: int, inv_update_steps: int = 5) -> LayoutProblem:
    """A random but realistic `LayoutProblem`, reproducible from `seed`: factor sizes and times as
    `random_placement_problem`, preconditioning p_l = 2 d_A d_G (d_A + d_G) flops at 1–50 GFLOP/s, and a
    gradient broadcast of 4 d_A d_G bytes at the instance's latency and bandwidth."""
    placement = random_placement_problem(2 * layers, world_size, seed)
    rng = np.random.default_rng(seed + 7919)
    dims = np.asarray(placement.dims, dtype=float).reshape(layers, 2)
    flops = 2.0 * dims[:, 0] * dims[:, 1] * dims.sum(axis=1)
    pre = flops / np.exp(rng.uniform(np.log(1e9), np.log(50e9))) * rng.lognormal(0.0, 0.1, layers)
    latency = np.exp(rng.uniform(np.log(10e-6), np.log(50e-6)))
    bandwidth = np.exp(rng.uniform(np.log(1e9), np.log(25e9)))
    grad = latency * (1 + np.log2(max(world_size, 1))) + 4.0 * dims[:, 0] * dims[:, 1] / bandwidth
    return LayoutProblem(placement=placement, precondition_s=tuple(float(v) for v in pre),
                         grad_bcast_s=tuple(float(v) for v in grad), inv_update_steps=inv_update_steps)


def random_fusion_problem(n_layers: int, seed: int, *, n_grads: int | None = None) -> FusionProblem:
    """A random but plausible `FusionProblem` of `n_layers` layers, reproducible from `seed`.

    Factor dimensions are log-uniform in [16, 4608] (A, inputs * kernel) and [16, 4096] (G, outputs), sent
    as float32 upper triangles; each layer's forward (and A factor) and backward (and G factor) take time
    proportional to its weights and factors at a per-instance speed, so that compute-bound and
    communication-bound instances both occur. The gradients form `n_grads` contiguous groups in backward
    order (default n_layers // 5, at least 1), each ready when its last layer's weight gradient is. The
    allreduce is alpha + beta * bytes, alpha in [20 us, 1 ms] and beta in [1e-10, 1e-9] s/byte.
    """
    if n_layers < 1:
        raise SolverError(f"`n_layers >= 1` must hold, but got n_layers={n_layers}")
    n_grads = max(1, n_layers // 5) if n_grads is None else n_grads
    if not 0 <= n_grads <= n_layers:
        raise SolverError(f"`0 <= n_grads <= n_layers` must hold, but got (n_grads={n_grads}, n_layers={n_layers})")
    rng = np.random.default_rng(seed)

    def log_uniform(low: float, high: float, size: int | None = None) -> np.ndarray:
        return np.exp(rng.uniform(math.log(low), math.log(high), size))

    a_dim = np.round(log_uniform(16, 4608, n_layers)).astype(np.int64)
    g_dim = np.round(log_uniform(16, 4096, n_layers)).astype(np.int64)
    weights = a_dim * g_dim
    speed = float(log_uniform(1e-10, 1e-8))  # seconds per weight (forward) or per factor entry
    forward = speed * weights * rng.lognormal(0.0, 0.3, n_layers) + 10e-6
    a_factor = speed * a_dim.astype(float) ** 2
    backward = 2 * speed * weights * rng.lognormal(0.0, 0.3, n_layers) + 10e-6
    g_factor = speed * g_dim.astype(float) ** 2
    a_ready = np.cumsum(forward + a_factor)
    # Backward runs the layers in reverse; a layer's weight gradient is ready before its G factor.
    g_ready = a_ready[-1] + np.cumsum((backward + g_factor)[::-1])
    grad_ready_of_layer = g_ready - g_factor[::-1]
    grad_ends: list[int] = []
    if n_grads:
        cuts = rng.choice(np.arange(1, n_layers), size=n_grads - 1, replace=False)
        grad_ends = [*sorted(int(c) for c in cuts), n_layers]
    grad_numel = [int(weights[::-1][r].sum()) for r in groups_of(tuple(grad_ends))] if grad_ends else []
    allreduce = AffineCost(alpha=float(log_uniform(20e-6, 1e-3)), beta=float(log_uniform(1e-10, 1e-9)))
    return FusionProblem(
        a_ready_s=tuple(float(t) for t in a_ready),
        a_bytes=tuple(int(2 * d * (d + 1)) for d in a_dim),  # 4 bytes * d (d + 1) / 2
        g_ready_s=tuple(float(t) for t in g_ready),
        g_bytes=tuple(int(2 * d * (d + 1)) for d in g_dim[::-1]),
        grad_ready_s=tuple(float(grad_ready_of_layer[e - 1]) for e in grad_ends),
        grad_bytes=tuple(4 * n for n in grad_numel),
        allreduce=allreduce,
        a_names=tuple(f"layer{i}.A" for i in range(n_layers)),
        g_names=tuple(f"layer{i}.G" for i in reversed(range(n_layers))),
    )


def random_packing_problem(n_a: int, n_g: int, seed: int, *, n_grads: int = 2) -> PackingProblem:
    """A random instance where packing and bytes trade off: whole messages twice the bytes of triangles,
    triangle packing and folding costlier than whole, at per-instance speeds (so either format can win)."""
    rng = np.random.default_rng(seed)
    dims = np.exp(rng.uniform(math.log(16), math.log(2048), n_a + n_g))
    tri = np.round(4 * dims * (dims + 1) / 2).astype(np.int64)
    whole = np.round(4 * dims * dims).astype(np.int64)
    per_value = float(np.exp(rng.uniform(math.log(1e-10), math.log(1e-8))))
    sizes = list(zip(tri, whole, strict=True))
    pack = [(per_value * t * rng.uniform(1, 8), per_value * w * rng.uniform(0.05, 0.5)) for t, w in sizes]
    fold = [(per_value * t * rng.uniform(1, 8), per_value * w * rng.uniform(0.1, 1)) for t, w in sizes]
    compute = np.cumsum(rng.exponential(1e-3, n_a + n_g + n_grads))
    a_ready = compute[:n_a]
    rest = compute[n_a:]  # G factors and gradient collectives, interleaved at random
    is_grad = np.zeros(n_g + n_grads, dtype=bool)
    is_grad[rng.choice(n_g + n_grads, size=n_grads, replace=False)] = True
    g_ready = rest[~is_grad]
    grad_ready = rest[is_grad]
    grad_after = [int((~is_grad[:p]).sum()) for p in np.flatnonzero(is_grad)]
    allreduce = AffineCost(alpha=float(np.exp(rng.uniform(math.log(20e-6), math.log(1e-3)))),
                           beta=float(np.exp(rng.uniform(math.log(1e-10), math.log(1e-8)))))
    return PackingProblem(
        a_ready_s=tuple(a_ready), g_ready_s=tuple(g_ready),
        a_bytes=tuple(zip(tri[:n_a], whole[:n_a], strict=True)),
        g_bytes=tuple(zip(tri[n_a:], whole[n_a:], strict=True)),
        a_pack_s=tuple(pack[:n_a]), g_pack_s=tuple(pack[n_a:]),
        a_fold_s=tuple(fold[:n_a]), g_fold_s=tuple(fold[n_a:]),
        grad_ready_s=tuple(grad_ready),
        grad_bytes=tuple(int(x) for x in rng.integers(1_000, 10_000_000, n_grads)),
        grad_after_g=tuple(grad_after),
        compute_end_s=float(compute[-1] + rng.exponential(1e-3)),
        allreduce=allreduce,
    )
