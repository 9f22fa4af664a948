"""The plan: a versioned JSON document of decisions and predictions. Loading one never runs code.

Schema (version 1), all times in seconds, sizes in elements unless the name says bytes:

    {
      "schema_version": 1,
      "kind": "planner.plan",
      "created": "2026-11-22T12:00:00+00:00",
      "strategy": "dense" | "topk" | "mixed",
      "density": null | 0.01,                        # top-k fraction, null for dense and mixed
      "selector": null | "exact" | "sampled",        # top-k selector (planner.kernels.topk) of a top-k plan or
                                                     # of a mixed plan's top-k groups, else null; optional:
                                                     # absent reads as "exact" where there is top-k
      "compressors": null | ["dense", "fp16", ...],  # mixed plans: the compressors the solver could choose from
                                                     # (the accuracy budget); optional, absent: null
      "model":   {"name", "fingerprint", "num_params", "numel"},
      "cluster": {"world_size", "backend", "device", "host_count"},
      "source":  {"profile": "profiles/resnet18.json", "profiled": "<date of the profile>",
                  "batch_size": 32},                 # the profile's per-worker batch; optional (older plans)
      "solver":  {"name": "dense-dp", "seconds": 0.004,
                  "optimal": true, "gap": 0.0},      # optional (older plans: not recorded): whether the plan is
                                                     # proven optimal under the model; if not, "gap" is how far
                                                     # its step may be above the solver's lower bound,
                                                     # (iteration - bound) / bound, e.g. 0.0023
      "groups": [                                    # in the order gradients become ready
        {"layers": ["fc"], "params": ["fc.weight", "fc.bias"], "numel": 5130, "k": null}, ...
      ],                                             # a mixed plan's groups add "compressor": "powersgd:4"
                                                     # (dense, fp16, powersgd:R, topk:D; k for top-k only);
                                                     # "hierarchical": true sends a group of a multi-host
                                                     # plan inside each host, across, inside again
                                                     # (absent: flat collectives)
      "predicted": {
        "plan":      {"iteration_s", "compute_s", "exposed_comm_s", "comm_s", "selection_s", "decode_s", "num_groups",
                      "pack_s", "interference_s"},          # the last two optional (0 when absent)
        "baselines": {"wfbp": {...}, "single": {...}, "ddp": {...}, "plan via ddp": {...}, ...},
        "lower_bound_s": 0.091
      },
      "kfac": null | {...},                          # K-FAC plans only: see planner/contracts/kfac_section.py
      "unused_params": {...},                        # optional: the profile's parameters without a gradient
                                                     # in some batches (planner/contracts/unused.py); absent:
                                                     # not checked
      "abs": null | {...},                           # ABS-SGD plans only: see planner/contracts/abs_section.py
      "error": {"predicted": 0.12,                   # optional (mixed plans from a profile that measured it):
                "interval": [0.10, 0.14],            # the plan's compression error (planner/contracts/errors.py)
                "budget": 0.3 | null,                # with its 90% interval; the error budget it was solved
                "budget_of": "powersgd:4" | null},   # under (null: none) and the compressor whose error over the
                                                     # whole gradient set it (null: given as a number)
      "race": {...},                                 # optional: its finalists raced (planner/contracts/race_record.py)
      "runners_up": {"dense": {<a plan>}, ...}       # optional: the best structurally different plans the solve
    }                                                # also found (each a whole plan, without runners-up or race),
                                                     # finalists of the race beside the plan; in a K-FAC plan, the
                                                     # layout solved, where a race kept another (race_kfac.py)

A top-k plan names the selector whose measured cost its predictions use: "exact" (`torch.topk`) or
"sampled" (threshold from a random sample, exact top-k of the candidates above it); both send the same
entries, so the selector changes the time, not the decisions' meaning. Plans written before the field
existed used the exact selector.

A mixed plan (`planner solve --strategy mixed --compressors ...`) sends each group with its own compressor
(`planner.types.Compressor`): fp32 allreduce, fp16 allreduce, PowerSGD at rank R or top-k at density D. Its
top-k groups carry k and share the plan's selector. Dense and top-k plans have no per-group compressor (all
groups are sent the plan's way), and read as they always did.

A plan for several hosts (`cluster.host_count` > 1, from a profile that measured them) sends each dense group
flat or hierarchically (`planner.kernels.hierarchical`), whichever its profile predicts cheaper for its size;
a top-k group may be marked hierarchical too (merged inside each host, exchanged once per host), and so may
an fp16 or PowerSGD group of a mixed plan (each of its allreduces by host). The runtime
refuses such a plan on another number of hosts.

A K-FAC plan (`planner solve --strategy kfac`) has dense gradient groups and a `kfac` section with the
factor fusion buffers, the owner of every factor's inversion, the update intervals and predictions.
A document without the `kfac` key reads as a gradient-only plan.

The rows of DDP are named by what DDP sends (`ddp_row`): "ddp" is plain DDP on its own buckets, "ddp+C" DDP with
C's communication hook (a top-k plan's DDP row is "ddp+topk:D", DDP with the project's top-k hook at its
density). "plan via ddp" is the plan's own groups and compressors run inside DDP (`planner.runtime.PlanHook`), at
DDP's costs; plans PlanHook does not run (K-FAC, ABS-SGD), plans with groups sent hierarchically (they run inside
DDP, but its cost model is flat) and plans written before have no such row. Plans written before called the row
of DDP on its buckets "ddp-25mb" whatever it sent; they read with that row (and its interval) renamed.

An ABS-SGD plan (`planner solve --strategy abs`) has dense gradient groups (each round's exchange moves them)
and an `abs` section with the round trigger, the micro-batch and the predictions of ABS-SGD and of synchronous
SGD with equal and with speed-proportional batches. A document without the `abs` key has none.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from planner.contracts.abs_section import ABSSection
from planner.contracts.fingerprint import ClusterInfo, ModelInfo
from planner.contracts.jsonio import (
    MAX_NUMEL,
    check_fields,
    expect,
    expect_gain,
    expect_int,
    expect_interval,
    expect_time,
    read_json,
    write_json_atomic,
)
from planner.contracts.kfac_section import KFACSection
from planner.contracts.race_record import RaceRecord
from planner.contracts.unused import UnusedParams
from planner.types import (
    DENSE_COMPRESSOR,
    Compressor,
    CompressorError,
    CompressorKind,
    PlanMismatchError,
    SchemaError,
    Strategy,
)

__all__ = ["DDP_ROW", "PLAN_KIND", "PLAN_SCHEMA_VERSION", "SELECTORS", "VIA_DDP_ROW", "Group", "Intervals", "Plan",
           "PlanError", "Prediction", "Verdict", "check_selector", "ddp_row", "parse_compressor", "plan_simplicity"]

PLAN_SCHEMA_VERSION = 1
PLAN_KIND = "planner.plan"

#: Top-k selectors a plan can name and a profile can time: `planner.kernels.topk.SELECTORS`, repeated here
#: because reading a document must not import the runtime (and torch).
SELECTORS = ("exact", "sampled")

#: The row of plain DDP (fp32 allreduce on DDP's own buckets) in a plan's baselines and in its verdict.
DDP_ROW = "ddp"
#: The row of the plan itself run inside DDP (`planner.runtime.PlanHook`: its groups as DDP's buckets, moved at DDP's
#: own measured costs), in a plan's baselines; absent where PlanHook does not run the plan or it is not predicted
#: there (hierarchical groups), and in older plans.
VIA_DDP_ROW = "plan via ddp"
#: What plans written before rows named what they send called DDP's row, whatever it sent.
_OLD_DDP_ROW = "ddp-25mb"


def ddp_row(strategy: Strategy, density: float | None = None) -> str:
    """The name of the row of DDP on its own buckets in a plan of `strategy`: "ddp" (plain DDP, for dense and mixed
    plans, which list DDP's hooks as rows of their own) or "ddp+topk:D" (DDP with the top-k hook at a top-k plan's
    density)."""
    if strategy is Strategy.TOPK:
        return f"ddp+{Compressor(CompressorKind.TOPK, density=density)}"
    return DDP_ROW


def check_selector(selector: object, where: str) -> str:
    """`selector` if it names a top-k selector, else a SchemaError naming `where` and the valid names."""
    if not isinstance(selector, str) or selector not in SELECTORS:
        raise SchemaError(f"{where} must be one of {', '.join(SELECTORS)}, but got {selector!r}")
    return selector


def parse_compressor(text: object, where: str) -> Compressor:
    """The compressor `text` names, or a SchemaError naming `where`."""
    try:
        return Compressor.parse(text)  # type: ignore[arg-type]
    except CompressorError as exc:
        raise SchemaError(f"{where}: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class PlanError:
    """A plan's compression error as its profile measured it (`planner.contracts.errors`), with its 90% interval
    over the measured steps, and the budget the solver kept it within (None: solved without one; `budget_of`: the
    compressor whose error over the whole gradient the budget was)."""

    predicted: float
    interval: tuple[float, float]
    budget: float | None = None
    budget_of: Compressor | None = None

    def __post_init__(self) -> None:
        low, high = self.interval
        for name, value in (("predicted", self.predicted), ("interval", low), ("interval", high),
                            ("budget", 0.0 if self.budget is None else self.budget)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value)
                                                                                     and value >= 0):
                raise SchemaError(f"plan.error.{name} must be a finite number >= 0, got {value!r}")
        if low > high:
            raise SchemaError(f"plan.error.interval must be [low, high], got [{low!r}, {high!r}]")
        if self.budget_of is not None and self.budget is None:
            raise SchemaError("plan.error.budget_of names the compressor that set a budget, but there is no budget")

    def to_dict(self) -> dict[str, Any]:
        return {"predicted": self.predicted, "interval": list(self.interval), "budget": self.budget,
                "budget_of": None if self.budget_of is None else str(self.budget_of)}

    @classmethod
    def from_dict(cls, data: Any) -> PlanError:
        expect(data, dict, "plan.error")
        check_fields(data, "plan.error", ["predicted", "interval", "budget", "budget_of"])
        interval = expect(data["interval"], list, "plan.error.interval")
        if len(interval) != 2:
            raise SchemaError(f"plan.error.interval must be [low, high], got {interval!r}")
        return cls(predicted=data["predicted"], interval=(interval[0], interval[1]), budget=data["budget"],
                   budget_of=(None if data["budget_of"] is None
                              else parse_compressor(data["budget_of"], "plan.error.budget_of")))


@dataclass(frozen=True, kw_only=True)
class Group:
    """One collective: contiguous layers (ready order), their parameters, size, k for top-k, and (mixed plans
    only) how it is sent."""

    layers: tuple[str, ...]
    params: tuple[str, ...]
    numel: int
    k: int | None = None
    compressor: Compressor | None = None
    #: Sent hierarchically (`planner.kernels.hierarchical`: inside each host, across hosts, inside again)
    #: rather than by flat collectives over every rank; groups of multi-host plans only.
    hierarchical: bool = False

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layers": list(self.layers), "params": list(self.params), "numel": self.numel,
                               "k": self.k}
        if self.compressor is not None:
            out["compressor"] = str(self.compressor)
        if self.hierarchical:  # plans without it stay as they were
            out["hierarchical"] = True
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str) -> Group:
        expect(data, dict, where)
        check_fields(data, where, ["layers", "params", "numel", "k"], optional=["compressor", "hierarchical"])
        layers = tuple(expect(x, str, f"{where}.layers[]") for x in expect(data["layers"], list, f"{where}.layers"))
        params = tuple(expect(x, str, f"{where}.params[]") for x in expect(data["params"], list, f"{where}.params"))
        numel = expect_int(data["numel"], f"{where}.numel", 1, MAX_NUMEL)
        k = data["k"] if data["k"] is None else expect_int(data["k"], f"{where}.k", 1, MAX_NUMEL)
        if not params or not layers:
            raise SchemaError(f"{where} must name at least one layer and one parameter, got layers={list(layers)} "
                              f"and params={list(params)}")
        if k is not None and not 0 < k <= numel:
            raise SchemaError(f"{where}: `0 < k <= numel` must hold, but got (k={k}, numel={numel})")
        compressor = data.get("compressor")
        if compressor is not None:
            compressor = parse_compressor(compressor, f"{where}.compressor")
        hierarchical = expect(data.get("hierarchical", False), bool, f"{where}.hierarchical")
        return cls(layers=layers, params=params, numel=numel, k=k, compressor=compressor, hierarchical=hierarchical)


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """Predicted time of one iteration under a grouping, and where it goes (seconds): what the cost model's
    simulators return (`planner.costmodel.simulator`) and a plan records for itself and each baseline.

    iteration_s = compute_s + exposed_comm_s, where compute_s is the compute path alone
    (F + backward + selection or packing + decode + U, stretched by interference) and exposed_comm_s the
    communication not hidden behind it. comm_s is the collectives' own time, each as measured alone (with a
    comm stretch the channel is busy longer); interference_s how much longer the compute path is because
    collectives were in flight during it.
    """

    iteration_s: float
    compute_s: float
    exposed_comm_s: float
    comm_s: float
    selection_s: float = 0.0
    decode_s: float = 0.0
    num_groups: int = 1
    pack_s: float = 0.0
    interference_s: float = 0.0


def _prediction_from_dict(data: Any, where: str) -> Prediction:
    expect(data, dict, where)
    fields = ["iteration_s", "compute_s", "exposed_comm_s", "comm_s", "selection_s", "decode_s", "num_groups"]
    optional = ["pack_s", "interference_s"]  # absent in plans made before packing and interference were modelled
    check_fields(data, where, fields, optional)
    times = {f: expect_time(data[f], f"{where}.{f}") for f in [*fields, *optional] if f != "num_groups" and f in data}
    if times["iteration_s"] <= 0:  # every ratio `show` and `bench` print divides by it
        raise SchemaError(f"{where}.iteration_s must be a time above 0 (a step takes time), "
                          f"got {data['iteration_s']!r}")
    return Prediction(**times, num_groups=expect(data["num_groups"], int, f"{where}.num_groups"))


#: Most rows a plan's intervals may name.
MAX_ROWS = 1024
#: Most runners-up a plan may hold.
MAX_RUNNERS_UP = 8


@dataclass(frozen=True, kw_only=True)
class Intervals:
    """Each prediction's interval: its central `level` over `draws` profiles resampled from the samples the profile
    kept (`planner.costmodel.resample`; `sources` says which measurements had samples). `rows` maps "plan" and the
    baselines' names to (low, high) seconds (a baseline the planner could not rebuild has none)."""

    level: float
    draws: int
    sources: tuple[str, ...]
    rows: dict[str, tuple[float, float]]

    def to_dict(self) -> dict[str, Any]:
        return {"level": self.level, "draws": self.draws, "sources": list(self.sources),
                "rows": {name: list(pair) for name, pair in self.rows.items()}}

    @classmethod
    def from_dict(cls, data: Any, where: str = "plan.predicted.intervals") -> Intervals:
        expect(data, dict, where)
        check_fields(data, where, ["level", "draws", "sources", "rows"])
        level = float(expect(data["level"], (int, float), f"{where}.level"))
        if not 0 < level < 1:
            raise SchemaError(f"{where}.level must be in (0, 1) (the share of draws an interval holds), got "
                              f"{data['level']!r}")
        rows = expect(data["rows"], dict, f"{where}.rows")
        if len(rows) > MAX_ROWS:
            raise SchemaError(f"{where}.rows names {len(rows)} rows; at most {MAX_ROWS} are read")
        out = {expect(name, str, f"{where}.rows name"): expect_interval(pair, f"{where}.rows.{name}")
               for name, pair in rows.items()}
        return cls(level=level, draws=expect_int(data["draws"], f"{where}.draws", 1, 1_000_000),
                   sources=tuple(expect(x, str, f"{where}.sources[]") for x in expect(data["sources"], list,
                                                                                    f"{where}.sources")),
                   rows=out)


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """Whether to run the plan or DDP, weighed beyond the noise (`planner.strategies.intervals.weigh`).

    `variants` holds each DDP variant weighed ("ddp" for plain DDP, "ddp+C" for DDP with C's hook): its predicted
    step and interval, (seconds, low, high); `keep` is "plan" or the variant to keep instead; `against` the variant
    the plan gains least on, and `gain` the plan's gain over it, 1 - plan / variant draw by draw: (median, low, high)
    at the intervals' level. The plan is kept when `low` > 0. With `samples` (trials measured the samples each
    needs to a loss, `planner.contracts.trials`), each draw is a step times its `samples` factor: the gains weigh
    time to the loss, while `variants` still hold steps."""

    keep: str
    against: str
    gain: tuple[float, float, float]
    variants: dict[str, tuple[float, float, float]]
    #: The top-k selector of the DDP top-k hooks among `variants` (the one the profile predicts faster for them);
    #: None without such a hook.
    topk_selector: str | None = None
    #: The DDP hooks among `variants` that were predicted but not weighed ("ddp+C"): the plan was kept within an
    #: error budget and C's error on every layer is beyond it.
    beyond_budget: tuple[str, ...] = ()
    #: Each side's factor for the samples it needs over DDP's ("plan" and variants; {}: steps weighed alone).
    samples: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, factor in self.samples.items():
            if name != "plan" and name not in self.variants:
                raise SchemaError(f"plan.predicted.verdict.samples names {name!r}, which is not among the variants")
            if isinstance(factor, bool) or not (isinstance(factor, int | float) and math.isfinite(factor)
                                                and factor > 0):
                raise SchemaError(f"plan.predicted.verdict.samples.{name} must be a factor > 0, got {factor!r}")
        weighed = [name for name in self.variants if name not in self.beyond_budget]
        for name, value in (("keep", self.keep), ("against", self.against)):
            if value not in weighed and not (name == "keep" and value == "plan"):
                raise SchemaError(f"plan.predicted.verdict.{name} names {value!r}, which is not among the variants "
                                  f"weighed ({', '.join(weighed)})")
        if DDP_ROW in self.beyond_budget or not set(self.beyond_budget) <= set(self.variants):
            raise SchemaError("plan.predicted.verdict.beyond_budget must name DDP hooks among its variants, got "
                              f"{', '.join(self.beyond_budget)}")

    @property
    def against_s(self) -> float:
        """The predicted step of the variant the plan gains least on."""
        return self.variants[self.against][0]

    def to_dict(self) -> dict[str, Any]:
        return {"keep": self.keep, "against": self.against, "gain": list(self.gain),
                "variants": {name: list(v) for name, v in self.variants.items()},
                **({} if self.topk_selector is None else {"topk_selector": self.topk_selector}),
                **({"beyond_budget": list(self.beyond_budget)} if self.beyond_budget else {}),
                **({"samples": dict(self.samples)} if self.samples else {})}

    @classmethod
    def from_dict(cls, data: Any, where: str = "plan.predicted.verdict") -> Verdict:
        expect(data, dict, where)
        check_fields(data, where, ["keep", "against", "gain", "variants"],
                     optional=["topk_selector", "beyond_budget", "samples"])
        keep = _ddp_variant(data["keep"], f"{where}.keep", plan_too=True)
        against = _ddp_variant(data["against"], f"{where}.against")
        variants = expect(data["variants"], dict, f"{where}.variants")
        if not variants or len(variants) > MAX_ROWS:
            raise SchemaError(f"{where}.variants must name 1 to {MAX_ROWS} DDP variants, got {len(variants)}")
        steps = {}
        for name, value in variants.items():
            if not isinstance(value, list) or len(value) != 3:
                raise SchemaError(f"{where}.variants.{name} must be [seconds, low, high], got {value!r}")
            step = expect_time(value[0], f"{where}.variants.{name}[0]")
            steps[_ddp_variant(name, f"{where}.variants name")] = (
                step, *expect_interval(value[1:], f"{where}.variants.{name}[1:]"))
        selector = data.get("topk_selector")
        beyond = expect(data.get("beyond_budget", []), list, f"{where}.beyond_budget")
        if len(beyond) > MAX_ROWS:
            raise SchemaError(f"{where}.beyond_budget must name at most {MAX_ROWS} DDP hooks, got {len(beyond)}")
        left_out = tuple(_ddp_variant(name, f"{where}.beyond_budget[{i}]") for i, name in enumerate(beyond))
        samples = expect(data.get("samples", {}), dict, f"{where}.samples")
        if len(samples) > MAX_ROWS + 1:
            raise SchemaError(f"{where}.samples must name at most {MAX_ROWS + 1} rows, got {len(samples)}")
        return cls(keep=keep, against=against, gain=expect_gain(data["gain"], f"{where}.gain"), variants=steps,
                   topk_selector=None if selector is None else check_selector(selector, f"{where}.topk_selector"),
                   beyond_budget=left_out, samples=dict(samples))


