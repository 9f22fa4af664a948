"""Kernels below both the profiler and the runtime: what one times, the other runs."""
