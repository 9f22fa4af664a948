"""The cost model: cost curves of message size, the gradient problem a profile poses, the simulator that times any
grouping on it, and the statistics of measured samples (`spread`). Pure arithmetic on numbers: no files, no torch.

Two modules read the profile contract on top of that arithmetic: `from_profile` (the profile's measurements as the
solvers' instances) and `resample` (profiles drawn from the samples it kept)."""
