"""Execute plans during training: fused dense or top-k gradient exchange, a plan inside DDP (its groups as
buckets, one comm hook), a DDP top-k hook, K-FAC, and ABS-SGD
for workers of different speeds."""

from __future__ import annotations

if __name__ != "planner.runtime":  # this folder found as a top-level package (run from the repository root)
    raise ImportError(f"`{__name__}` is not a module of this project: import `planner.runtime` "
                      "(the folder runtime/ is installed under that name)")

import planner.platform.collective_defaults  # noqa: F401  (before the user's process group: see there)
from planner.kernels.topk import decode, pack, select_topk, unpack
from planner.runtime.abs_sgd import ABSSGD
from planner.runtime.adaptive import Replanning
from planner.runtime.ddp_hooks import TopkHookState, topk_hook
from planner.runtime.ddp_plan import PlanHook
from planner.runtime.exchange import GradientExchange
from planner.runtime.online_race import OnlineRace
from planner.runtime.preconditioner import KFACPreconditioner

__all__ = [
    "ABSSGD",
    "GradientExchange",
    "KFACPreconditioner",
    "OnlineRace",
    "PlanHook",
    "Replanning",
    "TopkHookState",
    "decode",
    "pack",
    "select_topk",
    "topk_hook",
    "unpack",
]
