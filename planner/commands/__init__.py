"""The commands a user runs: the command line (`planner ...`), `planner bench` (plans against DDP
and Horovod-style baselines on local workers, gradient and K-FAC), `planner tune`, `planner report`
and the solver benchmark. They sit on top: nothing below imports them."""
