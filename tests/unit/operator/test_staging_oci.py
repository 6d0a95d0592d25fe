"""Staging from oci:// against a real registry (Debian's docker-registry, the distribution
registry the local cluster runs) on 127.0.0.1: anonymous, with htpasswd logins, and with token
auth from a token service of our own. Adapters are published with `lora-operator adapter push`
(or, for images and indexes, its Pusher), staged by the real store into a temporary volume,
and every bad input ends in the error, reason and permanence its status shows."""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from lora_operator import ocipush
from lora_operator.rules import consent, errors
from lora_operator.store import oci, publishing, sources
from lora_volume import layout

from tests.support import registry as reg
from tests.support.loras import lora_bytes, sha
from tests.support.origin import Origin
from tests.support.staging import LOCAL, NS, make_store, tmp_entries, visible


@pytest.fixture(scope="module")
def anonymous(tmp_path_factory: pytest.TempPathFactory) -> Iterator[reg.Registry]:
    with reg.run_registry(tmp_path_factory.mktemp("anonymous"), "anonymous") as r:
        yield r


@pytest.fixture(scope="module")
def htpasswd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[reg.Registry]:
    with reg.run_registry(tmp_path_factory.mktemp("htpasswd"), "htpasswd") as r:
        yield r


@pytest.fixture(scope="module")
def token(tmp_path_factory: pytest.TempPathFactory) -> Iterator[reg.Registry]:
    with reg.run_registry(tmp_path_factory.mktemp("token"), "token") as r:
        yield r


def rules_for(*registries: reg.Registry, extra: tuple[str, ...] = ()) -> consent.Rules:
    """LOCAL (any host, loopback open) with the registries, and their token services, over
    plain HTTP."""
    insecure = [r.address for r in registries]
    insecure += [f"127.0.0.1:{r.tokens.origin.port}" for r in registries if r.tokens]
    return dataclasses.replace(LOCAL, insecure_registries=(*insecure, *extra))


def pushed(
    registry: reg.Registry, tmp: Path, ref: str, data: bytes, *args: str, **kw: object
) -> str:
    """Push `data` as an adapter artifact; the manifest, as `oci://REGISTRY/REPOSITORY@DIGEST`."""
    path = tmp / "adapter.safetensors"
    path.write_bytes(data)
    result = reg.push(registry, path, ref, *args, **kw)  # type: ignore[arg-type]
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def creds(registry: reg.Registry, password: str = reg.PASSWORD) -> sources.Credentials:
    config = reg.docker_config(registry.address, reg.USER, password)
    return sources.credentials_from_secret({oci.DOCKER_CONFIG_KEY: config})


async def stage(
    tmp: Path,
    uri: str,
    rules: consent.Rules,
    credentials: sources.Credentials | None = None,
    name: str = "pixel",
    **kw: object,
) -> publishing.StagedRevision:
    store = make_store(tmp / "volume", rules=rules, **kw)  # type: ignore[arg-type]
    return await store.stage(NS, name, sources.parse_source(uri), credentials=credentials)


async def refused(
    tmp: Path, uri: str, rules: consent.Rules, error: type[errors.StagingError], **kw: object
) -> errors.StagingError:
    with pytest.raises(error) as e:
        await stage(tmp, uri, rules, **kw)  # type: ignore[arg-type]
    assert visible(tmp / "volume") == []  # nothing published
    assert tmp_entries(tmp / "volume") == []
    return e.value


# ---- published and staged


async def test_push_then_stage_anonymous(anonymous: reg.Registry, tmp_path: Path) -> None:
    data = lora_bytes(seed=1)
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "pytorch_lora_weights.safetensors").write_bytes(data)
    (folder / "metadata.json").write_text(json.dumps({"baseModel": "sd15", "format": "lora"}))
    result = reg.push(anonymous, folder, "team/pixel:v1", "--trigger-word", "pixelart")
    assert result.returncode == 0, result.stderr
    pinned = result.stdout.strip()
    assert pinned.startswith(f"oci://{anonymous.address}/team/pixel@sha256:")
    assert f"sha256: {sha(data)}" in result.stderr

    uri = f"oci://{anonymous.address}/team/pixel:v1"
    staged = await stage(tmp_path, uri, rules_for(anonymous))
    assert staged.sha256 == sha(data) and staged.size == len(data)
    assert (staged.path / layout.WEIGHTS_FILE).read_bytes() == data
    assert tmp_entries(tmp_path / "volume") == []
    assert staged.resolved == pinned  # the tag resolved to the manifest pushed

    # By digest, the same revision and the same resolution; the config holds the metadata given.
    again = await stage(tmp_path / "by-digest", pinned, rules_for(anonymous))
    assert again.sha256 == sha(data) and again.resolved == pinned
    both = pinned.replace("/team/pixel@", "/team/pixel:v1@")  # the digest wins, the tag dropped
    assert (await stage(tmp_path / "both", both, rules_for(anonymous))).resolved == pinned
    manifest = json.loads(_get(anonymous, f"team/pixel/manifests/{pinned.split('@')[1]}"))
    assert manifest["artifactType"] == oci.ADAPTER_ARTIFACT_TYPE
    assert [layer["mediaType"] for layer in manifest["layers"]] == [oci.ADAPTER_LAYER]
    config = json.loads(_get(anonymous, f"team/pixel/blobs/{manifest['config']['digest']}"))
    assert config == {"baseModel": "sd15", "format": "lora", "triggerWords": ["pixelart"]}


