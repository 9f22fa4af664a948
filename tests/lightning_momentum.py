"""Run by tests/test_frameworks.py under torchrun (2 gloo ranks): first docs/snippets/train_lightning.py itself, as
its own launch would run it (its lines and `model.pt`; then "rank R: train_lightning.py done" on stderr); then the
small LM's plan (PowerSGD, top-k, dense) in Lightning with SGD's momentum in the hook
(`lightning_strategy(momentum=0.9)`, the optimizer at momentum 0), its parameters saved to `momentum.pt`; then the
same plan with the momentum in the optimizer instead, which the strategy refuses on the plan's top-k groups (printed
as "rank R refused: ..."). Given an adaptive plan, its profile and a number of steps too, it then runs
tests/lightning_adaptive.py's fit in the same processes (one launch, Lightning imported once, for all three of the
test's Lightning cases).

    torchrun --nproc_per_node 2 tests/lightning_momentum.py PLAN [ADAPTIVE_PLAN PROFILE STEPS]
"""

import os
import runpy
import sys
from pathlib import Path

import lightning as L
import torch
from my_workloads import small_lm
from torch.utils.data import DataLoader

from planner.runtime.frameworks import lightning_strategy

MOMENTUM = 0.9
SNIPPET = Path(__file__).resolve().parents[1] / "docs" / "snippets" / "train_lightning.py"


class LitModel(L.LightningModule):
    def __init__(self, net: torch.nn.Module, loss_fn, momentum: float) -> None:
        super().__init__()
        self.net, self.loss_fn, self.momentum = net, loss_fn, momentum

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return self.loss_fn(self.net(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=self.momentum)


def fit(optimizer_momentum: float, **strategy_kwargs) -> tuple[L.Trainer, torch.nn.Module]:
    workload = small_lm()
    net = workload.module
    generator = torch.Generator().manual_seed(int(os.environ["RANK"]))  # each rank its own data
    loader = DataLoader([workload.make_batch(workload.batch_size, generator) for _ in range(5)], batch_size=None)
    strategy = lightning_strategy(sys.argv[1], module=net, **strategy_kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, use_distributed_sampler=False,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(LitModel(net, workload.loss_fn, optimizer_momentum), loader)
    return trainer, net


argv = sys.argv
sys.argv = [str(SNIPPET), argv[1]]  # the snippet's command line: `train_lightning.py PLAN`
runpy.run_path(str(SNIPPET), run_name="__main__")
sys.argv = argv
print(f"rank {os.environ['RANK']}: {SNIPPET.name} done", file=sys.stderr, flush=True)

trainer, net = fit(0.0, momentum=MOMENTUM)
rank = trainer.global_rank
print(f"rank {rank} checksum {sum(p.sum().item() for p in net.parameters()):.6f}", flush=True)
if rank == 0:
    torch.save(net.state_dict(), "momentum.pt")
try:
    fit(MOMENTUM)
except ValueError as exc:
    print(f"rank {rank} refused: {exc}", flush=True)
if len(sys.argv) > 2:  # last: tests/test_adaptive.py's TwoMatrices seeds the global generator
    from tests.lightning_adaptive import fit as fit_adaptive

    fit_adaptive(sys.argv[2], sys.argv[3], int(sys.argv[4]))
