"""`planner report`: pictures of a plan and one HTML page that shows them.

Everything drawn comes from the plan and the profile it was solved from, through the cost model the solvers
use (a gradient plan's events as `planner.strategies.predict.predict` walks them; `planner.strategies.kfac_plan`), or
from plain data the caller passes (scaling series, `planner bench --json` rows). Pictures are drawn on
`matplotlib.figure.Figure` objects (no pyplot, no global state) and every file is written atomically (a temporary
file in the same folder, then a rename).

- `gantt_figure`: one predicted iteration, lane by lane (compute stream, communication channel), with the
  exposed communication hatched; for a K-FAC plan the factor-update step and a second panel with the
  inversion placement (one lane per worker, one for factors inverted on every worker).
- `scaling_figure`: predicted time against world size, one line per series.
- `measured_figure`: measured median (p25-p75) next to the predicted time of every bench variant.
- `write_report`: the pictures and `report.html`.
"""

from __future__ import annotations

import datetime as dt
import html
import itertools
import math
import numbers
import os
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from matplotlib.axes import Axes
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import NullLocator

from planner.contracts.jsonio import atomic_write, ensure_folder, read_json_value
from planner.contracts.layers import plan_grouping
from planner.contracts.plan import Plan, Prediction
from planner.contracts.profile import Profile
from planner.costmodel.from_profile import gradient_problem
from planner.costmodel.mixed_simulator import MixedEvent
from planner.costmodel.problem import Grouping, groups_of
from planner.costmodel.simulator import GroupEvent, simulate
from planner.solvers.layout import layout_timelines
from planner.solvers.placement import InversionTimeline, PlacementProblem, inversion_timeline
from planner.strategies.kfac_plan import factor_step_timeline, kfac_problem, section_layout
from planner.strategies.predict import predict
from planner.types import PlanMismatchError, SchemaError, Strategy

__all__ = [
    "BENCH_KEYS",
    "COLORS",
    "MAX_WORKER_LANES",
    "Bar",
    "GanttData",
    "ReportFiles",
    "gantt_figure",
    "gantt_lanes",
    "measured_figure",
    "read_bench_json",
    "scaling_figure",
    "write_report",
]

#: Colours of every kind of thing drawn, the same in every picture.
COLORS: dict[str, str] = {
    "forward": "#9ecae1",
    "backward": "#3182bd",
    "selection": "#e6550d",
    "decode": "#fdae6b",
    "compress": "#fd8d3c",
    "middle": "#a63603",
    "factor": "#9e9ac8",
    "fold": "#54278f",
    "precondition": "#cbc9e2",
    "update": "#636363",
    "collective": "#31a354",
    "factor-comm": "#a1d99b",
    "inversion": "#8c564b",
    "broadcast": "#17becf",
    "exposed": "#d62728",
    "plan": "#08306b",
    "lower bound": "#737373",
    "measured": "#bdbdbd",
}

#: What the legend calls each kind.
_KIND_NAMES: dict[str, str] = {
    "forward": "forward",
    "backward": "backward (per group)",
    "selection": "top-k selection",
    "decode": "top-k decode",
    "compress": "compression (fp16, PowerSGD, top-k)",
    "middle": "PowerSGD's middle round",
    "factor": "K-FAC factor (A, G)",
    "fold": "fold factors",
    "precondition": "precondition",
    "update": "optimizer update",
    "collective": "gradient collective",
    "factor-comm": "factor allreduce (A, G buffers)",
    "inversion": "inversion / eigendecomposition",
    "broadcast": "broadcast of a result",
}

#: Colours of scaling series other than "plan", by name, so that a baseline keeps its colour everywhere.
_SERIES_COLORS = ["#ff7f0e", "#2ca02c", "#9467bd", "#e377c2", "#8c564b", "#17becf", "#bcbd22", "#1f77b4",
                  "#7f7f7f", "#c49c94", "#dbdb8d"]
_KNOWN_SERIES = ["ddp", "horovod", "fixed-64mb", "wfbp", "single", "mg-wfbp", "mgs-greedy", "kfac-pytorch",
                 "everywhere", "sgd"]

#: The placement panel shows at most this many worker lanes (the busiest ones).
MAX_WORKER_LANES = 16

#: The keys of a `planner bench --json` row that `measured_figure` reads (`planner.sessions.bench.BenchResult.to_dict`).
BENCH_KEYS = ("name", "median_s", "p25_s", "p75_s", "predicted_s")

_DPI = 120
_WIDTH_IN = 12.0
_STEP_LANES = ("compute", "channel")
_LANE_NAMES = {"compute": "compute stream", "channel": "channel"}


# ----------------------------------------------------------------------------------------------------
# Data: what the timeline picture draws


