"""The profile: what was measured on the target devices and process group. Loading one never runs code.

Schema (version 1), times in seconds, sizes in elements unless the name says bytes:

    {
      "schema_version": 1, "kind": "planner.profile",
      "created": "<ISO date>", "torch_version": "2.13.0",
      "model": {"name", "fingerprint", "num_params", "numel"},
      "cluster": {"world_size", "backend", "device", "host_count"},
      "batch_size": 16, "element_bytes": 4,
      "forward_s": ..., "backward_s": ..., "update_s": ...,      # medians of whole-model phases (the
                                                                  # slowest worker's, as the layers')
      "layers": [                                                 # in the order gradients became ready
        {"name", "params": [...], "numel", "forward_s", "backward_s", "backward_iqr_s"}, ...
      ],
      "steps": {"whole_s": [...], "forward_s": [...],             # optional: the layer phase's measured steps,
                "update_s": [...], "backward_s": [[b_i...], ...]},# which the numbers above are medians of
      "collectives": {                                            # bytes = message size per rank
        "allreduce": {"points": [[bytes, seconds], ...], "alpha_s", "beta_s_per_byte", "fit_error",
                      "samples": [[s, s, ...], ...]}, ...         # optional: each point's runs (it is their mean)
      },
      "topk_left_out": {"compressors": ["topk:0.01"],             # optional: why "topk" is null: the plans
                        "budget": "fp16"},                        # the profile was made for send no top-k
      "topk": {                                                   # null when not measured
        "select": [[numel, density, seconds], ...],               # the "exact" selector (torch.topk)
        "select_sampled": [[numel, density, seconds], ...],       # the "sampled" selector; [] or absent:
                                                                  # not measured (exact only)
        "decode": {"points": [[values, seconds], ...], "alpha_s", "beta_s_per_byte", "fit_error"},
                                                                  # at density 1% (or the nearest measured)
        "decode_points": [[values, density, seconds], ...]        # at every measured density; [] or
      },                                                          # absent: `decode` serves every density
      "step_s": 0.8,                                              # whole local steps, timed between hooked ones
      "parts_scale": 0.97,                                        # the factor forward_s, the layers' times and
                                                                  # update_s were scaled by to sum to step_s
      "throughput": {"batch_sizes": [8, 16, 32],                  # null or absent: not measured
                     "step_s": [[s, s, s], [s, s, s]]},           # per rank: a local step at each micro-batch
      "pack": {"points": [[numel, seconds], ...], "alpha_s", "beta_s_per_byte", "fit_error"},
                                                                  # dense: a group's gradients into its flat
                                                                  # buffer, divided by P (the runtime's
                                                                  # `write_scaled`); null or absent: free
      "interference": {"allreduce": 0.9, "allgather": 1.1},       # sigma per collective: compute runs
                                                                  # 1 + sigma times slower while one is in
                                                                  # flight; null or absent: 0
      "comm_stretch": {"allreduce": 0.7, "allgather": 0.6},       # kappa per collective: a chain of them
                                                                  # runs 1 + kappa times slower while the
                                                                  # workers compute; null or absent: 0
      "slowdown_samples": {"allreduce": {"alone_s", "busy_s",     # optional: the pairs sigma and kappa are
                           "pace_alone_s", "pace_busy_s"}, ...},  # taken from
      "in_situ": {                                                # null or absent: factors of 1
        "pack": {"factor", "measured_s", "modelled_s",            # the runtime's hooks in real backward
                 "samples_s", "attempts"},                        # (optional: the samples, the attempts)
        "select": {"exact": {...}, "sampled": {...}},             # passes, against the micro-benchmarks
        "decode": {...},                                          # (see below)
        "ddp_pack": {...},                                        # optional: DDP's own bucket copies
        "compress": {"fp16": {"prepare": {...}, "decode": {...}}, # optional: each compressor's work
                     "powersgd:4": {...}, ...},
        "kfac_factors": {...},                                    # optional: K-FAC's factor hooks in real
                                                                  # forward and backward passes
        "kfac_steps": {"fold": {...}, "invert:eigen": {...},      # optional: K-FAC's step() after the
                       "invert:inverse": {...},                   # gradients in real steps, per part
                       "precondition:eigen": {...}, "precondition:inverse": {...}}
      },
      "compress": {                                               # null or absent: fp16 and PowerSGD not
        "fp16_cast": {"points": [[numel, seconds], ...], ...},    # measured (fp32 -> fp16 / world size)
        "fp16_uncast": {"points": ..., ...},                      # fp16 -> fp32
        "powersgd": [                                             # per layer (ready order) and rank
          {"layer", "rank", "shapes": [[64, 3, 3, 3], [64]], "compress_s", "middle_s", "decompress_s"}, ...
        ]
      },
      "quick": true,                                              # optional: `planner profile --quick`
      "unused_params": {"batches", "never", "sometimes"},         # optional: parameters without a gradient in
                                                                  # some batches (planner.contracts.unused)
      "errors": {"warmup", "layers", "grad_sq",                   # optional: each compressor's error on each
                 "compressors": {"topk:0.01": {...}, ...}},       # layer in real steps (planner.contracts.errors)
      "hosts": {"ranks": [[0, 1], [2, 3]],                        # null or absent: one host (or hosts of
                "intra": {...}, "inter": {...},                   # unequal size); the allreduce inside each
                "hierarchical": {...},                            # host, across them (one shard) and both
                                                                  # (planner.kernels.hierarchical), against
                                                                  # the whole message's bytes per rank
                "topk": [{"density", "union_ratio",               # optional: hierarchical top-k at each
                          "exchange": {...}}, ...]},              # density, against one rank's message bytes
      "peak_memory": {"layers": 812345344, "top-k": ..., ...},    # null or absent: not measured; bytes
                                                                  # resident at the peak of each phase
                                                                  # (the busiest worker's)
      "kfac": {                                                   # null or absent when not measured
        "layers": [                                               # Linear/Conv2d layers, forward order
          {"name", "a_dim", "g_dim", "a_compute_s", "g_compute_s", "fold_s",
           "precondition_eigen_s", "precondition_inverse_s"}, ...
        ],
        "inverse": {"points": [[dim, seconds], ...], "alpha_s", "beta_s_per_dim3", "fit_error"},
        "eigen":   {"points": [[dim, seconds], ...], "alpha_s", "beta_s_per_dim3", "fit_error"}
      }
    }

Top-k: `select` and `select_sampled` time `planner.kernels.topk.select_topk` (residual update included)
with `selector="exact"` and `selector="sampled"`; both pick the same k entries, so a plan may use
either, and the solver keeps the one predicted faster. A profile without `select_sampled` (written
before the sampled selector existed) offers the exact selector only.

K-FAC: `a_compute_s` is the time to compute a layer's A factor from its input (added to forward on a
factor-update step), `g_compute_s` the time for G from its output gradient (added to backward),
`fold_s` the time to unpack both averaged factors and fold them into the running averages (after the
factor allreduces, on a factor-update step), `precondition_eigen_s` / `precondition_inverse_s` the
time to precondition its gradient (every step) with eigendecompositions or with inverses. Inversion
and eigendecomposition times are measured against the matrix dimension d, modelled as alpha + beta*d^3.

Compressors: `fp16_cast` and `fp16_uncast` time `planner.kernels.compress.fp16_compress` and
`fp16_decompress` against the elements of a group; `powersgd` times `PowerSGDGroup.compress`, `middle` and
`decompress` on each layer's own tensors (their shapes are recorded: they decide what is compressed and how
large P and Q are) at each rank measured. PowerSGD's work is per tensor, so a group costs the sum over its
layers. A profile without `compress` plans dense and top-k groups only.

Interference: `planner profile` times the model's backward pass alone and while a chain of collectives
is in flight on the same workers (as it is during a real step); sigma = with / alone - 1, at least 0.
On a CPU the collectives' copies, reductions and socket work take cores and memory bandwidth from
compute; on a GPU their kernels take SMs and memory bandwidth. It depends on the network (over loopback
a collective takes as much CPU as it can get), so `--only comm` keeps the old values and says so.

In situ: the micro-benchmarks above time packing, selection and decoding on their own; inside a real
step the same work also slows the backward pass around it (caches and memory bandwidth are shared) and
meets colder data. `planner profile` runs the runtime itself (`GradientExchange` with one group per
layer, sending nothing) in real steps beside steps without it: `measured_s` is how much longer the
backward pass (pack, select) or the synchronize call (decode) takes, `modelled_s` what the
micro-benchmarked curves predict for the same groups, and the solvers use the curves times
`factor` = measured / modelled (1 where the measurement is not used: see "Samples"). `ddp_pack` does the same
for PyTorch DDP (with a comm hook that sends nothing) on its 25 MB buckets: the rows of plans that DDP runs ("ddp",
"ddp+C") are predicted with DDP's own packing cost
(`planner.costmodel.from_profile.gradient_problem(..., runtime="ddp")`), the other rows with this runtime's.

Samples: where a number is a statistic of repeated measurements, the profile keeps them (older profiles do not):
the steps of the layer phase, each collective point's runs, each in-situ calibration's paired differences (or the
work's own durations), the pairs sigma and kappa come from. `planner.costmodel.resample` draws profiles from them,
which gives every prediction an interval (`planner.strategies.intervals`). An in-situ calibration whose interval
includes no effect, or that lies outside 0.5x-20x of its micro-benchmark, is measured once more and, if still so,
not used: its micro-benchmark stands (`planner.spread.calibration_use`).

`backward_s` of a layer is the time between the previous layer's gradient becoming ready and its own
(b_i of the timeline model). `fit_error` is the median relative error of the fitted alpha + beta*x.
The solvers use the fit where it is good (every point within `planner.costmodel.measured.MAX_FIT_ERROR`) and
otherwise interpolate the measured points (DESIGN.md: fitted where the data is linear, interpolated where it is
not). This module holds the curves and their checks; `planner.costmodel.curves` fits and reads them.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from planner.contracts.errors import CompressionErrors
from planner.contracts.fingerprint import ClusterInfo, ModelInfo
from planner.contracts.jsonio import (
    MAX_NUMEL,
    MAX_SECONDS,
    MAX_WORLD_SIZE,
    check_fields,
    expect,
    expect_int,
    expect_time,
    read_json,
    write_json_atomic,
)
from planner.contracts.kfac_section import left_out_from_json
from planner.contracts.plan import SELECTORS, check_selector, parse_compressor
from planner.contracts.unused import UnusedParams
from planner.spread import CalibrationUse, calibration_use
from planner.types import (
    MAX_POWERSGD_RANK,
    Collective,
    Compressor,
    CompressorKind,
    InvalidProfileError,
    InverseMethod,
    SchemaError,
)

__all__ = [
    "KFAC_STEP_NAMES",
    "KFAC_STEP_PARTS",
    "PROFILE_KIND",
    "PROFILE_SCHEMA_VERSION",
    "Calibration",
    "CompressTiming",
    "DimCurve",
    "FittedCurve",
    "HostTiming",
    "HostTopk",
    "InSitu",
    "KFACLayerTiming",
    "KFACTiming",
    "LayerTiming",
    "PowerSGDLayerTiming",
    "Profile",
    "SlowdownSamples",
    "StepSamples",
    "TopkLeftOut",
    "TopkTiming",
    "WorkerThroughput",
]

PROFILE_SCHEMA_VERSION = 1
PROFILE_KIND = "planner.profile"


#: Largest batch size a profile may record.
MAX_BATCH_SIZE = 2**31
#: The parts of a K-FAC step after the gradients that the profile calibrates in real steps (`InSitu.kfac_steps`).
KFAC_STEP_PARTS = ("fold", "invert:eigen", "invert:inverse", "precondition:eigen", "precondition:inverse")
#: How `planner profile` and `show` name the parts of `InSitu.kfac_steps`.
KFAC_STEP_NAMES = {"fold": "folding", "invert:eigen": "eigendecompositions", "invert:inverse": "inverses",
                   "precondition:eigen": "preconditioning (eigen)", "precondition:inverse": "preconditioning (inverse)"}


def _time(value: Any, where: str) -> float:
    return expect_time(value, where, InvalidProfileError)


#: Most samples one measured quantity may keep (a profile keeps them to give its numbers intervals).
MAX_SAMPLES = 100_000


def _samples(value: Any, where: str, *, signed: bool = False) -> tuple[float, ...]:
    """A non-empty list of seconds as a tuple: durations (>= 0), or with `signed` differences of durations."""
    items = expect(value, list, where)
    if not items or len(items) > MAX_SAMPLES:
        raise InvalidProfileError(f"{where} must list 1 to {MAX_SAMPLES} samples, got {len(items)}")
    if not signed:
        return tuple(_time(x, f"{where}[{i}]") for i, x in enumerate(items))
    out = []
    for i, x in enumerate(items):
        v = float(expect(x, (int, float), f"{where}[{i}]"))
        if not (math.isfinite(v) and abs(v) <= MAX_SECONDS):
            raise InvalidProfileError(f"{where}[{i}] must be a difference of times within +-{MAX_SECONDS:g} seconds, "
                                      f"got {x!r}")
        out.append(v)
    return tuple(out)


def _element_bytes(value: Any, where: str) -> int:
    size = expect(value, int, where)
    if size not in (1, 2, 4, 8):
        raise InvalidProfileError(f"{where} must be 1, 2, 4 or 8 (bytes per gradient element), got {size}")
    return int(size)


def _check_distinct_layers(layers: tuple[LayerTiming, ...]) -> None:
    """Each layer named once and each parameter in one layer (a tied parameter is listed once)."""
    seen: dict[str, int] = {}
    owner: dict[str, int] = {}
    for i, layer in enumerate(layers):
        if layer.name in seen:
            raise InvalidProfileError(f"profile.layers[{i}].name {layer.name!r} repeats profile.layers"
                                      f"[{seen[layer.name]}]; every layer appears once")
        seen[layer.name] = i
        for param in layer.params:
            if param in owner:
                raise InvalidProfileError(f"profile.layers[{i}] lists parameter {param!r} of profile.layers"
                                          f"[{owner[param]}]; every parameter belongs to one layer")
            owner[param] = i


@dataclass(frozen=True, kw_only=True)
class LayerTiming:
    """One layer's measured times (medians over repetitions) and gradient size."""

    name: str
    params: tuple[str, ...]
    numel: int
    forward_s: float
    backward_s: float
    backward_iqr_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "params": list(self.params),
            "numel": self.numel,
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
            "backward_iqr_s": self.backward_iqr_s,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str) -> LayerTiming:
        expect(data, dict, where)
        check_fields(data, where, ["name", "params", "numel", "forward_s", "backward_s", "backward_iqr_s"])
        numel = expect_int(data["numel"], f"{where}.numel", 1, MAX_NUMEL, InvalidProfileError)
        params = tuple(expect(p, str, f"{where}.params[]") for p in expect(data["params"], list, f"{where}.params"))
        if not params:
            raise InvalidProfileError(f"{where}.params is empty: a layer without parameters has no gradient to plan")
        if len(set(params)) < len(params):
            raise InvalidProfileError(f"{where}.params lists a parameter twice: {sorted(params)}")
        return cls(
            name=expect(data["name"], str, f"{where}.name"),
            params=params,
            numel=numel,
            forward_s=_time(data["forward_s"], f"{where}.forward_s"),
            backward_s=_time(data["backward_s"], f"{where}.backward_s"),
            backward_iqr_s=_time(data["backward_iqr_s"], f"{where}.backward_iqr_s"),
        )


