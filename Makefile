# The README's interface: `make demo` runs the main job, `make test` runs everything.
# Both work on a fresh machine: they install what they need first.

SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install prepare packages binaries test lint typecheck unit demo demo-inference images push chart-push release e2e-kind bench bench-operator docs clean

install: $(STAMP) packages binaries

# What the local cluster needs (the virtualenv, the binaries, the images), the three builds side
# by side: on a fresh machine the Go builds keep the cores busy for about 20 minutes while the
# virtualenv and the images mostly wait on downloads and the disk. Each prints its own lines.
prepare: packages
	@$(MAKE) --no-print-directory -j3 $(STAMP) binaries images

# Debian packages for the local cluster's node and the image builds (apt-get, only when missing).
packages:
	@hack/install-packages.sh

# Re-installs only when the dependency list changed (or the venv is missing).
$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[inference,operator,dev]'
	@touch $(STAMP)

# The cluster's binaries (etcd, kube-apiserver, kubelet, ...) built from the Go module proxy into
# a cache keyed by version outside the repository; a warm machine rebuilds nothing.
binaries:
	@if [ -x hack/build-binaries.sh ]; then hack/build-binaries.sh; fi

# ruff, then the import contracts in .importlinter (which package may import which; why, there).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

typecheck: $(STAMP)
	$(VENV)/bin/mypy runtime/lora_runtime podapi/lora_podapi volume/lora_volume playground/lora_playground inference/lora_inference operator/lora_operator router/lora_router devcluster/lora_devcluster demo/lora_demo tests

unit: prepare
	$(VENV)/bin/pytest

test: prepare lint typecheck unit

# The main job on the local cluster: the chart, the operator, two adapters, images in demo-out/.
demo: prepare
	$(PY) -m lora_demo --out demo-out

# The inference server alone (no cluster): tiny model, two adapters, images in demo-out/.
demo-inference: install
	$(PY) -m lora_inference.tools.demo --out demo-out

# The container images (base, pause, operator, inference) without a Docker daemon: buildah
# from a local Debian base, as docker-archive tars in a cache keyed by their inputs
# (LORA_IMAGE_CACHE, default ~/.cache/lora-operator/images); an unchanged tree builds nothing.
# The operator and inference images are left tagged in buildah's storage as
# lora-operator/operator:<appVersion> and lora-operator/inference:<appVersion>.
# Needs root and the Debian packages `make install` installs; see docs/images.md.
IMAGES_PY = $(if $(wildcard $(PY)),$(PY),python3)
images: packages
	PYTHONPATH=devcluster $(IMAGES_PY) -m lora_devcluster.images build

# `make push REGISTRY=host[:port]/path`: the operator and inference images (built first when
# missing) to REGISTRY/operator:<appVersion> and REGISTRY/inference:<appVersion>;
# `make chart-push REGISTRY=...`: the packaged chart to oci://REGISTRY/lora-operator:<version>.
# Log in first (`buildah login`, `helm registry login`); PLAIN_HTTP=1 for a registry without TLS;
# PUSH_IMAGES=operator pushes one image; NO_COMPRESS=1 sends the layers uncompressed (a registry
# on this machine: gzipping the inference image's 5 GB takes minutes).
REGISTRY ?=
PLAIN_HTTP ?=
PUSH_IMAGES ?=
NO_COMPRESS ?=
CHART_VERSION = $(shell sed -n 's/^version: *"\{0,1\}\([^"]*\)"\{0,1\}$$/\1/p' charts/lora-operator/Chart.yaml)
HELM_PATH = PATH="$$PATH:$$(PYTHONPATH=devcluster $(IMAGES_PY) -m lora_devcluster.cli bin-dir 2>/dev/null)"
push: packages
	@test -n "$(REGISTRY)" || { echo "usage: make push REGISTRY=host[:port]/path [PLAIN_HTTP=1]" >&2; exit 2; }
	PYTHONPATH=devcluster $(IMAGES_PY) -m lora_devcluster.images push $(REGISTRY) $(if $(PLAIN_HTTP),--plain-http) $(if $(NO_COMPRESS),--no-compress) $(foreach i,$(PUSH_IMAGES),--only $(i))

chart-push:
	@test -n "$(REGISTRY)" || { echo "usage: make chart-push REGISTRY=host[:port]/path [PLAIN_HTTP=1]" >&2; exit 2; }
	$(HELM_PATH) helm package charts/lora-operator -d dist
	$(HELM_PATH) helm push dist/lora-operator-$(CHART_VERSION).tgz oci://$(REGISTRY) $(if $(PLAIN_HTTP),--plain-http)

# `make release`: the annotated tag v<version> on HEAD, for Chart.yaml's version (hack/release.py).
# Refused when the CRD, values.yaml or the pod API changed since the last v* tag while the
# version did not move, or when CHANGELOG.md has no section for it. It never pushes.
release:
	python3 hack/release.py

# The end-to-end suite against a kind cluster: needs Docker and kind (see docs/operations.md);
# kind loads the archives `make images` built.
e2e-kind: prepare
	PYTHON=$(PY) hack/e2e-kind.sh

bench: install
	$(PY) bench/bench_inference.py

bench-operator: install
	$(PY) bench/bench_operator.py

# docs/reference/ from the CRD, the chart and the metrics in code (tests/unit/test_docs.py checks it).
docs: $(STAMP) binaries
	PATH="$$PATH:$$($(PY) -m lora_devcluster.cli bin-dir 2>/dev/null)" $(PY) hack/gen-docs.py

clean:
	rm -rf $(VENV) demo-out dist .mypy_cache .ruff_cache .pytest_cache .import_linter_cache
