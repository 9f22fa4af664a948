"""What the commands print for a user to act on: rows named by what they send (tables, bench rows, plan files), one
verdict line for every strategy, and the short profile summary with its details behind --verbose / --details."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest

from planner.commands.cli import main
from planner.commands.printing import comm_frame, layers_frame, print_plan
from planner.contracts.plan import Plan
from planner.costmodel.curves import fit_curve
from planner.models import build_workload
from planner.sessions.bench import auto_tag, bench_variants, file_labels, plan_labels, plan_tag
from planner.strategies.gradients import make_plan
from planner.strategies.mixed_plan import make_mixed_plan, parse_compressors
from planner.types import Compressor, Strategy
from tests.factories import synthetic_profile, with_samples
from tests.test_interference import measured_profile

ROOT = Path(__file__).resolve().parents[1]


def test_a_profiles_tables_hold_its_layers_and_its_measured_points() -> None:
    prof = synthetic_profile("mlp")
    layers = layers_frame(prof)
    assert list(layers["name"]) == [lt.name for lt in prof.layers]
    assert list(layers["ready_s"]) == pytest.approx(list(itertools.accumulate(lt.backward_s for lt in prof.layers)))
    assert len(comm_frame(prof)) == sum(len(c.points) for c in prof.collectives.values())


def _verdicts(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("verdict:")]


# -- rows named by what they send -----------------------------------------------------------------------------------
def test_ddp_rows_are_named_by_what_ddp_sends_and_old_plans_read_with_those_names() -> None:
    prof = synthetic_profile("mlp")
    dense, topk = make_plan(prof, Strategy.DENSE), make_plan(prof, Strategy.TOPK, 0.01)
    mixed = make_mixed_plan(prof, parse_compressors("dense,fp16,powersgd:1"))
    assert "ddp" in dense.baselines and dense.ddp_row == "ddp"
    assert "ddp+topk:0.01" in topk.baselines and topk.ddp_row == "ddp+topk:0.01"  # DDP with the top-k hook
    assert {"ddp", "ddp+fp16", "ddp+powersgd:1"} <= set(mixed.baselines)
    assert not any("ddp-25mb" in p.baselines for p in (dense, topk, mixed))
    # Plans written before kept DDP's row as "ddp-25mb", whatever it sent: they read with the row renamed, in place.
    old_topk = Plan.load(ROOT / "plans" / "lstm-2w-topk.json")
    old_dense = Plan.load(ROOT / "plans" / "resnet18-2w-dense.json")
    assert "ddp+topk:0.01" in old_topk.baselines and "ddp" in old_dense.baselines
    raw = json.loads((ROOT / "plans" / "resnet18-2w-dense.json").read_text())["predicted"]["baselines"]
    assert list(old_dense.baselines) == ["ddp" if name == "ddp-25mb" else name for name in raw]
    weighed = with_samples(measured_profile("mlp"))
    from planner.strategies.intervals import with_intervals

    doc = with_intervals(make_plan(weighed, Strategy.TOPK, 0.01), weighed).to_dict()
    doc["predicted"]["baselines"] = {("ddp-25mb" if k == "ddp+topk:0.01" else k): v
                                     for k, v in doc["predicted"]["baselines"].items()}
    doc["predicted"]["intervals"]["rows"] = {("ddp-25mb" if k == "ddp+topk:0.01" else k): v
                                             for k, v in doc["predicted"]["intervals"]["rows"].items()}
    again = Plan.from_dict(doc)
    assert "ddp+topk:0.01" in again.baselines and "ddp+topk:0.01" in again.intervals.rows  # type: ignore[union-attr]


def test_the_solve_table_names_each_ddp_row_by_what_it_sends(capsys: pytest.CaptureFixture[str]) -> None:
    prof = synthetic_profile("mlp")
    topk, dense = make_plan(prof, Strategy.TOPK, 0.01), make_plan(prof, Strategy.DENSE)
    for plan, row in ((topk, "ddp+topk:0.01"), (dense, "ddp")):
        print_plan(plan)
        out = capsys.readouterr().out
        assert f"│ {row} " in out and f"vs {row}" in out and "ddp-25mb" not in out


def test_bench_rows_name_plans_by_strategy_and_what_they_send_or_by_file() -> None:
    prof = synthetic_profile("mlp")
    dense, topk = make_plan(prof, Strategy.DENSE), make_plan(prof, Strategy.TOPK, 0.01)
    mixed = make_mixed_plan(prof, parse_compressors("dense,fp16,powersgd:1"))
    sent = [str(c) for c in parse_compressors("dense,fp16,powersgd:1")
            if any(mixed.compressor_of(g) == c for g in mixed.groups)]
    assert plan_tag(dense) == "dense" and plan_tag(topk) == "topk@0.01"
    assert plan_tag(mixed) == f"mixed ({', '.join(sent)})" and auto_tag(mixed) == f"auto ({', '.join(sent)})"
    assert auto_tag(dense) == "auto (dense)"
    # Two plans that would read the same are told apart by their files' stems; never by a number alone.
    other = replace(dense, solver="wfbp")
    assert plan_labels([dense, other, topk], ["dense1", "dense2", "t"]) == [
        "plan dense (dense1)", "plan dense (dense2)", "plan topk@0.01"]
    assert file_labels([dense, other], ["a/dense.json", "b/dense.json"]) == (
        "plan dense (a/dense.json)", "plan dense (b/dense.json)")
    assert file_labels([dense, topk], ["a/x.json", "b/y.json"]) == ("plan dense", "plan topk@0.01")
    names = [v.name for v in bench_variants((dense, other), build_workload("mlp").module, peers=())]
    assert not any("#" in n for n in names) and len(set(names)) == len(names)
    labelled = [v.name for v in bench_variants((dense, other), build_workload("mlp").module, peers=(),
                                               labels=file_labels([dense, other], ["dense1.json", "dense2.json"]))]
    assert "plan dense (dense1)" in labelled and "plan dense (dense2)" in labelled


# -- one verdict line for every strategy -----------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["dense", "topk", "mixed", "auto", "kfac"])
def test_solve_ends_every_plan_with_one_verdict_line(strategy: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Without samples (the noise unknown) and with them, each strategy's solve prints exactly one verdict line,
    worded alike: keep the plan, or keep DDP (K-FAC: the simplest reference layout)."""
    extra = {"mixed": ["--compressors", "dense,fp16"], "auto": ["--compressors", "dense,fp16,topk:0.01"]}
    for name, prof in (("plain", synthetic_profile("mlp")), ("noisy", with_samples(measured_profile("mlp")))):
        path = tmp_path / f"{name}.json"
        prof.save(path)
        assert main(["solve", str(path), "--strategy", strategy, *extra.get(strategy, []),
                     "-o", str(tmp_path / f"{name}-plan.json")]) == 0
        lines = _verdicts(capsys.readouterr().out)
        assert len(lines) == 1, lines
        (line,) = lines
        keep = ("verdict: keep the plan: the plan's ", "verdict: keep DDP: the plan's ",
                "verdict: keep DDP with its ", "verdict: keep the everywhere layout: the plan's ",
                "verdict: keep the kfac-pytorch layout: the plan's ")
        assert line.startswith(keep), line
        if name == "plain":
            assert "as predicted; its noise not weighed" in line
        else:
            assert "the noise" in line and "as predicted" not in line


