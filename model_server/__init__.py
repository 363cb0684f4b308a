"""Wick model server: a paged-attention LLM inference engine and its OpenAI-compatible server."""

__version__ = "0.1.0"
