"""GPTQ and AWQ checkpoints served kept quantized, through the whole engine (`LLM`): tiny random
Llamas written in each format (tests/layers/quantization/checkpoints.py) against the same model
saved as float with the reference dequantization of every quantized matrix. The logprobs of
the greedy tokens agree to float rounding and the tokens are equal; the projections hold no
float matrix; malformed checkpoints fail with one error naming the tensor or field; tensor
parallelism splits N and K along whole groups (and refuses a group across ranks)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from model_server.engine.llm import LLM
from model_server.layers.linear import LinearBase
from model_server.layers.quantization.wna16 import WNA16Weight
from model_server.sampling_params import SamplingParams
from tests.layers.quantization.checkpoints import (
    VOCAB,
    Format,
    edit_checkpoint,
    edit_config,
    save_pair,
)
from tests.weights import held

ENGINE_ARGS = dict(
    dtype="float32",
    max_model_len=64,
    block_size=4,
    kv_cache_memory=2 * 1024**2,
    max_num_batched_tokens=16,
)
PROMPTS = [[(7 * i + 3) % VOCAB for i in range(13)], [(11 * i + 5) % VOCAB for i in range(21)]]
FORMATS = [
    Format("gptq", 4, 32),
    Format("gptq", 4, 64, sym=False, desc_act=True),
    Format("gptq", 8, 128),
    Format("gptq", 4, -1, sym=False),
    Format("awq", 4, 32),
    Format("awq", 4, 128),
]


def _generate(folder: Path, **kwargs: object) -> tuple[list[tuple[list[int], list[float]]], LLM]:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)
    llm = LLM(str(folder), **{**ENGINE_ARGS, **kwargs})
    outputs = llm.generate(PROMPTS, params)
    result = [
        (o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outputs
    ]
    return result, llm


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_quantized_model_matches_its_dequantized_float_model(fmt: Format, tmp_path: Path) -> None:
    qfolder, ffolder = save_pair(tmp_path, fmt)
    quantized, llm = _generate(qfolder)
    try:
        runner = llm.engine.core.model_runner
        assert runner.quantization_description == WNA16_DESCRIPTIONS[fmt.name]
        assert llm.engine.quantization == runner.quantization_description
        linears = [m for m in runner.model.modules() if isinstance(m, LinearBase)]
        assert len(linears) == 2 * 4  # qkv, o, gate_up, down per layer
        for layer in linears:
            assert isinstance(held(layer.weight), WNA16Weight) and layer.weight.method == fmt.method
            # Only the repacked tensors remain: no float matrix, no checkpoint-format copy.
            names = {name for name, _ in layer.named_parameters()}
            assert not names & {"qweight", "qzeros", "scales", "g_idx"}
            assert all(
                p.dtype == torch.uint8 or p.dim() < 2 or p.shape[1] <= 8 or p is layer.weight.perm
                for p in layer.parameters()
            )
        assert runner.model.lm_head.weight.dtype == torch.float32  # the head stays float
    finally:
        llm.shutdown()
    dequantized, llm = _generate(ffolder)
    llm.shutdown()
    for (tokens_q, logprobs_q), (tokens_f, logprobs_f) in zip(quantized, dequantized, strict=True):
        assert len(tokens_q) == 10
        assert tokens_q == tokens_f
        torch.testing.assert_close(logprobs_q, logprobs_f, atol=1e-3, rtol=1e-3)


WNA16_DESCRIPTIONS = {
    "gptq-w4-g32": "gptq w4 g32",
    "gptq-w4-g64-asym-actorder": "gptq w4 g64 act-order",
    "gptq-w8-g128": "gptq w8 g128",
    "gptq-w4-g-1-asym": "gptq w4 per-channel",
    "awq-w4-g32": "awq w4 g32",
    "awq-w4-g128": "awq w4 g128",
}


def test_bf16_activations_give_the_same_greedy_tokens(tmp_path: Path) -> None:
    qfolder, ffolder = save_pair(tmp_path, Format("gptq", 4, 32))
    quantized, llm = _generate(qfolder, dtype="bfloat16")
    llm.shutdown()
    dequantized, llm = _generate(ffolder, dtype="bfloat16")
    llm.shutdown()
    assert [t for t, _ in quantized] == [t for t, _ in dequantized]


def _load_error(folder: Path) -> str:
    with pytest.raises(ValueError) as info:
        LLM(str(folder), **ENGINE_ARGS)
    return str(info.value)


def test_missing_scales_names_the_tensor(tmp_path: Path) -> None:
    qfolder, _ = save_pair(tmp_path, Format("gptq", 4, 32))
    edit_checkpoint(qfolder, lambda t: t.pop("model.layers.1.mlp.down_proj.scales"))
    assert "model.layers.1.mlp.down_proj.scales" in _load_error(qfolder)


def test_scales_of_another_group_size_name_the_tensor(tmp_path: Path) -> None:
    qfolder, _ = save_pair(tmp_path, Format("gptq", 4, 32))
    edit_config(qfolder, group_size=64)  # the tensors still hold groups of 32
    message = _load_error(qfolder)
    # The first per-group tensor read (file order) is named, with what its shape should be.
    assert re.search(r"model\.layers\.\d\.\w+\.\w+\.(qzeros|scales)\b", message), message
    assert "checkpoint tensor has shape" in message and "gptq w4 g64" in message


def test_unknown_bits_name_the_field(tmp_path: Path) -> None:
    qfolder, _ = save_pair(tmp_path, Format("gptq", 4, 32))
    edit_config(qfolder, bits=3)
    assert "quantization_config.bits 3 is not supported for gptq" in _load_error(qfolder)


def test_float_scales_stored_as_ints_are_refused(tmp_path: Path) -> None:
    qfolder, _ = save_pair(tmp_path, Format("awq", 4, 32))
    name = "model.layers.0.mlp.up_proj.scales"
    edit_checkpoint(qfolder, lambda t: t.__setitem__(name, t[name].to(torch.int32)))
    message = _load_error(qfolder)
    assert "model.layers.0.mlp.gate_up_proj.scales (part 1)" in message
    assert "expected a float tensor" in message


@pytest.mark.parametrize(
    ("fmt", "named"), [(Format("gptq", 4, 32), "gptq"), (Format("gptq", 8, 128), "w8a16")]
)
def test_quantization_naming_the_checkpoints_format_serves_it(
    fmt: Format, named: str, tmp_path: Path
) -> None:
    """vLLM-GCU's --quantization gptq|w8a16 on a checkpoint of that format: served as stored,
    with the same tokens as without the flag."""
    qfolder, _ = save_pair(tmp_path, fmt)
    plain, llm = _generate(qfolder)
    llm.shutdown()
    named_run, llm = _generate(qfolder, quantization=named)
    try:
        assert (
            llm.engine.core.model_runner.prepared.resolved.quantization is None
        )  # nothing re-quantized
        assert llm.engine.quantization == WNA16_DESCRIPTIONS[fmt.name]
    finally:
        llm.shutdown()
    assert [t for t, _ in named_run] == [t for t, _ in plain]


def test_quantization_conflicting_with_the_checkpoint_is_refused(tmp_path: Path) -> None:
    qfolder, _ = save_pair(tmp_path, Format("gptq", 4, 32))
    with pytest.raises(ValueError, match="--quantization awq does not match the model, a gptq"):
        LLM(str(qfolder), quantization="awq", **ENGINE_ARGS)


def test_requantizing_a_checkpoint_is_refused(tmp_path: Path) -> None:
    qfolder, _ = save_pair(tmp_path, Format("awq", 4, 32))
    with pytest.raises(ValueError, match="cannot re-quantize a awq checkpoint"):
        LLM(str(qfolder), quantization="int8", **ENGINE_ARGS)


@pytest.mark.slow
def test_tp2_splits_along_groups_and_matches_tp1(tmp_path: Path) -> None:
    qfolder, _ = save_pair(tmp_path, Format("gptq", 4, 32, sym=False))
    single, llm = _generate(qfolder)
    llm.shutdown()
    sharded, llm = _generate(qfolder, tensor_parallel_size=2, num_threads=1)
    runner = llm.engine.core.model_runner
    down = held(runner.model.model.layers[0].mlp.down_proj.weight)
    llm.shutdown()
    assert isinstance(down, WNA16Weight) and down.shape == (128, 128)  # K 256 / 2 ranks
    for (tokens_1, logprobs_1), (tokens_2, logprobs_2) in zip(single, sharded, strict=True):
        assert tokens_2 == tokens_1
        torch.testing.assert_close(logprobs_2, logprobs_1, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_tp2_refuses_a_group_across_ranks(tmp_path: Path) -> None:
    # o_proj's 128 input features over 2 ranks: 64 each, inside one group of 128.
    qfolder, _ = save_pair(tmp_path, Format("gptq", 8, 128))
    with pytest.raises(ValueError, match="a group of 128 input features would straddle"):
        LLM(str(qfolder), tensor_parallel_size=2, num_threads=1, **ENGINE_ARGS)


def test_fused_parts_with_different_act_orders_are_refused(tmp_path: Path) -> None:
    qfolder, _ = save_pair(tmp_path, Format("gptq", 4, 32, desc_act=True))
    name = "model.layers.0.self_attn.k_proj.g_idx"
    edit_checkpoint(qfolder, lambda t: t.__setitem__(name, t[name].flip(0).contiguous()))
    message = _load_error(qfolder)
    assert "model.layers.0.self_attn.qkv_proj.g_idx (part" in message
    assert "differs from the g_idx of the layer's other parts" in message