@dataclass(frozen=True, kw_only=True)
class Bar:
    """One bar of a timeline picture (seconds; a gradient plan's clock starts at the start of forward).

    Attributes:
        lane: "compute" or "channel" for the step; "channel" or "rank <r>" for the inversion placement.
        kind: a key of `COLORS` ("forward", "backward", "selection", "collective", "inversion", ...).
        label: the text drawn on the bar where there is room ("g0", "fc1.A", ...).
    """

    lane: str
    start_s: float
    end_s: float
    kind: str
    label: str = ""

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True, kw_only=True)
class GanttData:
    """Everything `gantt_figure` draws, computed from a plan and a profile.

    Attributes:
        title: the step panel's title.
        bars: the step, lanes "compute" and "channel", each lane in time order.
        step_s: predicted time of the step drawn (the iteration; for K-FAC the factor-update step).
        step_name: what the step is called ("iteration" or "factor-update step").
        compute_end_s: when the compute stream would have finished backward (and selection, decoding or
            factor work) had it never waited for a collective.
        comm_end_s: when the compute stream may go on to the update (top-k: after the last decode).
        placement_title: the placement panel's title ("" without K-FAC).
        placement: the inversion step of a K-FAC plan, lanes "channel" (broadcasts) and "rank <r>" (inversions).
        placement_lanes: the placement lanes drawn, top to bottom (at most `MAX_WORKER_LANES` ranks).
        makespan_s: the placement's makespan (None without K-FAC).
    """

    title: str
    bars: tuple[Bar, ...]
    step_s: float
    step_name: str
    compute_end_s: float
    comm_end_s: float
    placement_title: str = ""
    placement: tuple[Bar, ...] = ()
    placement_lanes: tuple[str, ...] = ()
    makespan_s: float | None = None

    @property
    def exposed_s(self) -> float:
        """Communication the step waits for: how long the compute stream waits for collectives."""
        return self.comm_end_s - self.compute_end_s


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f}"


def gantt_lanes(plan: Plan, profile: Profile) -> GanttData:
    """The bars of one predicted step of `plan` under `profile`'s costs (and its inversion placement for K-FAC).

    Raises:
        PlanMismatchError: the plan's layers (or K-FAC layers, or owner ranks) do not match the profile.
    """
    grouping = plan_grouping(plan, profile)
    if plan.kfac is not None:
        return _kfac_lanes(plan, profile, grouping)
    found = predict(plan, profile, interval=False)
    assert found.gradient is not None
    if all(isinstance(e, MixedEvent) for e in found.events):
        return _mixed_lanes(plan, profile, found.gradient, cast(tuple[MixedEvent, ...], found.events))
    return _gradient_lanes(plan, profile, found.gradient, cast(tuple[GroupEvent, ...], found.events))


def _mixed_lanes(plan: Plan, profile: Profile, predicted: Prediction, events: Sequence[MixedEvent]) -> GanttData:
    """The bars of a mixed plan (or a top-k plan routed per group): each group's backward and compression,
    PowerSGD's middle rounds, its collectives (two for PowerSGD) and its decoding, as `predict` walked them
    (`planner.costmodel.mixed_simulator.timeline_mixed`)."""
    labels = [f"{e.compressor} hierarchical" if plan.groups[e.index].hierarchical else str(e.compressor)
              for e in events]
    f = profile.forward_s
    bars = [Bar(lane="compute", start_s=0.0, end_s=f, kind="forward", label="forward")]
    channel = []
    compute = 0.0
    for e in events:
        bars.append(Bar(lane="compute", start_s=f + compute, end_s=f + e.ready_s, kind="backward", label=f"g{e.index}"))
        bars.append(Bar(lane="compute", start_s=f + e.ready_s, end_s=f + e.prepared_s, kind="compress",
                        label=f"{e.compressor} g{e.index}"))
        channel.append(Bar(lane="channel", start_s=f + e.comm_start_s, end_s=f + e.comm_end_s, kind="collective",
                           label=f"g{e.index}" + (" hierarchical" if plan.groups[e.index].hierarchical else "")))
        if e.second_start_s != e.comm_end_s or e.middle_s or e.second_s:
            bars.append(Bar(lane="compute", start_s=f + e.second_start_s, end_s=f + e.second_start_s + e.middle_s,
                            kind="middle", label=f"middle g{e.index}"))
            channel.append(Bar(lane="channel", start_s=f + e.second_end_s - e.second_s, end_s=f + e.second_end_s,
                               kind="collective", label=f"Q g{e.index}"))
        compute = e.compute_end_s
    bars += [Bar(lane="compute", start_s=f + e.decode_start_s, end_s=f + e.decode_end_s, kind="decode",
                 label=f"decode g{e.index}") for e in events if e.decode_s > 0]
    decoding = sum(e.decode_end_s - e.decode_start_s for e in events)
    compute_end = f + events[-1].compute_end_s + decoding
    clock = f + max(events[-1].decode_end_s, events[-1].second_end_s)
    bars.append(Bar(lane="compute", start_s=clock, end_s=clock + profile.update_s, kind="update", label="update"))
    step = predicted.iteration_s
    sent = ", ".join(dict.fromkeys(labels))
    kind = "mixed" if plan.strategy is Strategy.MIXED else plan.strategy.value
    title = (f"{plan.model.name}: {kind} plan ({sent}), predicted iteration {_ms(step)} ms, {len(events)} groups, "
             f"exposed communication {_ms(max(0.0, clock - compute_end))} ms\n{profile.cluster.describe()}")
    return GanttData(title=title, bars=tuple(bars + channel), step_s=step, step_name="iteration",
                     compute_end_s=compute_end, comm_end_s=clock)


