"""oci:// read without a registry: references, manifests and the layer chosen, challenges, token
answers, pull Secrets, and the tar stream reader held to Python's tarfile. Pure, no I/O."""

from __future__ import annotations

import base64
import gzip
import io
import json
import tarfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lora_operator import ocipush
from lora_operator.rules import consent, errors
from lora_operator.store import oci, sources, tarstream

D = "sha256:" + "a" * 64
E = "sha256:" + "b" * 64

# ---- references


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        (
            "oci://ghcr.io/team/pixel-art:v1",
            sources.OciSource("ghcr.io", "ghcr.io", None, "team/pixel-art", "v1", None),
        ),
        (
            "oci://10.0.0.5:5000/a/b/c@" + D,
            sources.OciSource("10.0.0.5:5000", "10.0.0.5", 5000, "a/b/c", None, D),
        ),
        (
            "oci://registry.example:443/x_y__z.w:V1.0-rc_1@" + D,
            sources.OciSource(
                "registry.example:443", "registry.example", 443, "x_y__z.w", "V1.0-rc_1", D
            ),
        ),
    ],
    ids=["tag", "digest-port", "both"],
)
def test_parse_oci(uri: str, expected: sources.OciSource) -> None:
    parsed = sources.parse_source(uri)
    assert parsed == expected
    assert sources.describe(parsed) == uri
    assert sources.file_name(parsed) is None


@pytest.mark.parametrize(
    "uri",
    [
        "oci://ghcr.io/team/pixel",  # no tag nor digest
        "oci://ghcr.io/Team/pixel:v1",  # uppercase repository
        "oci://ghcr.io/team/pixel:-v1",  # a tag starts with a word character
        "oci://ghcr.io/team/pixel@sha256:abc",  # short digest
        "oci://ghcr.io/team/pixel@sha512:" + "a" * 128,
        "oci://user:pw@ghcr.io/team/pixel:v1",
        "oci://ghcr.io/team/../pixel:v1",
        "oci://ghcr.io/team//pixel:v1",
        "oci://gh%63r.io/team/pixel:v1",
        "oci://2130706433/team/pixel:v1",  # a numeric host that is not a dotted quad
        "oci://[::1]:5000/team/pixel:v1",
        "oci:///team/pixel:v1",
        "oci://ghcr.io/team/pixel:" + "t" * 129,
    ],
)
def test_parse_oci_refuses(uri: str) -> None:
    with pytest.raises(errors.InvalidSource, match="oci://REGISTRY/REPOSITORY"):
        sources.parse_source(uri)


def test_revision_is_for_hf_only() -> None:
    with pytest.raises(errors.InvalidSource, match="hf:// sources only"):
        sources.parse_source("oci://ghcr.io/a/b:v1", "main")


# ---- manifests and the layer chosen


def _desc(media_type: str, digest: str = D, size: int = 10, **extra: object) -> dict[str, object]:
    return {"mediaType": media_type, "digest": digest, "size": size, **extra}


def _manifest(*layers: dict[str, object], media_type: str | None = oci.OCI_MANIFEST) -> bytes:
    doc: dict[str, object] = {
        "schemaVersion": 2,
        "config": _desc(oci.ADAPTER_CONFIG, E, 2),
        "layers": list(layers),
    }
    if media_type:
        doc["mediaType"] = media_type
    return json.dumps(doc).encode()


def _chosen(body: bytes) -> oci.LayerChoice:
    manifest = oci.parse_manifest(body)
    assert isinstance(manifest, oci.Manifest)
    return oci.choose_layer(manifest, "oci://r/x:v1")


def test_what_push_writes_is_read_back() -> None:
    config = ocipush.Blob.of_bytes(oci.ADAPTER_CONFIG, b"{}")
    layer = ocipush.Blob.of_bytes(
        oci.ADAPTER_LAYER, b"weights", annotations={oci.TITLE_ANNOTATION: "a.safetensors"}
    )
    manifest = oci.parse_manifest(ocipush.build_manifest(config, [layer]))
    assert isinstance(manifest, oci.Manifest)
    assert manifest.artifact_type == oci.ADAPTER_ARTIFACT_TYPE
    assert manifest.config is not None and manifest.config.digest == config.digest
    choice = oci.choose_layer(manifest, "x")
    assert choice == oci.LayerChoice("file", manifest.layers)
    assert choice.layers[0].digest == layer.digest and choice.layers[0].size == 7


