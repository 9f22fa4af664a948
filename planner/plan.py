"""`planner.plan.Plan` as the README has always shown it; the plan contract lives in
planner/contracts/plan.py."""

from __future__ import annotations

from planner.contracts.plan import Group, Plan

__all__ = ["Group", "Plan"]
