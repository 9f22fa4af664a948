"""The cost model: cost curves of message size, the problems a profile poses (`from_profile`), and the
simulator that times any grouping on it. Pure arithmetic on numbers: no files, no torch."""
