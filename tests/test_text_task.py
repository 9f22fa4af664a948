"""The character model on real text (the Python standard library's sources) and its task: held-out files, shifted
targets, and a loss that falls from ln 128 when the model trains."""

from __future__ import annotations

import math

import pytest
import torch

from planner.models import CHAR_SEQ, CHAR_VOCAB, build_workload, stdlib_text
from planner.tasks import TEXT_EVAL_WINDOWS, build_task
from planner.types import PlannerError


def test_the_text_is_the_standard_library_split_by_file() -> None:
    train, held_out = stdlib_text()
    assert len(train) >= 4 * len(held_out) > 0  # nine files in ten train (each side capped)
    assert int(train.max()) < CHAR_VOCAB and int(train.min()) >= 0
    text = bytes(train[:200_000].tolist()).decode("ascii")
    assert "def " in text and "import " in text  # Python source
    # the held-out files are other files: a long window of held-out text is not in the training text
    probe = bytes(held_out[1000:1000 + 200].tolist())
    assert probe not in bytes(train.tolist())


def test_charlm_batches_are_windows_with_the_next_characters() -> None:
    workload = build_workload("charlm", batch_size=4)
    x, y = workload.batch(seed=3)
    assert x.shape == y.shape == (4, CHAR_SEQ) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    logits = workload.module(x)
    assert logits.shape == (4, CHAR_SEQ, CHAR_VOCAB)
    assert not torch.equal(*workload.batch(seed=3)) and torch.equal(workload.batch(seed=3)[0], x)


def test_text_task_learns_from_ln_128() -> None:
    task = build_task("charlm", "text", batch_size=16)
    assert task.eval_batch[0].shape == (TEXT_EVAL_WINDOWS, CHAR_SEQ)
    model = task.workload.module
    start = task.eval_loss(model)
    assert start == pytest.approx(math.log(CHAR_VOCAB), abs=0.1)  # untrained: about uniform over 128 characters
    optimizer = torch.optim.SGD(model.parameters(), lr=task.lr, momentum=0.9)
    generator = torch.Generator().manual_seed(0)
    for _ in range(40):
        x, y = task.workload.make_batch(16, generator)
        optimizer.zero_grad()
        task.workload.loss_fn(model(x), y).backward()
        optimizer.step()
    assert task.eval_loss(model) < start - 1.0


def test_text_task_is_the_charlm_models() -> None:
    with pytest.raises(PlannerError, match="the text task trains the built-in charlm model, not mlp"):
        build_task("mlp", "text")
