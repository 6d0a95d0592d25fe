#!/usr/bin/env bash
# `make e2e-kind`: the end-to-end suite (tests/e2e, the same tests `make test` runs on the local
# cluster; those that need the local cluster's own network namespace skip, saying so) against a
# kind cluster, for users with Docker and kind. Docker only
# runs kind's node: the images are the docker-archive tars `make images` built (no Docker build),
# loaded with `kind load image-archive`. The suite talks to the cluster through its API server
# only; it kills a container through `docker exec` on the node. The cluster is deleted at the
# end unless KEEP_CLUSTER=1.
set -euo pipefail
NAME=${KIND_CLUSTER:-lora-e2e}
PYTHON=${PYTHON:-.venv/bin/python}
cd "$(dirname "$0")/.."
for tool in docker kind; do
  command -v "$tool" >/dev/null || { echo "e2e-kind needs $tool on PATH"; exit 1; }
done
# The archives `make images` built for this tree; this fails, naming the missing image and the
# command that builds it, before any cluster exists.
archives=$("$PYTHON" -m lora_devcluster.images list --archives --only operator --only inference)
BIN=$(hack/build-binaries.sh --print-dir)
KUBECONFIG_FILE=${KUBECONFIG_OUT:-$(mktemp)}
export PATH="$BIN:$PATH"
step() { printf '[%5ss] %s\n' "$SECONDS" "$*"; }
cleanup() { [ "${KEEP_CLUSTER:-0}" = 1 ] || kind delete cluster --name "$NAME" >/dev/null 2>&1 || true; }
trap cleanup EXIT

step "kind create cluster $NAME"
kind create cluster --name "$NAME" --kubeconfig "$KUBECONFIG_FILE" --wait 120s
step "kind load the image archives"
for archive in $archives; do
  kind load image-archive --name "$NAME" "$archive"
done

step "the end-to-end suite"
LORA_E2E_KUBECONFIG="$KUBECONFIG_FILE" \
LORA_E2E_NODE_SHELL="docker exec $NAME-control-plane" \
  "$PYTHON" -m pytest tests/e2e -v -rs -p no:cacheprovider
step "e2e-kind passed"
