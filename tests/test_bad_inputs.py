"""The last bad inputs and faults a new user met with a traceback: each is now one line naming the cause and
what to do, exit 2, and nothing written. Through the real CLI (`python -m planner ...`) where workers start."""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from planner.commands.cli import main
from planner.models import Workload
from planner.types import SchemaError
from tests.factories import synthetic_plan, synthetic_profile

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "planner", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, **(env or {})})


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


#: A progress bar's last state, as a bench leaves it on a stream that is not a terminal.
_PROGRESS = re.compile(r"(K-FAC )?bench steps\b.* \d+/\d+ \d+:\d\d:\d\d")


def _errors(text: str) -> list[str]:
    """The lines a failed run printed besides its progress bars ("bench steps  3/280 0:00:00")."""
    return [ln for ln in _lines(text) if not _PROGRESS.fullmatch(ln.strip())]


def _in_process(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2, argv
    err = _lines(capsys.readouterr().err)
    assert len(err) == 1 and message in err[0], (argv, err)
    assert "Traceback" not in err[0]


# -- documents -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [0, -1024])
def test_a_collective_measured_at_no_bytes_is_refused(tmp_path: Path, size: int,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A size of 0 divided the solver's interpolation (ZeroDivisionError); a negative one was planned with."""
    doc = synthetic_profile("mlp").to_dict()
    doc["collectives"]["allreduce"]["points"][0][0] = size
    prof, out = tmp_path / "prof.json", tmp_path / "plan.json"
    prof.write_text(json.dumps(doc))
    for strategy in ("dense", "topk"):
        _in_process(["solve", str(prof), "--strategy", strategy, "-o", str(out)],
                    "collectives.allreduce.points[0][0] (size) must be an integer between 1 and", capsys)
    assert not out.exists()


def test_a_plan_predicting_a_step_of_no_time_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`show` divided by it (ZeroDivisionError)."""
    for where in ("plan", "baselines"):
        doc = synthetic_plan("mlp").to_dict()
        if where == "plan":
            doc["predicted"]["plan"]["iteration_s"] = 0
        else:
            doc["predicted"]["baselines"]["wfbp"]["iteration_s"] = 0.0
        path = tmp_path / f"{where}.json"
        path.write_text(json.dumps(doc))
        _in_process(["show", str(path)], "iteration_s must be a time above 0", capsys)


def test_names_longer_than_the_file_system_allows_are_one_line(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "prof.json"
    synthetic_profile("mlp").save(prof)
    long_name = str(tmp_path / ("a" * 300 + ".json"))
    _in_process(["solve", long_name, "-o", str(tmp_path / "plan.json")], "File name too long", capsys)
    _in_process(["show", long_name], "File name too long", capsys)
    digits = "9" * 400
    for cluster, message in [(f"ib100-64,nodes={digits}", "nodes * gpus_per_node <= 1048576"),
                             (digits, "unknown cluster preset"), (f"ib100-{digits}", "unknown cluster preset")]:
        _in_process(["simulate", str(prof), "--cluster", cluster], message, capsys)
    assert not (tmp_path / "plan.json").exists()


def test_report_reads_bench_results_with_the_loaders_guards(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Nesting (RecursionError), a 4,400-digit integer (ValueError) and a FIFO (waited on forever)."""
    prof, plan = tmp_path / "prof.json", tmp_path / "plan.json"
    synthetic_profile("mlp").save(prof)
    synthetic_plan("mlp").save(plan)
    nested, huge, fifo = tmp_path / "nested.json", tmp_path / "huge.json", tmp_path / "fifo"
    nested.write_text("[" * 100_000 + "]" * 100_000)
    huge.write_text('[{"median_s": ' + "9" * 4400 + "}]")
    os.mkfifo(fifo)
    out = tmp_path / "report"
    for bench, message in [(nested, "nests arrays or objects too deeply"), (huge, "an integer of 4400 digits"),
                           (fifo, "is not a regular file")]:
        _in_process(["report", str(plan), "--profile", str(prof), "--no-scaling", "--bench", str(bench),
                     "-o", str(out)], message, capsys)
    assert not out.exists()


def test_the_runtime_loads_plans_with_the_guards_of_the_cli(tmp_path: Path) -> None:
    from planner.models import build_workload
    from planner.runtime.exchange import GradientExchange

    text = json.dumps(synthetic_plan("mlp").to_dict())
    assert '"num_groups": 3' in text
    path = tmp_path / "huge.json"
    path.write_text(text.replace('"num_groups": 3', '"num_groups": ' + "9" * 4400, 1))
    with pytest.raises(SchemaError, match="an integer of 4400 digits"):
        GradientExchange.from_file(build_workload("mlp").module, path)


def test_demo_with_an_unknown_model_is_one_line_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    _in_process(["demo", "--model", "resnet19", "--link", "none"], "did you mean 'resnet18'?", capsys)


# -- a user's model ------------------------------------------------------------------------------------------------
def _batch(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 8, generator=generator), torch.randint(0, 4, (n,), generator=generator)


def _loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, targets)


def no_parameters() -> Workload:
    return Workload(name="relu", module=nn.ReLU(), batch_size=4, make_batch=_batch, loss_fn=_loss)


def wrong_input_width() -> Workload:
    return Workload(name="wide", module=nn.Linear(16, 4), batch_size=4, make_batch=_batch, loss_fn=_loss)


def _pairs(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 8, generator=generator), torch.randint(0, 4, (n, 2), generator=generator)


def wrong_targets() -> Workload:
    return Workload(name="pairs", module=nn.Linear(8, 4), batch_size=4, make_batch=_pairs, loss_fn=_loss)


class _FailsInWorkers(nn.Module):
    """Trains alone; in a process group, rank 1 dies (SIGKILL, as the OOM killer sends) or raises at its
    third forward, as PLANNER_TEST_FAULT says."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        fault = os.environ.get("PLANNER_TEST_FAULT")
        if fault and dist.is_initialized() and dist.get_rank() == 1 and self.calls >= 3:
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("boom from the user's forward")
        return self.fc(x)


def fails_in_workers() -> Workload:
    return Workload(name="faulty", module=_FailsInWorkers(), batch_size=4, make_batch=_batch, loss_fn=_loss)


@pytest.mark.parametrize(("factory", "message"), [
    ("no_parameters", "the module has no trainable parameters"),
    ("wrong_input_width", "the forward pass on make_batch's inputs of shape 2x8 raised RuntimeError: mat1 and mat2"),
    ("wrong_targets", "loss_fn(output of shape 2x4, targets of shape 2x2) raised RuntimeError"),
])
def test_a_user_model_that_cannot_train_is_one_line_naming_the_call(
        tmp_path: Path, factory: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "prof.json"
    _in_process(["profile", "--model", f"tests.test_bad_inputs:{factory}", "-o", str(out)], message, capsys)
    assert not out.exists()


def test_a_trial_step_leaves_the_users_module_as_it_was() -> None:
    from planner.models import build_workload

    module = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4))
    before = copy.deepcopy(module.state_dict())
    factory = Workload(name="bn", module=module, batch_size=4, make_batch=_batch, loss_fn=_loss)
    sys.modules[__name__].__dict__["_bn_factory"] = lambda: factory
    try:
        assert build_workload(f"{__name__}:_bn_factory").module is module
    finally:
        del sys.modules[__name__].__dict__["_bn_factory"]
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert all(p.grad is None for p in module.parameters())


@pytest.fixture(scope="module")
def faulty_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("faulty") / "plan.json"
    synthetic_plan("tests.test_bad_inputs:fails_in_workers").save(path)
    return path


@pytest.fixture(scope="module")
def faulty_kfac_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.factories import synthetic_kfac_plan

    path = tmp_path_factory.mktemp("faulty") / "kfac.json"
    synthetic_kfac_plan("tests.test_bad_inputs:fails_in_workers", time_limit_s=0.5).save(path)
    return path


@pytest.mark.parametrize("strategy", ["gradients", "kfac"])
def test_a_worker_killed_during_bench_is_named_not_its_peers_broken_connection(
        strategy: str, request: pytest.FixtureRequest) -> None:
    """Every bench strategy starts its workers through the same launcher (`run_job`)."""
    plan = request.getfixturevalue("faulty_plan" if strategy == "gradients" else "faulty_kfac_plan")
    proc = _cli("bench", "--strategy", strategy, "--plan", str(plan), "--steps", "5", "--peers", "none",
                env={"PLANNER_TEST_FAULT": "kill"})
    err = _errors(proc.stderr)
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert "worker rank 1 was killed by SIGKILL" in err[0] and "out of memory" not in err[0]  # killed by hand
    assert "(during: " in err[0]  # the phase the worker was in
    assert "Traceback" not in proc.stderr and "Connection reset" not in proc.stderr


@pytest.mark.spawns  # the --verbose run's workers must see PLANNER_TEST_FAULT, and die as spawned ones do
def test_a_worker_error_from_the_users_model_is_one_line_and_verbose_shows_its_traceback(
        faulty_plan: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    args = ("bench", "--plan", str(faulty_plan), "--steps", "5", "--peers", "none")
    proc = _cli(*args, env={"PLANNER_TEST_FAULT": "raise"})  # the real command: its whole stderr is the one line
    err = _errors(proc.stderr)
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert "worker rank 1 failed (during: bench steps): RuntimeError: boom from the user's forward (--verbose prints" \
        in err[0]  # and where it was
    # --verbose adds the worker's traceback: in this process (no interpreter to start), its workers spawned as the
    # command spawns them; the file descriptors are captured, so the workers' own output counts too
    monkeypatch.setenv("PLANNER_TEST_FAULT", "raise")
    capfd.readouterr()
    assert main(["--verbose", *args]) == 2
    verbose = capfd.readouterr().err
    assert "Traceback" in verbose and "in forward" in verbose


# -- sparse gradients ----------------------------------------------------------------------------------------------
class _Bag(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8, sparse=sparse)
        self.head = nn.Linear(8, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens).mean(dim=1))


def _tokens(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 50, (n, 6), generator=generator), torch.randint(0, 4, (n,), generator=generator)


def sparse_embedding() -> Workload:
    return Workload(name="bag", module=_Bag(sparse=True), batch_size=4, make_batch=_tokens, loss_fn=_loss)


def dense_embedding() -> Workload:
    return Workload(name="bag", module=_Bag(sparse=False), batch_size=4, make_batch=_tokens, loss_fn=_loss)


def test_sparse_gradients_are_refused_naming_the_parameter_and_the_fix(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The profile died with "Cannot access data pointer of Tensor that doesn't have storage", and a plan of the
    dense twin (same fingerprint) was accepted by the runtime, which then crashed."""
    from planner.runtime.exchange import GradientExchange
    from planner.types import PlannerError

    out = tmp_path / "prof.json"
    message = "parameter 'embed.weight' gets sparse gradients (Embedding(..., sparse=True))"
    _in_process(["profile", "--model", "tests.test_bad_inputs:sparse_embedding", "-o", str(out)], message, capsys)
    assert not out.exists()
    twin = synthetic_plan("tests.test_bad_inputs:dense_embedding")
    with pytest.raises(PlannerError, match="build the module with sparse=False"):
        GradientExchange(_Bag(sparse=True), twin)


# -- K-FAC: a layer called twice per step ---------------------------------------------------------------------------
class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.shared(torch.relu(self.shared(x)))))