def _measured_points(data: Any, where: str, size: str) -> list[tuple[int, float]]:
    """[[size, seconds], ...] as (int, time) pairs, each checked."""
    points = []
    for i, p in enumerate(expect(data, list, where)):
        if not isinstance(p, list) or len(p) != 2:
            raise SchemaError(f"{where}[{i}] must be [{size}, seconds], got {p!r}")
        # a size of 0 divided the solver's per-byte interpolation; a negative one was planned with
        n = expect_int(p[0], f"{where}[{i}][0] ({size})", 1, MAX_NUMEL * 8, InvalidProfileError)
        points.append((n, _time(p[1], f"{where}[{i}][1]")))
    return points


@dataclass(frozen=True, kw_only=True)
class FittedCurve:
    """Raw (size, seconds) points and their alpha + beta*size fit; `samples`, where kept, the runs each point's
    seconds are the mean of (the slowest rank's time in each run), in the order of `points`. Fitted and read as a
    cost by `planner.costmodel.curves`."""

    points: tuple[tuple[int, float], ...]
    alpha_s: float
    beta_s_per_byte: float
    fit_error: float
    samples: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self) -> None:
        if self.samples is not None and len(self.samples) != len(self.points):
            raise InvalidProfileError(f"a curve keeps samples for {len(self.samples)} points but has "
                                      f"{len(self.points)} points")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "points": [list(p) for p in self.points],
            "alpha_s": self.alpha_s,
            "beta_s_per_byte": self.beta_s_per_byte,
            "fit_error": self.fit_error,
        }
        if self.samples is not None:  # curves without them stay as they were
            out["samples"] = [list(s) for s in self.samples]
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str) -> FittedCurve:
        expect(data, dict, where)
        check_fields(data, where, ["points", "alpha_s", "beta_s_per_byte", "fit_error"], optional=["samples"])
        points = _measured_points(data["points"], f"{where}.points", "size")
        if len(points) < 2:
            raise InvalidProfileError(f"{where} needs at least two measured points, got {len(points)}")
        samples = data.get("samples")
        if samples is not None:
            rows = expect(samples, list, f"{where}.samples")
            if len(rows) != len(points):
                raise InvalidProfileError(f"{where}.samples must list the runs of each of its {len(points)} points, "
                                          f"got {len(rows)} lists")
            samples = tuple(_samples(row, f"{where}.samples[{i}]") for i, row in enumerate(rows))
        return cls(
            points=tuple(points),
            alpha_s=_time(data["alpha_s"], f"{where}.alpha_s"),
            beta_s_per_byte=_time(data["beta_s_per_byte"], f"{where}.beta_s_per_byte"),
            fit_error=_time(data["fit_error"], f"{where}.fit_error"),
            samples=samples,
        )


SelectPoints = tuple[tuple[int, float, float], ...]


