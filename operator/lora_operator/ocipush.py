"""Publishing an adapter to an OCI registry: `lora-operator adapter push FILE oci://...`.

Pushes the weights as one ADAPTER_LAYER blob, the metadata (base model, trigger words, format)
as the config blob, and an OCI image manifest with `artifactType` ADAPTER_ARTIFACT_TYPE tagged as
the reference says (`oci`'s media types; docs/staging.md). The distribution API's monolithic
upload (POST, then PUT with the digest); a blob the registry has already is not sent again.
Authentication as the operator pulls (`ocifetch`), with push scope: anonymous, Basic, or a
Bearer token from the challenge's realm, with the login of a Docker config file (`docker login`
writes it) or of --username and --password-stdin.

A client tool run by people who publish adapters, on their own machine or in CI: it reaches the
registry the user names directly (urllib3), not through the operator's egress rules, which
guard what tenants may make the operator fetch. Must not be imported by the operator.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import urllib3

from lora_operator.rules import errors
from lora_operator.store import oci, sources

CHUNK = 1024 * 1024


class PushError(Exception):
    """The push failed; the message says what to fix."""


@dataclass(frozen=True)
class Blob:
    media_type: str
    digest: str
    size: int
    path: Path | None = None  # its bytes: a file, or `data`
    data: bytes = b""
    annotations: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of_bytes(cls, media_type: str, data: bytes, **kw: Any) -> Blob:
        return cls(
            media_type, "sha256:" + hashlib.sha256(data).hexdigest(), len(data), data=data, **kw
        )

    @classmethod
    def of_file(cls, media_type: str, path: Path, **kw: Any) -> Blob:
        h = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
        return cls(media_type, "sha256:" + h.hexdigest(), path.stat().st_size, path=path, **kw)

    def descriptor(self) -> dict[str, Any]:
        d: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.annotations:
            d["annotations"] = dict(self.annotations)
        return d


def build_manifest(
    config: Blob, layers: Sequence[Blob], *, artifact_type: str | None = oci.ADAPTER_ARTIFACT_TYPE
) -> bytes:
    """An OCI image manifest over `config` and `layers` (pure)."""
    doc: dict[str, Any] = {"schemaVersion": 2, "mediaType": oci.OCI_MANIFEST}
    if artifact_type:
        doc["artifactType"] = artifact_type
    doc["config"] = config.descriptor()
    doc["layers"] = [layer.descriptor() for layer in layers]
    return json.dumps(doc, separators=(",", ":")).encode()


def adapter_blobs(path: Path, metadata: Mapping[str, Any]) -> tuple[Blob, list[Blob]]:
    """The config and layer of an adapter: `path` a .safetensors file, or a folder holding one
    (the weights file diffusers and peft name, or its only .safetensors) and optionally a
    `metadata.json` (baseModel, triggerWords, format), which `metadata` overrides."""
    weights = path
    meta: dict[str, Any] = {}
    if path.is_dir():
        candidates = sorted(p.name for p in path.iterdir() if p.is_file())
        try:
            weights = path / sources.choose_hf_file(candidates, source=str(path))
        except errors.StagingError as e:
            raise PushError(e.message) from e
        if (path / "metadata.json").is_file():
            loaded = json.loads((path / "metadata.json").read_text())
            if not isinstance(loaded, dict):
                raise PushError(f"{path}/metadata.json is not a JSON object")
            meta.update(loaded)
    if weights.suffix.lower() != ".safetensors":
        raise PushError(f"{weights} is not a .safetensors file; only safetensors are staged")
    meta.update({k: v for k, v in metadata.items() if v not in (None, [], "")})
    config = Blob.of_bytes(
        oci.ADAPTER_CONFIG, json.dumps(oci.config_blob(meta), sort_keys=True).encode()
    )
    layer = Blob.of_file(
        oci.ADAPTER_LAYER, weights, annotations={oci.TITLE_ANNOTATION: weights.name}
    )
    return config, [layer]


def docker_logins(config_dir: str | None = None) -> tuple[tuple[str, str, str], ...]:
    """The logins of the Docker config file (`$DOCKER_CONFIG/config.json`, else
    ~/.docker/config.json); none when there is no such file."""
    folder = Path(config_dir or os.environ.get("DOCKER_CONFIG") or Path.home() / ".docker")
    try:
        text = (folder / "config.json").read_text()
    except OSError:
        return ()
    try:
        return oci.parse_docker_config(text) if '"auths"' in text else ()
    except errors.StagingError as e:
        raise PushError(f"{folder / 'config.json'}: {e.message}") from e


class Pusher:
    """Pushes blobs and a manifest to one repository."""

    def __init__(
        self,
        reference: sources.OciSource,
        *,
        login: tuple[str, str] | None = None,
        plain_http: bool = False,
        pool: urllib3.PoolManager | None = None,
    ) -> None:
        self.ref = reference
        scheme = "http" if plain_http else "https"
        self.registry_url = f"{scheme}://{reference.registry}"
        self.base = f"{self.registry_url}/v2/{reference.repository}"
        self.login = login
        self.authorization: str | None = None
        self._pool = pool or urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(30, 300))

    def push(self, config: Blob, layers: Sequence[Blob], manifest: bytes) -> str:
        """Push the blobs, then the manifest; returns the manifest's digest."""
        for blob in (*layers, config):
            self.push_blob(blob)
        return self.push_manifest(manifest)

    def push_manifest(self, manifest: bytes, media_type: str = oci.OCI_MANIFEST) -> str:
        """PUT a manifest (or an index) under the reference's tag, else its own digest; returns
        its digest."""
        digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
        resp = self._request(
            "PUT",
            f"{self.base}/manifests/{self.ref.tag or digest}",
            body=manifest,
            headers={"Content-Type": media_type},
        )
        self._expect(resp, (201,), "the manifest")
        return digest

    def push_blob(self, blob: Blob) -> None:
        head = self._request("HEAD", f"{self.base}/blobs/{blob.digest}")
        if head.status == 200:
            return
        start = self._request("POST", f"{self.base}/blobs/uploads/", body=b"")
        self._expect(start, (202,), "an upload")
        location = start.headers.get("Location")
        if not location:
            raise PushError("the registry started an upload without a Location")
        if location.startswith("/"):
            location = self.registry_url + location
        sep = "&" if "?" in location else "?"
        url = f"{location}{sep}digest={blob.digest}"
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(blob.size)}
        if blob.path is not None:
            with blob.path.open("rb") as f:
                resp = self._request("PUT", url, body=f, headers=headers)
        else:
            resp = self._request("PUT", url, body=blob.data, headers=headers)
        self._expect(resp, (201,), f"the blob {blob.digest}")

    def _request(
        self,
        method: str,
        url: str,
        *,
        body: bytes | BinaryIO | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> urllib3.BaseHTTPResponse:
        tried: set[str] = set()
        while True:
            if hasattr(body, "seek"):
                body.seek(0)  # type: ignore[union-attr]
            h = dict(headers or {})
            if self.authorization:
                h["Authorization"] = self.authorization
            resp = self._pool.request(
                method, url, body=body, headers=h, redirect=False, preload_content=True
            )
            if resp.status != 401:
                return resp
            challenges = {
                c.scheme: c
                for c in oci.parse_www_authenticate(resp.headers.get("WWW-Authenticate", ""))
            }
            if "bearer" in challenges and "bearer" not in tried:
                tried.add("bearer")
                self.authorization = f"Bearer {self._token(challenges['bearer'])}"
            elif "basic" in challenges and self.login and "basic" not in tried:
                tried.add("basic")
                self.authorization = oci.basic_authorization(*self.login)
            else:
                raise PushError(
                    f"{self.ref.registry} answered HTTP 401 to {method}: "
                    + (
                        "log in (docker login, or --username and --password-stdin)"
                        if self.login is None
                        else f"the login was refused, or it may not push to {self.ref.repository}"
                    )
                )

    def _token(self, challenge: oci.Challenge) -> str:
        url = oci.token_url(challenge, self.ref.repository, ("pull", "push"))
        headers = {"Authorization": oci.basic_authorization(*self.login)} if self.login else {}
        resp = self._pool.request("GET", url, headers=headers, redirect=False)
        if resp.status != 200:
            raise PushError(f"the registry's token service answered HTTP {resp.status}")
        try:
            return oci.parse_token(resp.data)
        except ValueError as e:
            raise PushError(str(e)) from e

    def _expect(self, resp: urllib3.BaseHTTPResponse, ok: tuple[int, ...], what: str) -> None:
        if resp.status not in ok:
            detail = resp.data[:300].decode("utf-8", "replace").strip()
            raise PushError(f"pushing {what} failed: HTTP {resp.status} {detail}")
