"""The demo (`make demo`): the chart, the operator, three trained adapters and a composition.

`python -m lora_demo --out demo-out` starts a cluster in a temporary directory with an OCI registry
on its node (the registry's storage under the cache, so a push sends only what changed since the
last demo), pushes the images and the packaged chart to it as `make push` and `make chart-push` do,
copies the demo's small trained SD 1.5-family model (coloured shapes on paper) onto a claim with a
Job of the inference image, `helm install`s the chart from the registry (the release's images pulled
from it by the node), copies its three trained adapters (pixel-art, palette-swap, shape-shift) onto
the chart's adapter volume, applies examples/adapter.yaml, the two other adapters and a composition
of two (spec.compose), waits until all four are Ready on every inference pod, generates a few
prompts with the base model and each adapter by name through the Service, writes the images and a
side-by-side sheet, generates once more from a pod inside the cluster by the Service's DNS name,
SIGKILLs an inference container and times the adapters' return, prints a summary and tears
everything down, also on a failure, Ctrl-C or SIGTERM.

Owns: the demo's steps and what it prints. The cluster steps it shares with the end-to-end suite
are in `release`; what it applies is in `manifests`.
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

import yaml
from lora_devcluster import cluster as cluster_mod
from lora_devcluster import images, registry
from lora_devcluster.harness import ApiError, Harness
from lora_inference.tools.sheet import contact_sheet
from PIL import Image

from lora_demo import manifests, release
from lora_demo.manifests import (
    DEMO_ADAPTERS,
    DEMO_COMPOSITION,
    DEMO_MODEL,
    DEMO_PROMPTS,
    RELEASE,
    SERVICE,
)

EXAMPLE_ADAPTER = release.ROOT / "examples" / "adapter.yaml"
PUSHED_TO = f"{registry.ADDRESS}/lora-operator"  # the REGISTRY of `make push`
NAMESPACE = "lora-demo"
SIZE = 32  # the demo model's own size
STEPS = 20


class Progress:
    def __init__(self) -> None:
        self.start = time.monotonic()
        self.timings: list[tuple[str, float]] = []

    def step(self, message: str) -> None:
        print(f"[{time.monotonic() - self.start:6.1f} s] {message}", flush=True)

    def timed(self, label: str, since: float) -> float:
        seconds = time.monotonic() - since
        self.timings.append((label, seconds))
        return seconds


def _raise_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def push_to_registry(h: Harness, work: Path) -> tuple[str, str]:
    """What `make push` and `make chart-push` do, to the cluster's registry: the images (as
    built for this tree; their layers uncompressed: gzip would cost minutes on one machine) and
    the packaged chart. Returns the chart's `oci://` reference and version."""
    images.push(PUSHED_TO, images.built(images.PUSHED_IMAGES), plain_http=True, compress=False)
    version = yaml.safe_load((release.CHART / "Chart.yaml").read_text())["version"]
    h.run(["helm", "package", str(release.CHART), "-d", str(work)])
    packaged = work / f"lora-operator-{version}.tgz"
    h.run(["helm", "push", str(packaged), f"oci://{PUSHED_TO}", "--plain-http"])
    return f"oci://{PUSHED_TO}/lora-operator", str(version)


def run_demo(out: Path, work: Path, p: Progress, replicas: int) -> int:
    ns = NAMESPACE
    adapters = [*(a.name for a in DEMO_ADAPTERS), DEMO_COMPOSITION[0]]
    p.step(
        "starting the local cluster (control plane, containerd, kubelet, kube-proxy, CoreDNS) "
        "and its registry"
    )
    t = time.monotonic()
    # The registry keeps what is pushed under the cache: a push sends only the changed layers.
    os.environ.setdefault(registry.STORAGE_ENV, str(registry.cached_storage()))
    with cluster_mod.joined(work / "cluster", progress=lambda m: None, with_registry=True) as c:
        h = Harness(c)
        try:
            p.step(f"cluster up in {p.timed('cluster up', t):.1f} s")
            t = time.monotonic()
            p.step(f"make push and make chart-push to the cluster's registry ({PUSHED_TO})")
            chart, version = push_to_registry(h, work)
            p.step(f"pushed in {p.timed('push', t):.1f} s")
            h.create(
                "/api/v1/namespaces",
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
            )
            t = time.monotonic()
            p.step(
                f"a Job of the inference image copies the demo's model ({DEMO_MODEL}) to a claim"
            )
            release.prepare_model(h, ns, DEMO_MODEL)
            p.step(f"model written in {p.timed('model', t):.1f} s")

            t = time.monotonic()
            p.step(f"helm install {RELEASE} {chart} -n {ns} ({replicas} replicas)")
            release.install_crd(h)
            values = manifests.local_values(ns, replicas=replicas, model=DEMO_MODEL)
            for role in images.PUSHED_IMAGES:  # the release's images come from the registry
                values[role]["image"] = {"repository": f"{PUSHED_TO}/{role}"}
            flags = ("--version", version, "--plain-http")
            release.install_chart(h, ns, values, work, chart=chart, flags=flags)
            p.step("a Job copies the three trained adapters onto the chart's adapter volume")
            release.prepare_adapters(h, ns, DEMO_ADAPTERS, "prepare-adapters")
            pods = release.ready_inference_pods(h, ns, replicas)
            p.step(f"inference pods ready in {p.timed('helm install -> pods ready', t):.1f} s")
            pulled = {
                cs["imageID"]
                for pod in pods
                for cs in pod["status"]["containerStatuses"]
                if cs["name"] == "inference"
            }
            if not all(i.startswith(f"{PUSHED_TO}/inference@") for i in pulled):
                raise RuntimeError(f"the inference pods did not run the pushed image: {pulled}")
            p.step(f"the pods run the image the node pulled from the registry: {pulled.pop()}")

            t = time.monotonic()
            p.step(
                "kubectl apply -f examples/adapter.yaml (pixel-art), the two other adapters and "
                f"{DEMO_COMPOSITION[0]}, which stacks two of them"
            )
            h.kubectl("apply", "-n", ns, "-f", str(EXAMPLE_ADAPTER))
            for source in DEMO_ADAPTERS[1:]:
                h.apply(manifests.adapter(source, scale=1.0), ns)
            h.apply(manifests.composition(*DEMO_COMPOSITION, DEMO_MODEL), ns)
            for name in adapters:
                release.wait_adapter_ready(h, ns, name, f"{replicas}/{replicas}")
            p.step(
                f"all {len(adapters)} Ready on every pod in {p.timed('apply -> Ready', t):.1f} s"
            )
            print(h.kubectl("get", "lora", "-n", ns), end="", flush=True)

            columns = ["base", *adapters]
            rows: list[tuple[str, list[Image.Image]]] = []
            t = time.monotonic()
            for prompt in DEMO_PROMPTS:
                row = []
                for model, label in zip([DEMO_MODEL, *adapters], columns, strict=True):
                    png = release.generate(
                        h, ns, release.service_target(), model,
                        size=SIZE, steps=STEPS, prompt=prompt,
                    )  # fmt: skip
                    (out / f"{label}-{prompt.replace(' ', '-')}.png").write_bytes(png)
                    row.append(Image.open(io.BytesIO(png)).convert("RGB"))
                rows.append((prompt, row))
            seconds = p.timed("generate", t)
            p.step(
                f"POST svc/{SERVICE}/v1/images/generations: {len(DEMO_PROMPTS)} prompts x "
                f"{len(columns)} models -> {out}/ ({seconds:.1f} s)"
            )
            contact_sheet(columns, rows).save(out / "side-by-side.png")

            t = time.monotonic()
            url = manifests.service_url(ns, "/v1/images/generations")
            summary = release.generate_in_cluster(h, ns, "in-cluster-client", adapters[0])
            seconds = p.timed("generate from a pod by DNS name", t)
            p.step(f"a pod POSTed to {url}: {summary} ({seconds:.1f} s)")

            victim = pods[0]["metadata"]["name"]
            p.step(f"SIGKILL the inference container of {victim}")
            t = time.monotonic()
            h.kill_container(ns, victim, "inference")

            def reloaded() -> bool:
                pod = h.get(f"/api/v1/namespaces/{ns}/pods/{victim}")
                restarted = any(
                    cs["restartCount"] >= 1 for cs in pod["status"]["containerStatuses"]
                )
                return restarted and set(adapters) <= set(release.served_adapters(h, ns, victim))

            h.wait_for("the restarted container to get its adapters back", reloaded, timeout=180)
            seconds = p.timed("SIGKILL -> adapters back", t)
            p.step(f"restarted and all {len(adapters)} adapters loaded again in {seconds:.1f} s")

            t = time.monotonic()
            p.step("tearing down: delete the adapters, helm uninstall, stop the cluster")
            h.kubectl("delete", "lora", "--all", "-n", ns, "--timeout=60s")
            h.run(["helm", "uninstall", RELEASE, "-n", ns, "--wait", "--timeout", "60s"])
        except BaseException:
            print(h.describe_pods(ns), file=sys.stderr)
            print(h.container_logs(ns)[-6000:], file=sys.stderr)
            raise
    p.timed("teardown", t)
    left = cluster_mod.leftovers(work / "cluster")
    p.step("cluster stopped; " + (f"LEFT BEHIND: {left}" if left else "nothing left behind"))

    # Each adapter must change each prompt's picture: the demo fails if one draws the base.
    differ = all(len({img.tobytes() for img in row}) == len(row) for _, row in rows)
    print("\nSummary")
    for label, seconds in p.timings:
        print(f"  {label:<32} {seconds:6.1f} s")
    print(f"  {'total':<32} {time.monotonic() - p.start:6.1f} s")
    print(f"  for each prompt, the {len(columns)} pictures differ from each other: {differ}")
    print(f"  pictures: {out}/side-by-side.png and one PNG per model and prompt")
    return 0 if differ and not left else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("demo-out"))
    parser.add_argument("--replicas", type=int, default=2, help="inference replicas")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    # The example must be the demo's first adapter, as the README says.
    example = yaml.safe_load(EXAMPLE_ADAPTER.read_text())
    if example["spec"]["source"]["uri"] != DEMO_ADAPTERS[0].uri:
        print(f"{EXAMPLE_ADAPTER} no longer reads {DEMO_ADAPTERS[0].uri}", file=sys.stderr)
        return 1
    p = Progress()
    with tempfile.TemporaryDirectory(prefix="lora-demo-") as scratch:
        try:
            return run_demo(args.out.resolve(), Path(scratch), p, args.replicas)
        except (cluster_mod.ClusterError, AssertionError, RuntimeError, ApiError) as e:
            print(f"\ndemo failed after {time.monotonic() - p.start:.0f} s: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\ninterrupted; the cluster was torn down", file=sys.stderr)
            return 130


if __name__ == "__main__":
    sys.exit(main())
