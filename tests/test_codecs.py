"""Each codec (planner/runtime/codecs.py) against its reference, through the codec's own steps (take, prepare, launch,
finish) on two gloo ranks: dense bit for bit DDP's allreduce hook, fp16 bit for bit `fp16_compress_hook`, PowerSGD
bit for bit `powerSGD_hook` (tolerance 0: the same arithmetic in the same order), top-k against the sparse average
computed by hand from every rank's gradients. The drivers that feed the codecs are compared with each other in
tests/test_ddp_plan.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from planner.kernels.compress import PowerSGDLayout
from planner.runtime.codecs import Codec, DenseCodec, Fp16Codec, Link, PowerSGDCodec, TopkCodec, make_codec
from planner.types import Compressor, CompressorKind
from tests.pool import run_warm
from tests.test_compressors import SHAPES, FakeBucket

CPU = torch.device("cpu")
NUMEL = sum(int(np.prod(s)) for s in SHAPES)


def _gradient(rank: int, step: int, numel: int = NUMEL) -> Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * step + rank))


def _views(flat: Tensor) -> list[Tensor]:
    out, at = [], 0
    for shape in SHAPES:
        n = int(np.prod(shape))
        out.append(flat[at : at + n].view(shape))
        at += n
    return out


def _send(codec: Codec, link: Link, grad: Tensor, *, by_parameter: bool) -> Tensor:
    """One step of a plain group through `codec`, as the drivers run it: the gradient taken parameter by parameter
    (GradientExchange) or as a whole bucket (PlanHook); the average it leaves."""
    flat = torch.zeros(NUMEL) if by_parameter else grad.clone()
    if by_parameter:
        for j, (g, view) in enumerate(zip(_views(grad), _views(flat), strict=True)):
            codec.take(j, g.clone(), view)
    else:
        codec.take_flat(flat)
    codec.prepare(flat, None)
    handle = codec.launch(link, flat)
    if handle is not None:
        handle.wait()
    codec.finish(flat)
    return flat


def _against_hooks_worker(rank: int, world_size: int, by_parameter: bool) -> list[tuple[str, int, Tensor, Tensor]]:
    """Per codec and step: the codec's average and the PyTorch hook's, from the same gradients."""
    link = Link(None, world_size)
    out = []
    dense, half = DenseCodec(NUMEL, world_size, False), Fp16Codec(NUMEL, world_size, False, CPU)
    seeds = np.random.RandomState(0)
    powersgd = PowerSGDCodec(PowerSGDLayout.of(SHAPES, 2), world_size, False, CPU, int(seeds.randint(1_000_000_000)))
    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2, random_seed=0)
    state.iter = state.start_powerSGD_iter  # compress from the first call, as the codec does
    for step in range(3):
        grad = _gradient(rank, step) * torch.logspace(-6, 3, NUMEL)  # fp16 subnormals and large values
        for name, codec, hook in (
            ("dense", dense, lambda b: default_hooks.allreduce_hook(None, b)),
            ("fp16", half, lambda b: default_hooks.fp16_compress_hook(None, b)),
            ("powersgd", powersgd, lambda b: powerSGD_hook.powerSGD_hook(state, b)),
        ):
            expected = hook(FakeBucket(grad.clone(), SHAPES)).wait()
            expected = (expected[0] if isinstance(expected, list) else expected).clone()
            out.append((name, step, _send(codec, link, grad, by_parameter=by_parameter), expected))
    return out


@pytest.mark.parametrize("by_parameter", [True, False], ids=["taken-by-parameter", "taken-as-a-bucket"])
def test_dense_fp16_and_powersgd_codecs_equal_pytorchs_hooks_bit_for_bit(by_parameter: bool) -> None:
    """Three steps (PowerSGD's first draws its Qs, the later ones warm-start them and feed the error back)."""
    for rank_results in run_warm(_against_hooks_worker, 2, by_parameter):
        for name, step, mine, expected in rank_results:
            torch.testing.assert_close(mine, expected, rtol=0, atol=0, msg=f"{name}, step {step}")


def _topk_worker(rank: int, world_size: int, k: int, by_parameter: bool) -> list[tuple[Tensor, Tensor]]:
    """Per step: the codec's average and its residual afterwards."""
    codec = TopkCodec(NUMEL, world_size, False, CPU, k=k, shapes=[torch.Size(s) for s in SHAPES])
    link = Link(None, world_size)
    out = []
    for step in range(3):
        average = _send(codec, link, _gradient(rank, step), by_parameter=by_parameter)
        out.append((average, codec.residual.clone()))
    return out


@pytest.mark.parametrize("by_parameter", [True, False], ids=["taken-by-parameter", "taken-as-a-bucket"])
def test_topk_codec_is_the_average_of_every_ranks_k_largest_with_error_feedback(by_parameter: bool) -> None:
    """By hand: each rank adds its gradient into its residual, sends the k entries of largest magnitude and keeps
    the rest; the average is the sum of what the ranks sent over the world size."""
    k = 37
    results = run_warm(_topk_worker, 2, k, by_parameter)
    residuals = [torch.zeros(NUMEL) for _ in range(2)]
    for step in range(3):
        total = torch.zeros(NUMEL)
        for rank in range(2):
            acc = residuals[rank] + _gradient(rank, step)
            picked = torch.topk(acc.abs(), k).indices
            total[picked] += acc[picked]
            acc[picked] = 0
            residuals[rank] = acc
        for rank in range(2):
            average, residual = results[rank][step]
            torch.testing.assert_close(average, total / 2, rtol=0, atol=1e-7, msg=f"rank {rank}, step {step}")
            torch.testing.assert_close(residual, residuals[rank], rtol=0, atol=0, msg=f"rank {rank}, step {step}")


def _source_worker(rank: int, world_size: int) -> list[tuple[str, Tensor, Tensor]]:
    """A group with momentum: the codec compresses `source` (the velocity), not what `flat` holds. Per codec: its
    average of the source, and the same source sent plain."""
    link = Link(None, world_size)
    out = []
    for spec in ("dense", "fp16", "powersgd:2", "topk:0.05"):
        compressor = Compressor.parse(spec)
        seeds = np.random.RandomState(0)
        kwargs = {"layout": PowerSGDLayout.of(SHAPES, 2), "seed": int(seeds.randint(1_000_000_000)),
                  "k": max(1, int(0.05 * NUMEL)), "shapes": [torch.Size(s) for s in SHAPES]}
        with_source = make_codec(compressor, NUMEL, world_size, CPU, hierarchical=False, **kwargs)
        plain = make_codec(compressor, NUMEL, world_size, CPU, hierarchical=False, **kwargs)
        source = _gradient(rank, 7)
        flat = _gradient(rank, 9)  # garbage the codec must not read
        with_source.prepare(flat, source)
        handle = with_source.launch(link, flat)
        if handle is not None:
            handle.wait()
        with_source.finish(flat)
        out.append((spec, flat, _send(plain, link, source, by_parameter=False)))
    return out


def test_every_codec_compresses_the_source_it_is_given_as_it_compresses_a_plain_gradient() -> None:
    for rank_results in run_warm(_source_worker, 2):
        for spec, mine, expected in rank_results:
            torch.testing.assert_close(mine, expected, rtol=0, atol=0, msg=spec)


def test_codecs_keep_their_error_fed_back_and_give_it_back_from_a_saved_state() -> None:
    """One worker: top-k keeps what it did not send, PowerSGD what its approximation missed; dense and fp16 keep
    nothing. A codec loaded from another's state continues as it would have."""
    link = Link(None, 1)
    seeds = np.random.RandomState(0)
    seed = int(seeds.randint(1_000_000_000))

    def codecs() -> list[Codec]:
        return [DenseCodec(NUMEL, 1, False), Fp16Codec(NUMEL, 1, False, CPU),
                PowerSGDCodec(PowerSGDLayout.of(SHAPES, 1), 1, False, CPU, seed),
                TopkCodec(NUMEL, 1, False, CPU, k=50)]

    first, second = codecs(), codecs()
    for a in first:
        _send(a, link, _gradient(0, 0), by_parameter=False)
    errors = [a.error() for a in first]
    assert errors[0] is None and errors[1] is None
    assert errors[2] is not None and errors[3] is not None
    assert float(errors[2].abs().sum()) > 0 and int(torch.count_nonzero(errors[3])) == NUMEL - 50
    for a, b in zip(first, second, strict=True):
        b.load(a.state())
        torch.testing.assert_close(_send(b, link, _gradient(0, 1), by_parameter=False),
                                   _send(a, link, _gradient(0, 1), by_parameter=False), rtol=0, atol=0,
                                   msg=type(a).__name__)
    with pytest.raises(ValueError, match="keeps no state"):
        DenseCodec(NUMEL, 1, False).load({"residual": torch.zeros(NUMEL)})


def test_every_compressor_kind_has_its_codec() -> None:
    """A compressor added to `CompressorKind` without a codec fails here (and `make_codec` refuses it in one line)."""
    for kind in CompressorKind:
        compressor = Compressor.parse({"powersgd": "powersgd:2", "topk": "topk:0.1"}.get(kind.value, kind.value))
        codec = make_codec(compressor, NUMEL, 1, CPU, hierarchical=False, k=10, layout=PowerSGDLayout.of(SHAPES, 2))
        assert codec.kind is kind
