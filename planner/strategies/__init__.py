"""Strategies turn a profile into a plan: gradient groupings (dense or top-k), the K-FAC plan
(fusion buffers and inversion owners), what a profile becomes on another cluster, and re-tuning a
plan when the cluster changes. Each poses its problem on the cost model and hands it to the
solvers."""
