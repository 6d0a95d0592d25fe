"""What an OCI registry answers, read (pure): manifests and indexes, the adapter's layer in one,
the registry's authentication challenges and token answers, and a pull Secret's logins.

Purely computational, no side effects: every body is bounded before it is parsed
(`lora_volume.boundedjson`), and nothing a registry answered is quoted in a message but what
the distribution spec defines (media types, digests, sizes). The requests are `ocifetch`'s; the
reference (`oci://REGISTRY/REPOSITORY:TAG`) is `sources.parse_oci`'s; publishing is `ocipush`'s.

The media types an adapter is published with (`lora-operator adapter push`, docs/staging.md):
an OCI image manifest whose `artifactType` is ADAPTER_ARTIFACT_TYPE, its config ADAPTER_CONFIG
(JSON: baseModel, triggerWords, format; informational) and one ADAPTER_LAYER, the safetensors
file itself. Also read: a layer with a `.safetensors` title annotation (what `oras push FILE`
writes), and an image's tar or tar+gzip layer holding the file under `data/` (KAITO's adapter
images).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, Literal
from urllib.parse import urlencode

from lora_volume import boundedjson, files
from lora_volume import errors as volume_errors

from lora_operator.rules import errors

ADAPTER_ARTIFACT_TYPE = "application/vnd.lora-operator.adapter.v1"
ADAPTER_LAYER = "application/vnd.lora-operator.adapter.layer.v1+safetensors"
ADAPTER_CONFIG = "application/vnd.lora-operator.adapter.config.v1+json"

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MANIFEST_TYPES = (OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST)
INDEX_TYPES = frozenset({OCI_INDEX, DOCKER_LIST})
# The Accept header of a manifest request: every kind read here.
MANIFEST_ACCEPT = ", ".join(MANIFEST_TYPES)

TAR_LAYERS = frozenset({"application/vnd.oci.image.layer.v1.tar"})
TAR_GZIP_LAYERS = frozenset(
    {
        "application/vnd.oci.image.layer.v1.tar+gzip",
        "application/vnd.docker.image.rootfs.diff.tar.gzip",
    }
)
TITLE_ANNOTATION = "org.opencontainers.image.title"
# Where an image's layer holds the adapter (KAITO's adapter images: `ADD adapter/ /data/`).
IMAGE_ADAPTER_DIR = "data"

# The distribution registry refuses manifests over 4 MiB; an index or manifest nests little.
MANIFEST_LIMITS = boundedjson.Limits(max_bytes=4 * 1024 * 1024, max_depth=16, max_values=100_000)
TOKEN_LIMITS = boundedjson.Limits(max_bytes=1024 * 1024, max_depth=8, max_values=1_000)
DOCKER_CONFIG_LIMITS = boundedjson.Limits(max_bytes=1024 * 1024, max_depth=8, max_values=10_000)
MAX_LAYERS = 128
MAX_CHALLENGE_CHARS = 4096

DOCKER_CONFIG_KEY = ".dockerconfigjson"
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    annotations: Mapping[str, str] = field(default_factory=dict)
    artifact_type: str | None = None
    platform: tuple[str, str] | None = None  # (os, architecture)

    @property
    def title(self) -> str | None:
        return self.annotations.get(TITLE_ANNOTATION)


@dataclass(frozen=True)
class Manifest:
    media_type: str
    artifact_type: str | None
    config: Descriptor | None
    layers: tuple[Descriptor, ...]


@dataclass(frozen=True)
class Index:
    media_type: str
    manifests: tuple[Descriptor, ...]


def parse_manifest(body: bytes) -> Manifest | Index:
    """A manifest or an index (pure), its kind from `mediaType`, or from its shape when it
    names none (the OCI spec only recommends it); raises ValueError saying what is wrong."""
    try:
        doc = boundedjson.parse(body, MANIFEST_LIMITS, where="it")
    except volume_errors.InvalidJson:
        raise ValueError(
            f"it is not JSON within {MANIFEST_LIMITS.max_bytes} bytes and "
            f"{MANIFEST_LIMITS.max_depth} levels"
        ) from None
    if not isinstance(doc, dict) or doc.get("schemaVersion") != 2:
        raise ValueError("it is not a schema version 2 manifest")
    media_type = doc.get("mediaType")
    if media_type is None:
        media_type = OCI_INDEX if "manifests" in doc else OCI_MANIFEST
    if media_type in INDEX_TYPES:
        entries = doc.get("manifests")
        if not isinstance(entries, list) or not entries:
            raise ValueError("it is an index that lists no manifest")
        return Index(str(media_type), tuple(_descriptor(e) for e in entries[:MAX_LAYERS]))
    if media_type not in (OCI_MANIFEST, DOCKER_MANIFEST):
        raise ValueError(
            f"its media type {str(media_type)[:100]!r} is none of {', '.join(MANIFEST_TYPES)}"
        )
    layers = doc.get("layers")
    if not isinstance(layers, list):
        raise ValueError("it lists no layers")
    if len(layers) > MAX_LAYERS:
        raise ValueError(f"it lists more than {MAX_LAYERS} layers")
    config = doc.get("config")
    artifact_type = doc.get("artifactType")
    return Manifest(
        media_type=str(media_type),
        artifact_type=artifact_type if isinstance(artifact_type, str) else None,
        config=_descriptor(config) if isinstance(config, dict) else None,
        layers=tuple(_descriptor(layer) for layer in layers),
    )


def _descriptor(raw: object) -> Descriptor:
    if not isinstance(raw, dict):
        raise ValueError("a descriptor is not an object")
    media_type, digest, size = raw.get("mediaType"), raw.get("digest"), raw.get("size")
    if not isinstance(media_type, str) or not media_type:
        raise ValueError("a descriptor has no mediaType")
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise ValueError("a descriptor's digest is not sha256: and 64 lowercase hex digits")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError("a descriptor's size is not a non-negative integer")
    annotations = raw.get("annotations")
    platform = raw.get("platform")
    artifact_type = raw.get("artifactType")
    return Descriptor(
        media_type=media_type,
        digest=digest,
        size=size,
        annotations={str(k): str(v) for k, v in annotations.items() if isinstance(v, str)}
        if isinstance(annotations, dict)
        else {},
        artifact_type=artifact_type if isinstance(artifact_type, str) else None,
        platform=(str(platform.get("os")), str(platform.get("architecture")))
        if isinstance(platform, dict)
        else None,
    )


def choose_manifest(index: Index) -> Descriptor:
    """The manifest of an index that holds the adapter (pure): the first whose artifactType is
    ours, else the first for linux/amd64 or for no platform (an adapter is the same file on
    every platform), else the first."""
    for entry in index.manifests:
        if entry.artifact_type == ADAPTER_ARTIFACT_TYPE:
            return entry
    for entry in index.manifests:
        if entry.platform in (None, ("linux", "amd64")) and entry.media_type in (
            OCI_MANIFEST,
            DOCKER_MANIFEST,
        ):
            return entry
    return index.manifests[0]


@dataclass(frozen=True)
class LayerChoice:
    """The layer(s) to read: `file`: one layer that is the weights file itself; `tar`: image
    layers to look in for `data/*.safetensors`, the topmost first."""

    kind: Literal["file", "tar"]
    layers: tuple[Descriptor, ...]


def choose_layer(manifest: Manifest, what: str) -> LayerChoice:
    """Which layer of `manifest` holds the adapter (pure); raises InvalidSource (or
    PickleRefused) saying what the manifest should hold."""
    ours = [layer for layer in manifest.layers if layer.media_type == ADAPTER_LAYER]
    if len(ours) > 1:
        raise errors.InvalidSource(
            f"{what}: the manifest has {len(ours)} layers of type {ADAPTER_LAYER}; publish one"
        )
    if ours:
        return LayerChoice("file", (ours[0],))
    # `oras push FILE` writes the file itself, titled with its name, under the tar media type
    # unless told another: a title with a file's suffix says the blob is that file.
    titled = [
        layer
        for layer in manifest.layers
        if _suffix(layer.title) and layer.media_type not in TAR_GZIP_LAYERS
    ]
    safetensors = [layer for layer in titled if _suffix(layer.title) == ".safetensors"]
    if len(safetensors) > 1:
        raise errors.InvalidSource(
            f"{what}: the manifest has {len(safetensors)} .safetensors layers; publish one"
        )
    if safetensors:
        return LayerChoice("file", (safetensors[0],))
    tars = [
        layer
        for layer in manifest.layers
        if layer.media_type in TAR_LAYERS | TAR_GZIP_LAYERS and layer not in titled
    ]
    if tars:
        return LayerChoice("tar", tuple(reversed(tars)))
    if any(_suffix(layer.title) in files.PICKLE_SUFFIXES for layer in titled):
        raise errors.PickleRefused(
            f"{what}: the artifact holds only pickle weights, which can run code when opened "
            "and are never staged; publish a .safetensors file"
        )
    kinds = sorted({layer.media_type[:100] for layer in manifest.layers}) or ["none"]
    raise errors.InvalidSource(
        f"{what}: the manifest has no adapter layer (layer types: {', '.join(kinds[:5])}); "
        f"publish the file as a {ADAPTER_LAYER} layer (lora-operator adapter push), or as an "
        f"image whose layer holds it under /{IMAGE_ADAPTER_DIR}/"
    )


def _suffix(title: str | None) -> str:
    return PurePosixPath(title or "").suffix.lower()


def image_member(name: str) -> Literal["weights", "pickle", "other"]:
    """What a file of an image layer is to the adapter (pure): the weights (a `.safetensors`
    right under `data/`), pickle weights there, or anything else."""
    path = PurePosixPath(name.lstrip("/").removeprefix("./"))
    if len(path.parts) != 2 or path.parts[0] != IMAGE_ADAPTER_DIR:
        return "other"
    if path.suffix.lower() == ".safetensors":
        return "weights"
    return "pickle" if path.suffix.lower() in files.PICKLE_SUFFIXES else "other"


# ---- authentication: the registry's challenge, the token service's answer


@dataclass(frozen=True)
class Challenge:
    scheme: str  # lowercase: "bearer", "basic"
    params: Mapping[str, str]


_AUTH_PARAM = re.compile(r'\s*([A-Za-z0-9_.-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^\s,"]*)\s*(?:,|$)')
_SCHEME = re.compile(r"\s*([A-Za-z][A-Za-z0-9_-]*)(?:\s+|$)")


def parse_www_authenticate(header: str) -> list[Challenge]:
    """The challenges of a `WWW-Authenticate` value (RFC 7235 auth-params; pure): each scheme
    with its parameters, quoted strings unescaped. A value longer than MAX_CHALLENGE_CHARS, or
    what cannot be read, gives none."""
    if len(header) > MAX_CHALLENGE_CHARS:
        return []
    challenges: list[Challenge] = []
    rest = header.strip()
    while rest:
        m = _SCHEME.match(rest)
        if m is None:
            return challenges
        scheme = m.group(1).lower()
        rest = rest[m.end() :]
        params: dict[str, str] = {}
        while rest:
            p = _AUTH_PARAM.match(rest)
            if p is None:
                break
            value = p.group(2)
            if value.startswith('"'):
                value = re.sub(r"\\(.)", r"\1", value[1:-1])
            params[p.group(1).lower()] = value
            rest = rest[p.end() :]
        challenges.append(Challenge(scheme, params))
        rest = rest.lstrip(", ")
    return challenges


def token_url(challenge: Challenge, repository: str, actions: Sequence[str] = ("pull",)) -> str:
    """The token service's URL for `repository` (pure): the realm with `service` and the
    scope asked for; raises ValueError when the challenge names no realm."""
    realm = challenge.params.get("realm")
    if not realm:
        raise ValueError("the registry's Bearer challenge names no realm")
    query: list[tuple[str, str]] = []
    if challenge.params.get("service"):
        query.append(("service", challenge.params["service"]))
    query.append(("scope", f"repository:{repository}:{','.join(actions)}"))
    sep = "&" if "?" in realm else "?"
    return f"{realm}{sep}{urlencode(query)}"


def parse_token(body: bytes) -> str:
    """The token of a token service's answer (`token`, or OAuth's `access_token`) (pure);
    raises ValueError."""
    try:
        doc = boundedjson.parse(body, TOKEN_LIMITS, where="it")
    except volume_errors.InvalidJson:
        raise ValueError("the token service's answer is not JSON within bounds") from None
    token = doc.get("token") or doc.get("access_token") if isinstance(doc, dict) else None
    if not isinstance(token, str) or not token or not token.isascii() or " " in token:
        raise ValueError("the token service's answer holds no token")
    return token


def basic_authorization(username: str, password: str) -> str:
    raw = f"{username}:{password}".encode()
    return "Basic " + base64.b64encode(raw).decode()


# ---- a pull Secret's logins (`kubernetes.io/dockerconfigjson`)


def parse_docker_config(text: str | bytes) -> tuple[tuple[str, str, str], ...]:
    """(registry, username, password) for each login of a Docker config (`auths`: `auth`, the
    base64 of `user:password`, or `username` and `password`) (pure); registries as `host[:port]`
    (a URL's scheme and path dropped). Raises InvalidSource, never quoting the Secret."""
    where = f"the Secret's {DOCKER_CONFIG_KEY}"
    raw = text.encode() if isinstance(text, str) else text
    try:
        doc = boundedjson.parse(raw, DOCKER_CONFIG_LIMITS, where="it")
    except volume_errors.InvalidJson:
        raise errors.InvalidSource(f"{where} is not JSON; recreate the Secret") from None
    auths = doc.get("auths") if isinstance(doc, dict) else None
    if not isinstance(auths, dict):
        raise errors.InvalidSource(f'{where} has no "auths" object; recreate the Secret')
    logins = []
    for key, entry in auths.items():
        if not isinstance(entry, dict):
            continue
        username, password = entry.get("username"), entry.get("password")
        if isinstance(entry.get("auth"), str) and entry["auth"]:
            try:
                decoded = base64.b64decode(entry["auth"], validate=True).decode()
            except (binascii.Error, UnicodeDecodeError):
                raise errors.InvalidSource(
                    f"{where}: the auth of {registry_key(key)} is not base64 of user:password"
                ) from None
            username, _, password = decoded.partition(":")
        if isinstance(username, str) and isinstance(password, str) and username:
            logins.append((registry_key(key), username, password))
    return tuple(logins)


_DOCKER_HUB = {"index.docker.io", "docker.io", "registry-1.docker.io"}


def registry_key(key: str) -> str:
    """A Docker config's registry key as `host[:port]`, lowercase (pure): `https://r.io/v1/`
    is `r.io`; Docker Hub's names are one."""
    host = key.strip().lower()
    host = host.split("://", 1)[1] if "://" in host else host
    host = host.split("/", 1)[0]
    return "docker.io" if host in _DOCKER_HUB else host


def login_for(logins: Sequence[tuple[str, str, str]], registry: str) -> tuple[str, str] | None:
    """The (username, password) for `registry` (`host[:port]`) (pure)."""
    wanted = registry_key(registry)
    for key, username, password in logins:
        if key == wanted:
            return username, password
    return None


def config_blob(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The config an adapter is published with: the metadata's known keys only (pure)."""
    known = ("baseModel", "triggerWords", "format")
    return {k: metadata[k] for k in known if k in metadata and metadata[k] not in (None, [], "")}
