"""`planner profile --kfac` refuses layers K-FAC cannot take (run twice in a step, or not at all in one) before
any worker starts, naming every one of them in a --kfac-skip pattern with which one rerun passes (issue 49,
item 10): a GRU-like recurrent cell whose Linear layers run once per time step, and a mixture of experts whose
router sends each batch to 2 of its 4 experts."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from planner.models import Workload

STEPS = 2  # time steps of the recurrent cell: its Linear layers run twice per training step
EXPERTS, CHOSEN = 4, 2


def _vectors(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs [n, 8], shifted as a whole by a random offset (so the router picks other experts for other
    batches), and class targets [n]."""
    shift = 3 * torch.randn(1, 8, generator=generator)
    return torch.randn(n, 8, generator=generator) + shift, torch.randint(0, 4, (n,), generator=generator)


def _sequences(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, STEPS, 8, generator=generator), torch.randint(0, 4, (n,), generator=generator)


class _Recurrent(nn.Module):
    """A GRU-like cell written with Linear layers, run over the time steps: `gate` and `candidate` run once per
    time step, so STEPS times per forward pass (`embed` and `head` once)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.gate = nn.Linear(32, 16)
        self.candidate = nn.Linear(32, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[0], 16)
        embedded = torch.tanh(self.embed(x))
        for t in range(x.shape[1]):
            xt = embedded[:, t]
            z = torch.sigmoid(self.gate(torch.cat([xt, h], dim=1)))
            h = (1 - z) * h + z * torch.tanh(self.candidate(torch.cat([xt, h], dim=1)))
        return self.head(h)


class _MixtureOfExperts(nn.Module):
    """A router sends the whole batch to the CHOSEN of EXPERTS experts (two Linear layers each) it scores highest;
    with `shared_embed`, the input projection also runs twice (before and after the experts)."""

    def __init__(self, *, shared_embed: bool = False) -> None:
        super().__init__()
        self.shared_embed = shared_embed
        self.embed = nn.Linear(8, 8)
        self.router = nn.Linear(8, EXPERTS)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
                                     for _ in range(EXPERTS))
        self.head = nn.Linear(8, 4)

    def chosen(self, x: torch.Tensor) -> list[int]:
        """The experts the router picks for batch `x`."""
        return self.router(torch.relu(self.embed(x))).mean(0).topk(CHOSEN).indices.tolist()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.embed(x))
        scores = self.router(h).mean(0)
        weights, picked = scores.topk(CHOSEN)
        weights = torch.softmax(weights, dim=0)
        out = sum(w * self.experts[int(i)](h) for w, i in zip(weights, picked, strict=True))
        if self.shared_embed:
            out = self.embed(out)
        return self.head(out)


class _Checkpointed(nn.Module):
    """`block` under reentrant activation checkpointing: backward runs its forward again."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, x.requires_grad_(), use_reentrant=True))


class _SmallBatchesOnly(nn.Linear):
    """Fails on more than two samples: the trial step's batch of two passes, the check's full batch does not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 2:
            raise RuntimeError(f"at most 2 samples, got {x.shape[0]}")
        return super().forward(x)


def small_batches_only() -> Workload:
    return Workload(name="small", module=_SmallBatchesOnly(8, 4), batch_size=4, make_batch=_vectors,
                    loss_fn=F.cross_entropy)


def recurrent() -> Workload:
    return Workload(name="recurrent", module=_Recurrent(), batch_size=8, make_batch=_sequences, loss_fn=F.cross_entropy)


def moe() -> Workload:
    return Workload(name="moe", module=_MixtureOfExperts(), batch_size=8, make_batch=_vectors,
                    loss_fn=F.cross_entropy)


def moe_shared() -> Workload:
    return Workload(name="moe-shared", module=_MixtureOfExperts(shared_embed=True), batch_size=8,
                    make_batch=_vectors, loss_fn=F.cross_entropy)


def _built(factory: str) -> Workload:
    """The workload as `planner profile --model tests.test_kfac_early:<factory>` builds it (weights from seed 0)."""
    from planner.models import build_workload

    return build_workload(f"tests.test_kfac_early:{factory}")


def _chosen(workload: Workload, seed: int) -> set[int]:
    """The experts the router of `workload` (a mixture of experts) picks for its batch `seed`."""
    module = workload.module
    assert isinstance(module, _MixtureOfExperts)
    return set(module.chosen(workload.batch(seed)[0]))


def _expert_layers(experts: list[int]) -> list[str]:
    return [f"experts.{e}.{i}" for e in sorted(experts) for i in (0, 2)]


class _Launched(Exception):
    """Raised by the stand-in for the worker launch: the profile got as far as starting workers."""


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace every way of starting workers with one that records the call and raises `_Launched`."""
    import planner.platform.launch as launch

    started: list[str] = []

    def stand_in(name: str) -> Callable[..., None]:
        def start(*_args: object, **_kwargs: object) -> None:
            started.append(name)
            raise _Launched(name)
        return start

    for name in ("run_job", "run_jobs", "run_distributed"):
        monkeypatch.setattr(launch, name, stand_in(name))
    return started


