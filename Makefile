# The two set-up commands of the README: `make demo` (the main job) and `make test` (the tests).
# Both create .venv and install torch==2.13.0 before the project, so pip never resolves a newer
# torch with its CUDA packages. A GPU user can pre-install their own torch build into .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: venv demo test lint clean bench-env

$(BIN)/planner: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(BIN)/planner

venv: $(BIN)/planner

demo: venv
	$(BIN)/planner demo

test: venv
	$(BIN)/python -m pytest -q

# mypy finds modules by folder and knows nothing of setuptools' package-dir, so it checks a view of the installed
# layout (pyproject.toml's [tool.mypy] files): build/typecheck/planner, links to the entries of planner/ and to
# runtime/ and profilers/ as planner/runtime and planner/profilers. Its messages name the real files.
TYPECHECK := build/typecheck/planner

lint: venv
	$(BIN)/ruff check planner profilers runtime compat tests
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)
	for entry in planner/* runtime profilers; do ln -s "$(CURDIR)/$$entry" $(TYPECHECK)/; done
	$(BIN)/mypy

# A benchmark's environment: the project and the peers its benches run beside it (kfac-pytorch, whose source is in
# ../shared/peers). Never a dependency of the project: `make test` and `make demo` do not use it.
BENCH_VENV := .venv-bench
PEERS ?= ../shared/peers

bench-env:
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -c "import torch" 2>/dev/null || $(BENCH_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(BENCH_VENV)/bin/python -m pip install -q -e ".[test]"
	$(BENCH_VENV)/bin/python -m pip install -q --no-deps -e $(PEERS)/kfac-pytorch

clean:
	rm -rf $(VENV) $(BENCH_VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache
