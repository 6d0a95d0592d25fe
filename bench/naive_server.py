"""The baseline a cacheless service amounts to: load, generate, unload on every request.

Same HTTP shape as the real server's generation endpoint (enough of it for the benchmark), one
pipeline, one lock. Used only by bench_inference.py.
"""

from __future__ import annotations

import asyncio
import base64
import io
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from diffusers import DiffusionPipeline


def create_naive_app(model_dir: Path, adapter_root: Path, pipe: Any = None) -> web.Application:
    """`pipe`: an already built pipeline (full-size runs); else loaded from `model_dir`."""
    if pipe is None:
        pipe = DiffusionPipeline.from_pretrained(str(model_dir), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()
    lock = threading.Lock()
    base_id = model_dir.name

    def run(body: dict[str, Any]) -> bytes:
        with lock:
            name = body.get("model")
            if name and name != base_id:
                pipe.load_lora_weights(str(adapter_root / name), adapter_name=name)
                pipe.set_adapters([name], [1.0])
            try:
                width, height = (int(v) for v in body["size"].split("x"))
                with torch.inference_mode():
                    image = pipe(
                        body["prompt"],
                        generator=torch.Generator().manual_seed(body.get("seed", 0)),
                        num_inference_steps=body["num_inference_steps"],
                        width=width,
                        height=height,
                    ).images[0]
            finally:
                if name and name != base_id:
                    pipe.unload_lora_weights()
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return buffer.getvalue()

    # One worker thread, like the one lock it stands for: the benchmark reads the time other
    # processes took from the thread doing the work.
    worker = ThreadPoolExecutor(1, thread_name_prefix="naive")

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        png = await asyncio.get_running_loop().run_in_executor(worker, run, body)
        return web.json_response({"data": [{"b64_json": base64.b64encode(png).decode()}]})

    app = web.Application()
    app.router.add_post("/v1/images/generations", generate)
    return app
