"""A whole model on the Triton backend (interpreted on CPUs) generates exactly what the portable
backend generates: tiny random Llama/Qwen3 configs, greedy, a batch mixing prompt lengths."""

from __future__ import annotations

import pytest

from model_server.sampling_params import SamplingParams
from tests.kernels.helpers import MIXED_PROMPTS, TINY_CONFIGS, tiny_llm

pytestmark = pytest.mark.kernels


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_triton_backend_generates_like_torch(tmp_path, name: str) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = tiny_llm(tmp_path, name, attention_backend=backend)
        assert llm.engine.core.model_runner.attn_backend.name == backend
        outputs[backend] = [o.outputs[0].token_ids for o in llm.generate(MIXED_PROMPTS, params)]
    assert outputs["triton"] == outputs["torch"]
    assert all(len(t) == 12 for t in outputs["torch"])
