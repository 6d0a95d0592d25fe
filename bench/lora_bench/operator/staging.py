"""(d) staging speed, no cluster: one large file staged by the operator's store, in a process of
its own, from a local https origin and a local S3 server, against curl of the same bytes."""

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_devcluster.certs import write_pki

from lora_bench.operator import pods
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
        for _ in range(2 * half >> 20):
            f.write(chunk)


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
        self.url = f"https://127.0.0.1:{self.port}/{path.name}"
        for _ in range(100):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
                break
            time.sleep(0.05)

    def close(self) -> None:
        self._proc.terminate()
        self._proc.wait(10)


# The child imports only the operator's staging code: its peak RSS is the operator's cost.
STAGE_CHILD = """
import asyncio, json, os, sys, time, uuid
from pathlib import Path
from lora_operator.rules import consent
from lora_operator.store import egress, fetchers, sources, staging

uri, volume = sys.argv[1], Path(sys.argv[2])
credentials = sources.Credentials(
    aws_endpoint_url=os.environ.get("AWS_ENDPOINT_URL"),
    aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID"),
    aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
)
# The sources are this machine's: any name, the loopback range opened.
rules = consent.Rules(hosts=("*",), allow=consent.parse_networks(["127.0.0.0/8"]))
fetch = fetchers.Fetcher(volume, egress.Guard(rules))
store = staging.Store(volume, max_bytes=8 * 1024**3, fetch=fetch)
started = time.perf_counter()
name = "big-" + uuid.uuid4().hex[:8]
staged = asyncio.run(store.stage("bench", name, sources.parse_source(uri), credentials=credentials))
seconds = time.perf_counter() - started
# VmHWM: this process's peak (ru_maxrss would include the parent's, kept across exec).
status = Path("/proc/self/status").read_text()
rss = int(next(line for line in status.splitlines() if line.startswith("VmHWM")).split()[1]) / 1024
print(json.dumps({"seconds": seconds, "rss_mib": rss, "bytes": staged.size}))
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


def stage_in_child(uri: str, volume: Path, env: dict[str, str]) -> dict[str, Any]:
    """Stage `uri` with the operator's store in a fresh process: its time and peak RSS."""
    out = subprocess.run(
        [sys.executable, "-c", STAGE_CHILD, uri, str(volume)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def plain_download(url: str, dest: Path, ca: Path | None) -> float:
    """The same bytes with curl to the same volume: the limit for staging."""
    argv = ["curl", "-sSf", "-o", str(dest), url] + (["--cacert", str(ca)] if ca else [])
    started = time.perf_counter()
    subprocess.run(argv, check=True)
    seconds = time.perf_counter() - started
    dest.unlink()
    return seconds


@dataclass
class StagingRow:
    source: str
    mib: int
    plain_s: float
    staged_s: float
    rss_mib: float
    cache_emptied: bool  # the page cache was dropped before each download


def measure_staging(work: Path, sizes_mib: list[int], repeats: int) -> list[StagingRow]:
    import boto3

    volume = work / "staging-volume"
    volume.mkdir(parents=True, exist_ok=True)
    pki = write_pki(work / "pki", ["127.0.0.1"], ["localhost"], "bench", "127.0.0.1")
    moto_port = free_port()
    moto = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(moto_port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{moto_port}"
    s3_env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
    }
    rows = []
    try:
        for _ in range(300):
            if pods.http_ok(f"{endpoint}/moto-api/"):
                break
            time.sleep(0.1)
        s3 = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
        )
        s3.create_bucket(Bucket="bench")
        for mib in sizes_mib:
            path = work / f"big-{mib}.safetensors"
            write_big_lora(path, mib * 2**20)
            origin = FileOrigin(path, pki.server_cert, pki.server_key)
            s3.upload_file(str(path), "bench", path.name)
            sources_ = [
                ("https", origin.url, pki.ca_cert, {"SSL_CERT_FILE": str(pki.ca_cert)}),
                ("s3", f"s3://bench/{path.name}", None, s3_env),
            ]
            try:
                for name, uri, ca, env in sources_:
                    url = uri if name == "https" else f"{endpoint}/bench/{path.name}"
                    plain, staged = [], []
                    rss, emptied = 0.0, True
                    for _ in range(repeats):  # alternate, keep the best of each (a shared machine)
                        emptied &= empty_page_cache()
                        plain.append(plain_download(url, volume / "plain.bin", ca))
                        empty_page_cache()
                        result = stage_in_child(uri, volume, env)
                        staged.append(result["seconds"])
                        rss = max(rss, result["rss_mib"])
                        gc_volume(volume)
                    rows.append(StagingRow(name, mib, min(plain), min(staged), rss, emptied))
                    print(
                        f"  {name} {mib} MiB: plain {min(plain):.2f} s, staged {min(staged):.2f} s,"
                        f" operator RSS {rss:.0f} MiB",
                        flush=True,
                    )
            finally:
                origin.close()
                path.unlink()
    finally:
        moto.terminate()
        moto.wait(10)
    return rows


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
        f"{'operator RSS MiB':>17}"
    )
    for r in rows:
        print(
            f"{r.source:>7}{r.mib:6d} |{r.plain_s:8.2f}{r.staged_s:9.2f}"
            f"{r.plain_s / r.staged_s:7.2f} |{r.rss_mib:17.0f}"
        )
    print(
        "speed: curl's time / the store's (target >= 0.8); the store hashes, checks the header,"
        " fsyncs and publishes;\noperator RSS: the staging process's peak, flat in the file size"
        " when the sizes' rows agree; the page cache was"
        + ("" if all(r.cache_emptied for r in rows) else " NOT")
        + " emptied before each download."
    )