@dataclass(frozen=True, kw_only=True)
class TopkTiming:
    """Top-k selection time against (numel, density) for each selector, and decode time against values.

    `select` holds the exact selector's points and `select_sampled` the sampled one's (empty when the
    profile predates it or did not measure it). Decoding scatters P * k values into a zeroed dense
    gradient of numel elements: its cost has a part in numel and a part in P * k, so at a given P * k it
    depends on the density too. `decode_points` holds it at every measured density (empty in profiles
    measured before: then `decode`, measured at 1%, serves every density).
    """

    select: SelectPoints
    decode: FittedCurve
    select_sampled: SelectPoints = ()
    decode_points: SelectPoints = ()  # (P * k values decoded, density, seconds)

    def points(self, selector: str = "exact") -> SelectPoints:
        """The (numel, density, seconds) points of `selector`.

        Raises:
            SchemaError: an unknown selector name.
        """
        match check_selector(selector, "the top-k selector"):
            case "exact":
                return self.select
            case "sampled":
                return self.select_sampled
            case _:  # pragma: no cover - check_selector admits SELECTORS only
                raise SchemaError(f"unknown top-k selector {selector!r}")

    def selectors(self) -> list[str]:
        """The selectors this profile measured, in `SELECTORS` order."""
        return [s for s in SELECTORS if self.points(s)]

    def densities(self, selector: str = "exact") -> list[float]:
        return sorted({d for _, d, _ in self.points(selector)})

    def scaled(self, factor: float) -> TopkTiming:
        """Every selection time of every selector multiplied by `factor` (the decode times unchanged)."""
        return replace(
            self,
            select=tuple((n, d, t * factor) for n, d, t in self.select),
            select_sampled=tuple((n, d, t * factor) for n, d, t in self.select_sampled),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "select": [list(p) for p in self.select],
            "select_sampled": [list(p) for p in self.select_sampled],
            "decode": self.decode.to_dict(),
            "decode_points": [list(p) for p in self.decode_points],
        }

    @classmethod
    def from_dict(cls, data: Any, where: str) -> TopkTiming:
        expect(data, dict, where)
        check_fields(data, where, ["select", "decode"], optional=["select_sampled", "decode_points"])
        return cls(
            select=_select_points(data["select"], f"{where}.select"),
            select_sampled=_select_points(data.get("select_sampled", []), f"{where}.select_sampled"),
            decode=FittedCurve.from_dict(data["decode"], f"{where}.decode"),
            decode_points=_select_points(data.get("decode_points", []), f"{where}.decode_points", what="values"),
        )


def _select_points(data: Any, where: str, what: str = "numel") -> SelectPoints:
    """[[size, density, seconds], ...] as checked tuples (`what` names the size in messages)."""
    select = []
    for i, p in enumerate(expect(data, list, where)):
        if not isinstance(p, list) or len(p) != 3:
            raise SchemaError(f"{where}[{i}] must be [{what}, density, seconds], got {p!r}")
        n = expect(p[0], int, f"{where}[{i}][0]")
        d = float(expect(p[1], (int, float), f"{where}[{i}][1]"))
        if n <= 0 or not 0 < d <= 1:
            raise InvalidProfileError(f"{where}[{i}]: `{what} > 0 and 0 < density <= 1`, got {p!r}")
        select.append((n, d, _time(p[2], f"{where}[{i}][2]")))
    return tuple(select)


@dataclass(frozen=True, kw_only=True)
class PowerSGDLayerTiming:
    """PowerSGD's work on one layer's tensors at one rank: its three steps (planner.kernels.compress)."""

    layer: str
    rank: int
    shapes: tuple[tuple[int, ...], ...]
    compress_s: float
    middle_s: float
    decompress_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "rank": self.rank, "shapes": [list(s) for s in self.shapes],
                "compress_s": self.compress_s, "middle_s": self.middle_s, "decompress_s": self.decompress_s}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> PowerSGDLayerTiming:
        expect(data, dict, where)
        check_fields(data, where, ["layer", "rank", "shapes", "compress_s", "middle_s", "decompress_s"])
        shapes = []
        for i, shape in enumerate(expect(data["shapes"], list, f"{where}.shapes")):
            dims = tuple(expect_int(d, f"{where}.shapes[{i}][]", 1, MAX_NUMEL, InvalidProfileError)
                         for d in expect(shape, list, f"{where}.shapes[{i}]"))
            if len(dims) > 8 or math.prod(dims) > MAX_NUMEL:
                raise InvalidProfileError(f"{where}.shapes[{i}] must have at most 8 dimensions and {MAX_NUMEL} "
                                          f"elements, got {list(dims)}")
            shapes.append(dims)
        if not shapes:
            raise InvalidProfileError(f"{where}.shapes is empty: a layer has at least one tensor")
        return cls(layer=expect(data["layer"], str, f"{where}.layer"),
                   rank=expect_int(data["rank"], f"{where}.rank", 1, MAX_POWERSGD_RANK, InvalidProfileError),
                   shapes=tuple(shapes), compress_s=_time(data["compress_s"], f"{where}.compress_s"),
                   middle_s=_time(data["middle_s"], f"{where}.middle_s"),
                   decompress_s=_time(data["decompress_s"], f"{where}.decompress_s"))


#: The runtime's calibrated parts of a compressor's work (`InSitu.compress`), in words.
_RUNTIME_PARTS = {"prepare": "compression", "decode": "decompression", "send": "sending"}


@dataclass(frozen=True, kw_only=True)
class CompressTiming:
    """What fp16 and PowerSGD cost on this device (see the module docstring)."""

    fp16_cast: FittedCurve
    fp16_uncast: FittedCurve
    powersgd: tuple[PowerSGDLayerTiming, ...] = ()
    #: What an allreduce of fp16 elements costs beyond one of fp32 elements of the same bytes (against the fp16
    #: message's bytes; `profilers.comm.measure_fp16_sum`); None in profiles from before it was measured, whose
    #: fp16 allreduce is priced as an fp32 one of its bytes.
    fp16_sum: FittedCurve | None = None

    def __post_init__(self) -> None:
        seen: set[tuple[str, int]] = set()
        for row in self.powersgd:
            if (row.layer, row.rank) in seen:
                raise InvalidProfileError(f"profile.compress.powersgd times layer {row.layer!r} at rank {row.rank} "
                                          "twice")
            seen.add((row.layer, row.rank))

    def ranks(self) -> list[int]:
        """The PowerSGD ranks measured."""
        return sorted({row.rank for row in self.powersgd})

    def powersgd_at(self, rank: int) -> dict[str, PowerSGDLayerTiming]:
        """Layer name -> its timing at `rank` (empty if that rank was not measured)."""
        return {row.layer: row for row in self.powersgd if row.rank == rank}

    def to_dict(self) -> dict[str, Any]:
        out = {"fp16_cast": self.fp16_cast.to_dict(), "fp16_uncast": self.fp16_uncast.to_dict(),
               "powersgd": [row.to_dict() for row in self.powersgd]}
        if self.fp16_sum is not None:
            out["fp16_sum"] = self.fp16_sum.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str) -> CompressTiming:
        expect(data, dict, where)
        check_fields(data, where, ["fp16_cast", "fp16_uncast", "powersgd"], optional=["fp16_sum"])
        rows = expect(data["powersgd"], list, f"{where}.powersgd")
        return cls(fp16_cast=FittedCurve.from_dict(data["fp16_cast"], f"{where}.fp16_cast"),
                   fp16_uncast=FittedCurve.from_dict(data["fp16_uncast"], f"{where}.fp16_uncast"),
                   powersgd=tuple(PowerSGDLayerTiming.from_dict(r, f"{where}.powersgd[{i}]")
                                  for i, r in enumerate(rows)),
                   fp16_sum=(None if data.get("fp16_sum") is None
                             else FittedCurve.from_dict(data["fp16_sum"], f"{where}.fp16_sum")))


@dataclass(frozen=True, kw_only=True)
class DimCurve:
    """Seconds against a matrix dimension d (raw points) and the fit alpha + beta * d^3 (`planner.costmodel.curves`
    fits and reads it)."""

    points: tuple[tuple[int, float], ...]
    alpha_s: float
    beta_s_per_dim3: float
    fit_error: float

    def scaled(self, factor: float) -> DimCurve:
        """The same curve with every time multiplied by `factor`."""
        return replace(self, points=tuple((d, t * factor) for d, t in self.points), alpha_s=self.alpha_s * factor,
                       beta_s_per_dim3=self.beta_s_per_dim3 * factor)

    def to_dict(self) -> dict[str, Any]:
        return {
            "points": [list(p) for p in self.points],
            "alpha_s": self.alpha_s,
            "beta_s_per_dim3": self.beta_s_per_dim3,
            "fit_error": self.fit_error,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str) -> DimCurve:
        expect(data, dict, where)
        check_fields(data, where, ["points", "alpha_s", "beta_s_per_dim3", "fit_error"])
        points = _measured_points(data["points"], f"{where}.points", "dim")
        if any(d <= 0 for d, _ in points):
            raise InvalidProfileError(f"{where}: every dimension must be > 0, got {[d for d, _ in points]}")
        if len(points) < 2 or len({d for d, _ in points}) < 2:
            raise InvalidProfileError(f"{where} needs points at two or more dimensions, got {len(points)} point(s)")
        return cls(
            points=tuple(points),
            alpha_s=_time(data["alpha_s"], f"{where}.alpha_s"),
            beta_s_per_dim3=_time(data["beta_s_per_dim3"], f"{where}.beta_s_per_dim3"),
            fit_error=_time(data["fit_error"], f"{where}.fit_error"),
        )


