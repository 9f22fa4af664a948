"""The pairing plan: which data-parallel jobs cross over on shared devices, as a versioned JSON document.

`planner pair` writes it from the jobs' own plans (`planner solve`); the runtime's crossover gate
(`planner.runtime.crossover`) reads it to know a job's partner. Loading one never runs code.

Schema (version 1), times in seconds:

    {
      "schema_version": 1,
      "kind": "planner.pairing",
      "created": "2026-11-22T12:00:00+00:00",
      "jobs": [                                  # index = position in this list
        {"name": "resnet18-dense",               # unique
         "plan": "plans/resnet18-dense.json",    # the job's plan, the path as given to `planner pair`
         "plan_fingerprint": "3f2a...",          # `plan_fingerprint` of that plan (16 hex digits)
         "model": "resnet18", "model_fingerprint": "7e79...", "world_size": 2,
         "samples": 256,                         # samples per iteration (global batch)
         "compute_s": 0.08, "comm_s": 0.05},     # per iteration alone: device, exposed communication
        ...
      ],
      "pairs": [[0, 1], ...],                    # crossed-over jobs (same world size), each job in one group
      "alone": [2],                              # jobs that run by themselves
      "predicted": {
        "jobs": [{"alone_s", "side_by_side_s", "crossover_s",           # per job, seconds per iteration
                  "side_by_side_interleaved_s"}, ...],                # optional (null or absent: not predicted)
        "totals": {"sequential_samples_per_s", "side_by_side_samples_per_s", "crossover_samples_per_s"}
      }
    }

A job's iteration alternates compute and exposed communication (`JobPhases`, made from a plan by `job_phases`).
Per job, `alone_s` is its iteration alone (compute_s + comm_s), `side_by_side_s` its period when it runs with its
partner uncoordinated (each resource shared equally) and `crossover_s` with the partner crossed over (one computes
while the other communicates), both from `planner.costmodel.crossover.simulate_pair`; a job left alone has all
three equal to `alone_s`.

The totals assume the equal-progress turn-taking of `planner.solvers.pairing`: the groups take turns on the
devices, each for one period in which each of its jobs makes one iteration, so a round of the groups advances
every job by one iteration and the samples per second are the jobs' summed samples over the round's seconds.
A group alone takes its job's `alone_s` in all three; a pair takes

- sequential: the two jobs one after the other, alone_s + alone_s of the partner (so the round is the sum of
  every job's alone_s: no sharing at all);
- side by side: the larger of the two side_by_side_s;
- crossover: the larger of the two crossover_s (the time the pairing was optimised for).

They are derived from the per-job predictions: reading a document recomputes them and refuses totals that do
not match.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.contracts.jsonio import (
    MAX_WORLD_SIZE,
    check_fields,
    expect,
    expect_int,
    expect_time,
    read_json,
    write_json_atomic,
)
from planner.contracts.plan import Plan
from planner.types import PlanMismatchError, PlannerFileError, SchemaError

__all__ = [
    "MAX_SAMPLES",
    "MODES",
    "PAIRING_KIND",
    "PAIRING_SCHEMA_VERSION",
    "JobPhases",
    "JobPrediction",
    "PairingJob",
    "PairingPlan",
    "check_job_plan",
    "job_phases",
    "plan_fingerprint",
]

PAIRING_SCHEMA_VERSION = 1
PAIRING_KIND = "planner.pairing"
#: Most samples per iteration a job may have.
MAX_SAMPLES = 2**31
#: Relative tolerance of the checks between predictions (they are written with every digit, so only sums of
#: floats may differ).
_RTOL = 1e-9
_FINGERPRINT = re.compile(r"[0-9a-f]{16}")
#: Largest job index a document may hold before the check against its number of jobs.
_MAX_INDEX = 2**20
#: The three ways a round of the groups can run (see the module docstring).
MODES = ("sequential", "side_by_side", "crossover")


def plan_fingerprint(plan: Plan) -> str:
    """16 hex digits of the SHA-256 of the plan's canonical JSON (its document with sorted keys).

    Any change of the plan, re-solving included (its `created` changes), changes the fingerprint."""
    text = json.dumps(plan.to_dict(), sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class JobPhases:
    """One job's iteration as it runs alone on its devices.

    Attributes:
        name: the job's name in messages and tables.
        compute_s: seconds per iteration on the device: forward, backward and update (the iteration time less
            the exposed communication).
        comm_s: seconds per iteration of exposed communication (the gradient exchange not hidden behind backward).
        samples: samples per iteration (the global batch).
    """

    name: str
    compute_s: float
    comm_s: float
    samples: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise SchemaError(f"a job needs a non-empty name, but got name={self.name!r}")
        for field, low in (("compute_s", "> 0"), ("comm_s", ">= 0")):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise SchemaError(f"job {self.name}: {field} must be a number of seconds, but got {value!r}")
            value = float(value)
            ok = math.isfinite(value) and (value > 0 if low == "> 0" else value >= 0)
            if not ok:
                raise SchemaError(f"job {self.name}: `{field} {low}` (finite) must hold, but got {field}={value}")
            object.__setattr__(self, field, value)
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise SchemaError(f"job {self.name}: `samples >= 1` (a whole number) must hold, but got "
                              f"samples={self.samples!r}")

    @property
    def iteration_s(self) -> float:
        """Seconds per iteration alone: compute_s + comm_s."""
        return self.compute_s + self.comm_s


def job_phases(plan: Plan, samples: int, name: str) -> JobPhases:
    """A job's compute and exposed communication per iteration, from its plan's predicted timeline.

    compute_s = iteration_s - exposed_comm_s (forward, backward, selection or packing, decode and update: the
    plan's compute path) and comm_s = exposed_comm_s, so that compute_s + comm_s is the plan's iteration.
    """
    p = plan.predicted
    return JobPhases(name=name, compute_s=p.iteration_s - p.exposed_comm_s, comm_s=p.exposed_comm_s, samples=samples)


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=_RTOL, abs_tol=0.0)


@dataclass(frozen=True, kw_only=True)
class PairingJob:
    """One job of a pairing: its plan, what the plan was made for, and its phases per iteration."""

    name: str
    plan: str
    plan_fingerprint: str
    model: str
    model_fingerprint: str
    world_size: int
    samples: int
    compute_s: float
    comm_s: float

    def __post_init__(self) -> None:
        _ = self.phases  # validates the name, the times and the samples
        if not self.plan.strip():
            raise SchemaError(f"job {self.name}: the plan path is empty")
        if not _FINGERPRINT.fullmatch(self.plan_fingerprint):
            raise SchemaError(f"job {self.name}: plan_fingerprint must be 16 hex digits (0-9, a-f), got "
                              f"{self.plan_fingerprint!r}")
        if not self.model or not self.model_fingerprint:
            raise SchemaError(f"job {self.name}: model and model_fingerprint must not be empty")
        if not 1 <= self.world_size <= MAX_WORLD_SIZE or not 1 <= self.samples <= MAX_SAMPLES:
            raise SchemaError(f"job {self.name}: `1 <= world_size <= {MAX_WORLD_SIZE}` and `1 <= samples <= "
                              f"{MAX_SAMPLES}` must hold, but got (world_size={self.world_size}, "
                              f"samples={self.samples})")

    @property
    def phases(self) -> JobPhases:
        """The job's iteration for `planner.costmodel.crossover`."""
        return JobPhases(name=self.name, compute_s=self.compute_s, comm_s=self.comm_s, samples=self.samples)

    @property
    def alone_s(self) -> float:
        return self.compute_s + self.comm_s

    @classmethod
    def from_plan(cls, plan: Plan, path: str, *, name: str, samples: int) -> PairingJob:
        """The job that runs `plan` (read from `path`) on `samples` samples per iteration."""
        phases = job_phases(plan, samples, name)
        return cls(name=name, plan=path, plan_fingerprint=plan_fingerprint(plan), model=plan.model.name,
                   model_fingerprint=plan.model.fingerprint, world_size=plan.cluster.world_size, samples=samples,
                   compute_s=phases.compute_s, comm_s=phases.comm_s)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "plan": self.plan, "plan_fingerprint": self.plan_fingerprint,
                "model": self.model, "model_fingerprint": self.model_fingerprint, "world_size": self.world_size,
                "samples": self.samples, "compute_s": self.compute_s, "comm_s": self.comm_s}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> PairingJob:
        expect(data, dict, where)
        check_fields(data, where, ["name", "plan", "plan_fingerprint", "model", "model_fingerprint", "world_size",
                                   "samples", "compute_s", "comm_s"])
        try:
            return cls(
                name=expect(data["name"], str, f"{where}.name"),
                plan=expect(data["plan"], str, f"{where}.plan"),
                plan_fingerprint=expect(data["plan_fingerprint"], str, f"{where}.plan_fingerprint"),
                model=expect(data["model"], str, f"{where}.model"),
                model_fingerprint=expect(data["model_fingerprint"], str, f"{where}.model_fingerprint"),
                world_size=expect_int(data["world_size"], f"{where}.world_size", 1, MAX_WORLD_SIZE),
                samples=expect_int(data["samples"], f"{where}.samples", 1, MAX_SAMPLES),
                compute_s=expect_time(data["compute_s"], f"{where}.compute_s"),
                comm_s=expect_time(data["comm_s"], f"{where}.comm_s"),
            )
        except SchemaError as exc:
            if str(exc).startswith(where):
                raise
            raise SchemaError(f"{where}: {exc}") from None