def test_a_plan_slower_than_ddp_says_keep_ddp_even_without_samples(capsys: pytest.CaptureFixture[str]) -> None:
    """A dense plan whose runtime packs 10x slower than DDP on a fast network: DDP is predicted faster, and the plan's
    table says to keep it, with no samples to weigh the noise (before, only plans with intervals said so)."""
    from planner.contracts.profile import Calibration, InSitu
    from planner.strategies.intervals import nominal_ddp
    from planner.types import Collective

    fast = fit_curve([(1 << s, 1e-6 + 1e-12 * (1 << s)) for s in range(10, 27, 2)])
    prof = replace(measured_profile("mlp"), in_situ=InSitu(pack=Calibration(measured_s=0.1, modelled_s=0.01),
                                                           ddp_pack=Calibration(measured_s=0.01, modelled_s=0.01)))
    prof = replace(prof, collectives={**prof.collectives, Collective.ALLREDUCE: fast, Collective.ALLGATHER: fast})
    for plan in (make_plan(prof, Strategy.DENSE), make_plan(prof, Strategy.TOPK, 0.01)):
        assert plan.intervals is None
        print_plan(plan, ddp=nominal_ddp(plan, prof))
        (line,) = _verdicts(capsys.readouterr().out)
        assert line.startswith("verdict: keep DDP") and " is slower than ddp" in line, line


