"""Plan and profile documents: round trips, validation, and the one-line errors of the CLI."""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from planner.commands.cli import main
from planner.contracts.fingerprint import model_info
from planner.contracts.jsonio import write_json_atomic
from planner.contracts.plan import Plan
from planner.contracts.profile import Profile
from planner.models import build_workload
from planner.types import InvalidProfileError, PlanMismatchError, PlannerFileError, SchemaError, Strategy
from tests.factories import synthetic_plan, synthetic_profile


def test_profile_round_trip(tmp_path: Path) -> None:
    prof = synthetic_profile("mlp")
    path = tmp_path / "p.json"
    prof.save(path)
    again = Profile.load(path)
    assert again == prof


@pytest.mark.parametrize(("strategy", "density"), [(Strategy.DENSE, None), (Strategy.TOPK, 0.01)])
def test_plan_round_trip(tmp_path: Path, strategy: Strategy, density: float | None) -> None:
    plan = synthetic_plan("mlp", strategy=strategy, density=density)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    assert sorted(plan.param_order) == sorted(n for n, _ in build_workload("mlp").module.named_parameters())


def test_plan_predictions_are_consistent() -> None:
    plan = synthetic_plan("resnet18")
    assert plan.lower_bound_s <= plan.predicted.iteration_s + 1e-12
    for name, pred in plan.baselines.items():
        assert plan.predicted.iteration_s <= pred.iteration_s + 1e-12, name


def test_write_is_atomic_and_leaves_no_temporaries(tmp_path: Path) -> None:
    plan = synthetic_plan("mlp")
    path = tmp_path / "sub" / "plan.json"
    plan.save(path)
    plan.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["plan.json"]


def test_plan_refuses_other_model_and_world_size() -> None:
    plan = synthetic_plan("mlp")
    other = model_info(build_workload("bert-tiny").module, "bert-tiny")
    with pytest.raises(PlanMismatchError, match=r"made for model mlp.*bert-tiny.*planner solve"):
        plan.check_compatible(other, 2)
    same = model_info(build_workload("mlp").module, "mlp")
    with pytest.raises(PlanMismatchError, match=r"world size 2.*world size 4.*planner retune.*auto_retune=True"):
        plan.check_compatible(same, 4)
    with pytest.raises(PlanMismatchError, match=r"backend gloo, but the process group uses nccl"):
        plan.check_compatible(same, 2, backend="nccl")
    with pytest.raises(PlanMismatchError, match=r"made for cpu .* on a gpu"):
        plan.check_compatible(same, 2, device_kind="gpu")
    plan.check_compatible(same, 2, backend="gloo", device_kind="cpu")


def test_a_plan_records_its_profiles_batch_and_the_step_bench_runs_it(tmp_path: Path) -> None:
    from planner.commands.bench_cli import _batch_size

    plan = synthetic_plan("mlp")
    assert plan.batch_size == synthetic_profile("mlp").batch_size
    doc = plan.to_dict()
    assert doc["source"]["batch_size"] == plan.batch_size
    del doc["source"]["batch_size"]  # a plan written before the batch was recorded
    assert Plan.from_dict(doc).batch_size is None
    doc["source"]["batch_size"] = 0
    with pytest.raises(SchemaError, match=r"plan\.source\.batch_size"):
        Plan.from_dict(doc)
    older = replace(plan, batch_size=None)
    assert _batch_size(None, (plan, older)) == plan.batch_size
    assert _batch_size(None, (older,)) is None  # the model's default
    assert _batch_size(3, (plan,)) == 3
    other = replace(plan, batch_size=2 * (plan.batch_size or 1))
    other_path, plan_path = tmp_path / "other.json", tmp_path / "plan.json"
    other.save(other_path)
    plan.save(plan_path)
    proc = _main("bench", "--plan", str(plan_path), "--plan", str(other_path))
    _one_clear_line(proc, "the plans were profiled at different batch sizes")


