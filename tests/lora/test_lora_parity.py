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

On the CPU the adapters' steps run in the native decoder step (kernels/cpu/lora.c inside
decoder_stack.c's matmuls; the panels forced to win every row bucket, so the step takes every
step): checked by the runner's count of them, and the same mixed batch gives the same tokens and
logprobs, bit for bit, as the modules (which call the same LoRA kernel), in fp32 and bf16.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_server.engine.llm import LLM
from model_server.engine.outputs import RequestOutput
from model_server.kernels.cpu.linear_tuning import PANELS
from model_server.lora.request import LoRARequest
from model_server.sampling_params import SamplingParams
from tests.kernels.helpers import force
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


ON_CPU = not torch.cuda.is_available()


@pytest.fixture
def native_everywhere(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The panels win every row bucket (a fresh tuning cache), so the native decoder step takes
    every step (tiny shapes might time otherwise)."""
    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path / "cache"))
    force(monkeypatch, PANELS)


def _llm(folder: Path, dtype: str = "float32", max_lora_rank: int = 16) -> LLM:
    return LLM(
        str(folder),
        dtype=dtype,
        device="cpu" if ON_CPU else "cuda",
        max_model_len=128,
        block_size=8,
        kv_cache_memory=4 * 1024**2,
        max_num_batched_tokens=24,
        enable_prefix_caching=True,
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=2,
        max_lora_rank=max_lora_rank,
    )


def _requests(adapters) -> list[LoRARequest]:
    return [LoRARequest(f"a{i + 1}", i + 1, str(a.path)) for i, a in enumerate(adapters)]


def test_mixed_batch_equals_peft_merged_models(family, native_everywhere, tmp_path: Path) -> None:
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
    llm = _llm(folder)
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
        runner = llm.engine.core.model_runner
        if ON_CPU:
            # The adapters' steps ran in the native decoder step (kernels/cpu/lora.c there).
            assert runner.native_lora and runner.native_lora_steps > 0
    finally:
        llm.shutdown()


@pytest.mark.skipif(not ON_CPU, reason="the native decoder step is the CPU's")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_native_step_gives_the_modules_tokens(family, native_everywhere, dtype: str) -> None:
    folder, _, adapters = family
    loras: list[LoRARequest | None] = [None, *_requests(adapters)]
    results = []
    for native in (True, False):
        llm = _llm(folder, dtype)
        runner = llm.engine.core.model_runner
        if not native:
            runner.native_step = None  # every step through the modules
        try:
            # Twice: the second batch reads the first one's prefix-cached blocks.
            outs = [llm.generate(PROMPTS, PARAMS, lora_request=loras) for _ in range(2)]
            assert [o.num_cached_tokens for o in outs[1]] == [24] * 4
            results.append(
                [
                    (o.outputs[0].token_ids, [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs])
                    for batch in outs
                    for o in batch
                ]
            )
            assert (runner.native_lora_steps > 0) == native
        finally:
            llm.shutdown()
    assert results[0] == results[1]


def test_rank_64_adapters_equal_peft(native_everywhere, tmp_path: Path) -> None:
    """--max-lora-rank 64: a rank-64 adapter and a rank-33 rsLoRA one beside the base model."""
    base = save_base(tmp_path / "base", "llama", seed=5)
    adapters = [
        make_adapter(tmp_path / "base", tmp_path / "a1", r=64, alpha=32, seed=6),
        make_adapter(tmp_path / "base", tmp_path / "a2", r=33, alpha=16, rslora=True, seed=7),
    ]
    llm = _llm(tmp_path / "base", max_lora_rank=64)
    try:
        outs = llm.generate(PROMPTS[:3], PARAMS, lora_request=[None, *_requests(adapters)])
        for out, model in zip(outs, [base, *(a.merged for a in adapters)], strict=True):
            _check(out, model)
        runner = llm.engine.core.model_runner
        assert runner.lora_manager is not None
        assert runner.lora_manager.config.max_lora_rank == 64
        assert not ON_CPU or runner.native_lora_steps > 0
    finally:
        llm.shutdown()


def test_the_pytorch_path_equals_peft(family) -> None:
    """The path of devices without the native kernel (CUDA's), run here on the CPU: segments
    for prefill chunks, the masked batched form for decodes."""
    folder, base, adapters = family
    llm = _llm(folder)
    runner = llm.engine.core.model_runner
    assert runner.lora_manager is not None
    runner.native_step = None
    runner.lora_manager.batch.native = False
    try:
        outs = llm.generate(PROMPTS, PARAMS, lora_request=[None, *_requests(adapters)])
        for out, model in zip(outs, [base, *(a.merged for a in adapters)], strict=True):
            _check(out, model)
    finally:
        llm.shutdown()
