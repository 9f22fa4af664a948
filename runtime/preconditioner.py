"""K-FAC preconditioning that communicates as a plan's `kfac` section says.

    precond = KFACPreconditioner(model, plan=plan, lr=lambda: sched.get_last_lr()[0])   # or plan=None
    for x, y in loader:
        loss_fn(model(x), y).backward()     # the loss is a mean over the local batch
        precond.step()                      # average gradients, update factors and inverses, precondition
        optimizer.step()
        optimizer.zero_grad()

Design (as `GradientExchange`, see runtime/exchange.py):

- Factors. On a factor step (every `factor_update_steps` calls of `step()`, in training mode with grad
  enabled) a forward hook computes each layer's A = aᵀa / rows from its input, and a tensor hook on the
  layer's output computes G = gᵀg / rows from the output's gradient as autograd gives it (kfac-pytorch's
  convention, see planner/kernels/kfac_factors.py: with a mean loss, G carries 1/B² for a local batch of B, so
  it depends on the per-worker batch as kfac-pytorch's does). A tensor hook on the output, unlike a full
  backward hook, still sees the gradient of the layer's output when an in-place op (ReLU(inplace=True))
  follows. Each factor is packed as its
  upper triangle into its planned flat buffer; a complete buffer is allreduced asynchronously, buffers
  strictly in plan order (A buffers, then G buffers): one finished early waits until every earlier one
  is launched, so all ranks issue the same collectives in the same order. `step()` launches what is
  left (a factor that was not computed on this rank counts as zeros), waits, and updates the running
  averages.
- Inverses. On an inversion step each factor's eigendecomposition (or damped inverse) is computed by
  its owner and broadcast, or computed by every rank when the plan says "all". Owners' broadcasts are
  issued first, then the replicated factors are inverted while they travel. A factor whose layer its
  owner preconditions (`section.preconditioners`) is inverted by the owner alone and never sent.
- Preconditioning (every step): each layer's gradient [W | b] becomes G⁻¹ [W | b] A⁻¹ (damped). A layer
  with a preconditioner rank is preconditioned there and broadcast (others receive it), in layer order,
  each broadcast posted as soon as it is computed; then every rank preconditions the layers left to
  everyone while those travel. All are then scaled by KL clipping, in place in `.grad`.

Limits: one training forward and backward per `step()` (a layer whose factor is computed twice, as
with gradient accumulation, shared layers or activation checkpointing, is refused). Ranks must run the
same graph every step (as with DDP): the factor collectives interleave with the gradient collectives
launched from hooks, and both must come in the same order on every rank.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import threading
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, SupportsFloat

import torch
import torch.distributed as dist
from torch import Tensor, nn

from planner.contracts.kfac_section import KFACLayerSpec, KFACSection, factor_name, kfac_layers, kfac_left_out
from planner.contracts.plan import Plan
from planner.kernels.kfac_factors import (
    covariance,
    decompose,
    factor_dtype,
    fold_factor,
    input_covariance,
    output_grad_rows,
    precondition_eigen,
    precondition_inverse,
    symmetric_from_triangle,
)
from planner.runtime.attach import resolve_plan
from planner.runtime.exchange import GradientExchange
from planner.types import ROOT_NAME, DistributedError, FactorKind, InverseMethod, PlanMismatchError

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

__all__ = ["KFACPreconditioner"]

STATE_KIND = "runtime.kfac_preconditioner"

#: Without a plan, a factor at least this wide draws a warning: its O(d^3) inversion can dominate the step.
LARGE_FACTOR_DIM = 2048


def _warn_about_large_factors(section: KFACSection) -> None:
    """Warn, once per preconditioner made without a plan, about factors whose inversion may look like a hang."""
    large = [(factor_name(lt.name, kind), lt.dim(kind)) for lt in section.layers for kind in FactorKind
             if lt.dim(kind) >= LARGE_FACTOR_DIM]
    if not large:
        return
    listed = ", ".join(f"{name} ({d}x{d})" for name, d in large[:4]) + (" ..." if len(large) > 4 else "")
    warnings.warn(
        f"K-FAC will {section.method.value}-invert {listed} every {section.inv_update_steps} step(s), on every "
        "rank: inverting a d x d factor costs O(d^3) (6 steps with one 5000-wide factor took 484 s on a 2-core CPU), "
        "so steps may look hung. Leave such layers to plain gradients with skip_layers=REGEX, invert less often "
        "(inv_update_steps=), or plan the inversions (`planner profile --kfac`, `planner solve --strategy kfac`) "
        "to spread them over ranks",
        RuntimeWarning,
        stacklevel=3,
    )


def _world_size_and_rank(process_group: Any) -> tuple[int, int]:
    """(size, this rank) of `process_group`, of the default group if None, or (1, 0) without torch.distributed."""
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(process_group), dist.get_rank(process_group)


class _Factor:
    """One Kronecker factor: its running average, its slot in a fusion buffer, and its inverse.

    It travels (and a damped inverse with it) as its upper triangle, or whole (d^2 values) with `whole`."""

    __slots__ = (
        "cols",
        "dim",
        "evals",
        "inv",
        "inv_flat",
        "kind",
        "name",
        "owner",
        "q",
        "ready",
        "rows",
        "running",
        "view",
        "whole",
    )

    def __init__(
        self, name: str, kind: FactorKind, dim: int, owner: int | None, like: Tensor, method: InverseMethod,
        *, whole: bool = False,
    ) -> None:
        self.name = name
        self.kind = kind
        self.dim = dim
        self.owner = owner
        self.whole = whole
        dtype, device = factor_dtype(like), like.device
        self.rows, self.cols = torch.triu_indices(dim, dim, device=device)
        self.running: Tensor | None = None
        self.view: Tensor = torch.empty(0)  # set by the buffer holding this factor
        self.ready = False
        # what an inversion produces and the owner broadcasts: Q and eigenvalues, or the inverse as it travels
        numel = dim * dim + dim if method is InverseMethod.EIGEN else self.message_numel
        self.inv_flat = torch.zeros(numel, dtype=dtype, device=device)
        self.q: Tensor | None = None
        self.evals: Tensor | None = None
        self.inv: Tensor | None = None
        if method is InverseMethod.EIGEN:
            self.q = self.inv_flat[: dim * dim].view(dim, dim)
            self.evals = self.inv_flat[dim * dim :]
        else:
            self.inv = torch.zeros(dim, dim, dtype=dtype, device=device)

    @property
    def message_numel(self) -> int:
        """Values the factor's allreduce sends: d^2 whole, else d(d+1)/2."""
        return self.dim * self.dim if self.whole else self.dim * (self.dim + 1) // 2

    def pack(self, matrix: Tensor) -> None:
        if self.whole:
            self.view.copy_(matrix.reshape(-1))
        else:
            self.view.copy_(matrix[self.rows, self.cols])

    def unpack(self, flat: Tensor, out: Tensor | None = None) -> Tensor:
        """The symmetric matrix that `flat` holds (its upper triangle, or all of it when whole)."""
        if out is None:
            out = torch.empty(self.dim, self.dim, dtype=self.inv_flat.dtype, device=flat.device)
        if self.whole:
            return out.copy_(flat.view(self.dim, self.dim))
        return symmetric_from_triangle(flat, self.rows, self.cols, out)