@dataclass(frozen=True, kw_only=True)
class KFACLayerTiming:
    """One K-FAC layer: its factor dimensions and the measured cost of its factor and preconditioning work.

    a_compute_s, g_compute_s and fold_s pack and unpack factors as upper triangles; the `_whole_s` ones as
    whole d x d matrices (None in profiles made before those were measured: the triangle times stand in)."""

    name: str
    a_dim: int
    g_dim: int
    a_compute_s: float
    g_compute_s: float
    fold_s: float
    precondition_eigen_s: float
    precondition_inverse_s: float
    a_compute_whole_s: float | None = None
    g_compute_whole_s: float | None = None
    fold_whole_s: float | None = None

    def precondition_s(self, method: InverseMethod) -> float:
        return self.precondition_eigen_s if method is InverseMethod.EIGEN else self.precondition_inverse_s

    def a_compute(self, whole: bool) -> float:
        """Seconds to compute and pack A, as a triangle or (`whole`) the whole matrix."""
        return self.a_compute_whole_s if whole and self.a_compute_whole_s is not None else self.a_compute_s

    def g_compute(self, whole: bool) -> float:
        return self.g_compute_whole_s if whole and self.g_compute_whole_s is not None else self.g_compute_s

    def fold(self, whole: bool) -> float:
        """Seconds to unpack both averaged factors and fold them into their running averages."""
        return self.fold_whole_s if whole and self.fold_whole_s is not None else self.fold_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "a_dim": self.a_dim,
            "g_dim": self.g_dim,
            "a_compute_s": self.a_compute_s,
            "g_compute_s": self.g_compute_s,
            "fold_s": self.fold_s,
            "precondition_eigen_s": self.precondition_eigen_s,
            "precondition_inverse_s": self.precondition_inverse_s,
            "a_compute_whole_s": self.a_compute_whole_s,
            "g_compute_whole_s": self.g_compute_whole_s,
            "fold_whole_s": self.fold_whole_s,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str) -> KFACLayerTiming:
        expect(data, dict, where)
        whole = ["a_compute_whole_s", "g_compute_whole_s", "fold_whole_s"]
        check_fields(
            data, where, ["name", "a_dim", "g_dim", "a_compute_s", "g_compute_s", "fold_s", "precondition_eigen_s",
                         "precondition_inverse_s"], whole
        )
        a_dim = expect(data["a_dim"], int, f"{where}.a_dim")
        g_dim = expect(data["g_dim"], int, f"{where}.g_dim")
        if min(a_dim, g_dim) <= 0:
            raise InvalidProfileError(f"{where}: factor dimensions must be > 0, got (a_dim={a_dim}, g_dim={g_dim})")
        return cls(
            name=expect(data["name"], str, f"{where}.name"),
            a_dim=a_dim,
            g_dim=g_dim,
            a_compute_s=_time(data["a_compute_s"], f"{where}.a_compute_s"),
            g_compute_s=_time(data["g_compute_s"], f"{where}.g_compute_s"),
            fold_s=_time(data["fold_s"], f"{where}.fold_s"),
            precondition_eigen_s=_time(data["precondition_eigen_s"], f"{where}.precondition_eigen_s"),
            precondition_inverse_s=_time(data["precondition_inverse_s"], f"{where}.precondition_inverse_s"),
            **{k: None if data.get(k) is None else _time(data[k], f"{where}.{k}") for k in whole},
        )


@dataclass(frozen=True, kw_only=True)
class KFACTiming:
    """What K-FAC costs on this device: per-layer factor work, and inversion / eigendecomposition against d."""

    layers: tuple[KFACLayerTiming, ...]
    inverse: DimCurve
    eigen: DimCurve
    #: (name, reason) of the modules with trainable parameters K-FAC leaves to plain SGD
    #: (`planner.contracts.kfac_section.kfac_left_out`); None in profiles made before they were listed (not recorded).
    left_out: tuple[tuple[str, str], ...] | None = ()
    #: The --kfac-skip pattern the layers were measured with (None: none).
    skip: str | None = None

    def __post_init__(self) -> None:
        if not self.layers:
            raise InvalidProfileError("profile.kfac.layers is empty: the model has no Linear or Conv2d layers")

    def to_dict(self) -> dict[str, Any]:
        return {
            "layers": [lt.to_dict() for lt in self.layers],
            "inverse": self.inverse.to_dict(),
            "eigen": self.eigen.to_dict(),
            "left_out": None if self.left_out is None else [list(pair) for pair in self.left_out],
            "skip": self.skip,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str) -> KFACTiming:
        expect(data, dict, where)
        check_fields(data, where, ["layers", "inverse", "eigen"], ["left_out", "skip"])
        layers = expect(data["layers"], list, f"{where}.layers")
        skip = data.get("skip")
        return cls(
            layers=tuple(KFACLayerTiming.from_dict(x, f"{where}.layers[{i}]") for i, x in enumerate(layers)),
            inverse=DimCurve.from_dict(data["inverse"], f"{where}.inverse"),
            eigen=DimCurve.from_dict(data["eigen"], f"{where}.eigen"),
            left_out=left_out_from_json(data.get("left_out"), f"{where}.left_out"),
            skip=None if skip is None else expect(skip, str, f"{where}.skip"),
        )


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """One in-situ calibration: the runtime's measured extra time against the micro-benchmarks' prediction.

    `measured_s` is the median of `samples_s` where they are kept: paired differences (a step with the work less
    the step beside it without, every rank's), or the work's own durations (decoding, K-FAC's step parts). It may
    be below zero: the difference of two noisy step times. Whether the cost model uses it, and the factor that
    follows, is `use` (`planner.spread.calibration_use`): measured / modelled where it is told apart from
    no effect and plausible, else 1 (the micro-benchmark). `attempts`: how many times it was measured (a first
    measurement that was not usable is measured once more, and the last one kept).
    """

    measured_s: float
    modelled_s: float
    samples_s: tuple[float, ...] | None = None
    attempts: int = 1

    @classmethod
    def of_samples(cls, samples: Sequence[float], modelled_s: float, attempts: int = 1) -> Calibration:
        """The calibration of `samples` (seconds: paired differences or the work's durations): their median
        against `modelled_s`, the samples kept."""
        kept = tuple(float(x) for x in samples)
        return cls(measured_s=float(np.median(kept)), modelled_s=modelled_s, samples_s=kept, attempts=attempts)

    @functools.cached_property
    def use(self) -> CalibrationUse:
        """Whether the measurement is used, the factor applied and the interval of measured / modelled."""
        return calibration_use(self.measured_s, self.modelled_s, self.samples_s)

    @property
    def factor(self) -> float:
        """What the micro-benchmarked cost is multiplied by (1 where the measurement is not used)."""
        return self.use.factor

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"factor": self.factor, "measured_s": self.measured_s, "modelled_s": self.modelled_s}
        if self.samples_s is not None:
            out["samples_s"] = list(self.samples_s)
        if self.attempts != 1:
            out["attempts"] = self.attempts
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str) -> Calibration:
        expect(data, dict, where)
        check_fields(data, where, ["measured_s", "modelled_s"], optional=["factor", "samples_s", "attempts"])
        measured = float(expect(data["measured_s"], (int, float), f"{where}.measured_s"))
        if not (math.isfinite(measured) and abs(measured) <= MAX_SECONDS):
            raise InvalidProfileError(f"{where}.measured_s must be a time (or a difference of times) within "
                                      f"+-{MAX_SECONDS:g} seconds, got {data['measured_s']!r}")
        samples = data.get("samples_s")
        return cls(measured_s=measured, modelled_s=_time(data["modelled_s"], f"{where}.modelled_s"),
                   samples_s=None if samples is None else _samples(samples, f"{where}.samples_s", signed=True),
                   attempts=expect_int(data.get("attempts", 1), f"{where}.attempts", 1, 100, InvalidProfileError))


