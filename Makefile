# The two commands of the README. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export RAY_AUTH_MODE := disabled
export PYTHONUNBUFFERED := 1

.PHONY: demo test lint setup clean

setup: $(STAMP)

# The last step removes rfc3987-syntax, which jupyterlab's event schemas pull in: when it
# is installed, jsonschema imports it to check IRI formats, and it builds its parsers as
# it is imported: `import ray` took 1.5-2.1 s with it and 0.4-0.6 s without, in every
# process that imports Ray (the driver, each actor, a replacement worker after a
# preemption). Nothing here checks IRIs (docs/running_at_scale.md, "Actor start").
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "rlaxkit needs Python 3.11 or newer")'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[notebooks,dev,ray,tracking,tensorboard,wandb,mlflow,serve,tpu]"
	$(BIN)/python -m pip uninstall --quiet --yes rfc3987-syntax
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/rlaxkit demo

lint: $(STAMP)
	$(BIN)/ruff check rlaxkit sim tests benchmarks notebooks
	$(BIN)/ruff format --check rlaxkit sim tests benchmarks notebooks
	$(BIN)/mypy rlaxkit sim

# Two pytest workers (one per core here); the tests that start processes of their own
# (Ray clusters, multi-process JAX) share one of them (conftest.py: xdist_group).
PYTEST_WORKERS ?= 2

# Bytecode is written even where the environment turns it off (PYTHONDONTWRITEBYTECODE):
# the suite starts well over a hundred Python processes (pytest's workers, Ray actors,
# notebook kernels, the CLI) that import the same modules, and pytest keeps its rewritten
# test modules only then. Collecting the suite took 13.9-14.8 s without and 9.8-11.2 s
# with them.
test: lint
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -ra --durations=15 -n $(PYTEST_WORKERS) --dist loadgroup

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis
