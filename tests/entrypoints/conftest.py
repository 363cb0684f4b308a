"""An in-process model server (ASGI, no socket) over a tiny random-weight llama that borrows the
embedded SmolLM2 tokenizer (vocab 49152): the real HTTP stack and engine, in about a second."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from model_server.engine.async_engine import AsyncLLM, EngineClient
from model_server.entrypoints.openai.api_server import build_app
from model_server.loader.embedded import embedded_model_available
from model_server.settings import ServerSettings

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "vocab_size": 49152,  # borrows the embedded tokenizer (see loader/dummy.py)
    "bos_token_id": 1,
    "eos_token_id": 2,
}
MODEL_NAME = "tiny-test"
MAX_MODEL_LEN = 256


class AppClient:
    """Drives an ASGI app from sync tests: its own event loop in a thread, lifespan included."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._lifespan = app.router.lifespan_context(app)
        self.call(self._lifespan.__aenter__())
        self.client: httpx.AsyncClient = self.call(self._make_client())

    async def _make_client(self) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=self.app)
        return httpx.AsyncClient(transport=transport, base_url="http://wick", timeout=60)

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def get(self, url: str, **kw: Any) -> httpx.Response:
        return self.call(self.client.get(url, **kw))

    def post(self, url: str, **kw: Any) -> httpx.Response:
        return self.call(self.client.post(url, **kw))

    def sse(self, url: str, body: dict) -> list[Any]:
        """POST a streaming request; the parsed `data:` events ("[DONE]" kept as a string)."""
        resp = self.post(url, json={**body, "stream": True})
        assert resp.status_code == 200, resp.text
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = []
        for block in resp.text.split("\n\n"):
            if not block:
                continue
            assert block.startswith("data: "), block
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
        return events

    def close(self) -> None:
        self.call(self.client.aclose())
        self.call(self._lifespan.__aexit__(None, None, None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def tiny_settings(config_path: Path, **overrides: Any) -> ServerSettings:
    values: dict[str, Any] = {
        "model": str(config_path),
        "load_format": "dummy",
        "served_model_name": MODEL_NAME,
        "max_model_len": MAX_MODEL_LEN,
        "kv_cache_memory": "8MiB",
        "skip_warmup": True,
        "drain_timeout": 5,
        **overrides,
    }
    return ServerSettings(**values)


def start_app(settings: ServerSettings, engine: EngineClient | None = None) -> AppClient:
    """The app over `engine` (default: a real AsyncLLM, awaited until ready)."""
    if engine is not None:
        return AppClient(build_app(engine, settings))
    llm = AsyncLLM(settings.engine_config(), skip_warmup=settings.skip_warmup)
    client = AppClient(build_app(llm, settings))
    client.call(llm.wait_until_ready(60))
    return client


@pytest.fixture(scope="session")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not embedded_model_available():
        pytest.skip("the embedded SmolLM2 (its tokenizer) is not installed")
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.json"
    path.write_text(json.dumps(TINY_CONFIG))
    return path


@pytest.fixture(scope="module")
def api(tiny_config: Path) -> Iterator[AppClient]:
    client = start_app(tiny_settings(tiny_config))
    yield client
    client.close()
