"""Execute plans during training: fused dense or top-k gradient exchange, a DDP top-k hook, and K-FAC."""

from __future__ import annotations

from planner.kernels.topk import decode, pack, select_topk, unpack
from runtime.ddp_hooks import TopkHookState, topk_hook
from runtime.exchange import GradientExchange
from runtime.kfac import KFACPreconditioner

__all__ = [
    "GradientExchange",
    "KFACPreconditioner",
    "TopkHookState",
    "decode",
    "pack",
    "select_topk",
    "topk_hook",
    "unpack",
]
