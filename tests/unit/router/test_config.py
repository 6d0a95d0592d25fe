"""The router's command line (the client token file is checked at start, not at the first poll)
and the event loop it runs on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import uvloop
from lora_router.__main__ import new_event_loop
from lora_router.config import PodService, RouterConfig, parse_args


def test_defaults_poll_without_a_token() -> None:
    assert parse_args(["--namespace=ns"]) == RouterConfig(namespace="ns")


def test_the_client_token_file_is_kept_as_a_path(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    config = parse_args(["--namespace=ns", f"--client-token-file={token}"])
    assert config.client_token_file == token


@pytest.mark.parametrize("content", [None, "", " \n"], ids=["missing", "empty", "blank"])
def test_an_unusable_client_token_file_is_refused_at_start(
    tmp_path: Path, content: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    token = tmp_path / "token"
    if content is not None:
        token.write_text(content)
    with pytest.raises(SystemExit) as e:
        parse_args(["--namespace=ns", f"--client-token-file={token}"])
    assert e.value.code == 2
    assert "--client-token-file" in capsys.readouterr().err


def test_each_base_model_s_pods_are_named_by_their_service() -> None:
    config = parse_args(
        ["--namespace=ns", "--service=sdxl-base,sdxl=r-sdxl", "--service=sd15=r-sd15"]
    )
    assert config.services == (
        PodService("r-sdxl", frozenset({"sdxl-base", "sdxl"})),
        PodService("r-sd15", frozenset({"sd15"})),
    )
    assert parse_args(["--namespace=ns", "--service=pods"]).services == (PodService("pods"),)


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["--service==svc"], "MODEL[,MODEL...]=SERVICE"),
        (["--service=a,,b=svc"], "MODEL[,MODEL...]=SERVICE"),
        (["--service=m="], "MODEL[,MODEL...]=SERVICE"),
        (["--service=a=svc", "--service=b=svc"], "each Service once"),
        (["--service=a=svc", "--service=other"], "name the models each serves"),
    ],
    ids=["no-model", "empty-model", "no-service", "twice", "unsaid-model"],
)
def test_services_that_cannot_be_routed_by_model_are_refused_at_start(
    argv: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(["--namespace=ns", *argv])
    assert e.value.code == 2
    assert reason in capsys.readouterr().err


def test_the_router_runs_on_uvloops_event_loop() -> None:
    """`python -m lora_router` and the hop benchmark take the loop from `new_event_loop`."""
    loop = new_event_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
        assert loop.run_until_complete(asyncio.sleep(0, result="ran")) == "ran"
    finally:
        loop.close()
