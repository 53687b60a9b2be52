# Two commands set everything up: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export PYTHONUNBUFFERED := 1

.PHONY: install demo test test-all lint format bench bench-smoke wrk browser cluster-up cluster-down clean

install: $(STAMP)

# torch is installed first and pinned to the CPU build that pip finds locally, so the
# project's `torch>=2.6` range does not pull a multi-GB CUDA build on a CPU machine.
# Set TORCH_SPEC= (empty) to let pip choose, e.g. on a GPU box.
TORCH_SPEC ?= torch==2.13.0
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then $(PY) -m pip install -q "$(TORCH_SPEC)"; fi
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: install
	bash cluster/demo.sh

test: install browser
	bash tests/run.sh

# Everything `make test` runs plus the `slow` soak and benchmark-smoke runs.
test-all: install browser wrk
	bash tests/run.sh --all

lint: install
	$(VENV)/bin/ruff check app jobs tests bench cluster tools
	$(VENV)/bin/ruff format --check app jobs tests bench cluster tools
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff format app jobs tests bench tools
	$(VENV)/bin/ruff check --fix app jobs tests bench tools

bench: install wrk
	$(PY) -m bench.run_all

# B5's load generator (C): Debian's wrk package, installed when absent.
wrk:
	@command -v wrk >/dev/null || apt-get install -y wrk || sudo apt-get install -y wrk

# The search page's browser test: Debian's chromium, installed when absent (as root); without
# it the test skips (fails under CI=true).
browser:
	@command -v chromium >/dev/null || apt-get install -y -q chromium >/dev/null \
		|| { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; } \
		|| sudo -n apt-get install -y -q chromium >/dev/null \
		|| echo "chromium not installed: the search page's test will skip (and fail under CI=true)"

bench-smoke: install wrk
	$(PY) -m bench.run_all --smoke

cluster-up: install
	bash cluster/start.sh

# Stops only the cluster cluster/start.sh recorded; FORCE=1: every Ray cluster on this machine.
cluster-down:
	bash cluster/stop.sh $(if $(FORCE),--force)

clean:
	rm -rf outputs build .pytest_cache .mypy_cache .ruff_cache