@dataclass(frozen=True, kw_only=True)
class InSitu:
    """In-situ calibrations of the runtime's work on the compute stream: dense packing, top-k selection per
    selector, and top-k decoding (absent ones count as factor 1)."""

    pack: Calibration | None = None
    select: dict[str, Calibration] = field(default_factory=dict)
    decode: Calibration | None = None
    ddp_pack: Calibration | None = None
    #: Per compressor named as text ("fp16", "powersgd:4"): its work in the backward pass (prepare, with
    #: PowerSGD's middle round) and in synchronize (decode), against the micro-benchmarks; "ddp+powersgd:R":
    #: PyTorch's PowerSGD hook on DDP's one bucket, all its work against the same micro-benchmarks (prepare),
    #: and what sending adds to it on the real process group against the collective curve's prediction for its
    #: allreduces (send: their number, the callbacks between them and the wait for the other ranks included);
    #: "powersgd:R" also has the runtime's own sending, measured the same way on one group of every layer (send).
    compress: dict[str, dict[str, Calibration]] = field(default_factory=dict)
    #: The K-FAC runtime's factor hooks (A in forward, G in backward, each packed into its buffer) in real
    #: forward and backward passes, against the per-layer micro-benchmarks (`KFACLayerTiming` a/g_compute_s).
    kfac_factors: Calibration | None = None
    #: What K-FAC's step() does after the gradients, in real steps against the micro-benchmarks, by part:
    #: "fold" (`fold_s`), "invert:eigen" and "invert:inverse" (the inversion curves), "precondition:eigen" and
    #: "precondition:inverse" (`precondition_s`); `KFAC_STEP_PARTS`.
    kfac_steps: dict[str, Calibration] = field(default_factory=dict)

    def named(self) -> list[tuple[str, Calibration]]:
        """Every calibration with what it calibrates, in words ("packing", "fp16 decompression", ...)."""
        parts: list[tuple[str, Calibration | None]] = [
            ("packing", self.pack), *((f"{n} selection", c) for n, c in self.select.items()),
            ("decoding", self.decode), ("DDP's bucket copies", self.ddp_pack),
            *((f"PyTorch's {name.removeprefix('ddp+')} hook on DDP{'' if part == 'prepare' else ', sending'}"
               if name.startswith("ddp+") else
               f"{name} {_RUNTIME_PARTS[part]}", c)
              for name, calibrations in self.compress.items() for part, c in calibrations.items()),
            ("K-FAC factor hooks", self.kfac_factors),
            *((f"K-FAC {KFAC_STEP_NAMES.get(part, part)}", c) for part, c in self.kfac_steps.items())]
        return [(what, c) for what, c in parts if c is not None]

    def mapped(self, fn: Callable[[Calibration], Calibration]) -> InSitu:
        """The same calibrations, each replaced by `fn` of it (a resampled profile's)."""
        def one(c: Calibration | None) -> Calibration | None:
            return None if c is None else fn(c)

        return replace(self, pack=one(self.pack), select={n: fn(c) for n, c in self.select.items()},
                       decode=one(self.decode), ddp_pack=one(self.ddp_pack),
                       compress={n: {part: fn(c) for part, c in parts.items()} for n, parts in self.compress.items()},
                       kfac_factors=one(self.kfac_factors),
                       kfac_steps={part: fn(c) for part, c in self.kfac_steps.items()})

    def kfac_step_factor(self, part: str) -> float:
        """The calibration of one part of K-FAC's step (`KFAC_STEP_PARTS`; 1 when not calibrated)."""
        found = self.kfac_steps.get(part)
        return 1.0 if found is None else found.factor

    def pack_factor(self, runtime: str = "planner") -> float:
        found = self.ddp_pack if runtime == "ddp" else self.pack
        return 1.0 if found is None else found.factor

    def select_factor(self, selector: str) -> float:
        found = self.select.get(selector)
        return 1.0 if found is None else found.factor

    def decode_factor(self) -> float:
        return 1.0 if self.decode is None else self.decode.factor

    def kfac_factor(self) -> float:
        """The calibration of K-FAC's factor computation (1 when not calibrated)."""
        return 1.0 if self.kfac_factors is None else self.kfac_factors.factor

    def compress_factor(self, compressor: str, part: str) -> float:
        """The calibration of `compressor`'s "prepare" or "decode" work (1 when not calibrated)."""
        found = self.compress.get(compressor, {}).get(part)
        return 1.0 if found is None else found.factor

    def to_dict(self) -> dict[str, Any]:
        return {
            "pack": None if self.pack is None else self.pack.to_dict(),
            "select": {name: c.to_dict() for name, c in self.select.items()},
            "decode": None if self.decode is None else self.decode.to_dict(),
            "ddp_pack": None if self.ddp_pack is None else self.ddp_pack.to_dict(),
            "compress": {name: {part: c.to_dict() for part, c in parts.items()}
                         for name, parts in self.compress.items()},
            "kfac_factors": None if self.kfac_factors is None else self.kfac_factors.to_dict(),
            "kfac_steps": {part: c.to_dict() for part, c in self.kfac_steps.items()},
        }

    @classmethod
    def from_dict(cls, data: Any, where: str) -> InSitu:
        expect(data, dict, where)
        data = {"ddp_pack": None, "compress": {}, "kfac_factors": None, "kfac_steps": {}, **data}
        check_fields(data, where, ["pack", "select", "decode", "ddp_pack", "compress", "kfac_factors", "kfac_steps"])
        steps = expect(data["kfac_steps"], dict, f"{where}.kfac_steps")
        check_fields(steps, f"{where}.kfac_steps", [], optional=list(KFAC_STEP_PARTS))
        compress: dict[str, dict[str, Calibration]] = {}
        for name, parts in expect(data["compress"], dict, f"{where}.compress").items():
            hook = isinstance(name, str) and name.startswith("ddp+")  # PyTorch's hook on DDP, not the runtime
            key = ("ddp+" if hook else "") + str(parse_compressor(name.removeprefix("ddp+") if hook else name,
                                                                  f"a compressor in {where}.compress"))
            expect(parts, dict, f"{where}.compress.{name}")
            # send: PowerSGD's sending on the real process group, by the hook or by the runtime
            sends = hook or key.startswith("powersgd:")
            parts_known = ["prepare", "decode", *(["send"] if sends else [])]
            check_fields(parts, f"{where}.compress.{name}", [], optional=parts_known)
            compress[key] = {part: Calibration.from_dict(c, f"{where}.compress.{name}.{part}")
                             for part, c in parts.items()}
        select = {}
        for name, c in expect(data["select"], dict, f"{where}.select").items():
            select[check_selector(name, f"a selector in {where}.select")] = Calibration.from_dict(
                c, f"{where}.select.{name}")
        return cls(
            pack=None if data["pack"] is None else Calibration.from_dict(data["pack"], f"{where}.pack"),
            select=select,
            decode=None if data["decode"] is None else Calibration.from_dict(data["decode"], f"{where}.decode"),
            ddp_pack=None if data["ddp_pack"] is None else Calibration.from_dict(data["ddp_pack"], f"{where}.ddp_pack"),
            compress=compress,
            kfac_factors=None if data["kfac_factors"] is None else Calibration.from_dict(
                data["kfac_factors"], f"{where}.kfac_factors"),
            kfac_steps={part: Calibration.from_dict(c, f"{where}.kfac_steps.{part}") for part, c in steps.items()},
        )


@dataclass(frozen=True, kw_only=True)
class TopkLeftOut:
    """Why a profile has no top-k timings although it could have measured them: it was made for plans that cannot
    send top-k (`planner demo`: the compressors it solves over, within its error budget). `compressors`: the top-k
    compressors among those, none of which any plan within `budget`'s error on every layer could send a layer by
    (`planner.strategies.budget.within_reach`; empty: no top-k among them). A solve asking for top-k on this
    profile is told so, and to profile again."""

    compressors: tuple[Compressor, ...]
    budget: Compressor | None

    def __post_init__(self) -> None:
        if any(c.kind is not CompressorKind.TOPK for c in self.compressors):
            raise SchemaError(f"topk_left_out.compressors lists top-k compressors only, got "
                              f"{', '.join(map(str, self.compressors))}")
        if self.compressors and self.budget is None:
            raise SchemaError("topk_left_out names top-k compressors left out by a budget, but no budget")

    def why(self) -> str:
        """Why top-k was not timed, in words."""
        if not self.compressors:
            return "the profile left top-k out: the plans it was made for send none"
        return (f"the profile left top-k out: {', '.join(map(str, self.compressors))} cannot fit the error budget it "
                f"was made for ({self.budget}'s error on every layer), not even on one layer")

    def to_dict(self) -> dict[str, Any]:
        return {"compressors": [str(c) for c in self.compressors],
                "budget": None if self.budget is None else str(self.budget)}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> TopkLeftOut:
        expect(data, dict, where)
        check_fields(data, where, ["compressors", "budget"])
        names = expect(data["compressors"], list, f"{where}.compressors")[:64]
        compressors = tuple(parse_compressor(c, f"{where}.compressors[{i}]") for i, c in enumerate(names))
        budget = None if data["budget"] is None else parse_compressor(data["budget"], f"{where}.budget")
        return cls(compressors=compressors, budget=budget)


@dataclass(frozen=True, kw_only=True)
class HostTopk:
    """The hierarchical top-k exchange at one density (`planner.kernels.hierarchical.hierarchical_topk_sum`):
    how much the picks of one host's ranks overlap on the model's real gradients, and the exchange timed end
    to end with picks that overlap as much.

    `union_ratio` is the host's union of picks over k (1: every rank of a host picks the same entries; the
    ranks per host: disjoint picks): the largest host's, as the exchange pads to it, with the picks made under
    error feedback as the runtime makes them and averaged over rounds (`planner.profilers.comm.measure_union_ratios`;
    older profiles took the mean over hosts of the first gradients' picks, which came out lower). `exchange`
    is the whole exchange, merging, crossing and decoding included, against the bytes of one rank's message
    (k values and k indices)."""

    density: float
    union_ratio: float
    exchange: FittedCurve

    def to_dict(self) -> dict[str, Any]:
        return {"density": self.density, "union_ratio": self.union_ratio, "exchange": self.exchange.to_dict()}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> HostTopk:
        expect(data, dict, where)
        check_fields(data, where, ["density", "union_ratio", "exchange"])
        density = float(expect(data["density"], (int, float), f"{where}.density"))
        ratio = float(expect(data["union_ratio"], (int, float), f"{where}.union_ratio"))
        if not 0 < density <= 1:
            raise InvalidProfileError(f"{where}.density must be in (0, 1], got {data['density']!r}")
        if not (math.isfinite(ratio) and ratio >= 1):
            raise InvalidProfileError(f"{where}.union_ratio must be >= 1 (a host's union over k), got "
                                      f"{data['union_ratio']!r}")
        return cls(density=density, union_ratio=ratio, exchange=FittedCurve.from_dict(data["exchange"],
                                                                                       f"{where}.exchange"))


