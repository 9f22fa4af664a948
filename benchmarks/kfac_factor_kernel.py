"""Time K-FAC's A factor the two ways: from the rows (unfolded patches, transposed, a ones column appended,
divided) and from sums of patch products (`planner.kernels.kfac_factors.input_covariance`, what the runtime runs).

    python benchmarks/kfac_factor_kernel.py                 # the built-in CNN's convolutions, batch 32
    python benchmarks/kfac_factor_kernel.py --threads 2 --repeats 9

One process, float32, `--threads` intra-op threads (the benches run one per worker). Prints, per layer shape,
the median of `--repeats` calls each way, their ratio, and the largest difference between the two results.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planner.kernels.kfac_factors import covariance, input_covariance, input_rows

#: (in channels, out channels, input size, bias): the built-in CNN's convolutions and one with a bias.
SHAPES = [(3, 32, 32, False), (32, 32, 32, False), (32, 64, 16, False), (64, 128, 16, False), (32, 32, 32, True)]


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"batch {args.batch}, {args.threads} thread(s), median of {args.repeats}")
    print(f"{'conv (in, out, size, bias)':>28} {'rows ms':>9} {'sums ms':>9} {'ratio':>7} {'max |diff|':>11}")
    for cin, cout, size, bias in SHAPES:
        module = nn.Conv2d(cin, cout, 3, padding=1, bias=bias)
        x = torch.randn(args.batch, cin, size, size)
        rows_ms = median_ms(lambda: covariance(input_rows(module, x, torch.float32)), args.repeats)  # noqa: B023
        sums_ms = median_ms(lambda: input_covariance(module, x, torch.float32), args.repeats)  # noqa: B023
        diff = (covariance(input_rows(module, x, torch.float32)) - input_covariance(module, x, torch.float32))
        print(f"{(cin, cout, size, bias)!s:>28} {rows_ms:9.1f} {sums_ms:9.1f} {rows_ms / sums_ms:6.2f}x "
              f"{diff.abs().max().item():11.2e}")


if __name__ == "__main__":
    main()