def _gradient_lanes(plan: Plan, profile: Profile, predicted: Prediction, events: Sequence[GroupEvent]) -> GanttData:
    """The bars of a dense or top-k plan (and of an ABS-SGD plan's groups): backward, top-k selection, collectives
    and decoding, as `predict` walked them (`planner.costmodel.simulator.timeline`)."""
    f = profile.forward_s
    bars = [Bar(lane="compute", start_s=0.0, end_s=f, kind="forward", label="forward")]
    compute = 0.0
    for e in events:
        bars.append(Bar(lane="compute", start_s=f + compute, end_s=f + e.ready_s, kind="backward", label=f"g{e.index}"))
        if plan.strategy is Strategy.TOPK:
            bars.append(Bar(lane="compute", start_s=f + e.select_start_s, end_s=f + e.select_end_s, kind="selection",
                            label=f"top-k g{e.index}"))
        compute = e.select_end_s
    channel = [
        Bar(lane="channel", start_s=f + e.comm_start_s, end_s=f + e.comm_end_s, kind="collective", label=f"g{e.index}")
        for e in events
    ]
    # Top-k decodes each group after its own allgather once backward is over, overlapping the later ones:
    # the compute stream's own work ends at compute_end if it never waits; it waits the rest of the way.
    decoding = sum(e.decode_end_s - e.decode_start_s for e in events)
    compute_end = f + events[-1].select_end_s + decoding
    clock = f + max(events[-1].select_end_s, events[-1].comm_end_s, events[-1].decode_end_s)
    comm_end = clock
    if plan.strategy is Strategy.TOPK:
        bars += [Bar(lane="compute", start_s=f + e.decode_start_s, end_s=f + e.decode_end_s, kind="decode",
                     label=f"decode g{e.index}") for e in events]
    bars.append(Bar(lane="compute", start_s=clock, end_s=clock + profile.update_s, kind="update", label="update"))
    step = predicted.iteration_s
    tag = plan.strategy.value + (f" (density {plan.density:g})" if plan.strategy is Strategy.TOPK else "")
    title = (
        f"{plan.model.name}: {tag} plan, predicted iteration {_ms(step)} ms, {len(events)} groups, "
        f"exposed communication {_ms(comm_end - compute_end)} ms\n{profile.cluster.describe()}"
    )
    return GanttData(title=title, bars=tuple(bars + channel), step_s=step, step_name="iteration",
                     compute_end_s=compute_end, comm_end_s=comm_end)


def _merge(bars: list[Bar]) -> list[Bar]:
    """Join bars of one lane that touch and share kind and label (one bar per group instead of one per layer)."""
    out: list[Bar] = []
    for b in bars:
        last = out[-1] if out else None
        if last is not None and (last.kind, last.label, last.end_s) == (b.kind, b.label, b.start_s):
            out[-1] = Bar(lane=b.lane, start_s=last.start_s, end_s=b.end_s, kind=b.kind, label=b.label)
        else:
            out.append(b)
    return out


def _kfac_lanes(plan: Plan, profile: Profile, grouping: Grouping) -> GanttData:
    section = plan.kfac
    assert section is not None
    try:
        section.check_world_size(profile.cluster.world_size)
    except PlanMismatchError as exc:
        raise PlanMismatchError(f"{exc} (the profile's world size)") from None
    step = factor_step_timeline(profile, section, grouping)
    group_of = {profile.layers[i].name: g for g, layers in enumerate(groups_of(grouping)) for i in layers}
    compute = _merge([
        Bar(lane="compute", start_s=s.start_s, end_s=s.end_s, kind="factor" if s.kind in ("A", "G") else s.kind,
            label=f"g{group_of[s.layer]}" if s.kind == "backward" else s.kind)
        for s in step.compute
    ])
    clock = step.comm_end_s
    for kind, seconds in (("fold", step.fold_s), ("precondition", step.precondition_s), ("update", step.update_s)):
        compute.append(Bar(lane="compute", start_s=clock, end_s=clock + seconds, kind=kind, label=kind))
        clock += seconds
    channel = [
        Bar(lane="channel", start_s=e.start_s, end_s=e.end_s, kind="collective" if e.kind == "grad" else "factor-comm",
            label=f"g{e.index}" if e.kind == "grad" else f"{e.kind}{e.index}")
        for e in step.channel.events
    ]

    problem = kfac_problem(profile, section.method, whole_factors=section.factor_formats())
    layout = section_layout(section)
    placement = layout.owners
    bars, lanes, makespan = _placement_bars(problem.placement, placement,
                                            layout_timelines(problem.layout, layout)[0])
    shown = len(lanes) - 1
    grad = gradient_problem(profile, Strategy.DENSE)
    plain = simulate(grad, grouping).iteration_s + step.precondition_s
    average = (plain + (step.step_s - plain) / section.factor_update_steps
               + makespan / section.inv_update_steps)
    title = (
        f"{plan.model.name}: K-FAC factor-update step {_ms(step.step_s)} ms (plain step {_ms(plain)} ms, "
        f"average step {_ms(average)} ms with factors every {section.factor_update_steps} and inverses every "
        f"{section.inv_update_steps} steps)\n{profile.cluster.describe()}"
    )
    owned = sum(o is not None for o in placement)
    workers = profile.cluster.world_size
    which = ""
    if shown < workers:
        which = (f"; lanes: the {shown} busiest of {workers} workers" if shown == MAX_WORKER_LANES
                 else f"; lanes: the {shown} of {workers} workers that own factors")
    placement_title = (
        f"Inversion step ({section.method.value}, one in {section.inv_update_steps}): makespan {_ms(makespan)} ms; "
        f"{owned} factors inverted by one owner and broadcast, {len(placement) - owned} by all workers{which}"
    )
    return GanttData(
        title=title, bars=tuple(compute + channel), step_s=step.step_s, step_name="factor-update step",
        compute_end_s=step.compute_end_s,
        comm_end_s=step.comm_end_s, placement_title=placement_title, placement=tuple(bars), placement_lanes=lanes,
        makespan_s=makespan,
    )


