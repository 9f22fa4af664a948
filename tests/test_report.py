"""`planner report`: what the timeline picture is made of agrees with the simulator, files and refusals."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest

from planner.contracts.layers import plan_grouping
from planner.contracts.plan import Plan
from planner.contracts.profile import Profile
from planner.costmodel.from_profile import gradient_problem
from planner.costmodel.simulator import timeline
from planner.sessions.report import (
    MAX_WORKER_LANES,
    Bar,
    ReportFiles,
    gantt_figure,
    gantt_lanes,
    measured_figure,
    read_bench_json,
    scaling_figure,
    write_report,
)
from planner.solvers.layout import layout_timelines
from planner.strategies.kfac_plan import factor_step_timeline, kfac_problem, section_layout
from planner.types import PlanMismatchError, PlannerError, SchemaError, Strategy
from tests.factories import synthetic_kfac_plan, synthetic_plan, synthetic_profile

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@cache
def profile(model: str = "mlp", world_size: int = 2) -> Profile:
    return synthetic_profile(model, world_size)


@cache
def plan(model: str = "mlp", strategy: Strategy = Strategy.DENSE, density: float | None = None) -> Plan:
    return synthetic_plan(model, strategy=strategy, density=density)


@cache
def kfac_plan(model: str = "mlp", world_size: int = 2) -> Plan:
    return synthetic_kfac_plan(model, world_size, time_limit_s=0.5)


def bench_rows() -> list[dict]:
    """Rows shaped like `planner bench --json` output (`BenchResult.to_dict`)."""
    def row(name: str, median: float, predicted: float | None) -> dict:
        rel = None if predicted is None else abs(predicted - median) / median
        return {"name": name, "strategy": "dense", "median_s": median, "p25_s": median * 0.95,
                "p75_s": median * 1.1, "steps": 20, "predicted_s": predicted, "speedup": 0.02 / median,
                "reference": "ddp", "rel_error": rel}

    return [row("ddp", 0.020, 0.018), row("per-layer dense", 0.025, None), row("plan dense", 0.017, 0.016)]


def is_png(path: Path) -> bool:
    data = path.read_bytes()
    return len(data) > 1000 and data.startswith(PNG_SIGNATURE)


def lane(bars: tuple[Bar, ...], name: str) -> list[Bar]:
    return [b for b in bars if b.lane == name]


def assert_ordered_and_disjoint(bars: list[Bar]) -> None:
    assert bars
    for b in bars:
        assert b.end_s >= b.start_s >= 0
    for a, b in itertools.pairwise(bars):
        assert b.start_s >= a.end_s - 1e-12, (a, b)


# -- the timeline's bars ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("model", "strategy", "density"), [
    ("mlp", Strategy.DENSE, None), ("cnn", Strategy.DENSE, None), ("cnn", Strategy.TOPK, 0.01),
])
def test_gantt_bars_follow_the_simulator(model: str, strategy: Strategy, density: float | None) -> None:
    p, prof = plan(model, strategy, density), profile(model)
    data = gantt_lanes(p, prof)
    compute, channel = lane(data.bars, "compute"), lane(data.bars, "channel")
    assert_ordered_and_disjoint(compute)
    assert_ordered_and_disjoint(channel)
    assert {b.lane for b in data.bars} == {"compute", "channel"}

    problem = gradient_problem(prof, strategy, density)
    events = timeline(problem, plan_grouping(p, prof))
    f = problem.forward_s
    assert [t for b in channel for t in (b.start_s, b.end_s)] == pytest.approx(
        [t for e in events for t in (f + e.comm_start_s, f + e.comm_end_s)]
    )
    assert [b.label for b in channel] == [f"g{i}" for i in range(len(p.groups))]
    assert compute[0].kind == "forward" and compute[0].end_s == pytest.approx(f)
    assert compute[-1].kind == "update" and compute[-1].end_s == pytest.approx(data.step_s)
    assert sum(b.kind == "selection" for b in compute) == (len(p.groups) if strategy is Strategy.TOPK else 0)
    assert data.step_s == pytest.approx(p.predicted.iteration_s, rel=1e-9)
    assert data.exposed_s == pytest.approx(p.predicted.exposed_comm_s, abs=1e-12)
    assert data.makespan_s is None and not data.placement
    assert f"{p.predicted.iteration_s * 1e3:,.2f} ms" in data.title


def test_kfac_step_and_placement_match_the_plan_predictions() -> None:
    p, prof = kfac_plan(), profile()
    assert p.kfac is not None and p.kfac.predicted is not None
    data = gantt_lanes(p, prof)
    assert data.step_s == pytest.approx(p.kfac.predicted.factor_step_s, rel=1e-9)
    compute = lane(data.bars, "compute")
    assert_ordered_and_disjoint(compute)
    assert_ordered_and_disjoint(lane(data.bars, "channel"))
    assert {"forward", "factor", "backward", "fold", "precondition", "update"} <= {b.kind for b in compute}
    channel_kinds = {b.kind for b in lane(data.bars, "channel")}
    assert channel_kinds == {"collective", "factor-comm"}
    assert sum(b.kind == "collective" for b in data.bars) == len(p.groups)
    assert data.compute_end_s <= data.comm_end_s <= data.step_s

    # The placement panel: each lane in order; each rank inverts its own factors, then every "all" factor; each
    # owned factor's broadcast (unless its owner preconditions its layer) on the channel after its owner inverted
    # it; the makespan of the layout's inversion phase.
    problem = kfac_problem(prof, p.kfac.method)
    owners = tuple(p.kfac.owners[name] for name in problem.factor_names)
    kept = {name for name in problem.factor_names if p.kfac.preconditioners[name.rsplit(".", 1)[0]] is not None}
    layout = section_layout(p.kfac)
    assert data.makespan_s == pytest.approx(layout_timelines(problem.layout, layout)[0].makespan_s, rel=1e-9)
    assert data.makespan_s == pytest.approx(p.kfac.predicted.inversion_s, rel=1e-9)
    assert data.placement_lanes == ("channel", *(f"rank {r}" for r in range(p.cluster.world_size)))
    for name in data.placement_lanes:
        if lane(data.placement, name):
            assert_ordered_and_disjoint(lane(data.placement, name))
    shared = [n for n, owner in zip(problem.factor_names, owners, strict=True) if owner is None]
    inverted_at: dict[str, float] = {}
    for r in range(p.cluster.world_size):
        mine = [n for n, owner in zip(problem.factor_names, owners, strict=True) if owner == r]
        bars = lane(data.placement, f"rank {r}")
        assert [b.label for b in bars] == mine + shared and {b.kind for b in bars} <= {"inversion"}
        inverted_at.update({b.label: b.end_s for b in bars if b.label in mine})
    broadcasts = lane(data.placement, "channel")
    assert [b.label for b in broadcasts] == [n for n, owner in zip(problem.factor_names, owners, strict=True)
                                             if owner is not None and n not in kept]
    assert all(b.kind == "broadcast" and b.start_s >= inverted_at[b.label] - 1e-12 for b in broadcasts)
    assert max(b.end_s for b in data.placement) == pytest.approx(data.makespan_s)
    assert data.placement_title


def test_placement_panel_shows_at_most_the_busiest_workers() -> None:
    p, prof = kfac_plan("cnn", 32), profile("cnn", 32)
    data = gantt_lanes(p, prof)
    ranks = [name for name in data.placement_lanes if name != "channel"]
    assert 0 < len(ranks) <= MAX_WORKER_LANES
    assert len(ranks) < p.cluster.world_size
    busy = {b.lane for b in data.placement if b.lane != "channel"}
    assert set(ranks) <= busy
    assert f"of {p.cluster.world_size} workers" in data.placement_title


def test_factor_step_timeline_is_the_predicted_factor_step() -> None:
    p, prof = kfac_plan("cnn"), profile("cnn")
    assert p.kfac is not None and p.kfac.predicted is not None
    step = factor_step_timeline(prof, p.kfac, plan_grouping(p, prof))
    assert step.step_s == pytest.approx(p.kfac.predicted.factor_step_s, rel=1e-12)
    assert step.channel.factor_comm_s == pytest.approx(p.kfac.predicted.factor_comm_s, rel=1e-12)
    spans = [(s.start_s, s.end_s) for s in step.compute]
    assert all(b[0] >= a[1] - 1e-12 for a, b in itertools.pairwise(spans))
    assert spans[-1][1] == pytest.approx(step.compute_end_s)


# -- refusals ---------------------------------------------------------------------------------------------------


def test_a_plan_for_other_layers_is_refused(tmp_path: Path) -> None:
    p = plan()
    renamed = replace(p, groups=(replace(p.groups[0], layers=("not-a-layer",)), *p.groups[1:]))
    with pytest.raises(PlanMismatchError, match="layers differ"):
        gantt_lanes(renamed, profile())
    with pytest.raises(PlanMismatchError):
        write_report(plan("cnn"), profile("mlp"), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    resized = replace(p, model=replace(p.model, numel=p.model.numel + 1),
                      groups=(replace(p.groups[0], numel=p.groups[0].numel + 1), *p.groups[1:]))
    with pytest.raises(PlanMismatchError, match="elements"):
        plan_grouping(resized, profile())


def test_kfac_owner_beyond_the_profiles_world_size_is_refused() -> None:
    p = kfac_plan()
    assert p.kfac is not None
    first = next(iter(p.kfac.owners))
    far = replace(p, cluster=replace(p.cluster, world_size=8),
                  kfac=replace(p.kfac, owners={**p.kfac.owners, first: 7}, preconditioners={}))
    with pytest.raises(PlanMismatchError, match="world size"):
        gantt_lanes(far, profile())


@pytest.mark.parametrize(("sizes", "series", "bound", "message"), [
    ([], {"plan": []}, None, "at least one world size"),
    ([8, 16], {}, None, "at least one series"),
    ([8, 16], {"plan": [0.1]}, None, "len"),
    ([8, 16], {"plan": [0.1, 0.2], "ddp": [0.1, 0.2, 0.3]}, None, "ddp"),
    ([8, 16], {"plan": [0.1, float("nan")]}, None, "finite"),
    ([16, 8], {"plan": [0.1, 0.2]}, None, "ascending"),
    ([8, 16], {"plan": [0.1, 0.2]}, [0.1], "lower_bound"),
])
def test_bad_scaling_data_is_refused(tmp_path: Path, sizes: list, series: dict, bound: list | None,
                                     message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        scaling_figure(sizes, series, tmp_path / "s.png", title="t", lower_bound=bound)
    with pytest.raises(PlannerError):
        write_report(plan(), profile(), tmp_path / "out", scaling=(sizes, series, bound, "cluster"))
    assert not (tmp_path / "s.png").exists() and not (tmp_path / "out").exists()


def test_bad_bench_rows_are_refused(tmp_path: Path) -> None:
    rows = bench_rows()
    del rows[1]["p75_s"]
    with pytest.raises(SchemaError, match=r"bench row 1 .*p75_s"):
        measured_figure(rows, tmp_path / "m.png", title="t")
    with pytest.raises(SchemaError, match="at least one"):
        measured_figure([], tmp_path / "m.png", title="t")
    bad = bench_rows()
    bad[0]["median_s"] = -1.0
    with pytest.raises(SchemaError, match="median_s"):
        write_report(plan(), profile(), tmp_path / "out", bench=bad)
    assert not (tmp_path / "out").exists()
    (tmp_path / "bench.json").write_text(json.dumps({"not": "a list"}))
    with pytest.raises(SchemaError, match="list"):
        read_bench_json(tmp_path / "bench.json")
    (tmp_path / "bench.json").write_text(json.dumps(bench_rows()))
    assert read_bench_json(tmp_path / "bench.json") == bench_rows()


# -- files --------------------------------------------------------------------------------------------------------


def test_report_with_every_section(tmp_path: Path) -> None:
    p = plan()
    scaling = ([8, 64, 512], {"plan": [0.01, 0.012, 0.02], "ddp": [0.012, 0.016, 0.03]}, [0.009, 0.01, 0.015],
               "8 workers per host <fast>")
    files = write_report(p, profile(), tmp_path / "a" / "b", plan_path="plans/x&y.json", scaling=scaling,
                         bench=bench_rows(), bench_source="bench.json")
    assert isinstance(files, ReportFiles)
    assert files.scaling is not None and files.measured is not None
    for picture in (files.timeline, files.scaling, files.measured):
        assert picture.parent == tmp_path / "a" / "b" and is_png(picture)
    page = files.page.read_text(encoding="utf-8")
    for picture in (files.timeline, files.scaling, files.measured):
        assert f'src="{picture.name}"' in page
    assert f"{p.predicted.iteration_s * 1e3:,.2f}" in page
    assert "<td>ddp</td>" in page and "vs ddp" in page and "lower bound" in page
    assert "plans/x&amp;y.json" in page and "&lt;fast&gt;" in page and "<fast>" not in page
    assert "Not drawn" not in page
    assert sorted(f.name for f in files.page.parent.iterdir()) == ["measured.png", "report.html", "scaling.png",
                                                                    "timeline.png"]  # no temporary files left


def test_report_without_scaling_or_bench_says_how_to_get_them(tmp_path: Path) -> None:
    p = plan("cnn", Strategy.TOPK, 0.01)
    files = write_report(p, profile("cnn"), tmp_path, plan_path="plan.json")
    assert files.scaling is None and files.measured is None
    assert sorted(f.name for f in tmp_path.iterdir()) == ["report.html", "timeline.png"]
    assert is_png(files.timeline)
    page = files.page.read_text(encoding="utf-8")
    assert 'src="timeline.png"' in page and "scaling.png" not in page and "measured.png" not in page
    assert "planner report plan.json -o DIR --cluster SPEC --world-sizes 8,64,512" in page
    assert "planner bench --plan plan.json --json &gt; bench.json" in page
    assert "--bench bench.json" in page
    assert f"{p.predicted.iteration_s * 1e3:,.2f}" in page


def test_kfac_report_has_the_placement_panel_and_kfac_table(tmp_path: Path) -> None:
    p = kfac_plan()
    assert p.kfac is not None and p.kfac.predicted is not None
    files = write_report(p, profile(), tmp_path)
    assert is_png(files.timeline)
    page = files.page.read_text(encoding="utf-8")
    assert "kfac-pytorch" in page and f"{p.kfac.predicted.step_s * 1e3:,.2f}" in page
    assert "planner bench --strategy kfac" in page
    assert gantt_lanes(p, profile()).placement


def test_pictures_overwrite_atomically(tmp_path: Path) -> None:
    target = tmp_path / "timeline.png"
    target.write_bytes(b"old")
    assert gantt_figure(plan(), profile(), target) == target
    assert is_png(target)
    sizes = [1, 2, 4]
    assert is_png(scaling_figure(sizes, {"plan": [1.0, 2.0, 3.0]}, tmp_path / "s.png", title="t"))
    assert is_png(measured_figure(bench_rows(), tmp_path / "m.png", title="t"))
    assert sorted(f.name for f in tmp_path.iterdir()) == ["m.png", "s.png", "timeline.png"]


def test_scaling_accepts_one_world_size(tmp_path: Path) -> None:
    assert is_png(scaling_figure([8], {"plan": [0.1]}, tmp_path / "one.png", title="t", lower_bound=[0.0]))


def test_plan_grouping_has_one_end_per_group() -> None:
    p = plan("cnn")
    ends = plan_grouping(p, profile("cnn"))
    assert len(ends) == len(p.groups) and ends[-1] == len(profile("cnn").layers)
    assert [b - a for a, b in zip((0, *ends), ends, strict=False)] == [len(g.layers) for g in p.groups]


def test_cli_report_writes_every_picture_and_the_page(tmp_path: Path) -> None:
    from planner.commands.cli import main

    prof = tmp_path / "prof.json"
    synthetic_profile("mlp").save(prof)
    plan_path = tmp_path / "plan.json"
    assert main(["solve", str(prof), "--strategy", "kfac", "-o", str(plan_path)]) == 0
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps([
        {"name": "kfac-pytorch", "strategy": "kfac", "median_s": 0.02, "p25_s": 0.019, "p75_s": 0.021, "steps": 20,
         "predicted_s": 0.018, "speedup": 1.0, "reference": "kfac-pytorch", "rel_error": 0.1},
        {"name": "plan", "strategy": "kfac", "median_s": 0.019, "p25_s": 0.018, "p75_s": 0.02, "steps": 20,
         "predicted_s": 0.017, "speedup": 1.05, "reference": "kfac-pytorch", "rel_error": 0.1},
    ]))
    out = tmp_path / "report"
    assert main(["report", str(plan_path), "-o", str(out), "--cluster", "ib100-64", "--world-sizes", "8,64",
                 "--bench", str(bench)]) == 0
    for name in ("timeline.png", "scaling.png", "measured.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert name in (out / "report.html").read_text()
