"""Top-k sparsification with error feedback: select, pack for one allgather, decode the gathered result.

These are the exact functions the runtime calls and the profiler times (selection cost s(N), decode
cost d(P k) in DESIGN.md's timeline model), so keep them free of anything else.

Two selectors pick the same k entries (the k largest |acc|, ties broken arbitrarily): "exact" runs
`torch.topk` over all N magnitudes; "sampled" (Deep Gradient Compression's sampled threshold) estimates
the threshold from a small random sample, gathers the few candidates above it in one blocked pass and
runs the exact top-k on those only, falling back to "exact" when the sample under-shoots.

Wire format of one rank's message: 2k fp32 words, the k values then the k int32 indices reinterpreted
bit for bit as fp32 (`indices.view(torch.float32)`), so a single allgather carries both.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["MAX_NUMEL", "SELECTORS", "all_gather_flat", "decode", "pack", "select_topk", "take_topk", "unpack"]

#: Allgather into one flat tensor (every rank's message, rank by rank): `all_gather_single` where it
#: exists (torch 2.13 deprecates the old name `all_gather_into_tensor`).
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: Indices travel as int32, so a sparsified flat gradient can hold at most this many elements.
MAX_NUMEL = 2**31 - 1

#: Names of the top-k selectors `select_topk` accepts ("exact" is the default).
SELECTORS = ("exact", "sampled")

#: Below this many elements "sampled" runs the exact top-k: its fixed cost (sample, threshold, a few
#: calls; about 0.2 ms) matches an exact topk of 64K elements on one CPU thread.
_SAMPLED_MIN_NUMEL = 1 << 16
#: Sample size: `numel // _SAMPLE_DIVISOR` (0.5%), between these bounds.
_MIN_SAMPLE, _MAX_SAMPLE, _SAMPLE_DIVISOR = 4096, 1 << 16, 200
#: Standard deviations of the sampled count by which the threshold over-selects, per attempt; when an
#: attempt still finds fewer than k candidates the next, lower threshold is tried, then exact topk.
_OVERSELECT_SIGMAS = (3.0, 8.0, 20.0)
#: Elements per block of the candidate scan: its magnitudes (1 MiB) and mask stay in cache.
_SCAN_BLOCK = 1 << 18
#: Random sample positions; fixed seed so runs repeat (the selected set does not depend on it).
_SAMPLE_GEN = torch.Generator(device="cpu").manual_seed(0x7C0)


def select_topk(
    grad: Tensor, residual: Tensor | None, k: int, *, selector: str = "exact"
) -> tuple[Tensor, Tensor]:
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
        selector: "exact" (`torch.topk` over all N) or "sampled" (threshold from a random sample, exact
            topk over the candidates above it; the same entries up to ties, several times faster on CPU
            at low density). Both return exactly k entries with the same residual accounting.

    Returns:
        (values fp32 [k], indices int32 [k]) of the selected entries, in no particular order.
        At k == N every entry is selected (indices 0..N-1) and the residual ends all zero.

    Raises:
        ValueError: an unknown selector, a tensor that is not flat fp32, or k out of range.
    """
    if selector not in SELECTORS:
        raise ValueError(f"unknown top-k selector {selector!r}; valid selectors: {', '.join(SELECTORS)}")
    _check_flat(grad, k)
    if residual is None:
        values, idx = _topk_of(grad, k, selector)
        return values, idx.to(torch.int32)
    if residual.shape != grad.shape or residual.dtype != grad.dtype:
        raise ValueError(
            f"residual must match grad, but got {tuple(residual.shape)} {residual.dtype} "
            f"for {tuple(grad.shape)} {grad.dtype}"
        )
    return take_topk(residual.add_(grad), k, selector=selector)


def take_topk(acc: Tensor, k: int, *, selector: str = "exact") -> tuple[Tensor, Tensor]:
    """Error feedback on an accumulator that already holds residual + gradient: the k largest |acc|,
    zeroed in `acc`, which keeps what was not sent.

    `select_topk(grad, residual, k)` is `take_topk(residual.add_(grad), k)`; the runtime calls this
    directly after adding each parameter's gradient into its slice of the residual, which saves
    gathering the gradients into a flat buffer first. Arguments, results and errors as `select_topk`.
    """
    if selector not in SELECTORS:
        raise ValueError(f"unknown top-k selector {selector!r}; valid selectors: {', '.join(SELECTORS)}")
    _check_flat(acc, k)
    values, idx = _topk_of(acc, k, selector)
    if k == acc.numel():
        acc.zero_()
    else:
        acc.index_fill_(0, idx, 0.0)
    return values, idx.to(torch.int32)


def _check_flat(grad: Tensor, k: int) -> None:
    numel = grad.numel()
    if grad.dim() != 1 or grad.dtype != torch.float32:
        raise ValueError(f"select_topk needs a flat fp32 tensor, but got shape {tuple(grad.shape)} {grad.dtype}")
    if not 0 < k <= numel:
        raise ValueError(f"`0 < k <= numel` must hold, but got (k={k}, numel={numel})")
    if numel > MAX_NUMEL:
        raise ValueError(f"indices are int32, so `numel <= {MAX_NUMEL}` must hold, but got numel={numel}")


def _topk_of(acc: Tensor, k: int, selector: str) -> tuple[Tensor, Tensor]:
    """(values fp32 [k], int64 indices [k]) of the k largest |acc|; `acc` is left as it is."""
    numel = acc.numel()
    if k == numel:  # everything is sent: no sort
        return acc.clone(), torch.arange(numel, device=acc.device)
    picked = _sampled_topk(acc, k) if selector == "sampled" else None
    if picked is None:
        _, idx = torch.topk(acc.abs(), k, sorted=False)
        values = acc.index_select(0, idx)
    else:
        values, idx = picked
    return values, idx


def _sampled_topk(acc: Tensor, k: int) -> tuple[Tensor, Tensor] | None:
    """(values, int64 indices) of the k largest |acc| via a sampled threshold; None: use exact topk.

    The threshold is the m-th largest of s sampled magnitudes, m set `_OVERSELECT_SIGMAS` binomial
    standard deviations above the s*k/N expected above the true k-th magnitude, so that the candidates
    (|acc| >= threshold) number slightly more than k with high probability. Every entry above the
    threshold is a candidate, so the exact top-k of the candidates is the top-k of acc.
    """
    numel = acc.numel()
    if numel < _SAMPLED_MIN_NUMEL:
        return None
    s = min(max(_MIN_SAMPLE, numel // _SAMPLE_DIVISOR), _MAX_SAMPLE)
    pos = torch.randint(numel, (s,), generator=_SAMPLE_GEN).to(acc.device)
    sample = acc.index_select(0, pos).abs_()
    f = k / numel
    mean, sd = s * f, math.sqrt(s * f * (1 - f))
    for sigmas in _OVERSELECT_SIGMAS:
        m = math.ceil(mean + sigmas * sd) + 1  # the m-th largest sampled magnitude is the threshold
        if m > s:
            return None  # the threshold would be about the smallest magnitude: nothing to skip
        thr = sample.kthvalue(s - m + 1).values.item()
        if not 0 < thr < math.inf:  # mostly zeros, or NaN / inf sampled: exact topk handles those
            return None
        cand = _at_least(acc, thr)
        if cand.numel() >= k:
            vals = acc.index_select(0, cand)
            if cand.numel() > k:
                _, top = torch.topk(vals.abs(), k, sorted=False)
                vals, cand = vals.index_select(0, top), cand.index_select(0, top)
            return vals, cand
    return None


def _at_least(acc: Tensor, thr: float) -> Tensor:
    """Ascending int64 indices i with |acc[i]| >= thr (thr > 0, an fp32 value), in one pass over acc.

    On CPU acc is scanned in cache-sized blocks into two small reused buffers (N-element temporaries
    cost more in page faults than in arithmetic): |x| thresholded to 0 below thr, then cast to a bool
    mask (a vectorised cast is several times cheaper than a comparison). `nonzero` then searches the
    mask 8 entries at a time through an int64 view; the few words that hold candidates are expanded
    once at the end.
    """
    if acc.device.type != "cpu":
        return torch.nonzero(acc.abs() >= thr).squeeze(1)
    # |x| > below  <=>  |x| >= thr, for fp32 x: below is the fp32 number just under thr.
    below = torch.nextafter(torch.tensor(thr, dtype=acc.dtype), torch.tensor(0.0, dtype=acc.dtype)).item()
    numel = acc.numel()
    block = min(numel, -(-_SCAN_BLOCK // 8) * 8)  # several blocks: a multiple of 8, so words stay aligned
    width = -(-block // 8) * 8
    mag = torch.empty(block, dtype=acc.dtype)
    mask = torch.zeros(width, dtype=torch.bool)
    words, bytes8 = mask.view(torch.int64), mask.view(-1, 8)
    hits, rows = [], []
    for start in range(0, numel, block):
        size = min(block, numel - start)
        part = torch.threshold_(torch.abs(acc[start:start + size], out=mag[:size]), below, 0.0)
        mask[:size].copy_(part)
        if size < width:
            mask[size:].zero_()
        hit = torch.nonzero(words).squeeze(1)
        if hit.numel():
            rows.append(bytes8.index_select(0, hit))
            hits.append(hit.add_(start // 8))
    if not hits:
        return torch.empty(0, dtype=torch.int64)
    bits = torch.nonzero(torch.cat(rows).view(-1)).squeeze(1)
    return torch.cat(hits).index_select(0, bits >> 3).mul_(8).add_(bits & 7)


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