def _placement_bars(
    problem: PlacementProblem, placement: Sequence[int | None], timeline: InversionTimeline | None = None
) -> tuple[list[Bar], tuple[str, ...], float]:
    """Bars of the inversion step as `planner.solvers.placement.inversion_timeline` models it (and the runtime runs it):
    each rank inverts its own factors in order, then the "all" factors; each owner's broadcast goes on the channel
    when its factor is inverted and the channel is free. `timeline`: the step's timeline when not every owned
    factor is broadcast (a K-FAC layout whose preconditioners keep their layers' factors).

    Returns the bars, the lanes to draw ("channel", then at most `MAX_WORKER_LANES` ranks: all of them, or the
    busiest owners when there are more workers; only those ranks get bars) and the makespan.
    """
    timeline = timeline or inversion_timeline(problem, placement)
    loads = timeline.owned_load_s
    if problem.world_size <= MAX_WORKER_LANES:
        ranks = list(range(problem.world_size))
    else:
        owners = {r for r in placement if r is not None}
        ranks = sorted(sorted(owners, key=lambda r: (-loads[r], r))[:MAX_WORKER_LANES])
    bars = [Bar(lane="channel", start_s=start, end_s=end, kind="broadcast", label=problem.name(f))
            for f, start, end in timeline.broadcasts]
    everywhere = [f for f, owner in enumerate(placement) if owner is None]
    for rank in ranks:
        clock = 0.0
        for f in [*(f for f, owner in enumerate(placement) if owner == rank), *everywhere]:
            bars.append(Bar(lane=f"rank {rank}", start_s=clock, end_s=clock + problem.inv_s[f], kind="inversion",
                            label=problem.name(f)))
            clock += problem.inv_s[f]
    return bars, ("channel", *(f"rank {r}" for r in ranks)), timeline.makespan_s


# ----------------------------------------------------------------------------------------------------
# Drawing


def _text_color(color: str) -> str:
    r, g, b = to_rgb(color)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


def _draw_bars(ax: Axes, bars: Sequence[Bar], lanes: Sequence[str], *, span_s: float, width_in: float) -> set[str]:
    """Bars in ms on lanes (top to bottom), labelled where the label fits; returns the kinds drawn.

    A bar narrower than a pixel and a half is drawn that wide, so that short collectives stay visible.
    """
    row = {lane: i for i, lane in enumerate(lanes)}
    drawn = [b for b in bars if b.lane in row]
    kinds = sorted({b.kind for b in drawn}, key=list(COLORS).index)
    px_per_ms = width_in * _DPI / (span_s * 1e3) if span_s > 0 else 0.0
    thinnest = 1.5 / px_per_ms if px_per_ms > 0 else 0.0
    for kind in kinds:
        mine = [b for b in drawn if b.kind == kind]
        ax.barh([row[b.lane] for b in mine], [max(b.duration_s * 1e3, thinnest) for b in mine],
                left=[b.start_s * 1e3 for b in mine], height=0.62, color=COLORS[kind], edgecolor="white",
                linewidth=0.6, zorder=2)
    for b in drawn:
        if b.label and b.duration_s * 1e3 * px_per_ms > (len(b.label) * 0.62 + 0.8) * 8 * _DPI / 72:
            ax.text((b.start_s + b.end_s) / 2 * 1e3, row[b.lane], b.label, ha="center", va="center", fontsize=8,
                    color=_text_color(COLORS[b.kind]), zorder=5, clip_on=True)
    ax.set_yticks(range(len(lanes)), [_LANE_NAMES.get(lane, lane) for lane in lanes], fontsize=10)
    ax.set_ylim(len(lanes) - 0.45, -0.55)
    ax.set_xlim(0, span_s * 1e3 * 1.01)
    ax.grid(axis="x", color="#e0e0e0", linewidth=0.8, zorder=0)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return set(kinds)


def _mark(ax: Axes, x_s: float, text: str, *, color: str = "black") -> None:
    """A dashed vertical line at `x_s` with its label just above the axes, ending at the line."""
    ax.axvline(x_s * 1e3, color=color, linestyle="--", linewidth=1.2, zorder=4)
    ax.annotate(text, xy=(x_s * 1e3, 1.0), xycoords=("data", "axes fraction"), xytext=(-3, 3),
                textcoords="offset points", ha="right", va="bottom", fontsize=9, color=color, fontweight="bold")


def _wrap(title: str, width: int = 112) -> str:
    """Wrap each line of a title so that it leaves room for the mark label at the right above the axes."""
    return "\n".join(textwrap.fill(line, width) for line in title.split("\n"))


def _share(part: float, whole: float) -> str:
    share = part / whole if whole > 0 else 0.0
    return f"{share:.1%}" if share < 0.1 else f"{share:.0%}"


