"""The chat playground at ``GET /`` (services/gateway/playground.py, static/playground.html).

1. On the fake stack: the page is served without authentication even when API keys are on (the
   API behind it still wants one), it is self-contained (no outside URL), and its
   Content-Security-Policy pins exactly its inline script and style.
2. In headless Chromium (selenium) against ``tandem up`` with the default model and auth on:
   without the key the model list is refused; with it the models load, a prompt's reply streams
   in and shows its token counts, TTFT and tokens per second; Stop really cancels: the reply
   stops growing, the gateway counts an aborted request, and the decode worker's KV blocks in
   use (from ``/ready``) return to 0. A screenshot goes to the test's tmp dir, and to
   docs/img/playground.png with ``TANDEM_UPDATE_SCREENSHOTS=1``. Skipped, saying why, only
   where Chromium or chromedriver cannot be found (scripts/install_browser.sh installs both).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

from tests.gateway_fakes import StackFactory
from tests.ports import free_ports
from tests.up_process import StartUp, port_flags

REPO = Path(__file__).resolve().parents[1]
SCREENSHOT = REPO / "docs" / "img" / "playground.png"
API_KEY = "sk-playground-test-0123456789"
MODEL = "SmolLM2-135M-Instruct"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


# --- the page as served ------------------------------------------------------------------------


async def test_page_is_served_without_auth_and_self_contained(make_stack: StackFactory) -> None:
    stack = await make_stack(keys=(API_KEY,))
    async with aiohttp.ClientSession() as session:
        async with session.get(stack.url + "/") as response:
            assert response.status == 200
            assert response.headers["Content-Type"] == "text/html; charset=utf-8"
            policy = response.headers["Content-Security-Policy"]
            page = await response.text()
        async with session.get(stack.url + "/v1/models") as response:
            assert response.status == 401  # the API behind the page still needs the key
    assert "<title>Tandem playground</title>" in page
    assert not re.search(r"https?://", page), "the page must not load anything from elsewhere"
    directives = dict(d.strip().split(" ", 1) for d in policy.split(";"))
    assert directives["default-src"] == "'none'" and directives["connect-src"] == "'self'"
    for tag in ("script", "style"):
        (inline,) = re.findall(rf"<{tag}>(.*?)</{tag}>", page, re.DOTALL)
        digest = base64.b64encode(hashlib.sha256(inline.encode()).digest()).decode()
        assert directives[f"{tag}-src"] == f"'sha256-{digest}'"
    for needed in ('id="api-key"', 'id="model"', 'id="system"', 'id="temperature"',
                   'id="top-p"', 'id="max-tokens"', 'id="stop"', "include_usage"):  # fmt: skip
        assert needed in page, needed


# --- in a real browser against the real stack --------------------------------------------------


def _find_browser() -> tuple[str, str] | str:
    """(chromium binary, chromedriver) or why not."""
    binary = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        missing = " and ".join(
            what for what, path in (("Chromium", binary), ("chromedriver", driver)) if path is None
        )
        return (f"{missing} not found (Debian: apt-get install chromium chromium-driver, "
                "or scripts/install_browser.sh)")  # fmt: skip
    return binary, driver


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    found = _find_browser()
    if isinstance(found, str):
        pytest.skip(found)
    binary, driver_path = found
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1100,900", "--lang=en-US"):  # fmt: skip
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    # A fixed viewport (the window size includes the browser's own bars), light theme, 1x.
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": 1100, "height": 600, "deviceScaleFactor": 1, "mobile": False})
    driver.execute_cdp_cmd("Emulation.setEmulatedMedia",
                           {"features": [{"name": "prefers-color-scheme", "value": "light"}]})
    try:
        yield driver
    finally:
        driver.quit()


def _until(driver: webdriver.Chrome, what: str, check: Callable[[], Any], timeout: float) -> Any:
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(
        lambda _: check(), message=f"timed out after {timeout:g}s waiting for {what}"
    )


def _ready(gateway: str) -> dict[str, Any]:
    """``/ready``'s details: with API keys on, only an authenticated caller sees them."""
    request = urllib.request.Request(gateway + "/ready",
                                     headers={"Authorization": f"Bearer {API_KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as err:  # 503 still carries the JSON
        return json.loads(err.read())


def _metric(metrics_url: str, sample: str) -> float:
    """``sample``'s value on the gateway's own metrics port (``metrics_url``)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(sample + " "))  # fmt: skip


def _fill(element: WebElement, value: str) -> None:
    element.clear()
    element.send_keys(value)


def _last_reply(driver: webdriver.Chrome) -> WebElement:
    return driver.find_elements(By.CSS_SELECTOR, "#log li.assistant")[-1]


@pytest.mark.slow
def test_chat_streams_and_stop_cancels_in_chromium(
    browser: webdriver.Chrome, start_up: StartUp, tmp_path: Path
) -> None:
    driver = browser
    up = start_up(
        "--prefill", "1", "--decode", "1", *port_flags(1, 1),
        "--gateway-port", str(free_ports(1)[0]),
        env={**os.environ, "TANDEM_API_KEYS": API_KEY}, gateway=True,
    )  # fmt: skip
    up.wait_ready()
    gateway = up.rows["gateway"][0]
    driver.get(gateway + "/")

    # Auth is on: the page loads, but listing models needs the key typed into it.
    hint = driver.find_element(By.ID, "model-hint")
    _until(driver, "the 401", lambda: "Could not list models" in hint.text, 20)
    assert "API key" in hint.text
    driver.find_element(By.ID, "api-key").send_keys(API_KEY, Keys.TAB)  # change -> reload
    model = driver.find_element(By.ID, "model")
    _until(driver, "the model list", lambda: model.get_attribute("value") == MODEL, 20)
    assert "Context window" in hint.text

    # A prompt (sent with Enter) streams a reply, then shows usage, TTFT and tokens/s.
    _fill(driver.find_element(By.ID, "system"), "You are a concise assistant.")
    _fill(driver.find_element(By.ID, "temperature"), "0")
    _fill(driver.find_element(By.ID, "max-tokens"), "48")
    driver.find_element(By.ID, "prompt").send_keys("What is the capital of France?", Keys.ENTER)
    reply = _until(driver, "a reply", lambda: driver.find_elements(By.CSS_SELECTOR,
                   "#log li.assistant"), 10)[-1]  # fmt: skip
    _until(driver, "the reply to finish",
           lambda: reply.get_attribute("data-state") != "streaming", 120)  # fmt: skip
    assert reply.get_attribute("data-state") == "done", reply.text
    text = reply.find_element(By.CSS_SELECTOR, ".text").text
    assert text.strip(), "empty reply"
    assert int(reply.get_attribute("data-chunks") or 0) > 1, "the reply did not stream"
    stats = reply.find_element(By.CSS_SELECTOR, ".stats").text
    assert re.search(r"\d+ prompt \+ \d+ completion tokens", stats), stats
    assert re.search(r"TTFT \d+ ms", stats) and re.search(r"[\d.]+ tokens/s", stats), stats
    driver.execute_script("document.activeElement.blur()")
    png = driver.get_screenshot_as_png()
    assert png.startswith(b"\x89PNG")
    (tmp_path / "playground.png").write_bytes(png)
    if os.environ.get("TANDEM_UPDATE_SCREENSHOTS"):
        SCREENSHOT.write_bytes(png)

    # JSON mode: the reply is one JSON object (response_format json_object).
    driver.find_element(By.ID, "json-mode").click()
    driver.find_element(By.ID, "prompt").send_keys("Describe Paris as JSON.", Keys.ENTER)
    _until(driver, "the JSON reply", lambda: len(driver.find_elements(
        By.CSS_SELECTOR, "#log li.assistant")) == 2, 10)  # fmt: skip
    reply = _last_reply(driver)
    _until(driver, "the JSON reply to finish",
           lambda: reply.get_attribute("data-state") != "streaming", 120)  # fmt: skip
    assert isinstance(json.loads(reply.find_element(By.CSS_SELECTOR, ".text").text), dict)
    driver.find_element(By.ID, "json-mode").click()

    # Stop: a long reply is cancelled mid-stream; the worker frees its KV blocks at once.
    aborted_before = _metric(up.metrics_urls["gateway"],
                             'tandem:request_success_total{finished_reason="abort"}')
    _fill(driver.find_element(By.ID, "max-tokens"), "1024")
    driver.find_element(By.ID, "prompt").send_keys(
        "Write a very long story about a dragon who learns to fly, in ten chapters."
    )
    driver.find_element(By.ID, "send").click()
    _until(driver, "the second reply", lambda: len(driver.find_elements(
        By.CSS_SELECTOR, "#log li.assistant")) == 3, 10)  # fmt: skip
    reply = _last_reply(driver)
    _until(driver, "a few streamed chunks",
           lambda: int(reply.get_attribute("data-chunks") or 0) >= 3, 120)  # fmt: skip

    def decode_holds_blocks() -> bool:
        assert reply.get_attribute("data-state") == "streaming", "the reply ended before Stop"
        return any(w.get("kv_blocks_in_use", 0) > 0 for w in _ready(gateway)["decode"])

    _until(driver, "the decode worker to report KV blocks in use", decode_holds_blocks, 30)
    stop = driver.find_element(By.ID, "stop")
    assert stop.is_enabled()
    stop.click()
    _until(driver, "the reply to stop",
           lambda: reply.get_attribute("data-state") == "stopped", 10)  # fmt: skip
    shown = reply.find_element(By.CSS_SELECTOR, ".text").text
    time.sleep(2.0)
    assert reply.find_element(By.CSS_SELECTOR, ".text").text == shown, "still growing after Stop"
    assert int(reply.get_attribute("data-chunks")) < 1024
    assert "finish: stopped" in reply.find_element(By.CSS_SELECTOR, ".stats").text
    assert not stop.is_enabled() and driver.find_element(By.ID, "send").is_enabled()
    assert driver.find_element(By.ID, "status").text == "Stopped"

    def all_freed() -> bool:
        body = _ready(gateway)
        return body["in_flight"] == 0 and all(
            w["in_flight"] == 0 and w.get("kv_blocks_in_use") == 0 for w in body["decode"]
        )

    _until(driver, "the decode worker's KV blocks to return to 0", all_freed, 20)
    _until(driver, "the gateway to count the abort", lambda: _metric(
        up.metrics_urls["gateway"], 'tandem:request_success_total{finished_reason="abort"}')
        > aborted_before, 10)
