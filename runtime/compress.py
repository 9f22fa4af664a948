"""Top-k sparsification with error feedback: select, pack for one allgather, decode the gathered result.

These are the exact functions the runtime calls and the profiler times (selection cost s(N), decode
cost d(P k) in DESIGN.md's timeline model), so keep them free of anything else.

Wire format of one rank's message: 2k fp32 words, the k values then the k int32 indices reinterpreted
bit for bit as fp32 (`indices.view(torch.float32)`), so a single allgather carries both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["MAX_NUMEL", "all_gather_flat", "decode", "pack", "select_topk", "unpack"]

#: Allgather into one flat tensor (every rank's message, rank by rank): `all_gather_single` where it
#: exists (torch 2.13 deprecates the old name `all_gather_into_tensor`).
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: Indices travel as int32, so a sparsified flat gradient can hold at most this many elements.
MAX_NUMEL = 2**31 - 1


def select_topk(grad: Tensor, residual: Tensor | None, k: int) -> tuple[Tensor, Tensor]:
    """Error-feedback top-k: add `grad` into `residual`, take the k largest magnitudes, zero them there.

    The add happens inside (so the profiler's selection time includes the residual update):
    `residual += grad` becomes the accumulator acc, the k entries of largest |acc| are returned and
    zeroed in `residual`, which keeps what was not sent for the next step. `grad` is only read, so it
    may be a DDP bucket or a buffer the caller overwrites afterwards. With `residual=None` (no error
    feedback) acc is `grad` itself.

    Args:
        grad: flat fp32 gradient of N elements.
        residual: flat fp32 tensor of N elements, updated in place; or None.
        k: number of entries to send, 1 <= k <= N.

    Returns:
        (values fp32 [k], indices int32 [k]) of the selected entries, in no particular order.
        At k == N every entry is selected (indices 0..N-1) and the residual ends all zero.
    """
    numel = grad.numel()
    if grad.dim() != 1 or grad.dtype != torch.float32:
        raise ValueError(f"select_topk needs a flat fp32 tensor, but got shape {tuple(grad.shape)} {grad.dtype}")
    if not 0 < k <= numel:
        raise ValueError(f"`0 < k <= numel` must hold, but got (k={k}, numel={numel})")
    if numel > MAX_NUMEL:
        raise ValueError(f"indices are int32, so `numel <= {MAX_NUMEL}` must hold, but got numel={numel}")
    if residual is None:
        acc = grad
    else:
        if residual.shape != grad.shape or residual.dtype != grad.dtype:
            raise ValueError(
                f"residual must match grad, but got {tuple(residual.shape)} {residual.dtype} "
                f"for {tuple(grad.shape)} {grad.dtype}"
            )
        acc = residual.add_(grad)
    if k == numel:  # everything is sent: no sort, and nothing is left behind
        values = acc.clone()
        if residual is not None:
            residual.zero_()
        return values, torch.arange(numel, dtype=torch.int32, device=grad.device)
    _, idx = torch.topk(acc.abs(), k, sorted=False)
    values = acc.index_select(0, idx)
    if residual is not None:
        residual.index_fill_(0, idx, 0.0)
    return values, idx.to(torch.int32)


def pack(values: Tensor, indices: Tensor, out: Tensor | None = None) -> Tensor:
    """Values then bit-reinterpreted int32 indices in one fp32 tensor of 2k (written into `out` if given)."""
    if values.dtype != torch.float32 or indices.dtype != torch.int32 or values.shape != indices.shape:
        raise ValueError(
            f"pack needs fp32 values and int32 indices of one shape, but got {values.dtype} "
            f"{tuple(values.shape)} and {indices.dtype} {tuple(indices.shape)}"
        )
    k = values.numel()
    if out is None:
        out = torch.empty(2 * k, dtype=torch.float32, device=values.device)
    elif out.shape != (2 * k,) or out.dtype != torch.float32:
        raise ValueError(f"out must be fp32 of shape ({2 * k},), but got {out.dtype} {tuple(out.shape)}")
    out[:k].copy_(values)
    out[k:].view(torch.int32).copy_(indices)
    return out


def unpack(buf: Tensor) -> tuple[Tensor, Tensor]:
    """Inverse of `pack`: (values fp32 [k], indices int32 [k]), views into `buf`."""
    if buf.dim() != 1 or buf.dtype != torch.float32 or buf.numel() % 2:
        raise ValueError(f"unpack needs a flat fp32 tensor of even length, but got {buf.dtype} {tuple(buf.shape)}")
    k = buf.numel() // 2
    return buf[:k], buf[k:].view(torch.int32)


def decode(gathered: Tensor, k: int, numel: int, world_size: int, out: Tensor | None = None) -> Tensor:
    """Average every rank's sparse message into a dense fp32 vector of `numel` elements.

    Args:
        gathered: the allgather result, world_size packed messages of 2k fp32 each, rank by rank.
        k: values per rank.
        numel: size of the dense gradient.
        world_size: P; the result is the sum of all ranks' values divided by P (the dense allreduce mean).
        out: dense fp32 tensor of `numel` to write into (overwritten); allocated when None.

    Returns:
        `out`, holding sum over ranks of the scattered values, divided by world_size.
    """
    if gathered.numel() != world_size * 2 * k:
        raise ValueError(
            f"`gathered.numel() == world_size * 2 * k` must hold, but got "
            f"({gathered.numel()}, world_size={world_size}, k={k})"
        )
    if out is None:
        out = torch.zeros(numel, dtype=torch.float32, device=gathered.device)
    else:
        if out.shape != (numel,) or out.dtype != torch.float32:
            raise ValueError(f"out must be fp32 of shape ({numel},), but got {out.dtype} {tuple(out.shape)}")
        out.zero_()
    msgs = gathered.view(world_size, 2 * k)
    values = msgs[:, :k].reshape(-1)
    indices = msgs[:, k:].view(torch.int32).reshape(-1).long()
    # alpha folds the mean into the scatter: P*k multiplies instead of a pass over all numel elements.
    out.index_add_(0, indices, values, alpha=1.0 / world_size)
    return out
