"""Execute plans during training: fused dense or top-k gradient exchange, a plan inside DDP (its groups as
buckets, one comm hook), a DDP top-k hook, K-FAC, and ABS-SGD
for workers of different speeds."""

from __future__ import annotations

import planner.platform.collective_defaults  # noqa: F401  (before the user's process group: see there)
from planner.kernels.topk import decode, pack, select_topk, unpack
from planner.runtime.abs import ABSSGD
from planner.runtime.adaptive import Replanning
from planner.runtime.ddp_hooks import TopkHookState, topk_hook
from planner.runtime.ddp_plan import PlanHook
from planner.runtime.exchange import GradientExchange
from planner.runtime.kfac import KFACPreconditioner

__all__ = [
    "ABSSGD",
    "GradientExchange",
    "KFACPreconditioner",
    "PlanHook",
    "Replanning",
    "TopkHookState",
    "decode",
    "pack",
    "select_topk",
    "topk_hook",
    "unpack",
]

if __name__ == "runtime":
    # This folder found as the top-level `runtime` (the repository root on sys.path): the old import path. Its
    # name becomes the module `planner.runtime` itself, with a DeprecationWarning (see planner/_aliases.py).
    from planner._aliases import alias_package

    alias_package("runtime", "planner.runtime")