@pytest.mark.parametrize("noise", ["unweighed", "weighed"])
def test_auto_that_keeps_ddp_says_one_thing_what_it_kept_and_how_to_run_that(
        noise: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Where DDP (or a hook) is kept over the best plan, solve says so and how to run it, and not how to run the
    plan it did not keep (it once printed "run it via DDP (PlanHook) ..." and then "verdict: keep DDP")."""
    from planner.contracts.profile import Calibration, InSitu
    from planner.types import Collective

    fast = fit_curve([(1 << s, 1e-6 + 1e-12 * (1 << s)) for s in range(10, 27, 2)])
    prof = replace(measured_profile("mlp"), in_situ=InSitu(pack=Calibration(measured_s=0.1, modelled_s=0.01),
                                                           ddp_pack=Calibration(measured_s=0.01, modelled_s=0.01)))
    prof = replace(prof, collectives={**prof.collectives, Collective.ALLREDUCE: fast, Collective.ALLGATHER: fast})
    path, out = tmp_path / "profile.json", tmp_path / "plan.json"
    (with_samples(prof) if noise == "weighed" else prof).save(path)
    assert main(["solve", str(path), "--strategy", "auto", "--compressors", "dense,fp16", "-o", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    verdict = Plan.load(out).verdict
    kept = [line for line in lines if line.startswith("kept ")]
    (verdict_line,) = _verdicts("\n".join(lines))
    assert verdict_line.startswith(("verdict: keep DDP: ", "verdict: keep DDP with its fp16 hook")), verdict_line
    assert len(kept) == 1 and kept[0].startswith(("kept DDP: ", "kept DDP with its fp16 hook (ddp+fp16): ")), kept
    assert "run it: " in kept[0] and ("fp16_compress_hook" in kept[0]) == ("ddp+fp16" in kept[0])
    assert not [line for line in lines if line.startswith("run it ")]  # nothing on running the plan not kept
    assert any("best plan, not kept" in line for line in lines)
    if verdict is not None:
        assert f"wrote plan {out} (the verdict keeps {verdict.keep}:" in lines[-1]


def test_an_abs_plan_ends_with_the_verdict_against_synchronous_sgd(capsys: pytest.CaptureFixture[str]) -> None:
    from planner.strategies.abs_plan import make_abs_plan
    from tests.test_abs_plan import slowed_profile

    for factor in (3.0, 1.0):  # a slow worker: ABS-SGD wins; equal workers: nothing to balance
        print_plan(make_abs_plan(slowed_profile(factor), 128))
        (line,) = _verdicts(capsys.readouterr().out)
        assert line.startswith(("verdict: keep the plan: the plan's ", "verdict: keep DDP: the plan's ",
                                "verdict: keep synchronous SGD (sync-proportional)"))
        assert "samples/s" in line and "ABS-SGD plans carry no intervals" in line
        if factor == 3.0:
            assert line.startswith("verdict: keep the plan")


def test_a_verdict_within_the_noise_names_a_slower_plan_slower() -> None:
    from planner.commands.printing import verdict_line

    line = verdict_line("DDP", "106.44 ms", "ddp 104.45 ms", (-0.036, -0.272, 0.105))
    assert line == ("verdict: keep DDP: the plan's 106.44 ms against ddp 104.45 ms: 3.6% slower [-10.5%, 27.2%], "
                    "within the noise")
    assert "faster [" in verdict_line("DDP", "a", "ddp b", (0.05, -0.01, 0.1))
    assert verdict_line("DDP", "a", "ddp b", (-0.05, -0.1, -0.01)).endswith("by 5.0% [1.0%, 10.0%], beyond the noise")


# -- the profile: a summary, and all of it on demand -----------------------------------------------------------------
def test_show_prints_a_profiles_summary_and_its_details_on_demand(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from planner.contracts.profile import Calibration, InSitu

    prof = with_samples(measured_profile("mlp"))
    prof = replace(prof, in_situ=InSitu(pack=Calibration.of_samples([0.011, 0.012, 0.010, 0.011] * 4, 0.01),
                                        decode=Calibration.of_samples([0.001, 0.0012, 0.0009] * 4, 0.01)))
    path = tmp_path / "prof.json"
    prof.save(path)
    assert main(["show", str(path)]) == 0
    captured = capsys.readouterr()
    summary = captured.out.splitlines()
    assert len(summary) <= 8, summary
    text = "\n".join(summary)
    for part in ("measured on world size 2", "no emulated link", "step ", "interval", "4 layers",
                 "one allreduce of all", "compute,", "communication where nothing overlaps", "sigma", "kappa",
                 "in-situ calibration: 1 of 2 used; not used", "decoding (0.10x)"):
        assert part in text, part
    assert "collectives: alpha + beta" not in text and "was not used (" not in captured.err
    assert main(["show", str(path), "--details"]) == 0
    details = capsys.readouterr().out
    assert details.startswith(captured.out.splitlines()[0]) and text.splitlines()[-1] in details
    for part in ("collectives: alpha + beta", "packing a dense group", "decoding in real steps was not used (",
                 "compute while communicating: the backward pass"):
        assert part in details, part
    assert main(["show", str(ROOT / "plans" / "mlp-2w-kfac.json"), "--details"]) == 2
    assert "--details applies to a profile" in capsys.readouterr().err


def test_profile_prints_its_summary_where_it_wrote_and_what_to_run_next(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """`planner profile` without measuring: the summary, where it wrote the profile and the next command; with
    --verbose, the details too."""
    import planner.sessions.profile as profile_module

    prof = with_samples(measured_profile("mlp"))
    monkeypatch.setattr(profile_module, "run_profile", lambda config: prof)
    out_path = tmp_path / "p.json"
    assert main(["profile", "--model", "mlp", "-o", str(out_path)]) == 0
    out = capsys.readouterr().out
    assert f"wrote profile {out_path} (all it measured: planner show {out_path} --details)" in out
    assert out.rstrip().endswith(f"next: planner solve {out_path} -o plan.json")
    assert "collectives: alpha + beta" not in out and len(out.splitlines()) <= 10
    assert main(["profile", "--model", "mlp", "--verbose", "-o", str(out_path)]) == 0
    verbose = capsys.readouterr().out
    assert "collectives: alpha + beta" in verbose and "planner show" not in verbose


def test_profile_compressors_narrows_what_it_times_to_what_their_plans_can_send(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`planner profile --compressors LIST`: the profile measures their PowerSGD ranks and top-k densities and is
    given their scope (top-k timed only where a plan over them within the default budget could send it, as the demo's
    profile); the next command solves over those it timed. Beside --only comm or --kfac it is refused in one line."""
    import planner.sessions.profile as profile_module
    from planner.contracts.profile import TopkLeftOut
    from planner.sessions.profile import PlanScope

    configs = []
    topk = Compressor.parse("topk:0.05")
    left_out = TopkLeftOut(compressors=(topk,), budget=Compressor.parse("fp16"))
    prof = replace(with_samples(measured_profile("mlp")), topk=None, topk_left_out=left_out)
    monkeypatch.setattr(profile_module, "run_profile", lambda config: configs.append(config) or prof)
    out_path = tmp_path / "p.json"
    assert main(["profile", "--model", "mlp", "--quick", "--compressors", "dense,fp16,powersgd:2,topk:0.05",
                 "-o", str(out_path)]) == 0
    out = capsys.readouterr().out
    config = configs[-1]
    assert config.scope == PlanScope(compressors=parse_compressors("dense,fp16,powersgd:2,topk:0.05"),
                                     budget=Compressor.parse("fp16"))
    assert 2 in config.powersgd_ranks and 4 in config.powersgd_ranks and 0.05 in config.densities
    assert "top-k not timed" in out
    assert out.rstrip().endswith(f"next: planner solve {out_path} --compressors dense,fp16,powersgd:2 -o plan.json")
    assert main(["profile", "--model", "mlp", "-o", str(out_path)]) == 0
    assert configs[-1].scope is None  # without it, everything is timed
    capsys.readouterr()
    for extra in (["--only", "comm"], ["--kfac"]):
        assert main(["profile", "--model", "mlp", "--compressors", "light", *extra, "-o", str(out_path)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "drop --compressors" in err
    assert main(["profile", "--model", "mlp", "--compressors", "dense,zstd", "-o", str(out_path)]) == 2
    assert "--compressors" in capsys.readouterr().err
