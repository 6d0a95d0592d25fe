# The README's interface: `make demo` runs the main job, `make test` runs everything.
# Both work on a fresh machine: they install what they need first.

SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install binaries test lint typecheck unit demo bench clean

install: $(STAMP) binaries

# Re-installs only when the dependency list changed (or the venv is missing).
$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[inference,operator,dev]'
	@touch $(STAMP)

# Control-plane binaries (etcd, kube-apiserver, ...) built from the Go module proxy into
# a cache keyed by version outside the repository; a warm machine rebuilds nothing.
binaries:
	@if [ -x hack/build-binaries.sh ]; then hack/build-binaries.sh; fi

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy inference/lora_inference operator/lora_operator devcluster/lora_devcluster

unit: install
	$(VENV)/bin/pytest

test: install lint typecheck unit

demo: install
	$(PY) -m lora_inference.tools.demo --out demo-out

bench: install
	$(PY) bench/bench_inference.py

clean:
	rm -rf $(VENV) demo-out .mypy_cache .ruff_cache .pytest_cache