def _mutated(tmp_path: Path, doc: dict, name: str) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_loaders_reject_bad_documents(tmp_path: Path) -> None:
    plan_doc = synthetic_plan("mlp").to_dict()
    prof_doc = synthetic_profile("mlp").to_dict()
    with pytest.raises(PlannerFileError, match="not found"):
        Plan.load(tmp_path / "missing.json")
    trunc = tmp_path / "trunc.json"
    trunc.write_text(json.dumps(plan_doc)[:200])
    with pytest.raises(SchemaError, match=r"not valid JSON.*truncated"):
        Plan.load(trunc)
    with pytest.raises(SchemaError, match="schema_version 99"):
        Plan.load(_mutated(tmp_path, {**plan_doc, "schema_version": 99}, "v.json"))
    with pytest.raises(SchemaError, match=r"unknown field\(s\) \['surprise'\]"):
        Plan.load(_mutated(tmp_path, {**plan_doc, "surprise": 1}, "u.json"))
    bad_layers = [dict(prof_doc["layers"][0], backward_s=-1.0), *prof_doc["layers"][1:]]
    with pytest.raises(InvalidProfileError, match=r"layers\[0\]\.backward_s must be a time between 0 and"):
        Profile.load(_mutated(tmp_path, {**prof_doc, "layers": bad_layers}, "neg.json"))
    nan = tmp_path / "nan.json"
    nan.write_text(json.dumps(prof_doc).replace('"update_s": 0.001', '"update_s": NaN'))
    with pytest.raises(SchemaError, match="NaN"):
        Profile.load(nan)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "planner", *args], capture_output=True, text=True, timeout=120)


