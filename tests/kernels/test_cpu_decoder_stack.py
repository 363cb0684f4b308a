"""The native decoder stack (kernels/cpu/decoder_stack.c, .py): a whole model's layers in one
call give the same bits as the layers' modules, in fp32 and bf16, with GQA, q/k/v biases, an odd
number of heads, a quantized KV cache, prefill chunks mixed with decodes and GGUF weights kept in
their blocks; it declines what it does not run (an activation it lacks, untuned weights) and then
the modules run; a position outside the rotary cache is the same IndexError. The other families:
tests/kernels/test_native_step_families.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model_server.engine.llm import LLM
from model_server.kernels.cpu import decoder_stack, linear_tuning
from model_server.kernels.cpu.gemm import default_kernels
from model_server.kernels.cpu.linear_tuning import PANELS
from model_server.sampling_params import SamplingParams
from tests.kernels.helpers import MIXED_PROMPTS, TINY_CONFIGS, force, force_prefetch_split

pytestmark = pytest.mark.skipif(
    default_kernels() is None, reason="the native CPU kernels need a C compiler"
)

# Qwen2's q/k/v biases, 6 heads over 2 KV heads of 24 dims (hidden 144), intermediate 160.
QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 144,
    "intermediate_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
CONFIGS = {"llama-gqa": TINY_CONFIGS["llama-gqa"], "qwen2-bias": QWEN2}


def force_panels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The panels win every bucket (tiny shapes might not on real timings)."""
    force(monkeypatch, PANELS)


_OWN_TAKES = decoder_stack.CpuDecoderStack.takes
_OWN_CALL = decoder_stack.CpuDecoderStack.__call__


class StackCalls:
    """Counts the steps the native stack ran and declined (`takes` said no)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, enabled: bool = True) -> None:
        self.ran = 0
        self.declined = 0

        def takes(stack, *args):
            out = _OWN_TAKES(stack, *args) if enabled else False
            self.declined += not out
            return out

        def call(stack, *args, **kwargs):
            self.ran += 1
            return _OWN_CALL(stack, *args, **kwargs)

        monkeypatch.setattr(decoder_stack.CpuDecoderStack, "takes", takes)
        monkeypatch.setattr(decoder_stack.CpuDecoderStack, "__call__", call)


def generate(
    folder: Path, config: dict, dtype: str, engines: list | None = None, **options
) -> list[tuple[list, list]]:
    """Greedy tokens and logprobs of MIXED_PROMPTS; the engine is appended to `engines`."""
    (folder / "config.json").write_text(json.dumps(config))
    llm = LLM(
        str(folder),
        load_format="dummy",
        dtype=dtype,
        device="cpu",
        attention_backend="cpu",
        block_size=8,
        kv_cache_memory=2 * 1024**2,
        max_num_batched_tokens=24,  # prompts prefill in chunks, beside decodes
        seed=3,
        **options,
    )
    if engines is not None:
        engines.append(llm)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = llm.generate(MIXED_PROMPTS, params)
    return [
        (o.outputs[0].token_ids, [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs])
        for o in outs
    ]


@pytest.mark.parametrize(
    ("name", "dtype", "kv_cache_dtype"),
    [
        ("llama-gqa", "float32", "auto"),
        ("llama-gqa", "bfloat16", "auto"),
        ("llama-gqa", "float32", "int8"),
        ("qwen2-bias", "float32", "auto"),
        ("qwen2-bias", "bfloat16", "auto"),
        ("qwen2-bias", "bfloat16", "int8"),
    ],
)
def test_the_stack_generates_the_modules_bits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, dtype: str, kv_cache_dtype: str
) -> None:
    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path / "cache"))
    force_panels(monkeypatch)
    config = CONFIGS[name]
    off = StackCalls(monkeypatch, enabled=False)
    expected = generate(tmp_path, config, dtype, kv_cache_dtype=kv_cache_dtype)
    on = StackCalls(monkeypatch)
    got = generate(tmp_path, config, dtype, kv_cache_dtype=kv_cache_dtype)
    assert off.ran == 0 and off.declined > 0
    assert on.ran > 0 and on.declined == 0  # every step, prefill chunks and decodes
    assert got == expected
    assert all(len(tokens) == 10 for tokens, _ in got)


def test_the_stack_runs_the_panels_prefetch_the_plan_chose_per_bucket(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The plan runs the panels without software prefetch at 1-2 rows and with it beyond: each
    step's WickLinear structs carry that bucket's choice (hw_prefetch_only, the fused gate/up
    SiLU's included), as the modules' calls take it, and the bits equal the modules'. Without
    the pair layout (no AVX512-BF16) no bucket can leave it to the hardware."""
    from model_server.kernels.cpu.panel_gemm import pairs_available

    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path / "cache"))
    force_prefetch_split(monkeypatch, 2)
    config = CONFIGS["llama-gqa"]
    off = StackCalls(monkeypatch, enabled=False)
    expected = generate(tmp_path, config, "bfloat16")
    flags: dict[int, set[int]] = {}
    own_plan = decoder_stack.CpuDecoderStack._plan

    def plan(stack, key, *args):
        structs = own_plan(stack, key, *args)
        if structs is not None:
            for layer in structs:
                assert layer.fuse_silu == 1
                flags.setdefault(key, set()).update(
                    getattr(layer, name).hw_prefetch_only
                    for name in ("qkv", "o", "gate_up", "down")
                )
        return structs

    monkeypatch.setattr(decoder_stack.CpuDecoderStack, "_plan", plan)
    on = StackCalls(monkeypatch)
    got = generate(tmp_path, config, "bfloat16")
    assert off.ran == 0 and on.ran > 0 and on.declined == 0
    assert got == expected
    hardware = int(pairs_available())
    assert flags == {key: {hardware if key <= 1 else 0} for key in flags}
    assert min(flags) <= 1 < max(flags), flags  # decodes and prefill chunks both ran


