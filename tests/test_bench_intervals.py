"""The bench's speedup intervals (`paired_speedup_interval`): two variants' steps, run interleaved in rounds,
resampled a round at a time so that what a round's noise did to both stays paired."""

from __future__ import annotations

import numpy as np
import pytest

from planner.sessions.bench import BenchResult, paired_speedup_interval


def interleaved(rng: np.random.Generator, rounds: int, block: int, ratio: float, spell: float = 0.3,
                jitter: float = 0.03) -> tuple[np.ndarray, np.ndarray]:
    """Two variants' step times, `block` steps of each to a round: a shared spell of noise per round (the machine's
    load, `spell` its spread in log) and each step's own jitter; the variant `ratio` times the reference's steps."""
    load = np.repeat(np.exp(rng.normal(0.0, spell, rounds)), block)
    ref = 0.1 * load * np.exp(rng.normal(0.0, jitter, rounds * block))
    arm = 0.1 * ratio * load * np.exp(rng.normal(0.0, jitter, rounds * block))
    return ref, arm


def test_the_same_steps_have_no_spread() -> None:
    steps = [0.1, 0.12, 0.11, 0.3, 0.09, 0.1, 0.13]  # 3 rounds of 3, the last one short
    assert paired_speedup_interval(steps, steps, 3) == (1.0, 1.0)
    assert paired_speedup_interval(steps, [1.25 * s for s in steps], 3) == pytest.approx((0.8, 0.8))


def test_pairing_by_rounds_tells_a_gain_apart_from_the_machines_spells() -> None:
    """A variant 5% faster on a machine whose load moves 30% from round to round, 10 simulated benches of 20
    rounds: the paired intervals are less than half as wide as resampling each variant's steps on their own
    (unpaired) would make them, and most exclude no gain."""
    rng = np.random.default_rng(0)
    paired, unpaired, gains = [], [], 0
    for _ in range(10):
        ref, arm = interleaved(rng, rounds=20, block=5, ratio=1 / 1.05)
        low, high = paired_speedup_interval(ref, arm, 5)
        paired.append(high - low)
        gains += low > 1.0
        apart = (np.median(ref[rng.integers(0, ref.size, size=(1000, ref.size))], axis=1)
                 / np.median(arm[rng.integers(0, arm.size, size=(1000, arm.size))], axis=1))
        lo_u, hi_u = np.quantile(apart, [0.05, 0.95])
        unpaired.append(hi_u - lo_u)
    assert np.mean(paired) < 0.5 * np.mean(unpaired)
    assert gains >= 8


def test_the_interval_covers_the_true_speedup_about_as_often_as_it_says() -> None:
    """Over 200 simulated benches (the true speedup 1.03), the 90% interval holds it in at least 80% of them (a
    percentile bootstrap of 30 rounds runs a little short of its level)."""
    rng = np.random.default_rng(11)
    held = 0
    for _ in range(200):
        ref, arm = interleaved(rng, rounds=30, block=5, ratio=1 / 1.03)
        low, high = paired_speedup_interval(ref, arm, 5, draws=400)
        held += low <= 1.03 <= high
    assert held >= 160


def test_variants_not_run_in_the_same_rounds_are_refused() -> None:
    with pytest.raises(ValueError, match="same rounds"):
        paired_speedup_interval([0.1, 0.1, 0.1], [0.1, 0.1], 2)
    with pytest.raises(ValueError, match="same rounds"):
        paired_speedup_interval([], [], 2)


def test_a_row_keeps_its_steps_and_interval_in_its_json() -> None:
    row = BenchResult.from_samples("x", "dense", [0.10, 0.11, 0.12], steps=3, predicted_s=0.1, reference="ddp")
    assert row.samples_s == (0.10, 0.11, 0.12)
    assert "samples_s" not in row.to_dict()  # kept only where the rounds are known (the bench's own rows)
    benched = row.__class__(**{**row.__dict__, "block": 2, "speedup_interval": (0.9, 1.1)}).to_dict()
    assert benched["samples_s"] == [0.10, 0.11, 0.12] and benched["block"] == 2
    assert benched["speedup_interval"] == [0.9, 1.1]
