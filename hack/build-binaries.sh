#!/usr/bin/env bash
# Builds the local cluster's binaries (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kubelet, kube-proxy, kubectl, CoreDNS, local-path-provisioner) and helm from
# the Go module proxy, pinned by the wrapper modules beside this script (hack/k8s, hack/etcd,
# hack/helm, hack/coredns, hack/local-path: their go.mod/go.sum are the pins), into a cache
# directory keyed by version outside the repository. Idempotent: a binary already in the
# cache is not rebuilt, so a warm machine returns in about a second.
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

# build NAME MODULE_DIR PACKAGE LDFLAGS
build() {
    local name=$1 moddir=$2 pkg=$3 ldflags=$4
    if [[ -x "$out/$name" ]]; then
        log "$name: cached"
        return 0
    fi
    log "$name: building $pkg (cold builds take minutes)"
    local t0=$SECONDS
    # Build to a temporary name and rename, so an interrupted build never leaves a binary
    # that a later run would take for a finished one.
    (cd "$here/$moddir" && "$GO" build -p "$jobs" -trimpath -tags=selinux,notest \
        -ldflags "-s -w $ldflags" -o "$out/.$name.tmp" "$pkg")
    mv -f "$out/.$name.tmp" "$out/$name"
    log "$name: built in $((SECONDS - t0)) s"
    built=$((built + 1))
}

kver="-X k8s.io/component-base/version.gitVersion=$K8S_VERSION -X k8s.io/component-base/version.gitTreeState=clean"
kver="$kver -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION"

build etcd etcd go.etcd.io/etcd/server/v3 ""
build kube-apiserver k8s k8s.io/kubernetes/cmd/kube-apiserver "$kver"
build kube-controller-manager k8s k8s.io/kubernetes/cmd/kube-controller-manager "$kver"
build kube-scheduler k8s k8s.io/kubernetes/cmd/kube-scheduler "$kver"
build kubelet k8s k8s.io/kubernetes/cmd/kubelet "$kver"
build kube-proxy k8s k8s.io/kubernetes/cmd/kube-proxy "$kver"
build kubectl k8s k8s.io/kubernetes/cmd/kubectl "$kver"
build coredns coredns . ""
build local-path-provisioner local-path github.com/rancher/local-path-provisioner ""
build helm helm helm.sh/helm/v3/cmd/helm "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"

if ((built > 0)); then
    log "built $built binaries in $((SECONDS - start)) s; $(du -sh "$out" | cut -f1) in $out"
else
    log "all binaries cached in $out"
fi
echo "$out"
