"""What the tests check the solvers with: random but realistic instances of their problems, reproducible from a seed
(`problems`; `planner bench-solvers` times the solvers on them too), and brute-force references of the exact
solvers on small instances (`brute_force`).

The layer above the solvers: it imports the solvers, the cost model and below; in the package only the commands
import it (the solver benchmark's engine, `planner.sessions.solver_bench`).
"""

from __future__ import annotations

from planner.testing.brute_force import (
    brute_force_fusion,
    brute_force_layout,
    brute_force_packing,
    brute_force_placement,
)
from planner.testing.problems import (
    random_fusion_problem,
    random_layout_problem,
    random_packing_problem,
    random_placement_problem,
    random_problem,
)

__all__ = [
    "brute_force_fusion",
    "brute_force_layout",
    "brute_force_packing",
    "brute_force_placement",
    "random_fusion_problem",
    "random_layout_problem",
    "random_packing_problem",
    "random_placement_problem",
    "random_problem",
]