@dataclass(frozen=True, kw_only=True)
class HostTiming:
    """The hosts the workers ran on and the allreduce at each level: inside a host (`intra`, None with one worker
    per host), across hosts among one rank per host (`inter`), and hierarchical (`hierarchical`: inside, across,
    inside again, `planner.kernels.hierarchical`), each against the bytes per rank of the whole message; and the
    hierarchical top-k exchange at each measured density (`topk`, empty where not measured)."""

    ranks: tuple[tuple[int, ...], ...]
    inter: FittedCurve
    hierarchical: FittedCurve
    intra: FittedCurve | None = None
    topk: tuple[HostTopk, ...] = ()

    def __post_init__(self) -> None:
        sizes = {len(h) for h in self.ranks}
        if len(self.ranks) < 2 or len(sizes) != 1 or 0 in sizes:
            raise InvalidProfileError(f"profile.hosts.ranks must list two or more hosts of equal size, got "
                                      f"{[list(h) for h in self.ranks]}")
        flat = sorted(r for h in self.ranks for r in h)
        if flat != list(range(len(flat))):
            raise InvalidProfileError(f"profile.hosts.ranks must list every rank once, got "
                                      f"{[list(h) for h in self.ranks]}")
        densities = [t.density for t in self.topk]
        if len(set(densities)) != len(densities):
            raise InvalidProfileError(f"profile.hosts.topk lists a density twice: {densities}")
        if any(t.union_ratio > self.per_host * (1 + 1e-9) for t in self.topk):
            raise InvalidProfileError(f"profile.hosts.topk: a host's union of picks is at most {self.per_host} k "
                                      f"(its ranks' picks), got ratios {[t.union_ratio for t in self.topk]}")

    @property
    def per_host(self) -> int:
        return len(self.ranks[0])

    def topk_at(self, density: float) -> HostTopk | None:
        """The hierarchical top-k exchange measured at `density` (None: not measured there)."""
        return next((t for t in self.topk if math.isclose(t.density, density, rel_tol=1e-9)), None)

    def union_ratios(self, per_host: int) -> dict[float, float]:
        """The host's union of top-k picks over k at each measured density, where it holds for hosts of `per_host`
        ranks (it was measured on such hosts; empty otherwise). It depends on the model and its data, not on the
        network, so a re-measurement of the network times the exchange again at these overlaps."""
        return {t.density: t.union_ratio for t in self.topk} if per_host == self.per_host else {}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ranks": [list(h) for h in self.ranks],
                               "intra": None if self.intra is None else self.intra.to_dict(),
                               "inter": self.inter.to_dict(), "hierarchical": self.hierarchical.to_dict()}
        if self.topk:  # profiles without it stay as they were
            out["topk"] = [t.to_dict() for t in self.topk]
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str = "profile.hosts") -> HostTiming:
        expect(data, dict, where)
        check_fields(data, where, ["ranks", "inter", "hierarchical"], optional=["intra", "topk"])
        ranks = tuple(
            tuple(expect_int(r, f"{where}.ranks[{i}][]", 0, MAX_WORLD_SIZE - 1, InvalidProfileError)
                  for r in expect(host, list, f"{where}.ranks[{i}]"))
            for i, host in enumerate(expect(data["ranks"], list, f"{where}.ranks")[:MAX_WORLD_SIZE + 1])
        )
        intra = data.get("intra")
        topk = tuple(HostTopk.from_dict(t, f"{where}.topk[{i}]")
                     for i, t in enumerate(expect(data.get("topk", []), list, f"{where}.topk")[:64]))
        if len(data.get("topk", [])) > 64:
            raise InvalidProfileError(f"{where}.topk lists {len(data['topk'])} densities; at most 64 are read")
        return cls(ranks=ranks, inter=FittedCurve.from_dict(data["inter"], f"{where}.inter"),
                   hierarchical=FittedCurve.from_dict(data["hierarchical"], f"{where}.hierarchical"),
                   intra=None if intra is None else FittedCurve.from_dict(intra, f"{where}.intra"), topk=topk)


@dataclass(frozen=True, kw_only=True)
class WorkerThroughput:
    """Each worker's own speed: seconds of one local step (forward, backward, no communication) at a few
    micro-batch sizes, per rank. Workers differ on heterogeneous clusters (or under `--slowdown`)."""

    batch_sizes: tuple[int, ...]
    step_s: tuple[tuple[float, ...], ...]  # [rank][size]

    def __post_init__(self) -> None:
        if not self.batch_sizes or list(self.batch_sizes) != sorted(set(self.batch_sizes)):
            raise InvalidProfileError(f"profile.throughput.batch_sizes must be increasing and not empty, "
                                      f"got {list(self.batch_sizes)}")
        if not self.step_s or any(len(row) != len(self.batch_sizes) for row in self.step_s):
            raise InvalidProfileError("profile.throughput.step_s must hold one time per batch size for every rank")
        if any(not t > 0 for row in self.step_s for t in row):
            raise InvalidProfileError("profile.throughput.step_s must hold times > 0")

    def samples_per_s(self, rank: int) -> tuple[float, ...]:
        """Rank `rank`'s samples per second at each batch size."""
        return tuple(b / t for b, t in zip(self.batch_sizes, self.step_s[rank], strict=True))

    @property
    def spread(self) -> float:
        """Fastest over slowest worker's samples per second at the largest batch size (1: all alike)."""
        rates = [self.samples_per_s(r)[-1] for r in range(len(self.step_s))]
        return max(rates) / min(rates)

    def to_dict(self) -> dict[str, Any]:
        return {"batch_sizes": list(self.batch_sizes), "step_s": [list(row) for row in self.step_s]}

    @classmethod
    def from_dict(cls, data: Any, where: str = "profile.throughput") -> WorkerThroughput:
        expect(data, dict, where)
        check_fields(data, where, ["batch_sizes", "step_s"])
        sizes = tuple(expect_int(b, f"{where}.batch_sizes[{i}]", 1, MAX_BATCH_SIZE, InvalidProfileError)
                      for i, b in enumerate(expect(data["batch_sizes"], list, f"{where}.batch_sizes")))
        rows = tuple(
            tuple(_time(t, f"{where}.step_s[{r}][{i}]")
                  for i, t in enumerate(expect(row, list, f"{where}.step_s[{r}]")))
            for r, row in enumerate(expect(data["step_s"], list, f"{where}.step_s"))
        )
        return cls(batch_sizes=sizes, step_s=rows)


def _collective(name: str, where: str) -> Collective:
    """The collective a key of `where` names."""
    try:
        return Collective(name)
    except ValueError:
        raise SchemaError(f"unknown collective {name!r} in {where}; known: {[c.value for c in Collective]}") from None


def _peak_memory(data: Any, where: str) -> dict[str, int]:
    """{"phase": bytes, ...} as checked values: names, and whole numbers of bytes >= 0."""
    out = {}
    for name, value in expect(data, dict, where).items():
        out[name] = expect_int(value, f"{where}.{name}", 0, 1 << 60, SchemaError)
    return out


#: The largest sigma or kappa a profile may hold: 101 times slower is no measurement of interference, and a time
#: multiplied by more overflows the baselines' arithmetic (the Horovod cycle counts its cycles).
MAX_SLOWDOWN = 100.0

_SLOWDOWNS = {"profile.interference": "how much slower compute runs while one is in flight",
              "profile.comm_stretch": "how much slower a chain of them runs while the workers compute"}


def _slowdowns(data: Any, where: str) -> dict[Collective, float]:
    """{"allreduce": sigma, ...} (`profile.interference`; kappa, for `profile.comm_stretch`) as checked values: known
    collectives, numbers from 0 to MAX_SLOWDOWN."""
    out = {}
    for name, sigma in expect(data, dict, where).items():
        coll = _collective(name, where)
        value = float(expect(sigma, (int, float), f"{where}.{name}"))
        if not (math.isfinite(value) and 0 <= value <= MAX_SLOWDOWN):
            raise InvalidProfileError(f"`0 <= {where}.{name} <= {MAX_SLOWDOWN:g}` must hold "
                                      f"({_SLOWDOWNS[where]}: 1 + it times), but got {sigma!r}")
        out[coll] = value
    return out


@dataclass(frozen=True, kw_only=True)
class StepSamples:
    """The steps the layer phase timed, one entry per measured step: the whole local step (the slowest rank's, from a
    barrier), and the slowest worker's forward, update and each layer's backward time b_i (in the profile's layer
    order) in the hooked step beside it. The profile's F, b_i and U are their medians, all scaled by one factor so
    that they sum to the median whole step (`scaled_parts`); a resampled profile draws steps from these."""

    whole_s: tuple[float, ...]
    forward_s: tuple[float, ...]
    update_s: tuple[float, ...]
    backward_s: tuple[tuple[float, ...], ...]  # [step][layer]

    def __post_init__(self) -> None:
        counts = {len(self.whole_s), len(self.forward_s), len(self.update_s), len(self.backward_s)}
        if len(counts) != 1 or 0 in counts:
            raise InvalidProfileError(f"profile.steps must list the same number of steps (one at least) in whole_s, "
                                      f"forward_s, update_s and backward_s, got {sorted(counts)}")
        if len({len(row) for row in self.backward_s}) != 1:
            raise InvalidProfileError("profile.steps.backward_s must list every layer at every step")
        # Any draw of steps scales its parts by median whole / summed medians: bounded by these extremes, so that
        # no resampled profile multiplies a time by more than MAX_SLOWDOWN (or divides by a sum of zero).
        rows = np.asarray(self.backward_s, dtype=float)
        least = min(self.forward_s) + float(rows.min(axis=0).sum()) + min(self.update_s)
        most = max(self.forward_s) + float(rows.max(axis=0).sum()) + max(self.update_s)
        if not (least > 0 and max(self.whole_s) / least <= MAX_SLOWDOWN
                and min(self.whole_s) / most >= 1 / MAX_SLOWDOWN):
            raise InvalidProfileError(
                f"profile.steps: the whole steps ({min(self.whole_s):g} to {max(self.whole_s):g} s) and the sums of "
                f"their parts ({least:g} to {most:g} s) must agree within {MAX_SLOWDOWN:g}x (the parts are scaled "
                "by their ratio); profile it again with `planner profile`")

    @property
    def count(self) -> int:
        return len(self.whole_s)

    def scaled_parts(self, picks: Sequence[int] | np.ndarray | None = None,
                     ) -> tuple[float, float, tuple[float, ...], float]:
        """(F, U, (b_i), whole step) over the steps `picks` (default all; repeats allowed: a bootstrap draw): the
        medians, with F, U and b_i scaled by one factor so that F + sum(b_i) + U is the median whole step."""
        rows = np.asarray(self.backward_s, dtype=float)
        idx = np.arange(self.count) if picks is None else np.asarray(picks, dtype=np.int64)
        fwd = float(np.median(np.asarray(self.forward_s)[idx]))
        upd = float(np.median(np.asarray(self.update_s)[idx]))
        backward = np.median(rows[idx], axis=0)
        whole = float(np.median(np.asarray(self.whole_s)[idx]))
        summed = fwd + float(backward.sum()) + upd
        k = whole / summed if summed > 0 else 1.0
        return k * fwd, k * upd, tuple(float(k * b) for b in backward), whole

    def to_dict(self) -> dict[str, Any]:
        return {"whole_s": list(self.whole_s), "forward_s": list(self.forward_s), "update_s": list(self.update_s),
                "backward_s": [list(row) for row in self.backward_s]}

    @classmethod
    def from_dict(cls, data: Any, where: str = "profile.steps") -> StepSamples:
        expect(data, dict, where)
        check_fields(data, where, ["whole_s", "forward_s", "update_s", "backward_s"])
        rows = expect(data["backward_s"], list, f"{where}.backward_s")
        if len(rows) > MAX_SAMPLES:
            raise InvalidProfileError(f"{where}.backward_s lists {len(rows)} steps; at most {MAX_SAMPLES} are read")
        return cls(whole_s=_samples(data["whole_s"], f"{where}.whole_s"),
                   forward_s=_samples(data["forward_s"], f"{where}.forward_s"),
                   update_s=_samples(data["update_s"], f"{where}.update_s"),
                   backward_s=tuple(_samples(row, f"{where}.backward_s[{i}]") for i, row in enumerate(rows)))


