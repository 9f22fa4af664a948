"""What a command does, as a library call: profile a model (`profile.py`), measure plans in real steps (`bench*.py`),
run a plan's trials (`trial.py`), tune a plan by measurement (`tune.py`), pair two jobs (`pair.py`), draw a report
(`report.py`) and time the solvers (`solver_bench.py`). Each session starts workers or runs a study and returns its
results; the commands above parse flags, call one session and print."""
