"""How far each compressor moves each layer's gradients, over a few real training steps on this rank's own batches
(`planner.kernels.error.ErrorMeter`, one per layer and compressor, with its error feedback carried from step to
step as the runtime carries it). `planner profile` gathers every rank's run into `CompressionErrors`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from planner.contracts.errors import CompressionErrors
from planner.costmodel.problem import topk_count
from planner.kernels.error import ErrorMeter
from planner.models import Workload
from planner.types import Compressor, CompressorKind

__all__ = ["ERROR_STEPS", "ERROR_WARMUP", "ErrorRun", "combine_error_runs", "layer_k", "measure_errors"]

#: Steps `planner profile` records the errors of, after `ERROR_WARMUP` steps that build up the error fed back.
ERROR_STEPS, ERROR_WARMUP = 6, 2
#: Seeds of the batches: its own per rank and step, apart from the layer phase's and the unused-parameter check's.
_SEED_BASE, _SEEDS_PER_RANK = 2_000_000, 100_000


@dataclass(frozen=True)
class ErrorRun:
    """One rank's squared norms: grad_sq (layers, steps) and per compressor input_sq, error_sq (layers, steps)."""

    grad_sq: np.ndarray
    input_sq: dict[str, np.ndarray]
    error_sq: dict[str, np.ndarray]


def measure_errors(
    workload: Workload,
    device: torch.device,
    layers: Sequence[tuple[str, Sequence[str]]],
    compressors: Sequence[Compressor],
    *,
    rank: int = 0,
    steps: int = ERROR_STEPS,
    warmup: int = ERROR_WARMUP,
    on_step: Callable[[], object] = lambda: None,
) -> ErrorRun:
    """Train `warmup + steps` SGD steps (momentum 0.9, lr 1e-3, as the layer phase) on this rank's batches; after
    each backward pass hand every layer's gradient (its parameters `layers[i][1]` flat, in order; zeros for a
    parameter without one) to a meter per compressor, and keep the squared norms of the last `steps` steps."""
    chosen = [c for c in compressors if c.kind is not CompressorKind.DENSE
              and not (c.kind is CompressorKind.TOPK and c.density is not None and c.density >= 1)]
    model = workload.module.to(device)
    params = dict(model.named_parameters())
    shapes = [[tuple(params[p].shape) for p in names] for _, names in layers]
    meters = {str(c): [ErrorMeter(s, c, device, k=layer_k(c, s), seed=i) for i, s in enumerate(shapes)] for c in chosen}
    grad_sq = np.zeros((len(layers), steps))
    input_sq = {c: np.zeros((len(layers), steps)) for c in meters}
    error_sq = {c: np.zeros((len(layers), steps)) for c in meters}
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    for step in range(warmup + steps):
        inputs, targets = (t.to(device) for t in workload.batch(seed=_SEED_BASE + rank * _SEEDS_PER_RANK + step))
        optimizer.zero_grad(set_to_none=True)
        workload.loss_fn(model(inputs), targets).backward()
        with torch.no_grad():
            for i, (_, names) in enumerate(layers):
                flat = torch.cat([_grad(params[p]).reshape(-1) for p in names]).float()
                for c, per_layer in meters.items():
                    sample = per_layer[i].observe(flat)
                    if step >= warmup:
                        input_sq[c][i, step - warmup] = sample.input_sq
                        error_sq[c][i, step - warmup] = sample.error_sq
                        grad_sq[i, step - warmup] = sample.grad_sq
                if not meters and step >= warmup:
                    grad_sq[i, step - warmup] = float(torch.dot(flat.double(), flat.double()))
        optimizer.step()
        on_step()
    optimizer.zero_grad(set_to_none=True)
    return ErrorRun(grad_sq=grad_sq, input_sq=input_sq, error_sq=error_sq)


def combine_error_runs(runs: Sequence[ErrorRun], layers: Sequence[str], warmup: int) -> CompressionErrors:
    """Every rank's run (in rank order) as the profile's record."""
    return CompressionErrors(
        layers=tuple(layers), warmup=warmup, grad_sq=np.stack([r.grad_sq for r in runs]),
        input_sq={c: np.stack([r.input_sq[c] for r in runs]) for c in runs[0].input_sq},
        error_sq={c: np.stack([r.error_sq[c] for r in runs]) for c in runs[0].error_sq})


def layer_k(compressor: Compressor, shapes: Sequence[tuple[int, ...]]) -> int | None:
    """What top-k sends of a layer of these shapes alone (None for the other compressors)."""
    if compressor.kind is not CompressorKind.TOPK:
        return None
    assert compressor.density is not None
    return topk_count(sum(math.prod(s) for s in shapes), compressor.density)


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)
