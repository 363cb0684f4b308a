"""Fixtures shared across suites: the chat prompts the engine, model and quantization tests use."""

from __future__ import annotations

import pytest

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain in one sentence what a paged KV cache is, and why an inference engine would use "
    "one instead of a contiguous buffer per sequence.",
    "Hi!",
    "Translate 'good morning' into Spanish, French and German.",
    "What is 12 times 7?",
    "Give me a short tip for learning to cook pasta well at home, with a reason.",
    "Name a famous painting by Vincent van Gogh.",
    "Why is the sky blue? Answer briefly.",
    "Suggest a name for a cat.",
    "What does CPU stand for?",
    "Describe a sunset over the mountains in two sentences, using vivid colours and the sounds of "
    "the evening, as if you were writing the opening of a novel set in a small alpine village.",
    "How many legs does a spider have?",
    "What is the boiling point of water at sea level in Celsius?",
    "Tell me a fun fact about octopuses.",
]


@pytest.fixture(scope="session")
def chat_prompts() -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": q}] for q in QUESTIONS]


# The suite's resident size: engines fault in their KV caches (2 GiB by default on CPU, zeroed
# at start) and packed weights; freed, glibc keeps most of those pages in its arenas, so without
# a trim the pytest process grew to ~10 GB over the suite on a busy 2-core box. After a test that
# left the process this much larger than at the last trim, collect and return the free pages.
_TRIM_GROWTH_BYTES = 512 * 2**20
_rss_at_trim = [0]


def _rss_bytes() -> int:
    import os

    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    rss = _rss_bytes()
    if rss - _rss_at_trim[0] < _TRIM_GROWTH_BYTES:
        return
    import gc

    from model_server.engine.allocator import trim_heap

    gc.collect()
    trim_heap()
    _rss_at_trim[0] = _rss_bytes()
