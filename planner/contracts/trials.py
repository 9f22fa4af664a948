"""Trials: which compressors trained like dense on a model's task, measured by training (`planner trial`).

A profile's compression error says how far a compressor moves one step's gradient; it does not rank how a
compressor trains over many steps with error feedback and momentum (docs/results/error-budget.md: on ResNet-18's
teacher task top-k 1%, error 0.925, ended below DDP's loss where PowerSGD rank 1, error 0.922, diverged). A trial
runs the plan that sends every group by one compressor, beside DDP, from the same initial weights on the same
batches, for the same samples, over a few repeats (each its own batches), and records each run's final evaluation
loss. `planner solve --strategy auto --trials FILE` then keeps its plan among the compressors that trained like
dense, within the error of the loosest of them (`planner.strategies.budget`).

Schema (version 1; a final loss is null where the run diverged):

    {
      "kind": "trials", "version": 1,
      "model": {"name", "fingerprint", "num_params", "numel"},
      "task": "digits", "world_size": 2, "samples": 40000, "lr": 0.05, "momentum": 0.9,
      "tolerance": 0.02,                            # how far above DDP's final loss still counts as like dense
      "reference": [0.0251, 0.0249, 0.0250],        # DDP's final loss, per repeat
      "compressors": {"fp16": [...], "powersgd:4": [...], "topk:0.01": [...]}   # the same repeats
    }

A compressor trained like dense when every run of it finished and the upper end of the 90% interval of its final
loss over DDP's (Student's t over the repeats' log ratios, paired by repeat: the same batches) is at most
1 + tolerance: a result within the noise of the repeats is not taken as like dense. One repeat gives no interval,
so nothing passes on one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from planner.contracts.fingerprint import ModelInfo
from planner.contracts.jsonio import check_fields, expect, expect_int, read_json, write_json_atomic
from planner.contracts.plan import parse_compressor
from planner.types import Compressor, CompressorKind, SchemaError

__all__ = ["DEFAULT_TOLERANCE", "TRIALS_KIND", "TrialResult", "Trials"]

TRIALS_KIND, TRIALS_VERSION = "trials", 1
#: How far above DDP's final loss at equal samples still counts as training like dense (the issue's goal: 2%).
DEFAULT_TOLERANCE = 0.02
#: The interval's level: two-sided 90%, so its upper end is a one-sided 95% bound.
LEVEL = 0.90
#: The most repeats a file may hold (a bound for reading files).
MAX_REPEATS = 1_000


@dataclass(frozen=True)
class TrialResult:
    """One compressor's trial: its final loss over DDP's (median, and the interval's ends; None where a run
    diverged or there was one repeat) and whether it trained like dense."""

    compressor: Compressor
    ratio: float | None
    low: float | None
    high: float | None
    passed: bool

    def describe(self) -> str:
        """"1.01x DDP's final loss [0.99, 1.03]", or why there is no ratio."""
        if self.ratio is None:
            return "diverged (a run ended without a finite loss)"
        if self.low is None or self.high is None:
            return f"{self.ratio:.3g}x DDP's final loss (one repeat: no interval)"
        text = f"{self.ratio:.3g}x DDP's final loss [{self.low:.3g}, {self.high:.3g}]"
        if not self.passed and self.low <= 1 < self.high:
            text += ", not beyond the noise of the repeats"
        return text


@dataclass(frozen=True, kw_only=True)
class Trials:
    """The final losses of DDP and of each compressor sent on every group, per repeat (module docstring)."""

    model: ModelInfo
    task: str
    world_size: int
    samples: int
    lr: float
    momentum: float
    reference: tuple[float, ...]
    compressors: Mapping[Compressor, tuple[float | None, ...]]
    tolerance: float = DEFAULT_TOLERANCE

    def __post_init__(self) -> None:
        repeats = len(self.reference)
        if not 1 <= repeats <= MAX_REPEATS:
            raise SchemaError(f"trials.reference must hold 1 to {MAX_REPEATS:,} final losses, got {repeats}")
        if not all(math.isfinite(x) and x > 0 for x in self.reference):
            raise SchemaError("trials.reference must hold DDP's final losses, finite and > 0; DDP did not train "
                              "this task: run the trial again with a lower --lr")
        for c, losses in self.compressors.items():
            if c.kind is CompressorKind.DENSE:
                raise SchemaError("trials.compressors must not hold dense: DDP is the reference")
            if len(losses) != repeats:
                raise SchemaError(f"trials.compressors[{str(c)!r}] must hold one final loss per repeat ({repeats}), "
                                  f"got {len(losses)}")
            if not all(x is None or (math.isfinite(x) and x > 0) for x in losses):
                raise SchemaError(f"trials.compressors[{str(c)!r}] must hold final losses > 0, or null where a run "
                                  f"diverged, got {list(losses)}")
        if not (math.isfinite(self.tolerance) and 0 <= self.tolerance < 1):
            raise SchemaError(f"trials.tolerance must be in [0, 1), got {self.tolerance}")
        if not (self.lr > 0 and math.isfinite(self.lr) and 0 <= self.momentum < 1):
            raise SchemaError(f"trials.lr must be > 0 and trials.momentum in [0, 1), got {self.lr}, {self.momentum}")

    @property
    def repeats(self) -> int:
        return len(self.reference)

    def result(self, compressor: Compressor) -> TrialResult:
        """How `compressor` trained beside DDP (module docstring).

        Raises:
            KeyError: no trial of it.
        """
        losses = self.compressors[compressor]
        if any(x is None for x in losses):
            return TrialResult(compressor, None, None, None, passed=False)
        logs = np.log(np.array(losses, dtype=float) / np.array(self.reference))
        ratio = float(np.exp(np.median(logs)))
        if len(logs) < 2:
            return TrialResult(compressor, ratio, None, None, passed=False)
        half = float(stats.t.ppf((1 + LEVEL) / 2, len(logs) - 1) * np.std(logs, ddof=1) / math.sqrt(len(logs)))
        low, high = (float(np.exp(logs.mean() + s * half)) for s in (-1, 1))
        return TrialResult(compressor, ratio, low, high, passed=high <= 1 + self.tolerance)

    def results(self) -> list[TrialResult]:
        return [self.result(c) for c in self.compressors]

    def passed(self) -> tuple[Compressor, ...]:
        """The compressors that trained like dense, in the file's order."""
        return tuple(r.compressor for r in self.results() if r.passed)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": TRIALS_KIND, "version": TRIALS_VERSION, "model": self.model.to_dict(), "task": self.task,
                "world_size": self.world_size, "samples": self.samples, "lr": self.lr, "momentum": self.momentum,
                "tolerance": self.tolerance, "reference": list(self.reference),
                "compressors": {str(c): list(v) for c, v in self.compressors.items()}}

    @classmethod
    def from_dict(cls, data: Any, where: str = "trials") -> Trials:
        data = expect(data, dict, where)
        check_fields(data, where, ["kind", "version", "model", "task", "world_size", "samples", "lr", "momentum",
                                   "tolerance", "reference", "compressors"])
        if data["kind"] != TRIALS_KIND:
            raise SchemaError(f"{where}.kind must be {TRIALS_KIND!r} (a file written by `planner trial`), got "
                              f"{data['kind']!r}")
        if data["version"] != TRIALS_VERSION:
            raise SchemaError(f"{where}.version {data['version']!r} is not supported (this planner reads "
                              f"{TRIALS_VERSION}); run `planner trial` again")
        compressors = expect(data["compressors"], dict, f"{where}.compressors")
        return cls(model=ModelInfo.from_dict(data["model"], f"{where}.model"),
                   task=expect(data["task"], str, f"{where}.task"),
                   world_size=expect_int(data["world_size"], f"{where}.world_size", 1, 1 << 20),
                   samples=expect_int(data["samples"], f"{where}.samples", 1, 1 << 40),
                   lr=float(expect(data["lr"], (int, float), f"{where}.lr")),
                   momentum=float(expect(data["momentum"], (int, float), f"{where}.momentum")),
                   tolerance=float(expect(data["tolerance"], (int, float), f"{where}.tolerance")),
                   reference=tuple(x for x in _losses(data["reference"], f"{where}.reference", nulls=False)
                                   if x is not None),
                   compressors={parse_compressor(k, f"{where}.compressors"): _losses(v, f"{where}.compressors[{k!r}]")
                                for k, v in compressors.items()})

    def save(self, path: str | Path) -> Path:
        return write_json_atomic(path, self.to_dict(), "trials")

    @classmethod
    def load(cls, path: str | Path) -> Trials:
        """Read and validate (data only: nothing in the file runs)."""
        data = read_json(path, "trials")
        try:
            return cls.from_dict(data)
        except SchemaError as exc:
            raise type(exc)(f"trials file {path}: {exc}") from None


def _losses(value: Any, where: str, *, nulls: bool = True) -> tuple[float | None, ...]:
    items: Sequence[Any] = expect(value, list, where)
    if len(items) > MAX_REPEATS:
        raise SchemaError(f"{where} must hold at most {MAX_REPEATS:,} final losses, got {len(items):,}")
    return tuple(None if (x is None and nulls) else float(expect(x, (int, float), f"{where}[{i}]"))
                 for i, x in enumerate(items))
