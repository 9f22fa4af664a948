"""A plan inside PyTorch Lightning, Hugging Face Accelerate and a plain torchrun DDP script
(`planner.runtime.frameworks`; docs/snippets/train_{lightning,accelerate,ddp}.py, shown in docs/guide/frameworks.md):
each script, run under torchrun on 2 gloo processes, ends with the parameters of the same plan run by hand (DDP and
`PlanHook` in a plain loop, whose buckets are checked to be the plan's groups), and not with those of DDP without the
hook.

The plan sends the small LM's layers by PowerSGD (rank 2), top-k (density 0.3) and dense allreduce, so a framework
that dropped the hook, or bucketed other than the plan, would end elsewhere: the test checks that the unhooked run is
further off than the tolerance by orders of magnitude.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from planner.runtime import PlanHook
from planner.runtime.frameworks import accelerate_prepare, lightning_strategy
from planner.types import PlanMismatchError
from tests.pool import run_warm
from tests.test_mixed_runtime import mixed_plan

ROOT = Path(__file__).resolve().parent.parent
SNIPPETS = ROOT / "docs" / "snippets"
SENT_AS = ["powersgd:2", "topk:0.3", "dense"]
STEPS = 5  # the scripts' loader: 5 batches per rank
MISMATCH = "DDP's buckets are not the plan's groups"
MOMENTUM = 0.9  # tests/lightning_momentum.py's
#: The scripts and the hand-made loop do the same arithmetic on the same data (in practice bit for bit).
RTOL, ATOL = 1e-6, 1e-7
#: How far DDP without the hook must end from the plan's run, at least (1.1e-3 here, on head.weight).
APART = 1e-4


def _small_lm() -> Any:
    if str(SNIPPETS) not in sys.path:
        sys.path.insert(0, str(SNIPPETS))
    from my_workloads import small_lm

    return small_lm()


def _reference_worker(rank: int, world_size: int, plan_path: str) -> dict[str, Any]:
    """The scripts' model, data and SGD, by hand: DDP with `PlanHook` (its buckets checked to be the plan's groups,
    with no warning), the same with momentum 0.9 in the hook, and DDP without a hook. Parameters after the 5 steps,
    by name."""
    results: dict[str, Any] = {}
    for run in ("plan", "plan+momentum", "ddp"):
        workload = _small_lm()
        model, loss_fn = workload.module, workload.loss_fn
        generator = torch.Generator().manual_seed(rank)
        loader = [workload.make_batch(workload.batch_size, generator) for _ in range(STEPS)]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if run != "ddp":
                momentum = {"momentum": MOMENTUM, "optimizer": optimizer} if run == "plan+momentum" else {}
                hook = PlanHook.from_file(model, plan_path, **momentum)
                ddp = DistributedDataParallel(model, **hook.ddp_kwargs())
                hook.register(ddp)
            else:
                ddp = DistributedDataParallel(model)
            for inputs, targets in loader:
                optimizer.zero_grad()
                loss_fn(ddp(inputs), targets).backward()
                optimizer.step()
        if run != "ddp":
            assert hook.bucket_groups == list(range(len(hook.plan.groups))), hook.buckets
            assert not [w for w in caught if MISMATCH in str(w.message)]
        results[run] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return results


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "small-lm-plan.json"
    mixed_plan(_small_lm().module, SENT_AS).save(path)
    return path


@pytest.fixture(scope="module")
def plan_and_reference(plan_path: Path) -> tuple[Path, dict[str, Any]]:
    path = plan_path
    ranks = run_warm(_reference_worker, 2, str(path), timeout=300)
    for name, p in ranks[0]["plan"].items():  # DDP keeps the ranks in step
        assert torch.equal(p, ranks[1]["plan"][name]), name
    return path, ranks[0]


def _torchrun(script: str, plan: Path, tmp_path: Path) -> tuple[dict[str, torch.Tensor], str]:
    return _snippet_ran(_torchrun_script(SNIPPETS / script, plan, tmp_path), tmp_path)


def _snippet_ran(done: subprocess.CompletedProcess[str], folder: Path,
                 stderr: str | None = None) -> tuple[dict[str, torch.Tensor], str]:
    """The parameters a snippet's run saved in `folder`, and its stderr (`stderr`: its part of a launch's stderr
    where the snippet ran beside other cases)."""
    assert done.returncode == 0, done.stderr[-3000:]
    # the ranks' lines (torchrun may pass two ranks' writes on without a line break between them)
    ranks = sorted(re.findall(r"rank (\d) loss [-\d.]+ checksum (-?\d+\.\d{6})", done.stdout))
    assert [rank for rank, _ in ranks] == ["0", "1"], done.stdout[-2000:]
    assert len({checksum for _, checksum in ranks}) == 1, ranks  # both ranks stepped alike
    return torch.load(folder / "model.pt"), done.stderr if stderr is None else stderr


def _marked(stderr: str, marker: str) -> tuple[str, str]:
    """`stderr` split at each rank's "rank R: MARKER": what came before the last rank's, and what came after the first
    rank's (each rank writes in order, so what a rank wrote before its own marker is all in the first part, and
    what it wrote after it all in the second)."""
    at = list(re.finditer(rf"rank \d: {re.escape(marker)}", stderr))
    assert len(at) == 2, stderr[-3000:]
    return stderr[:at[-1].start()], stderr[at[0].end():]


def _torchrun_script(script: Path, plan: Path, tmp_path: Path, *more: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SNIPPETS), str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
         str(plan), *more],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )


@pytest.fixture(scope="module")
def lightning_runs(plan_path: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> tuple[subprocess.CompletedProcess[str], Path, Any]:
    """One torchrun for the three Lightning cases below (Lightning's import is most of a launch):
    tests/lightning_momentum.py, which runs docs/snippets/train_lightning.py on the small LM's plan first, then its
    own cases on that plan, then, in the same processes, tests/lightning_adaptive.py's fit on the adaptive task
    (tests/test_adaptive.py). The run, its directory, and the adaptive plan it started from."""
    from planner.strategies.mixed_plan import make_mixed_plan, parse_compressors
    from tests.test_adaptive import ALLOWED, BUDGET, slow_profile_with_errors
    from tests.test_adaptive_ddp import ITERATIONS

    out = tmp_path_factory.mktemp("lightning")
    profile = slow_profile_with_errors()
    profile_path, adaptive_path = out / "profile.json", out / "plan.json"
    profile.save(profile_path)
    adaptive = make_mixed_plan(profile, parse_compressors(ALLOWED), source=str(profile_path), error_budget=BUDGET,
                               time_limit_s=None)
    adaptive.save(adaptive_path)
    done = _torchrun_script(ROOT / "tests" / "lightning_momentum.py", plan_path, out,
                            str(adaptive_path), str(profile_path), str(ITERATIONS))
    return done, out, adaptive


@pytest.fixture(scope="module")
def accelerate_run(plan_path: Path, tmp_path_factory: pytest.TempPathFactory
                   ) -> tuple[subprocess.CompletedProcess[str], Path]:
    """One torchrun for both Accelerate cases below: tests/accelerate_momentum.py on the small LM's plan, then, in the
    same processes, docs/snippets/train_accelerate.py on it. The run and its directory."""
    out = tmp_path_factory.mktemp("accelerate")
    return _torchrun_script(ROOT / "tests" / "accelerate_momentum.py", plan_path, out), out


def _refused(stdout: str) -> list[tuple[str, str]]:
    """Each rank's "rank R refused: ..." line, sorted by rank (torchrun may pass two ranks' writes on without a line
    break between them: a line ends where the next rank's starts)."""
    return sorted(re.findall(r"rank (\d) refused: (.*?)(?=rank \d refused: |$)", stdout, re.M))


def test_lightning_takes_the_hooks_momentum_and_checks_the_optimizer_it_makes(
        plan_and_reference: tuple[Path, dict[str, Any]],
        lightning_runs: tuple[subprocess.CompletedProcess[str], Path, Any]) -> None:
    """`lightning_strategy(momentum=0.9)` trains as `PlanHook(momentum=0.9, optimizer=...)` by hand, and momentum in
    Lightning's optimizer on the plan's top-k groups is refused in one line, as the plain path refuses it."""
    _plan, reference = plan_and_reference
    done, out, _adaptive = lightning_runs
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(out / "momentum.pt")
    for name, p in got.items():
        torch.testing.assert_close(p, reference["plan+momentum"][name], rtol=RTOL, atol=ATOL, msg=name)
    apart = max((got[n] - reference["plan"][n]).abs().max().item() for n in got)
    assert apart > APART, f"without the momentum the run ends within {apart:.3g}: the hook's momentum did nothing"
    refused = _refused(done.stdout)
    assert [rank for rank, _ in refused] == ["0", "1"], done.stdout[-2000:]
    assert all("has momentum=0.9, but the plan sends its parameters by top-k" in line for _, line in refused)


def test_lightning_strategy_replans_as_training_goes(
        lightning_runs: tuple[subprocess.CompletedProcess[str], Path, Any]) -> None:
    """`lightning_strategy(adaptive=...)`: on the task whose gradients change (tests/test_adaptive.py), the hook
    Lightning runs re-plans as `PlanHook(adaptive=...)` does in a plain loop: the same plan on every rank, PowerSGD
    rank 1 replaced once it exceeds the budget, the buckets kept, no gradient lost."""
    import json

    from planner.contracts.plan import Plan
    from tests.test_adaptive import check_replanned_once
    from tests.test_adaptive_ddp import ITERATIONS

    done, out, plan = lightning_runs
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = []
    for rank in range(2):
        result = torch.load(out / f"adaptive-rank{rank}.pt", weights_only=False)
        ranks.append({**result, "plan": json.dumps(result["plan"], sort_keys=True),
                      "resumed": json.dumps(result["resumed"], sort_keys=True)})
    new = check_replanned_once(ranks[0], ranks[1], ITERATIONS)
    assert [g.params for g in new.groups] == [g.params for g in plan.groups], "DDP's buckets are kept"
    assert Plan.from_dict(json.loads(ranks[0]["resumed"])) == new


def test_accelerate_takes_the_hooks_momentum_and_the_hook_checks_the_prepared_optimizer(
        plan_and_reference: tuple[Path, dict[str, Any]],
        accelerate_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    """`PlanHook(momentum=0.9, optimizer=...)` run through `accelerate_prepare` trains as by hand, and momentum put in
    the optimizer Accelerate prepared is refused at its next step, in one line."""
    _plan, reference = plan_and_reference
    done, out = accelerate_run
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(out / "momentum.pt")
    for name, p in got.items():
        torch.testing.assert_close(p, reference["plan+momentum"][name], rtol=RTOL, atol=ATOL, msg=name)
    refused = _refused(done.stdout)
    assert [rank for rank, _ in refused] == ["0", "1"], done.stdout[-2000:]
    assert all("momentum" in line and "\n" not in line for _, line in refused)


def _check_runs_the_plan(got: dict[str, torch.Tensor], reference: dict[str, Any], stderr: str) -> None:
    assert MISMATCH not in stderr
    assert list(got) == list(reference["plan"])
    for name, p in got.items():
        torch.testing.assert_close(p, reference["plan"][name], rtol=RTOL, atol=ATOL, msg=name)
    apart = max((got[n] - reference["ddp"][n]).abs().max().item() for n in got)
    assert apart > APART, f"DDP without the hook ends within {apart:.3g} of this run: the plan did not change it"


@pytest.mark.parametrize("script", ["train_ddp.py", "train_lightning.py", "train_accelerate.py"])
def test_each_script_runs_the_plan_as_by_hand(script: str, plan_and_reference: tuple[Path, dict[str, Any]],
                                              tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """train_ddp.py in a launch of its own; the Lightning and Accelerate scripts in the launches of their momentum
    cases (`lightning_runs`, `accelerate_run`), which run them as their own launches would: Lightning's first,
    Accelerate's last."""
    plan, reference = plan_and_reference
    if script == "train_lightning.py":
        done, out, _adaptive = request.getfixturevalue("lightning_runs")
        got, stderr = _snippet_ran(done, out, _marked(done.stderr, f"{script} done")[0])
    elif script == "train_accelerate.py":
        done, out = request.getfixturevalue("accelerate_run")
        got, stderr = _snippet_ran(done, out, _marked(done.stderr, f"{script} starts")[1])
    else:
        got, stderr = _torchrun(script, plan, tmp_path)
    _check_runs_the_plan(got, reference, stderr)


# -- refusals (one process) -------------------------------------------------------------------------------------


class _Lit(nn.Module):
    """Stands for a LightningModule holding the planned network and one more trainable parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 2)
        self.scale = nn.Parameter(torch.ones(1))


def test_lightning_strategy_refuses_what_the_plan_sets_in_one_line() -> None:
    for kwargs in ({"bucket_cap_mb": 5}, {"ddp_comm_hook": lambda s, b: None}, {"gradient_as_bucket_view": False}):
        with pytest.raises(ValueError, match="sets DDP's buckets and comm hook from the plan") as info:
            lightning_strategy("plan.json", **kwargs)
        assert "\n" not in str(info.value) and next(iter(kwargs)) in str(info.value)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"momentum": 0.9, "nesterov": False}, None),  # taken: the optimizer is checked once Lightning makes it
    ({"momentum": 1.5}, "`0 <= momentum < 1` must hold"),
    ({"momentum": "0.9"}, "`0 <= momentum < 1` must hold"),
    ({"nesterov": True}, "nesterov=True needs momentum > 0"),
    ({"momentun": 0.9}, "lightning_strategy got momentun, which is an argument of neither DDPStrategy nor"),
    ({"optimizer": object()}, "checks the optimizer your LightningModule's configure_optimizers returns"),
])
def test_lightning_strategy_refuses_a_wrong_argument_at_construction_in_one_line(
        kwargs: dict[str, Any], message: str | None) -> None:
    """Not inside `fit` on every rank (a `momentum=` once reached DDP's constructor there, as an unknown keyword)."""
    if message is None:
        lightning_strategy("never-read.json", **kwargs)
        return
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        lightning_strategy("never-read.json", **kwargs)
    assert "\n" not in str(info.value)
    lightning_strategy("never-read.json", timeout=datetime.timedelta(seconds=60),
                       broadcast_buffers=False)  # DDPStrategy's and DDP's own arguments pass


def test_lightning_strategy_refuses_a_module_that_does_not_hold_all_trainable_parameters() -> None:
    lit = _Lit()
    strategy = lightning_strategy("never-read.json", module=lit.net)
    strategy.model = lit
    with pytest.raises(PlanMismatchError, match="does not hold all the trainable parameters") as info:
        strategy.configure_ddp()
    assert "\n" not in str(info.value)
    lit.scale.requires_grad_(False)  # frozen: DDP buckets only the net's parameters; the plan's file is read next
    with pytest.raises(OSError, match=r"never-read\.json"):
        strategy.configure_ddp()


def test_accelerate_prepare_refuses_a_single_process_or_mixed_precision() -> None:
    assert not dist.is_initialized()
    model = nn.Linear(3, 2)
    hook = SimpleNamespace(model=model)
    single = SimpleNamespace(distributed_type="NO", num_processes=1, mixed_precision="no", device="cpu")
    mixed = SimpleNamespace(distributed_type="MULTI_CPU", num_processes=2, mixed_precision="bf16", device="cpu")
    for accelerator, what in ((single, "several processes"), (mixed, "mixed precision")):
        with pytest.raises(ValueError, match=what) as info:
            accelerate_prepare(accelerator, hook)  # type: ignore[arg-type]
        assert "\n" not in str(info.value)
