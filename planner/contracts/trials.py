"""Trials: which compressors trained like dense on a model's task, measured by training (`planner trial`).

A profile's compression error says how far a compressor moves one step's gradient; it does not rank how a
compressor trains over many steps with error feedback and momentum (docs/results/error-budget.md: on ResNet-18's
teacher task top-k 1%, error 0.925, ended below DDP's loss where PowerSGD rank 1, error 0.922, diverged). A trial
runs the plan that sends every group by one compressor, beside DDP, from the same initial weights on the same
batches, for the same samples, over a few repeats (each its own batches), and records each run's evaluation loss
curve. `planner solve --strategy auto --trials FILE` then keeps its plan among the compressors that trained like
dense, within the error of the loosest of them (`planner.strategies.budget`), by the least predicted step times the
samples each needed to reach DDP's half-way loss.

Schema (version 2; a loss is null where the run diverged; version 1, without curves, is read too):

    {
      "kind": "trials", "version": 1,
      "model": {"name", "fingerprint", "num_params", "numel"},
      "task": "digits", "world_size": 2, "samples": 40000, "lr": 0.05, "momentum": 0.9,
      "tolerance": 0.02,                            # how far above DDP's final loss still counts as like dense
      "reference": [0.0251, 0.0249, 0.0250],        # DDP's final loss, per repeat
      "compressors": {"fp16": [...], "powersgd:4": [...], "topk:0.01": [...]},  # the same repeats
      "curves": {"ddp": [[[0, 2.31], [1000, 1.2], ...], ...],   # per repeat: (samples applied, evaluation loss)
                 "fp16": [...], ...}                            # each curve's last loss is the final loss above
    }

A compressor trained like dense when every run of it finished and the upper end of the 90% interval of its final
loss over DDP's (Student's t over the repeats' log ratios, paired by repeat: the same batches) is at most
1 + tolerance: a result within the noise of the repeats is not taken as like dense. One repeat gives no interval,
so nothing passes on one.

Samples to DDP's half-way loss: in each repeat, the target is DDP's evaluation loss at half its samples; the samples
each run needed to reach it are read off its curve (interpolated linearly between evaluations), and a compressor's
ratio over DDP's is summarised as the final losses are (median, 90% interval over the repeats). A run that never
reached it, within all the samples, gives no ratio. `samples_factor` is what `--strategy auto` multiplies a plan's
predicted step by: the interval's upper end, at least 1 (a compressor is never credited with training faster); for
one that did not reach it in some repeat, the samples it ran over DDP's to that loss, a lower bound.
"""

from __future__ import annotations

import itertools
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

__all__ = ["DEFAULT_TOLERANCE", "TRIALS_KIND", "Curve", "Ratio", "TrialResult", "Trials"]

TRIALS_KIND, TRIALS_VERSION = "trials", 2
#: The versions read: 1 has no curves (no samples to DDP's half-way loss).
READ_VERSIONS = (1, 2)
#: How far above DDP's final loss at equal samples still counts as training like dense (the issue's goal: 2%).
DEFAULT_TOLERANCE = 0.02
#: The interval's level: two-sided 90%, so its upper end is a one-sided 95% bound.
LEVEL = 0.90
#: The most repeats a file may hold, and evaluations a curve (bounds for reading files).
MAX_REPEATS, MAX_EVALUATIONS = 1_000, 100_000
#: The key of DDP's curves in "curves".
DDP_KEY = "ddp"
#: Ratios over DDP's are held within [1 / MAX_RATIO, MAX_RATIO]. Beyond, they only say "never" or "at once", and a
#: file can hold losses whose quotient overflows (1e300 / 1e-300) or a run that reached the loss at 0 samples (log
#: 0); held, their logs, the interval's ends and the plan times weighed by them stay finite.
MAX_RATIO = 1e100
_LOG_LIMIT = math.log(MAX_RATIO)

#: One run's evaluations: (samples applied, evaluation loss or None where diverged), samples increasing.
Curve = tuple[tuple[int, float | None], ...]


@dataclass(frozen=True)
class Ratio:
    """A ratio over DDP's across the repeats: the median, and the 90% interval's ends (None with one repeat)."""

    median: float
    low: float | None
    high: float | None

    @classmethod
    def of(cls, ratios: Sequence[float]) -> Ratio:
        """Median of the paired ratios; Student's t interval over their logs (module docstring)."""
        return cls.of_logs(np.log(np.clip(np.asarray(ratios, dtype=float), 1 / MAX_RATIO, MAX_RATIO)))

    @classmethod
    def of_logs(cls, logs: Sequence[float] | np.ndarray) -> Ratio:
        """`of` from the ratios' logs (a quotient of losses is its logs' difference: it never under- or overflows)."""
        held = np.clip(np.asarray(logs, dtype=float), -_LOG_LIMIT, _LOG_LIMIT)
        median = _exp(float(np.median(held)))
        if len(held) < 2:  # no degrees of freedom: no interval
            return cls(median, None, None)
        half = float(stats.t.ppf((1 + LEVEL) / 2, len(held) - 1) * np.std(held, ddof=1) / math.sqrt(len(held)))
        low, high = (_exp(float(held.mean()) + s * half) for s in (-1, 1))
        return cls(median, low, high)

    def text(self) -> str:
        """"1.01 [0.99, 1.03]", or the median alone."""
        if self.low is None or self.high is None:
            return f"{self.median:.3g}"
        return f"{self.median:.3g} [{self.low:.3g}, {self.high:.3g}]"