def _draw_step(ax: Axes, data: GanttData, width_in: float) -> set[str]:
    kinds = _draw_bars(ax, data.bars, _STEP_LANES, span_s=data.step_s, width_in=width_in)
    ax.set_ylim(1.95, -0.55)  # room under the channel lane for the exposed-communication note
    exposed = data.exposed_s
    x0, x1 = data.compute_end_s * 1e3, data.comm_end_s * 1e3
    red = COLORS["exposed"]
    if exposed > 0:
        # The channel's exposed part hatched; the compute stream waits meanwhile (a faint band).
        ax.add_patch(Rectangle((x0, -0.31), x1 - x0, 0.62, facecolor=red, alpha=0.12, edgecolor="none", zorder=1))
        ax.add_patch(Rectangle((x0, 0.64), x1 - x0, 0.72, facecolor=red, alpha=0.12, edgecolor="none", zorder=1))
        ax.add_patch(Rectangle((x0, 0.64), x1 - x0, 0.72, facecolor="none", edgecolor=red, hatch="///",
                               linewidth=1.2, zorder=3))
        text = f"exposed communication {_ms(exposed)} ms ({_share(exposed, data.step_s)} of the {data.step_name})"
    else:
        text = "no exposed communication: the channel finishes before the compute stream"
    # The note runs from the span's middle towards the roomier side, so that it stays inside the axes.
    middle = (x0 + x1) / 2
    right = middle > 0.5 * ax.get_xlim()[1]
    ax.annotate(text, xy=(middle, 1.36), xytext=(middle, 1.72), ha="right" if right else "left", va="center",
                fontsize=9.5, color=red, fontweight="bold",
                arrowprops={"arrowstyle": "->", "color": red, "linewidth": 1.0} if exposed > 0 else None)
    _mark(ax, data.step_s, f"{data.step_name} {_ms(data.step_s)} ms")
    ax.set_xlabel("time from the start of forward (ms)", fontsize=10)
    ax.set_title(_wrap(data.title), loc="left", fontsize=10.5)
    return kinds


def _draw_placement(ax: Axes, data: GanttData, width_in: float) -> set[str]:
    assert data.makespan_s is not None
    kinds = _draw_bars(ax, data.placement, data.placement_lanes, span_s=data.makespan_s, width_in=width_in)
    _mark(ax, data.makespan_s, f"makespan {_ms(data.makespan_s)} ms")
    ax.set_xlabel("time from the start of the inversion step (ms)", fontsize=10)
    ax.set_title(_wrap(data.placement_title), loc="left", fontsize=10.5)
    return kinds


def _save_figure(fig: Figure, path: Path) -> Path:
    return atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=_DPI), "report picture")


def gantt_figure(plan: Plan, profile: Profile, path: Path) -> Path:
    """Draw one predicted step of `plan` under `profile` (and the inversion placement of a K-FAC plan) to `path`.

    Raises:
        PlanMismatchError: the plan does not match the profile (see `gantt_lanes`).
    """
    data = gantt_lanes(plan, profile)
    placement = data.makespan_s is not None
    lanes = len(data.placement_lanes)
    heights = [3.4, 1.2 + 0.42 * lanes] if placement else [3.4]
    fig = Figure(figsize=(_WIDTH_IN, sum(heights) + 0.8), dpi=_DPI, layout="constrained")
    axes = fig.subplots(len(heights), 1, height_ratios=heights, squeeze=False)[:, 0]
    width_in = _WIDTH_IN * 0.84
    kinds = _draw_step(axes[0], data, width_in)
    if placement:
        kinds |= _draw_placement(axes[1], data, width_in)
    handles = [Patch(facecolor=COLORS[k], label=_KIND_NAMES[k]) for k in COLORS if k in kinds]
    handles.append(Patch(facecolor=COLORS["exposed"], alpha=0.3, hatch="///", edgecolor=COLORS["exposed"],
                         label="exposed communication"))
    columns = len(handles) if len(handles) <= 6 else 4
    fig.legend(handles=handles, loc="outside lower center", ncol=columns, frameon=False, fontsize=9)
    return _save_figure(fig, Path(path))


# ----------------------------------------------------------------------------------------------------
# Scaling and measured pictures


def _series_color(name: str, index: int) -> str:
    if name == "plan":
        return COLORS["plan"]
    known = "ddp" if name.startswith("ddp+") else name  # DDP's row, whichever hook it runs
    if known in _KNOWN_SERIES:
        return _SERIES_COLORS[_KNOWN_SERIES.index(known) % len(_SERIES_COLORS)]
    return _SERIES_COLORS[(len(_KNOWN_SERIES) + index) % len(_SERIES_COLORS)]


def _finite_times(values: Sequence[float], where: str, *, positive: bool) -> list[float]:
    out: list[float] = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0 or (
                positive and v == 0):
            rule = "> 0" if positive else ">= 0"
            raise SchemaError(f"`{where}[{i}] {rule}` must hold (a finite number of seconds), but got {v!r}")
        out.append(float(v))
    return out


def _check_scaling(
    world_sizes: Sequence[int], series: Mapping[str, Sequence[float]], lower_bound: Sequence[float] | None
) -> tuple[list[int], dict[str, list[float]], list[float] | None]:
    """The scaling data as lists, checked; one-line errors name the bad value."""
    sizes = list(world_sizes)
    if not sizes:
        raise SchemaError("the scaling picture needs at least one world size, but got world_sizes=[]")
    if any(isinstance(w, bool) or not isinstance(w, numbers.Integral) or w < 1 for w in sizes):
        raise SchemaError(f"world sizes must be whole numbers >= 1, but got world_sizes={sizes}")
    sizes = [int(w) for w in sizes]
    if any(b <= a for a, b in itertools.pairwise(sizes)):
        raise SchemaError(f"world sizes must be strictly ascending, but got world_sizes={sizes}")
    if not series:
        raise SchemaError("the scaling picture needs at least one series, but got none")
    checked = {}
    for name, values in series.items():
        values = list(values)
        if len(values) != len(sizes):
            raise SchemaError(
                f"`len(series[{name!r}]) == len(world_sizes)` must hold, but got ({len(values)}, {len(sizes)})"
            )
        checked[str(name)] = _finite_times(values, f"series[{name!r}]", positive=True)
    bound = None
    if lower_bound is not None:
        bound = list(lower_bound)
        if len(bound) != len(sizes):
            raise SchemaError(
                f"`len(lower_bound) == len(world_sizes)` must hold, but got ({len(bound)}, {len(sizes)})"
            )
        bound = _finite_times(bound, "lower_bound", positive=False)
    return sizes, checked, bound


