"""The measurements behind `planner profile` (planner/sessions/profile.py runs them on N workers):
per-layer compute (`layers.py`), collectives (`comm.py`), top-k selection and decoding (`topk.py`),
the costs of K-FAC factors and decompositions (`kfac_costs.py`), interference of communication with compute
(`interference.py`), and the quick probe of the cluster that re-tuning uses (`probe.py`). They
import no runtime class: what the runtime's own work costs it measures itself (`planner.runtime.calibrate`)."""

if __name__ != "planner.profilers":  # this folder found as a top-level package (run from the repository root)
    raise ImportError(f"`{__name__}` is not a module of this project: import `planner.profilers` "
                      "(the folder profilers/ is installed under that name)")
