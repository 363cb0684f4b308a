"""`--quantization int8`: per-channel weight-only int8 (layers/quantization/, the CPU kernel in
kernels/cpu/linear.py), from the codes up to the real embedded model."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from model_server.benchmarks.bandwidth import weight_bytes_per_step
from model_server.config import parse_quantization
from model_server.engine.llm import LLM
from model_server.kernels.cpu import linear as cpu_linear
from model_server.kernels.cpu.gemm import default_kernels
from model_server.kernels.cpu.linear import _INT8_KERNEL_MAX_ROWS, int8_linear
from model_server.kernels.table import TORCH_KERNELS, KernelTable
from model_server.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from model_server.layers.linear import LinearBase, dense
from model_server.layers.quantization import Int8Weight, quantize_int8
from model_server.layers.quantization.int8 import quantize_int8_wna16
from model_server.layers.quantization.wna16 import WNA16Config, WNA16Weight, resolve_quantization
from model_server.platforms.cpu import CpuPlatform
from model_server.sampling_params import SamplingParams
from model_server.settings import ServerSettings
from tests.weights import held


def test_codes_scales_and_error_bound() -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different ranges
    w[5] = 0.0
    q = quantize_int8(w)
    assert q.qweight.dtype == torch.int8 and q.qweight.shape == (64, 96)
    assert q.qweight.abs().max() <= 127
    # Scales are bf16 (what bf16-scale kernels apply) and at least max|row| / 127.
    assert q.scale.dtype == torch.bfloat16
    assert (q.scale.float() * 127 >= w.abs().amax(1)).all()
    err = (q.dequantize() - w).abs()
    assert (err <= q.scale.float()[:, None] / 2 + 1e-7).all()
    assert torch.count_nonzero(q.qweight[5]) == 0 and torch.count_nonzero(q.dequantize()[5]) == 0
    # Each row uses most of the code range (a scale far too large would not).
    assert (q.qweight.abs().amax(1)[torch.arange(64) != 5] >= 126).all()


def test_the_wna16_layout_holds_the_same_weights() -> None:
    """`-q int8` as 8-bit wNa16 codes (the CPU's layout): codes Q + 128, offsets -128 s, and
    every dequantized weight s * Q bit for bit."""
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.logspace(-3, 1, 64)[:, None]
    w[5] = 0.0
    q, codes = quantize_int8(w), quantize_int8_wna16(w)
    assert (codes.method, codes.bits, codes.group_size) == ("int8", 8, 96)
    assert codes.codes.dtype == torch.uint8
    assert torch.equal(codes.codes.to(torch.int16) - 128, q.qweight.to(torch.int16))
    assert torch.equal(codes.dequantize(), q.dequantize())


@pytest.mark.parametrize("rows", [1, 3, _INT8_KERNEL_MAX_ROWS, _INT8_KERNEL_MAX_ROWS + 1, 40])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_int8_linear_matches_the_dequantized_matmul(rows: int, with_bias: bool) -> None:
    torch.manual_seed(rows)
    q = quantize_int8(torch.randn(200, 96))
    x = torch.randn(rows, 96)
    bias = torch.randn(200) if with_bias else None
    expected = torch.nn.functional.linear(x, q.dequantize(), bias)
    got = int8_linear(x, q.qweight, q.scale, bias)
    assert got.dtype == torch.float32 and got.shape == (rows, 200)
    if rows <= _INT8_KERNEL_MAX_ROWS:
        # The int8 kernel rounds x and its output to bf16 (8 significant bits).
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2 * expected.abs().max())
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_cpu_dequantizing_matmul_in_blocks(monkeypatch) -> None:
    # Blocks of 3 rows (of 200, the last one partial): every block lands in its own columns.
    monkeypatch.setattr(cpu_linear, "_BLOCK_BYTES", 3 * 96 * 4)
    torch.manual_seed(1)
    q = quantize_int8(torch.randn(200, 96))
    x, bias = torch.randn(_INT8_KERNEL_MAX_ROWS + 5, 96), torch.randn(200)
    expected = torch.nn.functional.linear(x, q.dequantize(), bias)
    got = int8_linear(x, q.qweight, q.scale, bias)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_dense_dispatches_on_int8_weights_for_any_leading_shape() -> None:
    q = quantize_int8(torch.randn(32, 16))
    x = torch.randn(2, 3, 16)
    out = dense(x, q, kernels=KernelTable(int8_linear=int8_linear))
    assert out.shape == (2, 3, 32)
    torch.testing.assert_close(out, x @ q.dequantize().t(), rtol=2e-2, atol=5e-2)
    # The portable implementation (no platform kernel) is the exact dequantized matmul.
    torch.testing.assert_close(dense(x, q, kernels=TORCH_KERNELS), x @ q.dequantize().t())


def test_parse_quantization() -> None:
    for off in (None, "", "none", "None", "auto", "gguf"):
        assert parse_quantization(off) is None
    assert parse_quantization(" INT8 ") == "int8"
    assert [parse_quantization(m) for m in ("GPTQ", "awq", "w8a16")] == ["gptq", "awq", "w8a16"]
    with pytest.raises(ValueError, match=r"'fp4' is not supported; choose one of: int8, gptq"):
        parse_quantization("fp4")


def test_settings_validate_the_method() -> None:
    assert ServerSettings(quantization="int8").engine_config().quantization == "int8"
    with pytest.raises(ValidationError, match="choose one of: int8"):
        ServerSettings(quantization="w4a4")


def test_platforms_without_an_int8_kernel_refuse_it() -> None:
    class NoKernels(CpuPlatform):
        name = "nokernels"
        quantization_methods = ()

    CpuPlatform().check_quantization("int8")
    CpuPlatform().check_quantization(None)
    with pytest.raises(ValueError, match=r"int8 is not supported on nokernels \(supported: none\)"):
        NoKernels().check_quantization("int8")


# ---- the real embedded model ---------------------------------------------------------------


@pytest.fixture(scope="module")
def models() -> tuple[LLM, LLM]:
    # The float model's weights (auto would keep some GGUF blocks beside them).
    opts = {"dtype": "float32", "kv_cache_memory": 64 * 1024**2, "gguf_weights": "dequantized"}
    return LLM(**opts), LLM(quantization="int8", **opts)


def test_every_matrix_is_quantized_and_weights_shrink(models) -> None:
    fp32, int8 = (m.engine.core.model_runner.model for m in models)
    layout = models[1].engine.core.model_runner.prepared.resolved.int8_layout
    linears = [m for m in int8.modules() if isinstance(m, LinearBase | ParallelLMHead)]
    assert len(linears) == 30 * 4 + 1  # qkv, o, gate_up, down per layer + the LM head
    # Int8 codes (as 8-bit wNa16 codes where the native kernels built), in planned weights (the
    # kernels tuned per machine) or as they are with WICK_CPU_LINEAR_TUNING=0; every layer was
    # built with the CPU's one kernel table.
    holder = Int8Weight if layout == "int8" else WNA16Weight
    assert layout == ("wna16" if default_kernels() is not None else "int8")
    for m in linears:
        weight = held(m.weight)
        weight = weight if isinstance(weight, holder) else m.weight.source
        assert isinstance(weight, holder) and weight.method == "int8", m.weight
    tables = {id(m.kernels): m.kernels for m in linears}
    assert len(tables) == 1
    assert next(iter(tables.values())) is CpuPlatform().kernel_table()
    # The tied embedding keeps its float table for lookups; the head has its own int8 copy.
    embed = next(
        m
        for m in int8.modules()
        if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
    )
    assert embed.weight.dtype == torch.float32
    # A batch-1 decode step reads ~1/4 of the fp32 bytes (int8 codes + the embedding's rows).
    fp32_bytes, int8_bytes = weight_bytes_per_step(fp32, 1), weight_bytes_per_step(int8, 1)
    assert 0.24 < int8_bytes / fp32_bytes < 0.27, (int8_bytes, fp32_bytes)


def test_int8_model_agrees_with_fp32(models, chat_prompts) -> None:
    """First two tokens of 16 chats, with logprobs: the int8 model picks fp32's greedy token
    (nearly) always and gives it (nearly) the same logprob. The first token comes from a prefill
    (dequantized matmuls), the second from a decode step (the int8 kernel)."""
    fp32, int8 = models
    prompts = [fp32.apply_chat_template(chat) for chat in chat_prompts]
    params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=5, ignore_eos=True)
    ref = [o.outputs[0] for o in fp32.generate(prompts, params)]
    got = [o.outputs[0] for o in int8.generate(prompts, params)]
    agree, deltas = 0, []
    for r, g in zip(ref, got, strict=True):
        for step in range(2):
            if r.token_ids[:step] != g.token_ids[:step]:
                break  # different contexts from here on
            agree += r.token_ids[step] == g.token_ids[step]
            top = dict(g.logprobs[step].top)
            if r.token_ids[step] in top:
                deltas.append(abs(top[r.token_ids[step]] - r.logprobs[step].logprob))
    assert agree >= 28, agree  # of at most 32 positions
    assert sum(deltas) / len(deltas) < 0.1, deltas


def test_int8_model_answers(models) -> None:
    _, int8 = models
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = int8.apply_chat_template(chat)
    out = int8.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0))
    assert "Paris" in out[0].outputs[0].text


def _checkpoint(method: str, bits: int) -> WNA16Config:
    return WNA16Config.from_quantization_config(
        {"quant_method": method, "bits": bits, "group_size": 128, "desc_act": False, "sym": True,
         **({"version": "gemm", "zero_point": True} if method == "awq" else {})}
    )  # fmt: skip


@pytest.mark.parametrize(
    ("requested", "checkpoint", "expected"),
    [
        (None, None, None),
        ("int8", None, "int8"),
        ("w8a16", None, "int8"),  # a float checkpoint: W8A16 is int8 weights at load
        ("gptq", ("gptq", 4), None),  # the checkpoint's own format: served as stored
        ("awq", ("awq", 4), None),
        ("w8a16", ("gptq", 8), None),
    ],
)
def test_quantization_matching_the_checkpoint_is_accepted(
    requested: str | None, checkpoint: tuple[str, int] | None, expected: str | None
) -> None:
    qc = _checkpoint(*checkpoint) if checkpoint else None
    assert resolve_quantization(requested, qc) == expected


@pytest.mark.parametrize(
    ("requested", "checkpoint", "needle"),
    [
        ("gptq", ("awq", 4), "--quantization gptq does not match the model, a awq w4 g128"),
        ("awq", None, "a float checkpoint (no quantization_config in its config.json): -q int8"),
        ("w8a16", ("gptq", 4), "a gptq w4 g128 checkpoint"),
        ("int8", ("gptq", 4), "cannot re-quantize a gptq checkpoint (gptq w4 g128"),
    ],
)
def test_quantization_conflicting_with_the_checkpoint_is_refused(
    requested: str, checkpoint: tuple[str, int] | None, needle: str
) -> None:
    qc = _checkpoint(*checkpoint) if checkpoint else None
    with pytest.raises(ValueError) as exc:
        resolve_quantization(requested, qc)
    assert needle in str(exc.value)
