"""(d) staging speed, no cluster: one large file staged by the operator's store, in a process of
its own, from a local https origin (`openssl s_server`), a real S3 server (SeaweedFS's S3
gateway, tests/support/s3server.py) and a real OCI registry (the distribution registry,
tests/support/registry.py), against curl of the same bytes over the same HTTP to the same disk."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_devcluster.certs import write_pki
from lora_operator.store import oci

from tests.support import registry, s3server
from tests.support.http import free_port


def write_big_lora(path: Path, size: int) -> None:
    """A LoRA-shaped safetensors file of `size` bytes: two F32 halves of rank 64 (zeros)."""
    cols = size // (2 * 64 * 4)
    half = 64 * cols * 4
    header = json.dumps(
        {
            "unet.big.lora_A.weight": {
                "dtype": "F32",
                "shape": [64, cols],
                "data_offsets": [0, half],
            },
            "unet.big.lora_B.weight": {
                "dtype": "F32",
                "shape": [cols, 64],
                "data_offsets": [half, 2 * half],
            },
        }
    ).encode()
    header += b" " * (-len(header) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        chunk = os.urandom(1 << 20)  # incompressible, like real weights
        for start in range(0, 2 * half, len(chunk)):
            f.write(chunk[: 2 * half - start])


class FileOrigin:
    """An HTTPS origin serving one file: `openssl s_server -WWW` (C, so the origin is not what
    is measured; it answers HTTP/1.0 without a Content-Length, which the fetcher accepts)."""

    def __init__(self, path: Path, cert: Path, key: Path) -> None:
        self.port = free_port()
        self._proc = subprocess.Popen(
            [
                *("openssl", "s_server", "-accept", str(self.port)),
                *("-cert", str(cert), "-key", str(key), "-WWW", "-quiet"),
            ],
            cwd=path.parent,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = self.url_of(path.name)
        for _ in range(100):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
                break
            time.sleep(0.05)

    def url_of(self, name: str) -> str:
        """The URL of another file in the same folder."""
        return f"https://127.0.0.1:{self.port}/{name}"

    def close(self) -> None:
        self._proc.terminate()
        self._proc.wait(10)


# The child imports only the operator's staging code: its peak RSS is the operator's cost. It
# stages a small file from the same kind of source first, as a running operator has: the time
# measured is a staging's own, not the process's first imports (botocore's alone take 0.2 s),
# which the small staging's time shows.
STAGE_CHILD = """
import asyncio, json, os, sys, time, uuid
from pathlib import Path
from lora_operator.rules import consent
from lora_operator.store import egress, fetchers, sources, staging

first_uri, uri, volume = sys.argv[1], sys.argv[2], Path(sys.argv[3])
credentials = sources.Credentials(
    aws_endpoint_url=os.environ.get("AWS_ENDPOINT_URL"),
    aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID"),
    aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
)
# The sources are this machine's: any name, the loopback range opened, the bench's registry
# over plain HTTP (as `operator.insecureRegistries` would).
insecure = tuple(filter(None, os.environ.get("BENCH_INSECURE_REGISTRIES", "").split(",")))
rules = consent.Rules(
    hosts=("*",), allow=consent.parse_networks(["127.0.0.0/8"]), insecure_registries=insecure
)
fetch = fetchers.Fetcher(volume, egress.Guard(rules))
store = staging.Store(volume, max_bytes=8 * 1024**3, fetch=fetch)


async def stage(uri):
    name = "big-" + uuid.uuid4().hex[:8]
    started = time.perf_counter()
    source = sources.parse_source(uri)
    staged = await store.stage("bench", name, source, credentials=credentials)
    return time.perf_counter() - started, staged.size


async def both():
    return await stage(first_uri), await stage(uri)