def _main(*args: str) -> subprocess.CompletedProcess[str]:
    """`planner ARGS` run in this process, its exit status and what it printed as `_cli` returns them: for bad input
    refused before any worker starts, without starting an interpreter (and importing torch) for each."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as stop:  # argparse's own refusals
            code = stop.code if isinstance(stop.code, int) else 1
    return subprocess.CompletedProcess(["planner", *args], code, out.getvalue(), err.getvalue())


def _one_clear_line(proc: subprocess.CompletedProcess[str], pattern: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert pattern in lines[0], lines[0]


def test_cli_bad_inputs_give_one_line(tmp_path: Path) -> None:
    prof = synthetic_profile("mlp")
    good = tmp_path / "good.json"
    prof.save(good)
    doc = prof.to_dict()
    trunc = tmp_path / "trunc.json"
    trunc.write_text(good.read_text()[:300])
    neg = _mutated(tmp_path, {**doc, "forward_s": -0.5}, "neg.json")
    nan = tmp_path / "nan.json"
    nan.write_text(good.read_text().replace('"update_s": 0.001', '"update_s": NaN'))
    version = _mutated(tmp_path, {**doc, "schema_version": 7}, "ver.json")
    out = str(tmp_path / "plan.json")
    _one_clear_line(_main("solve", str(tmp_path / "nope.json"), "-o", out), "profile file not found")
    _one_clear_line(_main("solve", str(trunc), "-o", out), "not valid JSON")
    _one_clear_line(_main("solve", str(neg), "-o", out), "forward_s must be a time between 0 and")
    _one_clear_line(_main("solve", str(nan), "-o", out), "NaN")
    _one_clear_line(_main("solve", str(version), "-o", out), "unknown profile schema_version 7")
    _one_clear_line(_main("show", str(trunc)), "not valid JSON")
    assert not Path(out).exists()


def test_outputs_that_are_not_regular_files_are_refused_and_left_alone(tmp_path: Path) -> None:
    """A rename would replace a directory entry of any kind (it once turned /dev/full into a plan file): targets
    that exist and are not regular files, paths under a file, names too long and unwritable places get one
    line, exit 2, and stay as they were; nothing temporary is left behind."""
    good = tmp_path / "good.json"
    synthetic_profile("mlp").save(good)
    folder = tmp_path / "folder"
    folder.mkdir()
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    regular = tmp_path / "regular.txt"
    regular.write_text("keep me\n")
    cases = [
        (str(folder), "exists and is not a regular file"),
        (str(fifo), "exists and is not a regular file"),
        (str(regular / "plan.json"), "regular.txt is not a folder"),
        (str(tmp_path / ("x" * 300)), "File name too long"),
    ]
    for target, message in cases:
        _one_clear_line(_main("solve", str(good), "--strategy", "dense", "-o", target), message)
    assert folder.is_dir() and not any(folder.iterdir())
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and regular.read_text() == "keep me\n"
    _one_clear_line(_main("report", str(tmp_path / "nope.json"), "-o", str(regular)), "is not a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "good.json", "pipe", "regular.txt"]
    with pytest.raises(PlannerFileError, match="path is empty"):
        write_json_atomic("", {})
    with pytest.raises(PlannerFileError, match=r"the plan .* is not a folder"):
        write_json_atomic(regular / "x.json", {}, "plan")


def test_cli_solve_and_show(tmp_path: Path) -> None:
    prof_path = tmp_path / "prof.json"
    synthetic_profile("resnet18").save(prof_path)
    plan_path = tmp_path / "plan.json"
    assert main(["solve", str(prof_path), "--strategy", "topk", "--density", "0.01", "-o", str(plan_path)]) == 0
    plan = Plan.load(plan_path)
    assert plan.strategy is Strategy.TOPK and plan.density == 0.01
    assert all(g.k is not None and g.k >= 1 for g in plan.groups)
    proc = _main("show", str(plan_path), "--groups")
    assert proc.returncode == 0, proc.stderr
    for name in ("plan (topk-exact)", "wfbp", "ddp+topk:0.01", "horovod", "fixed-64mb", "mgs-greedy", "lower bound"):
        assert name in proc.stdout
    # DDP's row names what it sends (DDP with the top-k hook here), and the table ends with the verdict against it.
    assert "ddp-25mb" not in proc.stdout and "vs ddp+topk:0.01" in proc.stdout
    assert sum(line.startswith("verdict: keep ") for line in proc.stdout.splitlines()) == 1
    proc = _main("show", str(prof_path))
    assert proc.returncode == 0 and "allreduce" in proc.stdout


def test_cli_bench_refuses_wrong_world_size(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    synthetic_plan("mlp", world_size=4).save(path)
    _one_clear_line(_main("bench", "--plan", str(path), "--nproc", "2"), "made for world size 4")


def test_cli_usage_errors_exit_nonzero(tmp_path: Path) -> None:
    proc = _main("solve", "x.json", "--strategy", "topk", "--density", "2", "-o", str(tmp_path / "p.json"))
    assert proc.returncode == 2 and "0 < density <= 1" in proc.stderr


def test_cli_bench_refuses_plan_for_another_model(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    synthetic_plan("mlp").save(path)
    proc = _cli("bench", "--plan", str(path), "--model", "bert-tiny", "--steps", "1", "--warmup", "0")
    _one_clear_line(proc, "this plan was made for model mlp")
    assert "planner solve" in proc.stderr


def test_the_whole_step_cross_check_round_trips_and_warns_past_ten_percent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dataclasses import replace

    profile = synthetic_profile()
    assert profile.step_s is None and profile.parts_error is None  # not timed: no check, nothing printed
    parts = profile.forward_s + sum(lt.backward_s for lt in profile.layers) + profile.update_s
    assert profile.parts_s == pytest.approx(parts)
    close, far = replace(profile, step_s=parts * 1.05), replace(profile, step_s=parts * 1.5)
    assert close.parts_error == pytest.approx(0.05 / 1.05)
    for p in (close, far):
        p.save(tmp_path / "p.json")
        assert Profile.load(tmp_path / "p.json") == p
        assert main(["show", str(tmp_path / "p.json"), "--details"]) == 0
    out = capsys.readouterr()
    assert out.err.count("warning: whole local steps") == 1 and "off by 33.3%" in out.err
    assert "off by 4.8%" in out.out
    assert main(["show", str(tmp_path / "p.json")]) == 0  # the summary: the warning alone
    out = capsys.readouterr()
    assert out.err.count("warning: whole local steps") == 1 and "off by" not in out.out
    # A profile written before the check existed has no step_s and still loads.
    doc = json.loads((tmp_path / "p.json").read_text())
    del doc["step_s"]
    (tmp_path / "old.json").write_text(json.dumps(doc))
    assert Profile.load(tmp_path / "old.json").step_s is None


def test_parts_scaled_to_the_whole_round_trip_print_their_scale_and_warn_past_ten_percent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dataclasses import replace

    profile = synthetic_profile()
    scaled = replace(profile, step_s=profile.parts_s, parts_scale=0.95)
    far = replace(profile, step_s=profile.parts_s, parts_scale=0.8)
    for p in (scaled, far):
        p.save(tmp_path / "p.json")
        assert Profile.load(tmp_path / "p.json") == p
        assert main(["show", str(tmp_path / "p.json"), "--details"]) == 0
    out = capsys.readouterr()
    assert "scaled by 0.950 to match" in out.out
    assert out.err.count("warning: whole local steps") == 1 and "scaled by 0.800" in out.err
    for bad in (0, -1.0, "1", True):
        doc = {**scaled.to_dict(), "parts_scale": bad}
        (tmp_path / "bad.json").write_text(json.dumps(doc))
        proc = _main("show", str(tmp_path / "bad.json"))
        _one_clear_line(proc, "parts_scale")


def _layer(doc: dict, index: int, **fields: object) -> dict:
    layers = [dict(layer) for layer in doc["layers"]]
    layers[index].update(fields)
    return {**doc, "layers": layers}


_PROFILE = synthetic_profile("mlp").to_dict()
_PLAN = synthetic_plan("mlp").to_dict()
_TOPK_PLAN = synthetic_plan("mlp", strategy=Strategy.TOPK, density=0.01).to_dict()


@pytest.mark.parametrize(("doc", "message"), [
    (_layer(_PROFILE, 0, numel=2**60), r"profile.layers\[0\].numel must be an integer between 1 and"),
    (_layer(_PROFILE, 0, numel=0), r"profile.layers\[0\].numel must be an integer between 1 and"),
    (_layer(_PROFILE, 1, backward_s=1e308), r"profile.layers\[1\].backward_s must be a time between 0 and 1e\+06"),
    ({**_PROFILE, "forward_s": 1e300}, r"profile.forward_s must be a time between"),
    ({**_PROFILE, "batch_size": 0}, r"profile.batch_size must be an integer between 1 and"),
    ({**_PROFILE, "batch_size": -3}, r"profile.batch_size must be an integer between 1 and"),
    ({**_PROFILE, "element_bytes": 0}, r"profile.element_bytes must be 1, 2, 4 or 8"),
    (_layer(_PROFILE, 0, params=[]), r"profile.layers\[0\].params is empty"),
    (_layer(_PROFILE, 2, name=_PROFILE["layers"][0]["name"]),
     r"profile.layers\[2\].name '6' repeats profile.layers\[0\]"),
    (_layer(_PROFILE, 1, params=_PROFILE["layers"][0]["params"][:1]),
     r"profile.layers\[1\] lists parameter '6.weight' of profile.layers\[0\]"),
])
def test_profiles_with_fields_out_of_bounds_are_refused_naming_the_field(doc: dict, message: str) -> None:
    with pytest.raises(InvalidProfileError, match=message):
        Profile.from_dict(doc)


def _groups(doc: dict, groups: list[dict]) -> dict:
    return {**doc, "groups": groups}


@pytest.mark.parametrize(("doc", "message"), [
    ({**_PLAN, "density": 5}, "only a top-k plan has a density, but this dense plan has density=5"),
    ({**_TOPK_PLAN, "density": 5}, r"a top-k plan needs `0 < density <= 1`"),
    (_groups(_PLAN, _PLAN["groups"][1:]), "the groups hold .* parameter tensors .* but the model mlp has"),
    (_groups(_PLAN, [*_PLAN["groups"], _PLAN["groups"][0]]), r"appear in more than one group"),
    (_groups(_PLAN, [dict(_PLAN["groups"][0], numel=10**20), *_PLAN["groups"][1:]]),
     r"plan.groups\[0\].numel must be an integer between 1 and"),
    ({**_PLAN, "cluster": {**_PLAN["cluster"], "world_size": 2**200}}, r"plan.cluster.world_size must be an integer"),
    ({**_PLAN, "cluster": {**_PLAN["cluster"], "host_count": 3}},
     r"plan.cluster.host_count must be an integer between 1 and 2"),
    ({**_PLAN, "model": {**_PLAN["model"], "numel": -1}}, r"plan.model.numel must be an integer between 1 and"),
])
def test_plans_that_contradict_themselves_are_refused(doc: dict, message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        Plan.from_dict(doc)


def test_json_no_document_can_be_is_refused_in_the_projects_error(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Deep nesting and huge integers raise SchemaError (not RecursionError / ValueError), and a file larger than
    any plan or profile is refused before it is read."""
    from planner.contracts import jsonio

    nested = tmp_path / "nested.json"
    nested.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(SchemaError, match="nests arrays or objects too deeply"):
        Plan.load(nested)
    deep_object = tmp_path / "deep.json"
    deep_object.write_text('{"a":' * 50_000 + "1" + "}" * 50_000)
    with pytest.raises(SchemaError, match="nests arrays or objects too deeply"):
        Profile.load(deep_object)
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps(_PROFILE).replace('"batch_size": 64', '"batch_size": ' + "9" * 4400))
    assert "9" * 4400 in huge.read_text()
    with pytest.raises(SchemaError, match="an integer of 4400 digits"):
        Profile.load(huge)
    big = tmp_path / "big.json"
    big.write_text(json.dumps(_PLAN))
    monkeypatch.setattr(jsonio, "MAX_DOCUMENT_BYTES", big.stat().st_size - 1)
    reads: list[Path] = []
    read_text = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: reads.append(self) or read_text(self, *a, **k))
    with pytest.raises(PlannerFileError, match="no plan is over"):
        Plan.load(big)
    assert reads == []


