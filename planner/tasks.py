"""Tasks whose loss means something, for judging lossy communication by the time it takes to reach a loss.

- "digits": the built-in `digits` model on scikit-learn's handwritten digits (1797 real 8x8 images); the
  evaluation loss is the loss over all of them.
- "text": the built-in `charlm` model on the Python standard library's own sources (`planner.models.stdlib_text`):
  training windows of 64 characters from nine files in ten, the evaluation loss on 256 windows spread evenly
  over the held-out files.
- "teacher": any built-in model (or `package.module:factory`) as the student of a fixed random teacher: a small
  random network labels the random inputs drawn by the model's own `make_batch` with the class (or, for a
  sequence, the per-token class) of its largest logit, its logits first centred by their mean over the first
  batch so that the labels spread over the classes. The teacher is small so that the student can learn it
  on a CPU in minutes: for images, a random linear map of the image average-pooled to 4x4; for token
  sequences, a random embedding of each token and a linear map onto the first 100 token ids (a function of
  the token: the LSTM must learn 10,000 tokens' labels); for vectors, a random linear map. (A copy of the
  student with other weights labels random images with one class, or with classes a student does not learn
  in thousands of samples.) The student learns from a fixed training set of such inputs and is evaluated on
  a held-out set of the same kind. A student with BatchNorm layers is evaluated with the statistics of a fixed
  slice of its training set under its current weights ("precise BN"), not its running ones, which follow the
  last few batches of 16 samples: judged with those, ResNet-18's held-out loss moved by a median 7% and up to
  50% between snapshots one or two steps apart (trials at lr 0.005, 2,400 samples).

No data is downloaded: the digits ship with scikit-learn, the text with Python, the rest is synthetic.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from planner.models import CHAR_SEQ, Batch, Workload, build_workload, digits_data, stdlib_text, text_windows
from planner.types import PlannerError

__all__ = ["TASKS", "Task", "build_task", "default_task", "recompute_batchnorm"]

#: The tasks `build_task` knows.
TASKS = ("digits", "text", "teacher")
#: Windows of held-out text the "text" task's loss is evaluated on.
TEXT_EVAL_WINDOWS = 256

#: Samples of the teacher's training and held-out sets, and the seeds of its weights and inputs.
TEACHER_TRAIN, TEACHER_EVAL = 2048, 256
#: Labels a token teacher uses (the first token ids).
TOKEN_LABELS = 100
_TEACHER_SEED, _INPUT_SEED, _EVAL_SEED = 90_001, 90_002, 90_003
#: Samples per forward pass while labelling (keeps the logits of a 10k-token vocabulary small).
_LABEL_CHUNK = 32
#: Training samples whose statistics a student's BatchNorm layers take before each evaluation (`Task.norm_inputs`).
NORM_SAMPLES = 128
#: The BatchNorm layers whose running statistics `recompute_batchnorm` replaces.
_BATCHNORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)


def default_task(model: str) -> str:
    """The task a model trains on unless told: the digits for `digits`, the text for `charlm`, else the teacher."""
    return {"digits": "digits", "charlm": "text"}.get(model, "teacher")


@dataclass(frozen=True, kw_only=True)
class Task:
    """A workload whose batches come from the task's training data, and the held-out batch it is judged on."""

    name: str
    workload: Workload
    eval_batch: Batch
    #: A learning rate of SGD with momentum 0.9 that learns the task in a few thousand samples (checked by hand:
    #: the digits 0.05; the LSTM 0.5 takes its teacher's loss from 9.2 to 4.3 in 1,600 samples; ResNet-18 0.02
    #: from 2.3 to about 1.5 in 3,000; the character model 1.0 takes its held-out loss from 4.84 to 1.57 in 6,400
    #: windows, batches of 16, one process).
    lr: float = 0.05
    #: Training inputs whose statistics replace the running ones of the module's BatchNorm layers before each
    #: evaluation (`recompute_batchnorm`); None: evaluated with the running ones.
    norm_inputs: torch.Tensor | None = None

    def eval_loss(self, module: torch.nn.Module) -> float:
        """The loss of `module` on the evaluation batch (no gradients; the module's mode as it is), its BatchNorm
        statistics first recomputed on `norm_inputs` where the task has them."""
        x, y = self.eval_batch
        with torch.no_grad():
            if self.norm_inputs is not None:
                recompute_batchnorm(module, self.norm_inputs)
            return float(self.workload.loss_fn(module(x), y))


