#!/usr/bin/env bash
# `make e2e-kind`: the chart on a real Kubernetes (kind) with the real images. Needs Docker and
# kind on PATH (Docker only runs kind's nodes); `make images` has built
# lora-operator/{operator,inference}:TAG as docker-archive tars (no Docker build). Steps: create a
# kind cluster, load the archives, write the tiny SD 1.5 model and the example's adapter source onto
# claims with a Job run by the inference image, `helm install` (CPU values), `helm test`, apply
# examples/adapter.yaml, wait for Ready, and generate through the Service (port-forward). The
# cluster is deleted at the end unless KEEP_CLUSTER=1. The full scenario of tests/e2e (killed
# container, deleted pod, update, uninstall) runs on the local cluster (`make test`).
set -euo pipefail
TAG=${1:?usage: hack/e2e-kind.sh IMAGE_TAG}
NAME=${KIND_CLUSTER:-lora-e2e}
NS=lora-e2e
cd "$(dirname "$0")/.."
for tool in docker kind; do
  command -v "$tool" >/dev/null || { echo "e2e-kind needs $tool on PATH"; exit 1; }
done
# The archives `make images` built for this tree; this fails, naming the missing image and the
# command that builds it, before any cluster exists.
archives=$(PYTHONPATH=devcluster "${PYTHON:-python3}" -m lora_devcluster.images list --archives \
  --only operator --only inference)
BIN=$(hack/build-binaries.sh --print-dir)
export PATH="$BIN:$PATH" KUBECONFIG="${KUBECONFIG_OUT:-$(mktemp)}"
step() { printf '[%5ss] %s\n' "$SECONDS" "$*"; }
cleanup() { [ "${KEEP_CLUSTER:-0}" = 1 ] || kind delete cluster --name "$NAME" >/dev/null 2>&1 || true; }
trap cleanup EXIT

step "kind create cluster $NAME"
kind create cluster --name "$NAME" --kubeconfig "$KUBECONFIG" --wait 120s
step "kind load the image archives"
for archive in $archives; do
  kind load image-archive --name "$NAME" "$archive"
done
kubectl create namespace "$NS"

step "the model and the adapter source onto claims (kind's local-path class; one node, so RWO)"
kubectl -n "$NS" apply -f - <<YAML
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: models}
spec: {accessModes: [ReadWriteOnce], resources: {requests: {storage: 1Gi}}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: adapters}
spec: {accessModes: [ReadWriteOnce], resources: {requests: {storage: 1Gi}}}
---
apiVersion: batch/v1
kind: Job
metadata: {name: prepare}
spec:
  backoffLimit: 0
  template:
    spec:
      restartPolicy: Never
      securityContext: {fsGroup: 65532}
      initContainers:
        - name: model
          image: lora-operator/inference:$TAG
          args: [tiny-model, /models/tiny-sd15, --arch, sd15]
          env: [{name: HOME, value: /tmp}, {name: HF_HOME, value: /tmp/hf}]
          volumeMounts: [{name: models, mountPath: /models}, {name: tmp, mountPath: /tmp}]
      containers:
        - name: adapter
          image: lora-operator/inference:$TAG
          args: [make-adapter, /var/lib/lora/adapters/sources/pixel-art, --model, /models/tiny-sd15, --rank, "8", --strength, "0.8", --seed, "1"]
          env: [{name: HOME, value: /tmp}, {name: HF_HOME, value: /tmp/hf}]
          volumeMounts:
            - {name: models, mountPath: /models}
            - {name: adapters, mountPath: /var/lib/lora/adapters}
            - {name: tmp, mountPath: /tmp}
      volumes:
        - {name: models, persistentVolumeClaim: {claimName: models}}
        - {name: adapters, persistentVolumeClaim: {claimName: adapters}}
        - {name: tmp, emptyDir: {}}
YAML
kubectl -n "$NS" wait --for=condition=Complete job/prepare --timeout=600s

step "helm install (CRDs with the chart, CPU values)"
helm install lora-operator charts/lora-operator -n "$NS" --wait --timeout 10m \
  --set-json "operator.watchNamespaces=[\"$NS\"]" \
  --set operator.image.tag="$TAG",inference.image.tag="$TAG" \
  --set adapterVolume.existingClaim=adapters \
  --set inference.model.existingClaim=models,inference.model.path=/models/tiny-sd15 \
  --set inference.servedModelName=tiny-sd15,inference.device=cpu,inference.gpu.enabled=false \
  --set inference.maxLoras=2,inference.maxCpuLoras=4,inference.maxBatchSize=1
step "helm test"
helm test lora-operator -n "$NS" --logs

step "kubectl apply -f examples/adapter.yaml; wait for Ready"
kubectl -n "$NS" apply -f examples/adapter.yaml
kubectl -n "$NS" wait --for=jsonpath='{.status.phase}'=Ready lora/pixel-art --timeout=300s
kubectl -n "$NS" get lora

step "generate through the Service by adapter name"
kubectl -n "$NS" port-forward svc/lora-operator-inference 18080:80 >/dev/null &
PF=$!
trap 'kill $PF 2>/dev/null || true; cleanup' EXIT
for _ in $(seq 30); do curl -fs localhost:18080/ready >/dev/null && break; sleep 1; done
curl -fsS localhost:18080/v1/images/generations \
  -d '{"model": "pixel-art", "prompt": "a lighthouse", "size": "64x64", "num_inference_steps": 4}' \
  | python3 -c 'import json, sys; d = json.load(sys.stdin); print("generated", len(d["data"]), "image(s)")'

step "helm uninstall; the CRD stays (crds.keep)"
helm uninstall lora-operator -n "$NS" --wait
kubectl get crd loraadapters.lora.dev
step "e2e-kind passed"
