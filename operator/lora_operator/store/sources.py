"""Where an adapter comes from: the parsed `spec.source` and the credentials of its Secret.

Purely computational, no side effects: parsing, naming, and choosing a file from a listing; the
one reading of an http(s) URL the operator connects to (`parse_url`), the Hub's URLs and its
listing, S3's error codes, an oci:// reference (the registry's answers are `oci`'s to read).
The I/O lives in `fetchers`, `ocifetch` and `egress`. The API server already
validates the URI (see crds/); the checks here repeat the ones staging depends on, so a bad
value never reaches a fetcher.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from urllib.parse import quote, urlsplit

from lora_volume import boundedjson, files
from lora_volume import errors as volume_errors

from lora_operator.rules import errors
from lora_operator.store import oci

DEFAULT_HF_REVISION = "main"

_HF = re.compile(r"^hf://([A-Za-z0-9][A-Za-z0-9._-]*)/([A-Za-z0-9][A-Za-z0-9._-]*)(?:/(.+))?$")
_S3 = re.compile(r"^s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])/(.+)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# The distribution spec's grammar: a repository's path components, a tag, a sha256 digest.
_OCI = re.compile(r"^oci://([^/]+)/([^:@]+)(?::([^@]+))?(?:@(.+))?$")
_OCI_REPOSITORY = re.compile(
    r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$"
)
_OCI_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_OCI_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


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
class OciSource:
    """An artifact or image in an OCI registry: `oci://REGISTRY/REPOSITORY:TAG` or
    `...@sha256:DIGEST` (the digest wins when both are given)."""

    registry: str  # host[:port], as credentials and `insecureRegistries` name it
    host: str
    port: int | None
    repository: str
    tag: str | None
    digest: str | None  # "sha256:<hex>"

    @property
    def reference(self) -> str:
        """What the manifest is asked for by: the digest, else the tag."""
        return self.digest or self.tag or ""


@dataclass(frozen=True)
class VolumeSource:
    path: Path


Source = HfSource | HttpsSource | S3Source | OciSource | VolumeSource


@dataclass(frozen=True)
class Credentials:
    """Values from the Secret named in `source.secretRef`; secrets are kept out of `repr`."""

    hf_token: str | None = field(default=None, repr=False)
    aws_access_key_id: str | None = field(default=None, repr=False)
    aws_secret_access_key: str | None = field(default=None, repr=False)
    aws_endpoint_url: str | None = None
    aws_region: str | None = None
    authorization: str | None = field(default=None, repr=False)
    # oci://: (registry, username, password) from a `.dockerconfigjson`, as `oci` parsed it.
    registry_auths: tuple[tuple[str, str, str], ...] = field(default=(), repr=False)
    # Whether an s3:// request without keys may be signed with the operator's own cloud
    # identity (consent.Rules.ambient decides per namespace); False: it goes unsigned.
    ambient: bool = True


def parse_source(uri: str, revision: str | None = None) -> Source:
    """Parse `spec.source.uri` (and `revision`, hf:// only) into a typed source (pure)."""
    if uri.startswith("hf://"):
        m = _HF.fullmatch(uri)
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
        try:
            parse_url(uri)
        except ValueError as e:
            raise errors.InvalidSource(
                f"{describe(HttpsSource(uri))}: the URI is refused: {e}; write it plainly"
            ) from e
        return HttpsSource(url=uri)
    if uri.startswith("oci://"):
        return parse_oci(uri)
    if uri.startswith("s3://"):
        m = _S3.fullmatch(uri)
        if not m:
            raise errors.InvalidSource(f"{uri!r}: an s3:// source must look like s3://BUCKET/KEY")
        return S3Source(bucket=m.group(1), key=m.group(2))
    if uri.startswith("/"):
        if ".." in PurePosixPath(uri).parts:
            raise errors.InvalidSource(f"{uri!r}: a volume path must not contain '..' segments")
        return VolumeSource(path=Path(uri))
    raise errors.InvalidSource(
        f"{uri[:100]!r}: source.uri must start with hf://, https://, s3://, oci:// or / (a path "
        "on the shared adapter volume)"
    )


def parse_oci(uri: str) -> OciSource:
    """`oci://REGISTRY/REPOSITORY:TAG`, `...@sha256:DIGEST` or both (pure): the registry a
    DNS name or an IPv4 address with an optional port, the repository and tag as the
    distribution spec writes them. No default tag: a reference says what it means."""
    shape = (
        f"{uri[:100]!r}: an oci:// source must look like oci://REGISTRY/REPOSITORY:TAG or "
        "oci://REGISTRY/REPOSITORY@sha256:DIGEST"
    )
    m = _OCI.fullmatch(uri)
    if not m:
        raise errors.InvalidSource(shape)
    registry, repository, tag, digest = m.groups()
    try:
        target = parse_url(f"https://{registry}/")
    except ValueError as e:
        raise errors.InvalidSource(f"{shape}: the registry is refused: {e}") from e
    if ":" in target.host:
        raise errors.InvalidSource(f"{shape}: name the registry by a DNS name or IPv4 address")
    if len(repository) > 255 or not _OCI_REPOSITORY.fullmatch(repository):
        raise errors.InvalidSource(
            f"{shape}: the repository must be lowercase letters, digits and separators "
            "(., _, __, -) between '/'-separated parts"
        )
    if tag is not None and not _OCI_TAG.fullmatch(tag):
        raise errors.InvalidSource(
            f"{shape}: the tag must match [A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}}"
        )
    if digest is not None and not _OCI_DIGEST.fullmatch(digest):
        raise errors.InvalidSource(
            f"{shape}: the digest must be sha256: and 64 lowercase hex digits"
        )
    if tag is None and digest is None:
        raise errors.InvalidSource(f"{shape}: name a tag or a digest")
    port = None if ":" not in registry else target.port
    return OciSource(
        registry=target.host if port is None else f"{target.host}:{port}",
        host=target.host,
        port=port,
        repository=repository,
        tag=tag,
        digest=digest,
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
    if isinstance(source, OciSource):
        tag = f":{source.tag}" if source.tag else ""
        digest = f"@{source.digest}" if source.digest else ""
        return f"oci://{source.registry}/{source.repository}{tag}{digest}"
    return str(source.path)


def file_name(source: Source) -> str | None:
    """The name of the file the source points at, when the URI says it (pure)."""
    if isinstance(source, HfSource):
        return source.filename
    if isinstance(source, HttpsSource):
        return PurePosixPath(urlsplit(source.url).path).name or None
    if isinstance(source, S3Source):
        return PurePosixPath(source.key).name or None
    if isinstance(source, OciSource):
        return None  # the manifest's layers say (oci.choose_layer)
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
    if not _SHA256.fullmatch(pin.lower()):
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
    Both AWS keys or neither: half a key pair is a mistake worth a clear message. A
    `kubernetes.io/dockerconfigjson` Secret's `.dockerconfigjson` gives oci:// its logins.
    """
    registry_auths: tuple[tuple[str, str, str], ...] = ()
    docker_config = data.get(oci.DOCKER_CONFIG_KEY)
    if docker_config:
        registry_auths = oci.parse_docker_config(docker_config)
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
        registry_auths=registry_auths,
    )


# ---- URLs as the guarded client reads them (egress): one reading, held against two parsers


@dataclass(frozen=True)
class Target:
    """A URL as it is connected to: the scheme, the host (lowercase, no brackets, no trailing
    dot), the port, and the request target (path and query) sent to it."""

    scheme: str
    host: str
    port: int
    request_target: str

    @property
    def origin(self) -> str:
        """`scheme://host:port` for messages: never a path or a query (they may hold a
        signature)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


_AUTHORITY = re.compile(
    r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]*)"
    r"(?::(?P<port>[0-9]{1,5}))?(?P<rest>[/?#].*)?$"
)
_DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_QUAD_PART = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4 = re.compile(rf"^{_QUAD_PART}(\.{_QUAD_PART}){{3}}$")
DEFAULT_PORTS = {"http": 80, "https": 443}