@dataclass(frozen=True)
class JobPrediction:
    """One job's predicted seconds per iteration: alone, side by side with its partner, crossed over with it."""

    alone_s: float
    side_by_side_s: float  # side by side, the jobs starting in lockstep (the worst case the model has)
    crossover_s: float
    #: side by side, the jobs starting interleaved (one computing while the other communicates): the best case;
    #: uncoordinated jobs settle anywhere between the two (None: a pairing made before it was predicted)
    side_by_side_interleaved_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"alone_s": self.alone_s, "side_by_side_s": self.side_by_side_s, "crossover_s": self.crossover_s,
                "side_by_side_interleaved_s": self.side_by_side_interleaved_s}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> JobPrediction:
        expect(data, dict, where)
        fields = ["alone_s", "side_by_side_s", "crossover_s"]
        check_fields(data, where, fields, ["side_by_side_interleaved_s"])
        alone_s, side_by_side_s, crossover_s = (expect_time(data[f], f"{where}.{f}") for f in fields)
        best = data.get("side_by_side_interleaved_s")
        return cls(alone_s=alone_s, side_by_side_s=side_by_side_s, crossover_s=crossover_s,
                   side_by_side_interleaved_s=None if best is None else
                   expect_time(best, f"{where}.side_by_side_interleaved_s"))