def scaling_figure(
    world_sizes: Sequence[int],
    series: Mapping[str, Sequence[float]],
    path: Path,
    *,
    title: str,
    lower_bound: Sequence[float] | None = None,
    ylabel: str = "predicted time per step (ms)",
) -> Path:
    """Draw predicted time (seconds in, ms drawn) against world size, one line per series, to `path`.

    The series named "plan" is drawn bold; `lower_bound`, when given, as a dashed grey line.

    Raises:
        SchemaError: no world sizes or series, a series (or the bound) of another length, or a bad value.
    """
    sizes, checked, bound = _check_scaling(world_sizes, series, lower_bound)
    fig = Figure(figsize=(_WIDTH_IN, 5.0), dpi=_DPI, layout="constrained")
    ax = fig.subplots()
    order = sorted(checked, key=lambda n: n == "plan")  # the plan last, on top
    for i, name in enumerate(order):
        bold = name == "plan"
        ax.plot(sizes, [v * 1e3 for v in checked[name]], marker="o", markersize=7 if bold else 5,
                linewidth=3.0 if bold else 1.6, color=_series_color(name, i), label=name, zorder=4 if bold else 3)
    if bound is not None:
        ax.plot(sizes, [v * 1e3 for v in bound], linestyle="--", linewidth=1.6, color=COLORS["lower bound"],
                label="lower bound", zorder=2)
    values = [v for vs in checked.values() for v in vs] + [v for v in bound or [] if v > 0]
    if max(values) / min(values) > 30:
        ax.set_yscale("log")
    else:
        ax.set_ylim(0, max(values) * 1e3 * 1.08)
    if len(sizes) > 1:
        ax.set_xscale("log", base=2)
        ax.set_xlim(sizes[0] / 1.25, sizes[-1] * 1.25)
    ax.set_xticks(sizes, [str(w) for w in sizes])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("world size (workers)", fontsize=11)
    ax.set_ylabel(ylabel, fontsize=11)
    ax.set_title(_wrap(title, 100), loc="left", fontsize=11)
    ax.grid(color="#e0e0e0", linewidth=0.8)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    handles, names = ax.get_legend_handles_labels()
    first = sorted(range(len(names)), key=lambda i: (names[i] != "plan", names[i] == "lower bound", i))
    ax.legend([handles[i] for i in first], [names[i] for i in first], loc="upper left", bbox_to_anchor=(1.01, 1.0),
              frameon=False, fontsize=10)
    return _save_figure(fig, Path(path))