@pytest.mark.parametrize(
    ("layers", "kind", "digests"),
    [
        ([_desc(oci.ADAPTER_LAYER)], "file", [D]),
        (  # oras push FILE: the file under the tar type, titled
            [
                _desc(
                    "application/vnd.oci.image.layer.v1.tar",
                    annotations={oci.TITLE_ANNOTATION: "a.safetensors"},
                )
            ],
            "file",
            [D],
        ),
        (
            [
                _desc(
                    "application/octet-stream", annotations={oci.TITLE_ANNOTATION: "A.SAFETENSORS"}
                )
            ],
            "file",
            [D],
        ),
        (  # ours wins over a titled one
            [
                _desc(
                    "application/octet-stream",
                    E,
                    annotations={oci.TITLE_ANNOTATION: "b.safetensors"},
                ),
                _desc(oci.ADAPTER_LAYER),
            ],
            "file",
            [D],
        ),
        (  # an image: its tar layers, the topmost first
            [
                _desc("application/vnd.docker.image.rootfs.diff.tar.gzip", E),
                _desc("application/vnd.oci.image.layer.v1.tar+gzip", D),
            ],
            "tar",
            [D, E],
        ),
        (  # a titled README next to an image layer: the image layer is read
            [
                _desc(
                    "application/vnd.oci.image.layer.v1.tar",
                    E,
                    annotations={oci.TITLE_ANNOTATION: "README.md"},
                ),
                _desc("application/vnd.oci.image.layer.v1.tar", D),
            ],
            "tar",
            [D],
        ),
    ],
    ids=["ours", "oras-default", "titled", "ours-first", "image", "image-beside-a-file"],
)
def test_choose_layer(layers: list[dict[str, object]], kind: str, digests: list[str]) -> None:
    choice = _chosen(_manifest(*layers))
    assert choice.kind == kind
    assert [layer.digest for layer in choice.layers] == digests


@pytest.mark.parametrize(
    ("layers", "error", "match"),
    [
        ([], errors.InvalidSource, "no adapter layer"),
        ([_desc("application/vnd.example.model")], errors.InvalidSource, "no adapter layer"),
        (
            [_desc("application/vnd.oci.image.layer.v1.tar+zstd")],
            errors.InvalidSource,
            r"layer types: application/vnd.oci.image.layer.v1.tar\+zstd",
        ),
        (
            [_desc(oci.ADAPTER_LAYER), _desc(oci.ADAPTER_LAYER, E)],
            errors.InvalidSource,
            "publish one",
        ),
        (
            [_desc("application/octet-stream", annotations={oci.TITLE_ANNOTATION: "w.ckpt"})],
            errors.PickleRefused,
            "pickle",
        ),
    ],
    ids=["no-layers", "unknown-type", "zstd", "two-adapters", "pickle"],
)
def test_choose_layer_refuses(
    layers: list[dict[str, object]], error: type[errors.StagingError], match: str
) -> None:
    with pytest.raises(error, match=match) as e:
        _chosen(_manifest(*layers))
    assert e.value.permanent


def test_docker_manifest_and_missing_media_type() -> None:
    docker = _chosen(_manifest(_desc(oci.ADAPTER_LAYER), media_type=oci.DOCKER_MANIFEST))
    assert docker.kind == "file"
    bare = _chosen(_manifest(_desc(oci.ADAPTER_LAYER), media_type=None))
    assert bare.kind == "file"


