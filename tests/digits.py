"""scikit-learn's digits (1797 images of 8x8 pixels, 10 classes) as tensors, and K-FAC against SGD on
them: the small real task of the tests and of benchmarks/kfac_convergence.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from planner.runtime import KFACPreconditioner
from planner.types import InverseMethod

#: The hyperparameters a kfac-pytorch user brings (its defaults, and SGD as its examples run it).
KFAC_PYTORCH_HYPERPARAMETERS = {"lr": 0.01, "momentum": 0.9, "damping": 1e-3, "factor_decay": 0.95, "kl_clip": 1e-3}


def digits(size: int = 8, channels: int = 0) -> tuple[Tensor, Tensor]:
    """All 1797 digits: pixels scaled to [0, 1], upsampled (bilinear) to `size` x `size` when larger than 8;
    flat vectors [N, size²] with `channels` 0, else images [N, channels, size, size] (the gray repeated)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    if size != 8:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    x = x.flatten(1) if channels == 0 else x.expand(-1, channels, -1, -1).contiguous()
    return x, torch.tensor(data.target, dtype=torch.long)


def train_digits(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    kfac: bool,
    seed: int,
    steps: int = 100,
    batch_size: int = 64,
    method: InverseMethod = InverseMethod.EIGEN,
    inv_update_steps: int = 5,
    hyperparameters: dict[str, float] | None = None,
) -> tuple[list[float], float]:
    """SGD with momentum, with or without K-FAC, on batches drawn with `seed` (the same for both), as a
    kfac-pytorch user writes the loop. Returns the loss of every step's batch and the final training loss on
all the data (in training mode, so BatchNorm uses the data's statistics, not its lagging running ones)."""
    hp = {**KFAC_PYTORCH_HYPERPARAMETERS, **(hyperparameters or {})}
    opt = torch.optim.SGD(model.parameters(), lr=hp["lr"], momentum=hp["momentum"])
    precond = None
    if kfac:
        precond = KFACPreconditioner(model, lr=hp["lr"], damping=hp["damping"], factor_decay=hp["factor_decay"],
                                     kl_clip=hp["kl_clip"], method=method, inv_update_steps=inv_update_steps)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for _ in range(steps):
        index = torch.randint(0, len(x), (batch_size,), generator=gen)
        opt.zero_grad()
        loss = F.cross_entropy(model(x[index]), y[index])
        loss.backward()
        if precond is not None:
            precond.step()
        opt.step()
        losses.append(loss.item())
    if precond is not None:
        precond.remove_hooks()
    with torch.no_grad():  # the training loss: BatchNorm normalises with the data's own statistics
        final = F.cross_entropy(model(x), y).item()
    return losses, final