@dataclass(frozen=True)
class TrialResult:
    """One compressor's trial: its final loss over DDP's (median, and the interval's ends; None where a run
    diverged or there was one repeat) and whether it trained like dense."""

    compressor: Compressor
    ratio: float | None
    low: float | None
    high: float | None
    passed: bool
    #: The samples it needed to reach DDP's half-way loss over DDP's (None: no curves, a run diverged or never
    #: reached it).
    samples: Ratio | None = None
    #: Why there is no samples ratio, where there are curves.
    samples_missing: str = ""

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

    def describe_samples(self) -> str:
        """"1.24x DDP's samples to its half-way loss [1.1, 1.4]", or why there is no such ratio ("" without curves)."""
        if self.samples is None:
            return self.samples_missing
        text = f"{self.samples.median:.3g}x DDP's samples to its half-way loss"
        if self.samples.low is not None and self.samples.high is not None:
            text += f" [{self.samples.low:.3g}, {self.samples.high:.3g}]"
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
    #: Each run's evaluation curve, per repeat: DDP's under "ddp", each compressor's under its name (None: a
    #: version 1 file, final losses only).
    curves: Mapping[str, tuple[Curve, ...]] | None = None

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
        if self.curves is not None:
            self._check_curves(self.curves)

    def _check_curves(self, curves: Mapping[str, tuple[Curve, ...]]) -> None:
        finals = {DDP_KEY: self.reference, **{str(c): v for c, v in self.compressors.items()}}
        if set(curves) != set(finals):
            raise SchemaError(f"trials.curves must hold a curve per repeat for {sorted(finals)}, got {sorted(curves)}")
        for key, runs in curves.items():
            if len(runs) != self.repeats:
                raise SchemaError(f"trials.curves[{key!r}] must hold one curve per repeat ({self.repeats}), got "
                                  f"{len(runs)}")
            for i, curve in enumerate(runs):
                where = f"trials.curves[{key!r}][{i}]"
                if not curve or any(b[0] <= a[0] for a, b in itertools.pairwise(curve)) or curve[0][0] < 0:
                    raise SchemaError(f"{where} must hold evaluations at increasing samples >= 0, got {len(curve)} "
                                      "of them out of order or none")
                if any(loss is not None and not (math.isfinite(loss) and loss > 0) for _, loss in curve):
                    raise SchemaError(f"{where} must hold losses > 0, or null where the run diverged")
                # DDP's run is the reference, and it did not diverge (its final loss is finite; a run that diverged
                # stays so): a null in its curve would leave its half-way loss, the samples' target, undefined
                if key == DDP_KEY and any(loss is None for _, loss in curve):
                    raise SchemaError(f"{where} must hold a loss at every evaluation: DDP's run is the reference and "
                                      "its final loss is finite; run `planner trial` again")
                if curve[-1][1] != finals[key][i]:
                    raise SchemaError(f"{where} must end at the final loss the file records ({finals[key][i]}), got "
                                      f"{curve[-1][1]}")

    @property
    def repeats(self) -> int:
        return len(self.reference)

    def result(self, compressor: Compressor) -> TrialResult:
        """How `compressor` trained beside DDP (module docstring).

        Raises:
            KeyError: no trial of it.
        """
        losses = self.compressors[compressor]
        samples, missing = self._samples_ratio(compressor)
        if any(x is None for x in losses):
            return TrialResult(compressor, None, None, None, passed=False, samples=samples, samples_missing=missing)
        final = Ratio.of_logs([math.log(x) - math.log(r) for x, r in zip(losses, self.reference, strict=True)
                               if x is not None])
        passed = final.high is not None and final.high <= 1 + self.tolerance
        return TrialResult(compressor, final.median, final.low, final.high, passed=passed, samples=samples,
                           samples_missing=missing)

    def _samples_ratio(self, compressor: Compressor) -> tuple[Ratio | None, str]:
        """The samples `compressor` needed to reach DDP's half-way loss over DDP's, per repeat (module docstring),
        summarised; or None and why not."""
        ratios, missing = self._repeat_ratios(compressor)
        return (None, missing) if ratios is None or missing else (Ratio.of(ratios), "")

    def _repeat_ratios(self, compressor: Compressor) -> tuple[list[float] | None, str]:
        """Per repeat, the samples `compressor` needed to reach DDP's half-way loss over DDP's; where a run never
        reached it, the samples it ran over DDP's (a lower bound), and why in the text. None: no ratio at all."""
        if self.curves is None:
            return None, ""
        ratios, missing = [], ""
        for ddp, run in zip(self.curves[DDP_KEY], self.curves[str(compressor)], strict=True):
            half = ddp[-1][0] / 2
            target = next(loss for n, loss in ddp if n >= half)
            assert target is not None  # DDP's curves hold no null (`_check_curves`)
            theirs, ours = samples_to(ddp, target), samples_to(run, target)
            if theirs is None or theirs <= 0:
                return None, "no samples ratio (DDP's half-way loss was no lower than its first evaluation)"
            if ours is None:
                missing = f"did not reach DDP's half-way loss within {run[-1][0]:,} samples"
                ours = float(run[-1][0])
            ratios.append(min(max(ours / theirs, 1 / MAX_RATIO), MAX_RATIO))
        return ratios, missing

    def samples_factor(self, compressor: Compressor) -> float | None:
        """What a plan sending `compressor` takes its predicted step times, for the samples it needs: the upper end
        of its samples ratio's interval, at least 1; where a run never reached DDP's half-way loss, the largest of
        the repeats' lower bounds (the samples it ran over DDP's to that loss: at least 2). None: not measured (no
        curves, no trial of it, or one repeat).
        """
        if self.curves is None or compressor not in self.compressors or self.repeats < 2:
            return None
        ratios, missing = self._repeat_ratios(compressor)
        if ratios is None:
            return None
        if missing:
            return max(1.0, *ratios)
        high = Ratio.of(ratios).high
        return None if high is None else max(1.0, high)

    def results(self) -> list[TrialResult]:
        return [self.result(c) for c in self.compressors]

    def passed(self) -> tuple[Compressor, ...]:
        """The compressors that trained like dense, in the file's order."""
        return tuple(r.compressor for r in self.results() if r.passed)

    def to_dict(self) -> dict[str, Any]:
        out = {"kind": TRIALS_KIND, "version": TRIALS_VERSION, "model": self.model.to_dict(), "task": self.task,
               "world_size": self.world_size, "samples": self.samples, "lr": self.lr, "momentum": self.momentum,
               "tolerance": self.tolerance, "reference": list(self.reference),
               "compressors": {str(c): list(v) for c, v in self.compressors.items()}}
        # null where there are none (made from a version 1 file): version 2 always has the field
        out["curves"] = None if self.curves is None else {
            k: [[list(point) for point in curve] for curve in runs] for k, runs in self.curves.items()}
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str = "trials") -> Trials:
        data = expect(data, dict, where)
        if data.get("version") == 1:
            data = {**data, "curves": None}
        check_fields(data, where, ["kind", "version", "model", "task", "world_size", "samples", "lr", "momentum",
                                   "tolerance", "reference", "compressors", "curves"])
        if data["kind"] != TRIALS_KIND:
            raise SchemaError(f"{where}.kind must be {TRIALS_KIND!r} (a file written by `planner trial`), got "
                              f"{data['kind']!r}")
        if data["version"] not in READ_VERSIONS:
            raise SchemaError(f"{where}.version {data['version']!r} is not supported (this planner reads "
                              f"{' and '.join(map(str, READ_VERSIONS))}); run `planner trial` again")
        compressors = expect(data["compressors"], dict, f"{where}.compressors")
        curves = None
        if data["curves"] is not None:
            curves = {k: tuple(_curve(c, f"{where}.curves[{k!r}][{i}]")
                               for i, c in enumerate(_bounded(runs, f"{where}.curves[{k!r}]", MAX_REPEATS)))
                      for k, runs in expect(data["curves"], dict, f"{where}.curves").items()}
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
                                for k, v in compressors.items()},
                   curves=curves)

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