async def test_a_moved_tag_is_a_new_revision(anonymous: reg.Registry, tmp_path: Path) -> None:
    uri = f"oci://{anonymous.address}/team/moving:stable"
    store = make_store(tmp_path / "volume", rules=rules_for(anonymous))
    first, second = lora_bytes(seed=2), lora_bytes(seed=3)
    first_manifest = pushed(anonymous, tmp_path, "team/moving:stable", first)
    one = await store.stage(NS, "moving", sources.parse_source(uri))
    second_manifest = pushed(anonymous, tmp_path, "team/moving:stable", second)
    two = await store.stage(NS, "moving", sources.parse_source(uri))
    assert (one.sha256, two.sha256) == (sha(first), sha(second))
    assert (one.resolved, two.resolved) == (first_manifest, second_manifest)
    assert first_manifest != second_manifest
    assert store.current_revision(NS, "moving") == sha(second)
    assert one.path.exists()  # the old revision stays until collected

    # The same file under a new manifest (other metadata): a new resolution, the same revision.
    third_manifest = pushed(
        anonymous, tmp_path, "team/moving:stable", second, "--trigger-word", "moved"
    )
    three = await store.stage(NS, "moving", sources.parse_source(uri))
    assert third_manifest != second_manifest
    assert (three.sha256, three.resolved, three.reused) == (sha(second), third_manifest, True)


async def test_a_pin_holds_the_content(anonymous: reg.Registry, tmp_path: Path) -> None:
    data = lora_bytes(seed=4)
    manifest = pushed(anonymous, tmp_path, "team/pinned:v1", data)
    uri = f"oci://{anonymous.address}/team/pinned:v1"
    store = make_store(tmp_path / "volume", rules=rules_for(anonymous))
    with pytest.raises(errors.ChecksumMismatch):
        await store.stage(NS, "pinned", sources.parse_source(uri), sha256="0" * 64)
    staged = await store.stage(NS, "pinned", sources.parse_source(uri), sha256=sha(data))
    assert staged.sha256 == sha(data)
    assert staged.resolved == manifest  # not held yet: fetched, and so resolved
    # Pinned content the namespace holds is published from the store: nothing is fetched, so
    # nothing is resolved (the registry is not asked, and could not say).
    again = await store.stage(NS, "again", sources.parse_source(uri), sha256=sha(data))
    assert (again.sha256, again.reused, again.resolved) == (sha(data), True, None)


def _image_layer(files: dict[str, bytes], compress: bool = True) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return gzip.compress(buf.getvalue()) if compress else buf.getvalue()


@pytest.mark.parametrize(
    ("manifest_type", "layer_type", "compress"),
    [
        (oci.DOCKER_MANIFEST, "application/vnd.docker.image.rootfs.diff.tar.gzip", True),
        (oci.OCI_MANIFEST, "application/vnd.oci.image.layer.v1.tar+gzip", True),
        (oci.OCI_MANIFEST, "application/vnd.oci.image.layer.v1.tar", False),
    ],
    ids=["docker-gzip", "oci-gzip", "oci-tar"],
)
async def test_an_image_with_the_adapter_under_data(
    anonymous: reg.Registry, tmp_path: Path, manifest_type: str, layer_type: str, compress: bool
) -> None:
    data = lora_bytes(seed=5)
    adapter = {"data/adapter_model.safetensors": data, "data/adapter_config.json": b"{}"}
    ref = f"kaito/adapter-{layer_type.rsplit('.', 1)[-1].replace('+', '-')}:{manifest_type[-4:]}"
    digest = reg.push_image(
        anonymous,
        ref,
        [
            (layer_type, _image_layer({"data/adapter_model.safetensors": b"old"}, compress)),
            (layer_type, _image_layer(adapter, compress)),  # the topmost layer wins
        ],
        manifest_type=manifest_type,
    )
    staged = await stage(tmp_path, f"oci://{anonymous.address}/{ref}", rules_for(anonymous))
    assert staged.sha256 == sha(data)
    assert staged.resolved == f"oci://{anonymous.address}/{ref.split(':')[0]}@{digest}"


