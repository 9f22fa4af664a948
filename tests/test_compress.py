"""Unit tests of top-k selection with error feedback, the pack/unpack wire format and decoding."""

from __future__ import annotations

import pytest
import torch

from planner.kernels.topk import MAX_NUMEL, decode, pack, select_topk, unpack


def _grad(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_select_topk_picks_largest_magnitudes() -> None:
    """The k entries of largest |grad + residual| are chosen, with their signed values."""
    grad = torch.tensor([0.1, -5.0, 0.3, 4.0, -0.2, 2.5, 0.0, -3.0])
    values, indices = select_topk(grad, torch.zeros(8), 3)
    assert values.dtype == torch.float32 and indices.dtype == torch.int32
    assert sorted(indices.tolist()) == [1, 3, 7]
    chosen = dict(zip(indices.tolist(), values.tolist(), strict=True))
    assert chosen == {1: -5.0, 3: 4.0, 7: -3.0}


def test_select_topk_residual_accounting() -> None:
    """values scattered + new residual == grad + old residual; the chosen entries are zero in the residual."""
    grad = _grad(1000)
    residual = _grad(1000, seed=1) * 0.5
    acc = grad + residual
    values, indices = select_topk(grad, residual, 37)
    assert values.shape == (37,) and indices.shape == (37,)
    assert len(set(indices.tolist())) == 37
    rebuilt = residual.clone()
    rebuilt[indices.long()] += values
    torch.testing.assert_close(rebuilt, acc, rtol=0, atol=0)
    assert torch.all(residual[indices.long()] == 0)
    # every selected magnitude is at least every magnitude left behind
    assert values.abs().min() >= residual.abs().max()


def test_select_topk_uses_error_feedback_over_steps() -> None:
    """An entry too small to be sent once is sent after it accumulated in the residual."""
    residual = torch.zeros(4)
    grad = torch.tensor([1.0, 0.4, 0.0, 0.0])
    _, idx1 = select_topk(grad, residual, 1)
    _, idx2 = select_topk(grad, residual, 1)
    values3, idx3 = select_topk(grad, residual, 1)
    assert idx1.tolist() == [0] and idx2.tolist() == [0]
    assert idx3.tolist() == [1] and values3.tolist() == pytest.approx([1.2])


def test_select_topk_everything_at_k_equal_numel() -> None:
    """k == numel sends every entry exactly and leaves the residual zero."""
    grad = _grad(50)
    residual = _grad(50, seed=2)
    acc = grad + residual
    values, indices = select_topk(grad, residual, 50)
    dense = torch.zeros(50)
    dense[indices.long()] = values
    torch.testing.assert_close(dense, acc, rtol=0, atol=0)
    assert torch.count_nonzero(residual) == 0


def test_select_topk_without_residual_leaves_grad_alone() -> None:
    grad = _grad(20)
    before = grad.clone()
    values, indices = select_topk(grad, None, 5)
    assert torch.equal(grad, before)
    assert torch.equal(values, grad[indices.long()])


@pytest.mark.parametrize(
    ("grad", "residual", "k"),
    [
        (torch.zeros(4), torch.zeros(4), 0),
        (torch.zeros(4), torch.zeros(4), 5),
        (torch.zeros(2, 2), torch.zeros(2, 2), 1),
        (torch.zeros(4, dtype=torch.float64), None, 1),
        (torch.zeros(4), torch.zeros(5), 1),
    ],
)
def test_select_topk_rejects_bad_arguments(grad: torch.Tensor, residual: torch.Tensor | None, k: int) -> None:
    with pytest.raises(ValueError, match=r"must|needs"):
        select_topk(grad, residual, k)


def test_pack_unpack_round_trip_with_large_indices() -> None:
    """Indices survive the fp32 reinterpretation bit for bit, including NaN and denormal patterns."""
    indices = torch.tensor([0, 1, 7, 2**23, 2**31 - 1, 0x7FC00000, 0x7F800001, 2**30 + 12345], dtype=torch.int32)
    values = torch.tensor([1.5, -0.0, float("inf"), 3.0, -2.0, 1e-30, 7.0, -1.0])
    buf = pack(values, indices)
    assert buf.dtype == torch.float32 and buf.shape == (16,)
    # the buffer survives copies and a concatenation, as in an allgather
    gathered = torch.cat([buf.clone(), buf.clone()])
    for part in gathered.view(2, 16):
        v, i = unpack(part.contiguous())
        assert torch.equal(i, indices)
        assert torch.equal(v.view(torch.int32), values.view(torch.int32))
    out = torch.empty(16)
    assert pack(values, indices, out=out) is out


def test_pack_rejects_mismatched_inputs() -> None:
    with pytest.raises(ValueError, match="int32"):
        pack(torch.zeros(3), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="even"):
        unpack(torch.zeros(3))


def test_decode_averages_over_ranks() -> None:
    """Overlapping indices add, and the sum is divided by the world size."""
    k, numel = 2, 6
    rank0 = pack(torch.tensor([1.0, 2.0]), torch.tensor([0, 5], dtype=torch.int32))
    rank1 = pack(torch.tensor([3.0, -4.0]), torch.tensor([5, 2], dtype=torch.int32))
    rank2 = pack(torch.tensor([6.0, 9.0]), torch.tensor([1, 0], dtype=torch.int32))
    gathered = torch.cat([rank0, rank1, rank2])
    dense = decode(gathered, k, numel, world_size=3)
    expected = torch.tensor([10.0, 6.0, -4.0, 0.0, 0.0, 5.0]) / 3
    torch.testing.assert_close(dense, expected)
    out = torch.full((numel,), 99.0)
    assert decode(gathered, k, numel, 3, out=out) is out
    torch.testing.assert_close(out, expected)


def test_select_pack_decode_at_full_density_is_the_mean() -> None:
    """k == numel: decoding every rank's message gives the dense average exactly (P = 2)."""
    grads = [_grad(300, seed=s) for s in range(2)]
    msgs = [pack(*select_topk(g, torch.zeros(300), 300)) for g in grads]
    dense = decode(torch.cat(msgs), 300, 300, 2)
    torch.testing.assert_close(dense, (grads[0] + grads[1]) / 2, rtol=0, atol=0)


def test_decode_checks_sizes() -> None:
    with pytest.raises(ValueError, match="world_size"):
        decode(torch.zeros(10), 2, 8, 2)


def test_max_numel_is_int32() -> None:
    assert torch.iinfo(torch.int32).max == MAX_NUMEL