class _Layer:
    """A K-FAC layer: its module, parameters and two factors."""

    __slots__ = ("a", "bias", "g", "module", "name", "weight")

    def __init__(self, name: str, module: nn.Module, a: _Factor, g: _Factor) -> None:
        self.name = name
        self.module = module
        weight, bias = module.weight, module.bias
        assert isinstance(weight, nn.Parameter)
        self.weight: nn.Parameter = weight
        self.bias: nn.Parameter | None = bias if isinstance(bias, nn.Parameter) else None
        self.a = a
        self.g = g

    def input_covariance(self, x: Tensor, dtype: torch.dtype) -> Tensor:
        return input_covariance(self.module, x, dtype)

    def output_grads(self, grad: Tensor, dtype: torch.dtype) -> Tensor:
        return output_grad_rows(self.module, grad, dtype)


class _Buffer:
    """One fused factor allreduce: its factors as they travel (upper triangles or whole), back to back."""

    __slots__ = ("factors", "flat", "index", "num_ready", "prepared", "work")

    def __init__(self, index: int, factors: list[_Factor]) -> None:
        self.index = index
        self.factors = factors
        devices = {f.inv_flat.device for f in factors}
        if len(devices) > 1:
            names = [f.name for f in factors]
            raise ValueError(f"K-FAC buffer {names} spans several devices {sorted(map(str, devices))}; one is needed")
        dtype = functools.reduce(torch.promote_types, [f.inv_flat.dtype for f in factors])
        sizes = [f.message_numel for f in factors]
        self.flat = torch.zeros(sum(sizes), dtype=dtype, device=devices.pop())
        offset = 0
        for f, n in zip(factors, sizes, strict=True):
            f.view = self.flat[offset : offset + n]
            offset += n
        self.num_ready = 0
        self.prepared = False
        self.work: Any = None

    def reset(self) -> None:
        for f in self.factors:
            f.ready = False
        self.num_ready = 0
        self.prepared = False
        self.work = None