def parse_url(url: str) -> Target:
    """Read an http(s) URL the one way the operator connects to it (pure); raises ValueError
    saying why when it is not plain: a backslash, a control or non-ASCII character, user
    information, a percent-encoded or malformed host, a numeric host other than a dotted quad,
    or any disagreement on the scheme, host or port between this reading (the Kubernetes-style
    one: DNS-1123 names, dotted-quad IPv4, bracketed IPv6), `urllib.parse` and urllib3's."""
    check_url_text(url)
    if "://" not in url:
        raise ValueError("it is not an absolute http(s) URL")
    authority = re.split(r"[/?#]", url.split("://", 1)[1], maxsplit=1)[0]
    if "@" in authority:
        raise ValueError("it holds user information before an '@'")
    if "%" in authority:
        raise ValueError("its host is percent-encoded")
    m = _AUTHORITY.match(url)
    if m is None:
        raise ValueError("its host is not a DNS name, an IPv4 address or a bracketed IPv6 address")
    scheme = m.group("scheme").lower()
    if scheme not in DEFAULT_PORTS:
        raise ValueError(f"its scheme is {scheme[:10]!r}, not http or https")
    host = _check_host(m.group("host").lower())
    port = int(m.group("port")) if m.group("port") else DEFAULT_PORTS[scheme]
    if not 0 < port < 65536:
        raise ValueError("its port is out of range")
    request_target = _agree(url, scheme, host, port)
    return Target(scheme, host, port, request_target)


def check_url_text(url: str) -> None:
    """Refuse the characters URL parsers disagree about, wherever they are (pure): a backslash
    (a path separator to some, part of the host to others), spaces and control characters, and
    anything not ASCII (IDNA and Unicode normalisation differ between parsers)."""
    if "\\" in url:
        raise ValueError("it holds a backslash, which URL parsers read differently")
    if any(ord(c) <= 0x20 or ord(c) == 0x7F for c in url):
        raise ValueError("it holds a space or a control character")
    if not url.isascii():
        raise ValueError(
            "it holds non-ASCII characters: write the host in punycode (xn--) and "
            "percent-encode the path"
        )


