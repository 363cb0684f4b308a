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
