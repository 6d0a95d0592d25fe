"""The operator on the local cluster when things go wrong: bad sources, a full volume, the
operator killed mid-download, and two namespaces with the same adapter names.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from lora_devcluster.certs import write_pki
from lora_devcluster.harness import Harness
from lora_inference.tools.random_adapters import write_random_adapter
from lora_inference.tools.tiny_models import build_tiny_pipeline

from tests.support import cluster
from tests.support.cluster import Models, Operator, StatusRecorder
from tests.support.http import free_port, generate
from tests.support.origin import Origin
from tests.support.phases import Phase


@pytest.fixture
def origin(tmp_path: Path) -> Iterator[tuple[Origin, Path]]:
    """An HTTPS origin with a certificate from a CA the operator is told to trust."""
    pki = write_pki(tmp_path / "pki", ["127.0.0.1"], ["localhost"], "origin", "127.0.0.1")
    server = Origin(pki.server_cert, pki.server_key)
    try:
        yield server, pki.ca_cert
    finally:
        server.close()


@pytest.fixture
def small_volume(crd: Harness, tmp_path: Path) -> Iterator[tuple[Path, list[str]]]:
    """A 1 MiB tmpfs as the adapter volume, mounted in the cluster's mount namespace (where
    the kubelet makes the pods' mounts), and the command prefix that runs a process there."""
    v = tmp_path / "small-volume"
    v.mkdir()
    enter = ["nsenter", f"--mount=/proc/{crd.cluster.unshare_pid}/ns/mnt", "--"]
    subprocess.run([*enter, "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(v)], check=True)
    try:
        yield v, enter
    finally:
        subprocess.run([*enter, "umount", "-l", str(v)], check=False)


SECRET_TOKEN = "s3cret-t0ken-value"
SECRET_HEADER = f"Bearer {SECRET_TOKEN}"


def condition(obj: dict, type_: str) -> dict:  # type: ignore[type-arg]
    return next(c for c in obj["status"]["conditions"] if c["type"] == type_)


def test_bad_sources_get_the_documented_phase_and_reason_and_harm_no_other_adapter(
    crd: Harness,
    devcluster_namespace: str,
    volume: Path,
    models: Models,
    origin: tuple[Origin, Path],
    tmp_path: Path,
    phase: Phase,
) -> None:
    h, ns = crd, devcluster_namespace
    server, ca = origin
    with Operator(
        volume=volume,
        namespaces=[ns],
        log_path=tmp_path / "op.log",
        env={"SSL_CERT_FILE": str(ca)},
    ).running() as op:
        phase("a good adapter Ready")
        good, good_sha = cluster.write_adapter(models, volume / ns / "src" / "good", seed=1)
        weights = (good / "pytorch_lora_weights.safetensors").read_bytes()
        sdxl = build_tiny_pipeline("sdxl")
        wrong = write_random_adapter(tmp_path / "sdxl", sdxl, base_model="tiny-sdxl", seed=3)
        h.apply(
            cluster.inference_deployment(h.image("inference"), "inference", 1, models.root, volume),
            ns,
        )
        h.apply(cluster.adapter("good", str(good)), ns)
        cluster.wait_phase(h, ns, "good", "Ready", "1/1", timeout=240)
        (ip,) = cluster.pod_ips(h, ns, 1).values()
        before = generate(f"http://{ip}:8000", "good")

        phase("bad sources applied: each gets its phase and reason")
        flaky = server.fail_first("/flaky.safetensors", weights, failures=2)
        guarded = server.serve_guarded("/guarded.safetensors", weights, SECRET_HEADER)
        h.apply(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                # Lent to LoRAAdapters on purpose: a Secret without this label is refused.
                "metadata": {
                    "name": "origin-creds",
                    "labels": {"lora.dev/source-credentials": "true"},
                },
                "stringData": {"AUTHORIZATION": SECRET_HEADER},
            },
            ns,
        )
        recorder = StatusRecorder(h, ns).start()
        refused = f"https://127.0.0.1:{free_port()}/nobody-listens.safetensors"
        h.apply(
            [
                cluster.adapter("refused", refused),
                cluster.adapter("missing", server.url("/nothing.safetensors")),
                cluster.adapter("flaky", flaky),
                cluster.adapter("truncated", server.serve_truncated("/t.safetensors", weights)),
                cluster.adapter(
                    "mismatch",
                    server.serve("/m.safetensors", weights),
                    source={"sha256": "0" * 64},
                ),
                cluster.adapter("pickle", server.url("/adapter.bin")),
                cluster.adapter("wrong-shapes", server.serve("/w.safetensors", _weights_of(wrong))),
                cluster.adapter("other-base", str(good), baseModel="another-model"),
                cluster.adapter("guarded", guarded, source={"secretRef": {"name": "origin-creds"}}),
                cluster.adapter("no-secret", guarded, source={"secretRef": {"name": "absent"}}),
            ],
            ns,
        )
        expectations = {
            "missing": ("Failed", "Staged", "SourceNotFound"),
            "mismatch": ("Failed", "Staged", "ChecksumMismatch"),
            "pickle": ("Failed", "Staged", "PickleRefused"),
            "wrong-shapes": ("Failed", "Ready", "LoadFailed"),
            "other-base": ("Pending", "Ready", "NoPods"),
        }
        for name, (expected_phase, ctype, reason) in expectations.items():
            obj = cluster.wait_phase(h, ns, name, expected_phase, timeout=120)
            c = condition(obj, ctype)
            assert (c["status"], c["reason"]) == ("False", reason), (name, c)
            assert c["message"], name
        assert "wrong-shapes" not in cluster.models(ip)
        msg = condition(cluster.get_adapter(h, ns, "wrong-shapes") or {}, "Ready")["message"]
        assert "422" in msg
        cluster.wait_phase(h, ns, "flaky", "Ready", "1/1", timeout=120)
        # Credentials come from the Secret, and never show in status, Events or the log.
        phase("credentials from the Secret, never shown")
        guarded_obj = cluster.wait_phase(h, ns, "guarded", "Ready", "1/1", timeout=120)
        missing = cluster.wait_phase(h, ns, "no-secret", "Degraded", timeout=120)
        assert "Secret 'absent'" in condition(missing, "Staged")["message"]
        every_event = str(h.get(f"/api/v1/namespaces/{ns}/events"))
        for text in (str(guarded_obj), every_event, op.log()):
            assert SECRET_TOKEN not in text
        # Transient failures retry with backoff, then say Degraded; they never publish anything.
        phase("transient failures: retried, then Degraded")
        obj = cluster.wait_phase(h, ns, "truncated", "Degraded", timeout=120)
        assert condition(obj, "Staged")["reason"] == "SourceUnavailable"
        assert condition(obj, "Degraded")["status"] == "True"
        assert not (volume / ns / "truncated").exists()
        # Permanent failures are not retried: one download attempt each.
        phase("permanent failures: not retried, one Warning each")
        assert server.hits.get("/m.safetensors") == 1
        assert "/adapter.bin" not in server.hits
        # One Warning per permanent failure, with its own reason (no second, generic one).
        for name, reason in (
            ("missing", "SourceNotFound"),
            ("mismatch", "ChecksumMismatch"),
            ("pickle", "PickleRefused"),
            ("wrong-shapes", "LoadFailed"),
        ):
            assert list(cluster.event_notes(h, ns, name, "Warning")) == [reason], name
            assert len(cluster.event_notes(h, ns, name, "Warning")[reason]) == 1, name
        phase("a source refusing connections: Degraded for good")
        # A source that refuses connections: Staging, then Degraded for good, never back to
        # Staging or Pending while it retries; the message says when the next attempt is; one
        # Warning when it first failed and one when it became Degraded.
        obj = cluster.wait_phase(h, ns, "refused", "Degraded", timeout=180)
        h.wait_for(
            "two more attempts",
            lambda: op.log().count("adapter=" + ns + "/refused result=transient") >= 6,
            120,
        )
        recorder.stop()
        phases = [phase for phase, _, _ in recorder.seen["refused"]]
        first = phases.index("Degraded")
        assert set(phases[first:]) == {"Degraded"}, phases
        assert set(phases[:first]) <= {"Pending", "Staging"}, phases
        assert obj["status"]["phase"] == "Degraded"
        warned = cluster.event_notes(h, ns, "refused", "Warning")
        assert warned.keys() == {"SourceUnavailable"} and len(warned["SourceUnavailable"]) <= 2
        (note,) = [n for n in warned["SourceUnavailable"] if "in a row" in n]
        assert "staging failed 4 times in a row" in note and "attempt 5 at 20" in note, note
        # The adapter that was there all along is untouched.
        phase("the good adapter untouched, nothing left in .tmp")
        cluster.wait_phase(h, ns, "good", "Ready", "1/1", timeout=30)
        assert np.array_equal(generate(f"http://{ip}:8000", "good"), before)
        assert cluster.holds(ip, "good", good_sha)
        # Every failed attempt removed its download. ("refused" keeps retrying, and an attempt
        # holds its file for the moment it takes to be refused: a leak is a file that stays.)
        h.wait_for("nothing left in .tmp", lambda: not any((volume / ".tmp").iterdir()), 30)


def _weights_of(adapter_dir: Path) -> bytes:
    return (adapter_dir / "pytorch_lora_weights.safetensors").read_bytes()


def test_operator_killed_mid_download_shows_nothing_partial_and_finishes_after_restart(
    crd: Harness,
    devcluster_namespace: str,
    volume: Path,
    models: Models,
    origin: tuple[Origin, Path],
    tmp_path: Path,
) -> None:
    h, ns = crd, devcluster_namespace
    server, ca = origin
    path, sha = cluster.write_adapter(models, tmp_path / "src", seed=5)
    url = server.serve_slowly("/slow.safetensors", _weights_of(path), seconds=6)
    with Operator(
        volume=volume, namespaces=[ns], log_path=tmp_path / "op.log", env={"SSL_CERT_FILE": str(ca)}
    ).running() as op:
        h.apply(
            cluster.inference_deployment(h.image("inference"), "inference", 1, models.root, volume),
            ns,
        )
        h.apply(cluster.adapter("slow", url), ns)
        # (The download's file exists from the first byte; what it received shows in the
        # status, as staging writes to the file in large batches.)
        h.wait_for("a download in .tmp", lambda: any((volume / ".tmp").glob("*.part")), 60)
        staging = h.wait_for(  # progress shows in the status while it downloads
            "the status to show the bytes staged so far",
            lambda: (
                (cluster.get_adapter(h, ns, "slow") or {}).get("status", {}).get("stagingBytes")
            ),
            timeout=30,
        )
        assert 0 < staging < len(_weights_of(path))
        assert cluster.get_adapter(h, ns, "slow")["status"]["phase"] == "Staging"  # type: ignore[index]
        op.kill()
        assert not (volume / ns / "slow").exists()
        assert not (volume / ".objects").exists() or not any(
            (volume / ".objects").rglob("*.safetensors")
        )
        op.start()
        obj = cluster.wait_phase(h, ns, "slow", "Ready", "1/1", timeout=240)
        assert obj["status"]["staged"]["sha256"] == sha
        assert list((volume / ".tmp").iterdir()) == []
        assert server.hits["/slow.safetensors"] >= 2


@pytest.fixture
def second_namespace(crd: Harness, devcluster_namespace: str) -> Iterator[str]:
    ns = f"{devcluster_namespace[:50]}-two"
    crd.kubectl("create", "namespace", ns)
    try:
        yield ns
    finally:
        crd.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_same_named_adapters_in_two_namespaces_stay_isolated(
    crd: Harness,
    devcluster_namespace: str,
    second_namespace: str,
    volume: Path,
    models: Models,
    tmp_path: Path,
) -> None:
    h, ns1, ns2 = crd, devcluster_namespace, second_namespace
    with Operator(volume=volume, namespaces=[ns1, ns2], log_path=tmp_path / "op.log").running():
        shas = {}
        for ns, seed in ((ns1, 1), (ns2, 2)):
            src, shas[ns] = cluster.write_adapter(models, volume / ns / "src" / "pixel", seed=seed)
            h.apply(
                cluster.inference_deployment(
                    h.image("inference"), "inference", 1, models.root, volume
                ),
                ns,
            )
            h.apply(cluster.adapter("pixel", str(src)), ns)
        images = {}
        for ns in (ns1, ns2):
            cluster.wait_phase(h, ns, "pixel", "Ready", "1/1", timeout=240)
            (ip,) = cluster.pod_ips(h, ns, 1).values()
            card = cluster.models(ip)["pixel"]
            assert card["root"] == "pixel"  # the adapter's name: no path on the pod
            assert cluster.holds(ip, "pixel", shas[ns])
            images[ns] = generate(f"http://{ip}:8000", "pixel")
        assert not np.array_equal(images[ns1], images[ns2])
        # A volume path into another namespace is refused, not loaded.
        h.apply(cluster.adapter("thief", str(volume / ns2 / "src" / "pixel")), ns1)
        obj = cluster.wait_phase(h, ns1, "thief", "Failed", timeout=60)
        assert condition(obj, "Staged")["reason"] == "InvalidSource"


def test_a_volume_filling_up_mid_download_is_transient_and_publishes_nothing(
    crd: Harness,
    devcluster_namespace: str,
    small_volume: tuple[Path, list[str]],
    models: Models,
    origin: tuple[Origin, Path],
    tmp_path: Path,
) -> None:
    h, ns = crd, devcluster_namespace
    volume, enter = small_volume
    server, ca = origin

    def listing(path: Path) -> str:  # what the pods and the operator see, inside the cluster
        out = subprocess.run([*enter, "find", str(path)], capture_output=True, text=True)
        return out.stdout

    with Operator(
        volume=volume,
        namespaces=[ns],
        log_path=tmp_path / "op.log",
        env={"SSL_CERT_FILE": str(ca)},
        prefix=enter,
    ).running():
        path, sha = cluster.write_adapter(models, tmp_path / "src", seed=7)
        h.apply(
            cluster.inference_deployment(h.image("inference"), "inference", 1, models.root, volume),
            ns,
        )
        h.apply(cluster.adapter("small", server.serve("/s.safetensors", _weights_of(path))), ns)
        cluster.wait_phase(h, ns, "small", "Ready", "1/1", timeout=240)
        big = server.serve("/big.safetensors", b"\0" * (2 * 1024 * 1024))
        h.apply(cluster.adapter("big", big), ns)
        obj = cluster.wait_phase(h, ns, "big", "Degraded", timeout=120)
        assert condition(obj, "Staged")["reason"] == "DiskFull"
        assert "full" in condition(obj, "Staged")["message"]
        files = listing(volume)
        assert f"{ns}/big" not in files and ".part" not in files, files
        assert f"{ns}/small/revisions/{sha}" in files
        cluster.wait_phase(h, ns, "small", "Ready", "1/1", timeout=30)
        (ip,) = cluster.pod_ips(h, ns, 1).values()
        assert cluster.holds(ip, "small", sha)


def test_the_operator_recovers_its_watches_after_an_api_server_restart(
    crd: Harness, devcluster_namespace: str, volume: Path, models: Models, tmp_path: Path
) -> None:
    h, ns = crd, devcluster_namespace
    with Operator(volume=volume, namespaces=[ns], log_path=tmp_path / "op.log").running() as op:
        first, _ = cluster.write_adapter(models, volume / ns / "src" / "first", seed=1)
        second, sha = cluster.write_adapter(models, volume / ns / "src" / "second", seed=2)
        h.apply(
            cluster.inference_deployment(h.image("inference"), "inference", 1, models.root, volume),
            ns,
        )
        h.apply(cluster.adapter("first", str(first)), ns)
        cluster.wait_phase(h, ns, "first", "Ready", "1/1", timeout=240)
        h.restart_apiserver()
        # Only a re-established watch can see these: a new adapter, and a replaced pod.
        h.apply(cluster.adapter("second", str(second)), ns)
        cluster.wait_phase(h, ns, "second", "Ready", "1/1", timeout=120)
        (old,) = cluster.pod_ips(h, ns, 1)
        h.kubectl("delete", "pod", "-n", ns, old, "--wait=false")
        h.wait_for(
            "the replacement pod to hold both adapters",
            lambda: any(
                name != old and "first" in cluster.models(ip) and cluster.holds(ip, "second", sha)
                for name, ip in cluster.pod_ips(h, ns, 1).items()
            ),
            timeout=180,
        )
        assert op.proc is not None and op.proc.poll() is None
