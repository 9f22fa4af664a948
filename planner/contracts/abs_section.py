"""The `abs` section of a plan: ABS-SGD's round trigger and micro-batch, and what each variant is predicted to do.

ABS-SGD (delayed synchronous SGD with adaptive batch size) runs in rounds. In a round every worker computes
micro-batches of `micro_batch` samples on the current parameters and sums their gradients; the round ends on
the trigger, the same rule on every rank: at least `min_micro_batches` micro-batches, then more until the
previous round's exchange has finished, at most `max_micro_batches` (null: no cap). At the end of a round the
worker sends (sum of gradients, sample count) to the exchange, applies the previous round's sample-weighted
mean, and goes on. A fast worker therefore computes more micro-batches than a slow one and nobody waits for
the allreduce: it runs behind the next round's compute.

The batch trigger (`round_samples` set) ends rounds by size instead: every round is about `round_samples`
samples, each worker's part in proportion to its speed as measured in the run, and a worker whose part is done
before the previous exchange waits for it. Rounds then stay at the global batch the user chose where the
exchange trigger would stretch them to hide a slow exchange (samples beyond the batch the task may not use).

Schema (inside the plan, version 1 like the plan):

    "abs": {
      "global_batch": 256,                 # the samples per round the user aimed at (--global-batch)
      "micro_batch": 32,
      "min_micro_batches": 2,
      "max_micro_batches": 32 | null,
      "round_samples": 256 | null,         # the batch trigger (below); null or absent: the exchange trigger
      "predicted": {                       # one entry per variant, the same model for all (planner.strategies.abs_plan)
        "abs-sgd":           {"round_s", "samples_per_s", "samples": [per rank, per round], "idle_s": [per rank]},
        "sync-equal":        {...},        # synchronous SGD, global_batch split equally
        "sync-proportional": {...}         # synchronous SGD, global_batch split by measured speed
      }
    }

`samples` is a worker's expected samples per round (its share is samples / sum), `idle_s` its expected seconds
per round spent waiting for others (not computing, not updating).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from planner.contracts.jsonio import check_fields, expect, expect_int, expect_time
from planner.types import PlanMismatchError, SchemaError

__all__ = ["ABS_VARIANTS", "MAX_GLOBAL_BATCH", "TRIGGERS", "ABSSection", "VariantPrediction"]

#: How a plan may end rounds (`planner solve --strategy abs --trigger`): the batch trigger (`round_samples`),
#: the exchange trigger, or whichever is predicted faster.
TRIGGERS = ("batch", "exchange", "best")
#: The variants every ABS plan predicts: ABS-SGD first, then the synchronous baselines.
ABS_VARIANTS = ("abs-sgd", "sync-equal", "sync-proportional")
MAX_GLOBAL_BATCH = 2**31


@dataclass(frozen=True)
class VariantPrediction:
    """One training variant under the ABS model: a round (an iteration for synchronous SGD) and its samples."""

    round_s: float
    samples: tuple[float, ...]  # [rank] expected samples per round
    idle_s: tuple[float, ...]  # [rank] expected seconds per round waiting for others

    def __post_init__(self) -> None:
        if not self.samples or len(self.samples) != len(self.idle_s):
            raise SchemaError("a variant prediction needs samples and idle_s for every rank, of the same length")
        if not (math.isfinite(self.round_s) and self.round_s > 0):
            raise SchemaError(f"a variant's round_s must be a time > 0, got {self.round_s}")
        if any(not (math.isfinite(s) and s >= 0) for s in self.samples) or sum(self.samples) <= 0:
            raise SchemaError(f"a variant's samples must be finite, >= 0 and not all 0, got {list(self.samples)}")
        if any(not (math.isfinite(t) and t >= 0) for t in self.idle_s):
            raise SchemaError(f"a variant's idle_s must be times >= 0, got {list(self.idle_s)}")

    @property
    def samples_per_s(self) -> float:
        """The cluster's samples per second."""
        return sum(self.samples) / self.round_s

    @property
    def shares(self) -> tuple[float, ...]:
        """Each worker's fraction of a round's samples."""
        total = sum(self.samples)
        return tuple(s / total for s in self.samples)

    @property
    def idle_fraction(self) -> tuple[float, ...]:
        """Each worker's fraction of the round spent waiting."""
        return tuple(t / self.round_s for t in self.idle_s)

    def to_dict(self) -> dict[str, Any]:
        return {"round_s": self.round_s, "samples_per_s": self.samples_per_s, "samples": list(self.samples),
                "idle_s": list(self.idle_s)}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> VariantPrediction:
        expect(data, dict, where)
        check_fields(data, where, ["round_s", "samples", "idle_s"], ["samples_per_s"])  # samples_per_s: derived

        def numbers(key: str) -> tuple[float, ...]:
            values = expect(data[key], list, f"{where}.{key}")
            return tuple(float(expect(v, (int, float), f"{where}.{key}[{i}]")) for i, v in enumerate(values))

        try:
            return cls(round_s=expect_time(data["round_s"], f"{where}.round_s"), samples=numbers("samples"),
                       idle_s=numbers("idle_s"))
        except SchemaError as exc:
            raise SchemaError(f"{where}: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class ABSSection:
    """ABS-SGD's decisions for one model on one cluster, and the predictions of it and its baselines."""

    global_batch: int
    micro_batch: int
    min_micro_batches: int
    max_micro_batches: int | None
    predicted: dict[str, VariantPrediction]
    round_samples: int | None = None  # the batch trigger's samples per round (None: the exchange trigger)

    def __post_init__(self) -> None:
        if not 1 <= self.micro_batch <= self.global_batch <= MAX_GLOBAL_BATCH:
            raise SchemaError(f"abs needs `1 <= micro_batch <= global_batch`, but got micro_batch="
                              f"{self.micro_batch}, global_batch={self.global_batch}")
        if self.min_micro_batches < 1 or (self.max_micro_batches is not None
                                          and self.max_micro_batches < self.min_micro_batches):
            raise SchemaError(f"abs needs `1 <= min_micro_batches <= max_micro_batches`, but got "
                              f"({self.min_micro_batches}, {self.max_micro_batches})")
        if self.round_samples is not None and not 1 <= self.round_samples <= MAX_GLOBAL_BATCH:
            raise SchemaError(f"abs.round_samples must be null or a whole number >= 1, got {self.round_samples}")
        missing = [v for v in ABS_VARIANTS if v not in self.predicted]
        if missing:
            raise SchemaError(f"abs.predicted lacks the variant(s) {missing}; every ABS plan predicts {ABS_VARIANTS}")
        sizes = {len(p.samples) for p in self.predicted.values()}
        if len(sizes) != 1:
            raise SchemaError("abs.predicted: every variant must predict the same number of ranks")

    @property
    def world_size(self) -> int:
        return len(self.predicted[ABS_VARIANTS[0]].samples)

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise PlanMismatchError(f"the abs section predicts {self.world_size} workers, but the plan is for "
                                    f"world size {world_size}")
        if self.global_batch < world_size:
            raise PlanMismatchError(f"abs.global_batch {self.global_batch} is smaller than the world size "
                                    f"{world_size}: every worker needs at least one sample per round")
        if self.round_samples is not None and self.round_samples < world_size:
            raise PlanMismatchError(f"abs.round_samples {self.round_samples} is smaller than the world size "
                                    f"{world_size}: every worker needs at least one sample per round")

    def to_dict(self) -> dict[str, Any]:
        return {
            "global_batch": self.global_batch,
            "micro_batch": self.micro_batch,
            "min_micro_batches": self.min_micro_batches,
            "max_micro_batches": self.max_micro_batches,
            "round_samples": self.round_samples,
            "predicted": {name: p.to_dict() for name, p in self.predicted.items()},
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "plan.abs") -> ABSSection:
        expect(data, dict, where)
        check_fields(data, where, ["global_batch", "micro_batch", "min_micro_batches", "max_micro_batches",
                                   "predicted"], ["round_samples"])  # round_samples: absent in older plans
        cap = data["max_micro_batches"]
        batch = data.get("round_samples")
        predicted = expect(data["predicted"], dict, f"{where}.predicted")
        return cls(
            global_batch=expect_int(data["global_batch"], f"{where}.global_batch", 1, MAX_GLOBAL_BATCH),
            micro_batch=expect_int(data["micro_batch"], f"{where}.micro_batch", 1, MAX_GLOBAL_BATCH),
            min_micro_batches=expect_int(data["min_micro_batches"], f"{where}.min_micro_batches", 1,
                                         MAX_GLOBAL_BATCH),
            max_micro_batches=None if cap is None else expect_int(cap, f"{where}.max_micro_batches", 1,
                                                                  MAX_GLOBAL_BATCH),
            round_samples=None if batch is None else expect_int(batch, f"{where}.round_samples", 1,
                                                                MAX_GLOBAL_BATCH),
            predicted={expect(name, str, f"{where}.predicted key"):
                       VariantPrediction.from_dict(p, f"{where}.predicted.{name}") for name, p in predicted.items()},
        )
