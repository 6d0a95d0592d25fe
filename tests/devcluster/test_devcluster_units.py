"""Pure or local parts of the harness: certificates, kubeconfig, image map, IPs, CLI."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from lora_devcluster import certs, cli, cluster, kubelet, mountpoints


def test_pki_has_a_serving_cert_for_every_address_and_an_admin_client_cert(tmp_path: Path) -> None:
    pki = certs.write_pki(tmp_path / "pki", ["127.0.0.1", "10.244.0.1"], ["kubernetes"])
    server = x509.load_pem_x509_certificate(pki.server_cert.read_bytes())
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)} == {
        "127.0.0.1",
        "10.244.0.1",
    }
    assert sans.get_values_for_type(x509.DNSName) == ["kubernetes"]
    admin = x509.load_pem_x509_certificate(pki.admin_cert.read_bytes())
    assert admin.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == (
        "system:masters"
    )
    usages = admin.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.CLIENT_AUTH in usages
    ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    admin.verify_directly_issued_by(ca)
    server.verify_directly_issued_by(ca)
    assert pki.admin_key.stat().st_mode & 0o077 == 0


def test_kubeconfig_embeds_the_certificates(tmp_path: Path) -> None:
    pki = certs.write_pki(tmp_path, ["127.0.0.1"], [])
    path = tmp_path / "kubeconfig"
    certs.write_kubeconfig(path, certs.build_kubeconfig("https://127.0.0.1:6443", pki))
    config = yaml.safe_load(path.read_text())
    user = config["users"][0]["user"]
    assert base64.b64decode(user["client-certificate-data"]) == pki.admin_cert.read_bytes()
    assert base64.b64decode(user["client-key-data"]) == pki.admin_key.read_bytes()
    assert config["clusters"][0]["cluster"]["server"] == "https://127.0.0.1:6443"
    assert config["current-context"] == config["contexts"][0]["name"]


def test_ip_allocator_round_robin_gives_a_replacement_a_new_ip() -> None:
    ips = kubelet.IPAllocator("10.244.0.")
    first, second = ips.allocate(), ips.allocate()
    assert (first, second) == ("10.244.0.2", "10.244.0.3")
    ips.release(first)
    assert ips.allocate() == "10.244.0.4"  # not the one just released


def test_ip_allocator_wraps_and_reports_exhaustion() -> None:
    ips = kubelet.IPAllocator("10.244.0.")
    allocated = [ips.allocate() for _ in range(253)]
    assert len(set(allocated)) == 253
    with pytest.raises(RuntimeError, match="no free pod IP"):
        ips.allocate()
    ips.release("10.244.0.100")
    assert ips.allocate() == "10.244.0.100"


def test_image_map_file_extends_the_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "images.yaml"
    f.write_text("'my/img:*': ['/bin/true']\n")
    mapping = cluster.load_image_map(str(f))
    assert mapping["my/img:*"] == ["/bin/true"]
    assert mapping["lora-operator/inference:*"] == [
        str(Path(sys.executable).parent / "lora-inference")
    ]
    monkeypatch.setenv("LORA_DEVCLUSTER_IMAGE_MAP", str(f))
    assert "my/img:*" in cluster.load_image_map(None)
    f.write_text("- not a mapping\n")
    with pytest.raises(cluster.ClusterError, match="must be a mapping"):
        cluster.load_image_map(str(f))


def test_cli_parses_every_subcommand_with_dir() -> None:
    parser = cli.build_parser()
    for cmd in ("up", "down", "bin-dir"):
        args = parser.parse_args([cmd, "--dir", "/x"])
        assert args.dir == Path("/x")
    args = parser.parse_args(["exec", "--dir", "/x", "--", "kubectl", "get", "pods", "-A"])
    assert args.command[-4:] == ["kubectl", "get", "pods", "-A"]


def test_bin_dir_is_keyed_by_version_outside_the_repository() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "lora_devcluster.cli", "bin-dir"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip())
    assert path.name == "k8s-v1.37.2-etcd-v3.6.16-helm-v3.22.0"
    assert cluster.repo_root() not in path.parents


def test_leftovers_of_a_directory_that_never_ran_is_empty(tmp_path: Path) -> None:
    assert cluster.leftovers(tmp_path / "never") == []
    assert cluster.down(tmp_path / "never") is False


def test_down_and_up_refuse_a_directory_that_is_not_a_cluster(tmp_path: Path) -> None:
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    with pytest.raises(cluster.ClusterError, match="not a lora-devcluster state directory"):
        cluster.down(precious)
    assert (precious / "thesis.tex").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts in a mount namespace need root")
def test_mountpoints_still_used_by_another_namespace_are_kept(tmp_path: Path) -> None:
    registry = tmp_path / "run" / "mountpoints"
    unused, used, src = tmp_path / "unused", tmp_path / "used", tmp_path / "src"
    for d in (unused, used, src):
        d.mkdir()
        mountpoints.record(d, registry)
    mountpoints.record(unused, registry)  # recorded once only
    holder = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f"mount --bind {src} {used} && echo mounted && exec sleep 60"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "mounted"
        mountpoints.remove_unused(registry)
        assert not unused.exists() and not src.exists()
        assert used.exists()  # removing it would detach the other namespace's mount
        assert registry.read_text().split() == [str(used)]
    finally:
        holder.kill()
        holder.wait()
    mountpoints.remove_unused(registry)
    assert not used.exists()
    assert not registry.parent.exists()


def test_mountpoints_never_removes_a_directory_with_content(tmp_path: Path) -> None:
    registry = tmp_path / "run" / "mountpoints"
    d = tmp_path / "d"
    d.mkdir()
    (d / "keep").write_text("x")
    mountpoints.record(d, registry)
    mountpoints.remove_unused(registry)
    assert (d / "keep").exists()
