"""Synthetic but valid profiles and plans for tests that must not measure anything."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from planner.contracts.abs_section import ABSSection, VariantPrediction
from planner.contracts.fingerprint import ClusterInfo, model_info
from planner.contracts.kfac_section import KFACSection, kfac_layers
from planner.contracts.layers import gradient_layers
from planner.contracts.plan import Group, Plan, Prediction
from planner.contracts.profile import (
    CompressTiming,
    FittedCurve,
    KFACLayerTiming,
    KFACTiming,
    LayerTiming,
    PowerSGDLayerTiming,
    Profile,
    TopkTiming,
)
from planner.costmodel.curves import fit_curve, fit_dim_curve
from planner.models import build_workload
from planner.strategies.gradients import make_plan
from planner.types import Collective, Strategy


def synthetic_profile(model: str = "mlp", world_size: int = 2, module: nn.Module | None = None) -> Profile:
    """A profile of a built-in model (or of `module`, named `model`) with made-up, plausible times (layers ready in
    reverse order)."""
    wl = build_workload(model) if module is None else None
    module = module if wl is None else wl.module
    layers = []
    for spec in reversed(gradient_layers(module)):
        layers.append(
            LayerTiming(name=spec.name, params=spec.params, numel=spec.numel, forward_s=1e-4 + spec.numel * 1e-9,
                        backward_s=2e-4 + spec.numel * 2e-9, backward_iqr_s=1e-5)
        )
    sizes = [1 << s for s in range(10, 27, 2)]

    def curve(alpha: float, beta: float) -> FittedCurve:
        return fit_curve([(s, alpha + beta * s) for s in sizes])

    numels = [1 << s for s in range(10, 23, 2)]
    select = tuple((n, d, 5e-5 + n * 4e-9 * (1 + d)) for n in numels for d in (0.001, 0.01, 0.1, 1.0))
    decode = fit_curve([(n // 50, 2e-5 + n * 1e-10) for n in numels])
    return Profile(
        model=model_info(module, model),
        cluster=ClusterInfo(world_size=world_size, backend="gloo", device="cpu (synthetic)"),
        created="2026-01-01T00:00:00+00:00",
        torch_version="2.13.0",
        batch_size=8 if wl is None else wl.batch_size,
        forward_s=sum(lt.forward_s for lt in layers),
        backward_s=sum(lt.backward_s for lt in layers),
        update_s=1e-3,
        layers=tuple(layers),
        collectives={
            Collective.ALLREDUCE: curve(2e-4, 2e-9),
            Collective.ALLGATHER: curve(2e-4, 2e-9),
            Collective.BROADCAST: curve(1e-4, 1e-9),
        },
        topk=TopkTiming(select=select, decode=decode),
        kfac=synthetic_kfac_timing(module),
        compress=synthetic_compress_timing(module, [lt.name for lt in layers]),
    )


def synthetic_compress_timing(module: nn.Module, ready_order: list[str], ranks: tuple[int, ...] = (1, 2, 4)
                              ) -> CompressTiming:
    """Made-up fp16 and PowerSGD costs: casts 0.3 ns per element; PowerSGD's steps 20 us per tensor plus
    1 ns per element and rank (its matmuls), the decompression the same."""
    params = dict(module.named_parameters())
    specs = {s.name: s for s in gradient_layers(module)}
    numels = [1 << s for s in range(10, 25, 2)]
    rows = []
    for name in ready_order:
        shapes = tuple(tuple(params[p].shape) for p in specs[name].params)
        numel = specs[name].numel
        for r in ranks:
            work = 2e-5 * len(shapes) + numel * r * 1e-9
            rows.append(PowerSGDLayerTiming(layer=name, rank=r, shapes=shapes, compress_s=work, middle_s=work,
                                            decompress_s=work))
    return CompressTiming(fp16_cast=fit_curve([(n, 5e-6 + n * 3e-10) for n in numels]),
                          fp16_uncast=fit_curve([(n, 5e-6 + n * 3e-10) for n in numels]),
                          powersgd=tuple(rows))


def synthetic_kfac_timing(module: object) -> KFACTiming:
    """Made-up K-FAC costs: factor work in proportion to d^2 (packing and unpacking whole matrices cheaper than
    triangles), inversion 1 ms + d^3 * 2e-10 s, eigen 3x that."""
    layers = tuple(
        KFACLayerTiming(name=s.name, a_dim=s.a_dim, g_dim=s.g_dim, a_compute_s=1e-5 + s.a_dim**2 * 1e-9,
                        g_compute_s=1e-5 + s.g_dim**2 * 1e-9, fold_s=(s.a_dim**2 + s.g_dim**2) * 1e-9,
                        precondition_eigen_s=2e-5 + s.a_dim * s.g_dim * 2e-9,
                        precondition_inverse_s=1e-5 + s.a_dim * s.g_dim * 1e-9,
                        a_compute_whole_s=1e-5 + s.a_dim**2 * 0.8e-9, g_compute_whole_s=1e-5 + s.g_dim**2 * 0.8e-9,
                        fold_whole_s=(s.a_dim**2 + s.g_dim**2) * 0.4e-9)
        for s in kfac_layers(module)  # type: ignore[arg-type]
    )
    dims = [16, 64, 256, 1024, 2048]
    return KFACTiming(
        layers=layers,
        inverse=fit_dim_curve([(d, 1e-3 + d**3 * 2e-10) for d in dims]),
        eigen=fit_dim_curve([(d, 3e-3 + d**3 * 6e-10) for d in dims]),
    )


def synthetic_kfac_plan(model: str = "mlp", world_size: int = 2, **kwargs: object) -> Plan:
    from planner.strategies.kfac_plan import make_kfac_plan

    return make_kfac_plan(synthetic_profile(model, world_size), source="synthetic", **kwargs)  # type: ignore[arg-type]


def synthetic_plan(model: str = "mlp", world_size: int = 2, strategy: Strategy = Strategy.DENSE,
                   density: float | None = None) -> Plan:
    return make_plan(synthetic_profile(model, world_size), strategy, density, source="synthetic")


def plan_with_groups(
    model: nn.Module,
    groups: tuple[Group, ...],
    strategy: Strategy = Strategy.DENSE,
    density: float | None = None,
    *,
    world_size: int = 2,
    name: str = "tiny",
    kfac: KFACSection | None = None,
    counts_from_groups: bool = False,
    abs_section: ABSSection | None = None,
    host_count: int = 1,
) -> Plan:
    """A plan with dummy predictions for `model` (named `name`) made of `groups` (and a K-FAC section), for
    `world_size` workers on `host_count` hosts.

    `counts_from_groups`: the plan's model holds the groups' parameters (a plan must hold its model's
    parameters exactly) under `model`'s fingerprint: a plan made for a model that differs from `model` only
    in what the fingerprint does not see, to test the runtime's own checks."""
    dummy = Prediction(iteration_s=1.0, compute_s=1.0, exposed_comm_s=0, comm_s=0)  # a plan file needs a step > 0
    info = model_info(model, name)
    if counts_from_groups:
        info = replace(info, num_params=sum(len(g.params) for g in groups), numel=sum(g.numel for g in groups))
    return Plan(
        strategy=strategy,
        density=density,
        model=info,
        cluster=ClusterInfo(world_size=world_size, backend="gloo", device="cpu", host_count=host_count),
        groups=groups,
        predicted=dummy,
        baselines={},
        lower_bound_s=0.0,
        solver="test",
        solve_seconds=0.0,
        source_profile="test",
        profiled="test",
        created="test",
        kfac=kfac,
        abs=abs_section,
    )


def abs_section(world_size: int = 2, *, min_micro_batches: int = 1, max_micro_batches: int | None = None,
                micro_batch: int = 8, global_batch: int = 64) -> ABSSection:
    """An ABS-SGD section with the given trigger and dummy predictions."""
    dummy = VariantPrediction(round_s=1.0, samples=(1.0,) * world_size, idle_s=(0.0,) * world_size)
    return ABSSection(global_batch=global_batch, micro_batch=micro_batch, min_micro_batches=min_micro_batches,
                      max_micro_batches=max_micro_batches,
                      predicted={"abs-sgd": dummy, "sync-equal": dummy, "sync-proportional": dummy})


def with_samples(profile: Profile, *, spread: float = 0.05, steps: int = 20, runs: int = 7, seed: int = 0) -> Profile:
    """`profile` with the samples a measured one keeps, drawn around its numbers (relative noise `spread`): `steps`
    steps of the layer phase (F, b_i, U and the whole step, each step's noise shared by all of its parts, as a
    busy spell slows a whole step), and `runs` runs at each collective point. The medians and means of the samples
    become the profile's numbers, as `planner profile` takes them."""
    import numpy as np

    from planner.contracts.profile import StepSamples

    rng = np.random.default_rng(seed)
    slow = 1 + spread * np.abs(rng.standard_normal(steps))  # per step: the whole step and its parts together

    def jitter(value: float, size: int) -> np.ndarray:
        return value * (1 + spread * 0.2 * rng.standard_normal(size))

    backward = np.array([[lt.backward_s for lt in profile.layers]] * steps) * slow[:, None]
    samples = StepSamples(
        whole_s=tuple(jitter(profile.forward_s + profile.backward_s + profile.update_s, steps) * slow),
        forward_s=tuple(jitter(profile.forward_s, steps) * slow),
        update_s=tuple(jitter(profile.update_s, steps) * slow),
        backward_s=tuple(tuple(float(b) for b in row) for row in backward))
    fwd, upd, b, whole = samples.scaled_parts()
    layers = tuple(replace(lt, backward_s=bi) for lt, bi in zip(profile.layers, b, strict=True))

    def curve(c: FittedCurve) -> FittedCurve:
        runs_of = [tuple(np.abs(t * (1 + spread * rng.standard_normal(runs)))) for _, t in c.points]
        return fit_curve([(n, float(np.mean(r))) for (n, _), r in zip(c.points, runs_of, strict=True)], runs_of)

    return replace(profile, steps=samples, forward_s=fwd, update_s=upd, layers=layers, step_s=whole,
                   backward_s=sum(b), collectives={k: curve(c) for k, c in profile.collectives.items()})


#: `make test-thorough` (PLANNER_TESTS=thorough) runs every property test on this many times its examples.
THOROUGH_FACTOR = 10


def examples(count: int) -> int:
    """A property test's example count: `count` in the suite (`make test`), THOROUGH_FACTOR times it in a
    deliberate run (`make test-thorough`)."""
    import os

    return count * THOROUGH_FACTOR if os.environ.get("PLANNER_TESTS") == "thorough" else count
