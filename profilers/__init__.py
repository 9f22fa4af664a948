"""The measurements behind `planner profile` (planner/commands/profile.py runs them on N workers):
per-layer compute (`layers.py`), collectives (`comm.py`), top-k selection and decoding (`topk.py`),
K-FAC factors and decompositions (`kfac.py`), interference of communication with compute
(`interference.py`), and the quick probe of the cluster that re-tuning uses (`probe.py`). They
import no runtime class: what the runtime's own work costs it measures itself (`planner.runtime.calibrate`)."""

if __name__ == "profilers":
    # This folder found as the top-level `profilers` (the repository root on sys.path): the old import path. Its
    # name becomes the module `planner.profilers` itself, with a DeprecationWarning (see planner/_aliases.py).
    from planner._aliases import alias_package

    alias_package("profilers", "planner.profilers")
