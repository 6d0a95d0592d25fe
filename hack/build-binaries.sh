#!/usr/bin/env bash
# Builds the local cluster's binaries (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kubelet, kube-proxy, kubectl, CoreDNS, local-path-provisioner, kube-router),
# helm, prometheus-adapter and SeaweedFS from the Go module proxy, pinned by the wrapper
# modules beside this script (hack/k8s, hack/etcd, hack/helm, hack/coredns, hack/local-path,
# hack/kube-router, hack/prometheus-adapter, hack/seaweedfs: their go.mod/go.sum are the pins),
# into a cache directory keyed by version outside the repository. Idempotent: a binary already
# in the cache is not rebuilt, so a warm machine returns in about a second; a binary whose wrapper
# module changed since it was built (a pin, or CoreDNS's plugin list) is rebuilt.
#
# helm, CoreDNS and local-path-provisioner are pinned to the Kubernetes build's versions of
# every module they share with it (hack/align-go-modules.py), so Go's build cache compiles
# client-go and the rest once for all binaries.
#
# prometheus-adapter (custom.metrics.k8s.io from Prometheus, for the tests that run a
# HorizontalPodAutoscaler on the inference pods' queue: devcluster/lora_devcluster/
# metricspipeline.py) is not part of the cluster itself: `up` starts without it, and only the
# tests that ask for the metrics pipeline need it. It is built here all the same, so CI (make
# prepare) has it. Like kube-router it keeps its own release's modules (Kubernetes v0.30), not
# aligned, so a cold build compiles its own client-go, apiserver and kube-aggregator: 132 s on 2
# cores after the binaries above (the standard library already compiled), 60 MiB; with an empty
# build cache add the standard library's few minutes.
#
# SeaweedFS (`weed`, whose S3 gateway the s3:// tests and the staging bench talk to:
# tests/support/s3server.py) is not part of the cluster either; it keeps its own modules and is
# the largest build here: about 10 minutes cold on 2 cores.
#
# kube-router (the node's NetworkPolicy enforcer: its firewall alone) is built against its own
# release's client-go (v0.29), not aligned: a NetworkPolicy controller's API calls are all v1.
# Its version is the one in hack/kube-router/go.mod (the newest the module proxy serves); the
# binary is keyed by that wrapper module's pins like every other, in the same directory.
#
#   hack/build-binaries.sh            build what is missing, print the directory at the end
#   hack/build-binaries.sh --print-dir   print the directory only (builds nothing)
#
# Environment: LORA_BIN_CACHE (default ~/.cache/lora-operator/bin), GO (default go),
# LORA_BUILD_JOBS (go build -p, default 2: these machines have 2 cores).
set -euo pipefail

K8S_VERSION=v1.37.2
ETCD_VERSION=v3.6.16
HELM_VERSION=v3.22.0
COREDNS_VERSION=v1.15.0
LOCAL_PATH_VERSION=v0.0.30
KUBE_ROUTER_VERSION=v2.1.0

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache_root="${LORA_BIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lora-operator/bin}"
out="$cache_root/k8s-$K8S_VERSION-etcd-$ETCD_VERSION-helm-$HELM_VERSION-coredns-$COREDNS_VERSION-local-path-$LOCAL_PATH_VERSION"

if [[ "${1:-}" == "--print-dir" ]]; then
    echo "$out"
    exit 0
fi

GO="${GO:-go}"
jobs="${LORA_BUILD_JOBS:-2}"
# The pinned modules need no newer toolchain; never let go fetch one.
# -buildvcs=false: the wrapper modules sit inside this git checkout, and stamping VCS data
# fails in checkouts git distrusts (another owner) while adding nothing to these binaries.
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"

log() { printf '[build-binaries %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if ! command -v "$GO" >/dev/null; then
    log "error: the Go toolchain ($GO) is not on PATH; install Go >= 1.26 (Debian: golang-go)"
    exit 1
fi

mkdir -p "$out"
start=$SECONDS
built=0

# build MODULE_DIR LDFLAGS NAME=PACKAGE...: the binaries of one wrapper module that are not
# cached yet, in one `go build`, so its packages are loaded once and one binary's link runs
# beside another's compiles. Several packages are written under their own names (cmd/NAME).
build() {
    local moddir=$1 ldflags=$2
    shift 2
    # The wrapper module's files (go.mod, go.sum, any main.go) are what the build is keyed on
    # besides the versions in the directory name.
    local pins pair name
    pins=$(cd "$here/$moddir" && { cat go.mod go.sum ./*.go 2>/dev/null || true; } | sha256sum | cut -c1-16)
    local names=() pkgs=()
    for pair in "$@"; do
        name=${pair%%=*}
        if [[ -x "$out/$name" && "$(cat "$out/.$name.pins" 2>/dev/null)" == "$pins" ]]; then
            log "$name: cached"
        else
            names+=("$name")
            pkgs+=("${pair#*=}")
        fi
    done
    ((${#names[@]} > 0)) || return 0
    log "${names[*]}: building (cold builds take minutes)"
    local t0=$SECONDS
    # Build into a scratch directory and rename, so an interrupted build never leaves a binary
    # that a later run would take for a finished one.
    local tmp="$out/.building-$moddir"
    rm -rf "$tmp"
    mkdir -p "$tmp"
    local dest="$tmp/"
    ((${#names[@]} > 1)) || dest="$tmp/${names[0]}"
    (cd "$here/$moddir" && "$GO" build -p "$jobs" -trimpath -tags=selinux,notest \
        -ldflags "-s -w $ldflags" -o "$dest" "${pkgs[@]}")
    for name in "${names[@]}"; do
        mv -f "$tmp/$name" "$out/$name"
        echo "$pins" >"$out/.$name.pins"
    done
    rm -rf "$tmp"
    log "${names[*]}: built in $((SECONDS - t0)) s"
    built=$((built + ${#names[@]}))
}

kver="-X k8s.io/component-base/version.gitVersion=$K8S_VERSION -X k8s.io/component-base/version.gitTreeState=clean"
kver="$kver -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION"
kcmd=k8s.io/kubernetes/cmd

build etcd "" etcd=go.etcd.io/etcd/server/v3
build k8s "$kver" kube-apiserver=$kcmd/kube-apiserver kube-controller-manager=$kcmd/kube-controller-manager \
    kube-scheduler=$kcmd/kube-scheduler kubelet=$kcmd/kubelet kube-proxy=$kcmd/kube-proxy kubectl=$kcmd/kubectl
build coredns "" coredns=.
build local-path "" local-path-provisioner=github.com/rancher/local-path-provisioner
build helm "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" helm=helm.sh/helm/v3/cmd/helm
build kube-router "-X github.com/cloudnativelabs/kube-router/v2/pkg/version.Version=$KUBE_ROUTER_VERSION" \
    kube-router=github.com/cloudnativelabs/kube-router/v2/cmd/kube-router
# v0.12.0 (hack/prometheus-adapter/go.mod); its main package sets no version variable.
build prometheus-adapter "" prometheus-adapter=sigs.k8s.io/prometheus-adapter/cmd/adapter
# SeaweedFS (hack/seaweedfs/go.mod): the tests' S3-compatible server, `weed server -s3`.
build seaweedfs "" weed=github.com/seaweedfs/seaweedfs/weed

if ((built > 0)); then
    log "built $built binaries in $((SECONDS - start)) s; $(du -sh "$out" | cut -f1) in $out"
else
    log "all binaries cached in $out"
fi
echo "$out"