def recompute_batchnorm(module: torch.nn.Module, inputs: torch.Tensor) -> None:
    """Set the running statistics of `module`'s BatchNorm layers to those of `inputs` under its current weights
    (one forward pass with those layers alone in training mode, averaging rather than blending); nothing else
    changes. A module without such layers (or only ones that keep no running statistics) is left as it is."""
    norms = [m for m in module.modules() if isinstance(m, _BATCHNORMS) and m.track_running_stats]
    if not norms:
        return
    saved = [(m, m.momentum, m.training) for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average: one pass sets the statistics to the batch's
        m.train(True)
    try:
        with torch.no_grad():
            module(inputs)
    finally:
        for m, momentum, training in saved:
            m.momentum = momentum
            m.train(training)


def build_task(model: str, task: str, *, batch_size: int | None = None) -> Task:
    """The `task` ("digits", "text" or "teacher") for `model` (its student; the same weights as `build_workload`).

    Raises:
        PlannerError: an unknown task, or "digits" or "text" with another model than theirs (digits, charlm).
    """
    workload = build_workload(model, batch_size=batch_size)
    match task:
        case "digits":
            if model != "digits":
                raise PlannerError(f"the digits task trains the built-in digits model, not {model}; use --task "
                                   "teacher for other models")
            return Task(name=task, workload=workload, eval_batch=digits_data(), lr=0.05)
        case "text":
            if model != "charlm":
                raise PlannerError(f"the text task trains the built-in charlm model, not {model}; use --task "
                                   "teacher for other models")
            _, held_text = stdlib_text()
            starts = torch.linspace(0, len(held_text) - CHAR_SEQ - 1, TEXT_EVAL_WINDOWS).long()
            return Task(name=task, workload=workload, eval_batch=text_windows(held_text, starts), lr=1.0)
        case "teacher":
            train, held_out = _teacher_data(model)
            tokens = not train[0].is_floating_point()
            return Task(name=task, workload=dataclasses.replace(
                workload, make_batch=functools.partial(_sample, train)), eval_batch=held_out,
                lr=0.5 if tokens else 0.02 if train[0].dim() == 4 else 0.05, norm_inputs=train[0][:NORM_SAMPLES])
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
    student = build_workload(model)
    inputs = _inputs(student, TEACHER_TRAIN, _INPUT_SEED)
    held_out = _inputs(student, TEACHER_EVAL, _EVAL_SEED)
    with torch.no_grad():
        classes = int(student.module(inputs[:1]).shape[-1])
        teacher = _teacher(inputs, classes)
        centre = teacher(inputs[:_LABEL_CHUNK]).reshape(-1, teacher(inputs[:1]).shape[-1]).mean(0)
        return (inputs, _labels(teacher, inputs, centre)), (held_out, _labels(teacher, held_out, centre))


def _inputs(student: Workload, n: int, seed: int) -> torch.Tensor:
    """`n` random inputs of the student's kind; images get a random brightness per quadrant and channel on top of
    their noise (the structure the image teacher labels)."""
    gen = torch.Generator().manual_seed(seed)
    inputs, _ = student.make_batch(n, gen)
    if inputs.dim() == 4 and inputs.is_floating_point():
        b, c, h, w = inputs.shape
        shades = torch.randn((b, c, 2, 2), generator=gen)
        inputs = inputs + torch.nn.functional.interpolate(shades, size=(h, w), mode="nearest")
    return inputs


def _teacher(inputs: torch.Tensor, classes: int) -> torch.nn.Module:
    """A small random network for inputs like `inputs`, with `classes` outputs (see the module docstring)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_TEACHER_SEED)
        if inputs.dtype in (torch.int32, torch.int64):  # token ids [B, S]
            vocab = int(inputs.max()) + 1
            return torch.nn.Sequential(torch.nn.Embedding(max(vocab, classes), 16),
                                       torch.nn.Linear(16, min(classes, TOKEN_LABELS)))
        if inputs.dim() == 4:  # images [B, C, H, W]
            return torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(2), torch.nn.Flatten(),
                                       torch.nn.Linear(inputs.shape[1] * 4, classes))
        return torch.nn.Linear(int(inputs[0].numel()), classes) if inputs.dim() == 2 else torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(int(inputs[0].numel()), classes))


def _labels(teacher: torch.nn.Module, inputs: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
    """The teacher's class (or per-token class) of every input: the largest centred logit."""
    out = []
    for start in range(0, len(inputs), _LABEL_CHUNK):
        logits = teacher(inputs[start : start + _LABEL_CHUNK])
        out.append((logits - centre).argmax(-1))
    return torch.cat(out)
