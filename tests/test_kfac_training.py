"""K-FAC trains with the hyperparameters a kfac-pytorch user brings (SGD lr 0.01, momentum 0.9, damping 1e-3,
factor decay 0.95, KL clip 1e-3), because the factors follow kfac-pytorch's convention and a damping value
means the same here as there. With the old convention (G scaled by B², conv factors by s² and B²·s², running
averages started at the first factor) the same runs diverged: the MLP to losses of 10⁴ on digits within 100
steps and 14–170 on random data, the CNN spiking to 3.4–7.2 from 2.3.

Models: the built-in MLP and CNN shapes at reduced width (full size: benchmarks/kfac_convergence.py), 100
steps of batches drawn with the seed: 3 seeds where K-FAC is compared with SGD, 2 where the test asks only that
it does not diverge (the old convention diverged on every seed). Two tasks:

- digits (scikit-learn, upsampled to 28x28 for the MLP, 32x32x3 for the CNN): learnable;
- random data as the built-in workloads make it (normal inputs, uniform labels, a pool of 100 batches):
  SGD stays at ln 10 = 2.30 while K-FAC starts to fit the pool.

No run diverges. K-FAC ends below SGD where 100 steps give it something to win: the MLP on random data. On
digits the MLP under K-FAC is far ahead by step 50 and then oscillates (a clipped step has a fixed KL size
however small the gradient), so it trails SGD at step 100 on some seeds; the CNN on digits ends below SGD on
all 3 seeds with two threads per process but on 1 of 3 with one (a final training loss of 0.49 against SGD's
0.37 on seed 0): which one ends lower at step 100 is chaos, not a property. There the test asks only that K-FAC
does not diverge.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import Tensor, nn

from planner.types import InverseMethod
from tests.digits import digits, train_digits

STEPS = 100
#: A run diverges when some step's loss exceeds the first step's by this factor (the old convention:
#: 1.5x to 10⁴x; K-FAC fitting random data: up to 1.2x on its batches).
DIVERGED = 1.25


def narrow_mlp() -> nn.Module:
    """The built-in MLP's shape (784 in, three hidden layers, 10 classes) at width 256."""
    widths = (784, 256, 256, 256)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(256, 10))


def narrow_cnn() -> nn.Module:
    """The built-in CNN's shape (four 3x3 convolutions with BatchNorm, two Linear layers) at a quarter width."""

    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

    return nn.Sequential(
        *block(3, 8), *block(8, 8), nn.MaxPool2d(2), *block(8, 16), *block(16, 32), nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32 * 4, 64), nn.ReLU(inplace=True), nn.Linear(64, 10),
    )


def task(kind: str, data: str) -> tuple[Tensor, Tensor, int]:
    """(inputs, labels, batch size) of `kind`'s model on `data`."""
    batch = 64 if kind == "mlp" else 32
    if data == "digits":
        x, y = digits(28) if kind == "mlp" else digits(32, 3)
        return x, y, batch
    g = torch.Generator().manual_seed(0)
    shape = (784,) if kind == "mlp" else (3, 32, 32)
    return torch.randn(100 * batch, *shape, generator=g), torch.randint(0, 10, (100 * batch,), generator=g), batch


#: (model, data, K-FAC ends below SGD, seeds)
CASES = [("cnn", "digits", False, (0, 1)), ("mlp", "random", True, (0, 1, 2)), ("mlp", "digits", False, (0, 1))]


@pytest.mark.parametrize(("kind", "data", "ends_below_sgd", "seed"),
                         [(kind, data, below, seed) for kind, data, below, seeds in CASES for seed in seeds])
def test_kfac_with_kfac_pytorch_hyperparameters(kind: str, data: str, ends_below_sgd: bool, seed: int) -> None:
    x, y, batch = task(kind, data)
    make = narrow_mlp if kind == "mlp" else narrow_cnn
    finals = {}
    for kfac in (False, True) if ends_below_sgd else (True,):  # SGD only where K-FAC is compared with it
        torch.manual_seed(seed)
        losses, finals[kfac] = train_digits(make(), x, y, kfac=kfac, seed=seed, steps=STEPS, batch_size=batch,
                                            method=InverseMethod.EIGEN, inv_update_steps=5)
    assert all(math.isfinite(v) for v in losses)
    assert max(losses) < DIVERGED * losses[0], f"K-FAC rose from {losses[0]:.3f} to {max(losses):.3f}"
    if ends_below_sgd:
        assert finals[True] < finals[False], f"K-FAC ended at {finals[True]:.4g}, SGD at {finals[False]:.4g}"
