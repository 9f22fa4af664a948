"""The fp16 and PowerSGD compressors (planner/kernels/compress.py) against PyTorch's own DDP hooks on the same
tensors: `fp16_compress_hook` and `powerSGD_hook` run on a bucket holding the same gradients, on the same two
gloo ranks, with the same seed, over several steps (error feedback and warm start carry over)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from planner.kernels.compress import (
    PowerSGDGroup,
    PowerSGDLayout,
    fp16_compress,
    fp16_decompress,
    orthogonalize,
    should_compress,
)
from tests.pool import run_warm

#: Tensors of a group as real models have them: a conv weight, its bias, a linear weight, a small matrix
#: that PowerSGD leaves whole at rank 4 (3 x 5), an embedding-like tall matrix.
SHAPES = ((16, 8, 3, 3), (16,), (10, 64), (3, 5), (200, 12))


class FakeBucket:
    """What DDP's hooks read of a bucket: its flat buffer, the per-parameter views, its index, whether last."""

    def __init__(self, buffer: torch.Tensor, shapes: tuple[tuple[int, ...], ...]) -> None:
        self._buffer = buffer
        self._views, at = [], 0
        for shape in shapes:
            n = int(np.prod(shape))
            self._views.append(buffer[at : at + n].view(shape))
            at += n

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


def _gradient(rank: int, step: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 * step + rank))


def _numel() -> int:
    return sum(int(np.prod(s)) for s in SHAPES)


def _powersgd_worker(rank: int, world_size: int, rank_r: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step: the hook's averaged bucket and this group's, from the same gradients."""
    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=rank_r, start_powerSGD_iter=2,
                                        random_seed=0)
    state.iter = state.start_powerSGD_iter  # compress from the first call, as the runtime does
    seeds = np.random.RandomState(0)
    group = PowerSGDGroup(PowerSGDLayout.of(SHAPES, rank_r), torch.device("cpu"), seeds.randint(1_000_000_000))
    out = []
    for step in range(steps):
        grad = _gradient(rank, step, _numel())
        bucket = FakeBucket(grad.clone(), SHAPES)
        expected = powerSGD_hook.powerSGD_hook(state, bucket).wait().clone()  # type: ignore[arg-type]
        send = group.compress(grad)
        dist.all_reduce(send)
        q = group.middle(world_size)
        if group.layout.compresses:
            dist.all_reduce(q)
        mine = torch.empty(_numel())
        group.decompress(mine, world_size)
        out.append((expected, mine))
    return out


@pytest.mark.parametrize("rank_r", [1, 2, 4])
def test_powersgd_equals_pytorch_hook(rank_r: int) -> None:
    """Ranks 1 and 2 (Gram-Schmidt) and 4 (QR): the same averaged gradients as powerSGD_hook, to the bit, over
    four steps (the first draws random Qs; the later ones warm-start them and feed the error back)."""
    results = run_warm(_powersgd_worker, 2, rank_r, 4)
    for rank_results in results:
        for step, (expected, mine) in enumerate(rank_results):
            torch.testing.assert_close(mine, expected, rtol=0, atol=0, msg=f"step {step}")
    # The approximation is lossy but not degenerate: after four steps it is correlated with the mean gradient.
    last_mean = (_gradient(0, 3, _numel()) + _gradient(1, 3, _numel())) / 2
    expected = results[0][3][0]
    assert torch.cosine_similarity(expected, last_mean, dim=0) > 0.1


def _fp16_worker(rank: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for step in range(2):
        grad = _gradient(rank, step, 4099) * torch.logspace(-9, 3, 4099)  # fp16 subnormals and large values
        bucket = FakeBucket(grad.clone(), ((4099,),))
        expected = default_hooks.fp16_compress_hook(None, bucket).wait().clone()  # type: ignore[arg-type]
        half = torch.empty(4099, dtype=torch.float16)
        fp16_compress(grad, half, world_size)
        dist.all_reduce(half)
        mine = torch.empty(4099)
        fp16_decompress(half, mine)
        out.append((expected, mine))
    return out


def test_fp16_equals_pytorch_hook() -> None:
    for rank_results in run_warm(_fp16_worker, 2):
        for expected, mine in rank_results:
            torch.testing.assert_close(mine, expected, rtol=0, atol=0)


def test_layout_compresses_as_powersgd_does() -> None:
    """Matrices worth it are compressed at min(rank, n, m); vectors and small matrices are sent whole."""
    layout = PowerSGDLayout.of(SHAPES, 4)
    compressed = {(n, m, r) for _, n, m, r, _, _ in layout.matrices}
    assert compressed == {(16, 72, 4), (10, 64, 4), (200, 12, 4)}
    assert [numel for _, numel in layout.uncompressed] == [16, 15]
    assert layout.numel == _numel()
    assert layout.p_numel == (16 + 10 + 200) * 4 and layout.q_numel == (72 + 64 + 12) * 4
    assert should_compress(10, 64, 4) and not should_compress(3, 5, 1) and not should_compress(8, 8, 4)
    whole = PowerSGDLayout.of(((16,), (3, 5)), 1)
    assert not whole.compresses and whole.send_numel == 31


@pytest.mark.parametrize("rank_r", [1, 2, 3, 6])
def test_orthogonalize_gives_orthonormal_columns(rank_r: int) -> None:
    x = torch.randn(3, 40, rank_r, generator=torch.Generator().manual_seed(rank_r), dtype=torch.float64)
    span = x.clone()
    orthogonalize(x)
    eye = torch.eye(rank_r, dtype=torch.float64).expand(3, -1, -1)
    torch.testing.assert_close(x.transpose(1, 2) @ x, eye, rtol=0, atol=1e-10)
    # same column space: projecting the input on the new basis loses nothing
    torch.testing.assert_close(x @ (x.transpose(1, 2) @ span), span, rtol=0, atol=1e-9)


def test_powersgd_single_process_is_error_feedback_exact() -> None:
    """On one worker, what is applied plus the new error is exactly the input (nothing is lost, only delayed)."""
    group = PowerSGDGroup(PowerSGDLayout.of(SHAPES, 2), torch.device("cpu"), seed=7)
    previous_error = torch.zeros(_numel())
    for step in range(3):
        grad = _gradient(0, step, _numel())
        group.compress(grad)
        group.middle(1)
        out = torch.empty(_numel())
        group.decompress(out, 1)
        torch.testing.assert_close(out + group.error, grad + previous_error, rtol=1e-6, atol=1e-6)
        previous_error = group.error.clone()


@pytest.mark.parametrize("rank_r", [1, 2, 4])
def test_powersgd_after_a_step_where_a_matrix_got_no_gradient_stays_finite_and_not_stuck_at_zero(rank_r: int) -> None:
    """A parameter no rank used sends zeros: PyTorch's Gram-Schmidt divides them by their zero norm into NaNs (which
    its warm start keeps), and a zero Q would approximate every later gradient by zero. Here the zero step sends
    zeros, and the next step approximates the matrix's gradient again, as a group that never saw the zero step."""
    shapes = [(16, 8), (8, 16)]
    numel = 16 * 8 * 2
    zero_first = torch.cat([torch.zeros(128), torch.randn(128, generator=torch.Generator().manual_seed(1))])
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(2))
    group = PowerSGDGroup(PowerSGDLayout.of(shapes, rank_r), torch.device("cpu"), seed=7)
    for step, source in enumerate((zero_first, grad)):
        group.compress(source)
        group.middle(1)
        out = torch.empty(numel)
        group.decompress(out, 1)
        assert torch.isfinite(out).all() and torch.isfinite(group.error).all(), f"step {step}"
        if step == 0:
            assert not out[:128].any()  # nothing to send for the unused matrix
    first = out[:128]
    assert first.norm() > 0.1 * grad[:128].norm(), "the matrix's approximation stays zero after its zero step"
    if rank_r <= 2:  # the hook's own orthogonalisation, for the record: NaNs where the column is zero
        zeros = torch.zeros(1, 16, rank_r)
        powerSGD_hook._orthogonalize(zeros)
        assert torch.isnan(zeros).all()
