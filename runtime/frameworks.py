"""Run a plan inside PyTorch Lightning and Hugging Face Accelerate: DDP's buckets the plan's groups, `PlanHook` its
communication hook, as in a plain DDP loop (`planner.runtime.ddp_plan`).

Lightning (`pip install 'planner[lightning]'`):

    trainer = Trainer(accelerator="cpu", devices=2, strategy=lightning_strategy("plan.json", module=net))
    trainer.fit(lit_module, loader)

`lightning_strategy` gives a `DDPStrategy` that builds the `PlanHook` once Lightning has started the process group,
wraps the LightningModule in DDP with the hook's `ddp_kwargs()` and registers the hook. Lightning's own
`DDPStrategy(ddp_comm_hook=..., ddp_comm_state=...)` does not do it: it registers a comm hook on CUDA only (on CPU
the hook is dropped without a word), and a hook built before `fit` has no process group to check the plan against.
The plan may be made for the LightningModule itself or for a submodule that holds all of its trainable parameters
(`module=`, e.g. the network the LightningModule trains): DDP's buckets are the same.

Accelerate (`pip install 'planner[accelerate]'`):

    accelerator = Accelerator()
    hook = PlanHook.from_file(model, "plan.json")
    model = accelerate_prepare(accelerator, hook)             # not accelerator.prepare(model)
    optimizer, loader = accelerator.prepare(optimizer, loader)

Accelerate builds DDP from `DistributedDataParallelKwargs`, which has no per-bucket caps (`bucket_cap_mb_list`)
and only its built-in hooks, so `accelerator.prepare(model)` cannot make the plan's buckets: a hook registered on
the model it returns sees DDP's own buckets, warns, and sends each as the group holding most of its elements.
`accelerate_prepare` builds the DDP as Accelerate would (on its device) with the hook's keyword arguments instead.
"""

from __future__ import annotations

import inspect
import os
from functools import cache
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from planner.contracts.plan import Plan
from planner.runtime.adaptive import Replanning
from planner.runtime.ddp_plan import PlanHook, trainable_ids
from planner.runtime.engine import check_momentum_options
from planner.types import CompressorKind, PlanMismatchError

__all__ = ["accelerate_prepare", "lightning_strategy"]

#: DDP's arguments that the hook sets (`PlanHook.ddp_kwargs`); a strategy given them as well is refused.
_HOOK_SETS = ("bucket_cap_mb", "bucket_cap_mb_list", "find_unused_parameters", "gradient_as_bucket_view")


def _check_holds_all(outer: nn.Module, inner: nn.Module, what: str) -> None:
    """Refuse, in one line, an `inner` module whose trainable parameters are not all of `outer`'s, in its order: DDP
    wrapping `outer` would bucket other parameters than the hook's plan."""
    if trainable_ids(outer) != trainable_ids(inner):
        raise PlanMismatchError(
            f"the plan's module ({type(inner).__name__}) does not hold all the trainable parameters of the {what} "
            f"({type(outer).__name__}) in its order, so DDP's buckets cannot be the plan's groups; make the plan for "
            f"the {what} itself, or freeze what the plan does not hold"
        )


# -- Lightning ----------------------------------------------------------------------------------------------------


