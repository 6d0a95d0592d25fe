"""The node's configuration, decided without starting anything: each setting a stock node would
not need is here because the machine is shared with the host and with other clusters."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

from lora_devcluster import certs, cgroups, imagestore, nodeconfig, sandbox
from lora_devcluster.layout import Layout


def pki(tmp_path: Path) -> certs.PKI:
    return certs.write_pki(tmp_path / "pki", ["127.0.0.1"], [], "n", "10.244.0.1")


def test_each_state_directory_has_its_own_cgroup_root(tmp_path: Path) -> None:
    a, b = Layout(tmp_path / "a"), Layout(tmp_path / "b")
    assert a.cgroup_root != b.cgroup_root
    assert a.cgroup_root == Layout(tmp_path / "a").cgroup_root
    assert a.cgroup_root.startswith("/lora-devcluster-")


def test_kubelet_config_keeps_the_node_to_itself(tmp_path: Path) -> None:
    layout = Layout(tmp_path / "c")
    config = nodeconfig.build_kubelet_config(layout, pki(tmp_path))
    assert config["cgroupRoot"] == layout.cgroup_root
    assert config["failCgroupV1"] is False and config["cgroupDriver"] == "cgroupfs"
    assert config["protectKernelDefaults"] is False
    assert config["clusterDNS"] == ["10.0.0.10"]
    assert Path(config["podLogsDir"]).parent == layout.root  # the host reads logs there
    assert Path(config["resolvConf"]).is_relative_to(layout.root)  # not the host's
    assert config["imageGCHighThresholdPercent"] == 100  # images cannot be pulled again
    assert config["authentication"]["anonymous"]["enabled"] is False


def test_containerd_config_is_valid_toml_with_its_own_root_and_no_oom_score_lowering(
    tmp_path: Path,
) -> None:
    text = nodeconfig.build_containerd_config(Path("/r"), "/run/x", "/run/x/s.sock", tmp_path)
    config = tomllib.loads(text)
    assert (config["root"], config["state"]) == ("/r", "/run/x")
    assert config["grpc"]["address"] == "/run/x/s.sock"
    cri = config["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["restrict_oom_score_adj"] is True
    assert cri["sandbox_image"] == nodeconfig.PAUSE_IMAGE
    assert cri["cni"]["conf_dir"] == str(tmp_path)
    assert cri["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is False
    assert "io.containerd.internal.v1.opt" in config["disabled_plugins"]  # writes /opt


def test_pod_network_and_service_routing() -> None:
    (bridge, portmap) = nodeconfig.build_cni_config()["plugins"]
    assert bridge["isGateway"] and bridge["hairpinMode"]
    assert bridge["ipam"]["ranges"] == [[{"subnet": "10.244.0.0/24", "gateway": "10.244.0.1"}]]
    assert bridge["ipam"]["dataDir"].startswith("/run/")  # the sandbox's tmpfs
    assert portmap["type"] == "portmap"
    proxy = nodeconfig.build_kube_proxy_config(Layout(Path("/c")))
    assert proxy["iptables"]["masqueradeAll"] is True
    assert proxy["conntrack"]["maxPerCore"] == 0 and proxy["conntrack"]["min"] == 0
    commands = sandbox.build_network_commands()
    assert ["ip", "route", "add", "10.0.0.0/24", "dev", "cni0", "src", "10.244.0.1"] in commands


def test_kube_router_only_enforces_network_policies() -> None:
    # Routing stays with the bridge and Services with kube-proxy: kube-router's firewall alone,
    # for this node's pods, knowing the Service range (it lets ClusterIP traffic through).
    args = nodeconfig.build_kube_router_args(Path("/bin"), Layout(Path("/c")))
    assert args[0] == "/bin/kube-router"
    for flag in ("--run-firewall=true", "--run-router=false", "--run-service-proxy=false"):
        assert flag in args
    assert "--hostname-override=lora-devcluster" in args
    assert "--service-cluster-ip-range=10.0.0.0/24" in args


def test_dns_service_points_at_coredns_on_the_node() -> None:
    svc, endpoints = nodeconfig.build_dns_objects()
    assert svc["spec"]["clusterIP"] == "10.0.0.10" and "selector" not in svc["spec"]
    assert endpoints["endpoints"][0]["addresses"] == ["10.244.0.1"]
    assert endpoints["metadata"]["labels"] == {"kubernetes.io/service-name": "kube-dns"}
    corefile = nodeconfig.build_corefile(Layout(Path("/c")))
    assert "kubernetes cluster.local" in corefile
    # CoreDNS holds no port a user's port-forward asks for (the README's 8080).
    assert re.findall(r"127\.0\.0\.1:(\d+)", corefile) == ["8181"]


def test_default_storage_class_provisions_world_writable_directories_in_the_cluster(
    tmp_path: Path,
) -> None:
    layout = Layout(tmp_path / "c")
    storage_class, config_map = nodeconfig.build_storage_objects(layout, "base:1")
    annotations = storage_class["metadata"]["annotations"]
    assert annotations["storageclass.kubernetes.io/is-default-class"] == "true"
    assert str(layout.volumes) in config_map["data"]["config.json"]
    assert "mkdir -m 0777" in config_map["data"]["setup"]
    assert "base:1" in config_map["data"]["helperPod.yaml"]


def test_sandbox_mounts_cover_every_path_a_node_writes_outside_its_directory(
    tmp_path: Path,
) -> None:
    layout = Layout(tmp_path / "c")
    mounts = {m.target: m for m in sandbox.build_mounts(layout)}
    assert mounts["/run"].fstype == "tmpfs" and mounts["/var/log"].fstype == "tmpfs"
    assert mounts["/var/lib"].fstype == "overlay"
    assert str(layout.var_lib_upper) in mounts["/var/lib"].options
    assert mounts["/var/lib/kubelet"].source == str(layout.kubelet_root)
    assert mounts["/var/lib/containerd"].source == str(layout.containerd_root)
    for name in sandbox.KUBELET_SYSCTLS:
        m = mounts[f"/proc/sys/{name}"]
        assert m.bind and Path(m.source).is_relative_to(layout.root)
    # Order matters: the binds under /var/lib go on top of the overlay, not under it.
    targets = list(mounts)
    assert targets.index("/var/lib") < targets.index("/var/lib/kubelet")


def test_image_names_as_containerd_stores_them() -> None:
    assert imagestore.normalize_ref("lora-operator/inference:1") == (
        "docker.io/lora-operator/inference:1"
    )
    assert imagestore.normalize_ref("busybox:1") == "docker.io/library/busybox:1"
    for ref in ("localhost/lora-devcluster/pause:3.10", "registry.example:5000/x/y:1"):
        assert imagestore.normalize_ref(ref) == ref


def test_the_store_imports_only_new_archives_and_drops_images_nobody_wants() -> None:
    held = {"base@1": "localhost/b:1", "inference@1": "lora-operator/inference:0.1"}
    wanted = {"base@1": "localhost/b:1", "inference@2": "lora-operator/inference:0.1"}
    listed = ["localhost/b:1", "docker.io/lora-operator/inference:0.1", "localhost/b:0"]
    to_import, to_remove = imagestore.plan_update(held, wanted, listed)
    assert to_import == ["inference@2"]  # a new build of the same name: imported over it
    assert to_remove == ["localhost/b:0"]
    assert imagestore.plan_update(wanted, wanted, listed[:2]) == ([], [])


def test_linking_a_seed_shares_layers_and_copies_the_databases(tmp_path: Path) -> None:
    seed, root = tmp_path / "seed", tmp_path / "root"
    blob = seed / "io.containerd.content.v1.content" / "blobs" / "sha256" / "abc"
    layer = seed / "io.containerd.snapshotter.v1.overlayfs" / "snapshots" / "1" / "fs" / "bin"
    for f in (blob, layer, *(seed / p for p in imagestore.PRIVATE_FILES)):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(f.name)
    (layer.parent / "sh").symlink_to("bin")
    imagestore.link_tree(seed, root)
    linked = root / blob.relative_to(seed)
    assert linked.stat().st_ino == blob.stat().st_ino
    assert os.readlink(root / (layer.parent / "sh").relative_to(seed)) == "bin"
    for p in imagestore.PRIVATE_FILES:
        assert (root / p).read_text() == (seed / p).read_text()
        assert (root / p).stat().st_ino != (seed / p).stat().st_ino


def test_cgroup_hierarchies_are_read_from_the_mount_table(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "tmpfs /sys/fs/cgroup tmpfs rw 0 0\n"
        "cgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\n"
        "cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n"
        "/dev/vda / ext4 rw 0 0\n"
    )
    assert cgroups.hierarchies(str(mounts)) == [
        Path("/sys/fs/cgroup/memory"),
        Path("/sys/fs/cgroup/unified"),
    ]
