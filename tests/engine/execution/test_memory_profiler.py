"""Sizing the KV cache from a profiled forward and gpu_memory_utilization (memory_profiler.py).

The budget arithmetic is checked with numbers; the whole path (EngineCore -> executor ->
ModelRunner.local_num_blocks -> profile_run -> check_kv_blocks) runs on a tiny random model with
`FakeGpu`: CPU compute, GPU-like memory accounting whose numbers the test sets and which the
profile forward bumps. The last test needs a real CUDA GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
import transformers

import model_server.engine.engine_core as engine_core_module
from model_server.config import EngineConfig
from model_server.engine.core.request import Request
from model_server.engine.engine_core import EngineCore
from model_server.engine.execution.memory_profiler import (
    MemoryProfile,
    MemorySnapshot,
    check_kv_blocks,
    min_kv_blocks,
    profile_chunks,
)
from model_server.layers.sampler import Sampler
from model_server.models.llama import LlamaForCausalLM
from model_server.platforms import PlatformUnavailable
from model_server.platforms.cpu import CpuPlatform
from model_server.platforms.cuda import CudaPlatform
from model_server.sampling_params import MAX_LOGPROBS, SamplingParams

GiB = 1024**3
MiB = 1024**2
MAX_MODEL_LEN = 128
MAX_NUM_SEQS = 8
MAX_NUM_BATCHED_TOKENS = 320  # two full 128-token sequences and one of 64
# The tiny model's block: 2 (k, v) x 2 layers x 16 tokens x 2 KV heads x head_dim 16 x 4 bytes.
BYTES_PER_BLOCK = 2 * 2 * 16 * 2 * 16 * 4


# ---------------------------------------------------------------- the budget, with numbers


def test_budget_arithmetic() -> None:
    p = MemoryProfile(
        total=80 * GiB, utilization=0.9, weights=16 * GiB, activation_peak=2 * GiB, non_torch=GiB
    )
    assert p.requested == 72 * GiB and p.usable == 72 * GiB and not p.capped
    assert p.non_kv == 19 * GiB
    assert p.kv_cache_memory == 53 * GiB
    assert str(p) == (
        "memory profile: 80.00 GiB total x 0.90 = 72.00 GiB; weights 16.00 GiB, activation "
        "peak 2.00 GiB, non-torch 1.00 GiB; KV cache 53.00 GiB"
    )


def test_memory_in_use_at_start_is_not_ours_and_caps_the_share() -> None:
    # 8 GiB used by others at start: not charged while the requested share was free.
    p = MemoryProfile(80 * GiB, 0.9, 16 * GiB, 2 * GiB, GiB, in_use_at_start=8 * GiB)
    assert p.usable == 72 * GiB and p.kv_cache_memory == 53 * GiB
    # 20 GiB used at start: only 60 GiB were free, so the share is capped there.
    p = MemoryProfile(80 * GiB, 0.9, 16 * GiB, 2 * GiB, GiB, in_use_at_start=20 * GiB)
    assert p.capped and p.usable == 60 * GiB and p.kv_cache_memory == 41 * GiB
    assert "capped at the 60.00 GiB free at start (20.00 GiB was already in use)" in str(p)


def test_budget_can_be_negative() -> None:
    p = MemoryProfile(16 * GiB, 0.5, 7 * GiB, 2 * GiB, 0)
    assert p.kv_cache_memory == -GiB


def test_snapshot_non_torch_memory() -> None:
    assert (
        MemorySnapshot(free=70 * GiB, total=80 * GiB, torch_reserved=6 * GiB).non_torch == 4 * GiB
    )
    # Some runtimes count the allocator's pool as free: never negative.
    assert MemorySnapshot(free=79 * GiB, total=80 * GiB, torch_reserved=6 * GiB).non_torch == 0


def test_min_kv_blocks_is_one_full_sequence() -> None:
    assert min_kv_blocks(4096, 16) == 256
    assert min_kv_blocks(100, 16) == 7
    assert min_kv_blocks(8, 16) == 2


def test_check_kv_blocks_error_says_the_numbers() -> None:
    p = MemoryProfile(80 * GiB, 0.1, 6 * GiB, int(1.5 * GiB), GiB)
    with pytest.raises(ValueError) as err:
        check_kv_blocks(p, 0, 2 * MiB, max_model_len=4096, block_size=16)
    msg = str(err.value)
    for part in (
        "holds 0 blocks of 2.00 MiB",
        "one 4096-token sequence needs 256",
        "80.00 GiB total x 0.10 = 8.00 GiB",
        "weights 6.00 GiB",
        "activation peak 1.50 GiB",
        "non-torch 1.00 GiB",
        "leaving -0.50 GiB",
        "Raise --gpu-memory-utilization",
        "--max-num-batched-tokens or --max-model-len",
        "--kv-cache-memory",
    ):
        assert part in msg
    check_kv_blocks(p, 256, 2 * MiB, max_model_len=4096, block_size=16)  # enough: no error


def test_check_kv_blocks_names_a_smaller_rank() -> None:
    p = MemoryProfile(80 * GiB, 0.9, 6 * GiB, GiB, GiB)  # plenty on this rank
    with pytest.raises(ValueError, match="another rank's; this rank's budget holds 32768"):
        check_kv_blocks(p, 3, 2 * MiB, max_model_len=4096, block_size=16)


# ---------------------------------------------------------------- the profile step


def _config(**overrides: object) -> EngineConfig:
    values: dict[str, object] = dict(
        load_format="dummy",
        dtype="float32",  # the block counts below assume 4-byte K/V
        attention_backend="torch",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        block_size=16,
        gpu_memory_utilization=0.5,
    )
    values.update(overrides)
    return EngineConfig(**values)  # type: ignore[arg-type]


def test_profile_chunks_fill_the_token_budget_with_long_prefills() -> None:
    chunks = profile_chunks(_config(), MAX_MODEL_LEN, 16)
    assert [len(c.token_ids) for c in chunks] == [128, 128, 64]
    assert all(c.num_computed_tokens == 0 for c in chunks)
    assert [c.block_ids for c in chunks] == [[0] * 8, [0] * 8, [0] * 4]


def test_profile_chunks_respect_max_num_seqs() -> None:
    # 2 sequences of at most 128 tokens: the scheduler cannot fill 320 tokens.
    chunks = profile_chunks(_config(max_num_seqs=2), MAX_MODEL_LEN, 16)
    assert [len(c.token_ids) for c in chunks] == [128, 128]


def test_profile_chunks_without_chunked_prefill_take_the_raised_budget() -> None:
    # Without chunked prefill the scheduler's budget is raised to max_model_len (as in vLLM).
    config = _config(max_num_batched_tokens=64, enable_chunked_prefill=False)
    assert [len(c.token_ids) for c in profile_chunks(config, MAX_MODEL_LEN, 16)] == [128]


# ---------------------------------------------------------------- through the real engine


class FakeGpu(CpuPlatform):
    """CPU compute with a GPU's memory accounting, driven by the test: torch holds `weights`
    once loaded; the profile forward (`on_forward`) peaks `activation` above them, leaves them
    cached until `empty_cache`, and brings `non_torch` bytes of runtime memory with it;
    `in_use_at_start` bytes belong to other processes."""

    def __init__(
        self,
        *,
        total: int = 64 * MiB,
        weights: int = 4 * MiB,
        activation: int = 2 * MiB,
        non_torch: int = MiB,
        in_use_at_start: int = 0,
    ) -> None:
        super().__init__()
        self.total = total
        self.weights = weights
        self.activation = activation
        self.non_torch = non_torch
        self.in_use_at_start = in_use_at_start
        # The weights count once loaded: from the profile on (ModelRunner.__init__ takes its
        # baseline snapshot before they load).
        self.loaded = False
        self.ran = False  # the profile forward ran
        self.cached = 0
        self.peak = 0

    def can_profile_memory(self) -> bool:
        return True

    def default_kv_cache_memory(self, bytes_per_block: int) -> int:
        raise AssertionError("a platform that profiles never uses the default budget")

    def on_forward(self) -> None:
        self.ran = True
        self.peak = max(self.peak, self.weights + self.activation)
        self.cached = self.activation

    def memory_allocated(self) -> int:
        return self.weights if self.loaded else 0

    def reset_peak_memory_stats(self) -> None:
        self.peak = self.memory_allocated()

    def max_memory_allocated(self) -> int:
        return self.peak

    def memory_reserved(self) -> int:
        return self.memory_allocated() + self.cached

    def empty_cache(self) -> None:
        self.loaded = True  # first called as the profile starts, after the weights loaded
        self.cached = 0

    def mem_get_info(self) -> tuple[int, int]:
        runtime = self.non_torch if self.ran else 0
        used = self.in_use_at_start + self.memory_reserved() + runtime
        return self.total - used, self.total


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.json"
    transformers.LlamaConfig(
        architectures=["LlamaForCausalLM"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=MAX_MODEL_LEN,
    ).to_json_file(str(path))
    return str(path)


class Spy(SimpleNamespace):
    forward_tokens: list[int]
    logits_rows: list[int]
    sampled: list[tuple[int, int | None]]  # (rows, max_num_logprobs) of each sampler call


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[Spy]:
    """Records every model forward, LM head and sampler call; tells a FakeGpu of forwards."""
    record = Spy(forward_tokens=[], logits_rows=[], sampled=[], platform=None)
    forward, compute_logits, sample = (
        LlamaForCausalLM.forward,
        LlamaForCausalLM.compute_logits,
        Sampler.__call__,
    )

    def spy_forward(self, input_ids, positions, kv_caches, attn_metadata):
        record.forward_tokens.append(int(input_ids.shape[0]))
        if isinstance(record.platform, FakeGpu):
            record.platform.on_forward()
        return forward(self, input_ids, positions, kv_caches, attn_metadata)

    def spy_logits(self, hidden_states):
        record.logits_rows.append(int(hidden_states.shape[0]))
        return compute_logits(self, hidden_states)

    def spy_sample(self, logits, metadata):
        record.sampled.append((int(logits.shape[0]), metadata.max_num_logprobs))
        return sample(self, logits, metadata)

    monkeypatch.setattr(LlamaForCausalLM, "forward", spy_forward)
    monkeypatch.setattr(LlamaForCausalLM, "compute_logits", spy_logits)
    monkeypatch.setattr(Sampler, "__call__", spy_sample)
    yield record


def _engine(
    monkeypatch: pytest.MonkeyPatch, spy: Spy, platform: CpuPlatform, config: EngineConfig
) -> EngineCore:
    spy.platform = platform
    monkeypatch.setattr(engine_core_module, "get_platform", lambda device: platform)
    return EngineCore(config)


def _blocks(budget: int) -> int:
    return budget // BYTES_PER_BLOCK


def test_profiled_engine_sizes_the_kv_cache(
    monkeypatch: pytest.MonkeyPatch, spy: Spy, tiny_model: str, caplog: pytest.LogCaptureFixture
) -> None:
    platform = FakeGpu()
    with caplog.at_level(logging.INFO, logger="model_server.engine.execution.model_runner"):
        core = _engine(monkeypatch, spy, platform, _config(model=tiny_model))
    # One profile forward of the whole token budget, logits and sampling for max_num_seqs rows,
    # then one piece of prompt logprobs (at most 2**24 logits: here every row of the budget).
    assert spy.forward_tokens == [MAX_NUM_BATCHED_TOKENS]
    assert spy.logits_rows == [MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS]
    assert spy.sampled == [(MAX_NUM_SEQS, MAX_LOGPROBS)]
    # 64 MiB x 0.5 - (4 MiB weights + 2 MiB activations + 1 MiB non-torch) = 25 MiB.
    assert core.model_runner.bytes_per_block() == BYTES_PER_BLOCK
    assert core.num_blocks == _blocks(25 * MiB) == 3200
    assert core.kv_cache_manager.num_blocks == 3200
    assert core.model_runner.kv_caches[0].shape[1] == 3200
    assert platform.cached == 0  # the profile's cached blocks were handed back
    assert (
        "memory profile: 0.06 GiB total x 0.50 = 0.03 GiB; weights 0.00 GiB, activation peak "
        "0.00 GiB, non-torch 0.00 GiB; KV cache 0.02 GiB: 3200 blocks of 0.01 MiB"
    ) in caplog.text
    # The engine still serves after the profile (its scratch cache is gone, the real one used).
    core.add_request(Request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3, temperature=0)))
    steps = 0
    while core.has_unfinished_requests():
        core.step()
        steps += 1
    assert steps == 3
    assert spy.forward_tokens[1:] == [5, 1, 1]


def test_kv_cache_memory_skips_profiling(
    monkeypatch: pytest.MonkeyPatch, spy: Spy, tiny_model: str
) -> None:
    platform = FakeGpu()
    core = _engine(
        monkeypatch, spy, platform, _config(model=tiny_model, kv_cache_memory=100 * BYTES_PER_BLOCK)
    )
    assert core.num_blocks == 100
    assert spy.forward_tokens == [] and not platform.ran
    assert core.model_runner.memory_profile is None


@pytest.mark.parametrize("utilization", [0.25, 0.5, 0.75])
def test_utilization_moves_the_budget_by_its_share_of_total(
    monkeypatch: pytest.MonkeyPatch, spy: Spy, tiny_model: str, utilization: float
) -> None:
    core = _engine(
        monkeypatch, spy, FakeGpu(), _config(model=tiny_model, gpu_memory_utilization=utilization)
    )
    expected = _blocks(int(64 * MiB * utilization) - 7 * MiB)
    assert core.num_blocks == expected
    # Each 0.25 of utilization is 16 MiB of the 64 MiB device: 2048 more blocks.
    assert core.num_blocks == 3200 + round((utilization - 0.5) / 0.25) * 2048


def _five_block_gpu() -> FakeGpu:
    # 80 GiB x 0.1 = 8 GiB; weights, activations and runtime leave 40 KiB: 5 blocks.
    return FakeGpu(
        total=80 * GiB,
        weights=6 * GiB,
        activation=int(1.5 * GiB),
        non_torch=GiB // 2 - 5 * BYTES_PER_BLOCK,
    )


def test_too_small_a_budget_is_one_clear_error(
    monkeypatch: pytest.MonkeyPatch, spy: Spy, tiny_model: str
) -> None:
    # 5 blocks, and one 128-token sequence needs 8. Nothing is allocated: the error comes first.
    platform = _five_block_gpu()
    with pytest.raises(ValueError) as err:
        _engine(monkeypatch, spy, platform, _config(model=tiny_model, gpu_memory_utilization=0.1))
    msg = str(err.value)
    assert "holds 5 blocks of 0.01 MiB, and one 128-token sequence needs 8" in msg
    assert "80.00 GiB total x 0.10 = 8.00 GiB; weights 6.00 GiB, activation peak 1.50 GiB" in msg
    assert "Raise --gpu-memory-utilization" in msg
    # Nothing left at all: the same error, with 0 blocks.
    with pytest.raises(ValueError, match="holds 0 blocks"):
        _engine(monkeypatch, spy, platform, _config(model=tiny_model, gpu_memory_utilization=0.05))


def _run_to_end(core: EngineCore, request: Request) -> Request:
    core.add_request(request)
    while core.has_unfinished_requests():
        core.step()
    return request


def test_the_models_context_is_fitted_to_a_small_profiled_budget(
    monkeypatch: pytest.MonkeyPatch, spy: Spy, tiny_model: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The budget of the test above (5 blocks, 80 tokens), but no --max-model-len: the model's
    # 128 is lowered to what the cache holds instead of refusing to start.
    platform = _five_block_gpu()
    config = _config(model=tiny_model, gpu_memory_utilization=0.1, max_model_len=None)
    with caplog.at_level(logging.WARNING, logger="model_server.engine.engine_core"):
        core = _engine(monkeypatch, spy, platform, config)
    assert core.num_blocks == 5
    assert core.config.max_model_len == core.scheduler.config.max_model_len == 80
    assert "max_model_len lowered from the model's 128 to 80 tokens" in caplog.text
    # A request without max_tokens runs to the end of the fitted context instead of a 400.
    done = _run_to_end(
        core,
        Request("r", [1, 2, 3], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)),
    )
    assert done.num_tokens == 80 and done.status.name == "FINISHED_LENGTH"
    # Fewer than 2 blocks still cannot start.
    with pytest.raises(ValueError, match=r"holds 0 blocks of 0\.01 MiB, and the engine needs 2"):
        _engine(
            monkeypatch,
            spy,
            platform,
            _config(model=tiny_model, gpu_memory_utilization=0.05, max_model_len=None),
        )


def test_a_given_kv_cache_memory_fits_only_the_models_context(
    monkeypatch: pytest.MonkeyPatch, spy: Spy, tiny_model: str, caplog: pytest.LogCaptureFixture
) -> None:
    budget = 6 * BYTES_PER_BLOCK  # 96 tokens, against the model's 128
    fitted = _engine(
        monkeypatch,
        spy,
        CpuPlatform(),
        _config(model=tiny_model, kv_cache_memory=budget, max_model_len=None),
    )
    assert fitted.config.max_model_len == 96
    done = _run_to_end(
        fitted,
        Request("r", [1, 2, 3], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)),
    )
    assert done.num_tokens == 96
    # A --max-model-len the user gave is kept, with a warning; too long a request is refused
    # with the cache's numbers, and the engine goes on serving.
    with caplog.at_level(logging.WARNING, logger="model_server.engine.engine_core"):
        given = _engine(
            monkeypatch,
            spy,
            CpuPlatform(),
            _config(model=tiny_model, kv_cache_memory=budget, max_model_len=128),
        )
    assert given.config.max_model_len == 128
    assert "the KV cache holds 96 tokens, fewer than --max-model-len 128" in caplog.text
    with pytest.raises(ValueError, match="the cache has only 6 blocks of 16 tokens"):
        given.add_request(
            Request(
                "long", [1, 2, 3], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
            )
        )
    short = SamplingParams(max_tokens=4, temperature=0)
    assert _run_to_end(given, Request("short", [1, 2, 3], short)).num_output_tokens == 4


def test_memory_in_use_before_start_is_not_charged(
    monkeypatch: pytest.MonkeyPatch, spy: Spy, tiny_model: str
) -> None:
    platform = FakeGpu(in_use_at_start=10 * MiB)
    core = _engine(monkeypatch, spy, platform, _config(model=tiny_model))
    profile = core.model_runner.memory_profile
    assert profile is not None and profile.in_use_at_start == 10 * MiB
    assert profile.non_torch == MiB  # this process's own runtime memory only
    assert core.num_blocks == _blocks(25 * MiB)  # as on an empty device


def test_a_share_larger_than_the_free_memory_is_capped_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, spy: Spy, tiny_model: str, caplog: pytest.LogCaptureFixture
) -> None:
    platform = FakeGpu(in_use_at_start=10 * MiB)
    with caplog.at_level(logging.WARNING, logger="model_server.engine.execution.model_runner"):
        core = _engine(
            monkeypatch, spy, platform, _config(model=tiny_model, gpu_memory_utilization=0.9)
        )
    # 0.9 x 64 MiB = 57.6 MiB requested, 54 MiB free at start: 54 - 7 MiB for the KV cache.
    assert core.num_blocks == _blocks(47 * MiB)
    assert "asks for more than was free when the engine started" in caplog.text


def test_cpu_keeps_its_fixed_default_budget(
    monkeypatch: pytest.MonkeyPatch, spy: Spy, tiny_model: str
) -> None:
    platform = CpuPlatform()
    assert not platform.can_profile_memory()
    core = _engine(monkeypatch, spy, platform, _config(model=tiny_model))
    assert core.num_blocks == 2 * GiB // BYTES_PER_BLOCK
    assert spy.forward_tokens == [] and core.model_runner.memory_profile is None


# ---------------------------------------------------------------- platforms' memory calls


def _stats_api(**missing: None) -> SimpleNamespace:
    calls = dict(
        reset_peak_memory_stats=lambda device=None: None,
        max_memory_allocated=lambda device=None: 3 * GiB,
        memory_allocated=lambda device=None: 2 * GiB,
        memory_reserved=lambda device=None: 4 * GiB,
        empty_cache=lambda: None,
    )
    calls.update(missing)
    return SimpleNamespace(**{k: v for k, v in calls.items() if v is not None})


def test_cuda_always_profiles() -> None:
    assert CudaPlatform().can_profile_memory()


@pytest.mark.parametrize("device", ["gcu", "hpu"])
def test_gcu_and_hpu_profile_only_with_a_complete_api(
    monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    from model_server.platforms import gcu, hpu

    module, accessor, cls = {
        "gcu": (gcu, "_torch_gcu", gcu.GcuPlatform),
        "hpu": (hpu, "_hthpu", hpu.HpuPlatform),
    }[device]
    if device == "gcu" and torch._C._get_privateuse1_backend_name() == "privateuseone":
        # torch_gcu names torch's out-of-tree device slot "gcu" (once per process, as in
        # test_platforms.py); nothing else here uses that slot.
        torch.utils.rename_privateuse1_backend("gcu")
    platform = cls()
    monkeypatch.setattr(module, accessor, lambda: _stats_api())
    assert platform.can_profile_memory()
    assert platform.max_memory_allocated() == 3 * GiB
    assert platform.memory_allocated() == 2 * GiB
    assert platform.memory_reserved() == 4 * GiB
    platform.reset_peak_memory_stats()
    platform.empty_cache()
    # An older runtime without memory_reserved: the default budget applies instead.
    monkeypatch.setattr(module, accessor, lambda: _stats_api(memory_reserved=None))
    assert not platform.can_profile_memory()

    def missing() -> None:
        raise PlatformUnavailable("no runtime")

    monkeypatch.setattr(module, accessor, missing)
    assert not platform.can_profile_memory()
    platform.empty_cache()  # a no-op without the runtime


# ---------------------------------------------------------------- a real GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kv_cache_and_torch_peak_stay_within_the_share_on_a_gpu() -> None:
    num_seqs, prompt_len = 32, 64
    core = EngineCore(
        EngineConfig(
            model="smollm2-135m",
            load_format="dummy",
            device="cuda",
            gpu_memory_utilization=0.5,
            max_model_len=1024,
            max_num_seqs=num_seqs,
            max_num_batched_tokens=num_seqs * prompt_len,
            enforce_eager=True,
        )
    )
    try:
        runner = core.model_runner
        profile = runner.memory_profile
        assert profile is not None
        assert profile.weights > 0 and profile.activation_peak > 0
        _, total = torch.cuda.mem_get_info()
        assert profile.total == total and profile.usable <= total * 0.5
        kv_bytes = core.num_blocks * runner.bytes_per_block()
        assert kv_bytes > 0.5 * profile.kv_cache_memory  # the budget went to the KV cache
        # Steps at the profile's limits: a full token budget of prefills, then decodes.
        torch.cuda.reset_peak_memory_stats()
        params = SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, logprobs=5)
        for i in range(num_seqs):
            core.add_request(
                Request(f"r{i}", [1 + (i + j) % 1000 for j in range(prompt_len)], params)
            )
        while core.has_unfinished_requests():
            core.step()
        peak = torch.cuda.max_memory_allocated()  # weights + KV cache + the steps' activations
        assert peak >= kv_bytes
        assert peak + profile.non_torch <= profile.usable
    finally:
        core.shutdown()
