"""The race log: every race `planner race` ran here, with what it raced on, kept to calibrate the model's error.

Schema (version 1), a JSON object at `runs/races.json` by default (`--race-log`):

    {
      "kind": "planner.race_log", "schema_version": 1,
      "races": [
        {"model": "mlp", "world_size": 2, "link": "1gbit" | null,   # what the race ran on (null: loopback)
         "race": {...}},                                            # the race record (planner/contracts/race_record.py)
        ...                                                         # oldest first, at most MAX_RACES
      ]
    }

Each raced arm holds the ratio to DDP the model predicted and the one the race measured: the pairs the model's
error is calibrated from (`planner.strategies.model_error`). Loading one never runs code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from planner.contracts.jsonio import check_fields, expect, expect_int, is_file, read_json, write_json_atomic
from planner.contracts.race_record import RaceRecord
from planner.types import SchemaError

__all__ = ["MAX_RACES", "RACE_LOG_KIND", "LoggedRace", "RaceLog"]

RACE_LOG_KIND = "planner.race_log"
RACE_LOG_SCHEMA_VERSION = 1
#: The races a log keeps: the newest (the model's error is that of the planner and machine of now).
MAX_RACES = 200


@dataclass(frozen=True)
class LoggedRace:
    """One race and what it ran on."""

    model: str
    world_size: int
    link: str | None
    race: RaceRecord

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "world_size": self.world_size, "link": self.link, "race": self.race.to_dict()}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> LoggedRace:
        data = expect(data, dict, where)
        check_fields(data, where, ["model", "world_size", "link", "race"])
        link = data["link"]
        return cls(model=expect(data["model"], str, f"{where}.model"),
                   world_size=expect_int(data["world_size"], f"{where}.world_size", 1, 1 << 20),
                   link=None if link is None else expect(link, str, f"{where}.link"),
                   race=RaceRecord.from_dict(data["race"], f"{where}.race"))


@dataclass(frozen=True)
class RaceLog:
    """The races logged here, oldest first."""

    races: tuple[LoggedRace, ...] = ()

    def with_race(self, race: LoggedRace) -> RaceLog:
        """This log and `race`, the oldest dropped past `MAX_RACES`."""
        return RaceLog((*self.races, race)[-MAX_RACES:])

    def to_dict(self) -> dict[str, Any]:
        return {"kind": RACE_LOG_KIND, "schema_version": RACE_LOG_SCHEMA_VERSION,
                "races": [r.to_dict() for r in self.races]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RaceLog:
        if data.get("kind") != RACE_LOG_KIND:
            raise SchemaError(f"not a race log: kind is {data.get('kind')!r}, expected {RACE_LOG_KIND!r}")
        if data.get("schema_version") != RACE_LOG_SCHEMA_VERSION:
            raise SchemaError(f"unknown race log schema_version {data.get('schema_version')!r}; this planner reads "
                              f"version {RACE_LOG_SCHEMA_VERSION}")
        check_fields(data, "race_log", ["kind", "schema_version", "races"])
        races = expect(data["races"], list, "race_log.races")
        if len(races) > MAX_RACES:
            raise SchemaError(f"race_log.races holds {len(races)} races; at most {MAX_RACES} are read")
        return cls(tuple(LoggedRace.from_dict(r, f"race_log.races[{i}]") for i, r in enumerate(races)))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RaceLog:
        """The log at `path`; an empty one where there is no file yet. Errors name the file and the field."""
        if not is_file(path):
            return cls()
        try:
            return cls.from_dict(read_json(path, "race log"))
        except SchemaError as exc:
            raise type(exc)(f"race log {path}: {exc}; move it aside to start a new one") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically."""
        write_json_atomic(path, self.to_dict(), "race log")
