"""Your own model, as the planner builds it: `planner profile --model my_workloads:small_lm` (with this file's folder
on PYTHONPATH). `factory()` returns a Workload: the module, the per-worker batch, how to draw a batch, the loss."""

# --8<-- [start:factory]
import torch
from torch import nn

from planner.models import Workload

VOCAB, WIDTH, SEQ = 1000, 64, 32


class SmallLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return self.head(self.norm(x + self.mix(x)))


def small_lm() -> Workload:
    torch.manual_seed(0)  # every rank builds the same weights
    return Workload(
        name="small-lm",  # shown in tables and stored in the profile
        module=SmallLM(),  # any torch.nn.Module
        batch_size=16,  # per-worker batch the profile measures at
        # (inputs, targets) of n samples drawn from the generator g: synthetic data is enough, only shapes matter
        make_batch=lambda n, g: (torch.randint(0, VOCAB, (n, SEQ), generator=g),
                                 torch.randint(0, VOCAB, (n, SEQ), generator=g)),
        loss_fn=lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()),
    )
# --8<-- [end:factory]
