"""Execute plans during training: fused dense or top-k gradient exchange, and a DDP top-k hook."""

from __future__ import annotations

from runtime.compress import decode, pack, select_topk, unpack
from runtime.ddp_hooks import TopkHookState, topk_hook
from runtime.exchange import GradientExchange

__all__ = [
    "GradientExchange",
    "TopkHookState",
    "decode",
    "pack",
    "select_topk",
    "topk_hook",
    "unpack",
]
