"""The `race` record of a plan: its finalists as `planner race` measured them, and the one it kept.

Schema (inside the plan, version 1 like the plan):

    "race": {
      "raced": "2026-12-02T10:50:00+00:00",
      "kept": "ddp",                      # an arm's name
      "rule": "won" | "tied" | "budget",  # what kept it (planner.strategies.race_rule)
      "rounds": 24, "block": 4,           # rounds run, steps per arm per round
      "margin": 0.02, "alpha": 0.05, "seconds": 31.5,
      "reference": "ddp",                 # optional (old records: "ddp"): the arm every ratio is measured against
      "arms": [                           # simplest first
        {"name": "ddp", "rounds": 24, "steps": 96, "median_block_s": 0.061,
         "ratio_to_ddp": 1.0, "interval": null, "predicted_ratio": 1.0, "beaten_by": null,
         "blocks_s": [0.062, 0.060, ...]},  # optional (old records: none): its block in each round it ran
        ...
      ]
    }

`ratio_to_ddp` is the median over the rounds both ran of the arm's block time over the reference's (DDP's in a race
of gradient plans; in a race of K-FAC layouts kfac-pytorch's default layout, COMM_OPT: the key keeps its first name),
`interval` its anytime interval, `predicted_ratio` the model's (null where the plan predicts no row of the reference
or of the arm). `blocks_s` are the rule's evidence, round by round (the mean of the block's slowest-rank steps), so
that a race can be replayed under another rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from planner.contracts.jsonio import check_fields, expect, expect_int, expect_time
from planner.types import SchemaError

__all__ = ["RACE_RULES", "RaceRecord", "RacedArm"]

RACE_RULES = ("won", "tied", "budget")
_MOST_ROUNDS = 10**7


def _ratio(value: Any, where: str) -> float:
    v = float(expect(value, (int, float), where))
    if not (math.isfinite(v) and 0 < v < 1e6):
        raise SchemaError(f"{where} must be a positive ratio, got {value!r}")
    return v


def _optional_ratio(value: Any, where: str) -> float | None:
    return None if value is None else _ratio(value, where)


@dataclass(frozen=True)
class RacedArm:
    """One finalist as the race measured it."""

    name: str
    rounds: int
    steps: int
    median_block_s: float
    ratio_to_ddp: float | None
    interval: tuple[float, float] | None
    predicted_ratio: float | None
    beaten_by: str | None = None
    #: Its block time (seconds) in each round it ran, in order; empty in records from before they were kept.
    blocks_s: tuple[float, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        data = {"name": self.name, "rounds": self.rounds, "steps": self.steps, "median_block_s": self.median_block_s,
                "ratio_to_ddp": self.ratio_to_ddp, "interval": None if self.interval is None else list(self.interval),
                "predicted_ratio": self.predicted_ratio, "beaten_by": self.beaten_by}
        if self.blocks_s:
            data["blocks_s"] = list(self.blocks_s)
        return data

    @classmethod
    def from_dict(cls, data: Any, where: str) -> RacedArm:
        data = expect(data, dict, where)
        check_fields(data, where, ["name", "rounds", "steps", "median_block_s", "ratio_to_ddp", "interval",
                                   "predicted_ratio", "beaten_by"], optional=["blocks_s"])
        interval = data["interval"]
        if interval is not None:
            if not isinstance(interval, list) or len(interval) != 2:
                raise SchemaError(f"{where}.interval must be [low, high] or null, got {interval!r}")
            interval = (_ratio(interval[0], f"{where}.interval[0]"), _ratio(interval[1], f"{where}.interval[1]"))
            if interval[0] > interval[1]:
                raise SchemaError(f"{where}.interval: `low <= high` must hold, got {list(interval)}")
        beaten_by = data["beaten_by"]
        blocks = expect(data.get("blocks_s", []), list, f"{where}.blocks_s")
        if blocks and len(blocks) != data["rounds"]:
            raise SchemaError(f"{where}.blocks_s holds {len(blocks)} blocks, but the arm ran {data['rounds']!r} "
                              "rounds: one block per round")
        return cls(name=expect(data["name"], str, f"{where}.name"),
                   rounds=expect_int(data["rounds"], f"{where}.rounds", 1, _MOST_ROUNDS),
                   steps=expect_int(data["steps"], f"{where}.steps", 1, _MOST_ROUNDS * 1000),
                   median_block_s=expect_time(data["median_block_s"], f"{where}.median_block_s"),
                   ratio_to_ddp=_optional_ratio(data["ratio_to_ddp"], f"{where}.ratio_to_ddp"),
                   interval=interval,
                   predicted_ratio=_optional_ratio(data["predicted_ratio"], f"{where}.predicted_ratio"),
                   beaten_by=None if beaten_by is None else expect(beaten_by, str, f"{where}.beaten_by"),
                   blocks_s=tuple(expect_time(b, f"{where}.blocks_s[{i}]") for i, b in enumerate(blocks)))


@dataclass(frozen=True)
class RaceRecord:
    """The race of a plan's finalists: the arms (simplest first), the arm kept and the rule that kept it."""

    raced: str
    kept: str
    rule: str
    rounds: int
    block: int
    margin: float
    alpha: float
    seconds: float
    arms: tuple[RacedArm, ...]
    #: The arm every ratio is measured against, which runs every round.
    reference: str = "ddp"

    def __post_init__(self) -> None:
        names = [a.name for a in self.arms]
        if self.reference not in names:
            raise SchemaError(f"plan.race.reference must be one of the arms {names}, got {self.reference!r}")
        if len(names) < 2 or len(set(names)) != len(names):
            raise SchemaError(f"plan.race.arms must name two or more distinct arms, got {names}")
        if self.kept not in names:
            raise SchemaError(f"plan.race.kept must be one of the arms {names}, got {self.kept!r}")
        if self.rule not in RACE_RULES:
            raise SchemaError(f"plan.race.rule must be one of {list(RACE_RULES)}, got {self.rule!r}")
        beaten = [a for a in self.arms if a.beaten_by is not None and a.beaten_by not in names]
        if beaten:
            raise SchemaError(f"plan.race.arms: {beaten[0].name} is beaten by {beaten[0].beaten_by!r}, not an arm")
        if self.kept in {a.name for a in self.arms if a.beaten_by is not None}:
            raise SchemaError(f"plan.race.kept: {self.kept} was beaten, so it cannot be the arm kept")

    def arm(self, name: str) -> RacedArm:
        return next(a for a in self.arms if a.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {"raced": self.raced, "kept": self.kept, "rule": self.rule, "rounds": self.rounds, "block": self.block,
                "margin": self.margin, "alpha": self.alpha, "seconds": self.seconds, "reference": self.reference,
                "arms": [a.to_dict() for a in self.arms]}

    @classmethod
    def from_dict(cls, data: Any, where: str = "plan.race") -> RaceRecord:
        data = expect(data, dict, where)
        check_fields(data, where, ["raced", "kept", "rule", "rounds", "block", "margin", "alpha", "seconds", "arms"],
                     optional=["reference"])
        margin = float(expect(data["margin"], (int, float), f"{where}.margin"))
        alpha = float(expect(data["alpha"], (int, float), f"{where}.alpha"))
        if not 0 <= margin < 1:
            raise SchemaError(f"{where}.margin must be in [0, 1), got {data['margin']!r}")
        if not 0 < alpha < 1:
            raise SchemaError(f"{where}.alpha must be in (0, 1), got {data['alpha']!r}")
        arms = expect(data["arms"], list, f"{where}.arms")
        try:
            return cls._of(data, where, arms, margin, alpha)
        except SchemaError as exc:  # the record's own checks name it where a plan holds it: say where it is
            raise SchemaError(str(exc).replace("plan.race", where, 1)) from None

    @classmethod
    def _of(cls, data: dict[str, Any], where: str, arms: list[Any], margin: float, alpha: float) -> RaceRecord:
        return cls(raced=expect(data["raced"], str, f"{where}.raced"),
                   kept=expect(data["kept"], str, f"{where}.kept"),
                   rule=expect(data["rule"], str, f"{where}.rule"),
                   rounds=expect_int(data["rounds"], f"{where}.rounds", 1, _MOST_ROUNDS),
                   block=expect_int(data["block"], f"{where}.block", 1, 10**6),
                   margin=margin, alpha=alpha, seconds=expect_time(data["seconds"], f"{where}.seconds"),
                   reference=expect(data.get("reference", "ddp"), str, f"{where}.reference"),
                   arms=tuple(RacedArm.from_dict(a, f"{where}.arms[{i}]") for i, a in enumerate(arms)))