def shared_layer() -> Workload:
    return Workload(name="twice", module=_Twice(), batch_size=4, make_batch=_batch, loss_fn=_loss)


def test_a_layer_called_twice_per_step_is_refused_at_profile_time_naming_kfac_skip() -> None:
    """It passed `profile --kfac` (the profiler kept the first call) and `solve`, and the runtime refused it."""
    from planner.models import build_workload
    from planner.profilers.kfac_costs import measure_kfac_layers
    from planner.types import InvalidProfileError

    workload = build_workload("tests.test_bad_inputs:shared_layer")
    with pytest.raises(InvalidProfileError, match=r"\['shared'\] run 2 times .* --kfac-skip '\^shared\$'"):
        measure_kfac_layers(workload, torch.device("cpu"), repeats=1, warmup=0)
    timings = measure_kfac_layers(workload, torch.device("cpu"), repeats=1, warmup=0, skip="^shared$")
    assert [t.name for t in timings] == ["head"]


# -- fuzz round 2026-11-29 -----------------------------------------------------------------------------------------
def test_a_density_of_many_decimal_digits_is_counted_and_refused_as_unmeasured(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """5e-324 is 5/10^324 as a decimal: the vectorised count divided an int64 array by that denominator
    (OverflowError out of `solve --density 5e-324` and `--compressors topk:5e-324`)."""
    import numpy as np

    from planner.costmodel.problem import topk_count, topk_count_many

    numel = np.array([1000, 2**40])
    assert topk_count_many(numel, 5e-324).tolist() == [1.0, 1.0]
    assert topk_count_many(numel, 0.07).tolist() == [70.0, float(topk_count(2**40, 0.07))]
    prof, out = tmp_path / "prof.json", tmp_path / "plan.json"
    synthetic_profile("mlp").save(prof)
    _in_process(["solve", str(prof), "--strategy", "topk", "--density", "5e-324", "-o", str(out)],
                "this profile measured top-k at densities 0.001 to 1, not at topk:5e-324", capsys)
    _in_process(["solve", str(prof), "--strategy", "auto", "--compressors", "dense,topk:5e-324", "-o", str(out)],
                "not at topk:5e-324", capsys)


@pytest.mark.parametrize("density", ["0.0005", "5e-324"])
def test_solve_writes_no_top_k_plan_whose_ddp_row_the_profile_cannot_predict(
        tmp_path: Path, density: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A density below the profile's measured ones was planned (top-k extrapolates), the plan written, and then the
    DDP top-k hook's row refused it: exit 2 with the plan on disk."""
    prof, out = tmp_path / "prof.json", tmp_path / "plan.json"
    synthetic_profile("mlp").save(prof)
    _in_process(["solve", str(prof), "--strategy", "topk", "--density", density, "-o", str(out)],
                "this profile measured top-k at densities 0.001 to 1, not at topk:", capsys)
    assert not out.exists()


def test_simulate_refuses_k_fac_intervals_that_do_not_divide_before_its_progress_bar(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--factor-update-steps 3 against the default --inv-update-steps 10 was refused from inside the first world
    size's solve: the progress bar's line, then the error."""
    prof = tmp_path / "prof.json"
    synthetic_profile("mlp").save(prof)
    _in_process(["simulate", str(prof), "--strategy", "kfac", "--world-sizes", "8,64", "--factor-update-steps", "3"],
                "--inv-update-steps must be a multiple of --factor-update-steps, but got 10 and 3", capsys)


@pytest.mark.parametrize(("extra", "message"), [
    (["--world-sizes", "0"], "`1 <= world_size <= 1048576` must hold, but got 0"),
    (["--world-sizes", "3,6"], "world size 3 is not a multiple of gpus_per_node=2"),
])
def test_report_refuses_bad_world_sizes_before_making_its_folder(
        tmp_path: Path, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    prof, plan = tmp_path / "prof.json", tmp_path / "plan.json"
    synthetic_profile("mlp").save(prof)
    synthetic_plan("mlp").save(plan)
    out = tmp_path / "report"
    _in_process(["report", str(plan), "--profile", str(prof), *extra, "-o", str(out)], message, capsys)
    assert not out.exists()


@pytest.mark.parametrize("name", ["", "  "])
def test_report_refuses_an_empty_folder_name(tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`-o ""` was the current folder (Path("") is "."): the report was written there."""
    prof, plan = tmp_path / "prof.json", tmp_path / "plan.json"
    synthetic_profile("mlp").save(prof)
    synthetic_plan("mlp").save(plan)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    _in_process(["report", str(plan), "--profile", str(prof), "--no-scaling", "-o", name],
                "the report folder path is empty", capsys)
    assert list(work.iterdir()) == []


def test_a_k_fac_plan_predicting_a_step_of_no_time_is_refused(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`show` divided kfac-pytorch's step by it (ZeroDivisionError)."""
    from tests.factories import synthetic_kfac_plan

    doc = synthetic_kfac_plan("mlp", time_limit_s=0.5).to_dict()
    predicted = doc["kfac"]["predicted"]
    for where in ["plan", *(f"baselines.{name}" for name in predicted["baselines"])]:
        bad = copy.deepcopy(doc)
        section = bad["kfac"]["predicted"]
        for part in where.split("."):
            section = section[part]
        section["step_s"] = 0.0
        path = tmp_path / "kfac.json"
        path.write_text(json.dumps(bad))
        _in_process(["show", str(path)], f"plan.kfac.predicted.{where}.step_s must be a time above 0", capsys)


def test_pair_refuses_a_plan_that_is_a_symlink_loop_in_one_line(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Comparing each plan's path with the output's (Path.resolve) raised RuntimeError("Symlink loop")."""
    plan, loop, out = tmp_path / "plan.json", tmp_path / "loop.json", tmp_path / "pairing.json"
    synthetic_plan("mlp").save(plan)
    loop.symlink_to(loop)
    _in_process(["pair", "--batch", "64", "-o", str(out), str(loop), str(plan)], f"plan file not found: {loop}", capsys)
    assert not out.exists()


@pytest.mark.parametrize(("name", "shown"), [("a\nb.json", "a\\nb.json"), ("a\r\u2028b.json", "a\\r\\u2028b.json"),
                                             ("\x1b[31mred.json", "\\x1b[31mred.json")])
def test_a_name_with_a_line_break_or_an_escape_stays_on_the_errors_one_line(
        tmp_path: Path, name: str, shown: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing file's name was printed as it is: a newline in it made the error two lines, an escape sequence
    reached the terminal."""
    _in_process(["show", str(tmp_path / name)], f"plan, profile or trials file not found: {tmp_path / shown} (check",
                capsys)


# -- issue 69: the new surface's bad inputs -------------------------------------------------------------------------
#: Compressor names `int` or `float` took apart or misread: signs, digits that are not ASCII, Python's own numbers.
_BAD_NAMES = ["powersgd:+-3", "powersgd:--4", "powersgd:²", "powersgd:+3", "topk:１", "topk:nan", "topk:1_0"]


@pytest.mark.parametrize("name", _BAD_NAMES)
def test_a_compressor_name_only_ascii_digits_write_is_one_line_wherever_it_is_read(
        tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`Compressor.parse` raised ValueError out of `int("+-3")`: a traceback from --error-budget, --compressors,
    --peers and every file naming a compressor; "topk:１" was read as top-k at density 1."""
    from planner.types import Compressor, CompressorError
    from tests.test_budget_plan import profile_with_errors
    from tests.test_trials import TOPK, trials_of

    with pytest.raises(CompressorError, match=re.escape(repr(name))):
        Compressor.parse(name)
    profile = profile_with_errors()
    prof, out = tmp_path / "prof.json", tmp_path / "plan.json"
    profile.save(prof)
    shown = f"{name!r}: {name.partition(':')[0]} needs a"
    _in_process(["solve", str(prof), "--strategy", "mixed", "--compressors", "all", f"--error-budget={name}", "-o",
                 str(out)], f"--error-budget takes a number >= 0 (the error itself) or a compressor whose error over "
                f"the whole gradient is the budget, such as powersgd:4; {shown}", capsys)
    _in_process(["solve", str(prof), "--strategy", "mixed", "--compressors", f"dense,{name}", "-o", str(out)],
                f"--compressors: {shown}", capsys)
    assert not out.exists()
    # in files: trials, a plan, a profile's errors record
    trials = trials_of(profile, {TOPK: (2.0, 1.8, 2.2)}).to_dict()
    trials["compressors"] = {name: trials["compressors"]["topk:0.01"]}
    (tmp_path / "trials.json").write_text(json.dumps(trials))
    _in_process(["show", str(tmp_path / "trials.json")], f"trials.compressors: {shown}", capsys)
    _in_process(["solve", str(prof), "--strategy", "auto", "--trials", str(tmp_path / "trials.json"), "-o", str(out)],
                f"trials.compressors: {shown}", capsys)
    assert main(["solve", str(prof), "--strategy", "mixed", "--compressors", "dense,powersgd:1", "-o", str(out)]) == 0
    capsys.readouterr()
    _in_process(["bench", "--plan", str(out), "--peers", name], shown, capsys)
    (tmp_path / "bad-plan.json").write_text(out.read_text().replace('"powersgd:1"', json.dumps(name)))
    _in_process(["show", str(tmp_path / "bad-plan.json")], f"plan.compressors[1]: {shown}", capsys)
    doc = profile.to_dict()
    doc["errors"]["compressors"][name] = doc["errors"]["compressors"].pop("powersgd:4")
    prof.write_text(json.dumps(doc))
    _in_process(["show", str(prof)], f"profile.errors.compressors[{name!r}]: {shown}", capsys)


def test_profile_refuses_powersgd_ranks_not_written_in_ascii_digits_before_any_worker_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`"²".isdigit()` is True and `int("²")` a ValueError: a traceback."""
    import planner.sessions.profile

    def no_workers(*args: object, **kwargs: object) -> None:
        raise AssertionError("the profile started")

    monkeypatch.setattr(planner.sessions.profile, "run_profile", no_workers)
    for ranks in ("²", "+-3", "1,²"):
        _in_process(["profile", "--quick", "--model", "mlp", "--nproc", "2", "--powersgd-ranks", ranks, "-o",
                     str(tmp_path / "p.json")], f"--powersgd-ranks must list whole numbers in 1..1024 (e.g. 1,2,4) or "
                    f"be none, but got {ranks!r}", capsys)
    assert not (tmp_path / "p.json").exists()


def test_a_trials_file_whose_ddp_curve_holds_a_null_is_refused_at_load(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """DDP's half-way loss, the samples' target, was read as null: an AssertionError from `show` and `solve`. DDP's
    run is the reference and its final loss is finite: it did not diverge, so a null in its curve is no trial's."""
    from tests.test_budget_plan import profile_with_errors
    from tests.test_trials import TOPK, trials_of, with_curves

    profile = profile_with_errors()
    prof, out = tmp_path / "prof.json", tmp_path / "plan.json"
    profile.save(prof)
    doc = with_curves(trials_of(profile, {TOPK: (2.0, 1.8, 2.2)}), {TOPK: (3000, 3000, 3500)}).to_dict()
    curve = doc["curves"]["ddp"][1]
    curve[len(curve) // 2][1] = None  # at 2000 of 4000 samples: DDP's half-way point
    path = tmp_path / "trials.json"
    path.write_text(json.dumps(doc))
    message = "trials.curves['ddp'][1] must hold a loss at every evaluation: DDP's run is the reference"
    _in_process(["show", str(path)], message, capsys)
    _in_process(["solve", str(prof), "--strategy", "auto", "--trials", str(path), "-o", str(out)], message, capsys)
    assert not out.exists()


def test_a_tiny_error_budget_gives_the_plan_that_fits_without_warnings(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """1e-17 cut into units asked for more than int64 holds: numpy's "invalid value encountered in cast", then an
    error naming no option. The budget is legitimate: only what has no error fits it, dense."""
    import warnings

    import numpy as np

    from planner.contracts.plan import Plan
    from planner.solvers.compressor_choice import ErrorBudget
    from tests.test_budget_plan import profile_with_errors

    prof, out = tmp_path / "prof.json", tmp_path / "plan.json"
    profile_with_errors().save(prof)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for budget in ("1e-17", "5e-324"):
            assert main(["solve", str(prof), "--strategy", "mixed", "--compressors", "all",
                         f"--error-budget={budget}", "-o", str(out)]) == 0
            captured = capsys.readouterr()
            assert "Warning" not in captured.out + captured.err and not captured.err.strip()
            plan = Plan.load(out)
            assert {str(plan.compressor_of(g)) for g in plan.groups} == {"dense"}
        # an error beyond the whole budget fits no plan whatever its units; the others are cut as before
        errors = np.array([[0.0, 0.0], [0.3, 1e308], [1e-18, 0.0]])
        tiny = ErrorBudget.of(errors, 1e-17, resolution=4)
        assert tiny.budget == 8 and tiny.units.tolist() == [[0, 0], [9, 9], [1, 0]]
        assert ErrorBudget.of(errors, 1.0, resolution=4).units.tolist() == [[0, 0], [3, 9], [1, 0]]


def test_squared_norms_no_measurement_reaches_are_refused_at_load_and_none_overflows(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every grad_sq 1e308 was accepted; the solve summed them to inf (numpy's overflow warnings), then failed with
    "errors must be finite and >= 0"."""
    import warnings

    import numpy as np

    from planner.contracts.errors import MAX_CONTRACTION, CompressionErrors
    from tests.test_budget_plan import profile_with_errors

    doc = profile_with_errors().to_dict()
    doc["errors"]["grad_sq"] = np.full(np.shape(doc["errors"]["grad_sq"]), 1e308).tolist()
    prof, out = tmp_path / "prof.json", tmp_path / "plan.json"
    prof.write_text(json.dumps(doc))
    message = "profile.errors.grad_sq must hold finite squared norms >= 0 and at most 1e+100"
    _in_process(["solve", str(prof), "--strategy", "mixed", "--compressors", "all", "--error-budget=powersgd:4",
                 "-o", str(out)], message, capsys)
    _in_process(["show", str(prof)], message, capsys)
    assert not out.exists()
    # within the bound, nothing overflows: a large error over a vanishing input is held at MAX_CONTRACTION
    grad = np.full((2, 2, 3), 1e100)
    record = CompressionErrors(layers=("a", "b"), warmup=1, grad_sq=grad, input_sq={"fp16": np.full_like(grad, 1e-300)},
                               error_sq={"fp16": grad.copy()})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert record.contraction("fp16").tolist() == [MAX_CONTRACTION, MAX_CONTRACTION]
        assert record.uniform("fp16") == pytest.approx(MAX_CONTRACTION)
        assert record.grad_spread() == pytest.approx([0.0, 0.0], abs=1e-12)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc, a folder nothing can be created in")
def test_an_output_path_no_file_can_be_created_in_is_refused_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`-o /proc/x` passed `check_output_path` (the folder exists): the profile measured, the trial trained, and
    only then the write failed. Root passes any permission check there, so it is tried (a file created, removed)."""
    import planner.sessions.profile
    import planner.sessions.trial
    from planner.contracts.jsonio import check_output_path
    from planner.types import PlannerFileError
    from tests.test_budget_plan import profile_with_errors

    def no_work(*args: object, **kwargs: object) -> None:
        raise AssertionError("the work started")

    monkeypatch.setattr(planner.sessions.profile, "run_profile", no_work)
    monkeypatch.setattr(planner.sessions.trial, "run_trials", no_work)
    prof = tmp_path / "prof.json"
    profile_with_errors().save(prof)
    for what, argv in (("profile", ["profile", "--quick", "--model", "mlp", "--nproc", "2"]),
                       ("trials file", ["trial", str(prof), "--compressors", "fp16"]),
                       ("plan", ["solve", str(prof)]),
                       ("plan", ["tune", str(prof)]),
                       ("pairing plan", ["pair", str(prof), "--batch", "64"])):
        _in_process([*argv, "-o", "/proc/x"], f"cannot write the {what} /proc/x: no file can be created in /proc (",
                    capsys)
    # a folder to create under one that cannot hold it; a folder that can: nothing left behind by the check
    with pytest.raises(PlannerFileError, match="no file can be created in /proc"):
        check_output_path("/proc/new/plan.json", "plan")
    assert check_output_path(tmp_path / "new" / "plan.json") == tmp_path / "new" / "plan.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prof.json"]


@pytest.mark.parametrize("case", ["one repeat", "identical losses", "reached at no samples", "quotients overflow"])
def test_odd_trials_files_print_no_warnings(tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A run that reached DDP's half-way loss at 0 samples (log 0) and losses whose quotient under- or overflows
    (1e-300 / 1e300) printed numpy's "divide by zero encountered in log" and "invalid value" from `show` and from
    `solve --trials`; one repeat (no degrees of freedom) and identical losses (no variance) print nothing either."""
    import warnings
    from dataclasses import replace

    from tests.test_budget_plan import profile_with_errors
    from tests.test_trials import TOPK, falling, trials_of, with_curves

    profile = profile_with_errors()
    match case:
        case "one repeat":
            trials = with_curves(trials_of(profile, {TOPK: (2.0,)}, reference=(2.0,)), {TOPK: (3000,)})
        case "identical losses":
            trials = with_curves(trials_of(profile, {TOPK: (2.0,) * 3}, reference=(2.0,) * 3), {TOPK: (2000,) * 3})
        case "reached at no samples":
            base = trials_of(profile, {TOPK: (2.0, 1.8, 2.2)})
            trials = replace(base, curves={"ddp": tuple(falling(2000, f) for f in base.reference),
                                           "topk:0.01": tuple(((0, 1.0), (4000, f)) for f in (2.0, 1.8, 2.2))})
        case _:
            trials = with_curves(trials_of(profile, {TOPK: (1e300, 1e-300, 1e300)}, reference=(1e-300, 1e300, 1e-300)),
                                 {TOPK: (2000,) * 3})
    prof, path, out = tmp_path / "prof.json", tmp_path / "trials.json", tmp_path / "plan.json"
    profile.save(prof)
    trials.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for argv in (["show", str(path)],
                     ["solve", str(prof), "--strategy", "auto", "--compressors", "all", "--trials", str(path), "-o",
                      str(out)]):
            assert main(argv) == 0, argv
            captured = capsys.readouterr()
            assert "Warning" not in captured.out + captured.err and not captured.err.strip(), argv
