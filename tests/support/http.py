"""HTTP from the test process: a free port on 127.0.0.1, a JSON call that returns errors instead of
raising them, one image generation from an inference server by its address, and the check of an
error answer's OpenAI-style body (`assert_error`)."""

from __future__ import annotations

import base64
import io
import json
import random
import socket
import urllib.error
import urllib.request
from typing import Any

import numpy as np
from PIL import Image

# Small and quick on the tiny model: what every generation of the tests asks for.
GENERATION = {"prompt": "a lighthouse", "size": "32x32", "num_inference_steps": 2, "seed": 7}


# Below the kernel's ephemeral range (32768 and up by default) and Kubernetes' NodePort range
# (30000-32767): a port the kernel hands out for an outgoing connection between our check and a
# server's bind would make that bind fail (a server binds 0.0.0.0, where any connection's local
# port counts).
_PORTS = range(20000, 30000)


def free_port() -> int:
    """A port nobody listens on at the moment (for a server to start on, or to be refused),
    outside the range the kernel picks outgoing connections' ports from."""
    for _ in range(200):
        port = random.choice(_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_PORTS.start}-{_PORTS.stop - 1}")


def http_json(
    url: str, body: object | None = None, token: str | None = None, *, timeout: float = 120
) -> tuple[int, Any]:
    """GET `url`, or POST `body` as JSON; the status and the answer, an HTTP error's included.
    The answer is decoded JSON when it is JSON, else text (the load endpoint answers vLLM's
    plain text). Connection errors raise (OSError)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, _decode(r.read())
    except urllib.error.HTTPError as e:
        return e.code, _decode(e.read())


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw or b"null")
    except ValueError:
        return raw.decode(errors="replace")


def generate(base_url: str, model: str | None, **extra: Any) -> np.ndarray:
    """One image (GENERATION) by model or adapter name (and `extra` fields, such as `lora`) from
    the server at `base_url`, as RGB pixels; fails unless it answers 200."""
    request = {**GENERATION, **extra} if model is None else {**GENERATION, "model": model, **extra}
    status, body = http_json(f"{base_url}/v1/images/generations", request)
    assert status == 200, body
    png = base64.b64decode(body["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def assert_error(
    status: int, body: Any, expected: int, *, param: str | None = "unset"
) -> dict[str, Any]:
    """The body is the API's error with status `expected` (and `param`, when given); returns it."""
    assert status == expected, body
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == expected and error["message"]
    if param != "unset":
        assert error["param"] == param
    return error