def test_the_stack_declines_an_activation_it_lacks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The exact (erf) GELU has no native kernel: the modules run every step, generate as they
    always did, and the plan says which layer and what."""
    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path / "cache"))
    force_panels(monkeypatch)
    config = dict(TINY_CONFIGS["llama-gqa"], hidden_act="gelu")
    calls = StackCalls(monkeypatch)
    engines: list = []
    got = generate(tmp_path, config, "float32", engines)
    prepared = engines[0].engine.core.model_runner.prepared
    assert prepared.native_step is None and calls.ran == 0
    assert prepared.native_reason.startswith("layer 0: the gelu activation")
    assert "module by module (layer 0: the gelu activation" in prepared.describe()
    assert all(len(tokens) == 10 for tokens, _ in got)


def test_the_stack_declines_untuned_weights(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """With tuning off the matmuls are the fixed table's (no panels): the modules run."""
    monkeypatch.setenv(linear_tuning.TUNING_ENV, "0")
    calls = StackCalls(monkeypatch)
    engines: list = []
    got = generate(tmp_path, TINY_CONFIGS["llama-gqa"], "float32", engines)
    assert engines[0].engine.core.model_runner.native_step is None
    assert calls.ran == 0
    assert all(len(tokens) == 10 for tokens, _ in got)


def test_a_position_outside_the_rotary_cache_is_an_index_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """As the module path's rotary kernel raises it (the runner never lets one through)."""
    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path / "cache"))
    force_panels(monkeypatch)
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIGS["llama-gqa"]))
    llm = LLM(
        str(tmp_path),
        load_format="dummy",
        dtype="float32",
        device="cpu",
        attention_backend="cpu",
        block_size=8,
        kv_cache_memory=2 * 1024**2,
        seed=3,
    )
    runner = llm.engine.core.model_runner
    model = runner.model.model
    from tests.kernels.helpers import make_batch

    batch = make_batch([(0, 3)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    kv_caches = [torch.zeros(2, *batch.k_cache.shape) for _ in model.layers]
    hidden = torch.randn(3, 64)
    positions = torch.tensor([0, 1, 10_000])
    assert runner.native_step is not None
    with pytest.raises(IndexError, match="outside the cache"):
        runner.native_step(positions, hidden, kv_caches, batch.metadata)
    ok = runner.native_step(torch.tensor([0, 1, 2]), hidden, kv_caches, batch.metadata)
    assert ok is not None and ok[0].shape == (3, 64) and ok[1].shape == (3, 64)


@pytest.mark.slow
def test_the_embedded_gguf_kept_quantized_runs_the_stack_with_the_modules_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real SmolLM2 Q4_1 file kept in its blocks (the GGUF kernels the tuner chose per row
    count, int8 dot products included): greedy tokens and logprobs as the modules give them.
    One engine, so one plan: the runner's native step is switched off for the reference (two
    engines on a busy machine time their kernels differently and may plan differently)."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    prompts = [[1, 330, 2096, 314], [1, 4237, 28, 1812, 4219, 30, 3134, 1659, 288, 30, 2]]
    llm = LLM(
        None,
        gguf_weights="quantized",
        max_num_seqs=4,
        kv_cache_memory=64 * 1024**2,
        enable_prefix_caching=False,
    )
    runner = llm.engine.core.model_runner
    step = runner.native_step
    assert step is not None
    results = []
    try:
        for enabled in (False, True):
            runner.native_step = step if enabled else None
            calls = StackCalls(monkeypatch)
            outs = llm.generate(prompts, params)
            results.append(
                [
                    (o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs])
                    for o in outs
                ]
            )
            assert (calls.ran > 0) == enabled
    finally:
        llm.shutdown()
    assert results[1] == results[0]


AVX2_SCRIPT = """
import json, sys
import tests.kernels.test_cpu_decoder_stack as t
from model_server.kernels.cpu import native
assert native.load_kernels().isa == "avx2", native.load_kernels().isa

class Patch:
    def setattr(self, obj, name, value):
        setattr(obj, name, value)

t.force_panels(Patch())
folder = t.Path(sys.argv[1])
results = {}
for enabled in (False, True):
    calls = t.StackCalls(Patch(), enabled)
    results[enabled] = t.generate(folder, t.QWEN2, "bfloat16")
    assert (calls.ran > 0) == enabled, (enabled, calls.ran)
print(json.dumps(results[True] == results[False]))
"""


def test_the_stack_on_the_avx2_build_generates_the_modules_bits(tmp_path: Path) -> None:
    """The AVX2 build (no AVX-512, no vdpbf16ps: bf16 through the fp32 panels), forced on this
    CPU in a fresh process (a process keeps its first build for its matmuls)."""
    import os
    import subprocess
    import sys

    from model_server.kernels.cpu import isa as isa_mod

    if "avx2" not in [i.name for i in isa_mod.supported_isas(isa_mod.cpu_flags())]:
        pytest.fail("this CPU cannot run the AVX2 build")  # every x86-64 CI machine can
    env = dict(os.environ, WICK_CACHE_DIR=str(tmp_path / "cache"))
    env[isa_mod.CPU_ISA_ENV] = "avx2"
    proc = subprocess.run(
        [sys.executable, "-c", AVX2_SCRIPT, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "true"