def _profile(tmp_path: Path, model: str, *extra: str) -> int:
    from planner.commands.cli import main

    return main(["profile", "--model", f"tests.test_kfac_early:{model}", "--kfac", "--quick", "--backend", "gloo",
                 "--nproc", "2", "-o", str(tmp_path / "p.json"), *extra])


def _refusal(capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """The one line the refused command wrote, and the --kfac-skip pattern it suggests."""
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert "Traceback" not in lines[0]
    found = re.search(r"--kfac-skip '([^']+)' and pass skip_layers='([^']+)'", lines[0])
    assert found is not None, lines[0]
    assert found[1] == found[2]
    return lines[0], found[1]


def _skipped(model: nn.Module, pattern: str) -> list[str]:
    from planner.contracts.kfac_section import kfac_layers

    kept = {s.name for s in kfac_layers(model, pattern)}
    return [s.name for s in kfac_layers(model) if s.name not in kept]


def test_a_recurrent_cell_is_refused_before_any_worker_starts_and_the_suggestion_passes(
        tmp_path: Path, launches: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A GRU with a layer used twice was refused after minutes of profiling; now before the workers."""
    assert _profile(tmp_path, "recurrent") == 2
    assert launches == []
    line, pattern = _refusal(capsys)
    assert f"K-FAC layers ['gate', 'candidate'] run {STEPS} times in one training step" in line
    assert "did not run" not in line
    assert _skipped(_Recurrent(), pattern) == ["gate", "candidate"]
    assert not (tmp_path / "p.json").exists()

    with pytest.raises(_Launched):
        _profile(tmp_path, "recurrent", "--kfac-skip", pattern)
    assert launches == ["run_job"]  # past the check: workers would start


def test_every_unused_expert_is_named_before_any_worker_starts_and_the_suggestion_passes(
        tmp_path: Path, launches: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """The suggestion named three layers of four unused ones: a second full profile learned the fourth."""
    from planner.profilers.kfac_costs import KFAC_CHECK_BATCHES

    workload = _built("moe")
    unused = sorted({e for seed in range(KFAC_CHECK_BATCHES)
                     for e in set(range(EXPERTS)) - _chosen(workload, seed)})
    assert len(_expert_layers(unused)) >= 4  # more than the three the suggestion used to name
    assert _profile(tmp_path, "moe") == 2
    assert launches == []
    line, pattern = _refusal(capsys)
    assert f"did not run in the forward pass of at least one of {KFAC_CHECK_BATCHES} trial steps" in line
    assert _skipped(_MixtureOfExperts(), pattern) == _expert_layers(unused)
    for name in _expert_layers(unused):
        assert f"'{name}'" in line

    with pytest.raises(_Launched):
        _profile(tmp_path, "moe", "--kfac-skip", pattern)
    assert launches == ["run_job"]


def test_an_expert_the_first_batch_uses_but_a_later_one_does_not_is_named() -> None:
    """Routing changes per batch, and a step without a layer has no factors for it: the check looks at several
    batches, and names a layer missing from any of them."""
    from planner.profilers.kfac_costs import KFAC_CHECK_BATCHES, check_kfac_layers
    from planner.types import InvalidProfileError

    workload = _built("moe")
    first = _chosen(workload, 0)
    always = first.intersection(*(_chosen(workload, seed)
                                  for seed in range(1, KFAC_CHECK_BATCHES)))
    assert first - always  # the data: a later batch leaves out an expert batch 0 uses
    with pytest.raises(InvalidProfileError) as one_batch:
        check_kfac_layers(workload, batches=1)
    with pytest.raises(InvalidProfileError) as several:
        check_kfac_layers(workload)
    for layer in _expert_layers(sorted(first - always)):
        assert f"'{layer}'" not in str(one_batch.value)
        assert f"'{layer}'" in str(several.value)
    pattern = re.search(r"--kfac-skip '([^']+)'", str(several.value))
    assert pattern is not None
    check_kfac_layers(workload, pattern[1])  # passes


def test_shared_and_unused_layers_together_make_one_pattern_and_one_rerun_passes(
        tmp_path: Path, launches: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from planner.profilers.kfac_costs import check_kfac_layers

    assert _profile(tmp_path, "moe_shared") == 2
    assert launches == []
    line, pattern = _refusal(capsys)
    assert "['embed'] run 2 times in one training step" in line
    assert "did not run" in line
    skipped = _skipped(_MixtureOfExperts(shared_embed=True), pattern)
    assert skipped[0] == "embed" and len(skipped) >= 5
    check_kfac_layers(_built("moe_shared"), pattern)
    with pytest.raises(_Launched):
        _profile(tmp_path, "moe_shared", "--kfac-skip", pattern)
    assert launches == ["run_job"]


def test_the_suggestion_keeps_the_pattern_already_given(capsys: pytest.CaptureFixture[str]) -> None:
    """Skipping the head already, the suggestion adds the experts to it rather than replacing it."""
    from planner.profilers.kfac_costs import check_kfac_layers
    from planner.types import InvalidProfileError

    with pytest.raises(InvalidProfileError) as refused:
        check_kfac_layers(_built("moe"), "^head$")
    pattern = re.search(r"--kfac-skip '([^']+)'", str(refused.value))
    assert pattern is not None and pattern[1].startswith("^head$|")
    skipped = _skipped(_MixtureOfExperts(), pattern[1])
    assert "head" in skipped and "router" not in skipped
    check_kfac_layers(_built("moe"), pattern[1])


def test_the_workers_own_check_names_every_unused_layer_too() -> None:
    """The profiler's capture (in the workers, on batch 0) refuses with the whole list as well."""
    from planner.profilers.kfac_costs import measure_kfac_layers
    from planner.types import InvalidProfileError

    workload = _built("moe")
    unused = _expert_layers(sorted(set(range(EXPERTS)) - _chosen(workload, 0)))
    assert len(unused) == 4
    with pytest.raises(InvalidProfileError) as refused:
        measure_kfac_layers(workload, torch.device("cpu"), repeats=1, warmup=0)
    assert f"K-FAC layers {unused} did not run in the forward pass (" in str(refused.value)
    pattern = re.search(r"--kfac-skip '([^']+)'", str(refused.value))
    assert pattern is not None
    timings = measure_kfac_layers(_built("moe"), torch.device("cpu"), repeats=1, warmup=0, skip=pattern[1])
    assert [t.name for t in timings][:2] == ["embed", "router"]


def test_a_forward_run_again_in_backward_is_refused() -> None:
    """The runtime sees the recomputed forward as a second input: the check runs a backward too."""
    from planner.profilers.kfac_costs import check_kfac_layers
    from planner.types import InvalidProfileError

    workload = Workload(name="checkpointed", module=_Checkpointed(), batch_size=4, make_batch=_vectors,
                        loss_fn=F.cross_entropy)
    with pytest.raises(InvalidProfileError, match=r"\['block'\] run 2 times .* --kfac-skip '\^block\$'"):
        check_kfac_layers(workload)
    check_kfac_layers(workload, "^block$")


def test_a_model_failing_in_the_check_is_refused_in_one_line(
        tmp_path: Path, launches: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert _profile(tmp_path, "small_batches_only") == 2
    assert launches == []
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    assert "the K-FAC check's step on batch 0 (on the CPU) raised RuntimeError: at most 2 samples, got 4" in lines[0]


def test_the_check_leaves_the_users_module_as_it_was() -> None:
    from planner.profilers.kfac_costs import check_kfac_layers

    workload = _built("moe")
    before = {k: v.clone() for k, v in workload.module.state_dict().items()}
    with pytest.raises(Exception, match="did not run"):
        check_kfac_layers(workload)
    assert all(p.grad is None for p in workload.module.parameters())
    assert all(torch.equal(before[k], v) for k, v in workload.module.state_dict().items())


def test_the_real_command_exits_in_one_line(tmp_path: Path) -> None:
    """The command as a user runs it: exit status 2, one line, no traceback, no profile."""
    from tests.test_contracts import _cli, _one_clear_line

    _one_clear_line(_cli("profile", "--model", "tests.test_kfac_early:moe", "--kfac", "--backend", "gloo",
                         "-o", str(tmp_path / "p.json")), "did not run in the forward pass of at least one of")
    assert not (tmp_path / "p.json").exists()