def test_index_picks_our_artifact_then_linux_amd64() -> None:
    def index(*entries: dict[str, object]) -> oci.Index:
        doc = {"schemaVersion": 2, "mediaType": oci.OCI_INDEX, "manifests": list(entries)}
        parsed = oci.parse_manifest(json.dumps(doc).encode())
        assert isinstance(parsed, oci.Index)
        return parsed

    arm = _desc(oci.OCI_MANIFEST, E, platform={"os": "linux", "architecture": "arm64"})
    amd = _desc(oci.OCI_MANIFEST, D, platform={"os": "linux", "architecture": "amd64"})
    ours = _desc(oci.OCI_MANIFEST, "sha256:" + "c" * 64, artifactType=oci.ADAPTER_ARTIFACT_TYPE)
    assert oci.choose_manifest(index(arm, amd)).digest == D
    assert oci.choose_manifest(index(arm, amd, ours)).digest == "sha256:" + "c" * 64
    assert oci.choose_manifest(index(arm)).digest == E


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"not json", "not JSON"),
        (b"[]", "schema version 2"),
        (json.dumps({"schemaVersion": 1}).encode(), "schema version 2"),
        (
            json.dumps(
                {
                    "schemaVersion": 2,
                    "mediaType": "application/vnd.docker.distribution.manifest.v1+json",
                }
            ).encode(),
            "media type",
        ),
        (_manifest(_desc(oci.ADAPTER_LAYER, "sha256:xyz")), "digest"),
        (_manifest(_desc(oci.ADAPTER_LAYER, size=-1)), "size"),
        (_manifest(*[_desc(oci.ADAPTER_LAYER)] * (oci.MAX_LAYERS + 1)), "more than"),
        (
            json.dumps({"schemaVersion": 2, "mediaType": oci.OCI_INDEX, "manifests": []}).encode(),
            "no manifest",
        ),
        (b"[" * 100 + b"]" * 100, "JSON"),
    ],
    ids=[
        "text",
        "array",
        "v1",
        "schema1",
        "bad-digest",
        "negative-size",
        "too-many",
        "empty-index",
        "deep",
    ],
)
def test_parse_manifest_refuses(body: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        oci.parse_manifest(body)


# ---- WWW-Authenticate and tokens


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (
            'Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a/b:pull"',
            [
                (
                    "bearer",
                    {
                        "realm": "https://auth.example/token",
                        "service": "registry.example",
                        "scope": "repository:a/b:pull",
                    },
                )
            ],
        ),
        ('Basic realm="Registry Realm"', [("basic", {"realm": "Registry Realm"})]),
        (
            'bearer realm="https://a/t", error="insufficient_scope" , Basic realm=x',
            [
                ("bearer", {"realm": "https://a/t", "error": "insufficient_scope"}),
                ("basic", {"realm": "x"}),
            ],
        ),
        ('Bearer realm="a\\"b"', [("bearer", {"realm": 'a"b'})]),
        ("Bearer", [("bearer", {})]),
        ("", []),
        ("x" * (oci.MAX_CHALLENGE_CHARS + 1), []),
    ],
    ids=["distribution", "basic", "two-schemes", "escaped", "bare", "empty", "too-long"],
)
def test_parse_www_authenticate(header: str, expected: list[tuple[str, dict[str, str]]]) -> None:
    got = [(c.scheme, dict(c.params)) for c in oci.parse_www_authenticate(header)]
    assert got == expected


@given(st.text(max_size=300))
@settings(max_examples=300, deadline=None)
def test_parse_www_authenticate_never_raises(header: str) -> None:
    oci.parse_www_authenticate(header)


def test_token_url() -> None:
    bearer = oci.Challenge("bearer", {"realm": "https://auth.example/token", "service": "reg x"})
    assert oci.token_url(bearer, "a/b") == (
        "https://auth.example/token?service=reg+x&scope=repository%3Aa%2Fb%3Apull"
    )
    with_query = oci.Challenge("bearer", {"realm": "https://auth.example/t?x=1"})
    assert oci.token_url(with_query, "a", ("pull", "push")) == (
        "https://auth.example/t?x=1&scope=repository%3Aa%3Apull%2Cpush"
    )
    with pytest.raises(ValueError, match="no realm"):
        oci.token_url(oci.Challenge("bearer", {}), "a")


@pytest.mark.parametrize(
    ("body", "token"),
    [(b'{"token": "abc.def"}', "abc.def"), (b'{"access_token": "xyz"}', "xyz")],
    ids=["token", "access_token"],
)
def test_parse_token(body: bytes, token: str) -> None:
    assert oci.parse_token(body) == token


@pytest.mark.parametrize(
    "body", [b"{}", b'{"token": ""}', b'{"token": "a b"}', b"nope", b'{"token": 1}']
)
def test_parse_token_refuses(body: bytes) -> None:
    with pytest.raises(ValueError):
        oci.parse_token(body)


# ---- pull Secrets


def test_docker_config_logins() -> None:
    auth = base64.b64encode(b"bob:pa:ss").decode()
    config = json.dumps(
        {
            "auths": {
                "https://index.docker.io/v1/": {"auth": auth},
                "registry.example:5000": {"username": "alice", "password": "pw"},
                "http://Other.Example/path": {"auth": base64.b64encode(b"c:d").decode()},
                "empty.example": {},
            }
        }
    )
    logins = oci.parse_docker_config(config)
    assert logins == (
        ("docker.io", "bob", "pa:ss"),
        ("registry.example:5000", "alice", "pw"),
        ("other.example", "c", "d"),
    )
    assert oci.login_for(logins, "registry-1.docker.io") == ("bob", "pa:ss")
    assert oci.login_for(logins, "registry.example:5000") == ("alice", "pw")
    assert oci.login_for(logins, "registry.example") is None
    creds = sources.credentials_from_secret({oci.DOCKER_CONFIG_KEY: config})
    assert creds.registry_auths == logins
    assert "pw" not in repr(creds)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ("not json", "not JSON"),
        ('{"credsStore": "desktop"}', '"auths"'),
        ('{"auths": {"r.io": {"auth": "!!!"}}}', "not base64"),
    ],
    ids=["text", "no-auths", "bad-auth"],
)
def test_docker_config_refused(config: str, match: str) -> None:
    with pytest.raises(errors.InvalidSource, match=match) as e:
        oci.parse_docker_config(config)
    assert "!!!" not in e.value.message


