"""Who a process is to the API server, and where that server is: in a pod, its ServiceAccount at
the address Kubernetes puts in every pod's environment (`in_cluster`); outside one, the current
context of the kubeconfig (`from_kubeconfig`, for a router run by hand).

The token file is read at each login, so a rotated token is picked up by the next one. The
inference server reviews tokens with its own ServiceAccount (`api_server_address`,
`SERVICE_ACCOUNT`); the operator hands `in_cluster` to kopf in its own login glue.

Owns: reading the credentials. Must not: log a token or a key.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import os
import ssl
import tempfile
from pathlib import Path
from typing import Any

import yaml

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclasses.dataclass(frozen=True)
class Login:
    """An API server and the credentials to call it with (a `kube.Credentials`). Paths as
    given; `*_data` fields are PEM or base64 of PEM, as a kubeconfig holds them."""

    server: str
    token: str | None = None
    ca_path: str | None = None
    ca_data: str | None = None
    insecure: bool = False
    certificate_path: str | None = None
    certificate_data: str | None = None
    private_key_path: str | None = None
    private_key_data: str | None = None
    username: str | None = None
    password: str | None = None
    default_namespace: str | None = None

    def as_http_headers(self) -> dict[str, str]:
        if self.username and self.password:
            basic = base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
            return {"Authorization": f"Basic {basic}"}
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def as_ssl_context(self) -> ssl.SSLContext:
        cadata = _pem(self.ca_data) if self.ca_data else None
        context = ssl.create_default_context(cafile=self.ca_path, cadata=cadata)
        # Python's ssl loads a client certificate from files only: data goes through temporary
        # files, removed as soon as the context holds it.
        with contextlib.ExitStack() as stack:
            cert = self.certificate_path or _file(stack, self.certificate_data)
            key = self.private_key_path or _file(stack, self.private_key_data)
            if cert and key:
                context.load_cert_chain(certfile=cert, keyfile=key)
        if self.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context


def _pem(data: str) -> str:
    return data if data.startswith("-----BEGIN ") else base64.b64decode(data).decode("ascii")


def _file(stack: contextlib.ExitStack, data: str | None) -> str | None:
    if not data:
        return None
    handle = stack.enter_context(tempfile.NamedTemporaryFile(buffering=0))  # noqa: SIM115
    handle.write(_pem(data).encode("ascii"))
    return handle.name


def api_server_address() -> str | None:
    """`https://host:port` of the API server as Kubernetes gives every pod in its environment
    (as client-go reads it; not the kubernetes.default.svc DNS name); None outside a pod."""
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    if not host:
        return None
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def pod_namespace() -> str | None:
    """The namespace of the pod this process runs in (None outside a pod)."""
    path = SERVICE_ACCOUNT / "namespace"
    return path.read_text().strip() if path.is_file() else None


def in_cluster() -> Login | None:
    """The pod's ServiceAccount at the API server's in-cluster address; None outside a pod."""
    server = api_server_address()
    token_file = SERVICE_ACCOUNT / "token"
    if server is None or not token_file.is_file():
        return None
    ca = SERVICE_ACCOUNT / "ca.crt"
    return Login(
        server=server,
        token=token_file.read_text().strip(),
        ca_path=str(ca) if ca.is_file() else None,
        default_namespace=pod_namespace(),
    )


def from_kubeconfig(env: str | None = None) -> Login | None:
    """The current context of the kubeconfig (`KUBECONFIG`, its files joined as kubectl joins
    them, or ~/.kube/config); None when there is none. Reads what a kubeconfig holds directly
    (a token, client certificates, basic auth), no exec plugins; relative paths are the
    file's."""
    listed = os.environ.get("KUBECONFIG") if env is None else env
    default = Path("~/.kube/config").expanduser()
    if not listed and not default.is_file():
        return None
    paths = [Path(p).expanduser() for p in (listed or str(default)).split(os.pathsep) if p]
    current: str | None = None
    found: dict[str, dict[str, tuple[Path, dict[str, Any]]]] = {
        "contexts": {},
        "clusters": {},
        "users": {},
    }
    for path in paths:
        config = yaml.safe_load(path.read_text()) or {}
        current = current or config.get("current-context")
        for section, entries in found.items():
            for item in config.get(section) or ():
                # The first file that names an entry wins, as kubectl merges them.
                entries.setdefault(item["name"], (path.parent, item.get(section[:-1]) or {}))
    if not current:
        named = os.pathsep.join(map(str, paths))
        raise ValueError(f"no current-context in the kubeconfig ({named})")
    _, context = found["contexts"][current]
    where, cluster = found["clusters"][context["cluster"]]
    home, user = found["users"][context["user"]]
    provider_token = ((user.get("auth-provider") or {}).get("config") or {}).get("access-token")
    token = user.get("token") or provider_token
    if not token and user.get("tokenFile"):
        token = (home / user["tokenFile"]).read_text().strip()
    return Login(
        server=cluster["server"],
        token=token,
        ca_path=_relative(where, cluster.get("certificate-authority")),
        ca_data=cluster.get("certificate-authority-data"),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        certificate_path=_relative(home, user.get("client-certificate")),
        certificate_data=user.get("client-certificate-data"),
        private_key_path=_relative(home, user.get("client-key")),
        private_key_data=user.get("client-key-data"),
        username=user.get("username"),
        password=user.get("password"),
        default_namespace=context.get("namespace"),
    )


def _relative(base: Path, path: str | None) -> str | None:
    return str(base / Path(path).expanduser()) if path else None
