"""Tests of the built-in models and of loading user models given as `package.module:factory`."""

from __future__ import annotations

import pickle
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from planner.models import BUILTIN_MODELS, DEFAULT_MODEL, Workload, build_workload
from planner.types import ModelLoadError, PlannerError, UnknownModelError

CHEAP_MODELS = ["resnet18", "vgg16", "lstm", "bert-tiny", "bert-small", "cnn", "mlp", "charlm"]


def _param_count(module: nn.Module) -> int:
    """Count the scalar parameters in `module`."""
    return sum(p.numel() for p in module.parameters())


def _write_module(directory: Path, name: str, source: str) -> None:
    """Write a Python module `name` holding `source` into `directory`."""
    (directory / f"{name}.py").write_text(textwrap.dedent(source))


def test_builtin_names_and_defaults() -> None:
    """The registry lists exactly the documented models, each with a description and its default batch size."""
    assert set(BUILTIN_MODELS) == {
        "resnet18",
        "resnet18-imagenet",
        "resnet50",
        "resnet50-imagenet",
        "vgg16",
        "lstm",
        "bert",
        "bert-small",
        "bert-tiny",
        "cnn",
        "mlp",
        "digits",
        "charlm",
    }
    assert DEFAULT_MODEL in BUILTIN_MODELS
    assert all(isinstance(d, str) and d and "\n" not in d for d in BUILTIN_MODELS.values())
    defaults = {"resnet18": 16, "vgg16": 16, "lstm": 8, "bert-tiny": 4, "bert-small": 4, "cnn": 32, "mlp": 64,
                "charlm": 16}
    for name, batch_size in defaults.items():
        workload = build_workload(name)
        assert workload.name == name
        assert workload.batch_size == batch_size


@pytest.mark.parametrize("name", CHEAP_MODELS)
def test_forward_backward(name: str) -> None:
    """A batch of 2 runs forward and backward with a finite loss and a gradient for every trainable parameter."""
    workload = build_workload(name, batch_size=2)
    inputs, targets = workload.batch(seed=1)
    assert inputs.shape[0] == 2
    assert targets.shape[0] == 2
    loss = workload.loss(inputs, targets)
    assert loss.dim() == 0
    assert torch.isfinite(loss)
    loss.backward()
    for param_name, param in workload.module.named_parameters():
        if param.requires_grad:
            assert param.grad is not None, f"{name}: no gradient for {param_name}"
            assert torch.isfinite(param.grad).all(), f"{name}: non-finite gradient for {param_name}"


@pytest.mark.parametrize(
    ("name", "expected"),
    [("resnet18-imagenet", 11.7e6), ("resnet50-imagenet", 25.6e6), ("bert", 110e6)],
)
def test_large_models_parameter_counts(name: str, expected: float) -> None:
    """The large models have the parameter counts of their published architectures (construction only)."""
    module = build_workload(name).module
    count = _param_count(module)
    if name == "bert":
        count -= _param_count(module.head)  # the published count is of the encoder with its embeddings
    assert abs(count - expected) <= 0.05 * expected, f"{name}: {count:,} parameters"


def test_resnet50_cifar_builds() -> None:
    """ResNet-50 CIFAR-sized has the bottleneck layout with a 10-class head (construction only)."""
    workload = build_workload("resnet50")
    assert workload.batch_size == 8
    assert abs(_param_count(workload.module) - 23.5e6) <= 0.05 * 23.5e6
    inputs, targets = workload.batch()
    assert inputs.shape == (8, 3, 32, 32)
    assert targets.shape == (8,)


def test_batch_shapes() -> None:
    """Synthetic batches have the documented shapes and value ranges."""
    inputs, targets = build_workload("resnet18-imagenet", batch_size=1).batch()
    assert inputs.shape == (1, 3, 224, 224)
    assert int(targets.min()) >= 0
    assert int(targets.max()) < 1000
    inputs, targets = build_workload("lstm", batch_size=3).batch()
    assert inputs.shape == targets.shape == (3, 35)
    assert inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the next tokens
    inputs, targets = build_workload("bert-tiny").batch()
    assert inputs.shape == targets.shape == (4, 64)
    assert int(inputs.max()) < 30522
    inputs, targets = build_workload("mlp", batch_size=5).batch()
    assert inputs.shape == (5, 784)
    assert targets.shape == (5,)


def test_bert_parameters_live_in_linear_layernorm_embedding() -> None:
    """Every BERT parameter belongs to an nn.Linear, nn.LayerNorm or nn.Embedding."""
    module = build_workload("bert-tiny").module
    for sub in module.modules():
        if any(True for _ in sub.parameters(recurse=False)):
            assert isinstance(sub, (nn.Linear, nn.LayerNorm, nn.Embedding)), type(sub).__name__


