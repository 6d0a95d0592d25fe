"""The local cluster's OCI registry (`lora-devcluster up --registry`): where `make push` and
`make chart-push` publish the images and the chart, and where the node's containerd pulls from,
as a GPU cluster pulls from its registry.

The registry is Debian's `docker-registry` package: the distribution registry (what the `registry:2`
image runs), installed with the node's other packages, so nothing is built for it; it serves images
and Helm charts (OCI artifacts) alike and keeps them on disk in the cluster's directory, or where
LORA_REGISTRY_STORAGE says (the demo keeps them under the cache). It listens on the node's address
inside the cluster's network namespace, over plain HTTP: pods, containerd, and processes joined to
the cluster (the tests, `lora-devcluster exec`) reach it; nothing outside the machine does.

Owns: the registry's configuration and containerd's host configuration for it (pure), and
where both are written. Must not: start processes (node.start does), push or pull.
"""

from __future__ import annotations

import os
from pathlib import Path

from lora_devcluster.layout import HOST_IP, Layout

PORT = 5000
ADDRESS = f"{HOST_IP}:{PORT}"
"""`host:port` of the registry, as image references and `oci://` chart references name it."""
BINARY = "docker-registry"
PACKAGE = "docker-registry"


STORAGE_ENV = "LORA_REGISTRY_STORAGE"
"""Where the registry keeps what is pushed, when set (the demo's: a folder under the cache, so a
push finds the layers of the last one there and sends only what changed); otherwise in the
cluster's directory, gone with `down`."""


def storage_dir(layout: Layout) -> Path:
    return Path(os.environ.get(STORAGE_ENV) or layout.root / "registry")


def cached_storage() -> Path:
    """A registry storage that outlives clusters: ~/.cache/lora-operator/registry
    (XDG_CACHE_HOME honoured). Content-addressed, so one folder serves every tree's images."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lora-operator" / "registry"


def hosts_dir(layout: Layout) -> Path:
    """containerd's `config_path`: one folder per registry host with its hosts.toml."""
    return layout.config / "certs.d"


def build_registry_config(storage: Path, address: str = ADDRESS) -> dict[str, object]:
    """docker-registry's config.yml (pure): filesystem storage, deletes allowed (so a test can
    clean up), plain HTTP on `address`, quiet logs."""
    return {
        "version": 0.1,
        "log": {"level": "warn", "accesslog": {"disabled": True}},
        "storage": {"filesystem": {"rootdirectory": str(storage)}, "delete": {"enabled": True}},
        "http": {"addr": address},
    }


def build_hosts_toml(address: str = ADDRESS) -> str:
    """containerd's hosts.toml for the registry (pure): pull and resolve over plain HTTP,
    which containerd otherwise refuses for a registry that is not localhost."""
    return (
        f'server = "http://{address}"\n\n'
        f'[host."http://{address}"]\n'
        '  capabilities = ["pull", "resolve"]\n'
    )


def write_hosts(layout: Layout, address: str = ADDRESS) -> Path:
    """Write containerd's host configuration for the registry; returns the `config_path`."""
    folder = hosts_dir(layout) / address
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hosts.toml").write_text(build_hosts_toml(address))
    return hosts_dir(layout)
