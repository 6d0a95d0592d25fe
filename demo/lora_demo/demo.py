"""The demo (`make demo`): the chart, the operator, two adapters and a composition of them.

`python -m lora_demo --out demo-out` starts a cluster in a temporary directory (the project's
images imported into its node), writes a tiny SD 1.5 model onto a claim with a Job of the
inference image, `helm install`s charts/lora-operator, writes two random adapter sources onto the
chart's adapter volume, applies examples/adapter.yaml, a second adapter and a composition of the
two (spec.compose), waits until all three are Ready on every inference pod, generates base /
pixel-art / watercolor / pixel-watercolor images by adapter name through the Service, writes them
and a side-by-side sheet, generates once more from a pod inside the cluster by the Service's DNS
name, SIGKILLs an inference container and times the adapters' return, prints a summary and tears
everything down, also on a failure, Ctrl-C or SIGTERM.

Owns: the demo's steps and what it prints. The cluster steps it shares with the end-to-end suite
are in `release`; what it applies is in `manifests`.
"""

from __future__ import annotations

import argparse
import io
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

import yaml
from lora_devcluster import cluster as cluster_mod
from lora_devcluster.harness import ApiError, Harness
from PIL import Image, ImageDraw

from lora_demo import manifests, release
from lora_demo.manifests import DEMO_ADAPTERS, DEMO_COMPOSITION, MODEL_NAME, RELEASE, SERVICE

EXAMPLE_ADAPTER = release.ROOT / "examples" / "adapter.yaml"
NAMESPACE = "lora-demo"
SIZE = 64


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


def side_by_side(images: list[tuple[str, Image.Image]], scale: int = 4) -> Image.Image:
    """The images next to each other, enlarged without smoothing, each under its label."""
    side = SIZE * scale
    sheet = Image.new("RGB", (side * len(images), side + 24), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (label, image) in enumerate(images):
        sheet.paste(image.resize((side, side), Image.Resampling.NEAREST), (i * side, 24))
        draw.text((i * side + 8, 6), label, fill="black")
    return sheet


def _raise_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_demo(out: Path, work: Path, p: Progress, replicas: int) -> int:
    ns = NAMESPACE
    adapters = [*(a.name for a in DEMO_ADAPTERS), DEMO_COMPOSITION[0]]
    p.step("starting the local cluster (control plane, containerd, kubelet, kube-proxy, CoreDNS)")
    t = time.monotonic()
    with cluster_mod.joined(work / "cluster", progress=lambda m: None) as c:
        h = Harness(c)
        try:
            p.step(f"cluster up in {p.timed('cluster up', t):.1f} s")
            h.create(
                "/api/v1/namespaces",
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
            )
            t = time.monotonic()
            p.step("a Job of the inference image writes a tiny SD 1.5 model onto a claim")
            release.prepare_model(h, ns)
            p.step(f"model written in {p.timed('model', t):.1f} s")

            t = time.monotonic()
            p.step(f"helm install {RELEASE} charts/lora-operator -n {ns} ({replicas} replicas)")
            release.install_crd(h)
            release.install_chart(h, ns, manifests.local_values(ns, replicas=replicas), work)
            p.step("a Job writes two random adapter sources onto the chart's adapter volume")
            release.prepare_adapters(h, ns, DEMO_ADAPTERS, "prepare-adapters")
            pods = release.ready_inference_pods(h, ns, replicas)
            p.step(f"inference pods ready in {p.timed('helm install -> pods ready', t):.1f} s")

            t = time.monotonic()
            p.step(
                "kubectl apply -f examples/adapter.yaml (pixel-art), a second adapter and "
                f"{DEMO_COMPOSITION[0]}, which stacks the two"
            )
            h.kubectl("apply", "-n", ns, "-f", str(EXAMPLE_ADAPTER))
            h.apply(manifests.adapter(DEMO_ADAPTERS[1], scale=1.0), ns)
            h.apply(manifests.composition(*DEMO_COMPOSITION), ns)
            for name in adapters:
                release.wait_adapter_ready(h, ns, name, f"{replicas}/{replicas}")
            p.step(f"all three Ready on every pod in {p.timed('apply -> Ready', t):.1f} s")
            print(h.kubectl("get", "lora", "-n", ns), end="", flush=True)

            images: list[tuple[str, Image.Image]] = []
            for model, label in ((MODEL_NAME, "base"), *((name, name) for name in adapters)):
                t = time.monotonic()
                png = release.generate(h, ns, release.service_target(), model, size=SIZE)
                (out / f"{label}.png").write_bytes(png)
                images.append((label, Image.open(io.BytesIO(png)).convert("RGB")))
                seconds = p.timed(f"generate {label}", t)
                p.step(
                    f"POST svc/{SERVICE}/v1/images/generations model={model}"
                    f" -> {out}/{label}.png ({seconds:.1f} s)"
                )
            side_by_side(images).save(out / "side-by-side.png")

            t = time.monotonic()
            url = manifests.service_url(ns, "/v1/images/generations")
            summary = release.generate_in_cluster(h, ns, "in-cluster-client", "pixel-art")
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
            p.step(f"restarted and all three adapters loaded again in {seconds:.1f} s")

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

    arrays = [img.tobytes() for _, img in images]
    differ = len(set(arrays)) == len(arrays)
    print("\nSummary")
    for label, seconds in p.timings:
        print(f"  {label:<32} {seconds:6.1f} s")
    print(f"  {'total':<32} {time.monotonic() - p.start:6.1f} s")
    print(f"  {len(arrays)} images differ from each other: {differ}")
    pictures = ", ".join(f"{label}.png" for label, _ in images)
    print(f"  pictures: {out}/{pictures}, side-by-side.png")
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
