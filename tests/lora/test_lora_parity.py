"""LoRA adapters through the whole engine against PEFT's merged models in transformers (fp32).

Per family, a tiny random base model and three PEFT adapters with random non-zero A and B
(ranks 4, 8 and 16; all seven target modules, q/v only, and gate/up/down with rsLoRA) serve one
batch mixing the three adapters and the base model, greedy with top-5 logprobs: every token and
logprob equals the merged model's within 1e-3. Two device slots for three adapters (the
scheduler holds a third adapter's request back; slots are evicted and refilled) and two in host
memory (adapters are read again from their folder). Prefix caching is on and the prompts share
their first two blocks: a second batch with the adapters rotated over the same prompts hits only
its own adapter's blocks (16 tokens, not the 24 the prompt's full blocks would give), and the same
batch again hits all 24, with the same tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_server.engine.llm import LLM
from model_server.engine.outputs import RequestOutput
from model_server.lora.request import LoRARequest
from model_server.sampling_params import SamplingParams
from tests.lora.helpers import VOCAB, make_adapter, reference_logprobs, save_base

pytest.importorskip("peft")

TOL = 1e-3
PREFIX = [(13 * i + 7) % VOCAB for i in range(16)]  # two blocks of 8 shared by every prompt
PROMPTS = [PREFIX + [(5 * i + 3 * k + 1) % VOCAB for k in range(9)] for i in range(4)]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, logprobs=5, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(base folder, base model, three adapters)."""
    root = tmp_path_factory.mktemp(f"lora_{request.param}")
    base = save_base(root / "base", request.param)
    adapters = [
        make_adapter(root / "base", root / "a1", r=8, alpha=16, seed=1),
        make_adapter(
            root / "base", root / "a2", r=4, alpha=8, targets=["q_proj", "v_proj"], seed=2
        ),
        make_adapter(
            root / "base",
            root / "a3",
            r=16,
            alpha=8,
            targets=["gate_proj", "up_proj", "down_proj"],
            rslora=True,
            seed=3,
        ),
    ]
    return root / "base", base, adapters


def _check(out: RequestOutput, model: torch.nn.Module) -> None:
    completion = out.outputs[0]
    prompt = out.prompt_token_ids
    tokens = prompt + completion.token_ids
    expected = reference_logprobs(model, tokens)
    assert completion.logprobs is not None and len(completion.logprobs) == PARAMS.max_tokens
    for j, entry in enumerate(completion.logprobs):
        row = expected[len(prompt) + j - 1]
        assert entry.token_id == tokens[len(prompt) + j]
        assert abs(entry.logprob - row[entry.token_id].item()) < TOL, j
        assert row[entry.token_id].item() >= row.max().item() - TOL  # greedy
        for (t, lp), want in zip(entry.top, row.topk(5).values.tolist(), strict=True):
            assert abs(lp - want) < TOL and abs(lp - row[t].item()) < TOL


def test_mixed_batch_equals_peft_merged_models(family, tmp_path: Path) -> None:
    folder, base, adapters = family
    requests = [
        LoRARequest(f"a{i + 1}", i + 1, str(adapter.path)) for i, adapter in enumerate(adapters)
    ]
    models = [base, *(a.merged for a in adapters)]
    loras: list[LoRARequest | None] = [None, *requests]
    # The adapters change the model: a test that cannot fail proves nothing.
    for adapter in adapters:
        diff = reference_logprobs(adapter.merged, PROMPTS[0]) - reference_logprobs(base, PROMPTS[0])
        assert diff.abs().max().item() > 0.05
    llm = LLM(
        str(folder),
        dtype="float32",
        device="cuda" if torch.cuda.is_available() else "cpu",
        max_model_len=128,
        block_size=8,
        kv_cache_memory=4 * 1024**2,
        max_num_batched_tokens=24,
        enable_prefix_caching=True,
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=2,
        max_lora_rank=16,
    )
    try:
        first = llm.generate(PROMPTS, PARAMS, lora_request=loras)
        for out, model in zip(first, models, strict=True):
            _check(out, model)
        # The same prompts, each with the next adapter: only the shared prefix (computed by
        # every adapter in the first batch) is its own adapter's.
        rotated = loras[1:] + loras[:1]
        second = llm.generate(PROMPTS, PARAMS, lora_request=rotated)
        for out, model in zip(second, models[1:] + models[:1], strict=True):
            _check(out, model)
            assert out.num_cached_tokens == len(PREFIX)
        again = llm.generate(PROMPTS, PARAMS, lora_request=loras)
        for out, before in zip(again, first, strict=True):
            assert out.num_cached_tokens == 24
            assert out.outputs[0].token_ids == before.outputs[0].token_ids
        kv = llm.engine.core.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks  # nothing held once every request finished
    finally:
        llm.shutdown()