def _check_bench(results: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    rows = list(results)
    if not rows:
        raise SchemaError("the measured picture needs at least one bench row, but got none")
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise SchemaError(f"bench row {i} must be an object (a `planner bench --json` row), but got {row!r}")
        missing = [k for k in BENCH_KEYS if k not in row]
        if missing:
            raise SchemaError(
                f"bench row {i} ({row.get('name', '?')!r}) lacks {missing}: pass the rows `planner bench --json` prints"
            )
        where = f"bench row {i} ({row['name']!r})"
        _finite_times([row["median_s"], row["p25_s"], row["p75_s"]], f"{where} [median_s, p25_s, p75_s]",
                      positive=True)
        if not row["p25_s"] <= row["median_s"] <= row["p75_s"]:
            raise SchemaError(f"{where}: `p25_s <= median_s <= p75_s` must hold, but got "
                              f"({row['p25_s']}, {row['median_s']}, {row['p75_s']})")
        if row["predicted_s"] is not None:
            _finite_times([row["predicted_s"]], f"{where} predicted_s", positive=True)
    return rows


def read_bench_json(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows of a file written by `planner bench --json > FILE`, checked.

    Raises:
        PlannerFileError: the file is missing or unreadable. SchemaError: not a list of bench rows.
    """
    rows = read_json_value(path, "bench results")
    if not isinstance(rows, list):
        raise SchemaError(f"bench results {path} must be a list of rows, but got {type(rows).__name__}")
    try:
        _check_bench(rows)
    except SchemaError as exc:
        raise SchemaError(f"bench results {path}: {exc}") from None
    return rows


def measured_figure(results: Sequence[Mapping[str, Any]], path: Path, *, title: str) -> Path:
    """Draw, per bench variant, the measured median (p25-p75 error bar) next to the predicted time, to `path`.

    Raises:
        SchemaError: no rows, a row without one of `BENCH_KEYS`, or a bad time.
    """
    rows = _check_bench(results)
    fig = Figure(figsize=(_WIDTH_IN, 5.0), dpi=_DPI, layout="constrained")
    ax = fig.subplots()
    width = 0.38
    xs = range(len(rows))
    med = [r["median_s"] * 1e3 for r in rows]
    err = [[(r["median_s"] - r["p25_s"]) * 1e3 for r in rows], [(r["p75_s"] - r["median_s"]) * 1e3 for r in rows]]
    ax.bar([x - width / 2 for x in xs], med, width, yerr=err, capsize=5, color=COLORS["measured"],
           edgecolor="#525252", linewidth=0.8, error_kw={"elinewidth": 1.2, "ecolor": "#252525"},
           label="measured median (p25-p75)", zorder=2)
    with_pred = [(x, r) for x, r in zip(xs, rows, strict=True) if r["predicted_s"] is not None]
    ax.bar([x + width / 2 for x, _ in with_pred], [r["predicted_s"] * 1e3 for _, r in with_pred], width,
           color=COLORS["plan"], label="predicted", zorder=2)
    top = max(max(r["p75_s"], r["predicted_s"] or 0.0) for r in rows) * 1e3
    for x, r in zip(xs, rows, strict=True):
        high = max(r["p75_s"], r["predicted_s"] or 0.0) * 1e3
        if r["predicted_s"] is None:
            ax.text(x - width / 2, high + top * 0.02, "no prediction", ha="center", va="bottom", fontsize=9,
                    color="#737373")
            continue
        rel = (r["predicted_s"] - r["median_s"]) / r["median_s"]
        color = COLORS["exposed"] if abs(rel) > 0.25 else "black"
        ax.text(x, high + top * 0.02, f"{rel:+.0%}", ha="center", va="bottom", fontsize=10, color=color,
                fontweight="bold")
    labels = []
    for r in rows:
        speedup = r.get("speedup")
        extra = (f"\n{speedup:.2f}x vs {r.get('reference', 'reference')}"
                 if isinstance(speedup, int | float) and not isinstance(speedup, bool) else "")
        labels.append(f"{r['name']}{extra}")
    ax.set_xticks(list(xs), labels, fontsize=10)
    for tick, r in zip(ax.get_xticklabels(), rows, strict=True):
        if str(r["name"]).startswith("plan"):
            tick.set_fontweight("bold")
    ax.set_ylim(0, top * 1.15)
    ax.set_ylabel("time per step (ms)", fontsize=11)
    ax.set_title(f"{_wrap(title, 100)}\nabove each pair: (predicted - measured) / measured", loc="left", fontsize=11)
    ax.grid(axis="y", color="#e0e0e0", linewidth=0.8, zorder=0)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=10)
    return _save_figure(fig, Path(path))


# ----------------------------------------------------------------------------------------------------
# The page


@dataclass(frozen=True, kw_only=True)
class ReportFiles:
    """The files `write_report` wrote (None: that picture was not drawn)."""

    page: Path
    timeline: Path
    scaling: Path | None = None
    measured: Path | None = None


def _table(header: Sequence[str], rows: Sequence[tuple[Sequence[str], bool]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        ('<tr class="plan">' if bold else "<tr>") + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>"
        for cells, bold in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _comparison(plan: Plan) -> str:
    """The plan against every baseline and the lower bound, as an HTML table."""
    if plan.kfac is not None and plan.kfac.predicted is not None:
        k = plan.kfac
        assert k.predicted is not None
        baselines = k.baselines or {}
        ref = baselines.get("kfac-pytorch", k.predicted).step_s
        lb = k.lower_bound_s or 0.0
        rows = []
        for name, kp in [("plan", k.predicted), *baselines.items()]:
            gap = f"{(kp.step_s - lb) / lb:+.1%}" if lb > 0 and name != "sgd" else "-"
            rows.append(([name, str(kp.num_buffers), _ms(kp.step_s), _ms(kp.factor_step_s), _ms(kp.inversion_s),
                          f"{ref / kp.step_s:.2f}x", gap], name == "plan"))
        rows.append((["lower bound", "", _ms(lb), "", "", f"{ref / lb:.2f}x" if lb > 0 else "-", ""], False))
        caption = (f"<p>Predicted average K-FAC step (factors every {k.factor_update_steps} step(s), inverses every "
                   f"{k.inv_update_steps}); 'sgd' is the same step without K-FAC.</p>")
        return caption + _table(["layout", "buffers", "avg step ms", "factor step ms", "inversion ms",
                                 "vs kfac-pytorch", "gap to bound"], rows)
    reference = plan.ddp_row if plan.ddp_row in plan.baselines else "plan"
    ref = plan.baselines.get(reference, plan.predicted).iteration_s
    lb = plan.lower_bound_s
    rows = []
    for name, p in [(f"plan ({plan.solver})", plan.predicted), *plan.baselines.items()]:
        gap = f"{(p.iteration_s - lb) / lb:+.1%}" if lb > 0 else "-"
        rows.append(([name, str(p.num_groups), _ms(p.iteration_s), _ms(p.exposed_comm_s), f"{ref / p.iteration_s:.2f}x",
                      gap], name.startswith("plan")))
    rows.append((["lower bound", "", _ms(lb), "", f"{ref / lb:.2f}x" if lb > 0 else "-", ""], False))
    return "<p>Predicted iteration time.</p>" + _table(
        ["grouping", "groups", "iteration ms", "exposed comm ms", f"vs {reference}", "gap to bound"], rows
    )


def _timeline_caption(plan: Plan) -> str:
    lanes = ("Lanes: the compute stream and the communication channel (one collective per group, g0 first); "
             "hatched: the communication the step waits for.")
    if plan.kfac is None:
        return f"One iteration as the cost model predicts it. {lanes}"
    return (f"The factor-update step (one in {plan.kfac.factor_update_steps}) as the cost model predicts it. {lanes} "
            f"Below: the inversion step (one in {plan.kfac.inv_update_steps}), who inverts each factor and when its "
            "result is broadcast.")


_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1500px;
       padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.2em; margin-top: 1.6em; }
.meta { color: #555; } img { max-width: 100%; border: 1px solid #ddd; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; }
th, td { padding: 0.25em 0.8em; border-bottom: 1px solid #e5e5e5; text-align: right; }
th:first-child, td:first-child { text-align: left; } tr.plan { font-weight: bold; background: #eef3fa; }
code { background: #f4f4f4; padding: 0.1em 0.3em; } .missing { color: #555; }
"""


def write_report(
    plan: Plan,
    profile: Profile,
    out_dir: Path,
    *,
    plan_path: str = "",
    scaling: tuple[list[int], dict[str, list[float]], list[float] | None, str] | None = None,
    bench: list[dict[str, Any]] | None = None,
    bench_source: str = "",
) -> ReportFiles:
    """Write `timeline.png`, `scaling.png` (with `scaling`), `measured.png` (with `bench`) and `report.html`.

    Args:
        plan: the plan; profile: the profile it was solved from.
        out_dir: the folder (created with its parents).
        plan_path: how the page names the plan file.
        scaling: (world sizes, series name -> seconds per world size, lower bound or None, cluster description).
        bench: `planner bench --json` rows; bench_source: where they came from.

    Raises:
        PlanMismatchError: the plan does not match the profile. SchemaError: bad scaling or bench data.
    """
    if scaling is not None:
        _check_scaling(scaling[0], scaling[1], scaling[2])
    if bench is not None:
        _check_bench(bench)
    gantt_lanes(plan, profile)  # refuse a mismatched plan before writing anything
    out = ensure_folder(out_dir, "report folder")
    kfac = plan.kfac is not None
    kfac_predicted = plan.kfac.predicted if plan.kfac is not None else None
    what = "average step" if kfac_predicted is not None else "iteration"
    timeline_png = gantt_figure(plan, profile, out / "timeline.png")
    scaling_png = measured_png = None
    if scaling is not None:
        sizes, series, bound, cluster = scaling
        scaling_png = scaling_figure(sizes, series, out / "scaling.png", lower_bound=bound,
                                     title=f"{plan.model.name}: predicted {what} time against world size ({cluster})")
    if bench is not None:
        source = f" ({bench_source})" if bench_source else ""
        measured_png = measured_figure(bench, out / "measured.png",
                                       title=f"{plan.model.name}: predicted against measured{source}")

    name = plan_path or "PLAN"
    tag = "K-FAC" if kfac else plan.strategy.value + (f" (density {plan.density:g})" if plan.density else "")
    predicted = kfac_predicted.step_s if kfac_predicted is not None else plan.predicted.iteration_s
    esc = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(f'planner report: {plan.model.name} {tag}')}</title><style>{_CSS}</style></head><body>",
        f"<h1>{esc(f'{plan.model.name}: {tag} plan')}{esc(f' ({plan_path})' if plan_path else '')}</h1>",
        f"<p><strong>predicted {esc(what)}: {esc(_ms(predicted))} ms</strong></p>",
        f"<p class=\"meta\">model {esc(plan.model.describe())}<br>cluster {esc(plan.cluster.describe())}<br>"
        f"solver {esc(plan.solver)} ({esc(f'{plan.solve_seconds * 1e3:.1f}')} ms)"
        + (esc(f"; K-FAC: {plan.kfac.fusion_solver} buffers, {plan.kfac.placement_solver} placement")
           if plan.kfac is not None else "")
        + f"<br>profile {esc(plan.source_profile or '?')} measured {esc(plan.profiled)}; plan created "
          f"{esc(plan.created)}"
        + (f"<br>the timeline is drawn with a profile measured {esc(profile.created)}, not the plan's"
           if profile.created != plan.profiled else "")
        + "</p>",
        "<h2>Plan against the baselines</h2>",
        _comparison(plan),
        "<h2>One predicted step</h2>",
        f"<p>{esc(_timeline_caption(plan))}</p>",
        f'<img src="{esc(timeline_png.name)}" alt="timeline of one predicted step">',
        "<h2>Scaling</h2>",
    ]
    if scaling_png is not None:
        parts.append(f"<p>{esc(f'cluster: {cluster}')}</p>")
        parts.append(f'<img src="{esc(scaling_png.name)}" alt="predicted time against world size">')
    else:
        parts.append(
            f'<p class="missing">Not drawn. To draw it: <code>{esc(f"planner report {name} -o DIR --cluster SPEC")}'
            f'{esc(" --world-sizes 8,64,512")}</code></p>'
        )
    parts.append("<h2>Predicted against measured</h2>")
    if measured_png is not None:
        if bench_source:
            parts.append(f"<p>bench results: {esc(bench_source)}</p>")
        parts.append(f'<img src="{esc(measured_png.name)}" alt="predicted against measured step times">')
    else:
        strategy = " --strategy kfac" if kfac else ""
        parts.append(
            f'<p class="missing">Not drawn. To draw it: <code>{esc(f"planner bench{strategy} --plan {name} --json")}'
            f' &gt; bench.json</code> then <code>{esc(f"planner report {name} -o DIR --bench bench.json")}</code></p>'
        )
    stamp = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    parts.append(f'<p class="meta">written by planner report, {esc(stamp)}</p></body></html>\n')
    text = "\n".join(parts)
    page = atomic_write(out / "report.html", lambda tmp: tmp.write_text(text, encoding="utf-8"), "report page")
    return ReportFiles(page=page, timeline=timeline_png, scaling=scaling_png, measured=measured_png)
