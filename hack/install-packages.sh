#!/usr/bin/env bash
# Installs the Debian packages the local cluster and the image builds need, when any is
# missing (`make install` calls it; nothing happens when all are there):
#   node:   containerd runc containernetworking-plugins iptables conntrack socat iproute2 util-linux
#           ipset (kube-router's NetworkPolicy rules match ipsets of pod addresses)
#   images: buildah debootstrap gcc libc6-dev (the pause program is a static C binary)
#   tests:  dosfstools fusefat (a vfat adapter volume, which the operator must refuse),
#           chromium chromium-driver (the playground page, driven headless)
#   registry and monitoring tests: docker-registry (an OCI registry for `make push`),
#           skopeo (the air-gapped install's mirroring of the image archives),
#           prometheus (promtool and a real Prometheus for the dashboard and the alerts)
set -euo pipefail
packages=(containerd runc containernetworking-plugins iptables conntrack socat iproute2 ipset
          util-linux buildah debootstrap gcc libc6-dev dosfstools fusefat chromium chromium-driver
          docker-registry skopeo prometheus)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
    exit 0
fi
if [[ $(id -u) != 0 ]]; then
    echo "install-packages: missing Debian packages: ${missing[*]}; run as root (or: sudo apt-get install ${missing[*]})" >&2
    exit 1
fi
echo "install-packages: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q "${missing[@]}"; }
