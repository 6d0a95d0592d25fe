"""A real OCI registry for the oci:// tests: Debian's `docker-registry` (the distribution
registry, what the local cluster runs: lora_devcluster.registry) on 127.0.0.1 with a temporary
config and storage, anonymous, with htpasswd logins, or with token auth from `TokenServer`, a
token service of our own whose JWTs the registry verifies against its `rootcertbundle`.

`TokenServer` grants what `grants` says: a user (with its password) pushes and pulls every
repository; anyone pulls the repositories under `public/`; nothing else.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from aiohttp import web
from lora_operator import ocipush
from lora_operator.store import oci, sources

from tests.support.http import free_port
from tests.support.origin import Origin

BINARY = "docker-registry"
USER, PASSWORD = "alice", "s3cret-pw"
SERVICE, ISSUER = "lora-test-registry", "lora-test-tokens"


@dataclass
class Registry:
    address: str  # HOST:PORT
    mode: str  # anonymous, htpasswd, token
    folder: Path  # its config, and its storage under storage/
    tokens: TokenServer | None = None

    @property
    def host(self) -> str:
        return self.address.split(":")[0]


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def libtrust_key_id(public_der: bytes) -> str:
    """The key ID the distribution registry gives a key of its rootcertbundle (libtrust's: the
    SHA-256 of the DER public key, 240 bits, base32 in 12 groups of 4)."""
    encoded = base64.b32encode(hashlib.sha256(public_der).digest()[:30]).decode().rstrip("=")
    return ":".join(encoded[i : i + 4] for i in range(0, len(encoded), 4))


class TokenServer:
    """The distribution token flow's realm: GET /token?service=&scope= with Basic credentials
    or none answers {"token": JWT} for what `grants` allows; a wrong password is a 401."""

    def __init__(self, folder: Path) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import NameOID

        self._key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lora-test-tokens")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .sign(self._key, hashes.SHA256())
        )
        self.cert_path = folder / "tokens.pem"
        self.cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        der = self._key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        self._kid = libtrust_key_id(der)
        self.requests: list[dict[str, str]] = []
        self.origin = Origin()
        self.origin.routes["/token"] = self._handle

    @property
    def realm(self) -> str:
        return self.origin.url("/token")

    def close(self) -> None:
        self.origin.close()

    def grants(self, user: str | None, repository: str, actions: list[str]) -> list[str]:
        if user == USER:
            return actions
        return [a for a in actions if a == "pull"] if repository.startswith("public/") else []

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(
            dict(request.query) | {"auth": request.headers.get("Authorization", "")}
        )
        user = None
        auth = request.headers.get("Authorization", "")
        if auth.startswith("Basic "):
            name, _, password = base64.b64decode(auth[6:]).decode().partition(":")
            if (name, password) != (USER, PASSWORD):
                return web.json_response({"details": "bad login"}, status=401)
            user = name
        access: list[dict[str, object]] = []
        for scope in request.query.getall("scope", []):
            kind, _, rest = scope.partition(":")
            repository, _, actions = rest.rpartition(":")
            allowed = self.grants(user, repository, actions.split(","))
            if kind == "repository" and allowed:
                access.append({"type": "repository", "name": repository, "actions": allowed})
        return web.json_response({"token": self.token(user or "", access)})

    def token(self, subject: str, access: list[dict[str, object]]) -> str:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding

        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "kid": self._kid}
        claims = {
            "iss": ISSUER,
            "sub": subject,
            "aud": SERVICE,
            "exp": now + 300,
            "nbf": now - 10,
            "iat": now,
            "jti": uuid.uuid4().hex,
            "access": access,
        }
        signing = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        signature = self._key.sign(signing.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing}.{_b64url(signature)}"


def binary() -> str:
    path = shutil.which(BINARY)
    if path is None:
        if os.environ.get("CI"):
            raise RuntimeError(f"{BINARY} is not installed (apt-get install docker-registry)")
        pytest.skip(f"{BINARY} is not installed (apt-get install docker-registry)")
    return path


@contextlib.contextmanager
def run_registry(
    folder: Path, mode: str = "anonymous", host: str = "127.0.0.1"
) -> Iterator[Registry]:
    """docker-registry on `host` (an address of this network namespace), storage and config in
    `folder`; `mode` anonymous, htpasswd (USER/PASSWORD) or token (a TokenServer)."""
    exe = binary()
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    address = f"{host}:{port}"
    config: dict[str, object] = {
        "version": 0.1,
        "log": {"level": "warn", "accesslog": {"disabled": True}},
        "storage": {
            "filesystem": {"rootdirectory": str(folder / "storage")},
            "delete": {"enabled": True},
        },
        "http": {"addr": address, "secret": uuid.uuid4().hex},
    }
    tokens: TokenServer | None = None
    if mode == "htpasswd":
        import bcrypt

        hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=5)).decode()
        (folder / "htpasswd").write_text(f"{USER}:{hashed}\n")
        config["auth"] = {"htpasswd": {"realm": "lora-test", "path": str(folder / "htpasswd")}}
    elif mode == "token":
        tokens = TokenServer(folder)
        config["auth"] = {
            "token": {
                "realm": tokens.realm,
                "service": SERVICE,
                "issuer": ISSUER,
                "rootcertbundle": str(tokens.cert_path),
            }
        }
    (folder / "config.yml").write_text(yaml.safe_dump(config))
    log = (folder / "registry.log").open("wb")
    proc = subprocess.Popen(
        [exe, "serve", str(folder / "config.yml")], stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://{address}/v2/", timeout=1).close()
                break
            except urllib.error.HTTPError:
                break  # 401: up, and asking for a login
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{BINARY} did not start: {(folder / 'registry.log').read_text()[-2000:]}"
                    ) from None
                time.sleep(0.1)
        yield Registry(address, mode, folder, tokens)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
        if tokens is not None:
            tokens.close()


def docker_config(registry: str, username: str = USER, password: str = PASSWORD) -> str:
    """A `.dockerconfigjson` with one login, as `kubectl create secret docker-registry` writes."""
    auth = base64.b64encode(f"{username}:{password}".encode()).decode()
    return json.dumps(
        {"auths": {registry: {"username": username, "password": password, "auth": auth}}}
    )


def push(
    registry: Registry,
    path: Path,
    ref: str,
    *args: str,
    login: bool = False,
    password: str = PASSWORD,
) -> subprocess.CompletedProcess[str]:
    """`lora-operator adapter push PATH oci://REGISTRY/REF --plain-http ARGS`."""
    cmd = [sys.executable, "-m", "lora_operator.cli", "adapter", "push", str(path)]
    cmd += [f"oci://{registry.address}/{ref}", "--plain-http", *args]
    if login:
        cmd += ["--username", USER, "--password-stdin"]
    return subprocess.run(
        cmd, capture_output=True, text=True, input=f"{password}\n" if login else None, timeout=60
    )


def push_image(
    registry: Registry,
    ref: str,
    layers: list[tuple[str, bytes]],
    *,
    manifest_type: str = oci.DOCKER_MANIFEST,
    login: bool = False,
) -> str:
    """An image as buildah or docker push it (KAITO's adapter images): a config and tar
    layers; `login`: as USER."""
    config_type = (
        "application/vnd.docker.container.image.v1+json"
        if manifest_type == oci.DOCKER_MANIFEST
        else "application/vnd.oci.image.config.v1+json"
    )
    config = ocipush.Blob.of_bytes(config_type, b'{"architecture":"amd64","os":"linux"}')
    blobs = [ocipush.Blob.of_bytes(media_type, data) for media_type, data in layers]
    pusher = ocipush.Pusher(
        sources.parse_oci(f"oci://{registry.address}/{ref}"),
        plain_http=True,
        login=(USER, PASSWORD) if login else None,
    )
    for blob in (*blobs, config):
        pusher.push_blob(blob)
    doc = {
        "schemaVersion": 2,
        "mediaType": manifest_type,
        "config": config.descriptor(),
        "layers": [b.descriptor() for b in blobs],
    }
    return pusher.push_manifest(json.dumps(doc).encode(), manifest_type)
