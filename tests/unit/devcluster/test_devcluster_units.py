"""Pure or local parts of the cluster tool: certificates, kubeconfig, CLI, state directories."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from lora_devcluster import certs, cli, cluster


def test_pki_has_a_serving_cert_for_every_address_and_an_admin_client_cert(tmp_path: Path) -> None:
    pki = certs.write_pki(
        tmp_path / "pki", ["127.0.0.1", "10.244.0.1"], ["kubernetes"], "node-a", "10.244.0.1"
    )
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
    # The kubelet authenticates as its node (the Node authorizer and NodeRestriction apply)
    # and serves logs/exec on the node address with a certificate of the same CA.
    node = x509.load_pem_x509_certificate(pki.node_cert.read_bytes())
    assert node.subject.rfc4514_string() == "O=system:nodes,CN=system:node:node-a"
    kubelet = x509.load_pem_x509_certificate(pki.kubelet_cert.read_bytes())
    kubelet_sans = kubelet.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in kubelet_sans.get_values_for_type(x509.IPAddress)] == ["10.244.0.1"]
    for cert in (node, kubelet):
        cert.verify_directly_issued_by(ca)


def test_kubeconfig_embeds_the_certificates(tmp_path: Path) -> None:
    pki = certs.write_pki(tmp_path, ["127.0.0.1"], [], "n", "10.244.0.1")
    path = tmp_path / "kubeconfig"
    certs.write_kubeconfig(path, certs.build_kubeconfig("https://127.0.0.1:6443", pki))
    config = yaml.safe_load(path.read_text())
    user = config["users"][0]["user"]
    assert base64.b64decode(user["client-certificate-data"]) == pki.admin_cert.read_bytes()
    assert base64.b64decode(user["client-key-data"]) == pki.admin_key.read_bytes()
    assert config["clusters"][0]["cluster"]["server"] == "https://127.0.0.1:6443"
    assert config["current-context"] == config["contexts"][0]["name"]


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
    assert path.name.startswith("k8s-v1.37.2-etcd-v3.6.16-helm-v3.22.0-coredns-")
    assert cluster.repo_root() not in path.parents


def test_leftovers_of_a_directory_that_never_ran_is_empty(tmp_path: Path) -> None:
    assert cluster.leftovers(tmp_path / "never") == []
    assert cluster.down(tmp_path / "never") is False


HEALTHY_KERNEL: dict[str, Any] = {  # kernel_gap's keywords
    "filesystems": "nodev\tproc\nnodev\toverlay\n\text4\n",
    "bridge_netfilter": True,
    "cgroup_hierarchies": True,
}


@pytest.mark.parametrize(
    ("missing", "says"),
    [
        ({"filesystems": "nodev\tproc\n\text4\n"}, "modprobe overlay"),
        ({"bridge_netfilter": False}, "modprobe br_netfilter"),
        ({"cgroup_hierarchies": False}, "no cgroup hierarchy"),
    ],
)
def test_a_missing_kernel_feature_is_named_with_what_to_do(
    missing: dict[str, Any], says: str
) -> None:
    assert cluster.kernel_gap(**HEALTHY_KERNEL) is None
    gap = cluster.kernel_gap(**{**HEALTHY_KERNEL, **missing})
    assert gap is not None and says in gap


def test_down_and_up_refuse_a_directory_that_is_not_a_cluster(tmp_path: Path) -> None:
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    with pytest.raises(cluster.ClusterError, match="not a lora-devcluster state directory"):
        cluster.down(precious)
    assert (precious / "thesis.tex").exists()


def go_mod_versions(go_mod: Path) -> dict[str, str]:
    """Module -> the version a go.mod selects for it: its require, overridden by its replace."""
    required: dict[str, str] = {}
    replaced: dict[str, str] = {}
    block = ""  # inside `require (` or `replace (`
    for raw in go_mod.read_text().splitlines():
        words = raw.split("//")[0].split()
        if words in (["require", "("], ["replace", "("]):
            block = words[0]
            continue
        if words == [")"]:
            block = ""
            continue
        kind = block
        if words[:1] in (["require"], ["replace"]):  # a one-line directive
            kind, words = words[0], words[1:]
        if kind == "require" and len(words) == 2:
            required[words[0]] = words[1]
        elif kind == "replace" and "=>" in words:
            target = words[words.index("=>") + 1 :]
            if len(target) == 2 and target[0] == words[0]:
                replaced[words[0]] = target[1]
    return {**required, **replaced}


@pytest.mark.parametrize("wrapper", ["helm", "coredns", "local-path"])
def test_the_helper_binaries_share_the_kubernetes_builds_module_versions(wrapper: str) -> None:
    # Same versions, same compiled packages in Go's build cache: a cold build compiles
    # client-go and the rest once. hack/align-go-modules.py restores this after a pin changes.
    hack = cluster.repo_root() / "hack"
    node = go_mod_versions(hack / "k8s" / "go.mod")
    theirs = go_mod_versions(hack / wrapper / "go.mod")
    assert len(set(node) & set(theirs)) > 20  # client-go, apimachinery, x/net, ...
    differ = {m: (v, node[m]) for m, v in theirs.items() if m in node and node[m] != v}
    assert differ == {}, f"run hack/align-go-modules.py: {differ}"
