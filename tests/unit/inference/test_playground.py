"""The playground page in headless Chromium (Debian's, driven by its chromedriver), against a live
server on the tiny pipeline: the page lists the adapters, stacks two at the scales a user sets,
and shows exactly the images the API returns for the same request; every control has a label."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import shutil
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.unit.inference.conftest import Assets, Server

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# Where the screenshot in the docs comes from: PLAYGROUND_SCREENSHOT=docs/images/playground.png
SCREENSHOT = os.environ.get("PLAYGROUND_SCREENSHOT")


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.fail("Debian's chromium and chromium-driver are missing: run `make install`")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1000,1150"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def pixels(src: str) -> np.ndarray:
    assert src.startswith("data:image/png;base64,"), src[:40]
    png = base64.b64decode(src.split(",", 1)[1])
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def drive(driver: webdriver.Chrome, url: str) -> dict[str, Any]:
    """What a user does: pick two adapters, set their scales and a seed, generate; what shows."""
    driver.get(url)
    wait = WebDriverWait(driver, 60)
    wait.until(lambda d: d.find_elements(By.ID, "use-b"))
    # Every control is labelled (a screen reader names it).
    unlabelled = driver.execute_script(
        "return [...document.querySelectorAll('input, textarea, select')]"
        ".filter(e => !e.labels || e.labels.length === 0).map(e => e.id)"
    )
    driver.find_element(By.ID, "prompt").clear()
    driver.find_element(By.ID, "prompt").send_keys("a lighthouse")
    for field, value in (("seed", "11"), ("steps", "2"), ("size", "32x32")):
        driver.find_element(By.ID, field).clear()
        driver.find_element(By.ID, field).send_keys(value)
    for name, scale in (("a", "0.75"), ("b", "-0.5")):
        driver.find_element(By.ID, f"use-{name}").click()
        # A slider is set the way its own keyboard and mouse handlers leave it.
        driver.execute_script(
            "const s = document.getElementById(arguments[0]); s.value = arguments[1];"
            "s.dispatchEvent(new Event('input'));",
            f"scale-{name}",
            scale,
        )
    driver.find_element(By.ID, "generate").click()
    wait.until(lambda d: d.find_element(By.ID, "status").text.startswith(("Done", "Generation")))
    if SCREENSHOT:
        driver.save_screenshot(SCREENSHOT)
    return {
        "status": driver.find_element(By.ID, "status").text,
        "base": driver.find_element(By.ID, "base-image").get_attribute("src"),
        "adapted": driver.find_element(By.ID, "adapter-image").get_attribute("src"),
        "caption": driver.find_element(By.ID, "adapter-caption").text,
        "scale_shown": driver.find_element(By.ID, "scale-b-value").text,
        "unlabelled": unlabelled,
    }


async def test_the_page_stacks_adapters_and_shows_what_the_api_draws(
    server: Server, assets: Assets, browser: webdriver.Chrome
) -> None:
    await server.load("a", assets.adapter_a)
    await server.load("b", assets.adapter_b)
    seen = await asyncio.to_thread(drive, browser, server.url("/"))
    assert seen["unlabelled"] == [], seen["unlabelled"]
    assert seen["status"].startswith("Done"), seen["status"]
    assert seen["scale_shown"] == "-0.50"
    assert "a at 0.75 + b at -0.50" in seen["caption"] and " ms)" in seen["caption"]
    request = {"prompt": "a lighthouse", "size": "32x32", "num_inference_steps": 2, "seed": 11}
    assert np.array_equal(pixels(seen["base"]), await server.image(**request))
    stacked = [{"name": "a", "scale": 0.75}, {"name": "b", "scale": -0.5}]
    assert np.array_equal(pixels(seen["adapted"]), await server.image(**request, lora=stacked))


async def test_the_page_is_served_with_a_strict_policy(server: Server) -> None:
    async with server.session.get(server.url("/")) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/html")
        assert "script-src 'unsafe-inline'" in resp.headers["Content-Security-Policy"]
        assert "<title>LoRA playground</title>" in await resp.text()