@pytest.mark.parametrize(
    ("entries", "host", "port", "allowed"),
    [
        (("r.local:5000",), "r.local", 5000, True),
        (("R.Local:5000",), "r.local", 5000, True),
        (("r.local:5000",), "r.local", 5001, False),
        (("r.local",), "r.local", None, True),
        (("r.local",), "r.local", 80, True),
        (("r.local",), "r.local", 5000, False),
        ((), "r.local", 5000, False),
    ],
)
def test_plain_http_allowed(
    entries: tuple[str, ...], host: str, port: int | None, allowed: bool
) -> None:
    rules = consent.Rules(insecure_registries=entries)
    assert consent.plain_http_allowed(host, port, rules) is allowed


# ---- image layers: which files count, and the tar stream held to tarfile


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("data/adapter_model.safetensors", "weights"),
        ("./data/x.SAFETENSORS", "weights"),
        ("/data/x.safetensors", "weights"),
        ("data/sub/x.safetensors", "other"),
        ("x.safetensors", "other"),
        ("data/x.bin", "pickle"),
        ("data/adapter_config.json", "other"),
    ],
)
def test_image_member(name: str, kind: str) -> None:
    assert oci.image_member(name) == kind


def _tar(files: list[tuple[str, bytes]], fmt: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        d = tarfile.TarInfo("data/folder")
        d.type = tarfile.DIRTYPE
        t.addfile(d)
        link = tarfile.TarInfo("data/link.safetensors")
        link.type = tarfile.SYMTYPE
        link.linkname = "../etc/passwd"
        t.addfile(link)
    return buf.getvalue()


def _read(raw: bytes, piece: int) -> dict[str, bytes]:
    got: dict[str, bytes] = {}

    def on_file(name: str, _: int) -> tarstream.Consumer:
        got[name] = b""

        def take(chunk: bytes) -> None:
            got[name] += chunk

        return take

    reader = tarstream.TarStream(on_file)
    for i in range(0, len(raw), piece):
        reader.feed(raw[i : i + piece])
    reader.close()
    return got


def _tarfile_reads(raw: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(raw)) as t:
        return {m.name: t.extractfile(m).read() for m in t if m.isreg()}  # type: ignore[union-attr]


names = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="\\"),
    min_size=1,
    max_size=180,
).map(lambda s: "data/" + s.strip("/").replace("//", "/") + "x")


@given(
    files=st.lists(
        st.tuples(names, st.binary(max_size=2000)), max_size=5, unique_by=lambda f: f[0]
    ),
    fmt=st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]),
    piece=st.sampled_from([1, 7, 512, 4096, 1 << 20]),
)
@settings(max_examples=150, deadline=None)
def test_tar_stream_reads_what_tarfile_reads(
    files: list[tuple[str, bytes]], fmt: int, piece: int
) -> None:
    raw = _tar(files, fmt)
    assert _read(raw, piece) == _tarfile_reads(raw)


def test_tar_stream_ustar_gzip_and_prefix() -> None:
    files = [
        ("data/" + "d" * 90 + "/" + "f" * 90 + ".txt", b"long"),
        ("data/a.safetensors", b"W" * 5000),
    ]
    raw = _tar(files, tarfile.USTAR_FORMAT)
    assert _read(raw, 333) == _tarfile_reads(raw) == dict(files)
    assert _read(gzip.decompress(gzip.compress(raw)), 100) == dict(files)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda raw: raw[:700], "ends inside"),
        (lambda raw: b"\x01" + raw[1:], "checksum"),
        (lambda raw: b"x" * 1024, "checksum"),
    ],
    ids=["cut", "corrupt-header", "not-tar"],
)
def test_tar_stream_refuses(mutate: object, match: str) -> None:
    raw = _tar([("data/a.safetensors", b"W" * 1000)], tarfile.GNU_FORMAT)
    with pytest.raises(tarstream.TarRefused, match=match):
        _read(mutate(raw), 512)  # type: ignore[operator]


def test_tar_stream_bounds_metadata_and_entries() -> None:
    long_name = [("data/" + "n" * 100_000 + ".safetensors", b"x")]
    with pytest.raises(tarstream.TarRefused, match="metadata entry"):
        _read(_tar(long_name, tarfile.PAX_FORMAT), 4096)
    many = [(f"data/{i}.txt", b"") for i in range(30)]
    reader = tarstream.TarStream(lambda *_: None, max_members=20)
    with pytest.raises(tarstream.TarRefused, match="more than 20 entries"):
        reader.feed(_tar(many, tarfile.GNU_FORMAT))