def _check_host(host: str) -> str:
    if host.startswith("["):
        try:
            address = ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError("its IPv6 address is malformed") from None
        return str(address)
    host = host[:-1] if host.endswith(".") else host
    if not host:
        raise ValueError("it names no host")
    if _IPV4.fullmatch(host):
        return host
    labels = host.split(".")
    if len(host) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in labels):
        raise ValueError("its host is not a valid DNS name")
    last = labels[-1]
    if last.isdigit() or re.fullmatch(r"0x[0-9a-f]*", last):
        # 1.2.3, 0x7f.1, 2130706433: read as an address by some resolvers, as a name by others
        raise ValueError("its host is numeric but not a dotted-quad IPv4 address")
    return host


def _agree(url: str, scheme: str, host: str, port: int) -> str:
    """The request target urllib3 sends, once urllib.parse and urllib3 read the scheme, host
    and port as `parse_url` did; raises ValueError otherwise."""
    from urllib3.util import parse_url as urllib3_parse

    try:
        split = urlsplit(url)
        split_port = split.port
        u3 = urllib3_parse(url)
    except ValueError as e:
        raise ValueError("URL parsers cannot read it") from e
    readings = {
        (scheme, host, port),
        (split.scheme.lower(), _plain(split.hostname), split_port or DEFAULT_PORTS[scheme]),
        ((u3.scheme or "").lower(), _plain(u3.host), u3.port or DEFAULT_PORTS[scheme]),
    }
    if len(readings) != 1:
        raise ValueError("URL parsers read its host differently")
    return u3.request_uri


def _plain(host: str | None) -> str:
    host = (host or "").lower().strip("[]")
    try:
        return str(ipaddress.IPv6Address(host))
    except ValueError:
        return host[:-1] if host.endswith(".") else host


# ---- the Hub's plain HTTP endpoints (hf://), read through the guarded client

DEFAULT_HF_ENDPOINT = "https://huggingface.co"
# The Hub's model info for a repository of many files is a few megabytes; its card data nests.
HF_LISTING_LIMITS = boundedjson.Limits(max_bytes=8 * 1024 * 1024, max_depth=32, max_values=500_000)


def hf_file_url(endpoint: str, source: HfSource, filename: str) -> str:
    """The Hub's download URL of one file at a revision, as huggingface_hub builds it (pure)."""
    revision = quote(source.revision, safe="")
    return f"{endpoint.rstrip('/')}/{source.repo_id}/resolve/{revision}/{quote(filename)}"


def hf_listing_url(endpoint: str, source: HfSource) -> str:
    """The Hub's model-info URL at a revision, whose `siblings` list the files (pure)."""
    revision = quote(source.revision, safe="")
    return f"{endpoint.rstrip('/')}/api/models/{source.repo_id}/revision/{revision}"


def parse_hf_listing(body: bytes) -> list[str]:
    """The file names in the Hub's model info (`siblings[].rfilename`) (pure, bounded by
    HF_LISTING_LIMITS before anything is built); raises ValueError saying what is wrong,
    never quoting the body."""
    limits = HF_LISTING_LIMITS
    try:
        info = boundedjson.parse(body, limits, where="it")
    except volume_errors.InvalidJson:
        raise ValueError(
            f"it is not JSON within {limits.max_bytes} bytes, {limits.max_depth} levels and "
            f"{limits.max_values} values"
        ) from None
    siblings = info.get("siblings") if isinstance(info, dict) else None
    if not isinstance(siblings, list):
        raise ValueError("it holds no list of files")
    names = [s.get("rfilename") for s in siblings if isinstance(s, dict)]
    return [n for n in names if isinstance(n, str)]


# ---- S3's answers

_S3_ERROR_CODE = re.compile(rb"<Code>([A-Za-z]{1,64})</Code>")
S3_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NotFound"})
S3_FORBIDDEN_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "AllAccessDisabled",
        "AccountProblem",
    }
)
_S3_KNOWN_CODES = (
    S3_NOT_FOUND_CODES
    | S3_FORBIDDEN_CODES
    | {
        "PermanentRedirect",
        "AuthorizationHeaderMalformed",
        "InvalidBucketName",
        "InvalidObjectState",
        "SlowDown",
        "InternalError",
        "ServiceUnavailable",
        "InvalidRequest",
    }
)
_REGION = re.compile(r"^[a-z]{2}(-[a-z0-9]{1,20}){1,4}$")


def s3_error_code(body: bytes) -> str | None:
    """The `Code` of an S3 error answer when it is one S3 documents, else None (pure): nothing
    else of an answer reaches a message."""
    m = _S3_ERROR_CODE.search(body[:16384])
    code = m.group(1).decode() if m else None
    return code if code in _S3_KNOWN_CODES else None


def s3_region(header: str | None) -> str | None:
    """The region in an `x-amz-bucket-region` header when it looks like one (pure)."""
    return header if header and _REGION.fullmatch(header) else None
