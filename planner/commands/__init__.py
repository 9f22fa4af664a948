"""The commands a user runs: the command line (`planner ...`), `planner bench` (plans against DDP
and Horovod-style baselines on local workers, gradient and K-FAC), `planner tune`, `planner report`
and the solver benchmark. They sit on top: nothing below imports them.

Each command's arguments and glue are one module: solve, show, simulate, retune, demo, models, or NAME_cli
beside the module that does a command's work (bench_cli beside bench, profile_cli beside profile, ...);
what several commands share is in common (arguments) and printing (tables).

`planner --help` imports every command module (cli registers a command by importing its module), so a command
module imports at its top only the standard library, rich and light modules of the base and the contracts
(planner.types, planner.console, planner.contracts.plan, ...), none of which loads torch or numpy. What a command's
work needs (the sessions, strategies, solvers, cost model, runtime and profilers, the contracts that load numpy,
torch) it imports inside the function that needs it, each such line marked `# deferred (start-up)`
(tests/test_packaging.py checks what importing the commands loads)."""
