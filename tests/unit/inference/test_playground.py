"""The playground page in headless Chromium (Debian's, driven by its chromedriver), against a live
server on the tiny pipeline: the page lists the adapters, stacks two at the scales a user sets,
and shows exactly the images the API returns for the same request; every control has a label.
On the demo's trained model, the same page shows an adapter's visible effect."""

from __future__ import annotations

import asyncio
import base64
import io
import os
from typing import Any

import numpy as np
from lora_inference.tools import shapes
from PIL import Image
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.support import ROOT
from tests.unit.inference.conftest import Assets, Server, serving

# Where the screenshot in the docs comes from: PLAYGROUND_SCREENSHOT=docs/images/playground.png
SCREENSHOT = os.environ.get("PLAYGROUND_SCREENSHOT")
SHAPES = ROOT / "models" / "shapes"  # the demo's trained model and adapters


def pixels(src: str) -> np.ndarray:
    assert src.startswith("data:image/png;base64,"), src[:40]
    png = base64.b64decode(src.split(",", 1)[1])
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def drive(
    driver: webdriver.Chrome,
    url: str,
    *,
    prompt: str,
    picks: tuple[tuple[str, str], ...],
    fields: tuple[tuple[str, str], ...],
    screenshot: str | None = None,
) -> dict[str, Any]:
    """What a user does: write a prompt, tick adapters and set their scales (`picks`), fill
    other `fields`, generate; what shows."""
    driver.get(url)
    wait = WebDriverWait(driver, 60)
    wait.until(lambda d: d.find_elements(By.ID, f"use-{picks[-1][0]}"))
    # Every control is labelled (a screen reader names it).
    unlabelled = driver.execute_script(
        "return [...document.querySelectorAll('input, textarea, select')]"
        ".filter(e => !e.labels || e.labels.length === 0).map(e => e.id)"
    )
    for field, value in (("prompt", prompt), *fields):
        driver.find_element(By.ID, field).clear()
        driver.find_element(By.ID, field).send_keys(value)
    for name, scale in picks:
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
    if screenshot:
        driver.save_screenshot(screenshot)
    return {
        "status": driver.find_element(By.ID, "status").text,
        "base": driver.find_element(By.ID, "base-image").get_attribute("src"),
        "adapted": driver.find_element(By.ID, "adapter-image").get_attribute("src"),
        "caption": driver.find_element(By.ID, "adapter-caption").text,
        "scale_shown": driver.find_element(By.ID, f"scale-{picks[-1][0]}-value").text,
        "unlabelled": unlabelled,
    }


async def test_the_page_stacks_adapters_and_shows_what_the_api_draws(
    server: Server, assets: Assets, browser: webdriver.Chrome
) -> None:
    await server.load("a", assets.adapter_a)
    await server.load("b", assets.adapter_b)
    seen = await asyncio.to_thread(
        drive,
        browser,
        server.url("/"),
        prompt="a lighthouse",
        picks=(("a", "0.75"), ("b", "-0.5")),
        fields=(("seed", "11"), ("steps", "2"), ("size", "32x32")),
    )
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


async def test_the_page_shows_what_the_demo_models_adapters_do(browser: webdriver.Chrome) -> None:
    """On the demo's trained model the page shows a visible effect (the docs' screenshot)."""
    adapters = SHAPES / shapes.ADAPTERS_DIR
    async with serving(SHAPES / shapes.MODEL_NAME, adapters) as server:
        for name in shapes.ADAPTERS:
            await server.load(name, adapters / name)
        seen = await asyncio.to_thread(
            drive,
            browser,
            server.url("/"),
            prompt="a red circle",
            picks=(("pixel-art", "1"), ("palette-swap", "0.6")),
            fields=(("seed", "5"),),
            screenshot=SCREENSHOT,
        )
        assert seen["status"].startswith("Done"), seen["status"]
        # The model's own size and the page's default steps.
        request = {"prompt": "a red circle", "num_inference_steps": 20, "seed": 5, "size": None}
        base = await server.image(**request)
        stacked = [{"name": "pixel-art", "scale": 1.0}, {"name": "palette-swap", "scale": 0.6}]
        adapted = await server.image(**request, lora=stacked)
    assert np.array_equal(pixels(seen["base"]), base)
    assert np.array_equal(pixels(seen["adapted"]), adapted)
    assert np.abs(adapted.astype(int) - base).mean() > 10, "the stack should visibly change it"