def test_cli_bad_numbers_clusters_and_options_give_one_line(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Each in process: exit 2, one line on stderr naming the cause, no progress line first, nothing written."""
    prof = tmp_path / "prof.json"
    Profile.from_dict(_PROFILE).save(prof)
    no_kfac = tmp_path / "no-kfac.json"
    Profile.from_dict({**_PROFILE, "kfac": None}).save(no_kfac)
    out = tmp_path / "out.json"
    huge = _mutated(tmp_path, _layer(_PROFILE, 1, backward_s=1e308), "huge.json")
    dense5 = _mutated(tmp_path, {**_PLAN, "density": 5}, "dense5.json")
    skipping = _mutated(tmp_path, _groups(_PLAN, _PLAN["groups"][1:]), "skip.json")
    folder = tmp_path / "study-folder"
    folder.mkdir()
    not_sqlite = tmp_path / "study.db"
    not_sqlite.write_text("not a database\n")
    cases = [
        (["solve", str(huge), "-o", str(out)], "backward_s must be a time between 0 and 1e+06"),
        (["show", str(dense5)], "only a top-k plan has a density"),
        (["bench", "--plan", str(skipping)], "every trainable parameter must be in one group"),
        (["solve", str(prof), "--cluster", "ib100-64,compute_factor=1e308", "-o", str(out)],
         "1e-06 <= compute_factor <= 1e+06"),
        (["simulate", str(prof), "--cluster", f"ib100-64,nodes={10**30}"], "nodes * gpus_per_node <= 1048576"),
        (["simulate", str(prof), "--cluster", "ib100-64", "--world-sizes", "12"], "not a multiple of gpus_per_node"),
        (["simulate", str(no_kfac), "--strategy", "kfac"], "no K-FAC measurements"),
        (["tune", str(prof), "--study", str(folder), "-o", str(out)], "exists and is not a regular file"),
        (["tune", str(prof), "--study", str(not_sqlite), "-o", str(out)], "is not a SQLite database"),
        (["show", str(tmp_path / "[/bold]missing[red].json")], "[/bold]missing[red].json"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and message in lines[0], (argv, err)
    assert not out.exists() and not any(folder.iterdir()) and not_sqlite.read_text() == "not a database\n"


def test_negative_warmups_are_usage_errors() -> None:
    for argv in (["profile", "--model", "mlp", "--warmup", "-1"], ["bench", "--plan", "x.json", "--warmup", "-1"],
                 ["tune", "x.json", "-o", "y.json", "--warmup", "-1"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2


def test_foreign_strings_print_as_they_are(capsys: pytest.CaptureFixture[str]) -> None:
    """gloo's messages hold "[/.../pair.cc:537]", which rich markup would take for a closing tag (MarkupError)."""
    from planner.console import console, err_console

    message = "Connection closed by peer [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] [bold]"
    console.print(message)
    err_console.print(message)
    captured = capsys.readouterr()
    assert message in captured.out.replace("\n", "") and message in captured.err.replace("\n", "")


# -- a profile is checked whole at load, before any solver runs ----------------------------------------------------
@pytest.mark.parametrize("scale", [1e5, 101.0, 1e-320, 0.001])
def test_a_parts_scale_outside_its_range_is_refused_naming_it(tmp_path: Path, scale: float) -> None:
    """parts_scale scales every layer's time: "a time" of up to 1e6 let 1e-320 through, whose reciprocal is inf."""
    doc = {**synthetic_profile("mlp").to_dict(), "parts_scale": scale}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(InvalidProfileError, match=r"`0\.01 <= profile\.parts_scale <= 100` must hold"):
        Profile.load(path)


def test_a_profile_built_in_code_has_its_slowdowns_bounded_as_one_loaded() -> None:
    """The load bounded sigma and kappa; a Profile made in code (a what-if, a resample) is held to the same."""
    from planner.types import Collective

    prof = synthetic_profile("mlp")
    for field in ("interference", "comm_stretch"):
        with pytest.raises(InvalidProfileError, match=rf"`0 <= profile\.{field}\.allreduce <= 100` must hold"):
            replace(prof, **{field: {Collective.ALLREDUCE: 1e308}})


def _with_extra_layers(count: int) -> dict[str, object]:
    """The mlp's profile with `count` layers that its model does not have."""
    doc = synthetic_profile("mlp").to_dict()
    template = doc["layers"][0]
    doc["layers"] += [{**template, "name": f"extra{i}", "params": [f"extra{i}.weight"]} for i in range(count)]
    return doc


def test_a_profile_whose_layers_are_not_its_model_is_refused_at_load(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_with_extra_layers(1)))
    with pytest.raises(InvalidProfileError, match=r"profile\.layers hold 9 parameter tensors .* but profile\.model "
                                                  r"mlp has 8 .* profile it again"):
        Profile.load(path)
    doc = synthetic_profile("mlp").to_dict()
    doc["layers"] = doc["layers"][1:]  # one layer (two tensors) missing
    doc.pop("steps", None)
    path.write_text(json.dumps(doc))
    with pytest.raises(InvalidProfileError, match=r"profile\.layers hold 6 parameter tensors"):
        Profile.load(path)


