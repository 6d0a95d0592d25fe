"""Over HTTP: a LyCORIS file loads and its format, rank, targets and trigger words are listed
(`/v1/adapters`, `/v1/models`) and shown in the playground; a refused format is a 422 that
names it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline
from lora_volume import files
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.support.formats import sd_loha, write
from tests.unit.inference.conftest import Assets, Server

TAGS = {"10_lighthouse": {"lighthouse": 5, "cliff": 3, "glowing": 2}, "5_more": {"cliff": 1}}
METADATA = {"modelspec.trigger_phrase": "lhstyle, glowing", "ss_tag_frequency": json.dumps(TAGS)}
WORDS = ["lhstyle", "glowing", "lighthouse", "cliff"]  # the phrase, then tags by count (5, 3 + 1)


def _loha_file(assets: Assets, directory: str) -> Path:
    pipe = DiffusionPipeline.from_pretrained(str(assets.model))
    made = sd_loha(pipe)
    return write(assets.root / directory / "loha.safetensors", made.tensors, METADATA)


def test_trigger_words_come_from_the_phrase_then_the_most_frequent_tags(tmp_path: Path) -> None:
    path = write(tmp_path / "t.safetensors", {"x.lora_A.weight": torch.ones(1)}, METADATA)
    data = path.read_bytes()
    header = files.parse_safetensors_header(data, len(data))
    assert files.trigger_words(header) == tuple(WORDS)
    assert files.trigger_words(header, most=2) == ("lhstyle", "glowing")
    broken = files.SafetensorsHeader({}, {"ss_tag_frequency": "{not json"})
    assert files.trigger_words(broken) == ()


async def test_a_loha_file_is_listed_with_its_format_rank_and_trigger_words(
    server: Server, assets: Assets
) -> None:
    path = _loha_file(assets, "http-loha")
    await server.load("loha", path)
    status, listed = await server.get("/v1/adapters")
    assert status == 200
    (card,) = [c for c in listed["data"] if c["id"] == "loha"]
    # LoHa rank 3 x 3 is served at rank 9, its exact rank.
    assert (card["format"], card["rank"]) == ("loha", 9)
    assert card["targets"] == ["text_encoder", "unet"]
    assert card["trigger_words"] == WORDS
    status, models = await server.get("/v1/models")
    (model_card,) = [c for c in models["data"] if c["id"] == "loha"]
    assert model_card["trigger_words"] == WORDS and model_card["format"] == "loha"


@pytest.mark.parametrize(
    ("tensor", "label"),
    [("lora_unet_x.a1.weight", "GLoRA"), ("lora_unet_x.oft_blocks", "OFT")],
)
async def test_a_refused_format_is_a_422_naming_it(
    server: Server, assets: Assets, tensor: str, label: str
) -> None:
    path = assets.root / "http-refused" / f"{label.split()[0]}.safetensors"
    write(path, {"lora_unet_x.lora_down.weight": torch.ones(2, 4), tensor: torch.ones(4)})
    status, body = await server.post(
        "/v1/load_lora_adapter", {"lora_name": "refused", "lora_path": str(path)}
    )
    assert status == 422, body
    assert label in body["error"]["message"]


async def test_the_playground_shows_trigger_words_and_adds_one_to_the_prompt(
    server: Server, assets: Assets, browser: webdriver.Chrome
) -> None:
    await server.load("loha", _loha_file(assets, "http-playground"))

    def look() -> tuple[str, list[str], str]:
        browser.get(server.url("/"))
        WebDriverWait(browser, 60).until(lambda d: d.find_elements(By.ID, "about-loha"))
        about = browser.find_element(By.ID, "about-loha")
        buttons = about.find_elements(By.CSS_SELECTOR, "button.trigger")
        buttons[0].click()
        prompt = browser.find_element(By.ID, "prompt").get_attribute("value") or ""
        return about.text, [b.text for b in buttons], prompt

    text, words, prompt = await asyncio.to_thread(look)
    assert "loha" in text and "rank 9" in text
    assert words == WORDS
    assert prompt.endswith(", lhstyle")
