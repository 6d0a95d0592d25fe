"""The inference-only demo (`make demo`): a tiny model, two adapters, a real server, three images.

Builds everything offline in a work directory, starts `lora-inference serve` as a separate
process, loads two adapters through the admin API, generates the same prompt and seed with the
base model and each adapter by adapter name, writes the images and a side-by-side sheet to the
output directory and prints a summary with timings. The server is stopped on exit, whatever
happens.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image

from lora_inference.tools.sheet import contact_sheet

PROMPT = "a lighthouse on a cliff at dusk"
SIZE = 64
UPSCALE = 4


def _step(message: str) -> None:
    print(f"==> {message}", flush=True)


def _run(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "lora_inference.cli", *args], check=True, capture_output=True
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _request(url: str, body: object | None = None, token: str | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method="POST" if data else "GET")
    request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=300) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _wait_ready(base: str, server: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited early; its log:\n{log.read_text()}")
        try:
            if _request(f"{base}/ready")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("the server did not become ready within 180 s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("demo-out"))
    parser.add_argument("--arch", default="sd15", choices=("sd15", "sdxl", "sd3", "flux"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="lora-demo-") as scratch:
        work = Path(scratch)
        started = time.perf_counter()
        _step(f"building a tiny {args.arch} pipeline offline")
        _run("tiny-model", str(work / "model"), "--arch", args.arch)
        _step("writing two random adapters (pixel-art: UNet only; watercolor: UNet + text encoder)")
        # Strong random weights, so the difference shows even on a random tiny model.
        common = ["--model", str(work / "model"), "--rank", "8", "--strength", "0.8"]
        _run("make-adapter", str(work / "adapters" / "pixel-art"), *common, "--seed", "1")
        watercolor = str(work / "adapters" / "watercolor")
        _run("make-adapter", watercolor, *common, "--seed", "2", "--text-encoder")
        timings["build model and adapters"] = time.perf_counter() - started

        token = "demo-admin-token"
        (work / "token").write_text(token)
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        log = work / "server.log"
        _step(f"starting lora-inference serve on {base}")
        started = time.perf_counter()
        with log.open("w") as log_file:
            server = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "lora_inference.cli",
                    "serve",
                    "--model",
                    str(work / "model"),
                    "--adapter-root",
                    str(work / "adapters"),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--admin-token-file",
                    str(work / "token"),
                    "--max-loras",
                    "1",
                    "--device",
                    "cpu",
                ],
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        try:
            _wait_ready(base, server, log)
            timings["server ready"] = time.perf_counter() - started
            for name in ("pixel-art", "watercolor"):
                started = time.perf_counter()
                status, body = _request(
                    f"{base}/v1/load_lora_adapter",
                    {"lora_name": name, "lora_path": str(work / "adapters" / name)},
                    token=token,
                )
                if status != 200:
                    raise SystemExit(f"loading {name} failed ({status}): {body.decode()}")
                timings[f"load {name}"] = time.perf_counter() - started
                _step(body.decode())
            images: list[tuple[str, Image.Image]] = []
            for model in ("model", "pixel-art", "watercolor"):
                label = "base" if model == "model" else model
                started = time.perf_counter()
                status, body = _request(
                    f"{base}/v1/images/generations",
                    {
                        "model": model,
                        "prompt": PROMPT,
                        "size": f"{SIZE}x{SIZE}",
                        "seed": 42,
                        "num_inference_steps": 10,
                    },
                )
                if status != 200:
                    raise SystemExit(f"generation with {label} failed ({status}): {body.decode()}")
                timings[f"generate {label}"] = time.perf_counter() - started
                image = Image.open(
                    io.BytesIO(base64.b64decode(json.loads(body)["data"][0]["b64_json"]))
                )
                image.save(args.out / f"{label}.png")
                images.append((label, image.convert("RGB")))
                _step(f"generated {label} -> {args.out / (label + '.png')}")
            contact_sheet(
                [label for label, _ in images], [("", [img for _, img in images])], SIZE * UPSCALE
            ).save(args.out / "side-by-side.png")
            adapters = json.loads(_request(f"{base}/v1/adapters")[1])["data"]
        finally:
            server.terminate()
            server.wait(timeout=30)
    differ = len({img.tobytes() for _, img in images}) == len(images)
    pixels = [np.asarray(img, dtype=np.int16) for _, img in images]
    print("\nSummary")
    for step, seconds in timings.items():
        print(f"  {step:<28} {seconds:6.2f} s")
    for adapter in adapters:
        print(
            f"  adapter {adapter['id']:<12} tier={adapter['tier']:<4} hits={adapter['hits']} "
            f"sha256={adapter['sha256'][:12]}"
        )
    for (label, _), array in zip(images[1:], pixels[1:], strict=True):
        print(f"  {label:<12} mean |pixel - base| = {np.abs(array - pixels[0]).mean():.1f} / 255")
    print(f"  three images differ from each other: {differ}")
    print(f"  pictures: {args.out}/base.png, pixel-art.png, watercolor.png, side-by-side.png")
    return 0 if differ else 1


if __name__ == "__main__":
    sys.exit(main())
