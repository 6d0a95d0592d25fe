"""The local cluster's registry, as configured (no cluster): where it listens, where it keeps
its data, and containerd's host configuration that lets the node pull from it over HTTP."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from lora_devcluster import nodeconfig, registry
from lora_devcluster.layout import HOST_IP, Layout


def test_the_registry_listens_on_the_node_and_keeps_its_data_in_the_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(registry.STORAGE_ENV, raising=False)
    layout = Layout(tmp_path)
    config = registry.build_registry_config(registry.storage_dir(layout))
    assert f"{HOST_IP}:5000" == registry.ADDRESS
    assert config["http"] == {"addr": registry.ADDRESS}
    assert config["storage"] == {
        "filesystem": {"rootdirectory": str(tmp_path / "registry")},
        "delete": {"enabled": True},
    }


def test_a_registry_may_keep_its_data_where_it_outlives_the_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo's: under the cache, so its next push finds every unchanged layer there."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert registry.cached_storage() == tmp_path / "cache" / "lora-operator" / "registry"
    monkeypatch.setenv(registry.STORAGE_ENV, str(registry.cached_storage()))
    assert registry.storage_dir(Layout(tmp_path / "cluster")) == registry.cached_storage()


def test_containerd_pulls_from_it_over_plain_http(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    hosts = registry.write_hosts(layout)
    parsed = tomllib.loads((hosts / registry.ADDRESS / "hosts.toml").read_text())
    assert parsed["server"] == f"http://{registry.ADDRESS}"
    assert parsed["host"][f"http://{registry.ADDRESS}"]["capabilities"] == ["pull", "resolve"]
    text = nodeconfig.build_containerd_config(Path("/r"), "/s", "/sock", tmp_path / "cni", hosts)
    cri = tomllib.loads(text)["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["registry"] == {"config_path": str(hosts)}
    # Without a hosts folder the configuration is as before.
    plain = nodeconfig.build_containerd_config(Path("/r"), "/s", "/sock", tmp_path / "cni")
    assert "registry" not in tomllib.loads(plain)["plugins"]["io.containerd.grpc.v1.cri"]
