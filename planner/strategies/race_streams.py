"""Synthetic block times of a race on a drifting machine, to study the race's rule (tests/test_race.py and
benchmarks/budget_rule_study.py): the timing streams a shared machine makes, where the arms' true medians are known."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["drifting_blocks"]


def drifting_blocks(means: Sequence[float], rounds: int, rng: np.random.Generator, *,
                    noise: float = 0.02) -> np.ndarray:
    """Block times (rounds x arms) of arms whose medians are `means`, on a machine that drifts as a shared one does:

    - a trend: the machine slows by 30% over the rounds and wanders by 15% either way (a slow wave), alike for the
      blocks of one round;
    - within a round the arms run in a random order (as the race draws it) and the machine slows 0.4% per block, so
      an arm's place in its round matters;
    - bursts: spells (one starts in 5% of the rounds and lasts about 3) in which each block is hit with chance 1/2
      and runs 20-80% slower;
    - heavy tails: Student's t noise with 3 degrees of freedom, of scale `noise`, on each block's log time.

    Every arm meets the same machine (its order, its bursts and its noise are drawn alike), so the median of two arms'
    block ratio in a round is exactly the ratio of their `means`."""
    arms = len(means)
    r = np.arange(rounds)
    machine = 0.3 * r / rounds + 0.15 * np.sin(2 * np.pi * r / 37 + rng.uniform(0, 2 * np.pi))
    place = np.argsort(rng.random((rounds, arms)), axis=1)  # each arm's place in its round's random order
    spell = np.zeros(rounds, dtype=bool)
    draws = rng.random(rounds)
    for t in range(1, rounds):
        spell[t] = draws[t] < (0.7 if spell[t - 1] else 0.05)
    hit = spell[:, None] & (rng.random((rounds, arms)) < 0.5)
    burst = np.where(hit, np.log1p(rng.uniform(0.2, 0.8, (rounds, arms))), 0.0)
    log = (np.log(means)[None, :] + machine[:, None] + 0.004 * place + burst
           + noise * rng.standard_t(3, (rounds, arms)))
    return np.exp(log)
