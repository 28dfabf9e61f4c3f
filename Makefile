# Everything runs from a virtualenv this Makefile creates (.venv), so a fresh machine needs only
# Python 3.11+, Go (for the end-to-end control plane) and make.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
INSTALLED := $(VENV)/.installed
# helm and kustomize render the chart and the kustomizations in the manifest tests; built from the
# Go module proxy into .tools/ (the tests fall back to a small renderer without them).
TOOLS := $(CURDIR)/.tools/bin
HELM_VERSION := v3.22.0
KUSTOMIZE_VERSION := v5.7.1
export PATH := $(TOOLS):$(PATH)

.PHONY: test unit e2e lint demo bench tools clean

test: lint unit e2e  ## all tests: lint, unit, end-to-end on a real control plane

$(INSTALLED): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip==26.3
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(INSTALLED)

$(TOOLS)/helm:
	GOBIN=$(TOOLS) go install helm.sh/helm/v3/cmd/helm@$(HELM_VERSION)

$(TOOLS)/kustomize:
	GOBIN=$(TOOLS) go install sigs.k8s.io/kustomize/kustomize/v5@$(KUSTOMIZE_VERSION)

tools: $(TOOLS)/helm $(TOOLS)/kustomize

lint: $(INSTALLED)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

unit: $(INSTALLED) tools
	$(BIN)/python -m pytest tests

e2e: $(INSTALLED) tools
	$(BIN)/python -m pytest e2e

demo: $(INSTALLED)
	$(BIN)/python -m e2e.demo

bench: $(INSTALLED)
	$(BIN)/python -m bench.demand
	$(BIN)/python -m bench.webhook

clean:
	rm -rf $(VENV) .tools .mypy_cache .ruff_cache .pytest_cache .hypothesis
