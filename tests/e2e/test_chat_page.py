"""The chat page at the model server's `/`, in a real headless Chromium against the real server:
streamed text arrives, the conversation carries over, tokens/s is shown, and the stop button
aborts the request in the engine (its KV blocks freed at once)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.browser import artifact_path, headless_chromium
from tests.e2e.conftest import ServerProcess, metric

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def wait_for(condition: Callable[[], Any], timeout: float = 60, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what or condition}")


@pytest.fixture
def browser() -> Iterator[Any]:
    driver = headless_chromium()
    try:
        yield driver
    finally:
        driver.quit()


def set_field(browser: Any, element_id: str, value: str) -> None:
    field = browser.find_element("id", element_id)
    field.clear()
    field.send_keys(value)


def assistant_bubbles(browser: Any) -> list[Any]:
    return browser.find_elements("css selector", ".msg.assistant")


def ask(browser: Any, prompt: str) -> Any:
    """Type `prompt`, press Enter; the new assistant bubble."""
    before = len(assistant_bubbles(browser))
    browser.find_element("id", "prompt").send_keys(prompt + "\n")
    return wait_for(
        lambda: assistant_bubbles(browser)[before:] and assistant_bubbles(browser)[before],
        10,
        "the answer's bubble",
    )


def test_chat_streams_keeps_history_and_stop_aborts_in_the_engine(
    server: ServerProcess, model_name: str, browser: Any
) -> None:
    browser.get(f"{server.url}/")
    assert browser.title == "Wick chat"
    wait_for(lambda: browser.find_element("id", "model-name").text == model_name, 30, "model")
    set_field(browser, "system", "You are a helpful assistant. Answer briefly.")
    set_field(browser, "temperature", "0")
    set_field(browser, "max_tokens", "40")

    # A whole answer: streamed into its bubble, then tokens/s of that answer.
    first = ask(browser, "What is the capital of France?")
    wait_for(lambda: first.get_attribute("data-state") == "done", 120, "the first answer")
    assert "Paris" in first.find_element("css selector", ".text").text
    stats = browser.find_element("id", "stats")
    assert "tok/s" in stats.text and float(stats.get_attribute("data-tokens-per-second")) > 0
    assert browser.execute_script("return turns.length") == 2  # the conversation so far

    # A long answer, stopped mid-way by the user.
    set_field(browser, "max_tokens", "1500")
    aborted = metric(server.url, "vllm:request_success_total", 'finished_reason="abort"')
    generated = metric(server.url, "vllm:generation_tokens_total")
    second = ask(browser, "Now write a very long story about a dragon who learns to cook.")
    text = second.find_element("css selector", ".text")
    seen = wait_for(lambda: len(text.text) > 40 and text.text, 120, "streamed text")
    wait_for(lambda: len(text.text) > len(seen), 30, "more streamed text")  # still arriving
    assert metric(server.url, "vllm:num_requests_running") == 1
    assert metric(server.url, "vllm:kv_cache_usage_perc") > 0
    browser.find_element("id", "stop").click()
    wait_for(lambda: second.get_attribute("data-state") == "stopped", 10, "the stopped state")
    # The engine aborted it: nothing runs, no KV block is held, well before 1500 tokens.
    wait_for(
        lambda: (
            metric(server.url, "vllm:num_requests_running") == 0
            and metric(server.url, "vllm:kv_cache_usage_perc") == 0
        ),
        5,
        "the engine to free the stopped request",
    )
    assert metric(server.url, "vllm:request_success_total", 'finished_reason="abort"') == (
        aborted + 1
    )
    assert metric(server.url, "vllm:generation_tokens_total") - generated < 1000
    # The first turn's answer went with the second request (history), and both stay listed.
    assert browser.execute_script("return turns.length") == 4
    assert browser.find_element("id", "send").is_enabled()
    assert not browser.find_element("id", "stop").is_enabled()
    assert second.get_attribute("data-request-id")  # the server's X-Request-Id, exposed
    browser.save_screenshot(str(artifact_path("chat_page.png")))


def test_the_page_loads_nothing_from_elsewhere(server: ServerProcess, browser: Any) -> None:
    browser.get(f"{server.url}/")
    wait_for(lambda: browser.find_element("id", "model-name").text != "…", 30, "model")
    entries = browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)"
    )
    assert all(name.startswith(server.url) for name in entries), entries
