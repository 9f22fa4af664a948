"""Run by tests/test_frameworks.py under torchrun (2 gloo ranks), from tests/lightning_momentum.py's launch (`fit`):
the task of tests/test_adaptive.py in PyTorch Lightning, its plan run by `lightning_strategy(..., adaptive=...)`.
Writes this rank's plan in use, the plan a resumed hook adopts, the re-plans and how far each weight moved to
`adaptive-rank{R}.pt`. Runs alone too:

    torchrun --nproc_per_node 2 tests/lightning_adaptive.py PLAN PROFILE STEPS
"""

import sys

import lightning as L
import torch
from torch.utils.data import DataLoader

from planner.contracts.plan import Plan
from planner.runtime import PlanHook
from planner.runtime.frameworks import lightning_strategy
from tests.test_adaptive import SCHEDULE, TwoMatrices, gradients


class LitTwoMatrices(L.LightningModule):
    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        return self.net(*batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


def fit(plan_path: str, profile_path: str, steps: int) -> None:
    net = TwoMatrices()
    initial = [p.detach().clone() for p in net.parameters()]
    strategy = lightning_strategy(plan_path, module=net, adaptive=SCHEDULE, profile=profile_path)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, use_distributed_sampler=False,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    rank = trainer.global_rank
    loader = DataLoader([gradients(rank, step) for step in range(steps)], batch_size=None)
    trainer.fit(LitTwoMatrices(net), loader)
    hook = strategy.hook
    resumed = PlanHook(TwoMatrices(), Plan.load(plan_path), adaptive=SCHEDULE, profile=profile_path)
    resumed.load_state_dict(hook.state_dict())
    torch.save({
        "plan": hook.plan.to_dict(),
        "resumed": resumed.plan.to_dict(),
        "replans": [(r.step, r.changed, r.reason, r.error_before, r.error_after, r.budget) for r in hook.replans],
        "moved": [(p0 - p.detach()).numpy() for p0, p in zip(initial, net.parameters(), strict=True)],
        "names": [n for n, _ in net.named_parameters()],
    }, f"adaptive-rank{rank}.pt")


if __name__ == "__main__":
    fit(sys.argv[1], sys.argv[2], int(sys.argv[3]))
