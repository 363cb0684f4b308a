#!/usr/bin/env python3
"""A terminal chat with any OpenAI-compatible server (Wick's model server, vLLM, llama.cpp…).

    python examples/chat.py --base-url http://127.0.0.1:8008 --system "You are concise."
    python examples/chat.py --live     # the reply rendered as Markdown while it streams

The conversation history is kept and sent with every turn; the assistant's reply streams in as
plain text as it arrives. `--live` (candle-vllm's chat.py flag) renders it as Markdown instead,
redrawn in place as it grows (on a terminal; piped output stays plain text). `--base-url` is
the server's root, with or without `/v1`. Commands: `/reset` forgets the conversation (the
system prompt stays), `/exit` (or `/quit`, Ctrl-D) leaves. Ctrl-C while a reply streams stops
that reply and keeps what arrived.

Needs `httpx` and `rich` (both in Wick's `model-server` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from rich.console import Console
from rich.live import Live
from rich.markdown import Markdown


@dataclass
class Conversation:
    """The messages sent with each turn: the optional system prompt, then user/assistant turns."""

    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def reset(self) -> None:
        self.turns.clear()


@dataclass
class StreamStats:
    completion_tokens: int | None = None  # from the server's usage, when it sends one
    seconds: float = 0.0


def stream_chat(client: httpx.Client, payload: dict[str, Any], stats: StreamStats) -> Iterator[str]:
    """Yield the reply's text pieces from a streaming `/v1/chat/completions` request.

    Raises `httpx.HTTPError` for transport failures and `RuntimeError` for an error response
    (with the server's OpenAI-style message)."""
    start = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=payload) as response:
        if response.status_code != 200:
            raise RuntimeError(_error_message(response))
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            data_str = line[len("data:") :].strip()
            if data_str == "[DONE]":
                break
            data = json.loads(data_str)
            if "error" in data:
                raise RuntimeError(str(data["error"].get("message", data["error"])))
            if data.get("usage"):
                stats.completion_tokens = data["usage"].get("completion_tokens")
            for choice in data.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    yield piece
    stats.seconds = time.perf_counter() - start


def _error_message(response: httpx.Response) -> str:
    body = response.read().decode(errors="replace")
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:500]
    return f"HTTP {response.status_code}: {message}"


def first_model(client: httpx.Client) -> str:
    response = client.get("/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError("the server lists no model; pass --model")
    return str(models[0]["id"])


def server_root(base_url: str) -> str:
    """The server's root: `--base-url` as OpenAI clients spell it (`.../v1`, the form the openai
    SDK takes) or without `/v1`; the requests add `/v1/...` themselves."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


def show_reply(console: Console, pieces: Iterator[str], live: bool) -> str:
    """Print the pieces as they arrive; returns the whole reply (partial on Ctrl-C). `live`:
    Markdown redrawn in place (a terminal only: elsewhere nothing can be redrawn)."""
    text = ""
    try:
        if live and console.is_terminal:
            with Live(Markdown(""), console=console, refresh_per_second=12) as live_view:
                for piece in pieces:
                    text += piece
                    live_view.update(Markdown(text))
        else:
            for piece in pieces:
                text += piece
                console.file.write(piece)
                console.file.flush()
            console.file.write("\n")
    except KeyboardInterrupt:
        console.print("\n[yellow](interrupted)[/]")
    return text


def chat_turn(
    console: Console, client: httpx.Client, conv: Conversation, args: argparse.Namespace, user: str
) -> None:
    conv.turns.append({"role": "user", "content": user})
    payload = {
        "model": args.model,
        "messages": conv.messages(),
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    stats = StreamStats()
    console.print("[bold cyan]Assistant:[/]")
    try:
        reply = show_reply(console, stream_chat(client, payload, stats), args.live)
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        conv.turns.pop()  # the failed turn is not part of the conversation
        console.print(f"[bold red]error:[/] {exc}", markup=True, highlight=False)
        return
    conv.turns.append({"role": "assistant", "content": reply})
    if stats.completion_tokens and stats.seconds > 0:
        rate = stats.completion_tokens / stats.seconds
        console.print(
            f"[dim]{stats.completion_tokens} tokens, {stats.seconds:.2f} s, {rate:.1f} tok/s[/]"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Chat with an OpenAI-compatible server.")
    p.add_argument(
        "--base-url", default="http://127.0.0.1:8008", help="Server root, with or without /v1."
    )
    p.add_argument(
        "--live",
        action="store_true",
        help="Render the reply as Markdown, redrawn as it streams (candle-vllm's chat.py flag); "
        "default: plain text as it arrives.",
    )
    p.add_argument("--model", default=None, help="Model name (default: the server's first).")
    p.add_argument("--system", default=None, help="System prompt.")
    p.add_argument("--max-tokens", type=int, default=512, help="Most tokens per reply.")
    p.add_argument("--temperature", type=float, default=0.7, help="Sampling temperature.")
    p.add_argument("--api-key", default=None, help="Bearer token (default: $OPENAI_API_KEY).")
    p.add_argument("--timeout", type=float, default=600.0, help="Seconds per request.")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(
        base_url=server_root(args.base_url),
        headers=headers,
        timeout=httpx.Timeout(args.timeout, connect=10.0),
        trust_env=False,
    ) as client:
        if args.model is None:
            try:
                args.model = first_model(client)
            except (httpx.HTTPError, RuntimeError, ValueError) as exc:
                console.print(f"[bold red]cannot reach {args.base_url}:[/] {exc}")
                return 1
        conv = Conversation(system=args.system)
        console.print(
            f"[bold]Chatting with {args.model}[/] at {args.base_url}. Commands: /reset, /exit.",
            highlight=False,
        )
        while True:
            try:
                user = console.input("[bold green]You:[/] ").strip()
            except (EOFError, KeyboardInterrupt):
                console.print()
                return 0
            if not user:
                continue
            if user in ("/exit", "/quit"):
                return 0
            if user == "/reset":
                conv.reset()
                console.print("[dim](conversation reset)[/]")
                continue
            chat_turn(console, client, conv, args, user)


if __name__ == "__main__":
    sys.exit(main())
