"""The commands a user runs: the command line (`planner ...`), `planner bench` (plans against DDP
and Horovod-style baselines on local workers, gradient and K-FAC), `planner tune`, `planner report`
and the solver benchmark. They sit on top: nothing below imports them.

Each command's arguments and glue are one module: solve, show, simulate, retune, demo, models, or NAME_cli
beside the module that does a command's work (bench_cli beside bench, profile_cli beside profile, ...);
what several commands share is in common (arguments) and printing (tables)."""
