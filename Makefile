# Everything runs from a virtualenv this Makefile creates (.venv), so a fresh machine needs only
# Python 3.11+, Go (for the end-to-end control plane) and make.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed

.PHONY: test unit e2e lint demo bench clean

test: lint unit e2e  ## all tests: lint, unit, end-to-end on a real control plane

$(INSTALLED): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip==26.3
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(INSTALLED)

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/mypy

unit: $(INSTALLED)
	$(BIN)/python -m pytest tests

e2e: $(INSTALLED)
	$(BIN)/python -m pytest e2e

demo: $(INSTALLED)
	$(BIN)/python -m e2e.demo

bench: $(INSTALLED)
	$(BIN)/python -m bench.demand
	$(BIN)/python -m bench.webhook

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
