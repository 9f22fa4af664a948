"""K-FAC costs on this device: per-layer factor and preconditioning work, inversion time against dimension.

Times the kernels the runtime runs (planner.kernels.kfac_factors), on the layer inputs and output gradients of one real
training step, so the profile measures what the preconditioner does.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from planner.contracts.kfac_section import KFACLayerSpec, kfac_layers, kfac_left_out
from planner.contracts.profile import DimCurve, KFACLayerTiming, KFACTiming
from planner.costmodel.curves import fit_dim_curve
from planner.kernels.kfac_factors import (
    covariance,
    decompose,
    fold_factor,
    input_covariance,
    output_grad_rows,
    precondition_eigen,
    precondition_inverse,
    symmetric_from_triangle,
)
from planner.models import Workload
from planner.platform.timing import median, time_call
from planner.types import ROOT_NAME, InvalidProfileError, InverseMethod, PlannerError

__all__ = ["DEFAULT_MAX_DIM", "KFAC_CHECK_BATCHES", "check_kfac_layers", "inversion_dims", "measure_inversion",
           "measure_kfac_layers"]

#: Largest matrix the inversion sweep measures by default; larger factors are extrapolated as d^3.
DEFAULT_MAX_DIM = 2048
_DAMPING = 1e-3


#: Batches (seeds 0..N-1) the K-FAC check before any worker starts runs the model on. Which layers run can
#: change from batch to batch (a mixture of experts routes each batch to some experts), and a layer left out of any
#: step has no factors in it, so a layer that does not run in one of them is refused as one that never runs.
KFAC_CHECK_BATCHES = 4


def check_kfac_layers(workload: Workload, skip: str | None = None, *, batches: int = KFAC_CHECK_BATCHES) -> None:
    """Refuse, in one line naming every such layer, K-FAC layers (but those matching `skip`) that run more than
    once in a training step or not at all in one: one training step (forward and backward, as the runtime runs
    them) on batch 0 and the forward pass (with the loss) on the next `batches - 1`, on a copy of the module on
    the CPU. `planner profile --kfac` runs it before any worker starts; the `--kfac-skip` it suggests (with
    `skip`) leaves all of them out, so one rerun passes."""
    if batches < 1:
        raise ValueError(f"`batches >= 1` must hold, but got batches={batches}")
    module = copy.deepcopy(workload.module).cpu()  # the user's module keeps its gradients and statistics
    names = [s.name for s in kfac_layers(module, skip)]
    if not names:
        raise InvalidProfileError(f"model {workload.name} has no Linear or Conv2d layers for K-FAC to precondition")
    steps: list[dict[str, int]] = []
    for seed in range(batches):
        calls: dict[str, int] = {}
        hooks = _count_calls(module, set(names), calls)
        try:
            x, y = workload.batch(seed)
            loss = workload.loss_fn(module(x), y)
            if seed == 0:  # a backward that runs the forward again (checkpointing) shows on any batch: once is enough
                loss.backward()
        except Exception as exc:
            raise PlannerError(f"model {workload.name}: the K-FAC check's step on batch {seed} (on the CPU) raised "
                               f"{type(exc).__name__}: {exc}") from exc
        finally:
            for h in hooks:
                h.remove()
        module.zero_grad(set_to_none=True)
        steps.append(calls)
    _refuse(names, steps, skip)


def _count_calls(module: nn.Module, names: set[str], calls: dict[str, int]) -> list[Any]:
    """Forward hooks counting, in `calls`, how many times each layer named in `names` runs; returns the handles."""

    def count(name: str, *_: object) -> None:
        calls[name] = calls.get(name, 0) + 1

    return [mod.register_forward_hook(partial(count, name or ROOT_NAME))
            for name, mod in module.named_modules() if (name or ROOT_NAME) in names]


def _refuse(names: list[str], steps: list[dict[str, int]], skip: str | None) -> None:
    """Raise if a layer of `names` ran more than once in one of `steps` (calls per layer in each training step) or
    not at all in one; the message names every such layer and one --kfac-skip pattern leaving all of them out."""
    times = {n: max(calls.get(n, 0) for calls in steps) for n in names}
    reused = [n for n in names if times[n] > 1]
    unused = [n for n in names if any(calls.get(n, 0) == 0 for calls in steps)]
    if not reused and not unused:
        return
    parts = []
    if reused:  # the runtime refuses a factor computed twice in a step: say so now, not after the plan is made
        most = max(times[n] for n in reused)
        count = f"{most}" if all(times[n] == most for n in reused) else f"up to {most}"
        parts.append(f"K-FAC layers {reused} run {count} times in one training step (a shared layer, or a "
                     "recomputed forward), and K-FAC takes one input per layer and step")
    if unused:
        where = "the forward pass" if len(steps) == 1 else \
            f"the forward pass of at least one of {len(steps)} trial steps (batches 0-{len(steps) - 1})"
        parts.append(f"K-FAC layers {unused} did not run in {where} (their factors would be missing there)")
    left_out = [n for n in names if n in set(reused) | set(unused)]
    ours = f"^{re.escape(left_out[0])}$" if len(left_out) == 1 else \
        "^(?:" + "|".join(re.escape(n) for n in left_out) + ")$"
    pattern = f"{skip}|{ours}" if skip else ours
    raise InvalidProfileError("; ".join(parts) + f"; skip them: profile with --kfac-skip '{pattern}' and pass "
                                                 f"skip_layers='{pattern}' to KFACPreconditioner")


def _capture(workload: Workload, device: torch.device, skip: str | None = None
             ) -> tuple[list[str], dict[str, Tensor], dict[str, Tensor]]:
    """Run one training step; return the K-FAC layers (but those matching `skip`) in execution order, their
    inputs and output gradients. Refuses layers that run twice or not at all in it (`check_kfac_layers` looks at
    more batches, before any worker starts)."""
    module = workload.module.to(device)
    specs = kfac_layers(module, skip)
    names = {s.name for s in specs}
    if not names:
        raise InvalidProfileError(f"model {workload.name} has no Linear or Conv2d layers for K-FAC to precondition")
    order: list[str] = []
    inputs: dict[str, Tensor] = {}
    grads: dict[str, Tensor] = {}
    calls: dict[str, int] = {}

    def forward_hook(name: str, _mod: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        calls[name] = calls.get(name, 0) + 1
        if name in inputs or not args or not isinstance(args[0], Tensor):
            return
        order.append(name)
        inputs[name] = args[0].detach()
        if isinstance(output, Tensor) and output.requires_grad:
            output.register_hook(lambda g: grads.setdefault(name, g.detach()))

    hooks = [
        mod.register_forward_hook(partial(forward_hook, name or ROOT_NAME))
        for name, mod in module.named_modules()
        if (name or ROOT_NAME) in names
    ]
    try:
        x, y = workload.batch(0)
        workload.loss(x.to(device), y.to(device)).backward()
    finally:
        for h in hooks:
            h.remove()
    ran = {n: calls[n] for n in order}  # a layer called on no tensor gives K-FAC no input: it did not run
    _refuse([s.name for s in specs], [ran], skip)
    module.zero_grad(set_to_none=True)
    return order, inputs, grads


def measure_kfac_layers(
    workload: Workload,
    device: torch.device,
    *,
    repeats: int,
    warmup: int,
    skip: str | None = None,
    on_layer: Callable[[], object] = lambda: None,
) -> list[KFACLayerTiming]:
    """Median seconds of each layer's A and G computation (with packing) and of preconditioning its gradient
    (of the K-FAC layers but those matching `skip`)."""
    order, inputs, grads = _capture(workload, device, skip)
    specs = {s.name: s for s in kfac_layers(workload.module, skip)}
    modules = {name or ROOT_NAME: mod for name, mod in workload.module.named_modules()}
    gen = torch.Generator(device="cpu").manual_seed(0)
    out = []
    for name in order:
        work = _LayerWork(specs[name], modules[name], inputs[name], grads[name], device, gen)
        fns = (work.a_factor, work.g_factor, work.fold, work.precondition_eigen, work.precondition_inverse,
               work.fold_whole, work.pack_a, work.pack_a_whole, work.pack_g, work.pack_g_whole)
        timed = [median(time_call(fn, device, repeats=repeats, warmup=warmup)) for fn in fns]
        # Computing a factor takes far longer (and varies more) than packing it, so the whole-matrix times are the
        # triangle times with the packing swapped: the difference between the formats is measured, not noise.
        a_whole = max(0.0, timed[0] - timed[6] + timed[7])
        g_whole = max(0.0, timed[1] - timed[8] + timed[9])
        out.append(KFACLayerTiming(name=name, a_dim=work.spec.a_dim, g_dim=work.spec.g_dim, a_compute_s=timed[0],
                                   g_compute_s=timed[1], fold_s=timed[2], precondition_eigen_s=timed[3],
                                   precondition_inverse_s=timed[4], a_compute_whole_s=a_whole,
                                   g_compute_whole_s=g_whole, fold_whole_s=timed[5]))
        on_layer()
    return out


class _LayerWork:
    """The runtime's per-layer K-FAC work on one layer's captured input and output gradient."""

    def __init__(self, spec: KFACLayerSpec, module: nn.Module, x: Tensor, grad: Tensor, device: torch.device,
                 gen: torch.Generator) -> None:
        self.spec, self.module, self.x, self.grad = spec, module, x, grad
        self.a_index = torch.triu_indices(spec.a_dim, spec.a_dim, device=device)
        self.g_index = torch.triu_indices(spec.g_dim, spec.g_dim, device=device)
        self.running = (torch.zeros(spec.a_dim, spec.a_dim, device=device),
                        torch.zeros(spec.g_dim, spec.g_dim, device=device))
        self.packed = (self.a_factor(), self.g_factor())
        self.whole = (torch.empty(spec.a_dim * spec.a_dim, device=device),
                      torch.empty(spec.g_dim * spec.g_dim, device=device))

        def rand(*shape: int) -> Tensor:
            return torch.rand(*shape, generator=gen).to(device)

        self.eigen = (rand(spec.a_dim, spec.a_dim), rand(spec.a_dim), rand(spec.g_dim, spec.g_dim), rand(spec.g_dim))
        self.gmat = rand(spec.g_dim, spec.a_dim)

    def a_factor(self) -> Tensor:
        """A from the layer input, packed as its upper triangle (what the forward hook does)."""
        rows, cols = self.a_index
        return input_covariance(self.module, self.x, torch.float32)[rows, cols]

    def g_factor(self) -> Tensor:
        """G from the output gradient, packed (what the output's tensor hook does)."""
        rows, cols = self.g_index
        return covariance(output_grad_rows(self.module, self.grad, torch.float32))[rows, cols]

    def fold(self) -> None:
        """Unpack both averaged factors and fold them into their running averages (in `step()`)."""
        for flat, run, (rows, cols) in zip(self.packed, self.running, (self.a_index, self.g_index), strict=True):
            fold_factor(run, symmetric_from_triangle(flat, rows, cols, torch.empty_like(run)), 0.95)

    def pack_a(self) -> None:
        """Put a computed A into its buffer as its upper triangle (the packing part of `a_factor`)."""
        rows, cols = self.a_index
        self.packed[0].copy_(self.running[0][rows, cols])

    def pack_a_whole(self) -> None:
        """Put a computed A into its buffer whole (what the forward hook does when factors travel whole)."""
        self.whole[0].copy_(self.running[0].reshape(-1))

    def pack_g(self) -> None:
        rows, cols = self.g_index
        self.packed[1].copy_(self.running[1][rows, cols])

    def pack_g_whole(self) -> None:
        self.whole[1].copy_(self.running[1].reshape(-1))

    def fold_whole(self) -> None:
        """Fold both whole factors (views of their buffers) into their running averages."""
        for flat, run in zip(self.whole, self.running, strict=True):
            fold_factor(run, flat.view_as(run), 0.95)

    def precondition_eigen(self) -> Tensor:
        """Precondition the layer's gradient matrix with eigendecompositions (every step)."""
        qa, ea, qg, eg = self.eigen
        return precondition_eigen(self.gmat, qa, ea, qg, eg, _DAMPING)

    def precondition_inverse(self) -> Tensor:
        """Precondition the layer's gradient matrix with inverses (every step)."""
        return precondition_inverse(self.gmat, self.eigen[0], self.eigen[2])


def inversion_dims(dims: Sequence[int], *, max_dim: int = DEFAULT_MAX_DIM, points: int = 10) -> list[int]:
    """Dimensions to measure: the model's own factor sizes when there are few, else a geometric sweep over
    their range; capped at `max_dim`, and at least two."""
    distinct = sorted({min(d, max_dim) for d in dims})
    if len(distinct) > points:
        lo, hi = distinct[0], distinct[-1]
        distinct = sorted({round(lo * (hi / lo) ** (i / (points - 1))) for i in range(points)})
    if len(distinct) < 2:
        distinct = sorted({max(2, distinct[0] // 4), distinct[0]})
    return distinct


def measure_inversion(
    dims: Sequence[int],
    method: InverseMethod,
    device: torch.device,
    *,
    repeats: int,
    warmup: int,
    on_point: Callable[[], object] = lambda: None,
) -> DimCurve:
    """Median seconds of the runtime's `decompose` (eigh or damped inverse) of a d x d SPD matrix, per d."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    points = []
    for d in dims:
        x = torch.randn(d, 2 * d, generator=gen)
        matrix = (x @ x.T / (2 * d)).to(device)
        out = torch.empty(d * d + d if method is InverseMethod.EIGEN else d * (d + 1) // 2, device=device)
        # Large matrices take long: fewer repetitions, still a median of three (one sample of a 1024-wide
        # eigendecomposition came out 25% above the next at 1025 in a profile, and the fit followed it).
        reps = repeats if d < 1024 else max(3, math.ceil(repeats / 3))
        samples = time_call(partial(decompose, matrix, method, _DAMPING, out), device, repeats=reps,
                            warmup=min(warmup, 1))
        points.append((d, median(samples)))
        on_point()
    return fit_dim_curve(points)


def measure_kfac(
    workload: Workload,
    device: torch.device,
    *,
    repeats: int,
    warmup: int,
    max_dim: int = DEFAULT_MAX_DIM,
    skip: str | None = None,
    on_point: Callable[[], object] = lambda: None,
) -> KFACTiming:
    """Everything a K-FAC plan needs from this device (layers matching the regular expression `skip` left out,
    as `KFACPreconditioner(skip_layers=...)` leaves them)."""
    layers = measure_kfac_layers(workload, device, repeats=repeats, warmup=warmup, skip=skip, on_layer=on_point)
    dims = inversion_dims([d for lt in layers for d in (lt.a_dim, lt.g_dim)], max_dim=max_dim)
    curves = {
        m: measure_inversion(dims, m, device, repeats=max(3, repeats // 2), warmup=1, on_point=on_point)
        for m in InverseMethod
    }
    return KFACTiming(layers=tuple(layers), inverse=curves[InverseMethod.INVERSE], eigen=curves[InverseMethod.EIGEN],
                      left_out=tuple(kfac_left_out(workload.module, skip)), skip=skip)


def kfac_points(workload: Workload, max_dim: int = DEFAULT_MAX_DIM, skip: str | None = None) -> int:
    """How many progress steps `measure_kfac` takes (layers, then inversion points of both methods)."""
    specs = kfac_layers(workload.module, skip)
    dims = inversion_dims([d for s in specs for d in (s.a_dim, s.g_dim)], max_dim=max_dim)
    return len(specs) + 2 * len(dims)