@pytest.mark.parametrize("name", ["resnet18", "lstm", "bert-tiny", "mlp"])
def test_determinism(name: str) -> None:
    """Same seed: identical weights and batches; another seed: different ones."""
    a = build_workload(name, batch_size=2, seed=3)
    b = build_workload(name, batch_size=2, seed=3)
    c = build_workload(name, batch_size=2, seed=4)
    state_a, state_b, state_c = a.module.state_dict(), b.module.state_dict(), c.module.state_dict()
    assert state_a.keys() == state_b.keys()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert any(not torch.equal(state_a[k], state_c[k]) for k in state_a)
    for x, y in zip(a.batch(seed=7), b.batch(seed=7), strict=True):
        assert torch.equal(x, y)
    assert not torch.equal(a.batch(seed=7)[0], a.batch(seed=8)[0])


def test_global_rng_untouched() -> None:
    """Building a workload neither reads nor advances the global RNG."""
    torch.manual_seed(123)
    before = torch.get_rng_state()
    build_workload("mlp")
    assert torch.equal(before, torch.get_rng_state())


def test_builtin_workload_pickles() -> None:
    """Built-in workloads survive pickling (no closures), e.g. to hand them to worker processes."""
    workload = build_workload("mlp", batch_size=2)
    clone = pickle.loads(pickle.dumps(workload))
    inputs, targets = clone.batch()
    assert torch.equal(clone.loss(inputs, targets), workload.loss(inputs, targets))


def test_invalid_batch_size() -> None:
    """A non-positive batch size is refused."""
    with pytest.raises(PlannerError, match="batch size"):
        build_workload("mlp", batch_size=0)


def test_unknown_name_lists_valid_names() -> None:
    """An unknown built-in name raises UnknownModelError naming every valid model."""
    with pytest.raises(UnknownModelError) as info:
        build_workload("resnet19")
    message = str(info.value)
    assert "resnet19" in message
    assert "did you mean 'resnet18'" in message
    assert all(name in message for name in BUILTIN_MODELS)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("spec", ["no_colon_spec.x", "pkg.mod:", ":factory", "pkg mod:make", "a:b:c"])
def test_invalid_spec(spec: str) -> None:
    """Malformed `package.module:factory` specs raise ModelLoadError."""
    with pytest.raises(ModelLoadError, match=r"package\.module:factory"):
        build_workload(spec)


def test_missing_package() -> None:
    """An unimportable module raises ModelLoadError that says what could not be imported."""
    with pytest.raises(ModelLoadError, match=r"cannot import 'nosuchpkg\.mod'.*PYTHONPATH") as info:
        build_workload("nosuchpkg.mod:fn")
    assert isinstance(info.value, ImportError)


def test_factory_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Missing attribute, failing factory, non-callable and wrong return type all raise ModelLoadError."""
    _write_module(
        tmp_path,
        "planner_test_factories",
        """
        import torch
        NOT_CALLABLE = 3
        def returns_module():
            return torch.nn.Linear(2, 2)
        def fails():
            raise RuntimeError("boom")
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModelLoadError, match="no attribute 'missing'"):
        build_workload("planner_test_factories:missing")
    with pytest.raises(ModelLoadError, match="RuntimeError: boom"):
        build_workload("planner_test_factories:fails")
    with pytest.raises(ModelLoadError, match="not a callable"):
        build_workload("planner_test_factories:NOT_CALLABLE")
    with pytest.raises(ModelLoadError, match=r"returned Linear, expected a planner\.models\.Workload"):
        build_workload("planner_test_factories:returns_module")


def test_factory_success(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A valid factory is called under the seed, and batch_size overrides its default."""
    _write_module(
        tmp_path,
        "planner_test_good_factory",
        """
        import torch
        from planner.models import Workload

        def make():
            return Workload(
                name="tiny",
                module=torch.nn.Linear(4, 3),
                batch_size=5,
                make_batch=lambda n, g: (torch.randn((n, 4), generator=g), torch.randint(0, 3, (n,), generator=g)),
                loss_fn=torch.nn.functional.cross_entropy,
            )
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    a = build_workload("planner_test_good_factory:make", seed=1)
    b = build_workload("planner_test_good_factory:make", batch_size=2, seed=1)
    assert isinstance(a, Workload)
    assert a.name == "tiny"
    assert a.batch_size == 5
    assert b.batch_size == 2
    assert torch.equal(a.module.weight, b.module.weight)
    inputs, targets = b.batch()
    assert inputs.shape == (2, 4)
    assert torch.isfinite(b.loss(inputs, targets))
