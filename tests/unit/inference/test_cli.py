"""The `lora-inference` console script as a user runs it: real processes, real ports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.http import free_port, http_json

CLI = [sys.executable, "-m", "lora_inference.cli"]


def test_tiny_model_make_adapter_and_serve(tmp_path: Path) -> None:
    model = tmp_path / "model"
    adapters = tmp_path / "adapters"
    subprocess.run(
        [*CLI, "tiny-model", str(model), "--arch", "sd15"], check=True, capture_output=True
    )
    assert (model / "model_index.json").is_file()
    out = subprocess.run(
        [
            *CLI,
            "make-adapter",
            str(adapters / "a"),
            "--model",
            str(model),
            "--rank",
            "2",
            "--text-encoder",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    assert "rank-2 peft adapter" in out.stdout
    subprocess.run(
        [
            *CLI,
            "make-adapter",
            str(adapters / "k.safetensors"),
            "--model",
            str(model),
            "--format",
            "kohya",
        ],
        check=True,
        capture_output=True,
    )
    config = json.loads((adapters / "a" / "adapter_config.json").read_text())
    assert config["r"] == 2 and config["base_model_name_or_path"] == "model"

    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    port = free_port()
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        [
            *CLI,
            "serve",
            "--model",
            str(model),
            "--allowed-root",
            str(adapters),
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--device",
            "cpu",
            "--lora",
            f"static={adapters / 'k.safetensors'}",
            "--admin-token-file",
            str(token_file),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "LORA_ADMIN_TOKEN": "ignored-when-a-file-is-given"},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if http_json(f"{base}/ready", timeout=60)[0] == 200:
                    break
            except OSError:
                pass
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline, "server never became ready"
            time.sleep(0.2)
        load = {"lora_name": "a", "lora_path": str(adapters / "a")}
        assert http_json(f"{base}/v1/load_lora_adapter", load, timeout=60)[0] == 401
        assert http_json(f"{base}/v1/load_lora_adapter", load, "s3cret", timeout=60) == (
            200,
            "Success: LoRA adapter 'a' added successfully.",
        )
        status, body = http_json(
            f"{base}/v1/images/generations",
            {"model": "static", "prompt": "x", "size": "32x32", "num_inference_steps": 2, "n": 2},
            timeout=60,
        )
        assert status == 200 and len(body["data"]) == 2
        models = http_json(f"{base}/v1/models", timeout=60)[1]
        assert {m["id"] for m in models["data"]} == {"model", "static", "a"}
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--max-loras", "4", "--max-cpu-loras", "2"],
            "--max-cpu-loras (2) must be at least --max-loras (4)",
        ),
        (["--lora", "nonsense"], "--lora takes NAME=PATH"),
        (["--merge", "sometimes"], "argument --merge: invalid choice: 'sometimes'"),
    ],
)
def test_serve_refuses_bad_settings(tmp_path: Path, args: list[str], message: str) -> None:
    result = subprocess.run(
        [*CLI, "serve", "--model", str(tmp_path), *args], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert message in result.stderr


def test_serve_exits_when_the_model_cannot_load(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            *CLI,
            "serve",
            "--model",
            str(tmp_path / "missing"),
            "--no-admin-token",
            "--port",
            str(free_port()),
            "--host",
            "127.0.0.1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "startup failed" in result.stderr


def test_serve_reads_the_client_token_and_the_request_adapter_switch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lora_inference.cli import build_parser, config_from_args

    def config(*extra: str) -> Any:
        return config_from_args(build_parser().parse_args(["serve", "--model", "m", *extra]))

    monkeypatch.delenv("LORA_CLIENT_TOKEN", raising=False)
    assert config().client_token is None and config().allow_request_adapters
    assert not config("--no-allow-request-adapters").allow_request_adapters
    monkeypatch.setenv("LORA_CLIENT_TOKEN", "from-env")
    assert config().client_token == "from-env"
    token = tmp_path / "token"
    token.write_text("from-file\n")
    assert config("--client-token-file", str(token)).client_token == "from-file"
