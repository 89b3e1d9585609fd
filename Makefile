# dsim: `make train` and `make test` set up .venv (dsim and its Open MPI from PyPI) on first use.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
NP ?= 8
CONFIG ?= configs/default.yaml
ENV := . launch/env.sh &&
MPIRUN := $(VENV)/bin/mpirun
TEST_TIMEOUT ?= 2700
# the end-to-end stage's pytest-xdist workers: two 8-rank jobs at a time on 2 cores keep both busy while one job
# waits (a campaign's budget, a launcher's start); 0 runs them one at a time
E2E_WORKERS ?= 2

.PHONY: venv bytecode train test test-serial test-mpi test-e2e check check-mpi check-e2e bench docs docs-serve clean

venv: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml launch/env.sh Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,plot,docs]'  # plot: the loss-curve test runs too; docs: mkdocs --strict is a test
	@# the environment's activate script carries the Open MPI settings (see launch/env.sh)
	sed -i '/# >>> dsim >>>/,/# <<< dsim <<</d' $(VENV)/bin/activate
	{ echo '# >>> dsim >>>'; cat launch/env.sh; echo '# <<< dsim <<<'; } >> $(VENV)/bin/activate
	touch $@

# NP training ranks, plus the warm spares the config asks for (tft.spares); evaluated when `train` runs
PROCESSES = $(shell echo $$(( $(NP) + $$($(PY) -m dsim.ft.spare_count --config $(CONFIG)) )))

# HOSTFILE=path (Open MPI's hostfile): the ranks over its hosts, the first host's slots first (MAP_BY=node: round
# robin); MPIRUN_ARGS: more of Open MPI's own options, as they are (see docs/cluster.md)
HOSTS = $(if $(HOSTFILE),--hostfile $(HOSTFILE)) $(if $(HOSTFILE)$(MAP_BY),--map-by $(or $(MAP_BY),slot))

train: bytecode
	$(ENV) $(PY) dsim/ft/launcher.py $(MPIRUN) $(HOSTS) $(MPIRUN_ARGS) -n $(PROCESSES) $(PY) -m dsim.train --config $(CONFIG)

test: test-serial test-mpi test-e2e

# dsim is installed editable, so pip compiled none of it; where PYTHONDONTWRITEBYTECODE is set, every process
# of every job would compile it again (0.17 s of CPU each). Stale files are ignored by Python, never used.
bytecode: venv
	$(PY) -m compileall -q dsim tests bench >/dev/null
	@# and pytest's assertion-rewritten test modules, which it reads even where it may not write them: else each
	@# of the MPI stage's 8 ranks rewrites every test file (collection 16 s -> 4 s there)
	$(ENV) PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q --collect-only -p no:cacheprovider >/dev/null

test-serial: bytecode
	$(ENV) timeout $(TEST_TIMEOUT) $(PY) -m pytest -q -m "not mpi and not e2e" -n auto  # pytest-xdist: a worker a core

# only tests/mpi collected: 8 ranks importing tests/unit too cost 2.3 s more CPU (load 9), 41 s more wall at load 36
test-mpi: bytecode
	$(ENV) timeout $(TEST_TIMEOUT) $(PY) dsim/ft/launcher.py $(MPIRUN) -n $(NP) $(PY) -m mpi4py -m pytest -q --with-mpi -m mpi --color=no -p no:cacheprovider --durations=30 tests/mpi

# --durations, --cpu-durations: where the time goes, in CI's log (the CPU one as well: on a loaded machine a test's
# wall time grows with the load, its CPU much less; tests/conftest.py). Only tests/e2e collected, as tests/mpi for
# the MPI stage: each worker importing the other stages' files too cost 1.5 s more CPU (load 35)
test-e2e: bytecode
	$(ENV) timeout $(TEST_TIMEOUT) $(PY) -m pytest -q -m e2e -n $(E2E_WORKERS) --durations=30 --cpu-durations=30 tests/e2e

# The daily tier: every serial test, and the MPI and end-to-end tests tests/tiers.py names for each feature (its
# cheapest covering ones: one layout, one fault point each); docs/testing.md says which covers what
check: test-serial check-mpi check-e2e

check-mpi: bytecode
	$(ENV) timeout $(TEST_TIMEOUT) $(PY) dsim/ft/launcher.py $(MPIRUN) -n $(NP) $(PY) -m mpi4py -m pytest -q --with-mpi -m "mpi and check" --color=no -p no:cacheprovider tests/mpi

check-e2e: bytecode
	$(ENV) timeout $(TEST_TIMEOUT) $(PY) -m pytest -q -m "e2e and check" -n $(E2E_WORKERS) tests/e2e

# Benchmarks (not tests): a table on stdout and bench/results/latest.json. BENCH_QUICK=1 for smaller sizes.
# The optional `bench` extra (torch==2.13.0, CPU build) adds the torch.distributed.checkpoint column.
bench: venv
	@$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install --quiet -e '.[bench]' || \
		echo "bench: torch==2.13.0 not installed; the DCP column will say so"
	$(ENV) BENCH_COMMAND="make bench$(if $(BENCH_QUICK), BENCH_QUICK=1)" $(PY) -m bench $(if $(BENCH_QUICK),--size quick) $(BENCH_ARGS)

# The documentation site (MkDocs, mkdocs.yml): built into site/ with --strict (a broken link or anchor, or a page
# left out of the navigation, fails it); docs-serve serves it on http://127.0.0.1:8000 and rebuilds on edits
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

clean:
	rm -rf $(VENV) runs site .pytest_cache