async def test_an_index_leads_to_the_adapter(anonymous: reg.Registry, tmp_path: Path) -> None:
    data = lora_bytes(seed=6)
    pinned = pushed(anonymous, tmp_path, "team/indexed:artifact", data)
    digest = pinned.split("@")[1]
    manifest = _get(anonymous, f"team/indexed/manifests/{digest}")
    index = {
        "schemaVersion": 2,
        "mediaType": oci.OCI_INDEX,
        "manifests": [
            {
                "mediaType": oci.OCI_MANIFEST,
                "digest": digest,
                "size": len(manifest),
                "artifactType": oci.ADAPTER_ARTIFACT_TYPE,
            }
        ],
    }
    pusher = ocipush.Pusher(
        sources.parse_oci(f"oci://{anonymous.address}/team/indexed:index"), plain_http=True
    )
    index_digest = pusher.push_manifest(json.dumps(index).encode(), oci.OCI_INDEX)
    uri = f"oci://{anonymous.address}/team/indexed:index"
    staged = await stage(tmp_path, uri, rules_for(anonymous))
    assert staged.sha256 == sha(data)
    # The index's digest, what the tag names and a pin would name, not the manifest chosen in it.
    by_index = f"oci://{anonymous.address}/team/indexed@{index_digest}"
    assert staged.resolved == by_index != pinned
    pinned_index = await stage(tmp_path / "pinned", by_index, rules_for(anonymous))
    assert (pinned_index.sha256, pinned_index.resolved) == (sha(data), by_index)


# ---- logins


async def test_htpasswd_login_from_the_secret(htpasswd: reg.Registry, tmp_path: Path) -> None:
    data = lora_bytes(seed=7)
    pushed(htpasswd, tmp_path, "private/pixel:v1", data, login=True)
    uri = f"oci://{htpasswd.address}/private/pixel:v1"
    staged = await stage(tmp_path, uri, rules_for(htpasswd), creds(htpasswd))
    assert staged.sha256 == sha(data)

    e = await refused(tmp_path / "none", uri, rules_for(htpasswd), errors.SourceForbidden)
    assert (e.reason, e.permanent) == ("SourceForbidden", True)
    assert "needs a login" in e.message and "dockerconfigjson" in e.message
    e = await refused(
        tmp_path / "wrong",
        uri,
        rules_for(htpasswd),
        errors.SourceForbidden,
        credentials=creds(htpasswd, "wrong"),
    )
    assert "access denied" in e.message and "wrong" not in e.message


