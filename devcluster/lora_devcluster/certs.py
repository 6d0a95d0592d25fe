"""Certificates and keys for the local control plane, generated with `cryptography`.

Owns: one self-signed CA, the API server's serving certificate, the admin client certificate
(CN=admin, O=system:masters), the node's client certificate (system:node:NAME, so the Node
authorizer and NodeRestriction apply to the kubelet as on a real cluster), the kubelet's serving
certificate (logs, exec and port-forward go from the API server to it), the service-account
signing key, a second CA for the aggregation layer's front proxy with the client certificate the
API server presents to extension API servers (prometheus-adapter: they trust the identity headers
of a request only with it), serving certificates of the cluster's CA for such servers, and
kubeconfigs with the data embedded (kopf's login reads client-certificate-data /
client-key-data).
Must not: start processes or talk to the network.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import ipaddress
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = datetime.timedelta(days=30)


@dataclasses.dataclass(frozen=True)
class PKI:
    """Paths of the files `write_pki` produced."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    admin_cert: Path
    admin_key: Path
    node_cert: Path
    node_key: Path
    kubelet_cert: Path
    kubelet_key: Path
    sa_key: Path
    sa_pub: Path
    front_proxy_ca_cert: Path
    proxy_client_cert: Path
    proxy_client_key: Path


# The name the API server's front-proxy client certificate carries; extension API servers accept
# identity headers only from it (--requestheader-allowed-names).
FRONT_PROXY_CLIENT = "front-proxy-client"


def _pem_key(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )


def _cert(
    subject: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool,
    usages: list[x509.ObjectIdentifier],
    sans: list[x509.GeneralName],
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def pki_at(directory: Path) -> PKI:
    """The paths `write_pki` writes under `directory` (pure: for its readers, such as the
    metrics pipeline, which signs a serving certificate with the CA)."""
    return PKI(
        ca_cert=directory / "ca.crt",
        ca_key=directory / "ca.key",
        server_cert=directory / "apiserver.crt",
        server_key=directory / "apiserver.key",
        admin_cert=directory / "admin.crt",
        admin_key=directory / "admin.key",
        node_cert=directory / "node.crt",
        node_key=directory / "node.key",
        kubelet_cert=directory / "kubelet.crt",
        kubelet_key=directory / "kubelet.key",
        sa_key=directory / "sa.key",
        sa_pub=directory / "sa.pub",
        front_proxy_ca_cert=directory / "front-proxy-ca.crt",
        proxy_client_cert=directory / "front-proxy-client.crt",
        proxy_client_key=directory / "front-proxy-client.key",
    )


def write_pki(
    directory: Path,
    server_ips: list[str],
    server_names: list[str],
    node_name: str,
    node_ip: str,
) -> PKI:
    """Generate a CA, the API server's serving cert for `server_ips`/`server_names`, the admin
    and node client certs, the kubelet's serving cert for `node_ip`/`node_name`, and the
    service-account key pair under `directory` (mode 0700)."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    pki = pki_at(directory)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("lora-devcluster-ca")
    ca = _cert(ca_name, ca_key, ca_name, ca_key, ca=True, usages=[], sans=[])

    server_key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips]
    sans += [x509.DNSName(n) for n in server_names]
    server = _cert(
        _name("kube-apiserver"),
        server_key,
        ca_name,
        ca_key,
        ca=False,
        usages=[ExtendedKeyUsageOID.SERVER_AUTH],
        sans=sans,
    )
    admin_key = ec.generate_private_key(ec.SECP256R1())
    admin = _cert(
        _name("admin", "system:masters"),
        admin_key,
        ca_name,
        ca_key,
        ca=False,
        usages=[ExtendedKeyUsageOID.CLIENT_AUTH],
        sans=[],
    )
    node_key = ec.generate_private_key(ec.SECP256R1())
    node = _cert(
        _name(f"system:node:{node_name}", "system:nodes"),
        node_key,
        ca_name,
        ca_key,
        ca=False,
        usages=[ExtendedKeyUsageOID.CLIENT_AUTH],
        sans=[],
    )
    kubelet_key = ec.generate_private_key(ec.SECP256R1())
    kubelet = _cert(
        _name(node_name),
        kubelet_key,
        ca_name,
        ca_key,
        ca=False,
        usages=[ExtendedKeyUsageOID.SERVER_AUTH],
        sans=[x509.IPAddress(ipaddress.ip_address(node_ip)), x509.DNSName(node_name)],
    )
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    # A CA of its own, as kubeadm does: a certificate of the cluster's CA (any client's) must not
    # be able to pass identity headers to an extension API server. Its key signs one certificate
    # and is not kept.
    front_key = ec.generate_private_key(ec.SECP256R1())
    front_name = _name("lora-devcluster-front-proxy-ca")
    front_ca = _cert(front_name, front_key, front_name, front_key, ca=True, usages=[], sans=[])
    proxy_key = ec.generate_private_key(ec.SECP256R1())
    proxy = _cert(
        _name(FRONT_PROXY_CLIENT),
        proxy_key,
        front_name,
        front_key,
        ca=False,
        usages=[ExtendedKeyUsageOID.CLIENT_AUTH],
        sans=[],
    )

    pem = serialization.Encoding.PEM
    pki.ca_cert.write_bytes(ca.public_bytes(pem))
    pki.ca_key.write_bytes(_pem_key(ca_key))
    pki.server_cert.write_bytes(server.public_bytes(pem))
    pki.server_key.write_bytes(_pem_key(server_key))
    pki.admin_cert.write_bytes(admin.public_bytes(pem))
    pki.admin_key.write_bytes(_pem_key(admin_key))
    pki.node_cert.write_bytes(node.public_bytes(pem))
    pki.node_key.write_bytes(_pem_key(node_key))
    pki.kubelet_cert.write_bytes(kubelet.public_bytes(pem))
    pki.kubelet_key.write_bytes(_pem_key(kubelet_key))
    pki.sa_key.write_bytes(_pem_key(sa_key))
    pki.sa_pub.write_bytes(
        sa_key.public_key().public_bytes(pem, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    pki.front_proxy_ca_cert.write_bytes(front_ca.public_bytes(pem))
    pki.proxy_client_cert.write_bytes(proxy.public_bytes(pem))
    pki.proxy_client_key.write_bytes(_pem_key(proxy_key))
    for path in (
        pki.ca_key,
        pki.server_key,
        pki.admin_key,
        pki.node_key,
        pki.kubelet_key,
        pki.sa_key,
        pki.proxy_client_key,
    ):
        path.chmod(0o600)
    return pki


def write_serving_cert(
    pki: PKI, cert: Path, key: Path, dns_names: list[str], ips: list[str]
) -> None:
    """A serving certificate of the cluster's CA for `dns_names` and `ips` (an extension API
    server's: the API server checks it against the APIService's caBundle, the CA's certificate)."""
    ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TypeError(f"{pki.ca_key} is not the EC key write_pki writes")
    server_key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    server = _cert(
        _name(dns_names[0] if dns_names else ips[0]),
        server_key,
        ca.subject,
        ca_key,
        ca=False,
        usages=[ExtendedKeyUsageOID.SERVER_AUTH],
        sans=sans,
    )
    cert.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(_pem_key(server_key))
    key.chmod(0o600)


def build_kubeconfig(
    server: str,
    pki: PKI,
    name: str = "lora-devcluster",
    *,
    user: tuple[Path, Path] | None = None,
) -> dict[str, object]:
    """A kubeconfig for `server` with the certificates embedded (pure apart from reading the
    PEM files): the admin's, or the client (certificate, key) pair given as `user`."""
    cert, key = user or (pki.admin_cert, pki.admin_key)

    def b64(path: Path) -> str:
        return base64.b64encode(path.read_bytes()).decode()

    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": name,
                "cluster": {"server": server, "certificate-authority-data": b64(pki.ca_cert)},
            }
        ],
        "users": [
            {
                "name": "admin",
                "user": {
                    "client-certificate-data": b64(cert),
                    "client-key-data": b64(key),
                },
            }
        ],
        "contexts": [{"name": name, "context": {"cluster": name, "user": "admin"}}],
        "current-context": name,
    }


def write_kubeconfig(path: Path, config: dict[str, object]) -> None:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