def lightning_strategy(
    plan: Plan | str | os.PathLike[str],
    *,
    module: nn.Module | None = None,
    static_graph: bool = False,
    find_unused_parameters: bool | None = None,
    auto_retune: bool = False,
    profile: Any = None,
    adaptive: bool | Replanning = False,
    momentum: float = 0.0,
    nesterov: bool = False,
    **strategy_kwargs: Any,
) -> Any:
    """A Lightning `DDPStrategy` that runs `plan` in DDP: its groups as DDP's buckets, `PlanHook` as the comm hook.

    The hook is built at `Trainer.fit`'s set-up, after Lightning has started the process group, on every rank;
    it is then `strategy.hook` (its `state_dict()` holds the top-k residuals and PowerSGD state to checkpoint).

    Args:
        plan: the plan, or the path of its file.
        module: the module the plan was made for, when it is not the LightningModule itself: a submodule holding
            all of the LightningModule's trainable parameters (e.g. the network it trains).
        static_graph: DDP's `static_graph` (it changes when DDP lays out its buckets; see `PlanHook.ddp_kwargs`).
        find_unused_parameters: as `PlanHook`'s (default: as the plan says).
        auto_retune: as `PlanHook`'s.
        profile: as `PlanHook`'s.
        adaptive: as `PlanHook`'s: re-plan each bucket's compressor within the plan's error budget as training goes
            (`Replanning`; the buckets are kept). Its re-plans are then `strategy.hook.replans`.
        momentum: as `PlanHook`'s: SGD's momentum applied in the hook (momentum correction, for top-k plans), with
            the optimizer at momentum 0; `nesterov` likewise. The optimizer `configure_optimizers` returns is
            checked as `PlanHook(optimizer=...)` checks it, at set-up and at each step: momentum in it beside the
            hook's is refused, and without `momentum` so is momentum in it on the plan's top-k groups.
        **strategy_kwargs: other arguments of `DDPStrategy` (e.g. `process_group_backend`, `timeout`) and of DDP;
            not DDP's bucket arguments, which the plan sets, nor another comm hook.

    Raises:
        ImportError: Lightning is not installed.
        ValueError: the arguments set what the plan sets (bucket caps, find_unused_parameters, a comm hook), name
            no argument of `DDPStrategy` or DDP, or give momentum out of range (each in one line, here, not
            inside `fit` on every rank).
    """
    taken = sorted(k for k in strategy_kwargs
                   if k in _HOOK_SETS or k.startswith("ddp_comm_") or k == "model_averaging_period")
    if taken:
        raise ValueError(f"lightning_strategy sets DDP's buckets and comm hook from the plan, so it does not take "
                         f"{', '.join(taken)}; pass find_unused_parameters= and static_graph= to it by name")
    if "optimizer" in strategy_kwargs:
        raise ValueError("lightning_strategy checks the optimizer your LightningModule's configure_optimizers "
                         "returns, once Lightning has made it: drop optimizer=")
    unknown = sorted(set(strategy_kwargs) - _strategy_arguments())
    if unknown:
        raise ValueError(f"lightning_strategy got {', '.join(unknown)}, which is an argument of neither DDPStrategy "
                         "nor DistributedDataParallel; PlanHook's are find_unused_parameters, auto_retune, profile, "
                         "adaptive, momentum and nesterov")
    check_momentum_options(momentum, nesterov, None, "lightning_strategy", optimizer_later=True)
    hook_kwargs = {"find_unused_parameters": find_unused_parameters, "auto_retune": auto_retune, "profile": profile,
                   "adaptive": adaptive, "momentum": momentum, "nesterov": nesterov}
    return _strategy_class()(plan, module=module, static_graph=static_graph, hook_kwargs=hook_kwargs,
                             **strategy_kwargs)


