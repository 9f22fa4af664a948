"""Tasks whose loss means something, for judging lossy communication by the time it takes to reach a loss.

- "digits": the built-in `digits` model on scikit-learn's handwritten digits (1797 real 8x8 images); the
  evaluation loss is the loss over all of them.
- "teacher": any built-in model (or `package.module:factory`) as the student of a fixed random teacher: a copy
  of the same network with other weights labels random inputs drawn by the model's own `make_batch` (the
  class, or next token, with the largest logit, the logits first centred by their mean over the first
  batch, so that a random network's labels spread over the classes instead of all being one). The student
  learns from a fixed training set of such inputs and is evaluated on a held-out set of the same kind.

No data is downloaded: the digits ship with scikit-learn, the rest is synthetic.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from planner.models import Batch, Workload, build_workload, digits_data
from planner.types import PlannerError

__all__ = ["TASKS", "Task", "build_task"]

#: The tasks `build_task` knows.
TASKS = ("digits", "teacher")

#: Samples of the teacher's training and held-out sets, and the seeds of its weights and inputs.
TEACHER_TRAIN, TEACHER_EVAL = 1024, 256
_TEACHER_SEED, _INPUT_SEED, _EVAL_SEED = 90_001, 90_002, 90_003
#: Samples per forward pass while labelling (keeps the logits of a 10k-token vocabulary small).
_LABEL_CHUNK = 32


@dataclass(frozen=True, kw_only=True)
class Task:
    """A workload whose batches come from the task's training data, and the held-out batch it is judged on."""

    name: str
    workload: Workload
    eval_batch: Batch

    def eval_loss(self, module: torch.nn.Module) -> float:
        """The loss of `module` on the evaluation batch (no gradients; the module's mode as it is)."""
        x, y = self.eval_batch
        with torch.no_grad():
            return float(self.workload.loss_fn(module(x), y))


def build_task(model: str, task: str, *, batch_size: int | None = None) -> Task:
    """The `task` ("digits" or "teacher") for `model` (its student; the same weights as `build_workload`).

    Raises:
        PlannerError: an unknown task, or "digits" with another model than the built-in digits.
    """
    workload = build_workload(model, batch_size=batch_size)
    match task:
        case "digits":
            if model != "digits":
                raise PlannerError(f"the digits task trains the built-in digits model, not {model}; use --task "
                                   "teacher for other models")
            return Task(name=task, workload=workload, eval_batch=digits_data())
        case "teacher":
            train, held_out = _teacher_data(model)
            return Task(name=task, workload=dataclasses.replace(
                workload, make_batch=functools.partial(_sample, train)), eval_batch=held_out)
        case _:
            raise PlannerError(f"unknown task {task!r}; known: {', '.join(TASKS)}")


def _sample(data: Batch, n: int, generator: torch.Generator) -> Batch:
    """`n` samples of `data` drawn uniformly with replacement."""
    x, y = data
    index = torch.randint(0, len(x), (n,), generator=generator)
    return x[index], y[index]


@functools.cache
def _teacher_data(model: str) -> tuple[Batch, Batch]:
    """The teacher's training and held-out sets for `model` (built once per process: every variant of a bench
    trains on the same data)."""
    teacher = build_workload(model, seed=_TEACHER_SEED)
    teacher.module.eval()
    inputs, _ = teacher.make_batch(TEACHER_TRAIN, torch.Generator().manual_seed(_INPUT_SEED))
    held_out, _ = teacher.make_batch(TEACHER_EVAL, torch.Generator().manual_seed(_EVAL_SEED))
    with torch.no_grad():
        centre = teacher.module(inputs[:_LABEL_CHUNK]).reshape(-1, _classes(teacher, inputs)).mean(0)
        return ((inputs, _labels(teacher, inputs, centre)), (held_out, _labels(teacher, held_out, centre)))


def _classes(teacher: Workload, inputs: torch.Tensor) -> int:
    with torch.no_grad():
        return int(teacher.module(inputs[:1]).shape[-1])


def _labels(teacher: Workload, inputs: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
    """The teacher's class (or per-token class) of every input: the largest centred logit."""
    out = []
    for start in range(0, len(inputs), _LABEL_CHUNK):
        logits = teacher.module(inputs[start : start + _LABEL_CHUNK])
        out.append((logits - centre).argmax(-1))
    return torch.cat(out)
