"""Where an adapter comes from: the parsed `spec.source` and the credentials of its Secret.

Purely computational, no side effects: parsing, naming, and choosing a file from a listing. The
I/O lives in `fetchers`. The API server already validates the URI (see crds/); the checks here
repeat the ones staging depends on, so a bad value never reaches a fetcher.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

from lora_volume import files

from lora_operator import errors

DEFAULT_HF_REVISION = "main"

_HF = re.compile(r"^hf://([A-Za-z0-9][A-Za-z0-9._-]*)/([A-Za-z0-9][A-Za-z0-9._-]*)(?:/(.+))?$")
_S3 = re.compile(r"^s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])/(.+)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class HfSource:
    repo_id: str
    filename: str | None  # None: pick the weights file from the repository listing
    revision: str


@dataclass(frozen=True)
class HttpsSource:
    url: str


@dataclass(frozen=True)
class S3Source:
    bucket: str
    key: str


@dataclass(frozen=True)
class VolumeSource:
    path: Path


Source = HfSource | HttpsSource | S3Source | VolumeSource


@dataclass(frozen=True)
class Credentials:
    """Values from the Secret named in `source.secretRef`; secrets are kept out of `repr`."""

    hf_token: str | None = field(default=None, repr=False)
    aws_access_key_id: str | None = field(default=None, repr=False)
    aws_secret_access_key: str | None = field(default=None, repr=False)
    aws_endpoint_url: str | None = None
    aws_region: str | None = None
    authorization: str | None = field(default=None, repr=False)
    # Whether an s3:// request without keys may be signed with the operator's own cloud
    # identity (consent.Rules.ambient decides per namespace); False: it goes unsigned.
    ambient: bool = True


def parse_source(uri: str, revision: str | None = None) -> Source:
    """Parse `spec.source.uri` (and `revision`, hf:// only) into a typed source (pure)."""
    if uri.startswith("hf://"):
        m = _HF.match(uri)
        if not m or any(part in ("", ".", "..") for part in (m.group(3) or "x").split("/")):
            raise errors.InvalidSource(
                f"{uri!r}: an hf:// source must look like hf://ORG/REPO or hf://ORG/REPO/FILE"
            )
        return HfSource(
            repo_id=f"{m.group(1)}/{m.group(2)}",
            filename=m.group(3),
            revision=revision or DEFAULT_HF_REVISION,
        )
    if revision:
        raise errors.InvalidSource(
            "source.revision applies to hf:// sources only; pin other sources with source.sha256"
        )
    if uri.startswith("https://"):
        parts = urlsplit(uri)
        if parts.username is not None or parts.password is not None:
            raise errors.InvalidSource(
                "an https:// source must not carry credentials in the URI; put an "
                "AUTHORIZATION header value in the Secret named by source.secretRef"
            )
        if not parts.hostname:
            raise errors.InvalidSource(f"{describe(HttpsSource(uri))}: the URI names no host")
        return HttpsSource(url=uri)
    if uri.startswith("s3://"):
        m = _S3.match(uri)
        if not m:
            raise errors.InvalidSource(f"{uri!r}: an s3:// source must look like s3://BUCKET/KEY")
        return S3Source(bucket=m.group(1), key=m.group(2))
    if uri.startswith("/"):
        if ".." in PurePosixPath(uri).parts:
            raise errors.InvalidSource(f"{uri!r}: a volume path must not contain '..' segments")
        return VolumeSource(path=Path(uri))
    raise errors.InvalidSource(
        f"{uri[:100]!r}: source.uri must start with hf://, https://, s3:// or / (a path on the "
        "shared adapter volume)"
    )


def describe(source: Source) -> str:
    """The source for messages and logs: never a query string (it may hold a signature)."""
    if isinstance(source, HfSource):
        file = f"/{source.filename}" if source.filename else ""
        return f"hf://{source.repo_id}{file}@{source.revision}"
    if isinstance(source, HttpsSource):
        parts = urlsplit(source.url)
        return f"https://{parts.netloc}{parts.path}"
    if isinstance(source, S3Source):
        return f"s3://{source.bucket}/{source.key}"
    return str(source.path)


def file_name(source: Source) -> str | None:
    """The name of the file the source points at, when the URI says it (pure)."""
    if isinstance(source, HfSource):
        return source.filename
    if isinstance(source, HttpsSource):
        return PurePosixPath(urlsplit(source.url).path).name or None
    if isinstance(source, S3Source):
        return PurePosixPath(source.key).name or None
    return source.path.name


def check_not_pickle(source: Source) -> None:
    """Refuse pickle formats by name, before a byte is downloaded."""
    name = file_name(source)
    if name and PurePosixPath(name).suffix.lower() in files.PICKLE_SUFFIXES:
        raise errors.PickleRefused(
            f"{describe(source)} is a pickle file, which can run code when opened and is never "
            "staged; convert it to .safetensors"
        )


def check_sha256(pin: str | None) -> str | None:
    """The pin, lowercase, or None; refuses anything but 64 hex characters."""
    if pin is None or pin == "":
        return None
    if not _SHA256.match(pin.lower()):
        raise errors.InvalidSource(
            "source.sha256 must be 64 hexadecimal characters, as printed by sha256sum"
        )
    return pin.lower()


def choose_hf_file(names: Sequence[str], *, source: str = "repository") -> str:
    """The weights file of an hf:// repository from its file listing (pure).

    Prefers the names diffusers and peft write at the top level, then a single top-level
    `.safetensors`; refuses a repository with only pickle weights or several candidates.
    """
    top = [n for n in names if "/" not in n]
    for wanted in files.WEIGHT_FILE_NAMES:
        if wanted in top:
            return wanted
    safetensors = sorted(n for n in top if n.endswith(".safetensors"))
    if len(safetensors) == 1:
        return safetensors[0]
    if len(safetensors) > 1:
        raise errors.InvalidSource(
            f"{source} holds several .safetensors files ({', '.join(safetensors[:5])}); name one "
            "in the URI: hf://ORG/REPO/FILE"
        )
    if any(PurePosixPath(n).suffix.lower() in files.PICKLE_SUFFIXES for n in names):
        raise errors.PickleRefused(
            f"{source} holds only pickle weights, which can run code when opened and are never "
            "staged; publish a .safetensors file"
        )
    raise errors.SourceNotFound(
        f"{source} holds no .safetensors file at its top level; name the file in the URI"
    )


_SECRET_KEYS = {
    "HF_TOKEN": "hf_token",
    "AWS_ACCESS_KEY_ID": "aws_access_key_id",
    "AWS_SECRET_ACCESS_KEY": "aws_secret_access_key",
    "AWS_ENDPOINT_URL": "aws_endpoint_url",
    "AWS_REGION": "aws_region",
    "AUTHORIZATION": "authorization",
}


def credentials_from_secret(data: Mapping[str, str | bytes]) -> Credentials:
    """Credentials from a Secret's `data`, already base64-decoded by the caller (pure).

    Keys as docs/crd.md lists them; other keys are ignored, empty values count as absent.
    Both AWS keys or neither: half a key pair is a mistake worth a clear message.
    """
    values: dict[str, str | None] = {}
    for key, attr in _SECRET_KEYS.items():
        raw = data.get(key)
        if isinstance(raw, bytes):
            try:
                raw = raw.decode()
            except UnicodeDecodeError as e:
                raise errors.InvalidSource(f"the Secret's {key} is not UTF-8 text") from e
        values[attr] = raw.strip() if raw and raw.strip() else None
    if (values["aws_access_key_id"] is None) != (values["aws_secret_access_key"] is None):
        raise errors.InvalidSource(
            "the Secret has only one of AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY; set both"
        )
    return Credentials(
        hf_token=values["hf_token"],
        aws_access_key_id=values["aws_access_key_id"],
        aws_secret_access_key=values["aws_secret_access_key"],
        aws_endpoint_url=values["aws_endpoint_url"],
        aws_region=values["aws_region"],
        authorization=values["authorization"],
    )
