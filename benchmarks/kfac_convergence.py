"""K-FAC against SGD with the hyperparameters a kfac-pytorch user brings, on the full-size built-in models.

    python benchmarks/kfac_convergence.py                     # mlp and cnn, digits and random data, 3 seeds
    python benchmarks/kfac_convergence.py --models cnn --tasks digits --seeds 0 --steps 200

One process, SGD lr 0.01 with momentum 0.9, and K-FAC (eigen, inverses every 5 steps, damping 1e-3, factor
decay 0.95, KL clip 1e-3) in front of the same SGD, from the same initial weights and batches. Tasks: digits
(scikit-learn's, upsampled to 28x28 for the MLP and 32x32x3 for the CNN) and random data as the built-in
workloads make it (normal inputs, uniform labels; a pool of 100 batches). Prints, per run, the first and
largest batch loss and the final training loss on all the task's data; tests/test_kfac_training.py runs the
same comparison at reduced width.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.digits: the task and the loop

from planner.models import build_workload
from planner.types import InverseMethod
from tests.digits import digits, train_digits


def task(model: str, data: str, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    if data == "digits":
        return digits(28) if model == "mlp" else digits(32, 3)
    g = torch.Generator().manual_seed(0)
    shape = (784,) if model == "mlp" else (3, 32, 32)
    return torch.randn(100 * batch, *shape, generator=g), torch.randint(0, 10, (100 * batch,), generator=g)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--tasks", default="digits,random")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--method", choices=[m.value for m in InverseMethod], default="eigen")
    parser.add_argument("--inv-update-steps", type=int, default=5)
    args = parser.parse_args()
    print(f"{'model':5} {'task':7} {'seed':>4}  {'SGD first->final':>17}  {'K-FAC first->final':>19}  "
          f"{'K-FAC max/first':>15}  {'K-FAC/SGD':>9}  {'s (SGD, K-FAC)':>15}")
    ratios: dict[tuple[str, str], list[float]] = {}
    for model in args.models.split(","):
        batch = build_workload(model).batch_size
        for data in args.tasks.split(","):
            x, y = task(model, data, batch)
            for seed in (int(s) for s in args.seeds.split(",")):
                runs = {}
                for kfac in (False, True):
                    module = build_workload(model, seed=seed).module
                    t0 = time.perf_counter()
                    losses, final = train_digits(module, x, y, kfac=kfac, seed=seed, steps=args.steps,
                                                 batch_size=batch, method=InverseMethod(args.method),
                                                 inv_update_steps=args.inv_update_steps)
                    runs[kfac] = (losses, final, time.perf_counter() - t0)
                (sgd, sgd_final, sgd_s), (kf, kf_final, kf_s) = runs[False], runs[True]
                ratio = kf_final / sgd_final
                ratios.setdefault((model, data), []).append(ratio)
                print(f"{model:5} {data:7} {seed:>4}  {sgd[0]:7.3f}->{sgd_final:8.4f}  {kf[0]:8.3f}->{kf_final:9.4f}  "
                      f"{max(kf) / kf[0]:15.2f}  {ratio:9.2f}  {sgd_s:6.0f}, {kf_s:6.0f}", flush=True)
    for (model, data), values in ratios.items():
        print(f"{model} on {data}: median K-FAC/SGD final loss {statistics.median(values):.2f} "
              f"(K-FAC below SGD on {sum(v < 1 for v in values)} of {len(values)} seeds)")


if __name__ == "__main__":
    main()