def _renamed_ddp_row(rows: dict[str, Any], name: str | None) -> dict[str, Any]:
    """`rows` (baselines or intervals by row name, in order) with a plan written before rows named what they send:
    its "ddp-25mb" row named `name`, what DDP sent in it (a row of that name already there is kept)."""
    if _OLD_DDP_ROW not in rows or name is None or name in rows:
        return rows
    return {name if key == _OLD_DDP_ROW else key: value for key, value in rows.items()}


def _renamed_intervals(intervals: Intervals, name: str | None) -> Intervals:
    return replace(intervals, rows=_renamed_ddp_row(intervals.rows, name))


def _ddp_variant(value: Any, where: str, *, plan_too: bool = False) -> str:
    """"ddp" or "ddp+C" (C a compressor), or with `plan_too` "plan"; else a SchemaError naming `where`."""
    text = expect(value, str, where)
    if text == "ddp" or (plan_too and text == "plan"):
        return text
    if text.startswith("ddp+"):
        return f"ddp+{parse_compressor(text.removeprefix('ddp+'), where)}"
    raise SchemaError(f"{where} must be {'plan, ' if plan_too else ''}ddp or ddp+C (DDP with C's hook, e.g. "
                      f"ddp+fp16), got {text!r}")


def plan_simplicity(plan: Plan) -> int:
    """How simple a plan is to run, for choosing among plans within the noise or a race's margin: 0 a dense plan,
    1 a plan that sends every group losslessly (dense, fp16), 2 a plan with lossy groups."""
    if plan.strategy is Strategy.DENSE:
        return 0
    return 2 if any(plan.compressor_of(g).lossy for g in plan.groups) else 1


