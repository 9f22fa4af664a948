"""The K-FAC kernels that the profiler times and the runtime runs: factor rows and covariances, running
averages, decompositions and preconditioning (`planner.profilers.kfac_costs` measures exactly what
`planner.runtime.KFACPreconditioner` computes, and neither imports the other for it).

The factors follow kfac-pytorch's convention (and the K-FAC paper's expectations over the batch), so a
damping value means the same thing here as there:

- A = E[a aᵀ] over the rows a of the layer's input (a ones column appended for a bias); G = E[g gᵀ]
  over the rows g of the gradient of the loss with respect to the layer's output, as autograd delivers
  it (with a loss that is a mean over the local batch of B samples, each row carries that 1/B);
- for a Conv2d the rows are one per sample and output position, and both a (ones column included) and
  g are divided by the number of output positions s = H_out·W_out, as kfac-pytorch does;
- running averages start at the identity: the first update gives decay·I + (1 − decay)·A.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from planner.types import InverseMethod

__all__ = [
    "covariance",
    "decompose",
    "factor_dtype",
    "fold_factor",
    "input_covariance",
    "input_rows",
    "output_grad_rows",
    "precondition_eigen",
    "precondition_inverse",
    "symmetric_from_triangle",
]


def factor_dtype(param: Tensor) -> torch.dtype:
    """Factors and inverses are float64 for a float64 layer, float32 otherwise (fp16/bf16 included)."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def _patches(module: nn.Conv2d, x: Tensor) -> Tensor:
    """The convolution's input patches, (N, C * kh * kw, H' * W'), with its padding (any mode) applied."""
    if x.dim() == 3:
        x = x.unsqueeze(0)
    padding: Any = module.padding
    if isinstance(padding, str) or module.padding_mode != "zeros":
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, module._reversed_padding_repeated_twice, mode=mode)
        padding = 0
    return F.unfold(x, module.kernel_size, dilation=module.dilation, padding=padding, stride=module.stride)


def input_rows(module: nn.Module, x: Tensor, dtype: torch.dtype) -> Tensor:
    """The rows `a` whose covariance is A: inputs (or unfolded patches), with a ones column for the bias;
    a convolution's rows (bias column included) divided by its number of output positions."""
    x = x.detach().to(dtype)
    if isinstance(module, nn.Conv2d):
        patches = _patches(module, x)
        positions = patches.shape[2]
        a = patches.transpose(1, 2).reshape(-1, patches.shape[1])  # (N * H' * W', C * kh * kw)
    else:
        positions = 1
        a = x.reshape(-1, x.shape[-1])
    if isinstance(getattr(module, "bias", None), nn.Parameter):
        a = torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)
    return a / positions if positions > 1 else a


def input_covariance(module: nn.Module, x: Tensor, dtype: torch.dtype) -> Tensor:
    """A, equal to `covariance(input_rows(module, x, dtype))` without building the rows: a convolution's patch
    products are summed per sample from the unfolded input (no transposed copy of the patches), the bias
    row and column come from sums, and the scaling is applied to the d x d result."""
    x = x.detach().to(dtype)
    if isinstance(module, nn.Conv2d):
        patches = _patches(module, x)
        positions = patches.shape[2]
        products = torch.bmm(patches, patches.transpose(1, 2)).sum(0)  # sum over samples and positions
        sums = patches.sum(dim=(0, 2))
        count = patches.shape[0] * positions
    else:
        positions = 1
        rows = x.reshape(-1, x.shape[-1])
        products = rows.T @ rows
        sums = rows.sum(0)
        count = rows.shape[0]
    dim = products.shape[0]
    if isinstance(getattr(module, "bias", None), nn.Parameter):
        out = products.new_empty(dim + 1, dim + 1)
        out[:dim, :dim] = products
        out[:dim, dim] = sums
        out[dim, :dim] = sums
        out[dim, dim] = count
    else:
        out = products
    return out / max(count * positions * positions, 1)


def output_grad_rows(module: nn.Module, grad: Tensor, dtype: torch.dtype) -> Tensor:
    """The rows `g` whose covariance is G: output gradients as autograd gives them; for a convolution,
    channels last and divided by the number of output positions."""
    grad = grad.detach().to(dtype)
    if isinstance(module, nn.Conv2d):
        if grad.dim() == 3:
            grad = grad.unsqueeze(0)
        positions = grad.shape[2] * grad.shape[3]
        return grad.permute(0, 2, 3, 1).reshape(-1, grad.shape[1]) / positions
    return grad.reshape(-1, grad.shape[-1])


def covariance(rows: Tensor) -> Tensor:
    """rowsᵀ rows / number of rows: a factor from its rows."""
    return rows.T @ rows / max(rows.shape[0], 1)


def symmetric_from_triangle(flat: Tensor, rows: Tensor, cols: Tensor, out: Tensor) -> Tensor:
    """Fill `out` with the symmetric matrix whose upper triangle (at `rows`, `cols`) is `flat`."""
    out[rows, cols] = flat.to(out.dtype)
    out[cols, rows] = flat.to(out.dtype)
    return out


def fold_factor(running: Tensor | None, new: Tensor, decay: float) -> Tensor:
    """The running average of a factor: decay * running + (1 - decay) * new, in place; the first time
    (`running` None) it starts from the identity, as kfac-pytorch's does."""
    if running is None:
        running = torch.eye(new.shape[0], dtype=new.dtype, device=new.device)
    return running.mul_(decay).add_(new, alpha=1 - decay)


def decompose(matrix: Tensor, method: InverseMethod, damping: float, out: Tensor) -> None:
    """What an owner computes and broadcasts, written into the flat `out`: eigenvectors then eigenvalues
    (clamped at 0) for EIGEN; for INVERSE (matrix + damping I)⁻¹, its upper triangle, or all of it when `out`
    has room for d^2 values (whole factors)."""
    dim = matrix.shape[0]
    if method is InverseMethod.EIGEN:
        evals, q = torch.linalg.eigh(matrix)
        out[: dim * dim].view(dim, dim).copy_(q)
        out[dim * dim :].copy_(evals.clamp(min=0))
        return
    damped = matrix + damping * torch.eye(dim, dtype=matrix.dtype, device=matrix.device)
    chol, info = torch.linalg.cholesky_ex(damped)
    inv = torch.cholesky_inverse(chol) if int(info) == 0 else torch.linalg.inv(damped)
    if out.numel() == dim * dim:
        out.copy_(inv.reshape(-1))
        return
    rows, cols = torch.triu_indices(dim, dim, device=matrix.device)
    out.copy_(inv[rows, cols])


def precondition_eigen(grad: Tensor, qa: Tensor, ea: Tensor, qg: Tensor, eg: Tensor, damping: float) -> Tensor:
    """(G ⊗ A + damping)⁻¹ applied to a gradient matrix [W | b], from the factors' eigendecompositions."""
    v = qg.T @ grad @ qa
    v = v / (torch.outer(eg, ea) + damping)
    return qg @ v @ qa.T


def precondition_inverse(grad: Tensor, a_inv: Tensor, g_inv: Tensor) -> Tensor:
    """G⁻¹ [W | b] A⁻¹ with the damped inverses."""
    return g_inv @ grad @ a_inv