(first_seconds, _), (seconds, size) = asyncio.run(both())
# VmHWM: this process's peak (ru_maxrss would include the parent's, kept across exec).
status = Path("/proc/self/status").read_text()
rss = int(next(line for line in status.splitlines() if line.startswith("VmHWM")).split()[1]) / 1024
result = {"first_seconds": first_seconds, "seconds": seconds, "rss_mib": rss, "bytes": size}
print(json.dumps(result))
"""


def empty_page_cache() -> bool:
    """Write back and drop the page cache (root only), so that every download of (d) starts
    from the same memory state: on a machine just used by a cluster, fresh page-cache pages
    cost several times more to fill, and which run found them so was chance. Whether it could."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def stage_in_child(first_uri: str, uri: str, volume: Path, env: dict[str, str]) -> dict[str, Any]:
    """Stage `first_uri`, then `uri`, with the operator's store in a fresh process: the time of
    each and the peak RSS."""
    out = subprocess.run(
        [sys.executable, "-c", STAGE_CHILD, first_uri, uri, str(volume)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(f"staging {uri} failed: {out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def plain_download(curl_args: list[str], dest: Path) -> float:
    """The same bytes with curl to the same volume: the limit for staging."""
    started = time.perf_counter()
    subprocess.run(["curl", "-sSf", "-o", str(dest), *curl_args], check=True)
    seconds = time.perf_counter() - started
    dest.unlink()
    return seconds


@dataclass(frozen=True)
class Source:
    """One row's source: the URI the store stages, and how curl GETs the same bytes over the
    same HTTP (the URL and what it authenticates with)."""

    name: str  # https, s3, oci
    uri: str
    first_uri: str  # a small file from the same kind of source, staged first
    curl_args: list[str]
    env: dict[str, str]  # the staging process's


@dataclass
class StagingRow:
    source: str
    mib: int
    plain_s: float
    staged_s: float
    first_s: float  # the small staging before, the process's first: its imports and clients
    rss_mib: float
    cache_emptied: bool  # the page cache was dropped before each download


BUCKET = "bench"
FIRST_FILE, FIRST_KIB = "first.safetensors", 64
REPOSITORY = "bench/big"
S3_REGION = "us-east-1"


def https_source(origin: FileOrigin, ca: Path) -> Source:
    env = {"SSL_CERT_FILE": str(ca)}
    first = origin.url_of(FIRST_FILE)
    return Source("https", origin.url, first, [origin.url, "--cacert", str(ca)], env)


def s3_source(s3: s3server.S3Server, key: str) -> Source:
    """GetObject signed with SigV4 in its headers, by the store (botocore) and by curl alike."""
    env = {
        "AWS_ENDPOINT_URL": s3.endpoint,
        "AWS_ACCESS_KEY_ID": s3.key_id,
        "AWS_SECRET_ACCESS_KEY": s3.secret,
        "AWS_REGION": S3_REGION,
    }
    curl_args = [f"{s3.endpoint}/{BUCKET}/{key}", "--aws-sigv4", f"aws:amz:{S3_REGION}:s3"]
    curl_args += ["--user", f"{s3.key_id}:{s3.secret}"]
    first = f"s3://{BUCKET}/{FIRST_FILE}"
    return Source("s3", f"s3://{BUCKET}/{key}", first, curl_args, env)


def oci_source(reg: registry.Registry, tag: str) -> Source:
    """The store pulls the manifest, then the layer's blob; curl GETs that blob (the file's
    bytes)."""
    env = {"BENCH_INSECURE_REGISTRIES": reg.address}
    uri, first = (
        f"oci://{reg.address}/{REPOSITORY}:{tag}",
        f"oci://{reg.address}/{REPOSITORY}:first",
    )
    return Source("oci", uri, first, [layer_blob_url(reg, tag)], env)


def push_adapter(reg: registry.Registry, path: Path, tag: str) -> None:
    """`lora-operator adapter push` of the file, as REPOSITORY:tag."""
    pushed = registry.push(reg, path, f"{REPOSITORY}:{tag}")
    if pushed.returncode != 0:
        raise RuntimeError(f"adapter push failed: {pushed.stderr}")


def layer_blob_url(reg: registry.Registry, tag: str) -> str:
    """The URL of the adapter layer's blob of REPOSITORY:tag (the file's bytes)."""
    request = urllib.request.Request(
        f"http://{reg.address}/v2/{REPOSITORY}/manifests/{tag}",
        headers={"Accept": oci.OCI_MANIFEST},
    )
    with urllib.request.urlopen(request) as resp:
        layer = json.load(resp)["layers"][0]["digest"]
    return f"http://{reg.address}/v2/{REPOSITORY}/blobs/{layer}"


def measure_staging(work: Path, sizes_mib: list[int], repeats: int) -> list[StagingRow]:
    import boto3

    volume = work / "staging-volume"
    volume.mkdir(parents=True, exist_ok=True)
    pki = write_pki(work / "pki", ["127.0.0.1"], ["localhost"], "bench", "127.0.0.1")
    rows = []
    # SeaweedFS's volumes as large as the largest file (eight of them): an object spans few.
    with (
        s3server.running(volume_mib=max(64, *sizes_mib)) as s3,
        registry.run_registry(work / "registry") as reg,
    ):
        client = boto3.client(
            "s3",
            endpoint_url=s3.endpoint,
            region_name=S3_REGION,
            aws_access_key_id=s3.key_id,
            aws_secret_access_key=s3.secret,
        )
        client.create_bucket(Bucket=BUCKET)
        first = work / FIRST_FILE  # beside the large files: the https origin serves it too
        write_big_lora(first, FIRST_KIB * 1024)
        client.upload_file(str(first), BUCKET, FIRST_FILE)
        push_adapter(reg, first, "first")
        for mib in sizes_mib:
            path = work / f"big-{mib}.safetensors"
            write_big_lora(path, mib * 2**20)
            origin = FileOrigin(path, pki.server_cert, pki.server_key)
            try:
                client.upload_file(str(path), BUCKET, path.name)
                push_adapter(reg, path, f"{mib}mib")
                sources_ = [
                    https_source(origin, pki.ca_cert),
                    s3_source(s3, path.name),
                    oci_source(reg, f"{mib}mib"),
                ]
                for source in sources_:
                    row = measure_source(source, mib, volume, repeats)
                    rows.append(row)
                    print(
                        f"  {source.name} {mib} MiB: plain {row.plain_s:.2f} s, staged"
                        f" {row.staged_s:.2f} s (the first, small {row.first_s:.2f} s),"
                        f" operator RSS {row.rss_mib:.0f} MiB",
                        flush=True,
                    )
            finally:
                origin.close()
                path.unlink()
    return rows


def measure_source(source: Source, mib: int, volume: Path, repeats: int) -> StagingRow:
    """curl and the store, alternately, `repeats` times each; the best of each (a shared
    machine), and the store's peak RSS."""
    plain, staged, first = [], [], []
    rss, emptied = 0.0, True
    for _ in range(repeats):
        emptied &= empty_page_cache()
        plain.append(plain_download(source.curl_args, volume / "plain.bin"))
        empty_page_cache()
        result = stage_in_child(source.first_uri, source.uri, volume, source.env)
        staged.append(result["seconds"])
        first.append(result["first_seconds"])
        rss = max(rss, result["rss_mib"])
        gc_volume(volume)
    return StagingRow(source.name, mib, min(plain), min(staged), min(first), rss, emptied)


def gc_volume(volume: Path) -> None:
    """Empty the staging volume between runs (each run stages under a new name)."""
    for child in volume.iterdir():
        if child.is_dir():
            shutil.rmtree(child)
        else:
            child.unlink()


def print_staging(rows: list[StagingRow]) -> None:
    print("\n(d) staging one file: the operator's store against curl of the same bytes")
    print(
        f"{'source':>7}{'MiB':>6} |{'curl s':>8}{'staged s':>9}{'speed':>7} |"
        f"{'first s':>8}{'operator RSS MiB':>17}"
    )
    for r in rows:
        print(
            f"{r.source:>7}{r.mib:6d} |{r.plain_s:8.2f}{r.staged_s:9.2f}"
            f"{r.plain_s / r.staged_s:7.2f} |{r.first_s:8.2f}{r.rss_mib:17.0f}"
        )
    print(
        "speed: curl's time / the store's (target >= 0.8); the store hashes, checks the header,"
        " fsyncs and publishes;\ncurl: https the file, s3 GetObject signed with SigV4"
        " (--aws-sigv4), oci the layer's blob (the store reads the manifest first);"
        f"\nfirst: the staging process's first, of a {FIRST_KIB} KiB file from the same kind of"
        " source, before the one timed (its imports, its first client);"
        "\noperator RSS: the staging process's peak, flat in the file size when the sizes' rows"
        " agree; the page cache was"
        + ("" if all(r.cache_emptied for r in rows) else " NOT")
        + " emptied before each download."
    )