def _runner_up(data: Any, name: str) -> Plan:
    """One of `plan.runners_up`, read as a whole plan; its errors name where it sits."""
    where = f"plan.runners_up.{name}"
    expect(data, dict, where)
    if "runners_up" in data or "race" in data:
        raise SchemaError(f"{where} has runners-up or a race of its own; only the plan holding it may")
    try:
        return Plan.from_dict(data)
    except SchemaError as exc:
        raise SchemaError(f"{where}: {exc}") from None


def _hosts_text(hosts: int, world_size: int) -> str:
    """"2 hosts of 2 workers", "1 host of 4 workers"."""
    per = world_size // hosts if hosts and world_size % hosts == 0 else None
    of = f" of {per} worker{'s' if per != 1 else ''}" if per is not None else f" ({world_size} workers)"
    return f"{hosts} host{'s' if hosts != 1 else ''}{of}"


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Decisions for one model on one cluster, and what they are predicted to cost against the baselines."""

    strategy: Strategy
    density: float | None
    model: ModelInfo
    cluster: ClusterInfo
    groups: tuple[Group, ...]
    predicted: Prediction
    baselines: dict[str, Prediction]
    lower_bound_s: float
    solver: str
    solve_seconds: float
    source_profile: str
    profiled: str
    created: str
    kfac: KFACSection | None = None
    abs: ABSSection | None = None
    #: The top-k selector ("exact" or "sampled") of a top-k plan or of a mixed plan's top-k groups; None
    #: otherwise. A top-k plan made without one gets "exact", the selector every plan used before there
    #: was a choice.
    selector: str | None = None
    #: Mixed plans: the compressors the solver could choose from (None: not recorded, or not mixed).
    compressors: tuple[Compressor, ...] | None = None
    #: The per-worker batch of the profile the plan was solved from: what its predictions are for, and what
    #: `planner bench` runs unless told otherwise (None: a plan written before it was recorded).
    batch_size: int | None = None
    #: Each prediction's interval from the profile's samples (None: not computed, or the profile kept none).
    intervals: Intervals | None = None
    #: Plan or DDP, weighed beyond the noise (None: not weighed).
    verdict: Verdict | None = None
    #: Whether the solver proved the plan optimal under the model (of K-FAC and ABS-SGD plans: their gradient
    #: groups); None: not recorded (a plan written before it was).
    optimal: bool | None = None
    #: How far the plan's step may be above the solver's lower bound, (iteration - bound) / bound: 0 when
    #: `optimal`, required when not, None when not recorded.
    gap: float | None = None
    #: The profile's parameters without a gradient in some of its batches: the runtime then needs
    #: `find_unused_parameters=True` (None: not checked, as in plans from profiles made before it was).
    unused_params: UnusedParams | None = None
    #: The plan's compression error and the budget it was solved under (None: not predicted, as for plans from
    #: profiles without an `errors` record).
    error: PlanError | None = None
    #: The plan's finalists raced in real steps, and the one kept (`planner race`; None: not raced).
    race: RaceRecord | None = None
    #: The best plans of other structures the solve found (`--strategy auto`: the best per way of sending), by
    #: name, each predicted by the same model: finalists of the race beside this plan (`planner.sessions.race`).
    #: Each is a whole plan for the same model and cluster, without runners-up of its own or a race.
    runners_up: dict[str, Plan] = field(default_factory=dict)
    schema_version: int = PLAN_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if not self.groups:
            raise SchemaError("a plan needs at least one group")
        self._check_optimality()
        self._check_compressors()
        if self.sends_topk:
            object.__setattr__(self, "selector", check_selector(self.selector or "exact", "plan.selector"))
        elif self.selector is not None:
            raise SchemaError(f"only a plan with top-k groups has a selector, but this {self.strategy.value} plan "
                              f"has selector={self.selector!r}")
        if self.kfac is not None:
            if self.strategy is not Strategy.DENSE:
                raise SchemaError("a K-FAC plan exchanges gradients densely: its strategy must be 'dense'")
            try:
                self.kfac.check_world_size(self.cluster.world_size)
            except PlanMismatchError as exc:
                raise SchemaError(str(exc)) from None
        if self.abs is not None:
            if self.strategy is not Strategy.DENSE or self.kfac is not None:
                raise SchemaError("an ABS-SGD plan exchanges gradients densely and has no kfac section")
            try:
                self.abs.check_world_size(self.cluster.world_size)
            except PlanMismatchError as exc:
                raise SchemaError(str(exc)) from None
        if self.strategy is Strategy.TOPK:
            if self.density is None or not 0 < self.density <= 1:
                raise SchemaError(f"a top-k plan needs `0 < density <= 1`, but got density={self.density}")
            if any(g.k is None for g in self.groups):
                raise SchemaError("every group of a top-k plan needs k")
        elif self.strategy is Strategy.DENSE and any(g.k is not None for g in self.groups):
            raise SchemaError("a dense plan's groups have no k; only top-k groups do")
        elif self.density is not None:
            raise SchemaError(f"only a top-k plan has a density, but this {self.strategy.value} plan has "
                              f"density={self.density}")
        self._check_hierarchical()
        seen: set[str] = set()
        seen_layers: set[str] = set()
        for g in self.groups:
            dup = seen.intersection(g.params)
            if dup:
                raise SchemaError(f"parameter(s) {sorted(dup)} appear in more than one group")
            seen.update(g.params)
            dup = seen_layers.intersection(g.layers)
            if dup:
                raise SchemaError(f"layer(s) {sorted(dup)} appear in more than one group")
            seen_layers.update(g.layers)
        if self.unused_params is not None:
            self.unused_params.check_names(seen, "plan")
        self._check_runners_up()
        numel = sum(g.numel for g in self.groups)
        if len(seen) != self.model.num_params or numel != self.model.numel:
            raise SchemaError(
                f"the groups hold {len(seen)} parameter tensors of {numel:,} elements, but the model "
                f"{self.model.name} has {self.model.num_params} of {self.model.numel:,}: every trainable "
                "parameter must be in one group; re-plan with `planner solve`")

    def _check_optimality(self) -> None:
        """`optimal` a bool or None; `gap` a finite number >= 0, 0 for an optimal plan, given for one that is not,
        absent where optimality is not recorded."""
        if self.optimal is not None and not isinstance(self.optimal, bool):
            raise SchemaError(f"plan.solver.optimal must be true or false, got {self.optimal!r}")
        if self.gap is not None:
            if isinstance(self.gap, bool) or not isinstance(self.gap, int | float) or not math.isfinite(self.gap) \
                    or self.gap < 0:
                raise SchemaError(f"plan.solver.gap must be a finite number >= 0 (a fraction of the bound), got "
                                  f"{self.gap!r}")
            object.__setattr__(self, "gap", float(self.gap))
        match self.optimal, self.gap:
            case None, None:
                pass
            case None, _:
                raise SchemaError("plan.solver.gap needs plan.solver.optimal (whether the plan is proven optimal)")
            case True, None:
                object.__setattr__(self, "gap", 0.0)
            case True, gap if gap != 0:
                raise SchemaError(f"an optimal plan is at its bound: plan.solver.gap must be 0, got {gap!r}")
            case False, None:
                raise SchemaError("a plan not proven optimal needs plan.solver.gap, its distance to the bound")

    def _check_runners_up(self) -> None:
        """Runners-up: few, each a plan of the same kind (gradients, K-FAC) for the same model and cluster, with none of
        its own and no race."""
        if len(self.runners_up) > MAX_RUNNERS_UP:
            raise SchemaError(f"plan.runners_up names {len(self.runners_up)} plans; at most {MAX_RUNNERS_UP} are read")
        for name, other in self.runners_up.items():
            where = f"plan.runners_up.{name}"
            if not isinstance(other, Plan):
                raise SchemaError(f"{where} must be a plan, got {type(other).__name__}")
            if other.runners_up or other.race is not None:
                raise SchemaError(f"{where} has runners-up or a race of its own; only the plan holding it may")
            if other.abs is not None or self.abs is not None or (other.kfac is None) != (self.kfac is None):
                raise SchemaError(f"{where}: a gradient plan's runners-up are gradient plans, a K-FAC plan's K-FAC "
                                  "plans (an ABS-SGD plan has none)")
            if other.model.fingerprint != self.model.fingerprint or other.cluster != self.cluster:
                raise SchemaError(f"{where} is for another model or cluster than the plan holding it")

    def _check_compressors(self) -> None:
        """A mixed plan names every group's compressor, with k exactly for its top-k groups; the others none."""
        if self.strategy is not Strategy.MIXED:
            named = [i for i, g in enumerate(self.groups) if g.compressor is not None]
            if named:
                raise SchemaError(f"only a mixed plan names a compressor per group, but this {self.strategy.value} "
                                  f"plan names one in group {named[0]}")
            if self.compressors is not None:
                raise SchemaError(f"only a mixed plan lists its compressors, but this {self.strategy.value} plan "
                                  "has plan.compressors")
            return
        for i, g in enumerate(self.groups):
            if g.compressor is None:
                raise SchemaError(f"plan.groups[{i}] of a mixed plan needs a compressor (dense, fp16, powersgd:R or "
                                  "topk:D)")
            topk = g.compressor.kind is CompressorKind.TOPK
            if topk and g.k is None:
                raise SchemaError(f"plan.groups[{i}] is sent by {g.compressor} and needs k")
            if not topk and g.k is not None:
                raise SchemaError(f"plan.groups[{i}] is sent by {g.compressor}: only top-k groups have k, but got "
                                  f"k={g.k}")
        if self.compressors is not None:
            allowed = set(self.compressors)
            used = [str(g.compressor) for g in self.groups if g.compressor not in allowed]
            if used:
                raise SchemaError(f"plan.compressors lists {', '.join(map(str, self.compressors))}, but a group is "
                                  f"sent by {used[0]}")

    def _check_hierarchical(self) -> None:
        """Hierarchical groups: in a plan for two or more hosts of equal size."""
        for i, g in enumerate(self.groups):
            if not g.hierarchical:
                continue
            hosts, world = self.cluster.host_count, self.cluster.world_size
            if hosts < 2 or world % hosts:
                raise SchemaError(f"plan.groups[{i}] is hierarchical, but the plan is for "
                                  f"{_hosts_text(hosts, world)}: that needs two or more hosts of equal size")

    def compressor_of(self, group: Group) -> Compressor:
        """How `group` is sent: its own compressor in a mixed plan, else the plan's way (dense, or top-k at the
        plan's density)."""
        match self.strategy:
            case Strategy.MIXED:
                assert group.compressor is not None
                return group.compressor
            case Strategy.TOPK:
                assert self.density is not None
                return Compressor(CompressorKind.TOPK, density=self.density)
            case _:
                return DENSE_COMPRESSOR

    @property
    def sends_topk(self) -> bool:
        """Whether some group is sent by top-k (then the plan has a selector)."""
        if self.strategy is Strategy.MIXED:
            return any(g.compressor is not None and g.compressor.kind is CompressorKind.TOPK for g in self.groups)
        return self.strategy is Strategy.TOPK

    # -- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = {
            "schema_version": self.schema_version,
            "kind": PLAN_KIND,
            "created": self.created,
            "strategy": self.strategy.value,
            "density": self.density,
            "selector": self.selector,
            "model": self.model.to_dict(),
            "cluster": self.cluster.to_dict(),
            "source": {"profile": self.source_profile, "profiled": self.profiled,
                       **({} if self.batch_size is None else {"batch_size": self.batch_size})},
            "solver": {"name": self.solver, "seconds": self.solve_seconds,
                       **({} if self.optimal is None else {"optimal": self.optimal, "gap": self.gap})},
            "groups": [g.to_dict() for g in self.groups],
            "predicted": {
                "plan": asdict(self.predicted),
                "baselines": {name: asdict(p) for name, p in self.baselines.items()},
                "lower_bound_s": self.lower_bound_s,
                **({} if self.intervals is None else {"intervals": self.intervals.to_dict()}),
                **({} if self.verdict is None else {"verdict": self.verdict.to_dict()}),
            },
            "kfac": None if self.kfac is None else self.kfac.to_dict(),
            "abs": None if self.abs is None else self.abs.to_dict(),
        }
        if self.compressors is not None:
            out["compressors"] = [str(c) for c in self.compressors]
        if self.unused_params is not None:
            out["unused_params"] = self.unused_params.to_dict()
        if self.error is not None:
            out["error"] = self.error.to_dict()
        if self.race is not None:
            out["race"] = self.race.to_dict()
        if self.runners_up:
            out["runners_up"] = {name: other.to_dict() for name, other in self.runners_up.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        version = data.get("schema_version")
        if version != PLAN_SCHEMA_VERSION:
            raise SchemaError(
                f"unknown plan schema_version {version!r}; this planner reads version {PLAN_SCHEMA_VERSION}:"
                " re-plan with `planner solve`"
            )
        if data.get("kind") != PLAN_KIND:
            raise SchemaError(f"not a plan: kind is {data.get('kind')!r}, expected {PLAN_KIND!r}")
        fields = ["schema_version", "kind", "created", "strategy", "density", "model", "cluster", "source", "solver"]
        data = {"kfac": None, "abs": None, "selector": None, "compressors": None, "unused_params": None,
                "error": None, "race": None, "runners_up": {}, **data}
        check_fields(data, "plan", [*fields, "groups", "predicted", "kfac", "abs", "selector", "compressors",
                                    "unused_params", "error", "race", "runners_up"])
        runners_up = expect(data["runners_up"], dict, "plan.runners_up")
        if len(runners_up) > MAX_RUNNERS_UP:
            raise SchemaError(f"plan.runners_up names {len(runners_up)} plans; at most {MAX_RUNNERS_UP} are read")
        try:
            strategy = Strategy(data["strategy"])
        except ValueError:
            raise SchemaError(
                f"plan.strategy must be one of {[s.value for s in Strategy]}, got {data['strategy']!r}"
            ) from None
        density = data["density"]
        if density is not None:
            density = float(expect(density, (int, float), "plan.density"))
            if not math.isfinite(density):
                raise SchemaError(f"plan.density must be finite, got {density}")
        selector = data["selector"]
        if selector is not None:
            selector = check_selector(selector, "plan.selector")
        source = expect(data["source"], dict, "plan.source")
        source = {"batch_size": None, **source}
        check_fields(source, "plan.source", ["profile", "profiled", "batch_size"])
        batch_size = source["batch_size"]
        if batch_size is not None:
            batch_size = expect_int(batch_size, "plan.source.batch_size", 1, MAX_NUMEL)
        solver = expect(data["solver"], dict, "plan.solver")
        check_fields(solver, "plan.solver", ["name", "seconds"], optional=["optimal", "gap"])
        optimal = solver.get("optimal")
        if optimal is not None:
            optimal = expect(optimal, bool, "plan.solver.optimal")
        gap = solver.get("gap")
        if gap is not None:
            gap = float(expect(gap, (int, float), "plan.solver.gap"))
        predicted = expect(data["predicted"], dict, "plan.predicted")
        check_fields(predicted, "plan.predicted", ["plan", "baselines", "lower_bound_s"],
                     optional=["intervals", "verdict"])
        try:
            renamed: str | None = ddp_row(strategy, density)
        except CompressorError:
            renamed = None  # a top-k plan without a valid density: refused below, with the field named
        baselines = _renamed_ddp_row(expect(predicted["baselines"], dict, "plan.predicted.baselines"), renamed)
        groups = expect(data["groups"], list, "plan.groups")
        compressors = data["compressors"]
        if compressors is not None:
            compressors = tuple(parse_compressor(c, f"plan.compressors[{i}]")
                                for i, c in enumerate(expect(compressors, list, "plan.compressors")))
        return cls(
            schema_version=version,
            created=expect(data["created"], str, "plan.created"),
            strategy=strategy,
            density=density,
            selector=selector,
            model=ModelInfo.from_dict(data["model"], "plan.model"),
            cluster=ClusterInfo.from_dict(data["cluster"], "plan.cluster"),
            source_profile=expect(source["profile"], str, "plan.source.profile"),
            profiled=expect(source["profiled"], str, "plan.source.profiled"),
            solver=expect(solver["name"], str, "plan.solver.name"),
            solve_seconds=expect_time(solver["seconds"], "plan.solver.seconds"),
            groups=tuple(Group.from_dict(g, f"plan.groups[{i}]") for i, g in enumerate(groups)),
            predicted=_prediction_from_dict(predicted["plan"], "plan.predicted.plan"),
            baselines={
                expect(k, str, "baseline name"): _prediction_from_dict(v, f"plan.predicted.baselines.{k}")
                for k, v in baselines.items()
            },
            lower_bound_s=expect_time(predicted["lower_bound_s"], "plan.predicted.lower_bound_s"),
            kfac=None if data["kfac"] is None else KFACSection.from_dict(data["kfac"]),
            abs=None if data["abs"] is None else ABSSection.from_dict(data["abs"]),
            compressors=compressors,
            batch_size=batch_size,
            intervals=None if predicted.get("intervals") is None else _renamed_intervals(
                Intervals.from_dict(predicted["intervals"]), renamed),
            verdict=None if predicted.get("verdict") is None else Verdict.from_dict(predicted["verdict"]),
            optimal=optimal,
            gap=gap,
            unused_params=(None if data["unused_params"] is None
                           else UnusedParams.from_dict(data["unused_params"], "plan.unused_params")),
            error=None if data["error"] is None else PlanError.from_dict(data["error"]),
            race=None if data["race"] is None else RaceRecord.from_dict(data["race"]),
            runners_up={expect(name, str, "plan.runners_up name"): _runner_up(other, name)
                        for name, other in runners_up.items()},
        )

    @property
    def ddp_row(self) -> str:
        """The name of the baseline row of DDP on its own buckets (`ddp_row`): what the table compares against."""
        return ddp_row(self.strategy, self.density)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically."""
        write_json_atomic(path, self.to_dict(), "plan")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read and validate; errors name the file and the field."""
        data = read_json(path, "plan")
        try:
            return cls.from_dict(data)
        except SchemaError as exc:
            raise type(exc)(f"plan {path}: {exc}") from None

    # -- use -------------------------------------------------------------------------------------
    def replan_command(self, model: str | None = None) -> str:
        """The commands that make a fresh plan for `model` (a `--model` value; default this plan's) and
        the current cluster."""
        density = f" --density {self.density}" if self.strategy is Strategy.TOPK else ""
        if self.strategy is Strategy.MIXED:
            named = self.compressors or tuple(dict.fromkeys(self.compressor_of(g) for g in self.groups))
            density = " --compressors " + ",".join(map(str, named))
        strategy = "kfac" if self.kfac is not None else "abs" if self.abs is not None else self.strategy.value
        batch = f" --global-batch {self.abs.global_batch}" if self.abs is not None else ""
        return (
            f"planner profile --model {model or self.model.name} --nproc <N> -o profile.json && "
            f"planner solve profile.json --strategy {strategy}{density}{batch} -o plan.json"
        )

    def check_compatible(
        self, model: ModelInfo, world_size: int, *, backend: str | None = None, device_kind: str | None = None,
        hosts: int | None = None,
    ) -> None:
        """Refuse to run on another model, world size, backend, kind of device (cpu or gpu) or number of hosts,
        naming the difference and how to re-plan. `backend`, `device_kind` and `hosts` are checked when given."""
        if model.fingerprint != self.model.fingerprint:
            from planner.models import BUILTIN_MODELS  # deferred: reading a plan or a profile loads no torch

            # The given model's own --model value when it is one (a built-in name or a factory spec).
            spec = model.name if model.name in BUILTIN_MODELS or ":" in model.name else "<package.module:factory>"
            raise PlanMismatchError(
                f"this plan was made for model {self.model.describe()}, but the model given is "
                f"{model.describe()}; re-plan for it: {self.replan_command(spec)}"
            )
        retune = "; re-plan with `planner retune PLAN`, or pass auto_retune=True to the runtime"
        if world_size != self.cluster.world_size:
            raise PlanMismatchError(
                f"this plan was made for world size {self.cluster.world_size}, but the process group has "
                f"world size {world_size}{retune}"
            )
        if hosts is not None and hosts != self.cluster.host_count:
            raise PlanMismatchError(
                f"this plan was made for {_hosts_text(self.cluster.host_count, world_size)}, but the process group "
                f"runs on {_hosts_text(hosts, world_size)}{retune}"
            )
        if backend is not None and backend != self.cluster.backend:
            raise PlanMismatchError(
                f"this plan was made for backend {self.cluster.backend}, but the process group uses {backend}{retune}"
            )
        if device_kind is not None and device_kind != self.cluster.device_kind:
            raise PlanMismatchError(
                f"this plan was made for {self.cluster.device_kind} ({self.cluster.device}), but the model is on "
                f"a {device_kind}{retune}"
            )

    @property
    def param_order(self) -> list[str]:
        """Every planned parameter, group by group."""
        return [p for g in self.groups for p in g.params]
