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

.PHONY: test unit e2e e2e-next lint chart demo bench tools clean lock lock-check audit sbom image image-check image-e2e

test: lint chart unit e2e  ## all tests: lint, the chart, unit, end-to-end on a real control plane

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

chart: tools  ## helm lint and helm package of the chart (dist/vramguard-VERSION.tgz)
	helm lint --strict charts/vramguard --kube-version v1.36.3
	helm lint --strict charts/vramguard --kube-version v1.34.0 --set mode=default-scheduler --set certManager.enabled=true
	helm package charts/vramguard --destination dist

unit: $(INSTALLED) tools
	$(BIN)/python -m pytest tests

e2e: $(INSTALLED) tools
	$(BIN)/python -m pytest e2e

# The end-to-end suite on the newest Kubernetes release the harness builds (CI runs 1.36; run this
# by hand before a release, with the image env for the image tests: env $$(scripts/image.sh env)).
NEXT_KUBE_VERSION ?= 1.37
e2e-next: $(INSTALLED) tools
	KUBE_VERSION=$(NEXT_KUBE_VERSION) $(BIN)/python -m pytest e2e

demo: $(INSTALLED)
	$(BIN)/python -m e2e.demo $(if $(DRA),--dra)

# docs/policy-reference.md and docs/cli-reference.md from the code (tests/test_docs.py fails when
# they are stale; `python scripts/docs_reference.py --check` says which).
.PHONY: docs
docs: $(INSTALLED)  ## regenerate the generated reference pages of docs/
	$(BIN)/python scripts/docs_reference.py

# All figures into one JSON file (BENCH_OUT); prints each figure's ratio to the previous BENCH_OUT,
# or to BENCH_COMPARE=older.json.
BENCH_OUT ?= bench-results.json
bench: $(INSTALLED)
	$(BIN)/python -m bench.run --out $(BENCH_OUT) $(if $(BENCH_COMPARE),--compare $(BENCH_COMPARE))

# --- the image (scripts/image.sh, scripts/lock.sh) ------------------------------------------------
lock: $(INSTALLED)  ## regenerate requirements.lock (hashed, all transitive runtime dependencies)
	VENV=$(VENV) scripts/lock.sh compile

lock-check: $(INSTALLED)  ## fail if requirements.lock does not match pyproject.toml
	VENV=$(VENV) scripts/lock.sh check

audit: $(INSTALLED)  ## known vulnerabilities of the locked packages (PyPI's advisory data)
	VENV=$(VENV) scripts/lock.sh audit

sbom: $(INSTALLED)  ## CycloneDX SBOM of the image's packages: dist/vramguard-VERSION.cdx.json
	VENV=$(VENV) scripts/lock.sh sbom

image:  ## build vramguard:VERSION with Docker or podman (a local stand-in base where no registry is reachable)
	scripts/image.sh build

image-check: image lock-check audit sbom  ## what CI verifies of the image
	scripts/image.sh check

image-e2e: $(INSTALLED) tools image  ## the services run from the image on a real control plane
	env $$(scripts/image.sh env) $(BIN)/python -m pytest e2e/test_image.py

clean:
	rm -rf $(VENV) .tools .mypy_cache .ruff_cache .pytest_cache .hypothesis
