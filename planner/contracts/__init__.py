"""The contracts between the profiler, the solvers and the runtime: the profile and plan files (with
their K-FAC section), the model and cluster fingerprints that tie them together, how a plan's
groups map onto a model's parameters, and bounded JSON reading and atomic writing. Loading any of
these files only ever parses data."""
