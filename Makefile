# Quick start: `make demo` (train on the real CIFAR-10, print the table) and `make test`.
# Both create .venv and install with the pinned constraints when needed.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?= --durations=15

# The real CIFAR-10 beside the checkout (shared/); an explicit TRAINSCALE_DATA wins.
SHARED_CIFAR := $(abspath ../shared/data/cifar-10-batches-bin)
ifneq ($(wildcard $(SHARED_CIFAR)/data_batch_1.bin),)
export TRAINSCALE_DATA ?= $(SHARED_CIFAR)
endif

.PHONY: install demo lint format docs test test-fast bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test,docs]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m trainscale train --config configs/demo.toml --out runs/demo-$$(date +%Y%m%d-%H%M%S)

# ruff (lint and format check) and mypy over the tree; settings in pyproject.toml. `make format` applies ruff's fixes.
LINTED := src tests tests/dist benchmarks  # tests/dist named: ruff skips folders called dist by default
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff check --fix $(LINTED)
	$(VENV)/bin/ruff format $(LINTED)

# The documentation site into site/ (a few seconds). Strict: a broken link or anchor, or a page missing from the
# navigation, fails the build; `make test` runs it, so CI does too.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The unit tests (one process each, no timings) on every core at once; then the multi-process tests (tests/dist,
# tests/integration: workers, clusters, timeouts) two at a time: one at a time they kept 1.3 of 2 cores busy on
# average. Tests marked `alone` (they time faults, heartbeats or links) run with nothing beside them
# (tests/conftest.py). A file's tests go to one pytest worker: a module fixture that launches one job for all its
# tests runs once, and the cluster tests of tests/integration/test_cluster.py run one after another.
UNIT := tests/unit
MULTI := tests/integration tests/dist
PAIRED := -n 2 --dist loadfile
test: lint docs
	$(PY) -m pytest -n auto $(UNIT) $(PYTEST_ARGS)
	$(PY) -m pytest $(PAIRED) $(MULTI) $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -n auto -m "not slow" $(UNIT) $(PYTEST_ARGS)
	$(PY) -m pytest $(PAIRED) -m "not slow" $(MULTI) $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) build site *.egg-info src/*.egg-info .pytest_cache
