"""The real model server with `--kv-cache-dtype int8` (subprocess, embedded SmolLM2, the CPU's
native attention kernel on codes + scales), driven by the openai client: answers, streams, the
cache's dtype (in /v1/models too) and its ~3.8x the blocks of the fp32 cache in the startup log
and in `vllm:cache_config_info`, every block back after the requests."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import launch, metric

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# SmolLM2-135M: 30 layers x 2 (k, v) x 3 KV heads x (64 int8 codes + a 4-byte scale) per token.
INT8_TOKEN_BYTES = 30 * 2 * 3 * (64 + 4)
FP32_TOKEN_BYTES = 30 * 2 * 3 * 64 * 4
BUDGET = 256 * 1024**2  # SERVE_ARGS' --kv-cache-memory


def test_int8_kv_cache_server(tmp_path: Path) -> None:
    import openai

    # Float weights alone (fp32's auto would keep some GGUF blocks beside them: "gguf").
    server = launch(tmp_path, "--kv-cache-dtype", "int8", "--gguf-weights", "dequantized")
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        # The model card says which cache is in use, beside the weights' quantization.
        card = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
        assert card["kv_cache_dtype"] == "int8" and card["quantization"] is None
        answer = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
        )
        assert "Paris" in answer.choices[0].message.content
        stream = client.completions.create(
            model=model,
            prompt="Once upon a time",
            max_tokens=40,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert len(text.split()) >= 10
        # The budget in 16-token blocks of codes + scales: ~3.8x what fp32 would hold.
        blocks = BUDGET // (16 * INT8_TOKEN_BYTES)
        assert blocks > 3.7 * (BUDGET // (16 * FP32_TOKEN_BYTES))
        body = httpx.get(f"{server.url}/metrics", timeout=10).text
        info = [line for line in body.splitlines() if line.startswith("vllm:cache_config_info{")]
        assert len(info) == 1, body[:2000]
        assert 'cache_dtype="int8"' in info[0] and f'num_gpu_blocks="{blocks}"' in info[0]
        assert info[0].endswith(" 1.0")
        assert metric(server.url, "vllm:kv_cache_usage_perc") == 0.0
        assert f"KV cache: {blocks} blocks of 16 tokens" in server.log()
        assert "int8 codes + float32 scales" in server.log()
    finally:
        code = server.stop()
    assert code == 0, server.log()[-4000:]