@pytest.mark.parametrize("strategy", ["dense", "topk", "mixed", "auto", "kfac"])
def test_solve_refuses_a_profile_that_does_not_match_its_model_before_solving(
        tmp_path: Path, strategy: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A 20,000-layer profile of an 8-tensor model was solved for 13 minutes and only then refused: now no solver
    starts (each is replaced by one that fails the test)."""
    import planner.strategies.auto as auto
    import planner.strategies.gradients as gradients
    import planner.strategies.kfac_plan as kfac
    import planner.strategies.mixed_plan as mixed

    def never(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a solver ran on a profile that does not describe its model")

    for module, name in ((gradients, "make_plan"), (mixed, "make_mixed_plan"), (auto, "solve_auto"),
                         (kfac, "make_kfac_plan")):
        monkeypatch.setattr(module, name, never)
    path, out = tmp_path / "p.json", tmp_path / "plan.json"
    path.write_text(json.dumps(_with_extra_layers(20_000)))
    assert main(["solve", str(path), "--strategy", strategy, "-o", str(out)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "profile.layers hold 20,008 parameter tensors" in err[0], err
    assert not out.exists()


@pytest.mark.parametrize(("field", "value"), [("forward_s", 1e-300), ("whole_s", 1e6)])
def test_step_samples_that_would_scale_a_time_beyond_bounds_are_refused(tmp_path: Path, field: str,
                                                                       value: float) -> None:
    """A resampled profile scales a draw's parts by median whole / summed parts: with parts summing to 1e-300 s
    every time became about 1e297 times larger, then inf."""
    from tests.factories import with_samples

    doc = with_samples(synthetic_profile("mlp")).to_dict()
    steps = doc["steps"]
    if field == "forward_s":
        steps["update_s"] = [0.0] * len(steps["update_s"])
        steps["backward_s"] = [[0.0] * len(row) for row in steps["backward_s"]]
    steps[field] = [value] * len(steps[field])
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(InvalidProfileError, match=r"profile\.steps: the whole steps .* must agree within 100x"):
        Profile.load(path)


@pytest.mark.parametrize("field", ["forward_s", "update_s"])
def test_a_part_far_from_the_median_of_its_steps_is_refused(tmp_path: Path, field: str) -> None:
    """A resample multiplies F by a draw's F over the profile's: F = 5e-324 beside steps of a millisecond made that
    inf, and solve --strategy kfac met a NaN."""
    from tests.factories import with_samples

    doc = with_samples(synthetic_profile("mlp")).to_dict()
    doc[field] = 5e-324
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(InvalidProfileError, match=rf"profile\.{field} \(4\.94066e-324 s\) is not the median of "
                                                  r"profile\.steps .* within 100x"):
        Profile.load(path)