def _exp(value: float) -> float:
    """e^value for the log of a ratio, held within [1 / MAX_RATIO, MAX_RATIO] (`math.exp` would raise beyond 709)."""
    return math.exp(min(max(value, -_LOG_LIMIT), _LOG_LIMIT))


def samples_to(curve: Curve, target: float) -> float | None:
    """The samples at which `curve` first reaches `target`, interpolated linearly from the evaluation before (None:
    never, or it diverged first)."""
    before: tuple[int, float] | None = None
    for n, loss in curve:
        if loss is None:
            return None
        if loss <= target:
            if before is None:
                return float(n)
            n0, loss0 = before
            return n0 + (loss0 - target) / (loss0 - loss) * (n - n0)
        before = (n, loss)
    return None


def _bounded(value: Any, where: str, most: int, what: str = "items") -> list[Any]:
    """A list of at most `most` `what` (a bound for reading files)."""
    items: list[Any] = expect(value, list, where)
    if len(items) > most:
        raise SchemaError(f"{where} must hold at most {most:,} {what}, got {len(items):,}")
    return items


def _curve(value: Any, where: str) -> Curve:
    out = []
    for i, point in enumerate(_bounded(value, where, MAX_EVALUATIONS)):
        pair = expect(point, list, f"{where}[{i}]")
        if len(pair) != 2:
            raise SchemaError(f"{where}[{i}] must be [samples, loss], got {pair!r}")
        loss = None if pair[1] is None else float(expect(pair[1], (int, float), f"{where}[{i}][1]"))
        out.append((expect_int(pair[0], f"{where}[{i}][0]", 0, 1 << 50), loss))
    return tuple(out)


def _losses(value: Any, where: str, *, nulls: bool = True) -> tuple[float | None, ...]:
    items = _bounded(value, where, MAX_REPEATS, "final losses")
    return tuple(None if (x is None and nulls) else float(expect(x, (int, float), f"{where}[{i}]"))
                 for i, x in enumerate(items))