@dataclass(frozen=True, kw_only=True)
class SlowdownSamples:
    """The passes and chains sigma and kappa of one collective are taken from, every rank's, in pairs measured one
    after the other: backward passes alone and with a chain of the collective in flight (sigma = median busy /
    median alone - 1), and a chain's seconds per collective alone and while every worker computes (kappa)."""

    alone_s: tuple[float, ...]
    busy_s: tuple[float, ...]
    pace_alone_s: tuple[float, ...]
    pace_busy_s: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.alone_s) != len(self.busy_s) or len(self.pace_alone_s) != len(self.pace_busy_s):
            raise InvalidProfileError("slowdown samples come in pairs: as many busy as alone, for the passes and for "
                                      "the chains")

    def sigma(self, picks: Sequence[int] | np.ndarray | None = None) -> float:
        """sigma over the pairs `picks` (default all)."""
        return _slowdown(self.alone_s, self.busy_s, picks)

    def kappa(self, picks: Sequence[int] | np.ndarray | None = None) -> float:
        """kappa over the pairs `picks` (default all)."""
        return _slowdown(self.pace_alone_s, self.pace_busy_s, picks)

    def to_dict(self) -> dict[str, Any]:
        return {"alone_s": list(self.alone_s), "busy_s": list(self.busy_s), "pace_alone_s": list(self.pace_alone_s),
                "pace_busy_s": list(self.pace_busy_s)}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> SlowdownSamples:
        expect(data, dict, where)
        names = ["alone_s", "busy_s", "pace_alone_s", "pace_busy_s"]
        check_fields(data, where, names)
        return cls(**{name: _samples(data[name], f"{where}.{name}") for name in names})


def _slowdown(alone: Sequence[float], busy: Sequence[float], picks: Sequence[int] | np.ndarray | None) -> float:
    """median(busy) / median(alone) - 1 over the pairs `picks` (default all), at least 0; 0 when alone takes no
    time."""
    idx = np.arange(len(alone)) if picks is None else np.asarray(picks, dtype=np.int64)
    base = float(np.median(np.asarray(alone, dtype=float)[idx]))
    return max(0.0, float(np.median(np.asarray(busy, dtype=float)[idx])) / base - 1.0) if base > 0 else 0.0


def _slowdown_samples(data: Any, where: str) -> dict[Collective, SlowdownSamples]:
    return {_collective(name, where): SlowdownSamples.from_dict(value, f"{where}.{name}")
            for name, value in expect(data, dict, where).items()}


@dataclass(frozen=True, kw_only=True)
class _Optional:
    """How `Profile` reads, writes and checks one of its optional fields (the attribute is named as its JSON key).

    `load` reads the field's JSON value, checked, naming `where` in errors; `dump` writes the value. A profile without
    the field holds the dataclass field's default, and so does a null in the file where that default is None. The
    default is written as null, or left out with `omitted` (fields added later, so that the files of profiles without
    them stay as they were). `check`, where given, checks a value other than None against the rest of the profile
    when one is made.
    """

    load: Callable[[Any, str], Any]
    dump: Callable[[Any], Any]
    check: Callable[[Profile, Any, str], None] | None = None
    omitted: bool = False


#: The key of a `Profile` field's metadata that holds its `_Optional`.
_OPTIONAL = "planner.profile.optional"


def _optional(load: Callable[[Any, str], Any], dump: Callable[[Any], Any] | None = None, *,
              check: Callable[[Profile, Any, str], None] | None = None, omitted: bool = False) -> dict[str, _Optional]:
    """The metadata of an optional field of `Profile`: how it is read, written (by default its `to_dict()`) and
    checked (`_Optional`)."""
    return {_OPTIONAL: _Optional(load=load, dump=_to_dict if dump is None else dump, check=check, omitted=omitted)}


def _to_dict(value: Any) -> Any:
    return value.to_dict()


def _as_is(value: Any) -> Any:
    return value


def _flag(value: Any, where: str) -> bool:
    return bool(expect(value, bool, where))


def _per_collective(values: dict[Collective, Any]) -> dict[str, Any]:
    """{collective: sigma or kappa} as JSON: the collectives by name."""
    return {c.value: v for c, v in values.items()}


def _samples_per_collective(values: dict[Collective, SlowdownSamples]) -> dict[str, Any]:
    return {c.value: samples.to_dict() for c, samples in values.items()}


def _check_parts_scale(profile: Profile, scale: float, where: str) -> None:
    if not (math.isfinite(scale) and 1 / MAX_SLOWDOWN <= scale <= MAX_SLOWDOWN):
        raise InvalidProfileError(
            f"`{1 / MAX_SLOWDOWN:g} <= {where} <= {MAX_SLOWDOWN:g}` must hold (the factor the layers' times were "
            f"scaled by to sum to a whole step), but got {scale!r}")


def _check_slowdowns(profile: Profile, values: dict[Collective, float], where: str) -> None:
    """sigma or kappa of each collective within 0 to MAX_SLOWDOWN."""
    for coll, value in values.items():
        if not (math.isfinite(value) and 0 <= value <= MAX_SLOWDOWN):
            raise InvalidProfileError(f"`0 <= {where}.{coll.value} <= {MAX_SLOWDOWN:g}` must hold, but got {value!r}")


def _check_throughput(profile: Profile, throughput: WorkerThroughput, where: str) -> None:
    if len(throughput.step_s) != profile.cluster.world_size:
        raise InvalidProfileError(f"{where} has {len(throughput.step_s)} workers but the world size is "
                                  f"{profile.cluster.world_size}")


def _check_hosts(profile: Profile, hosts: HostTiming, where: str) -> None:
    cluster = profile.cluster
    if len(hosts.ranks) != cluster.host_count or len(hosts.ranks) * hosts.per_host != cluster.world_size:
        raise InvalidProfileError(
            f"{where} lists {len(hosts.ranks)} hosts of {hosts.per_host} ranks, but the cluster is "
            f"{cluster.host_count} hosts and {cluster.world_size} workers")


def _check_unused(profile: Profile, unused: UnusedParams, where: str) -> None:
    unused.check_names({p for lt in profile.layers for p in lt.params}, "profile")


def _check_errors(profile: Profile, errors: CompressionErrors, where: str) -> None:
    if errors.layers != tuple(lt.name for lt in profile.layers):
        raise InvalidProfileError(f"{where}.layers must be the profile's layers in its order; profile it again with "
                                  "`planner profile`")


def _check_topk_left_out(profile: Profile, left_out: TopkLeftOut, where: str) -> None:
    if profile.topk is not None:
        raise InvalidProfileError(f"{where} says top-k was left out, but profile.topk holds its timings")


def _check_steps(profile: Profile, steps: StepSamples, where: str) -> None:
    """The steps time the profile's layers, and F, U and the layers' backward times are their scaled medians (a
    resample multiplies them by a draw's over these): within MAX_SLOWDOWN of them, or a draw would scale a time
    beyond any measurement."""
    if len(steps.backward_s[0]) != len(profile.layers):
        raise InvalidProfileError(f"{where}.backward_s lists {len(steps.backward_s[0])} layers per step, but the "
                                  f"profile has {len(profile.layers)}")
    fwd, upd, backward, _ = steps.scaled_parts()
    for name, nominal, sampled in (("forward_s", profile.forward_s, fwd), ("update_s", profile.update_s, upd),
                                   ("layers' backward_s", sum(lt.backward_s for lt in profile.layers),
                                    sum(backward))):
        if nominal > 0 and not 1 / MAX_SLOWDOWN <= sampled / nominal <= MAX_SLOWDOWN:
            raise InvalidProfileError(
                f"profile.{name} ({nominal:g} s) is not the median of {where} ({sampled:g} s, scaled) within "
                f"{MAX_SLOWDOWN:g}x; profile it again with `planner profile`")


#: The fields every profile file holds (the optional ones are `Profile`'s fields with an `_Optional`).
_REQUIRED = ("schema_version", "kind", "created", "torch_version", "model", "cluster", "batch_size", "element_bytes",
             "forward_s", "backward_s", "update_s", "layers", "collectives", "topk")