def test_push_without_a_login_says_so(htpasswd: reg.Registry, tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    path.write_bytes(lora_bytes())
    result = reg.push(htpasswd, path, "private/x:v1")
    assert result.returncode == 1
    assert "HTTP 401" in result.stderr and "log in" in result.stderr


def test_push_over_https_to_a_plain_registry_says_so(
    anonymous: reg.Registry, tmp_path: Path
) -> None:
    path = tmp_path / "a.safetensors"
    path.write_bytes(lora_bytes())
    cmd = [sys.executable, "-m", "lora_operator.cli", "adapter", "push", str(path)]
    result = subprocess.run(
        [*cmd, f"oci://{anonymous.address}/team/tls:v1"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert "needs --plain-http" in result.stderr


async def test_token_auth(token: reg.Registry, tmp_path: Path) -> None:
    assert token.tokens is not None
    private, public = lora_bytes(seed=8), lora_bytes(seed=9)
    pushed(token, tmp_path, "private/pixel:v1", private, login=True)
    pushed(token, tmp_path, "public/pixel:v1", public, login=True)
    rules = rules_for(token)

    uri = f"oci://{token.address}/private/pixel:v1"
    staged = await stage(tmp_path / "login", uri, rules, creds(token))
    assert staged.sha256 == sha(private)
    asked = token.tokens.requests[-1]
    assert asked["scope"] == "repository:private/pixel:pull"
    assert asked["service"] == reg.SERVICE and asked["auth"].startswith("Basic ")

    # Anonymous: a token for what anyone may pull, and nothing else.
    public_uri = f"oci://{token.address}/public/pixel:v1"
    staged = await stage(tmp_path / "anonymous", public_uri, rules)
    assert staged.sha256 == sha(public)
    assert token.tokens.requests[-1]["auth"] == ""
    e = await refused(tmp_path / "private", uri, rules, errors.SourceForbidden)
    assert "needs a login" in e.message

    # A wrong password: the token service refuses it.
    e = await refused(
        tmp_path / "wrong", uri, rules, errors.SourceForbidden, credentials=creds(token, "bad")
    )
    assert "access denied" in e.message

    # The token service over plain HTTP must be allowed like the registry.
    registry_only = dataclasses.replace(LOCAL, insecure_registries=(token.address,))
    e = await refused(tmp_path / "plain", public_uri, registry_only, consent.HostRefused)
    assert "token service" in e.message and "insecureRegistries" in e.message


# ---- bad input: each a clear reason


async def test_plain_http_only_when_allowed(anonymous: reg.Registry, tmp_path: Path) -> None:
    pushed(anonymous, tmp_path, "team/plain:v1", lora_bytes())
    uri = f"oci://{anonymous.address}/team/plain:v1"
    # Without the registry in insecureRegistries it is asked over https, which it does not speak.
    e = await refused(tmp_path, uri, LOCAL, errors.SourceUnavailable)
    assert e.permanent is False
    assert "TLS" in e.message or "connection" in e.message


async def test_unknown_tag(anonymous: reg.Registry, tmp_path: Path) -> None:
    pushed(anonymous, tmp_path, "team/known:v1", lora_bytes())
    for ref in ("team/known:v2", "team/unknown:v1"):
        uri = f"oci://{anonymous.address}/{ref}"
        e = await refused(
            tmp_path / ref.replace("/", "-"), uri, rules_for(anonymous), errors.SourceNotFound
        )
        assert (e.reason, e.permanent) == ("SourceNotFound", True)
        assert "no manifest for tag" in e.message
    e = await refused(
        tmp_path / "digest",
        f"oci://{anonymous.address}/team/known@sha256:{'0' * 64}",
        rules_for(anonymous),
        errors.SourceNotFound,
    )
    assert "digest" in e.message


async def test_a_manifest_without_an_adapter_layer(anonymous: reg.Registry, tmp_path: Path) -> None:
    reg.push_image(anonymous, "team/model:v1", [("application/vnd.example.weights", b"w" * 10)])
    uri = f"oci://{anonymous.address}/team/model:v1"
    e = await refused(tmp_path, uri, rules_for(anonymous), errors.InvalidSource)
    assert (e.reason, e.permanent) == ("InvalidSource", True)
    assert "no adapter layer" in e.message and oci.ADAPTER_LAYER in e.message

    layer = _image_layer({"data/README.md": b"no weights here"})
    reg.push_image(
        anonymous, "team/empty-image:v1", [("application/vnd.oci.image.layer.v1.tar+gzip", layer)]
    )
    uri = f"oci://{anonymous.address}/team/empty-image:v1"
    e = await refused(tmp_path / "image", uri, rules_for(anonymous), errors.SourceNotFound)
    assert "/data/" in e.message


async def test_a_layer_over_the_size_limit(anonymous: reg.Registry, tmp_path: Path) -> None:
    data = lora_bytes(seed=10)
    pushed(anonymous, tmp_path, "team/big:v1", data)
    uri = f"oci://{anonymous.address}/team/big:v1"
    e = await refused(tmp_path, uri, rules_for(anonymous), errors.TooLarge, max_bytes=len(data) - 1)
    assert (e.reason, e.permanent) == ("TooLarge", True)
    assert "staging limit" in e.message

    # An image's file over the limit is refused at its tar header.
    layer = _image_layer({"data/a.safetensors": data})
    reg.push_image(
        anonymous, "team/big-image:v1", [("application/vnd.oci.image.layer.v1.tar+gzip", layer)]
    )
    uri = f"oci://{anonymous.address}/team/big-image:v1"
    await refused(tmp_path / "image", uri, rules_for(anonymous), errors.TooLarge, max_bytes=100)


async def test_a_blob_whose_digest_does_not_match(anonymous: reg.Registry, tmp_path: Path) -> None:
    data = lora_bytes(seed=11)
    pinned = pushed(anonymous, tmp_path, "team/corrupt:v1", data)
    # The registry serves what its storage holds: change the blob's bytes there.
    blob = _storage(anonymous) / "blobs" / "sha256" / sha(data)[:2] / sha(data) / "data"
    blob.write_bytes(lora_bytes(seed=12)[: len(data)].ljust(len(data), b" "))
    uri = f"oci://{anonymous.address}/team/corrupt:v1"
    e = await refused(tmp_path, uri, rules_for(anonymous), errors.ChecksumMismatch)
    assert (e.reason, e.permanent) == ("ChecksumMismatch", True)
    assert f"sha256:{sha(data)}" in e.message
    # By digest too: the manifest is checked, then the blob.
    await refused(tmp_path / "pinned", pinned, rules_for(anonymous), errors.ChecksumMismatch)


async def test_the_registry_answers_403(anonymous: reg.Registry, tmp_path: Path) -> None:
    front = Origin()
    try:
        from aiohttp import web

        async def forbidden(_: web.Request) -> web.StreamResponse:
            return web.Response(status=403, text="denied")

        front.routes["/v2/team/x/manifests/v1"] = forbidden
        uri = f"oci://127.0.0.1:{front.port}/team/x:v1"
        rules = dataclasses.replace(LOCAL, insecure_registries=(f"127.0.0.1:{front.port}",))
        e = await refused(tmp_path, uri, rules, errors.SourceForbidden)
        assert "HTTP 403" in e.message and e.permanent
    finally:
        front.close()


async def test_blob_redirects_are_checked(anonymous: reg.Registry, tmp_path: Path) -> None:
    """A registry that redirects blob GETs to object storage: the redirect's host is checked
    against sourceHosts like any other (here the blob storage is the registry itself, named
    `localhost`)."""
    data = lora_bytes(seed=13)
    pushed(anonymous, tmp_path, "team/redirected:v1", data)
    front = Origin()
    try:
        manifest = "/v2/team/redirected/manifests/v1"
        front.redirect(manifest, f"http://{anonymous.address}{manifest}", 307)
        blob = f"/v2/team/redirected/blobs/sha256:{sha(data)}"
        front.redirect(blob, f"http://localhost:{anonymous.address.split(':')[1]}{blob}", 307)
        uri = f"oci://127.0.0.1:{front.port}/team/redirected:v1"
        insecure = (f"127.0.0.1:{front.port}", anonymous.address)
        only_registry = consent.Rules(
            hosts=("127.0.0.1",),
            allow=consent.parse_networks(["127.0.0.0/8", "::1/128"]),
            insecure_registries=insecure,
        )
        e = await refused(tmp_path / "refused", uri, only_registry, consent.HostRefused)
        assert (e.reason, e.permanent) == ("HostRefused", True)
        assert "redirected to http://localhost" in e.message and "not one the operator" in e.message

        with_storage = dataclasses.replace(only_registry, hosts=("127.0.0.1", "localhost"))
        staged = await stage(tmp_path / "allowed", uri, with_storage)
        assert staged.sha256 == sha(data)
    finally:
        front.close()


async def test_sourcehosts_applies_to_the_registry(anonymous: reg.Registry, tmp_path: Path) -> None:
    uri = f"oci://{anonymous.address}/team/any:v1"
    rules = consent.Rules(
        hosts=("registry.example",),
        allow=consent.parse_networks(["127.0.0.0/8"]),
        insecure_registries=(anonymous.address,),
    )
    e = await refused(tmp_path, uri, rules, consent.HostRefused)
    assert "host 127.0.0.1 is not one the operator may fetch from" in e.message
    e = await refused(
        tmp_path / "closed", uri, rules_for(anonymous, extra=()), errors.SourceNotFound
    )
    assert e.reason == "SourceNotFound"  # opened: the registry answers (no such tag)
    no_loopback = dataclasses.replace(rules, hosts=("*",), allow=())
    e = await refused(tmp_path / "loopback", uri, no_loopback, consent.HostRefused)
    assert "loopback" in e.message


def _storage(registry: reg.Registry) -> Path:
    return registry.folder / "storage" / "docker" / "registry" / "v2"


def _get(registry: reg.Registry, path: str) -> bytes:
    import urllib.request

    req = urllib.request.Request(
        f"http://{registry.address}/v2/{path}", headers={"Accept": oci.MANIFEST_ACCEPT}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return bytes(resp.read())