@cache
def _strategy_arguments() -> frozenset[str]:
    """The keyword arguments `DDPStrategy` takes, and DDP's, which it passes on."""

    def named(fn: Any) -> set[str]:
        return {p.name for p in inspect.signature(fn).parameters.values()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"}

    from lightning.pytorch.strategies import DDPStrategy  # optional extra: lightning, imported once asked for

    _strategy_class()  # Lightning is installed, or one line says how
    return frozenset(named(DDPStrategy) | named(DistributedDataParallel)) - {"module"}


@cache
def _strategy_class() -> type:
    try:
        from lightning.pytorch.strategies import DDPStrategy  # optional extra: lightning, imported once asked for
    except ImportError as exc:
        raise ImportError(f"lightning_strategy needs PyTorch Lightning ({exc}); install it with "
                          "pip install 'planner[lightning]'") from None

    class PlanDDPStrategy(DDPStrategy):
        """`DDPStrategy` whose DDP is built with a plan's buckets and runs its `PlanHook` (see
        `lightning_strategy`)."""

        def __init__(self, plan: Plan | str | os.PathLike[str], *, module: nn.Module | None, static_graph: bool,
                     hook_kwargs: dict[str, Any], **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._plan = plan
            self._plan_module = module
            self._static_graph = static_graph
            self._hook_kwargs = hook_kwargs
            self._optimizers_made = False
            self.hook: PlanHook | None = None

        def configure_ddp(self) -> None:
            lightning_module = self.model
            assert isinstance(lightning_module, nn.Module)
            planned = lightning_module if self._plan_module is None else self._plan_module
            if planned is not lightning_module:
                _check_holds_all(lightning_module, planned, "LightningModule")
            plan = self._plan if isinstance(self._plan, Plan) else Plan.load(self._plan)
            optimizer = None
            self._optimizers_made = False
            if self._hook_kwargs["momentum"] > 0 or any(plan.compressor_of(g).kind is CompressorKind.TOPK
                                                        for g in plan.groups):
                # The hook checks the optimizer, which Lightning makes after DDP (`setup_optimizers`): make it
                # now, from the module's own parameters (DDP wraps them as they are), and not again later.
                trainer = lightning_module.trainer
                self.setup_optimizers(trainer)
                self._optimizers_made = True
                if len(self.optimizers) != 1:
                    raise ValueError(f"the plan's hook checks the optimizer for momentum, but configure_optimizers "
                                     f"returned {len(self.optimizers)}; return one optimizer")
                optimizer = self.optimizers[0]
            self.hook = PlanHook(planned, plan, optimizer=optimizer, **self._hook_kwargs)
            self._ddp_kwargs = {**self._ddp_kwargs, **self.hook.ddp_kwargs(static_graph=self._static_graph)}
            self.model = self._setup_model(lightning_module)
            # DDPStrategy._register_ddp_hooks registers a comm hook on CUDA only: the plan's is registered here.
            self.hook.register(self.model)

        def setup_optimizers(self, trainer: Any) -> None:
            if not self._optimizers_made:  # made already for the hook to check (`configure_ddp`)
                super().setup_optimizers(trainer)

    return PlanDDPStrategy


# -- Accelerate ---------------------------------------------------------------------------------------------------


def accelerate_prepare(accelerator: Any, hook: PlanHook, *, static_graph: bool = False) -> nn.Module:
    """The hook's model in DDP for `accelerator`, with the plan's buckets and the hook registered: in place of
    `accelerator.prepare(model)` (pass it the optimizer and data loaders as usual).

    The model is moved to the accelerator's device and wrapped as Accelerate wraps it for multi-process DDP
    (`device_ids` on a GPU), with `hook.ddp_kwargs(static_graph=...)`. Accelerate's mixed precision wraps a model's
    forward in `prepare`, which this skips: it is refused.

    Raises:
        ValueError: the accelerator does not run DDP over several processes, or uses mixed precision.
    """
    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
    if not kind.startswith("MULTI_") or accelerator.num_processes < 2:
        raise ValueError(f"accelerate_prepare runs a plan in DDP over several processes, but this accelerator's "
                         f"distributed type is {kind} with {accelerator.num_processes} process(es); launch with "
                         "accelerate launch or torchrun")
    if str(accelerator.mixed_precision) != "no":
        raise ValueError(f"accelerate_prepare does not apply Accelerate's mixed precision "
                         f"({accelerator.mixed_precision}); run with mixed_precision='no'")
    device = torch.device(accelerator.device)
    model = hook.model.to(device)
    on_cpu = device.type == "cpu"
    ddp = DistributedDataParallel(model, device_ids=None if on_cpu else [device], output_device=None if on_cpu
                                  else device, **hook.ddp_kwargs(static_graph=static_graph))
    hook.register(ddp)
    return ddp
