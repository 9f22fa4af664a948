"""Layers as the planner sees them: modules that directly own trainable parameters."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.contracts.plan import Plan
from planner.types import ROOT_NAME, PlanMismatchError

if TYPE_CHECKING:
    from torch import nn

    from planner.contracts.profile import Profile

__all__ = ["ROOT_NAME", "LayerSpec", "gradient_layers", "plan_grouping"]

@dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """A module's own trainable parameters (qualified names) and their total size."""

    name: str
    params: tuple[str, ...]
    numel: int


def gradient_layers(module: nn.Module) -> list[LayerSpec]:
    """Every module owning trainable parameters directly, in registration order.

    A parameter shared by several modules (tied weights, e.g. an output layer reusing the embedding's
    weight) belongs to the first of them only, under the name `module.named_parameters()` gives it, as it
    is one tensor with one gradient: its gradient is ready once every use has contributed.
    """
    layers = []
    seen: set[int] = set()
    for mname, mod in module.named_modules():
        own = []
        for n, p in mod.named_parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                own.append((n, p))
            seen.add(id(p))
        if own:
            prefix = f"{mname}." if mname else ""
            layers.append(
                LayerSpec(
                    name=mname or ROOT_NAME,
                    params=tuple(prefix + n for n, _ in own),
                    numel=sum(p.numel() for _, p in own),
                )
            )
    return layers


def plan_grouping(plan: Plan, profile: Profile) -> tuple[int, ...]:
    """The plan's groups as exclusive end indices in the profile's layer order (a grouping,
    `planner.costmodel.problem.Grouping`).

    Raises:
        PlanMismatchError: the plan's layers (in group order) or group sizes are not the profile's.
    """
    planned = [name for g in plan.groups for name in g.layers]
    profiled = [lt.name for lt in profile.layers]
    hint = f"use the profile the plan was solved from ({plan.source_profile or 'see `planner show PLAN`'})"
    if planned != profiled:
        diff = next(
            (f"position {i}: plan {a!r}, profile {b!r}" for i, (a, b) in enumerate(zip(planned, profiled, strict=False))
             if a != b),
            f"the plan has {len(planned)} layers, the profile {len(profiled)}",
        )
        raise PlanMismatchError(f"the plan's layers differ from the profile's ({diff}); {hint}")
    grouping = tuple(itertools.accumulate(len(g.layers) for g in plan.groups))
    starts = (0, *grouping[:-1])
    for i, (g, start, end) in enumerate(zip(plan.groups, starts, grouping, strict=True)):
        numel = sum(lt.numel for lt in profile.layers[start:end])
        if numel != g.numel:
            raise PlanMismatchError(
                f"group {i} of the plan has {g.numel} elements, but its layers have {numel} in the profile; {hint}"
            )
    return grouping
