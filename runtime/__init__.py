"""Execute plans during training: fused dense or top-k gradient exchange, a DDP top-k hook, K-FAC, and ABS-SGD
for workers of different speeds."""

from __future__ import annotations

from planner.kernels.topk import decode, pack, select_topk, unpack
from runtime.abs import ABSSGD
from runtime.ddp_hooks import TopkHookState, topk_hook
from runtime.exchange import GradientExchange
from runtime.kfac import KFACPreconditioner

__all__ = [
    "ABSSGD",
    "GradientExchange",
    "KFACPreconditioner",
    "TopkHookState",
    "decode",
    "pack",
    "select_topk",
    "topk_hook",
    "unpack",
]
