"""The arithmetic of the fp16 and PowerSGD compressors, as the runtime runs it and the profiler times it.

fp16 (as PyTorch's `fp16_compress_hook`): the group's gradients are cast to fp16 and divided by the world
size in fp16, allreduced, and cast back into the fp32 buffer.

PowerSGD (Vogels et al., NeurIPS 2019; as PyTorch's `powerSGD_hook`, one group standing for one DDP
bucket): each tensor of the group is seen as a matrix M of shape (shape[0], numel / shape[0]); those
worth compressing (`should_compress`) are approximated at rank r, the others (biases, small matrices)
are sent whole. With error feedback the input is the gradient plus the error left by the previous
step, and the new error is the input less what was applied; with warm start each matrix keeps its Q
from step to step. One step of a group:

1. `compress`: input = error + gradient (in the error buffer); the uncompressed tensors' part of the
   input and P = M Q for every compressed matrix go into one send buffer (Q drawn at random on the
   first step, orthogonalised otherwise);
2. the send buffer is allreduced (sums of the uncompressed parts and of the Ps);
3. `middle`: the uncompressed sums are divided by the world size, each P is orthogonalised, and
   Q = M^T P is computed for every matrix;
4. the Qs are allreduced;
5. `decompress`: Q is divided by the world size, the output gets the averaged uncompressed tensors and
   M ~ P Q^T for every matrix, and the error becomes input - output.

PyTorch's hook sends the uncompressed tensors and the Ps in two allreduces; here they share one (the sums
are the same element by element). Everything else is its arithmetic, step for step, including the
random Qs of the first step (`numpy.random.RandomState(seed).randint` seeds torch's generator per group),
so that the two agree to the bit on the same tensors (tests/test_compressors.py checks it).

What a tensor gets is fixed by the group, not by the buffer that holds it: the uncompressed parts, the Ps and
the Qs are packed in the group's order, and the first Qs are drawn from the group's seed in the group's order,
one per compressed matrix of the group. A buffer that holds the group's tensors in another order, or only some
of them (a DDP bucket: `PowerSGDLayout.of(..., held=...)`), therefore computes on each tensor what the group's
own buffer computes, and sends the same Ps and Qs at the same places.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "MIN_COMPRESSION_RATE",
    "PowerSGDGroup",
    "PowerSGDLayout",
    "fp16_compress",
    "fp16_decompress",
    "orthogonalize",
    "should_compress",
]

#: A matrix is compressed only if it shrinks at least this much: (n + m) r * rate < n m (PowerSGD's default).
MIN_COMPRESSION_RATE = 2.0


def fp16_compress(source: Tensor, out: Tensor, world_size: int) -> Tensor:
    """Cast the fp32 `source` into the fp16 `out` and divide it by `world_size` there (DDP's hook divides
    after the cast, so that a sum of world_size halves cannot overflow where the fp32 values would not)."""
    out.copy_(source)
    return out.div_(world_size)


def fp16_decompress(half: Tensor, out: Tensor) -> Tensor:
    """Cast the allreduced fp16 `half` back into the fp32 `out`."""
    return out.copy_(half)


def should_compress(rows: int, cols: int, rank: int, min_compression_rate: float = MIN_COMPRESSION_RATE) -> bool:
    """Whether a rows x cols matrix is worth approximating at `rank` (PowerSGD's rule)."""
    return (rows + cols) * rank * min_compression_rate < rows * cols


def orthogonalize(matrices: Tensor) -> None:
    """Orthonormalise the columns of each matrix of a batch (b, n, r) in place, r <= n: Gram-Schmidt for
    r <= 2, a QR decomposition above (PowerSGD's choice; the same results up to rounding). A column of zeros stays
    zeros: PyTorch's hook divides it by its norm into NaNs (a matrix whose gradient is zero on every rank, a
    parameter no rank used), which its warm start then carries into every later step."""
    batch, _, rank = matrices.shape
    if rank <= 2:
        for i in range(rank):
            col = matrices[:, :, i : i + 1]
            norm = torch.norm(col, dim=1, keepdim=True)
            col /= torch.where(norm > 0, norm, torch.ones_like(norm))  # the same division wherever norm > 0
            if i + 1 < rank:
                rest = matrices[:, :, i + 1 :]
                rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
        return
    r_factor = torch.empty(batch, rank, rank, device=matrices.device, dtype=matrices.dtype)
    torch.linalg.qr(matrices, out=(matrices, r_factor))


@dataclass(frozen=True)
class PowerSGDLayout:
    """Where each tensor of a group lives in its flat buffer, which are compressed, where their P and Q live, and
    which of the group's first random Qs each matrix takes.

    Attributes:
        rank: the rank asked for (each matrix uses min(rank, n, m)).
        matrices: per compressed tensor held (offset in the flat buffer, n, m, r, offset of P, offset of Q),
            in the group's order.
        uncompressed: per tensor held and sent whole (offset in the flat buffer, numel), in the group's order.
        numel: elements of the flat buffer.
        uncompressed_numel: elements sent whole (the head of the send buffer).
        p_numel, q_numel: elements of all the Ps (after the uncompressed ones in the send buffer) and Qs.
        draws: the shape (m, r) of each of the group's first random Qs, in the group's order (one per compressed
            matrix of the whole group, held or not).
        drawn: per entry of `matrices`, the index in `draws` of its first Q.
    """

    rank: int
    matrices: tuple[tuple[int, int, int, int, int, int], ...]
    uncompressed: tuple[tuple[int, int], ...]
    numel: int
    uncompressed_numel: int
    p_numel: int
    q_numel: int
    draws: tuple[tuple[int, int], ...]
    drawn: tuple[int, ...]

    @classmethod
    def of(cls, shapes: Sequence[Sequence[int]], rank: int, min_compression_rate: float = MIN_COMPRESSION_RATE,
           *, held: Sequence[int] | None = None) -> PowerSGDLayout:
        """The layout of a group of tensors of `shapes` (in the group's order) in a flat buffer: all of them one
        after the other in that order, or, with `held`, the tensors it lists (indices into `shapes`, each at most
        once, in the buffer's order): a DDP bucket that holds the group's tensors in another order, or part of
        them. Either way each tensor gets what it gets in the group's own buffer (see the module docstring)."""
        if rank < 1:
            raise ValueError(f"`rank >= 1` must hold, but got rank={rank}")
        sizes = []
        for shape in shapes:
            numel = 1
            for d in shape:
                numel *= int(d)
            sizes.append(numel)
        order = list(range(len(shapes))) if held is None else [int(i) for i in held]
        if len(set(order)) != len(order) or any(not 0 <= i < len(shapes) for i in order):
            raise ValueError(f"`held` must list distinct indices of the {len(shapes)} shapes, but got {list(order)}")
        offset_of, offset = {}, 0
        for i in order:
            offset_of[i] = offset
            offset += sizes[i]
        matrices, uncompressed, draws, drawn = [], [], [], []
        p_offset = q_offset = unc = 0
        for i, (shape, numel) in enumerate(zip(shapes, sizes, strict=True)):
            if len(shape) >= 2 and numel > 0:
                n = int(shape[0])
                m = numel // n
                r = min(rank, n, m)
                if should_compress(n, m, r, min_compression_rate):
                    draws.append((m, r))
                    if i in offset_of:
                        matrices.append((offset_of[i], n, m, r, p_offset, q_offset))
                        drawn.append(len(draws) - 1)
                        p_offset += n * r
                        q_offset += m * r
                    continue
            if i in offset_of:
                uncompressed.append((offset_of[i], numel))
                unc += numel
        return cls(rank=rank, matrices=tuple(matrices), uncompressed=tuple(uncompressed), numel=offset,
                   uncompressed_numel=unc, p_numel=p_offset, q_numel=q_offset, draws=tuple(draws),
                   drawn=tuple(drawn))

    @property
    def send_numel(self) -> int:
        """Elements of the first allreduce: the uncompressed tensors, then every P."""
        return self.uncompressed_numel + self.p_numel

    @property
    def compresses(self) -> bool:
        """Whether some tensor is approximated (else the group is an allreduce of its input, and no Q)."""
        return bool(self.matrices)


class PowerSGDGroup:
    """One group's PowerSGD state (error, Qs, send buffer) and its steps; see the module docstring.

    Args:
        layout: the group's tensors.
        device: where the buffers live (the group's).
        seed: the group's: seeds torch's generator for the random Qs of the first step, drawn in the group's
            order (PowerSGD's hook draws it with `state.rng.randint(1_000_000_000)` from a RandomState; the runtime
            draws it the same way, one per group in plan order).
    """

    __slots__ = ("_m_shapes", "error", "fresh", "layout", "p_views", "q", "q_views", "seed", "send")

    def __init__(self, layout: PowerSGDLayout, device: torch.device, seed: int) -> None:
        self.layout = layout
        self.seed = int(seed)
        self.error = torch.zeros(layout.numel, dtype=torch.float32, device=device)
        self.send = torch.zeros(layout.send_numel, dtype=torch.float32, device=device)
        self.q = torch.zeros(layout.q_numel, dtype=torch.float32, device=device)
        unc = layout.uncompressed_numel
        self.p_views = [self.send[unc + p : unc + p + n * r].view(1, n, r) for _, n, _, r, p, _ in layout.matrices]
        self.q_views = [self.q[q : q + m * r].view(1, m, r) for _, _, m, r, _, q in layout.matrices]
        self.fresh = True  # the Qs are drawn at random on the first step

    def _first_draws(self) -> list[Tensor]:
        """The group's random Qs of the first step, in the group's order (as far as this buffer's matrices need)."""
        wanted = max(self.layout.drawn) + 1
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return [torch.randn(1, m, r, device="cpu", dtype=torch.float32) for m, r in self.layout.draws[:wanted]]

    def _matrices(self) -> list[Tensor]:
        """The compressed tensors of the input (the error buffer), as (1, n, m) views."""
        return [self.error[o : o + n * m].view(1, n, m) for o, n, m, _, _, _ in self.layout.matrices]

    def compress(self, source: Tensor) -> Tensor:
        """Step 1: input = error + `source` (flat fp32, the group's gradients); return the send buffer
        (uncompressed input, then P = M Q per matrix)."""
        self.error.add_(source)
        at = 0
        for offset, numel in self.layout.uncompressed:
            self.send[at : at + numel].copy_(self.error[offset : offset + numel])
            at += numel
        if not self.layout.compresses:
            return self.send
        if self.fresh:  # the group's draws in the group's order, each matrix taking its own
            drawn = self._first_draws()
            for q, j in zip(self.q_views, self.layout.drawn, strict=True):
                q.copy_(drawn[j])
                orthogonalize(q)
            self.fresh = False
        else:
            redrawn: list[Tensor] | None = None
            for q, j in zip(self.q_views, self.layout.drawn, strict=True):
                if not bool(q.any()):
                    # Its matrix was zero on every rank last step (a parameter no rank used): Q = M^T P is zero
                    # everywhere alike, and a zero Q would approximate every later gradient by zero. It starts
                    # again from its first draw, the same on every rank.
                    redrawn = redrawn or self._first_draws()
                    q.copy_(redrawn[j])
                orthogonalize(q)
        for m, q, p in zip(self._matrices(), self.q_views, self.p_views, strict=True):
            torch.bmm(m, q, out=p)
        return self.send

    def middle(self, world_size: int) -> Tensor:
        """Step 3, once the send buffer holds the sums: average the uncompressed part, orthogonalise each P,
        Q = M^T P; return the Q buffer (to allreduce)."""
        self.send[: self.layout.uncompressed_numel].div_(world_size)
        for p in self.p_views:
            orthogonalize(p)
        for m, p, q in zip(self._matrices(), self.p_views, self.q_views, strict=True):
            torch.bmm(m.transpose(1, 2), p, out=q)
        return self.q

    def decompress(self, out: Tensor, world_size: int) -> Tensor:
        """Step 5, once the Q buffer holds the sums: write the averaged approximation into `out` (flat fp32,
        the group's) and keep input - out as the error."""
        if self.layout.compresses:
            self.q.div_(world_size)
        at = 0
        for offset, numel in self.layout.uncompressed:
            out[offset : offset + numel].copy_(self.send[at : at + numel])
            at += numel
        for (offset, n, m, _, _, _), p, q in zip(self.layout.matrices, self.p_views, self.q_views, strict=True):
            torch.bmm(p, q.transpose(1, 2), out=out[offset : offset + n * m].view(1, n, m))
        return self.error.sub_(out)
