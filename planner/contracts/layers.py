"""Layers as the planner sees them: modules that directly own trainable parameters."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.contracts.plan import Group, Plan
from planner.costmodel.problem import Grouping, groups_of, topk_count
from planner.types import ROOT_NAME, PlanMismatchError, SolverError, Strategy

if TYPE_CHECKING:
    from torch import nn

    from planner.contracts.profile import Profile

__all__ = ["ROOT_NAME", "LayerSpec", "gradient_layers", "groups_for", "plan_grouping"]

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


def groups_for(
    layers: Sequence[LayerSpec], grouping: Grouping, strategy: Strategy, density: float | None
) -> tuple[Group, ...]:
    """Plan groups for `layers` (in ready order) split at `grouping`'s end indices."""
    if not grouping or grouping[-1] != len(layers):
        raise SolverError(f"grouping {grouping} does not cover the {len(layers)} layers")
    out = []
    for r in groups_of(grouping):
        members = [layers[i] for i in r]
        numel = sum(m.numel for m in members)
        k = None
        if strategy is Strategy.TOPK:
            assert density is not None
            k = topk_count(numel, density)
        out.append(
            Group(
                layers=tuple(m.name for m in members),
                params=tuple(p for m in members for p in m.params),
                numel=numel,
                k=k,
            )
        )
    return tuple(out)


def plan_grouping(plan: Plan, profile: Profile) -> Grouping:
    """The plan's groups as exclusive end indices in the profile's layer order.

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
    for i, (g, layers) in enumerate(zip(plan.groups, groups_of(grouping), strict=True)):
        numel = sum(profile.layers[j].numel for j in layers)
        if numel != g.numel:
            raise PlanMismatchError(
                f"group {i} of the plan has {g.numel} elements, but its layers have {numel} in the profile; {hint}"
            )
    return grouping
