# Two commands on a fresh machine with only python3:  make demo   and   make test
# torch==2.13.0 is installed first, so pip never replaces it with a multi-GB CUDA build.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
PYTEST_WORKERS ?= 2

.PHONY: setup demo test test-fast lint bench clean

# alignzoo and its extras only (bench: TRL, for the parity tests; ray: the Ray executor tests): the tests install their plugin package (tests/plugin_pkg)
# into .test-plugins/ themselves, so `alignzoo plugins` never lists test doubles.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[dev,tensorboard,bench,ray]'
	touch $@

setup: $(VENV)/.installed

## Build the embedded world (cached) and run the default A/B experiment; prints where the report is.
demo: setup
	$(VENV)/bin/alignzoo run experiments/quickstart.yaml --resume --jobs 2

## The whole suite (unit, property, integration, fault injection), on all cores.
test: setup
	$(VENV)/bin/pytest -q -n $(PYTEST_WORKERS) --durations=15

## The quick subset for iteration: no model training, no wheel build.
test-fast: setup
	$(VENV)/bin/pytest -q -n $(PYTEST_WORKERS) -m "not slow"

lint: setup
	$(VENV)/bin/ruff check core plugins tests benchmarks
	$(VENV)/bin/ruff format --check core plugins tests benchmarks
	$(VENV)/bin/mypy core

bench: setup
	$(PY) benchmarks/import_time.py
	$(PY) benchmarks/engine_step.py
	$(PY) benchmarks/labeling.py
	$(PY) benchmarks/lora_memory.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache .test-plugins
