"""How far a compressor moves what it sends: its error on one layer, step after step, with error feedback as the
runtime runs it.

Each step a compressor C is handed the input x it would send: x = g + e with error feedback (top-k's residual,
PowerSGD's error), x = g without (fp16). `ErrorMeter.observe(g)` returns three squared norms:

    grad_sq = |g|^2        input_sq = |x|^2        error_sq = |C(x) - x|^2

and keeps e = x - C(x) for the next step where the compressor has error feedback. error_sq / input_sq is the
compressor's contraction on the inputs it met (1 - delta of a delta-compressor, |C(x) - x|^2 <= (1 - delta) |x|^2,
the quantity error-feedback SGD's convergence bounds depend on); `planner.contracts.errors` weighs layers by their
gradients' energy.

The arithmetic is the runtime's own (`planner.kernels.compress`, `planner.kernels.topk`) on one rank with a world
size of 1: fp16 casts x (the runtime casts x / P, the same relative rounding away from fp16's subnormals); PowerSGD
approximates this rank's own matrices with its warm-started Qs (the runtime approximates the ranks' mean with one Q
they share); top-k keeps this rank's k largest. Dense sends x as it is: its error is 0, not measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from planner.kernels.compress import PowerSGDGroup, PowerSGDLayout, fp16_compress, fp16_decompress
from planner.kernels.topk import take_topk
from planner.types import Compressor, CompressorKind

__all__ = ["ErrorMeter", "ErrorSample", "squared_norm"]


class ErrorSample(NamedTuple):
    """One step of one compressor on one layer: |g|^2, |x|^2 (x = g plus the error fed back) and |C(x) - x|^2."""

    grad_sq: float
    input_sq: float
    error_sq: float


class ErrorMeter:
    """One compressor on one layer (its tensors' `shapes`, laid out flat in order), with its error-feedback state.

    Args:
        shapes: the layer's parameter shapes, in the order its flat gradient holds them.
        compressor: fp16, powersgd:R or topk:D (dense moves nothing: use no meter).
        device: where the state lives (the gradients' device).
        k: top-k's count of entries sent (`planner.costmodel.problem.topk_count` of the layer's elements and the
            density, as a plan's group has it); required for top-k, refused otherwise.
        seed: seeds PowerSGD's first random Qs, as the runtime's groups are seeded.
        selector: top-k's selector ("exact" or "sampled"; both keep the same entries up to ties).
    """

    def __init__(self, shapes: Sequence[Sequence[int]], compressor: Compressor, device: torch.device | str = "cpu",
                 *, k: int | None = None, seed: int = 0, selector: str = "exact") -> None:
        self.compressor = compressor
        self.selector = selector
        self.numel = sum(_numel(s) for s in shapes)
        self._residual: Tensor | None = None
        self._powersgd: PowerSGDGroup | None = None
        self._half: Tensor | None = None
        if (k is None) == (compressor.kind is CompressorKind.TOPK) or (k is not None and not 1 <= k <= self.numel):
            raise ValueError(f"top-k needs the k it sends (1 <= k <= {self.numel}), no other compressor takes one; "
                             f"got k={k} for {compressor}")
        self.k = k or 0
        match compressor.kind:
            case CompressorKind.FP16:
                self._half = torch.empty(self.numel, dtype=torch.float16, device=device)
            case CompressorKind.POWERSGD:
                assert compressor.rank is not None
                self._powersgd = PowerSGDGroup(PowerSGDLayout.of(shapes, compressor.rank), torch.device(device), seed)
            case CompressorKind.TOPK:
                self._residual = torch.zeros(self.numel, dtype=torch.float32, device=device)
            case kind:
                raise ValueError(f"{kind.value} sends its input unchanged: it has no compression error to measure")

    def observe(self, grad: Tensor, grad_sq: float | None = None) -> ErrorSample:
        """Compress `grad` (flat fp32, this layer's; only read) after the error fed back, keep the new error, and
        return the step's three squared norms (`grad_sq`: |grad|^2 where the caller has it, as `_sq` computes it:
        several meters of one layer share it)."""
        if grad.dim() != 1 or grad.numel() != self.numel or grad.dtype != torch.float32:
            raise ValueError(f"expected a flat fp32 gradient of {self.numel} elements, got {tuple(grad.shape)} "
                             f"{grad.dtype}")
        if grad_sq is None:
            grad_sq = _sq(grad)
        if self._half is not None:  # no error feedback: x = g
            out = torch.empty_like(grad)
            fp16_decompress(fp16_compress(grad, self._half, 1), out)
            return ErrorSample(grad_sq, grad_sq, _sq(out.sub_(grad)))
        if self._residual is not None:  # residual += g is x; the k largest are zeroed there, leaving x - C(x)
            acc = self._residual.add_(grad)
            input_sq = _sq(acc)
            take_topk(acc, self.k, selector=self.selector)
            return ErrorSample(grad_sq, input_sq, _sq(acc))
        group = self._powersgd
        assert group is not None
        group.compress(grad)  # the error buffer now holds x = e + g
        input_sq = _sq(group.error)
        group.middle(1)
        group.decompress(torch.empty_like(grad), 1)  # the error buffer: x - C(x)
        return ErrorSample(grad_sq, input_sq, _sq(group.error))


def squared_norm(t: Tensor) -> float:
    """|t|^2 as the meters compute it (in float64)."""
    return _sq(t)


def _sq(t: Tensor) -> float:
    """|t|^2 in float64 (a float32 sum over millions of elements loses digits the small errors need)."""
    return float(torch.dot(t.double(), t.double())) if t.numel() else 0.0


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