class KFACPreconditioner:
    """Preconditions Linear and Conv2d gradients with K-FAC, communicating as a plan's `kfac` section says.

    Call `step()` after every `loss.backward()` and before `optimizer.step()`; the loss must be a mean
    over the local batch. Other layers (and those matched by `skip_layers`) keep their gradients, only
    averaged across ranks.

    Args:
        model: the module to precondition (for a plan: the one it was made for).
        plan: a plan with a `kfac` section (`planner solve PROFILE --strategy kfac`); it also supplies the
            gradient groups. None: every factor in its own buffer and inverted by every rank.
        lr: the learning rate, or a function returning the current one; used by KL clipping.
        damping: added to the factors' eigenvalue products (or to each factor before inverting), > 0.
        factor_decay: running average weight of the old factors, in [0, 1).
        kl_clip: bound on the KL-style step size that scales the preconditioned gradients; None: no clipping.
        factor_update_steps: steps between factor updates; default the plan's, else 1.
        inv_update_steps: steps between inversions, a multiple of factor_update_steps; default the plan's, else 1.
        method: eigendecomposition or damped inverse; default the plan's, else EIGEN.
        skip_layers: regular expression of layer names to leave alone (matched with `re.search`); default the
            plan's (the `--kfac-skip` it was profiled with), else none.
        process_group: the group to average over; default: the default group, or none (world size 1)
            when torch.distributed is not initialised.
        exchange_gradients: average gradients across ranks in `step()` (through the plan's groups when a
            plan is given, else one allreduce); False when DDP already does.
        kfac: an explicit K-FAC section (e.g. a baseline layout), used instead of the plan's.
        auto_retune: when the plan was made for another world size, backend or kind of device, re-plan
            from its stored profile and a quick network probe (rank 0 solves and broadcasts; see
            `planner.runtime.attach`), keeping its method and intervals. The plan in use is `self.plan`.
        profile: the per-layer profile to re-plan from (a Profile or a path); default the plan's source.

    Raises:
        PlanMismatchError: the plan was made for another model, or for another world size, backend or
            device without `auto_retune`, has no kfac section, or
            names other K-FAC layers than the model has, or owner ranks outside the group.
        ValueError: an argument is out of range.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        plan: Plan | None = None,
        lr: float | Callable[[], SupportsFloat] = 0.1,
        damping: float = 1e-3,
        factor_decay: float = 0.95,
        kl_clip: float | None = 1e-3,
        factor_update_steps: int | None = None,
        inv_update_steps: int | None = None,
        method: InverseMethod | None = None,
        skip_layers: str | None = None,
        process_group: Any = None,
        exchange_gradients: bool = True,
        kfac: KFACSection | None = None,
        auto_retune: bool = False,
        profile: Any = None,
    ) -> None:
        _check_arguments(lr, damping, factor_decay, kl_clip, factor_update_steps, inv_update_steps, skip_layers)
        if method is not None:
            method = InverseMethod(method)
        self.lr = lr
        self.damping = damping
        self.factor_decay = factor_decay
        self.kl_clip = kl_clip
        if plan is not None:
            plan = resolve_plan(plan, model, process_group=process_group, auto_retune=auto_retune, profile=profile)
        self.plan = plan
        self.process_group = process_group
        self.world_size, self.rank = _world_size_and_rank(process_group)
        if skip_layers is None:  # the pattern the section's layers were profiled with
            recorded = [s.skip for s in (kfac, plan.kfac if plan is not None else None) if s is not None]
            skip_layers = next((p for p in recorded if p is not None), None)
        specs = kfac_layers(model, skip_layers)
        #: (name, reason) of every module with trainable parameters left to plain SGD (`kfac_left_out`).
        self.left_out = kfac_left_out(model, skip_layers)
        self.section = self._make_section(specs, plan, kfac, factor_update_steps, inv_update_steps, method)
        self.section.check_layers(specs)
        self.section.check_world_size(self.world_size)
        if plan is None and kfac is None:
            _warn_about_large_factors(self.section)

        modules = {name or ROOT_NAME: mod for name, mod in model.named_modules()}
        self._layers: list[_Layer] = []
        factors: dict[str, _Factor] = {}
        for spec in self.section.layers:
            module = modules[spec.name]
            pair = []
            for kind in FactorKind:
                name = factor_name(spec.name, kind)
                pair.append(
                    _Factor(name, kind, spec.dim(kind), self.section.owners[name], module.weight, self.section.method,
                            whole=self.section.sends_whole(name))
                )
                factors[name] = pair[-1]
            self._layers.append(_Layer(spec.name, module, *pair))
        self._factors = [factors[n] for n in self.section.factor_names()]
        #: rank that preconditions each layer (None: every rank), and the factors it keeps for that
        self._preconditioner = [self.section.preconditioners[layer.name] for layer in self._layers]
        self._kept = {id(f) for layer, rank in zip(self._layers, self._preconditioner, strict=True)
                      if rank is not None for f in (layer.a, layer.g)}
        self._buffers = [
            _Buffer(i, [factors[factor_name(n, kind)] for n in names])
            for i, (kind, names) in enumerate(
                [(FactorKind.A, b) for b in self.section.a_buffers]
                + [(FactorKind.G, b) for b in self.section.g_buffers]
            )
        ]
        self._buffer_of = {id(f): st for st in self._buffers for f in st.factors}

        self._params = [p for p in model.parameters() if p.requires_grad]
        self.exchange: GradientExchange | None = None
        self._allreduce_grads = exchange_gradients and self.world_size > 1
        if self._allreduce_grads and plan is not None:
            self.exchange = GradientExchange(model, plan, process_group=process_group)
        self._steps = 0
        #: Host seconds spent in the factor hooks (computing and packing A and G) since construction: on a CPU
        #: the factors' compute time, what `planner bench` sets beside the profile's; on a GPU only the launches.
        self.factor_seconds = 0.0
        self._next_launch = 0
        self._active = False  # a factor was computed since the last step()
        self._have_factors = False
        self._have_inverses = False
        self._inverses_stale = False  # factors loaded without their inverses: invert locally on the next step
        self._lock = threading.Lock()
        self._hooks: list[RemovableHandle] = [
            layer.module.register_forward_hook(functools.partial(self._forward_hook, layer)) for layer in self._layers
        ]

    @classmethod
    def from_file(cls, model: nn.Module, path: str | os.PathLike[str], **kwargs: Any) -> KFACPreconditioner:
        """Load the plan at `path` (validated, see `Plan.load`) and build the preconditioner."""
        return cls(model, plan=Plan.load(path), **kwargs)

    @staticmethod
    def _make_section(
        specs: list[KFACLayerSpec],
        plan: Plan | None,
        kfac: KFACSection | None,
        factor_update_steps: int | None,
        inv_update_steps: int | None,
        method: InverseMethod | None,
    ) -> KFACSection:
        """The explicit section, else the plan's, else the default one; with the overrides applied."""
        section = kfac if kfac is not None else plan.kfac if plan is not None else None
        if section is None:
            if plan is not None:
                raise PlanMismatchError(
                    "the plan has no kfac section; make one with `planner solve PROFILE --strategy kfac`"
                )
            if not specs:
                raise ValueError(
                    "the model has no Linear or ungrouped Conv2d layer with a trainable weight to precondition"
                )
            return KFACSection.simple(
                specs,
                method=method or InverseMethod.EIGEN,
                factor_update_steps=factor_update_steps or 1,
                inv_update_steps=inv_update_steps or factor_update_steps or 1,
            )
        factor = factor_update_steps or section.factor_update_steps
        inv = inv_update_steps or section.inv_update_steps
        if inv % factor:
            raise ValueError(
                "inv_update_steps must be a multiple of factor_update_steps, but got "
                f"(factor_update_steps={factor}, inv_update_steps={inv}) (after overriding the section's)"
            )
        return dataclasses.replace(
            section, factor_update_steps=factor, inv_update_steps=inv, method=method or section.method
        )

    # -- properties ------------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Calls of `step()` so far (restored by `load_state_dict`)."""
        return self._steps

    @property
    def factor_update_steps(self) -> int:
        return self.section.factor_update_steps

    @property
    def inv_update_steps(self) -> int:
        return self.section.inv_update_steps

    @property
    def method(self) -> InverseMethod:
        return self.section.method

    def factors(self) -> dict[str, Tensor]:
        """The running factors by name (copies of the full symmetric matrices); empty before the first update."""
        return {f.name: f.running.clone() for f in self._factors if f.running is not None}

    # -- hooks and launching ---------------------------------------------------------------------
    def _factor_step(self) -> bool:
        return self._steps % self.section.factor_update_steps == 0

    def _forward_hook(self, layer: _Layer, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """On a factor step in training: compute A from the input and hook the output for G."""
        if not (module.training and torch.is_grad_enabled() and self._factor_step()):
            return
        if not args or not isinstance(args[0], Tensor):
            return
        dtype = layer.a.inv_flat.dtype
        started = time.perf_counter()
        with torch.no_grad():
            a = layer.input_covariance(args[0], dtype)
            self._factor_ready(layer.a, a)
        self.factor_seconds += time.perf_counter() - started
        if isinstance(output, Tensor) and output.requires_grad:
            output.register_hook(functools.partial(self._output_grad_hook, layer))

    def _output_grad_hook(self, layer: _Layer, grad: Tensor) -> None:
        """Tensor hook on a layer's output: compute G from the gradient."""
        started = time.perf_counter()
        with torch.no_grad():
            self._factor_ready(layer.g, covariance(layer.output_grads(grad, layer.g.inv_flat.dtype)))
        self.factor_seconds += time.perf_counter() - started

    def _factor_ready(self, factor: _Factor, value: Tensor) -> None:
        """Pack a fresh factor into its buffer; allreduce the buffer when complete, in buffer order."""
        with self._lock:
            if factor.ready:
                raise DistributedError(
                    f"K-FAC factor {factor.name} was computed twice before step(): run one training forward and "
                    "backward per step() (shared layers, gradient accumulation and recomputing forward are not "
                    "supported); wrap other forward passes in torch.no_grad()"
                )
            self._active = True
            factor.ready = True
            factor.pack(value)
            st = self._buffer_of[id(factor)]
            st.num_ready += 1
            if st.num_ready == len(st.factors):
                st.prepared = True
                self._launch_prepared()

    def _launch_prepared(self) -> None:
        """Launch every prepared buffer that directly follows the launched ones, in buffer order."""
        while self._next_launch < len(self._buffers) and self._buffers[self._next_launch].prepared:
            st = self._buffers[self._next_launch]
            st.work = self._start_allreduce(st)
            self._next_launch += 1

    def _start_allreduce(self, st: _Buffer) -> Any:
        """Start the buffer's async allreduce (sum) and return its work handle (None on world size 1)."""
        if self.world_size == 1:
            return None
        return dist.all_reduce(st.flat, group=self.process_group, async_op=True)

    def _launch_rest(self) -> None:
        """Launch the buffers not launched yet; factors not computed on this rank count as zeros."""
        for st in self._buffers:
            if not st.prepared:
                for f in st.factors:
                    if not f.ready:
                        f.view.zero_()
                st.prepared = True
        self._launch_prepared()

    def _finish_factors(self) -> None:
        """Wait for the factor allreduces, average, and fold the new factors into the running averages."""
        decay = self.factor_decay
        for st in self._buffers:
            if st.work is not None:
                st.work.wait()
            if self.world_size > 1:
                st.flat.div_(self.world_size)
            for f in st.factors:
                f.running = fold_factor(f.running, f.unpack(f.view), decay)
        self._have_factors = True

    # -- gradients -------------------------------------------------------------------------------
    def _average_gradients(self) -> None:
        """One allreduce per (device, dtype) of every trainable gradient (missing ones as zeros), then average."""
        buckets: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
        for p in self._params:
            buckets.setdefault((p.device, p.dtype), []).append(p)
        flats = []
        for params in buckets.values():
            flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in params])
            flats.append((params, flat, dist.all_reduce(flat, group=self.process_group, async_op=True)))
        for params, flat, work in flats:
            work.wait()
            flat.div_(self.world_size)
            offset = 0
            for p in params:
                avg = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is None:
                    p.grad = avg.clone()
                else:
                    p.grad.copy_(avg)

    # -- inverses --------------------------------------------------------------------------------
    def _invert(self, f: _Factor) -> None:
        """Eigendecompose (eigenvalues clamped at 0) or invert (damped) the running factor into `inv_flat`."""
        assert f.running is not None
        decompose(f.running.to(f.inv_flat.dtype), self.section.method, self.damping, f.inv_flat)

    def _global_rank(self, rank: int) -> int:
        return rank if self.process_group is None else dist.get_global_rank(self.process_group, rank)

    def _needs(self, f: _Factor) -> bool:
        """Whether this rank needs `f`'s inverse: not when another rank keeps it to precondition its layer."""
        return id(f) not in self._kept or f.owner == self.rank

    def _update_inverses(self, communicate: bool) -> None:
        """Invert every factor: owners invert and broadcast, others receive, "all" factors everywhere; a
        factor kept by the rank that preconditions its layer is inverted there only.

        Without `communicate` (world size 1, or after loading factors) every rank inverts every factor it needs.
        """
        pending = []
        if communicate and self.world_size > 1:
            for f in self._factors:
                if f.owner is None:
                    continue
                if f.owner == self.rank:
                    self._invert(f)
                if id(f) not in self._kept:
                    src = self._global_rank(f.owner)
                    pending.append(dist.broadcast(f.inv_flat, src, group=self.process_group, async_op=True))
            local = [f for f in self._factors if f.owner is None]
        else:
            local = [f for f in self._factors if self._needs(f)]
        for f in local:
            self._invert(f)
        for work in pending:
            work.wait()
        if self.section.method is InverseMethod.INVERSE:
            for f in self._factors:
                if self._needs(f):
                    f.unpack(f.inv_flat, out=f.inv)
        self._have_inverses = True
        self._inverses_stale = False

    # -- preconditioning -------------------------------------------------------------------------
    def _current_lr(self) -> float:
        return float(self.lr() if callable(self.lr) else self.lr)

    def _gradient_matrix(self, layer: _Layer) -> Tensor | None:
        """The layer's gradient [W | b] in the factors' dtype, or None when its weight has no gradient (the
        same on every rank: gradients are averaged, or missing everywhere, before this)."""
        wgrad = layer.weight.grad
        if wgrad is None:
            return None
        out = wgrad.shape[0]
        grad = wgrad.reshape(out, -1).to(layer.a.inv_flat.dtype)
        if layer.bias is not None:
            bgrad = layer.bias.grad
            column = bgrad.reshape(out, 1).to(grad.dtype) if bgrad is not None else grad.new_zeros(out, 1)
            grad = torch.cat([grad, column], dim=1)
        return grad

    def _preconditioned(self, layer: _Layer, grad: Tensor) -> Tensor:
        a, g = layer.a, layer.g
        if self.section.method is InverseMethod.EIGEN:
            assert a.q is not None and a.evals is not None and g.q is not None and g.evals is not None
            return precondition_eigen(grad, a.q, a.evals, g.q, g.evals, self.damping)
        assert a.inv is not None and g.inv is not None
        return precondition_inverse(grad, a.inv, g.inv)

    def _precondition(self) -> None:
        """Replace each K-FAC layer's gradient by its KL-clipped preconditioned gradient, in place: layers with
        a preconditioner rank there (and broadcast, in layer order), then the others on every rank."""
        grads = [self._gradient_matrix(layer) for layer in self._layers]
        preconditioned: list[Tensor | None] = [None] * len(self._layers)
        pending = []
        communicate = self.world_size > 1
        for i, (layer, grad, rank) in enumerate(zip(self._layers, grads, self._preconditioner, strict=True)):
            if grad is None or rank is None:
                continue
            v = self._preconditioned(layer, grad) if rank == self.rank or not communicate else torch.empty_like(grad)
            preconditioned[i] = v
            if communicate:
                pending.append(dist.broadcast(v, self._global_rank(rank), group=self.process_group, async_op=True))
        for i, (layer, grad, rank) in enumerate(zip(self._layers, grads, self._preconditioner, strict=True)):
            if grad is not None and rank is None:
                preconditioned[i] = self._preconditioned(layer, grad)
        for work in pending:
            work.wait()
        results = []
        vg: Tensor | None = None
        for layer, grad, done in zip(self._layers, grads, preconditioned, strict=True):
            if grad is None or done is None:
                continue
            results.append((layer, done))
            if self.kl_clip is not None:
                term = (done * grad).sum().double()
                vg = term if vg is None else vg + term
        nu = 1.0
        if self.kl_clip is not None and vg is not None:
            vg_sum = float(vg) * self._current_lr() ** 2
            if vg_sum != 0:
                nu = min(1.0, math.sqrt(self.kl_clip / abs(vg_sum)))
        for layer, v in results:
            if nu != 1.0:
                v = v * nu
            wgrad = layer.weight.grad
            assert wgrad is not None
            cols = wgrad[0].numel()
            wgrad.copy_(v[:, :cols].reshape_as(wgrad))
            if layer.bias is not None and layer.bias.grad is not None:
                layer.bias.grad.copy_(v[:, cols])

    # -- the step --------------------------------------------------------------------------------
    def step(self) -> None:
        """Average gradients, finish the factor update, invert on an inversion step, precondition `.grad`.

        Call once after every backward. Before the first factor update (e.g. in eval mode) gradients are
        only averaged.
        """
        with self._lock:
            try:
                if self._active:
                    self._launch_rest()
                if self._allreduce_grads:
                    if self.exchange is not None:
                        self.exchange.synchronize()
                    else:
                        self._average_gradients()
                if self._active:
                    self._finish_factors()
            finally:
                for st in self._buffers:
                    st.reset()
                self._next_launch = 0
                self._active = False
            if self._have_factors:
                if self._steps % self.section.inv_update_steps == 0:
                    self._update_inverses(communicate=True)
                elif self._inverses_stale:
                    self._update_inverses(communicate=False)
            if self._have_inverses:
                self._precondition()
            self._steps += 1

    # -- state -----------------------------------------------------------------------------------
    def _inverse_key(self) -> dict[str, Any]:
        """What the stored inverses depend on besides the factors."""
        method = self.section.method
        return {"method": method.value, "damping": self.damping if method is InverseMethod.INVERSE else None}

    def state_dict(self) -> dict[str, Any]:
        """The step counter, running factors and current inverses by factor name (copies).

        The inverses make a resumed run continue identically even when the factors changed since the
        last inversion; without them (or for another method) they are recomputed from the factors.
        """
        return {
            "kind": STATE_KIND,
            "steps": self._steps,
            "layers": [spec.to_dict() for spec in self.section.layers],
            "factors": {f.name: f.running.detach().clone() for f in self._factors if f.running is not None},
            "inverses": None
            if not self._have_inverses
            else {**self._inverse_key(), "tensors": {f.name: f.inv_flat.detach().clone() for f in self._factors}},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state saved by `state_dict` for the same K-FAC layers (PlanMismatchError else)."""
        kind = state.get("kind") if isinstance(state, dict) else type(state).__name__
        if kind != STATE_KIND:
            raise PlanMismatchError(f"not a KFACPreconditioner state: kind is {kind!r}, expected {STATE_KIND!r}")
        mine = [spec.to_dict() for spec in self.section.layers]
        saved = state.get("layers")
        if saved != mine:
            names = [lt.get("name") for lt in saved] if isinstance(saved, list) else saved
            raise PlanMismatchError(
                f"this K-FAC state was saved for other layers ({_short(names)}), but this preconditioner has "
                f"{_short([lt['name'] for lt in mine])}; load the state saved for this model, or start without one"
            )
        factors = state.get("factors", {})
        if factors and set(factors) != {f.name for f in self._factors}:
            raise PlanMismatchError("the K-FAC state's factors do not name every layer's A and G factor")
        for f in self._factors:
            if f.name in factors and tuple(factors[f.name].shape) != (f.dim, f.dim):
                raise PlanMismatchError(
                    f"factor {f.name} in the K-FAC state has shape {tuple(factors[f.name].shape)}, "
                    f"expected {(f.dim, f.dim)}"
                )
        steps = state.get("steps")
        if not isinstance(steps, int) or steps < 0:
            raise PlanMismatchError(f"the K-FAC state's step counter must be an int >= 0, got {steps!r}")
        self._steps = steps
        for f in self._factors:
            f.running = factors[f.name].to(f.inv_flat).clone() if f.name in factors else None
        self._have_factors = bool(factors)
        inverses = state.get("inverses")
        tensors = inverses.get("tensors") if isinstance(inverses, dict) else None
        usable = (
            self._have_factors
            and isinstance(inverses, dict)
            and isinstance(tensors, dict)
            and all(inverses.get(k) == v for k, v in self._inverse_key().items())
            and all(f.name in tensors and tensors[f.name].shape == f.inv_flat.shape for f in self._factors)
        )
        if usable:
            assert isinstance(tensors, dict)
            for f in self._factors:
                f.inv_flat.copy_(tensors[f.name])
                if f.inv is not None:
                    f.unpack(f.inv_flat, out=f.inv)
        self._have_inverses = usable
        self._inverses_stale = self._have_factors and not usable

    # -- teardown --------------------------------------------------------------------------------
    def remove_hooks(self) -> None:
        """Remove the forward hooks (and the gradient exchange's hooks); `step()` no longer updates factors."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self.exchange is not None:
            self.exchange.remove_hooks()

    close = remove_hooks

    def __enter__(self) -> KFACPreconditioner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _short(names: Any, limit: int = 3) -> str:
    if not isinstance(names, list):
        return repr(names)
    shown = ", ".join(map(str, names[:limit]))
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _check_arguments(
    lr: float | Callable[[], SupportsFloat],
    damping: float,
    factor_decay: float,
    kl_clip: float | None,
    factor_update_steps: int | None,
    inv_update_steps: int | None,
    skip_layers: str | None,
) -> None:
    """Refuse out-of-range arguments with one line each."""
    if not callable(lr) and not (isinstance(lr, int | float) and lr > 0):
        raise ValueError(f"lr must be a number > 0 or a function returning the current one, but got lr={lr!r}")
    if not damping > 0:
        raise ValueError(f"`damping > 0` must hold, but got damping={damping}")
    if not 0 <= factor_decay < 1:
        raise ValueError(f"`0 <= factor_decay < 1` must hold, but got factor_decay={factor_decay}")
    if kl_clip is not None and not kl_clip > 0:
        raise ValueError(f"`kl_clip > 0` must hold (None disables clipping), but got kl_clip={kl_clip}")
    for name, value in (("factor_update_steps", factor_update_steps), ("inv_update_steps", inv_update_steps)):
        if value is not None and not (isinstance(value, int) and value >= 1):
            raise ValueError(f"`{name} >= 1` must hold, but got {name}={value!r}")
    if factor_update_steps is not None and inv_update_steps is not None and inv_update_steps % factor_update_steps:
        raise ValueError(
            "inv_update_steps must be a multiple of factor_update_steps, but got "
            f"(factor_update_steps={factor_update_steps}, inv_update_steps={inv_update_steps})"
        )
    if skip_layers is not None:
        try:
            re.compile(skip_layers)
        except re.error as exc:
            raise ValueError(f"skip_layers is not a valid regular expression ({exc}): {skip_layers!r}") from None
