"""A real S3-compatible server for the tests: SeaweedFS's S3 gateway (`weed server -s3`, built
from the Go module proxy by hack/build-binaries.sh), one process with its master, volume server
and filer on 127.0.0.1, its data in a temporary folder.

It checks SigV4 signatures against the identities it is given (an unsigned request or an
unknown key is refused with S3's own error codes), stores multipart uploads as S3 does and
answers path-style requests; what only AWS does (a bucket in another region answering with
`x-amz-bucket-region`) is tested against a stand-in origin instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.http import free_port

BINARY = "weed"


# Where a virtual-host request names its bucket: `<bucket>.s3.lora.test` (a name no resolver
# knows: a test maps it to 127.0.0.1 at the operator's one lookup, `egress.resolve`).
DOMAIN = "s3.lora.test"


@dataclass(frozen=True)
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT: path-style requests
    key_id: str
    secret: str

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])


def weed_binary() -> str:
    """The SeaweedFS binary: on PATH, else in the cluster binaries' directory."""
    found = shutil.which(BINARY)
    if found:
        return found
    from lora_devcluster import cluster

    candidate = cluster.bin_dir() / BINARY
    if candidate.exists():
        return str(candidate)
    message = f"no {BINARY} in {candidate.parent}: run `make binaries`"
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def identities(key_id: str, secret: str) -> dict[str, object]:
    """The S3 gateway's configuration (pure): one identity that may do everything."""
    return {
        "identities": [
            {
                "name": "lora-tests",
                "credentials": [{"accessKey": key_id, "secretKey": secret}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            }
        ]
    }


# SeaweedFS stores objects in at most MAX_VOLUMES volume files of `volume_mib` each: 512 MiB in
# all by default, plenty for the tests; the staging bench's 1 GiB object asks for larger ones.
MAX_VOLUMES = 8


def server_argv(
    weed: str, data: Path, config: Path, ports: dict[str, int], volume_mib: int = 64
) -> list[str]:
    """`weed server` with every port chosen (pure): the HTTP ports and their gRPC ports, which
    would otherwise be the HTTP port plus 10000 and might be taken; room for MAX_VOLUMES volumes
    of `volume_mib` MiB."""
    return [
        weed,
        "server",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={ports['master']}",
        f"-master.port.grpc={ports['master_grpc']}",
        f"-master.volumeSizeLimitMB={volume_mib}",
        f"-volume.port={ports['volume']}",
        f"-volume.port.grpc={ports['volume_grpc']}",
        f"-volume.max={MAX_VOLUMES}",
        "-filer",
        f"-filer.port={ports['filer']}",
        f"-filer.port.grpc={ports['filer_grpc']}",
        "-s3",
        f"-s3.port={ports['s3']}",
        f"-s3.port.grpc={ports['s3_grpc']}",
        f"-s3.config={config}",
        f"-s3.domainName={DOMAIN}",
        # Its catalog servers would take fixed ports another test's server may hold.
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
    ]


@contextlib.contextmanager
def running(
    key_id: str = "lora-tests-key", secret: str = "lora-tests-secret", *, volume_mib: int = 64
) -> Iterator[S3Server]:
    """SeaweedFS with its S3 gateway, until the block ends; `volume_mib`: see MAX_VOLUMES."""
    weed = weed_binary()
    with tempfile.TemporaryDirectory(prefix="seaweedfs-") as tmp:
        root = Path(tmp)
        config = root / "s3.json"
        config.write_text(json.dumps(identities(key_id, secret)))
        (root / "data").mkdir()
        ports = _ports("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc",
                       "s3", "s3_grpc")  # fmt: skip
        log = (root / "weed.log").open("wb")
        proc = subprocess.Popen(
            server_argv(weed, root / "data", config, ports, volume_mib),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=root,
        )
        endpoint = f"http://127.0.0.1:{ports['s3']}"
        try:
            _wait_ready(endpoint, proc, root / "weed.log")
            yield S3Server(endpoint, key_id, secret)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


def _ports(*names: str) -> dict[str, int]:
    """A free port for each name, no two alike."""
    chosen: dict[str, int] = {}
    while len(chosen) < len(names):
        port = free_port()
        if port not in chosen.values():
            chosen[names[len(chosen)]] = port
    return chosen


def _wait_ready(endpoint: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until the gateway answers S3 (an unsigned ListBuckets is refused with S3's XML: it is
    up, and its identities are loaded)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint + "/", timeout=2).close()
            return
        except urllib.error.HTTPError as e:
            if e.code == 403 and b"<Error>" in e.read():
                return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"SeaweedFS did not start its S3 gateway: {tail}")
        time.sleep(0.2)
