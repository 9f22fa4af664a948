# The two set-up commands of the README: `make demo` (the main job) and `make test` (the tests).
# Both create .venv and install torch==2.13.0 before the project, so pip never resolves a newer
# torch with its CUDA packages. A GPU user can pre-install their own torch build into .venv. The project is then
# installed with the torch there as a constraint (.venv/torch-pin.txt), with the test tools and the extras the tests
# run (Lightning, Accelerate), so no dependency of theirs can replace it. pip byte-compiles what it installs one file
# at a time; compileall does it on every core: 72 s for the venv against 83 s (2026-12-03). A file it cannot compile
# (torch ships some for newer Pythons) is skipped, as pip skips it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: venv demo test test-thorough coverage lint docs view clean bench-env

$(BIN)/planner: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q --no-compile "$(TORCH)"
	$(BIN)/python -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/torch-pin.txt
	$(BIN)/python -m pip install -q --no-compile -c $(VENV)/torch-pin.txt -e ".[test,lightning,accelerate]"
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib > /dev/null 2>&1 || true
	touch $(BIN)/planner

venv: $(BIN)/planner

demo: venv
	$(BIN)/planner demo

# Two test processes (pytest-xdist): faster than one on 2 cores (docs/results/setup-times.md). worksteal: a process
# that runs out of tests takes pending ones from the other's queue, so that the suite does not end on one process.
test: venv
	$(BIN)/python -m pytest -q -n 2 --dist worksteal

# The same, every property test on ten times its examples (tests/factories.py `examples`).
test-thorough: venv
	PLANNER_TESTS=thorough $(BIN)/python -m pytest -q -n 2 --dist worksteal

# Line and branch coverage of planner/, runtime/ and profilers/ over the whole suite, every process included (the
# workers the tests spawn and the commands they run start coverage from a .pth hook, active only with
# COVERAGE_PROCESS_START). PYTEST_ARGS: what else pytest gets.
PYTEST_ARGS ?=
coverage: venv
	$(BIN)/python -c "import coverage" 2>/dev/null || $(BIN)/python -m pip install -q -c $(VENV)/torch-pin.txt "coverage>=7.4"
	echo 'import os; os.environ.get("COVERAGE_PROCESS_START") and __import__("coverage").process_startup()' > "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/planner-coverage.pth"
	rm -rf build/coverage && mkdir -p build/coverage
	COVERAGE_PROCESS_START=$(CURDIR)/pyproject.toml $(BIN)/python -m pytest -q $(PYTEST_ARGS)
	$(BIN)/coverage combine -q && $(BIN)/coverage report --skip-covered --sort=cover | tail -n 40

# The documentation site: the CLI reference regenerated from the parser, then built strict (a warning fails).
# mkdocstrings reads the API from the same linked view of the installed layout as mypy (below).
docs: venv view
	$(BIN)/python -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null || $(BIN)/python -m pip install -q -c $(VENV)/torch-pin.txt -e ".[docs]"
	$(BIN)/python -m planner.commands.cli_reference > docs/reference/cli.md.tmp && mv docs/reference/cli.md.tmp docs/reference/cli.md
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# mypy finds modules by folder and knows nothing of setuptools' package-dir, so it checks a view of the installed
# layout (pyproject.toml's [tool.mypy] files): build/typecheck/planner, links to the entries of planner/ and to
# runtime/ and profilers/ as planner/runtime and planner/profilers. Its messages name the real files.
TYPECHECK := build/typecheck/planner

view:
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)
	for entry in planner/* runtime profilers; do ln -s "$(CURDIR)/$$entry" $(TYPECHECK)/; done

lint: venv view
	$(BIN)/ruff check planner profilers runtime tests
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
	rm -rf $(VENV) $(BENCH_VENV) runs site *.egg-info .pytest_cache .mypy_cache .ruff_cache
