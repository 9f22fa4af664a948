"""The cost model: cost curves of message size, the gradient problem a profile poses (`from_profile` reads it
from a profile), and the simulator that times any grouping on it. Pure arithmetic on numbers: no files, no torch."""
