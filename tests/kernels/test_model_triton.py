"""A whole model on the Triton backend (interpreted on CPUs) generates exactly what the portable
backend generates: tiny random Llama/Qwen3 configs, greedy, a batch mixing prompt lengths."""

from __future__ import annotations

import json

import pytest
import torch

from model_server.engine.llm import LLM
from model_server.sampling_params import SamplingParams

pytestmark = pytest.mark.kernels

CONFIGS = {
    "llama-gqa": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "vocab_size": 256,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_triton_backend_generates_like_torch(tmp_path, name: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS[name]))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    common = dict(
        load_format="dummy",
        dtype="float32",
        device=device,
        block_size=8,
        kv_cache_memory=2 * 1024**2,
        max_num_batched_tokens=24,  # chunked prefill across steps
        seed=3,
    )
    prompts = [[(7 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate((5, 19, 11))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tmp_path), attention_backend=backend, **common)
        assert llm.engine.core.model_runner.attn_backend.name == backend
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outputs["triton"] == outputs["torch"]
    assert all(len(t) == 12 for t in outputs["torch"])
