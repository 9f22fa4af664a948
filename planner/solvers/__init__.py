"""The solvers, each family behind one small interface:

- `grouping`: gradient groups (`GroupingSolver`: the exact `DenseDP` and `TopkParetoDP`, the baselines);
- `fusion`: K-FAC factor buffers (`FusionSolver`: the exact `FusionDP`, the baselines);
- `placement`: K-FAC inversion owners (`PlacementSolver`: CBC and CP-SAT models, the published rules).

`tests/test_solver_conformance.py` runs one conformance test over all of them. The grouping family is
re-exported here (`from planner.solvers import DenseDP` is how the rest of the code reaches it).
"""

from __future__ import annotations

from planner.solvers.grouping import (
    BASELINES,
    DDP_BASELINE,
    DDP_BUCKET_BYTES,
    DDP_FIRST_BUCKET_BYTES,
    FIXED_64MB_BYTES,
    HOROVOD_CYCLE_S,
    HOROVOD_FUSION_BYTES,
    DenseDP,
    FixedBuckets,
    GroupingSolver,
    HorovodCycle,
    MGSGreedy,
    MGWFBPGreedy,
    PerLayer,
    SingleBucket,
    Solved,
    TopkParetoDP,
    lower_bound,
    solve_exact,
    within_group_bounds,
)

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
    "lower_bound",
    "solve_exact",
    "within_group_bounds",
]
