"""Compression error: each compressor's error against a hand computation (`planner.kernels.error`), the profile's
record of it and what the planner reads from it (`planner.contracts.errors`), and the profiler's real steps
(`profilers.errors`)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from planner.contracts.errors import CompressionErrors
from planner.contracts.profile import Profile
from planner.kernels.error import ErrorMeter
from planner.models import build_workload
from planner.profilers.errors import combine_error_runs, measure_errors
from planner.types import Compressor, InvalidProfileError, SchemaError
from tests.factories import synthetic_profile


def _c(text: str) -> Compressor:
    return Compressor.parse(text)


# -- the meters, against hand computations -------------------------------------------------------------------------
def test_fp16_error_of_values_between_halves():
    # fp16 holds 1 and 1 + 2^-10 around 1: 1 + 2^-12 rounds to 1 (off by 2^-12), 1 + 2^-11 lies halfway and rounds
    # to the even one, 1 (off by 2^-11); 1 + 2^-10 is exact.
    g = torch.tensor([1 + 2**-12, 1 + 2**-11, 1 + 2**-10, 2.0], dtype=torch.float32)
    sample = ErrorMeter([(4,)], _c("fp16")).observe(g)
    assert sample.error_sq == 2**-24 + 2**-22
    assert sample.input_sq == sample.grad_sq == pytest.approx(float((g.double() ** 2).sum()), rel=1e-15)


def test_fp16_relative_error_is_about_two_to_the_minus_22():
    g = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    meter = ErrorMeter([(100_000,)], _c("fp16"))
    first, second = meter.observe(g), meter.observe(g)
    assert first == second  # no error fed back: the same input gives the same error
    relative = first.error_sq / first.grad_sq
    # rounding to 11 significant bits: off by a uniform amount within half a spacing u = 2^-10 x_0 on a binade
    # [x_0, 2 x_0), variance u^2 / 12; relative to x^2, over values spread evenly in log: 2^-20 / 12 * 3 / (8 ln 2)
    expected = 2**-20 / 12 * 3 / (8 * math.log(2))  # 4.30e-8, about 2^-24.5
    assert relative == pytest.approx(expected, rel=0.05)


def test_powersgd_is_exact_on_a_matrix_of_its_rank():
    gen = torch.Generator().manual_seed(1)
    matrix = torch.randn(12, 3, generator=gen) @ torch.randn(3, 20, generator=gen)  # rank 3
    bias = torch.randn(12, generator=gen)
    g = torch.cat([matrix.reshape(-1), bias])
    sample = ErrorMeter([(12, 20), (12,)], _c("powersgd:3")).observe(g)
    assert sample.error_sq / sample.grad_sq < 1e-10  # float32 round-off only; the bias is sent whole


def test_powersgd_error_is_at_least_the_tail_of_the_singular_values():
    # diag(4, 3, 2, 1) in a 16 x 16 matrix at rank 2: no rank-2 approximation is closer than 2^2 + 1^2 (Eckart-Young)
    matrix = torch.zeros(16, 16)
    for i, s in enumerate((4.0, 3.0, 2.0, 1.0)):
        matrix[i, i] = s
    sample = ErrorMeter([(16, 16)], _c("powersgd:2")).observe(matrix.reshape(-1))
    assert 5.0 - 1e-5 <= sample.error_sq <= 30.0
    assert sample.input_sq == sample.grad_sq == pytest.approx(30.0)


def test_topk_error_with_error_feedback_by_hand():
    g = torch.tensor([5.0, -4.0, 3.0, 0.5, -0.25, 0.1])
    meter = ErrorMeter([(6,)], _c("topk:0.5"), k=3)
    first = meter.observe(g)
    assert first.grad_sq == first.input_sq == pytest.approx(25 + 16 + 9 + 0.25 + 0.0625 + 0.01)
    assert first.error_sq == pytest.approx(0.25 + 0.0625 + 0.01)  # 0.5, -0.25, 0.1 stay behind
    second = meter.observe(g)  # x = g + [0, 0, 0, 0.5, -0.25, 0.1]: the same three are kept
    assert second.input_sq == pytest.approx(25 + 16 + 9 + 1.0 + 0.25 + 0.04)
    assert second.error_sq == pytest.approx(1.0 + 0.25 + 0.04)


def test_topk_keeps_whatever_error_builds_up():
    # the residual wins once it outgrows the others: x = [1, 1, 0.6 * t] at step t, k = 1
    g = torch.tensor([1.0, 1.0, 0.6])
    meter = ErrorMeter([(3,)], _c("topk:0.3"), k=1)
    errors = [meter.observe(g).error_sq for _ in range(4)]
    # step 1: keeps one of the 1s -> [0, 1, 0.6] left; step 2: x = [1, 2, 1.2], keeps 2 -> [1, 0, 1.2];
    # step 3: x = [2, 1, 1.8], keeps 2 -> [0, 1, 1.8]; step 4: x = [1, 2, 2.4], keeps 2.4 -> [1, 2, 0]
    assert errors == pytest.approx([1 + 0.36, 1 + 1.44, 1 + 3.24, 1 + 4])


def test_meters_refuse_dense_and_bad_gradients():
    with pytest.raises(ValueError, match="no compression error"):
        ErrorMeter([(4,)], _c("dense"))
    with pytest.raises(ValueError, match="top-k needs the k it sends"):
        ErrorMeter([(4,)], _c("topk:0.5"))
    with pytest.raises(ValueError, match="top-k needs the k it sends"):
        ErrorMeter([(4,)], _c("fp16"), k=2)
    with pytest.raises(ValueError, match="1 <= k <= 4"):
        ErrorMeter([(4,)], _c("topk:0.5"), k=5)
    meter = ErrorMeter([(2, 3)], _c("topk:0.5"), k=3)
    with pytest.raises(ValueError, match="flat fp32 gradient of 6"):
        meter.observe(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="flat fp32 gradient of 6"):
        meter.observe(torch.zeros(6, dtype=torch.float64))


# -- the record ---------------------------------------------------------------------------------------------------
def _record(**changes: object) -> CompressionErrors:
    # 1 rank, 2 layers, 2 steps. Layer 0 holds 3/4 of the energy (grad_sq 3 against 1).
    grad = np.array([[[3.0, 3.0], [1.0, 1.0]]])
    fields = {
        "layers": ("a", "b"), "warmup": 1, "grad_sq": grad,
        "input_sq": {"fp16": grad.copy(), "topk:0.01": np.array([[[4.0, 8.0], [2.0, 2.0]]])},
        "error_sq": {"fp16": grad * 2**-22, "topk:0.01": np.array([[[1.0, 2.0], [1.0, 0.0]]])},
    }
    return CompressionErrors(**{**fields, **changes})  # type: ignore[arg-type]


def test_weights_contractions_and_errors_by_hand():
    rec = _record()
    assert rec.weights() == pytest.approx([0.75, 0.25])
    assert rec.contraction("topk:0.01") == pytest.approx([3 / 12, 1 / 4])  # sums over steps: 3/12 and 1/4
    assert rec.contraction("dense") == pytest.approx([0, 0])
    assert rec.uniform("fp16") == pytest.approx(2**-22)
    assert rec.uniform("topk:0.01") == pytest.approx(0.75 * 0.25 + 0.25 * 0.25)
    assert rec.error_of(["dense", "topk:0.01"]) == pytest.approx(0.25 * 0.25)
    assert rec.error_of([_c("topk:0.01"), "fp16"]) == pytest.approx(0.75 * 0.25 + 0.25 * 2**-22)
    assert rec.error_of(["topk:1.0", "dense"]) == 0.0  # top-k at density 1 sends everything
    assert rec.has("dense") and rec.has("topk:1.0") and rec.has("fp16") and not rec.has("powersgd:4")
    with pytest.raises(KeyError, match="no compression error for powersgd:4"):
        rec.uniform("powersgd:4")
    with pytest.raises(ValueError, match="one compressor per layer"):
        rec.error_of(["fp16"])


def test_interval_draws_the_measured_steps():
    rec = _record()
    low, high = rec.interval("topk:0.01")
    # each draw takes steps (0, 0), (0, 1), (1, 0) or (1, 1) of the one rank
    draws = []
    for take in ([0, 0], [0, 1], [1, 1]):
        t = np.array([take])
        draws.append(rec.error_of(["topk:0.01"] * 2, t))
    assert min(draws) - 1e-12 <= low <= rec.uniform("topk:0.01") <= high <= max(draws) + 1e-12
    assert rec.interval("fp16") == pytest.approx((2**-22, 2**-22))  # the same in every step


def test_grad_spread():
    rec = _record(grad_sq=np.array([[[1.0, 9.0], [4.0, 4.0]]]))
    assert rec.grad_spread() == pytest.approx([1 / 2, 0.0])  # |g| 1 and 3: mean 2, std 1


def test_record_round_trips_and_rejects_bad_values():
    rec = _record()
    back = CompressionErrors.from_dict(json.loads(json.dumps(rec.to_dict())))
    assert back.layers == rec.layers and back.warmup == 1
    assert back.uniform("topk:0.01") == rec.uniform("topk:0.01")
    bad = {
        "shape": (dict(grad_sq=np.ones((1, 3, 2))), "over the 2 layers"),
        "negative": (dict(input_sq={"fp16": -np.ones((1, 2, 2)), "topk:0.01": np.ones((1, 2, 2))}), ">= 0"),
        "nan": (dict(error_sq={"fp16": np.full((1, 2, 2), np.nan), "topk:0.01": np.ones((1, 2, 2))}), "finite"),
        "keys": (dict(error_sq={"fp16": np.ones((1, 2, 2))}), "both input_sq and error_sq"),
        "dense": (dict(input_sq={"dense": np.ones((1, 2, 2))}, error_sq={"dense": np.ones((1, 2, 2))}),
                  "changes what it sends"),
        "spelling": (dict(input_sq={"topk:1e-2": np.ones((1, 2, 2))}, error_sq={"topk:1e-2": np.ones((1, 2, 2))}),
                     "as planner writes it"),
        "twice": (dict(layers=("a", "a")), "names a layer twice"),
    }
    for name, (changes, message) in bad.items():
        with pytest.raises(InvalidProfileError, match=message):
            _record(**changes)
        del name
    data = rec.to_dict()
    for value, message in ((dict(data, grad_sq="x"), "grad_sq"), (dict(data, grad_sq=[[["a"]]]), "list of numbers"),
                           (dict(data, extra=1), "extra"), (dict(data, warmup=-1), "warmup")):
        with pytest.raises(SchemaError, match=message):
            CompressionErrors.from_dict(value)


def test_profile_keeps_the_record_of_its_own_layers():
    base = synthetic_profile("mlp")
    names = tuple(lt.name for lt in base.layers)
    n = len(names)
    grad = np.ones((2, n, 3))
    rec = CompressionErrors(layers=names, warmup=1, grad_sq=grad, input_sq={"fp16": grad},
                            error_sq={"fp16": grad * 1e-7})
    profile = dataclasses.replace(base, errors=rec)
    back = Profile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert back.errors is not None and back.errors.uniform("fp16") == pytest.approx(1e-7)
    assert "errors" not in base.to_dict()  # profiles without it stay as they were
    with pytest.raises(InvalidProfileError, match="profile's layers in its order"):
        dataclasses.replace(base, errors=dataclasses.replace(rec, layers=names[::-1]))


# -- the profiler ---------------------------------------------------------------------------------------------------
def test_measure_errors_on_real_steps():
    workload = build_workload("digits")
    named = dict(workload.module.named_parameters())
    layers = [("2", ("2.weight", "2.bias")), ("0", ("0.weight", "0.bias"))]
    assert all(p in named for _, ps in layers for p in ps)
    compressors = [_c(t) for t in ("dense", "fp16", "powersgd:1", "topk:0.01", "topk:1.0")]
    runs = [measure_errors(workload, torch.device("cpu"), layers, compressors, rank=r, steps=3, warmup=2)
            for r in range(2)]
    rec = combine_error_runs(runs, [name for name, _ in layers], warmup=2)
    assert rec.grad_sq.shape == (2, 2, 3) and sorted(rec.input_sq) == ["fp16", "powersgd:1", "topk:0.01"]
    assert np.all(rec.grad_sq > 0)
    assert not np.array_equal(rec.grad_sq[0], rec.grad_sq[1])  # each rank its own batches
    assert rec.uniform("fp16") == pytest.approx(4.3e-8, rel=0.2)  # as on random values: the same rounding
    topk, powersgd = rec.contraction("topk:0.01"), rec.contraction("powersgd:1")
    assert np.all((topk > 0.5) & (topk < 1))  # 1% of a dense gradient leaves most of its energy behind
    assert np.all((powersgd > 0) & (powersgd < 1))
    # error feedback: top-k's input after the warm-up holds more than the gradient
    assert np.all(rec.input_sq["topk:0.01"] > rec.grad_sq)
    assert math.isclose(rec.weights().sum(), 1.0)


def test_measure_errors_on_a_model_shaped_like_real_ones():
    """A tied weight (one gradient, once), a frozen layer (no layer), BatchNorm, an unused layer (a zero gradient: no
    energy, no error), modules registered in another order than used."""
    from planner.contracts.layers import gradient_layers
    from planner.models import Workload
    from tests.test_mixed_runtime import ShapedConv

    def batch(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 3, 6, 6, generator=generator), torch.randint(0, 4, (n,), generator=generator)

    workload = Workload(name="shaped", module=ShapedConv(), batch_size=8, make_batch=batch,
                        loss_fn=torch.nn.functional.cross_entropy)
    layers = [(s.name, s.params) for s in gradient_layers(workload.module)]
    names = [name for name, _ in layers]
    assert "frozen" not in names and "tail" not in names  # the tied weight is body's
    compressors = [_c(t) for t in ("fp16", "powersgd:1", "topk:0.3")]
    rec = combine_error_runs([measure_errors(workload, torch.device("cpu"), layers, compressors, steps=2, warmup=1)],
                             names, warmup=1)
    unused = names.index("unused")
    assert np.all(rec.grad_sq[:, unused] == 0) and rec.weights()[unused] == 0
    assert all(rec.contraction(c)[unused] == 0 for c in ("fp16", "powersgd:1", "topk:0.3"))
    used = [i for i in range(len(names)) if i != unused]
    assert np.all(rec.grad_sq[:, used] > 0) and np.all(rec.contraction("topk:0.3")[used] > 0)
    assert 0 < rec.uniform("topk:0.3") < 1 and math.isclose(rec.weights().sum(), 1.0)
