"""Solvers that choose how to merge per-layer gradients into groups (one collective per group).

Exact solvers (dynamic programs over prefixes of the ready order, `exact`):

- `DenseDP`: MG-WFBP's problem, E*(j) = min over i of max(E*(i-1), R_j) + T(n_i..n_j), O(L^2).
- `TopkParetoDP`: MGS's problem, a Pareto front of two clocks per prefix (exact, see its docstring; the search is
  `pareto`).

Baselines (`baselines`; `exact = False`, evaluated with the same model so that comparisons are fair): one
collective per layer (WFBP), one bucket for everything, PyTorch DDP's buckets, Horovod's fusion cycle, fixed 64 MiB
buckets, and the greedy merge rules published with MG-WFBP and MGS.

`lower_bound` (`bounds`) is a bound no grouping can beat under the timeline model. Every solver answers with a
`Grouping` (tuple of exclusive group ends); `planner.costmodel.simulator.simulate` evaluates it.

`base` holds the interface (`GroupingSolver`, `Solved`), the vectorised pieces of the model the solvers share, and
the group-size bounds of the exact solvers (`min_group_bytes` / `max_group_bytes`; the rule is in its docstring,
and `within_group_bounds` tests a grouping).
"""

from __future__ import annotations

from planner.solvers.grouping.base import GroupingSolver, Solved, within_group_bounds
from planner.solvers.grouping.baselines import (
    BASELINES,
    DDP_BASELINE,
    DDP_BUCKET_BYTES,
    DDP_FIRST_BUCKET_BYTES,
    FIXED_64MB_BYTES,
    HOROVOD_CYCLE_S,
    HOROVOD_FUSION_BYTES,
    FixedBuckets,
    HorovodCycle,
    MGSGreedy,
    MGWFBPGreedy,
    PerLayer,
    SingleBucket,
)
from planner.solvers.grouping.bounds import lower_bound
from planner.solvers.grouping.exact import DenseDP, TopkParetoDP, solve_exact
from planner.solvers.grouping.pareto import beaten_by_a_sample

__all__ = [
    "BASELINES",
    "DDP_BASELINE",
    "DDP_BUCKET_BYTES",
    "DDP_FIRST_BUCKET_BYTES",
    "FIXED_64MB_BYTES",
    "HOROVOD_CYCLE_S",
    "HOROVOD_FUSION_BYTES",
    "DenseDP",
    "FixedBuckets",
    "GroupingSolver",
    "HorovodCycle",
    "MGSGreedy",
    "MGWFBPGreedy",
    "PerLayer",
    "SingleBucket",
    "Solved",
    "TopkParetoDP",
    "beaten_by_a_sample",
    "lower_bound",
    "solve_exact",
    "within_group_bounds",
]