@dataclass(frozen=True, kw_only=True)
class PairingPlan:
    """Jobs, which of them cross over, and what that is predicted to give (see the module docstring).

    Pairs are kept as (i, j) with i < j, sorted, and `alone` ascending, however they were given.
    """

    jobs: tuple[PairingJob, ...]
    pairs: tuple[tuple[int, int], ...]
    alone: tuple[int, ...]
    predicted: tuple[JobPrediction, ...]
    created: str
    schema_version: int = PAIRING_SCHEMA_VERSION

    def __post_init__(self) -> None:
        n = len(self.jobs)
        if n == 0:
            raise SchemaError("a pairing needs at least one job")
        names = [job.name for job in self.jobs]
        repeated = sorted({x for x in names if names.count(x) > 1})
        if repeated:
            raise SchemaError(f"job names must be unique, but {repeated} name more than one job")
        if len(self.predicted) != n:
            raise SchemaError(f"predicted.jobs must hold one prediction per job, but there are {n} jobs and "
                              f"{len(self.predicted)} predictions")
        places: list[list[str]] = [[] for _ in range(n)]
        for pair in self.pairs:
            i, j = pair
            for k in (i, j):
                if not 0 <= k < n:
                    raise SchemaError(f"pair {list(pair)} names job {k}, but there are {n} jobs (indices 0 to "
                                      f"{n - 1})")
            if i == j:
                raise SchemaError(f"pair {list(pair)} pairs job {i} ({names[i]}) with itself; a pair is two "
                                  "different jobs")
            places[i].append(f"pair {list(pair)}")
            places[j].append(f"pair {list(pair)}")
        for k in self.alone:
            if not 0 <= k < n:
                raise SchemaError(f"alone names job {k}, but there are {n} jobs (indices 0 to {n - 1})")
            places[k].append("alone")
        for k, where in enumerate(places):
            if len(where) > 1:
                raise SchemaError(f"job {k} ({names[k]}) is in more than one group ({' and '.join(where)}); "
                                  "each job must be in exactly one pair or alone")
            if not where:
                raise SchemaError(f"job {k} ({names[k]}) is neither in a pair nor alone; each job must be in "
                                  "exactly one pair or alone")
        for i, j in self.pairs:
            a, b = self.jobs[i], self.jobs[j]
            if a.world_size != b.world_size:
                raise SchemaError(f"pair {[i, j]} joins {a.name} (world size {a.world_size}) and {b.name} (world "
                                  f"size {b.world_size}); paired jobs share the same devices, so their world sizes "
                                  "must be equal")
        for k, (job, p) in enumerate(zip(self.jobs, self.predicted, strict=True)):
            if not _close(p.alone_s, job.alone_s):
                raise SchemaError(f"predicted.jobs[{k}].alone_s must be compute_s + comm_s of job {job.name}, "
                                  f"{job.alone_s}, but got {p.alone_s}")
            if k in self.alone and not (_close(p.side_by_side_s, p.alone_s) and _close(p.crossover_s, p.alone_s)):
                raise SchemaError(f"job {job.name} runs alone, so its predicted side_by_side_s and crossover_s "
                                  f"must equal its alone_s {p.alone_s}, but got {p.side_by_side_s} and "
                                  f"{p.crossover_s}")
            best = p.side_by_side_interleaved_s
            if k in self.alone and best is not None and not _close(best, p.alone_s):
                raise SchemaError(f"job {job.name} runs alone, so its predicted side_by_side_interleaved_s must "
                                  f"equal its alone_s {p.alone_s}, but got {best}")
            fastest = min(p.side_by_side_s, p.crossover_s, p.side_by_side_s if best is None else best)
            if fastest < p.alone_s and not _close(fastest, p.alone_s):
                raise SchemaError(f"job {job.name} cannot iterate faster with a partner than alone, but its "
                                  f"predictions are alone_s={p.alone_s}, side_by_side_s={p.side_by_side_s}, "
                                  f"crossover_s={p.crossover_s}, side_by_side_interleaved_s={best}")
        object.__setattr__(self, "pairs", tuple(sorted((min(p), max(p)) for p in self.pairs)))
        object.__setattr__(self, "alone", tuple(sorted(self.alone)))

    # -- use -------------------------------------------------------------------------------------
    def index(self, name: str) -> int:
        """The index of the job called `name`; PlanMismatchError naming the jobs when there is none."""
        for k, job in enumerate(self.jobs):
            if job.name == name:
                return k
        raise PlanMismatchError(f"the pairing has no job {name!r}; its jobs are {[job.name for job in self.jobs]}")

    def pair_of(self, job: int) -> int | None:
        """The index in `pairs` of the pair holding job `job`, or None when it runs alone."""
        for p, pair in enumerate(self.pairs):
            if job in pair:
                return p
        return None

    def partner(self, job: int) -> int | None:
        """The job that job `job` crosses over with, or None when it runs alone."""
        p = self.pair_of(job)
        if p is None:
            return None
        i, j = self.pairs[p]
        return j if job == i else i

    def round_s(self, mode: str) -> float:
        """Seconds of one round of the groups (every job one iteration) run `mode`: one of `MODES`."""
        times = []
        for i, j in self.pairs:
            a, b = self.predicted[i], self.predicted[j]
            if mode == "sequential":
                times.append(a.alone_s + b.alone_s)
            elif mode == "side_by_side":
                times.append(max(a.side_by_side_s, b.side_by_side_s))
            elif mode == "crossover":
                times.append(max(a.crossover_s, b.crossover_s))
            else:
                raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        times.extend(self.predicted[k].alone_s for k in self.alone)
        return math.fsum(times)

    def samples_per_s(self, mode: str) -> float:
        """The jobs' samples per second together when the round runs `mode` (one of `MODES`)."""
        return sum(job.samples for job in self.jobs) / self.round_s(mode)

    @property
    def sequential_samples_per_s(self) -> float:
        return self.samples_per_s("sequential")

    @property
    def side_by_side_samples_per_s(self) -> float:
        return self.samples_per_s("side_by_side")

    @property
    def crossover_samples_per_s(self) -> float:
        return self.samples_per_s("crossover")

    # -- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "kind": PAIRING_KIND,
            "created": self.created,
            "jobs": [job.to_dict() for job in self.jobs],
            "pairs": [list(pair) for pair in self.pairs],
            "alone": list(self.alone),
            "predicted": {
                "jobs": [p.to_dict() for p in self.predicted],
                "totals": {f"{mode}_samples_per_s": self.samples_per_s(mode) for mode in MODES},
            },
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PairingPlan:
        version = data.get("schema_version")
        if version != PAIRING_SCHEMA_VERSION:
            raise SchemaError(f"unknown pairing schema_version {version!r}; this planner reads version "
                              f"{PAIRING_SCHEMA_VERSION}: make the pairing again with `planner pair`")
        if data.get("kind") != PAIRING_KIND:
            raise SchemaError(f"not a pairing plan: kind is {data.get('kind')!r}, expected {PAIRING_KIND!r}")
        check_fields(data, "pairing", ["schema_version", "kind", "created", "jobs", "pairs", "alone", "predicted"])
        jobs = expect(data["jobs"], list, "pairing.jobs")
        pairs = []
        for p, pair in enumerate(expect(data["pairs"], list, "pairing.pairs")):
            if not (isinstance(pair, list) and len(pair) == 2):
                raise SchemaError(f"pairing.pairs[{p}] must be a list of two job indices, got {pair!r}")
            pairs.append(tuple(expect_int(k, f"pairing.pairs[{p}][]", 0, _MAX_INDEX) for k in pair))
        alone = [expect_int(k, "pairing.alone[]", 0, _MAX_INDEX)
                 for k in expect(data["alone"], list, "pairing.alone")]
        predicted = expect(data["predicted"], dict, "pairing.predicted")
        check_fields(predicted, "pairing.predicted", ["jobs", "totals"])
        per_job = expect(predicted["jobs"], list, "pairing.predicted.jobs")
        totals = expect(predicted["totals"], dict, "pairing.predicted.totals")
        total_fields = [f"{mode}_samples_per_s" for mode in MODES]
        check_fields(totals, "pairing.predicted.totals", total_fields)
        stated = {f: float(expect(totals[f], (int, float), f"pairing.predicted.totals.{f}")) for f in total_fields}
        plan = cls(
            schema_version=version,
            created=expect(data["created"], str, "pairing.created"),
            jobs=tuple(PairingJob.from_dict(job, f"pairing.jobs[{k}]") for k, job in enumerate(jobs)),
            pairs=tuple((int(i), int(j)) for i, j in pairs),
            alone=tuple(alone),
            predicted=tuple(JobPrediction.from_dict(p, f"pairing.predicted.jobs[{k}]") for k, p in enumerate(per_job)),
        )
        for mode, field in zip(MODES, total_fields, strict=True):
            derived = plan.samples_per_s(mode)
            if not _close(stated[field], derived):
                raise SchemaError(f"pairing.predicted.totals.{field} is {stated[field]}, but the per-job "
                                  f"predictions give {derived}; the totals are derived: make the pairing again "
                                  "with `planner pair`")
        return plan

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically."""
        write_json_atomic(path, self.to_dict(), "pairing plan")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PairingPlan:
        """Read and validate (JSON only: nothing is run); errors name the file and the field."""
        data = read_json(path, "pairing plan")
        try:
            return cls.from_dict(data)
        except SchemaError as exc:
            raise type(exc)(f"pairing plan {path}: {exc}") from None


def check_job_plan(job: PairingJob, plan: Plan | str | os.PathLike[str] | None = None) -> Plan:
    """The plan `job` runs, checked against the one it was paired with; PlanMismatchError in one line if not.

    Args:
        plan: the Plan the job runs, or the path to read it from (default: `job.plan`, the path given to
            `planner pair`, relative to the folder it ran in).

    Raises:
        PlanMismatchError: the plan file is missing, the plan is for another model, or it changed since the
            pairing was made (another fingerprint).
        SchemaError: the file is not a valid plan.
    """
    path = job.plan if plan is None or isinstance(plan, Plan) else os.fspath(plan)
    if not isinstance(plan, Plan):
        try:
            plan = Plan.load(path)
        except (PlannerFileError, FileNotFoundError) as exc:
            if Path(path).is_file():
                raise
            raise PlanMismatchError(f"job {job.name}: its plan {path} is missing; restore the plan the pairing was "
                                    "made from, or re-run `planner pair` with the job's current plan") from exc
    if plan.model.name != job.model or plan.model.fingerprint != job.model_fingerprint:
        raise PlanMismatchError(f"job {job.name}: the plan {path} is for model {plan.model.describe()}, but the "
                                f"pairing was made for model {job.model} (fingerprint {job.model_fingerprint}); "
                                "re-run `planner pair` with this job's plan")
    found = plan_fingerprint(plan)
    if found != job.plan_fingerprint:
        raise PlanMismatchError(f"job {job.name}: the plan {path} changed since the pairing was made (fingerprint "
                                f"{found}, paired {job.plan_fingerprint}); re-run `planner pair`")
    return plan