@dataclass(frozen=True, kw_only=True)
class Profile:
    """Everything the solvers need about one model on one cluster.

    Each optional field is declared once, below: its type, its default (what a profile without it holds) and, in
    `_optional`, how it is read from its JSON key (the field's name), written and checked. `from_dict`, `to_dict`
    and the checks at construction follow these declarations, in this order (the order of the file's keys)."""

    model: ModelInfo
    cluster: ClusterInfo
    created: str
    torch_version: str
    batch_size: int
    forward_s: float
    backward_s: float
    update_s: float
    layers: tuple[LayerTiming, ...]
    collectives: dict[Collective, FittedCurve]
    topk: TopkTiming | None
    kfac: KFACTiming | None = field(default=None, metadata=_optional(KFACTiming.from_dict))
    #: Median of whole local steps without hooks, timed between the hooked ones (None: not timed).
    step_s: float | None = field(default=None, metadata=_optional(_time, _as_is))
    #: The factor the per-layer times and F, B, U were scaled by so that their sum equals `step_s` (None: not
    #: scaled, as in profiles made before the whole steps were interleaved with the hooked ones).
    parts_scale: float | None = field(default=None, metadata=_optional(_time, _as_is, check=_check_parts_scale))
    pack: FittedCurve | None = field(default=None, metadata=_optional(FittedCurve.from_dict))
    #: sigma per collective: compute runs (1 + sigma) times slower while one is in flight (None: 0).
    interference: dict[Collective, float] | None = field(
        default=None, metadata=_optional(_slowdowns, _per_collective, check=_check_slowdowns))
    #: kappa per collective: a chain of them runs (1 + kappa) times slower while the workers compute (None: 0).
    comm_stretch: dict[Collective, float] | None = field(
        default=None, metadata=_optional(_slowdowns, _per_collective, check=_check_slowdowns))
    in_situ: InSitu | None = field(default=None, metadata=_optional(InSitu.from_dict))
    throughput: WorkerThroughput | None = field(
        default=None, metadata=_optional(WorkerThroughput.from_dict, check=_check_throughput))
    compress: CompressTiming | None = field(default=None, metadata=_optional(CompressTiming.from_dict))
    #: Peak resident memory of the busiest worker in each phase of `planner profile`, in bytes (None: not
    #: measured, e.g. on another OS or in profiles made before it was).
    peak_memory: dict[str, int] | None = field(default=None, metadata=_optional(_peak_memory, _as_is))
    #: The hosts and the allreduce at each level (None: one host, or hosts of unequal size).
    hosts: HostTiming | None = field(default=None, metadata=_optional(HostTiming.from_dict, check=_check_hosts))
    #: Measured by `planner profile --quick`: fewer repeats and sweeps, wider intervals.
    quick: bool = field(default=False, metadata=_optional(_flag, _as_is, omitted=True))
    #: The parameters that went without a gradient in some of the batches checked (None: not checked, as in
    #: profiles made before it was); see `planner.contracts.unused`.
    unused_params: UnusedParams | None = field(
        default=None, metadata=_optional(UnusedParams.from_dict, check=_check_unused, omitted=True))
    #: Each compressor's error on each layer over a few real steps (None: not measured, as in profiles made before
    #: it was); see `planner.contracts.errors`.
    errors: CompressionErrors | None = field(
        default=None, metadata=_optional(CompressionErrors.from_dict, check=_check_errors, omitted=True))
    #: The layer phase's steps, which F, the b_i, U and `step_s` are medians of (None: not kept, as in profiles
    #: made before they were).
    steps: StepSamples | None = field(default=None, metadata=_optional(StepSamples.from_dict, check=_check_steps))
    #: The passes and chains sigma and kappa were taken from, per collective (None: not kept).
    slowdown_samples: dict[Collective, SlowdownSamples] | None = field(
        default=None, metadata=_optional(_slowdown_samples, _samples_per_collective))
    #: Why `topk` is null where the profile could have timed it: the plans it was made for send no top-k (None: not
    #: left out; a null `topk` then means not measured, as with `--only comm`).
    topk_left_out: TopkLeftOut | None = field(default=None, metadata=_optional(
        TopkLeftOut.from_dict, check=_check_topk_left_out, omitted=True))
    element_bytes: int = 4
    schema_version: int = PROFILE_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if not self.layers:
            raise InvalidProfileError("the profile has no layers with gradients")
        self._check_layers_cover_model()
        for name, spec, _ in _optional_fields():
            value = getattr(self, name)
            if spec.check is not None and value is not None:
                spec.check(self, value, f"profile.{name}")

    def _check_layers_cover_model(self) -> None:
        """The layers hold every trainable parameter of the model the profile names, and no other: checked at load,
        before a solver spends its time on a profile no plan could be made from."""
        params = sum(len(lt.params) for lt in self.layers)
        numel = sum(lt.numel for lt in self.layers)
        if params != self.model.num_params or numel != self.model.numel:
            raise InvalidProfileError(
                f"profile.layers hold {params:,} parameter tensors of {numel:,} elements, but profile.model "
                f"{self.model.name} has {self.model.num_params:,} of {self.model.numel:,}: the profile does not "
                "describe its model; profile it again with `planner profile`")

    def interference_for(self, collective: Collective) -> float:
        """sigma of `collective`: how much slower compute runs while one is in flight (0 if not measured)."""
        return (self.interference or {}).get(collective, 0.0)

    def comm_stretch_for(self, collective: Collective) -> float:
        """kappa of `collective`: how much slower a chain of them runs while the workers compute (0 if not
        measured)."""
        return (self.comm_stretch or {}).get(collective, 0.0)

    # -- the solver's instance -----------------------------------------------------------------
    def curve(self, collective: Collective) -> FittedCurve:
        if collective not in self.collectives:
            raise InvalidProfileError(f"the profile has no {collective.value} measurements; run `planner profile`")
        return self.collectives[collective]

    def with_comm(self, other: Profile) -> Profile:
        """This profile with the network measurements of `other` (for `--only comm`)."""
        return replace(self, collectives=other.collectives, cluster=other.cluster, created=other.created,
                       hosts=other.hosts)

    # -- serialisation ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema_version": self.schema_version,
            "kind": PROFILE_KIND,
            "created": self.created,
            "torch_version": self.torch_version,
            "model": self.model.to_dict(),
            "cluster": self.cluster.to_dict(),
            "batch_size": self.batch_size,
            "element_bytes": self.element_bytes,
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
            "update_s": self.update_s,
            "layers": [lt.to_dict() for lt in self.layers],
            "collectives": {c.value: curve.to_dict() for c, curve in self.collectives.items()},
            "topk": None if self.topk is None else self.topk.to_dict(),
        }
        for name, spec, default in _optional_fields():
            value = getattr(self, name)
            if not (spec.omitted and value == default):
                out[name] = None if value is None else spec.dump(value)
        return out

    @property
    def parts_s(self) -> float:
        """The whole local step as the sum of its measured parts: F + sum of b_i + U."""
        return self.forward_s + sum(lt.backward_s for lt in self.layers) + self.update_s

    @property
    def parts_error(self) -> float | None:
        """|parts - whole| / whole against the whole steps timed as a cross-check (None if not timed); about 0
        when the parts were scaled to the whole (`parts_scale`), whose distance from 1 is then the check."""
        if not self.step_s:
            return None
        return abs(self.parts_s - self.step_s) / self.step_s

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        version = data.get("schema_version")
        if version != PROFILE_SCHEMA_VERSION:
            raise SchemaError(
                f"unknown profile schema_version {version!r}; this planner reads version "
                f"{PROFILE_SCHEMA_VERSION}: measure again with `planner profile`"
            )
        if data.get("kind") != PROFILE_KIND:
            raise SchemaError(f"not a profile: kind is {data.get('kind')!r}, expected {PROFILE_KIND!r}")
        check_fields(data, "profile", _REQUIRED, optional=[name for name, _, _ in _optional_fields()])
        collectives = {
            _collective(name, "profile.collectives"): FittedCurve.from_dict(curve, f"profile.collectives.{name}")
            for name, curve in expect(data["collectives"], dict, "profile.collectives").items()}
        layers = expect(data["layers"], list, "profile.layers")
        if not layers:
            raise InvalidProfileError("profile.layers is empty: the model has no trainable layers")
        timings = tuple(LayerTiming.from_dict(x, f"profile.layers[{i}]") for i, x in enumerate(layers))
        _check_distinct_layers(timings)
        return cls(
            schema_version=version,
            created=expect(data["created"], str, "profile.created"),
            torch_version=expect(data["torch_version"], str, "profile.torch_version"),
            model=ModelInfo.from_dict(data["model"], "profile.model"),
            cluster=ClusterInfo.from_dict(data["cluster"], "profile.cluster"),
            batch_size=expect_int(data["batch_size"], "profile.batch_size", 1, MAX_BATCH_SIZE, InvalidProfileError),
            element_bytes=_element_bytes(data["element_bytes"], "profile.element_bytes"),
            forward_s=_time(data["forward_s"], "profile.forward_s"),
            backward_s=_time(data["backward_s"], "profile.backward_s"),
            update_s=_time(data["update_s"], "profile.update_s"),
            layers=timings,
            collectives=collectives,
            topk=None if data["topk"] is None else TopkTiming.from_dict(data["topk"], "profile.topk"),
            # an optional field absent, or null where its default is None, is its default
            **{name: spec.load(data[name], f"profile.{name}") for name, spec, default in _optional_fields()
               if name in data and not (data[name] is None and default is None)},
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write atomically."""
        write_json_atomic(path, self.to_dict(), "profile")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        """Read and validate; errors name the file and the field."""
        data = read_json(path, "profile")
        try:
            return cls.from_dict(data)
        except SchemaError as exc:
            raise type(exc)(f"profile {path}: {exc}") from None


@functools.cache
def _optional_fields() -> tuple[tuple[str, _Optional, Any], ...]:
    """`Profile`'s optional fields in the order they are declared: (name, how it is read and written, default)."""
    return tuple((f.name, f.metadata[_OPTIONAL], f.default) for f in fields(Profile) if _OPTIONAL in f.metadata)
