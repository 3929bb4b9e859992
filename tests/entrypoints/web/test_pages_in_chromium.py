"""The playground and the dashboard in real headless Chromium against a real `kvserve serve`
(with --api-key and the tiered KV cache): a typed message streams its reply, token for
token what the API answers; the dashboard, live in another window, follows the requests.
Screenshots land in test-artifacts/web_ui/."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from tests.entrypoints.openai.utils import RemoteServer

pytestmark = pytest.mark.slow

API_KEY = "web-ui-test-key"
ARTIFACTS = Path(__file__).parents[3] / "test-artifacts" / "web_ui"
# Long enough (with the chat template, > 256 tokens) for the tier to store one chunk.
SYSTEM_PROMPT = " ".join(["You are a helpful assistant and you answer in one short line."] * 24)
QUESTION = "Name three colors."
MAX_TOKENS = 24
WAIT_S = 120  # generous: the CI machine is shared; the waits end as soon as the page is right


@pytest.fixture(scope="module")
def web_server() -> Iterator[RemoteServer]:
    tiered = {
        "kv_connector": "TieredCacheConnector",
        "kv_connector_extra_config": {"max_local_cpu_size": 0.1},
    }
    remote = RemoteServer("--api-key", API_KEY, "--kv-transfer-config", json.dumps(tiered))
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and chromedriver):
        pytest.fail("chromium and chromedriver are needed: `make install` installs them")
    options = Options()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(chromedriver), options=options)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()


def _wait(driver: WebDriver, condition: Callable[[WebDriver], Any], what: str) -> Any:
    try:
        return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(condition)
    except TimeoutException:
        # What the page showed instead, for whoever reads the artifacts.
        driver.save_screenshot(str(ARTIFACTS / "timeout.png"))
        raise AssertionError(f"timed out after {WAIT_S} s waiting for {what}") from None


def _data(driver: WebDriver, selector: str, name: str = "value") -> str | None:
    elements = driver.find_elements(By.CSS_SELECTOR, selector)
    return elements[0].get_attribute(f"data-{name}") if elements else None


def _set(driver: WebDriver, element_id: str, text: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(text)


def test_chat_streams_and_the_dashboard_follows(
    web_server: RemoteServer, browser: WebDriver
) -> None:
    # The dashboard first: public page, its stats need the key the user types in.
    browser.get(web_server.url("/dashboard"))
    _wait(browser, lambda d: "API key" in d.find_element(By.ID, "key-msg").text, "the key prompt")
    assert "401" in browser.find_element(By.ID, "dash-status").text
    _set(browser, "key-input", API_KEY)
    browser.find_element(By.ID, "key-save").click()
    _wait(browser, lambda d: _data(d, "#tile-finished") == "0", "the dashboard's first stats")
    # The tier reports its counters once it has been used.
    assert browser.find_element(By.ID, "tiers-empty").is_displayed()
    browser.save_screenshot(str(ARTIFACTS / "dashboard_before.png"))
    dashboard = browser.current_window_handle

    # The playground in a second window (same origin: the key is remembered).
    browser.switch_to.new_window("window")
    browser.get(web_server.url("/"))
    model = _wait(
        browser, lambda d: d.find_element(By.ID, "model").get_attribute("value"), "models"
    )
    browser.execute_script(
        "document.getElementById('system-prompt').value = arguments[0]", SYSTEM_PROMPT
    )
    _set(browser, "temperature", "0")
    _set(browser, "max-tokens", str(MAX_TOKENS))
    browser.find_element(By.ID, "user-input").send_keys(QUESTION, Keys.ENTER)
    partial = _wait(
        browser,
        lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .content")[0].text or False,
        "the first streamed words",
    )
    _wait(
        browser,
        lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant.done"),
        "the end of the reply",
    )
    reply = browser.find_element(By.CSS_SELECTOR, ".msg.assistant")
    answer = reply.find_element(By.CSS_SELECTOR, ".content").get_property("textContent")
    meta = reply.find_element(By.CSS_SELECTOR, ".meta").text
    browser.save_screenshot(str(ARTIFACTS / "playground.png"))
    assert "error" not in (reply.get_attribute("class") or ""), meta
    assert answer.startswith(partial)
    assert int(reply.get_attribute("data-chunks") or 0) > 1  # rendered delta by delta
    assert "TTFT" in meta and "tokens/s" in meta
    assert float(reply.get_attribute("data-ttft-ms") or 0) > 0
    assert float(reply.get_attribute("data-tokens-per-s") or 0) > 0
    browser_tokens = int(reply.get_attribute("data-completion-tokens") or 0)

    # The same request through the API: greedy, so the very same text (and a prefix hit).
    api = web_server.client(api_key=API_KEY).chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": QUESTION},
        ],
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    assert api.choices[0].message.content == answer
    assert api.usage is not None and api.usage.completion_tokens == browser_tokens

    # Back on the dashboard, which kept polling: both requests show, with the same numbers
    # /metrics has, and the KV cache's peak and the CPU tier's bytes rose.
    browser.switch_to.window(dashboard)
    generated = browser_tokens + api.usage.completion_tokens
    _wait(
        browser,
        lambda d: _data(d, "#tile-finished") == "2" and _data(d, "#tile-tokens") == str(generated),
        "the dashboard's request counters",
    )
    _wait(browser, lambda d: float(_data(d, "#tile-kv", "peak") or 0) > 0, "the KV usage peak")
    stored = '#tiers tr[data-tier="cpu"] td[data-field="bytes_stored"]'
    _wait(browser, lambda d: float(_data(d, stored) or 0) > 0, "the CPU tier's bytes")
    assert float(_data(browser, "#tile-prefix") or 0) > 0
    browser.save_screenshot(str(ARTIFACTS / "dashboard_after.png"))
    metrics = web_server.metrics()
    assert metrics["kvserve:generation_tokens_total"] == generated
    assert metrics["kvserve:kv_connector_tier_bytes_stored_total"] == float(
        _data(browser, stored) or 0
    )
