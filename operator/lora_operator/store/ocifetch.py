"""oci://: an adapter pulled from an OCI registry through the distribution API, no container
runtime.

`fetch_oci` asks the registry for the manifest (by tag or digest; an index is followed to the
manifest that holds the adapter), chooses the adapter's layer (`oci.choose_layer`) and streams
that blob into the sink: the file itself for an artifact layer, or the `data/*.safetensors` file
of an image's tar(.gz) layer, read as it streams (`tarstream`). Every digest is checked: the
manifest's against the reference's digest and each child's against its index entry, the blob's
against its descriptor (`ChecksumMismatch`). What the reference resolved to is logged and
returned as `oci://REGISTRY/REPOSITORY@sha256:<digest>`: the digest of the manifest the reference
itself names, an index's when it names an index (what a registry reports for the tag and a user
pins: pinned, it resolves to the same child again, as an index's entries never change), never
the child's chosen from it.

Authentication is the distribution spec's: a request goes out anonymous; a 401 with a Bearer
challenge sends the login of the Secret's `.dockerconfigjson` for this registry (or none) to the
challenge's realm for a pull token, then the request again with it; a Basic challenge gets the
login itself. Every request, the token service's and the blob's redirects to object storage
included, goes through `downloads.download` and so `egress.get`: the hosts in `sourceHosts`, the
addresses checked where the socket opens, the Authorization header dropped when a redirect
leaves the origin. Plain HTTP only for a registry or token service in `insecureRegistries`.

Blocking calls in a worker thread, as the other fetchers. Raises `lora_operator.rules.errors`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import zlib
from collections.abc import Callable, Mapping

from lora_operator.rules import consent, errors
from lora_operator.store import downloads, egress, oci, sinks, sources, tarstream
from lora_operator.store.downloads import RetryPolicy, classify_status, status_error

log = logging.getLogger("lora_operator")

# What an image's layer may hold besides the adapter, compressed or not: the adapter's folder
# usually has its config and a README too.
LAYER_SLACK_BYTES = 64 * 1024 * 1024
SECRET_HINT = "the login for the registry in the Secret's .dockerconfigjson"


class _Unauthorized(errors.SourceForbidden):
    """A 401: answered by authenticating (`_Registry._authorize`), never a status itself."""

    def __init__(self, message: str, challenge: str) -> None:
        super().__init__(message)
        self.challenge = challenge


async def fetch_oci(
    source: sources.OciSource,
    credentials: sources.Credentials,
    sink: sinks.Sink,
    *,
    policy: RetryPolicy,
    guard: egress.Guard,
) -> str:
    """Fetch the adapter into `sink`; what the reference resolved to, by digest."""
    return await asyncio.to_thread(_fetch_sync, source, credentials, sink, policy, guard)


def _fetch_sync(
    source: sources.OciSource,
    credentials: sources.Credentials,
    sink: sinks.Sink,
    policy: RetryPolicy,
    guard: egress.Guard,
) -> str:
    what = sources.describe(source)
    registry = _Registry(source, credentials, policy, guard, what)
    digest, manifest = registry.manifest(source.reference, source.digest)
    if isinstance(manifest, oci.Index):
        entry = oci.choose_manifest(manifest)
        _, manifest = registry.manifest(entry.digest, entry.digest)
        if isinstance(manifest, oci.Index):
            raise errors.InvalidSource(f"{what}: an index within an index is not read")
    log.info("action=resolved source=%s manifest=%s", what, digest)
    choice = oci.choose_layer(manifest, what)
    if choice.kind == "file":
        _fetch_file(registry, choice.layers[0], sink, what)
    else:
        _fetch_from_image(registry, choice.layers, sink, what)
    return sources.describe(dataclasses.replace(source, tag=None, digest=digest))


def _fetch_file(registry: _Registry, layer: oci.Descriptor, sink: sinks.Sink, what: str) -> None:
    sink.expect(layer.size)  # TooLarge before a byte is fetched
    registry.blob(layer, sink)
    digest = "sha256:" + sink.finish()
    if digest != layer.digest or sink.size != layer.size:
        raise errors.ChecksumMismatch(
            f"{what}: the registry sent a layer of {sink.size} bytes with {digest}, but the "
            f"manifest says {layer.size} bytes with {layer.digest}; push the adapter again"
        )


def _fetch_from_image(
    registry: _Registry, layers: tuple[oci.Descriptor, ...], sink: sinks.Sink, what: str
) -> None:
    """The adapter from an image: each tar layer, the topmost first, until one holds it."""
    limit = sink.limit + LAYER_SLACK_BYTES
    pickle = False
    for layer in layers:
        if layer.size > limit:
            raise errors.TooLarge(
                f"{what}: an image layer of {layer.size} bytes is over the limit of {limit} "
                "(the staging size limit and 64 MiB for the adapter's other files)"
            )
        writer = _LayerReader(sink, layer, limit, what)
        registry.blob(layer, writer)
        writer.finish()
        if writer.found:
            return
        pickle = pickle or writer.pickle
        sink.reset()
    if pickle:
        raise errors.PickleRefused(
            f"{what}: the image holds only pickle weights under /{oci.IMAGE_ADAPTER_DIR}/, which "
            "can run code when opened and are never staged; publish a .safetensors file"
        )
    raise errors.SourceNotFound(
        f"{what}: no layer of the image holds a .safetensors file under "
        f"/{oci.IMAGE_ADAPTER_DIR}/; put the adapter there, or publish it as an artifact "
        "(lora-operator adapter push)"
    )


class _LayerReader:
    """A downloads.Writer for an image's tar(.gz) layer: hashes the blob as it comes, inflates
    it within bounds and hands the tar stream to `tarstream`; the `data/*.safetensors` file
    goes into the sink."""

    def __init__(self, sink: sinks.Sink, layer: oci.Descriptor, limit: int, what: str) -> None:
        self._sink, self._layer, self._limit, self._what = sink, layer, limit, what
        self._gzip = layer.media_type in oci.TAR_GZIP_LAYERS
        self.reset(sink_too=False)

    def reset(self, *, sink_too: bool = True) -> None:
        if sink_too:
            self._sink.reset()
        self._hash = hashlib.sha256()
        self.size = 0
        self._inflated = 0
        self._inflate = zlib.decompressobj(wbits=31) if self._gzip else None
        self._tar = tarstream.TarStream(self._on_file)
        self.found: str | None = None
        self.pickle = False

    def expect(self, declared: int | None) -> None:
        if declared is not None and declared > self._limit:
            raise self._too_large(declared)

    def write(self, chunk: bytes) -> None:
        self._hash.update(chunk)
        self.size += len(chunk)
        if self.size > self._limit:
            raise self._too_large(self.size)
        try:
            if self._inflate is None:
                self._feed(chunk)
                return
            data = chunk
            while data:
                if self._inflate.eof:  # another gzip member follows
                    data = self._inflate.unused_data + data
                    self._inflate = zlib.decompressobj(wbits=31)
                self._feed(self._inflate.decompress(data, downloads.CHUNK_BYTES))
                data = self._inflate.unconsumed_tail
        except zlib.error:
            raise errors.InvalidSource(
                f"{self._what}: the layer {self._layer.digest} is not valid gzip"
            ) from None
        except tarstream.TarRefused as e:
            raise errors.InvalidSource(
                f"{self._what}: the layer {self._layer.digest} is refused: {e}"
            ) from None

    def _feed(self, data: bytes) -> None:
        self._inflated += len(data)
        if self._inflated > self._limit:
            raise self._too_large(self._inflated, inflated=True)
        if not self._tar.ended:
            self._tar.feed(data)

    def _on_file(self, name: str, size: int) -> tarstream.Consumer | None:
        kind = oci.image_member(name)
        if kind == "pickle":
            self.pickle = True
        if kind != "weights":
            return None
        if self.found is not None:
            raise errors.InvalidSource(
                f"{self._what}: the image's layer holds several .safetensors files under "
                f"/{oci.IMAGE_ADAPTER_DIR}/; keep one"
            )
        self.found = name
        self._sink.expect(size)
        return self._sink.write

    def finish(self) -> None:
        """The whole layer was read: check its end and its digest."""
        try:
            if self._inflate is not None:
                self._feed(self._inflate.flush())
                if not self._inflate.eof:
                    raise tarstream.TarRefused("its gzip stream is cut short")
            self._tar.close()
        except (zlib.error, tarstream.TarRefused) as e:
            raise errors.InvalidSource(
                f"{self._what}: the layer {self._layer.digest} is refused: {e}"
            ) from None
        digest = "sha256:" + self._hash.hexdigest()
        if digest != self._layer.digest or self.size != self._layer.size:
            raise errors.ChecksumMismatch(
                f"{self._what}: the registry sent a layer of {self.size} bytes with {digest}, "
                f"but the manifest says {self._layer.size} bytes with {self._layer.digest}"
            )

    def _too_large(self, size: int, *, inflated: bool = False) -> errors.TooLarge:
        what = "inflates to" if inflated else "is"
        return errors.TooLarge(
            f"{self._what}: the layer {self._layer.digest} {what} more than {self._limit} bytes "
            f"(at least {size}): the staging size limit and 64 MiB for the adapter's other files"
        )


def _request(url: str, headers: Mapping[str, str]) -> Callable[[], tuple[str, Mapping[str, str]]]:
    return lambda: (url, headers)


class _Registry:
    """One registry, one repository: its base URL, and the Authorization its challenges led
    to, reused for every request of this fetch."""

    def __init__(
        self,
        source: sources.OciSource,
        credentials: sources.Credentials,
        policy: RetryPolicy,
        guard: egress.Guard,
        what: str,
    ) -> None:
        self.source, self.policy, self.guard, self.what = source, policy, guard, what
        plain = consent.plain_http_allowed(source.host, source.port, guard.rules)
        self.base = f"{'http' if plain else 'https'}://{source.registry}/v2/{source.repository}"
        self.login = oci.login_for(credentials.registry_auths, source.registry)
        self.authorization: str | None = None

    def manifest(self, reference: str, digest: str | None) -> tuple[str, oci.Manifest | oci.Index]:
        """The manifest `reference` names, its digest checked against `digest` when given."""
        buffer = downloads.Buffer(oci.MANIFEST_LIMITS.max_bytes, f"{self.what}: the manifest")
        where = "tag" if digest is None else "digest"
        self._get(
            f"{self.base}/manifests/{reference}",
            buffer,
            accept=oci.MANIFEST_ACCEPT,
            not_found=(
                f"{self.what}: the registry has no manifest for {where} {reference} in "
                f"{self.source.repository}; check the tag (or push it: lora-operator adapter "
                "push)"
            ),
        )
        body = buffer.value()
        actual = "sha256:" + hashlib.sha256(body).hexdigest()
        if digest is not None and actual != digest:
            raise errors.ChecksumMismatch(
                f"{self.what}: the registry sent a manifest with {actual} for {digest}"
            )
        try:
            return actual, oci.parse_manifest(body)
        except ValueError as e:
            raise errors.InvalidSource(f"{self.what}: the manifest is refused: {e}") from e

    def blob(self, layer: oci.Descriptor, writer: downloads.Writer) -> None:
        self._get(
            f"{self.base}/blobs/{layer.digest}",
            writer,
            not_found=(
                f"{self.what}: the registry has no blob {layer.digest} that the manifest "
                "names; push the adapter again"
            ),
        )

    def _get(
        self,
        url: str,
        writer: downloads.Writer,
        *,
        not_found: str,
        accept: str | None = None,
    ) -> None:
        tried: set[str] = set()  # each scheme answered once per request (a token may expire)
        while True:
            headers = {"Accept": accept} if accept else {}
            if self.authorization:
                headers["Authorization"] = self.authorization
            try:
                downloads.download(
                    _request(url, headers),
                    writer,
                    self.policy,
                    self.guard,
                    self.what,
                    self._refusal(not_found),
                )
                return
            except _Unauthorized as e:
                if not self._authorize(e.challenge, tried):
                    raise self._refused(401) from None
                writer.reset()

    def _refusal(self, not_found: str) -> downloads.Refusal:
        def refusal(status: int, headers: Mapping[str, str], _: bytes) -> errors.StagingError:
            if status == 401:
                return _Unauthorized("unauthorized", headers.get("WWW-Authenticate") or "")
            if status == 403:
                return self._refused(403)
            if status in (404, 410):
                return errors.SourceNotFound(not_found)
            return status_error(classify_status(status), status, self.what, SECRET_HINT)

        return refusal

    def _refused(self, status: int) -> errors.SourceForbidden:
        if self.login is None:
            return errors.SourceForbidden(
                f"{self.what}: the registry answered HTTP {status}: it needs a login; name a "
                "kubernetes.io/dockerconfigjson Secret with one for "
                f"{self.source.registry} in source.secretRef"
            )
        return errors.SourceForbidden(
            f"{self.what}: the registry answered HTTP {status}: access denied to "
            f"{self.source.repository}; check {SECRET_HINT} ({self.source.registry})"
        )

    def _authorize(self, header: str, tried: set[str]) -> bool:
        """Answer a 401's challenges, each scheme once per request (`tried`); whether there is
        something new to try. The Authorization found is kept for the next requests."""
        challenges = {c.scheme: c for c in oci.parse_www_authenticate(header)}
        bearer, basic = challenges.get("bearer"), challenges.get("basic")
        if bearer is not None and "bearer" not in tried:
            tried.add("bearer")
            self.authorization = f"Bearer {self._token(bearer)}"
            return True
        if basic is not None and self.login is not None and "basic" not in tried:
            tried.add("basic")
            self.authorization = oci.basic_authorization(*self.login)
            return True
        return False

    def _token(self, challenge: oci.Challenge) -> str:
        """A pull token from the challenge's realm: asked with the login, or anonymously."""
        try:
            url = oci.token_url(challenge, self.source.repository)
            target = sources.parse_url(url)
        except ValueError as e:
            raise consent.HostRefused(
                f"{self.what}: the registry's token service is refused: {e}"
            ) from e
        if target.scheme == "http" and not consent.plain_http_allowed(
            target.host, target.port, self.guard.rules
        ):
            raise consent.HostRefused(
                f"{self.what}: the registry's token service {target.origin} is plain HTTP; "
                f"list {target.host}:{target.port} in {consent.INSECURE_VALUE} to allow it"
            )
        headers = {"Authorization": oci.basic_authorization(*self.login)} if self.login else {}
        buffer = downloads.Buffer(oci.TOKEN_LIMITS.max_bytes, f"{self.what}: the token")
        where = f"{self.what} (token service {target.origin})"

        def refusal(status: int, _: Mapping[str, str], __: bytes) -> errors.StagingError:
            if status in (401, 403):
                return self._refused(status)
            return status_error(classify_status(status), status, where, SECRET_HINT)

        downloads.download(lambda: (url, headers), buffer, self.policy, self.guard, where, refusal)
        try:
            return oci.parse_token(buffer.value())
        except ValueError as e:
            raise errors.InvalidSource(f"{where}: {e}") from e
