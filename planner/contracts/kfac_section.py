"""K-FAC contracts: which layers K-FAC preconditions, and the plan's `kfac` section.

Every Linear and Conv2d layer (ungrouped) has two Kronecker factors: A, of dimension
inputs * kernel (+1 with a bias), built from the layer's inputs in forward, and G, of dimension
outputs, built from the gradient of its output in backward. Factors are named "<layer>.A" and
"<layer>.G".

The `kfac` section of a plan (schema in planner/contracts/plan.py):

    "kfac": {
      "method": "eigen" | "inverse",
      "factor_update_steps": 10, "inv_update_steps": 100,      # inv a multiple of factor
      "layers": [{"name": "conv1", "a_dim": 28, "g_dim": 16}, ...],   # forward order
      "a_buffers": [["conv1", "conv2"], ["fc"]],              # A allreduces, forward order
      "g_buffers": [["fc"], ["conv2", "conv1"]],              # G allreduces, backward order
      "owners": {"conv1.A": 0, "conv1.G": "all", ...},         # rank that inverts and broadcasts, or all
      "preconditioners": {"conv1": "all", "fc": 1, ...},       # optional, absent: all; a rank owns both factors
      "factor_messages": "upper-triangle" | "whole" | {"whole": ["conv1.A", ...]},   # optional, absent:
                                                              # upper-triangle; an object: those factors whole
      "solvers": {"fusion": "fusion-dp", "placement": "cp-sat", "seconds": 0.2, "gap": 0.0},
      "predicted": {"plan": {...}, "baselines": {"kfac-pytorch": {...}, ...}, "lower_bound_s": ...}
    }
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from planner.contracts.jsonio import check_fields, expect, expect_gain, expect_interval, expect_time
from planner.types import ROOT_NAME, FactorKind, InverseMethod, PlanMismatchError, SchemaError

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "ALL_WORKERS",
    "KFACLayerSpec",
    "KFACPrediction",
    "KFACSection",
    "factor_name",
    "kfac_layers",
]

#: The owner of a factor that every worker inverts for itself (no broadcast).
ALL_WORKERS = "all"


#: The two ways factors travel in JSON ("factor_messages").
_TRIANGLE, _WHOLE = "upper-triangle", "whole"


def factor_name(layer: str, kind: FactorKind) -> str:
    return f"{layer}.{kind.value}"


@dataclass(frozen=True, kw_only=True)
class KFACLayerSpec:
    """A layer K-FAC preconditions and the dimensions of its two factors."""

    name: str
    a_dim: int
    g_dim: int

    def dim(self, kind: FactorKind) -> int:
        return self.a_dim if kind is FactorKind.A else self.g_dim

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "a_dim": self.a_dim, "g_dim": self.g_dim}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> KFACLayerSpec:
        expect(data, dict, where)
        check_fields(data, where, ["name", "a_dim", "g_dim"])
        a_dim = expect(data["a_dim"], int, f"{where}.a_dim")
        g_dim = expect(data["g_dim"], int, f"{where}.g_dim")
        if a_dim <= 0 or g_dim <= 0:
            raise SchemaError(f"{where}: `a_dim > 0 and g_dim > 0` must hold, but got (a_dim={a_dim}, g_dim={g_dim})")
        return cls(name=expect(data["name"], str, f"{where}.name"), a_dim=a_dim, g_dim=g_dim)


def kfac_layers(module: nn.Module, skip: str | None = None) -> list[KFACLayerSpec]:
    """Linear and Conv2d layers (subclasses included) with a trainable weight, in registration (forward) order.

    Left out, keeping their plain gradients (`kfac_left_out` lists them with the reason): grouped and
    depthwise convolutions (their factors are not Kronecker-structured per layer), the projections inside
    `nn.MultiheadAttention` (it uses their weights in a functional call, so no hook sees their inputs), every
    layer whose qualified name matches the regular expression `skip`, and every layer whose weight another
    module shares (tied weights: the gradient sums every use, one layer's factors describe one).
    """
    return [spec for _, spec, _ in _kfac_classes(module, skip) if spec is not None]


def kfac_left_out(module: nn.Module, skip: str | None = None) -> list[tuple[str, str]]:
    """(name, reason) of every module with trainable parameters of its own that K-FAC leaves to plain SGD."""
    return [(name, reason) for name, spec, reason in _kfac_classes(module, skip) if spec is None]


def _kfac_classes(module: nn.Module, skip: str | None) -> list[tuple[str, KFACLayerSpec | None, str]]:
    """Every module owning a trainable parameter, in registration order: its K-FAC layer, or None and why not."""
    from torch import nn  # deferred: reading a plan or a profile loads no torch

    pattern = re.compile(skip) if skip else None
    holders: dict[int, int] = {}
    attention: set[int] = set()
    for mod in module.modules():
        for p in mod.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
        if isinstance(mod, nn.MultiheadAttention):
            attention.update(id(child) for child in mod.children())
    out: list[tuple[str, KFACLayerSpec | None, str]] = []
    for name, mod in module.named_modules():
        name = name or ROOT_NAME
        if not any(p.requires_grad for p in mod.parameters(recurse=False)):
            continue
        weight = getattr(mod, "weight", None)
        bias = 1 if getattr(mod, "bias", None) is not None else 0
        kind = type(mod).__name__
        if isinstance(mod, nn.MultiheadAttention) or id(mod) in attention:
            out.append((name, None, "nn.MultiheadAttention uses its projection weights in a functional call, so "
                                    "no hook sees their inputs: write the projections as nn.Linear modules to "
                                    "precondition them"))
        elif not isinstance(mod, (nn.Linear, nn.Conv2d)):
            out.append((name, None, f"{kind}: K-FAC here preconditions Linear and Conv2d layers only"))
        elif isinstance(mod, nn.Conv2d) and mod.groups != 1:
            out.append((name, None, f"a grouped convolution (groups={mod.groups}): its factors are not one "
                                    "Kronecker product per layer"))
        elif pattern is not None and pattern.search(name):
            out.append((name, None, f"matches the skip pattern {skip!r}"))
        elif not isinstance(weight, nn.Parameter) or not weight.requires_grad:
            out.append((name, None, "its weight is frozen"))
        elif holders[id(weight)] > 1:
            out.append((name, None, "its weight is shared with another module (tied): one layer's factors do "
                                    "not describe the summed gradient"))
        elif isinstance(mod, nn.Linear):
            out.append((name, KFACLayerSpec(name=name, a_dim=mod.in_features + bias, g_dim=mod.out_features), ""))
        else:
            kh, kw = mod.kernel_size
            out.append((name, KFACLayerSpec(name=name, a_dim=mod.in_channels * kh * kw + bias,
                                            g_dim=mod.out_channels), ""))
    return out


@dataclass(frozen=True, kw_only=True)
class KFACPrediction:
    """Predicted times of one K-FAC configuration (seconds).

    step_s is the average over the update intervals: every step pays plain_step_s, one step in
    factor_update_steps pays factor_step_s instead, one in inv_update_steps also pays inversion_s.
    precondition_s is the preconditioning phase every step pays (within plain_step_s); None in plans made
    before it was placed. factor_compute_s is the A and G factors' computation on a factor-update step (within
    factor_step_s), what `planner bench` sets beside the runtime's `factor_seconds`; interference_s how much
    longer forward and backward run on a factor-update step because collectives were in flight (within
    factor_step_s). Both None in older plans.
    """

    step_s: float
    plain_step_s: float
    factor_step_s: float
    inversion_s: float
    factor_comm_s: float
    broadcast_s: float
    num_buffers: int
    precondition_s: float | None = None
    factor_compute_s: float | None = None
    interference_s: float | None = None

    @classmethod
    def from_dict(cls, data: Any, where: str) -> KFACPrediction:
        expect(data, dict, where)
        fields = ["step_s", "plain_step_s", "factor_step_s", "inversion_s", "factor_comm_s", "broadcast_s"]
        check_fields(data, where, [*fields, "num_buffers"], ["precondition_s", "factor_compute_s", "interference_s"])
        times = {f: expect_time(data[f], f"{where}.{f}") for f in fields}
        if times["step_s"] <= 0:  # `show` divides by it (each layout against kfac-pytorch)
            raise SchemaError(f"{where}.step_s must be a time above 0 (a step takes time), got {data['step_s']!r}")

        def optional(name: str) -> float | None:
            return None if data.get(name) is None else expect_time(data[name], f"{where}.{name}")

        return cls(**times, num_buffers=expect(data["num_buffers"], int, f"{where}.num_buffers"),
                   precondition_s=optional("precondition_s"), factor_compute_s=optional("factor_compute_s"),
                   interference_s=optional("interference_s"))


def left_out_from_json(value: Any, where: str) -> tuple[tuple[str, str], ...] | None:
    """[[layer name, reason], ...] as checked pairs; None (absent or null: files made before the layers left
    out were listed) stays None, "not recorded", which is not "none"."""
    if value is None:
        return None
    out = []
    for i, pair in enumerate(expect(value, list, where)):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise SchemaError(f"{where}[{i}] must be [layer name, reason], got {pair!r}")
        out.append((pair[0], pair[1]))
    return tuple(out)


def _owner_from_json(value: Any, where: str) -> int | None:
    if value == ALL_WORKERS:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise SchemaError(f"{where} must be a rank >= 0 or {ALL_WORKERS!r}, got {value!r}")
    return value


def _name_lists(data: Any, where: str) -> tuple[tuple[str, ...], ...]:
    out = []
    for i, buf in enumerate(expect(data, list, where)):
        names = tuple(expect(x, str, f"{where}[{i}][]") for x in expect(buf, list, f"{where}[{i}]"))
        if not names:
            raise SchemaError(f"{where}[{i}] is empty: every buffer holds at least one layer's factor")
        out.append(names)
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class LayoutVerdict:
    """Whether to run the plan's K-FAC layout or one of the reference layouts it lists, weighed beyond the noise
    (`planner.strategies.intervals.with_kfac_intervals`): `keep` is "plan" or the reference layout kept; `against`
    the reference the plan gains least on; `gain` the plan's gain over it, 1 - plan / reference draw by draw:
    (median, low, high). The plan is kept when `low` > 0."""

    keep: str
    against: str
    gain: tuple[float, float, float]

    def to_dict(self) -> dict[str, Any]:
        return {"keep": self.keep, "against": self.against, "gain": list(self.gain)}

    @classmethod
    def from_dict(cls, data: Any, where: str) -> LayoutVerdict:
        expect(data, dict, where)
        check_fields(data, where, ["keep", "against", "gain"])
        return cls(keep=expect(data["keep"], str, f"{where}.keep"),
                   against=expect(data["against"], str, f"{where}.against"),
                   gain=expect_gain(data["gain"], f"{where}.gain"))


@dataclass(frozen=True, kw_only=True)
class KFACSection:
    """K-FAC decisions: factor fusion buffers, inversion owners, update intervals, and predictions.

    owners maps every factor name to the rank that inverts it and broadcasts the result, or None when
    every worker inverts it itself ("all" in JSON). preconditioners maps every layer to the rank that
    preconditions its gradient and broadcasts the result (that rank inverts both of the layer's factors,
    which then are not broadcast), or None when every worker preconditions it (empty: every layer).
    Factors travel as their upper triangles (d(d+1)/2
    values, and so does a damped inverse), or whole (d^2 values) with `whole_factors`, as kfac-pytorch
    sends them by default; `mixed_whole` (when not None) names the factors that travel whole, the others as
    triangles (the plan chooses per buffer).
    """

    method: InverseMethod
    factor_update_steps: int
    inv_update_steps: int
    layers: tuple[KFACLayerSpec, ...]
    a_buffers: tuple[tuple[str, ...], ...]
    g_buffers: tuple[tuple[str, ...], ...]
    owners: dict[str, int | None]
    preconditioners: dict[str, int | None] = field(default_factory=dict)
    whole_factors: bool = False
    mixed_whole: frozenset[str] | None = None
    fusion_solver: str = "none"
    placement_solver: str = "none"
    solve_seconds: float = 0.0
    placement_gap: float | None = None
    predicted: KFACPrediction | None = None
    baselines: dict[str, KFACPrediction] | None = None
    lower_bound_s: float | None = None
    #: The --kfac-skip pattern the profile was measured with (the runtime and bench follow it); None: none.
    skip: str | None = None
    #: (name, reason) of the model's modules with trainable parameters that K-FAC leaves to plain SGD.
    left_out: tuple[tuple[str, str], ...] | None = ()
    #: The interval (low, high) of "plan" and of each baseline that could be rebuilt, over profiles resampled from
    #: the profile's samples (None: not computed, or the profile kept none).
    intervals: dict[str, tuple[float, float]] | None = None
    #: The plan's layout or a reference layout, weighed beyond the noise (None: not weighed).
    verdict: LayoutVerdict | None = None

    def __post_init__(self) -> None:
        if self.skip is not None:
            try:
                re.compile(self.skip)
            except re.error as exc:
                raise SchemaError(f"kfac.skip {self.skip!r} is not a regular expression: {exc}") from None
        if self.factor_update_steps < 1 or self.inv_update_steps < 1:
            raise SchemaError(
                "`factor_update_steps >= 1 and inv_update_steps >= 1` must hold, but got "
                f"(factor_update_steps={self.factor_update_steps}, inv_update_steps={self.inv_update_steps})"
            )
        if self.inv_update_steps % self.factor_update_steps:
            raise SchemaError(
                "inv_update_steps must be a multiple of factor_update_steps, but got "
                f"(factor_update_steps={self.factor_update_steps}, inv_update_steps={self.inv_update_steps})"
            )
        if not self.layers:
            raise SchemaError("the kfac section names no layers")
        known = {"plan", *(self.baselines or {})}
        if self.verdict is not None and not {self.verdict.keep, self.verdict.against} <= known:
            raise SchemaError(f"kfac.predicted.verdict names a layout the section does not predict: keep "
                              f"{self.verdict.keep!r}, against {self.verdict.against!r}")
        unknown = sorted(set(self.intervals or {}) - known)
        if unknown:
            raise SchemaError(f"kfac.predicted.intervals names rows the section does not predict: {unknown}")
        names = [lt.name for lt in self.layers]
        if len(set(names)) != len(names):
            raise SchemaError("a layer appears twice in kfac.layers")
        forward = tuple(names)
        a_order = tuple(n for buf in self.a_buffers for n in buf)
        g_order = tuple(n for buf in self.g_buffers for n in buf)
        if a_order != forward:
            raise SchemaError(f"kfac.a_buffers must hold every layer once in forward order {list(forward)}")
        if g_order != forward[::-1]:
            raise SchemaError(f"kfac.g_buffers must hold every layer once in backward order {list(forward[::-1])}")
        expected = {factor_name(n, k) for n in names for k in FactorKind}
        if set(self.owners) != expected:
            missing = sorted(expected - set(self.owners))
            extra = sorted(set(self.owners) - expected)
            raise SchemaError(f"kfac.owners must name every factor once: missing {missing[:3]}, unknown {extra[:3]}")
        if self.mixed_whole is not None:
            unknown = sorted(set(self.mixed_whole) - expected)
            if unknown:
                raise SchemaError(f"kfac.factor_messages names factors the section does not have: {unknown[:3]}")
            if not self.mixed_whole or self.mixed_whole == expected:  # one format for all: say it plainly
                object.__setattr__(self, "whole_factors", bool(self.mixed_whole))
                object.__setattr__(self, "mixed_whole", None)
            else:
                object.__setattr__(self, "mixed_whole", frozenset(self.mixed_whole))
                object.__setattr__(self, "whole_factors", False)
        if not self.preconditioners:
            object.__setattr__(self, "preconditioners", dict.fromkeys(names))
        if set(self.preconditioners) != set(names):
            missing = sorted(set(names) - set(self.preconditioners))
            extra = sorted(set(self.preconditioners) - set(names))
            raise SchemaError(
                f"kfac.preconditioners must name every layer once: missing {missing[:3]}, unknown {extra[:3]}"
            )
        for layer, rank in self.preconditioners.items():
            owners = tuple(self.owners[factor_name(layer, k)] for k in FactorKind)
            if rank is not None and owners != (rank, rank):
                raise SchemaError(
                    f"kfac.preconditioners.{layer} is rank {rank}, which must invert both of the layer's factors, "
                    f"but kfac.owners gives {factor_name(layer, FactorKind.A)}: {owners[0]}, "
                    f"{factor_name(layer, FactorKind.G)}: {owners[1]} ({ALL_WORKERS!r} is every worker)"
                )

    # -- use ---------------------------------------------------------------------------------------
    def factor_names(self) -> list[str]:
        """Every factor, A and G of each layer in forward order."""
        return [factor_name(lt.name, k) for lt in self.layers for k in FactorKind]

    def sends_whole(self, factor: str) -> bool:
        """Whether `factor` (a name of `factor_names()`) travels whole rather than as its upper triangle."""
        return factor in self.mixed_whole if self.mixed_whole is not None else self.whole_factors

    def factor_formats(self) -> dict[str, bool]:
        """Every factor name and whether it travels whole."""
        return {f: self.sends_whole(f) for f in self.factor_names()}

    def describe_messages(self) -> str:
        """How factors travel, in a few words."""
        if self.mixed_whole is None:
            return "whole" if self.whole_factors else "upper triangles"
        return f"{len(self.mixed_whole)} of {2 * len(self.layers)} whole, the rest upper triangles"

    def check_layers(self, layers: list[KFACLayerSpec]) -> None:
        """Refuse a model whose K-FAC layers differ from the plan's (names or factor dimensions).

        Order is not compared: the section's order is the measured execution order, which can differ
        from the order modules were registered in (a residual shortcut, for example).
        """
        mine = {lt.name: lt for lt in layers}
        planned = {lt.name: lt for lt in self.layers}
        if mine != planned:
            diff = sorted(set(mine) ^ set(planned)) or sorted(n for n in planned if mine[n] != planned[n])
            raise PlanMismatchError(
                f"the model's K-FAC layers differ from the plan's (first differences: {diff[:3]}); "
                "profile this model and re-plan with `planner solve --strategy kfac`"
            )

    def check_world_size(self, world_size: int) -> None:
        ranks = [*self.owners.values(), *self.preconditioners.values()]
        bad = sorted({r for r in ranks if r is not None and r >= world_size})
        if bad:
            raise PlanMismatchError(
                f"the kfac section names ranks {bad} (inversion owners or preconditioners) but the world size is "
                f"{world_size}; re-plan for this cluster"
            )

    # -- serialisation -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method.value,
            "factor_update_steps": self.factor_update_steps,
            "inv_update_steps": self.inv_update_steps,
            "layers": [lt.to_dict() for lt in self.layers],
            "a_buffers": [list(b) for b in self.a_buffers],
            "g_buffers": [list(b) for b in self.g_buffers],
            "owners": {k: ALL_WORKERS if v is None else v for k, v in self.owners.items()},
            "preconditioners": {k: ALL_WORKERS if v is None else v for k, v in self.preconditioners.items()},
            "factor_messages": (_WHOLE if self.whole_factors else _TRIANGLE) if self.mixed_whole is None
            else {_WHOLE: [f for f in self.factor_names() if f in self.mixed_whole]},
            "solvers": {
                "fusion": self.fusion_solver,
                "placement": self.placement_solver,
                "seconds": self.solve_seconds,
                "gap": self.placement_gap,
            },
            "predicted": None
            if self.predicted is None
            else {
                "plan": asdict(self.predicted),
                "baselines": {k: asdict(v) for k, v in (self.baselines or {}).items()},
                "lower_bound_s": self.lower_bound_s,
                **({} if self.intervals is None else {"intervals": {k: list(v) for k, v in self.intervals.items()}}),
                **({} if self.verdict is None else {"verdict": self.verdict.to_dict()}),
            },
            "skip": self.skip,
            "left_out": None if self.left_out is None else [list(pair) for pair in self.left_out],
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "plan.kfac") -> KFACSection:
        expect(data, dict, where)
        check_fields(
            data,
            where,
            ["method", "factor_update_steps", "inv_update_steps", "layers", "a_buffers", "g_buffers", "owners",
             "solvers", "predicted"],
            # absent in plans made before these could be chosen, or were recorded
            ["factor_messages", "preconditioners", "skip", "left_out"],
        )
        messages = data.get("factor_messages", _TRIANGLE)
        mixed = None
        if isinstance(messages, dict):
            check_fields(messages, f"{where}.factor_messages", [_WHOLE])
            names = expect(messages[_WHOLE], list, f"{where}.factor_messages.{_WHOLE}")
            mixed = frozenset(expect(n, str, f"{where}.factor_messages.{_WHOLE}[]") for n in names)
            if len(mixed) != len(names):
                raise SchemaError(f"{where}.factor_messages.{_WHOLE} names a factor twice")
        elif messages not in (_TRIANGLE, _WHOLE):
            raise SchemaError(
                f"{where}.factor_messages must be {_TRIANGLE!r}, {_WHOLE!r} or {{{_WHOLE!r}: [factor names]}}, "
                f"got {messages!r}"
            )
        try:
            method = InverseMethod(data["method"])
        except ValueError:
            raise SchemaError(
                f"{where}.method must be one of {[m.value for m in InverseMethod]}, got {data['method']!r}"
            ) from None
        solvers = expect(data["solvers"], dict, f"{where}.solvers")
        check_fields(solvers, f"{where}.solvers", ["fusion", "placement", "seconds", "gap"])
        gap = solvers["gap"]
        owners = {
            expect(k, str, f"{where}.owners key"): _owner_from_json(v, f"{where}.owners.{k}")
            for k, v in expect(data["owners"], dict, f"{where}.owners").items()
        }
        preconditioners = {
            expect(k, str, f"{where}.preconditioners key"): _owner_from_json(v, f"{where}.preconditioners.{k}")
            for k, v in expect(data.get("preconditioners", {}), dict, f"{where}.preconditioners").items()
        }
        predicted = baselines = lower = intervals = verdict = None
        if data["predicted"] is not None:
            pred = expect(data["predicted"], dict, f"{where}.predicted")
            check_fields(pred, f"{where}.predicted", ["plan", "baselines", "lower_bound_s"],
                         ["intervals", "verdict"])
            if pred.get("intervals") is not None:
                intervals = {expect(k, str, f"{where}.predicted.intervals name"):
                             expect_interval(pair, f"{where}.predicted.intervals.{k}")
                             for k, pair in expect(pred["intervals"], dict, f"{where}.predicted.intervals").items()}
            if pred.get("verdict") is not None:
                verdict = LayoutVerdict.from_dict(pred["verdict"], f"{where}.predicted.verdict")
            predicted = KFACPrediction.from_dict(pred["plan"], f"{where}.predicted.plan")
            baselines = {
                expect(k, str, "baseline name"): KFACPrediction.from_dict(v, f"{where}.predicted.baselines.{k}")
                for k, v in expect(pred["baselines"], dict, f"{where}.predicted.baselines").items()
            }
            lower = expect_time(pred["lower_bound_s"], f"{where}.predicted.lower_bound_s")
        return cls(
            method=method,
            factor_update_steps=expect(data["factor_update_steps"], int, f"{where}.factor_update_steps"),
            inv_update_steps=expect(data["inv_update_steps"], int, f"{where}.inv_update_steps"),
            layers=tuple(
                KFACLayerSpec.from_dict(x, f"{where}.layers[{i}]")
                for i, x in enumerate(expect(data["layers"], list, f"{where}.layers"))
            ),
            a_buffers=_name_lists(data["a_buffers"], f"{where}.a_buffers"),
            g_buffers=_name_lists(data["g_buffers"], f"{where}.g_buffers"),
            owners=owners,
            preconditioners=preconditioners,
            whole_factors=messages == _WHOLE,
            mixed_whole=mixed,
            fusion_solver=expect(solvers["fusion"], str, f"{where}.solvers.fusion"),
            placement_solver=expect(solvers["placement"], str, f"{where}.solvers.placement"),
            solve_seconds=expect_time(solvers["seconds"], f"{where}.solvers.seconds"),
            placement_gap=None if gap is None else expect_time(gap, f"{where}.solvers.gap"),
            predicted=predicted,
            baselines=baselines,
            lower_bound_s=lower,
            skip=None if data.get("skip") is None else expect(data["skip"], str, f"{where}.skip"),
            left_out=left_out_from_json(data.get("left_out"), f"{where}.left_out"),
            intervals=intervals,
            verdict=verdict,
        )

    @classmethod
    def simple(
        cls,
        layers: list[KFACLayerSpec],
        *,
        method: InverseMethod = InverseMethod.EIGEN,
        factor_update_steps: int = 1,
        inv_update_steps: int = 1,
        owners: dict[str, int | None] | None = None,
        a_buffers: tuple[tuple[str, ...], ...] | None = None,
        g_buffers: tuple[tuple[str, ...], ...] | None = None,
        preconditioners: dict[str, int | None] | None = None,
    ) -> KFACSection:
        """A section without predictions: one buffer per factor, every factor inverted and every layer
        preconditioned everywhere, unless buffers, owners or preconditioners are given (the runtime's default
        when no plan is passed)."""
        names = [lt.name for lt in layers]
        return cls(
            method=method,
            factor_update_steps=factor_update_steps,
            inv_update_steps=inv_update_steps,
            layers=tuple(layers),
            a_buffers=a_buffers if a_buffers is not None else tuple((n,) for n in names),
            g_buffers=g_buffers if g_buffers is not None else tuple((n,) for n in reversed(names)),
            owners=owners if owners is not None else {factor_name(n, k): None for n in names for k in FactorKind},
            preconditioners=preconditioners or {},
        )
