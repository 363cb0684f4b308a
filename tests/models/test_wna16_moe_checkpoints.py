"""GPTQ and AWQ mixture-of-experts checkpoints served with the experts kept quantized, through
the whole engine (`LLM`): tiny random Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V2 models
saved by transformers, then quantized by `wick quantize` (GPTQ w4 g32 symmetric, asymmetric
with act-order, AWQ w4 g32),
against the same model saved as float with every quantized matrix replaced by its reference
dequantization (tests/layers/quantization/checkpoints.py, code by code from the format). The
logprobs of 32 greedy tokens agree to float rounding and the tokens are equal; the experts hold
exactly their packed bytes; the routers stay float; `modules_to_not_convert` keeps what it
names in float; a malformed expert tensor fails with one error naming it; tensor parallelism
splits every expert along whole groups (and refuses a group across ranks)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from model_server.engine.llm import LLM
from model_server.entrypoints.cli import main as cli_main
from model_server.layers.fused_moe import FusedMoE
from model_server.layers.linear import LinearBase
from model_server.layers.quantization.wna16 import WNA16Weight
from model_server.layers.quantization.wna16_moe import WNA16Experts
from model_server.sampling_params import SamplingParams
from tests.layers.quantization.checkpoints import Format, reference_dequantize
from tests.models.test_parity_tiny import _COMMON, VOCAB
from tests.weights import held, holds_float

NUM_TOKENS = 32
ENGINE_ARGS = dict(
    dtype="float32",
    max_model_len=96,
    block_size=4,
    kv_cache_memory=2 * 1024**2,
    max_num_batched_tokens=16,
)
PROMPTS = [[(7 * i + 3) % VOCAB for i in range(13)], [(11 * i + 5) % VOCAB for i in range(21)]]

# Sizes are multiples of 32 (4-bit codes come in blocks of 32 input features).
CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "mixtral": lambda: transformers.MixtralConfig(
        **{**_COMMON, "intermediate_size": 96},
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=None,
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **_COMMON,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        norm_topk_prob=False,
        mlp_only_layers=[1],
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **_COMMON,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
    # MLA attention (its projections quantized too; kv_b_proj dequantized at load, the rope
    # rows of q and kv_a de-interleaved in the packed layout), a dense first layer, shared
    # experts, group-limited routing.
    "deepseek_v2": lambda: transformers.DeepseekV2Config(
        **{**_COMMON, "intermediate_size": 96},
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        moe_intermediate_size=32,
        n_shared_experts=2,
        n_routed_experts=8,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
    ),
}
FORMATS = [
    Format("gptq", 4, 32),
    Format("gptq", 4, 32, sym=False, desc_act=True),
    Format("awq", 4, 32),
]
# What `wick quantize` gets for each format.
FLAGS = {
    "gptq-w4-g32": ["--group-size", "32"],
    "gptq-w4-g32-asym-actorder": ["--group-size", "32", "--asym", "--desc-act"],
    "awq-w4-g32": ["--method", "awq", "--group-size", "32"],
}


def save_float(name: str, folder: Path) -> Path:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]())
    hf.save_pretrained(folder, safe_serialization=True)
    return folder


def wick_quantize(model: Path, out: Path, *flags: str) -> Path:
    with pytest.raises(SystemExit) as done:
        cli_main(["quantize", "--model", str(model), "--output", str(out), *flags])
    assert done.value.code == 0
    return out


def dequantized_copy(qfolder: Path, out: Path, fmt: Format) -> Path:
    """The quantized folder as a float checkpoint: every matrix the reference decoding of its
    qweight / qzeros / scales (/ g_idx), config without quantization_config."""
    tensors = load_file(str(qfolder / "model.safetensors"))
    floats: dict[str, torch.Tensor] = {}
    prefixes = {n.removesuffix(".qweight") for n in tensors if n.endswith(".qweight")}
    for name, tensor in tensors.items():
        prefix, suffix = name.rsplit(".", 1)
        if prefix not in prefixes or suffix not in ("qweight", "qzeros", "scales", "g_idx"):
            floats[name] = tensor.float()  # also the biases of quantized projections
        elif name.endswith(".qweight"):
            parts = {s: tensors[f"{prefix}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx")
                     if f"{prefix}.{s}" in tensors}  # fmt: skip
            k = tensor.shape[0] * (8 if fmt.method == "gptq" else 1)
            floats[f"{prefix}.weight"] = reference_dequantize(parts, fmt, k)
    out.mkdir()
    save_file(floats, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((qfolder / "config.json").read_text())
    del config["quantization_config"]
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config))
    return out


def generate(folder: Path, **kwargs: object) -> tuple[list[tuple[list[int], list[float]]], LLM]:
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    llm = LLM(str(folder), **{**ENGINE_ARGS, **kwargs})
    outputs = llm.generate(PROMPTS, params)
    result = [
        (o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outputs
    ]
    return result, llm


@pytest.fixture(scope="module")
def float_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-float")
    return {name: save_float(name, root / name) for name in CONFIGS}


def _check_layout(model: torch.nn.Module, name: str, fmt: Format) -> None:
    config = CONFIGS[name]()
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    dense = {"qwen2_moe": 1, "deepseek_v2": 1}.get(name, 0)  # mlp_only_layers, first_k_dense
    assert len(experts) == 2 - dense
    h = config.hidden_size
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    num_experts = next(
        getattr(config, a) for a in ("num_local_experts", "num_experts", "n_routed_experts")
        if getattr(config, a, None)
    )  # fmt: skip
    for moe in experts:
        # The experts hold their packed codes and per-group scales and offsets, nothing else
        # (act-order adds each expert's permutation of its inputs).
        assert moe.quant_method is not None
        for weight, (n, k) in ((moe.w13_weight, (2 * inter, h)), (moe.w2_weight, (h, inter))):
            assert isinstance(weight, WNA16Experts) and weight.method == fmt.method
            packed = num_experts * (n * k // 2 + 2 * 4 * n * (k // 32))
            # (One group holds every input feature in any order: no permutation is kept.)
            permuted = fmt.desc_act and k > 32
            perm = num_experts * k * 8 if permuted else 0
            held_bytes = sum(p.numel() * p.element_size() for p in weight.parameters())
            assert held_bytes == packed + perm
            assert sum(1 for _ in weight.parameters()) == 3 + permuted
    for module_name, module in model.named_modules():
        if isinstance(module, LinearBase):
            router = module_name.endswith((".mlp.gate", ".shared_expert_gate"))
            if router:  # the router and the shared expert's gate stay float
                assert holds_float(module.weight) and module.quant_method is None
            else:
                assert isinstance(held(module.weight), WNA16Weight), module_name
    for module_name, module in model.named_modules():
        if module_name.endswith("kv_b_proj"):  # MLA reads it as a matrix: dequantized at load
            assert module.weight.dtype == torch.float32 and module.weight.dim() == 2
            assert not any(n != "weight" for n, _ in module.named_parameters())


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_quantized_experts_match_the_dequantized_model(
    name: str, fmt: Format, float_folders: dict[str, Path], tmp_path: Path
) -> None:
    qfolder = wick_quantize(float_folders[name], tmp_path / "q", *FLAGS[fmt.name])
    stored = load_file(str(qfolder / "model.safetensors"))
    layer = 1 if name == "deepseek_v2" else 0  # its first layer is dense
    expert = "block_sparse_moe.experts.3.w2" if name == "mixtral" else "mlp.experts.3.down_proj"
    assert f"model.layers.{layer}.{expert}.qweight" in stored
    assert f"model.layers.{layer}.{expert}.weight" not in stored
    router = "block_sparse_moe.gate" if name == "mixtral" else "mlp.gate"
    assert stored[f"model.layers.{layer}.{router}.weight"].is_floating_point()
    quantized, llm = generate(qfolder)
    try:
        runner = llm.engine.core.model_runner
        assert runner.quantization_description == fmt.config()["quant_method"] + (
            " w4 g32 act-order" if fmt.desc_act else " w4 g32"
        )
        assert not runner.graphs_enabled()  # no device graphs over the grouped quantized path
        _check_layout(runner.model, name, fmt)
    finally:
        llm.shutdown()
    dequantized, llm = generate(dequantized_copy(qfolder, tmp_path / "f", fmt))
    llm.shutdown()
    for (tokens_q, logprobs_q), (tokens_f, logprobs_f) in zip(quantized, dequantized, strict=True):
        assert len(tokens_q) == NUM_TOKENS
        assert tokens_q == tokens_f
        torch.testing.assert_close(logprobs_q, logprobs_f, atol=1e-3, rtol=1e-3)


def test_bf16_activations_agree_with_the_dequantized_model(
    float_folders: dict[str, Path], tmp_path: Path
) -> None:
    """In bf16 the two are different products (the kernel multiplies the exact dequantized
    values, the float model their bf16 roundings), so greedy paths part after a few tokens on
    these flat random models (measured: at tokens 6-19 of 32, or never); until they part, the
    logprobs agree to bf16 rounding."""
    qfolder = wick_quantize(float_folders["mixtral"], tmp_path / "q", "--group-size", "32")
    quantized, llm = generate(qfolder, dtype="bfloat16")
    llm.shutdown()
    ffolder = dequantized_copy(qfolder, tmp_path / "f", FORMATS[0])
    dequantized, llm = generate(ffolder, dtype="bfloat16")
    llm.shutdown()
    for (tokens_q, logprobs_q), (tokens_f, logprobs_f) in zip(quantized, dequantized, strict=True):
        same = next(
            (i for i, (a, b) in enumerate(zip(tokens_q, tokens_f, strict=True)) if a != b),
            NUM_TOKENS,
        )
        assert same >= 4, (tokens_q, tokens_f)
        torch.testing.assert_close(logprobs_q[:same], logprobs_f[:same], atol=3e-2, rtol=3e-2)


def test_modules_to_not_convert_stay_float(float_folders: dict[str, Path], tmp_path: Path) -> None:
    qfolder = wick_quantize(
        float_folders["qwen2_moe"],
        tmp_path / "q",
        "--group-size", "32",
        "--modules-to-not-convert", "o_proj",
        "--modules-to-not-convert", "shared_expert",
    )  # fmt: skip
    config = json.loads((qfolder / "config.json").read_text())
    assert config["quantization_config"]["modules_to_not_convert"] == ["o_proj", "shared_expert"]
    stored = load_file(str(qfolder / "model.safetensors"))
    assert "model.layers.0.self_attn.o_proj.weight" in stored
    assert "model.layers.0.mlp.shared_expert.gate_proj.weight" in stored
    assert "model.layers.0.mlp.experts.0.gate_proj.qweight" in stored
    quantized, llm = generate(qfolder)
    try:
        model = llm.engine.core.model_runner.model
        layer = model.model.layers[0]
        assert holds_float(layer.self_attn.o_proj.weight)
        assert isinstance(held(layer.self_attn.qkv_proj.weight), WNA16Weight)
        assert holds_float(layer.mlp.shared_expert.down_proj.weight)
        assert isinstance(layer.mlp.experts.w13_weight, WNA16Experts)
    finally:
        llm.shutdown()
    dequantized, llm = generate(dequantized_copy(qfolder, tmp_path / "f", FORMATS[0]))
    llm.shutdown()
    assert [t for t, _ in quantized] == [t for t, _ in dequantized]


def _load_error(folder: Path, **kwargs: object) -> str:
    with pytest.raises(ValueError) as info:
        LLM(str(folder), **{**ENGINE_ARGS, **kwargs})
    return str(info.value)


def _edit(folder: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_a_malformed_expert_tensor_is_named(float_folders: dict[str, Path], tmp_path: Path) -> None:
    qfolder = wick_quantize(float_folders["mixtral"], tmp_path / "q", "--group-size", "32")
    name = "model.layers.1.block_sparse_moe.experts.2.w3.scales"
    _edit(qfolder, lambda t: t.__setitem__(name, t[name][:1].contiguous()))  # 1 group, not 2
    message = _load_error(qfolder)
    assert f"{name}: checkpoint tensor has shape (1, 96), expected (2, 96)" in message
    _edit(qfolder, lambda t: t.pop(name))
    message = _load_error(qfolder)
    assert "model.layers.1.mlp.experts.w13_scales" in message and "(2, 'up')" in message


def test_an_unquantized_expert_in_a_quantized_checkpoint_is_refused(
    float_folders: dict[str, Path], tmp_path: Path
) -> None:
    qfolder = wick_quantize(float_folders["qwen2_moe"], tmp_path / "q", "--group-size", "32")
    prefix = "model.layers.0.mlp.experts.1.up_proj"

    def float_up(t: dict[str, torch.Tensor]) -> None:
        for s in ("qweight", "qzeros", "scales", "g_idx"):
            t.pop(f"{prefix}.{s}")
        t[f"{prefix}.weight"] = torch.zeros(64, 64)

    _edit(qfolder, float_up)
    assert f"checkpoint tensor {prefix}.weight matches no parameter" in _load_error(qfolder)


@pytest.mark.slow
def test_tp2_splits_every_expert_along_groups_and_matches_tp1(
    float_folders: dict[str, Path], tmp_path: Path
) -> None:
    qfolder = wick_quantize(
        float_folders["qwen2_moe"], tmp_path / "q", "--group-size", "32", "--asym"
    )
    single, llm = generate(qfolder)
    llm.shutdown()
    sharded, llm = generate(qfolder, tensor_parallel_size=2, num_threads=1)
    moe = llm.engine.core.model_runner.model.model.layers[0].mlp.experts
    # This rank's half of every expert's intermediate dim: gate|up rows, down's input features.
    assert moe.w13_weight.shape == (4, 64, 64) and moe.w2_weight.shape == (4, 64, 32)
    llm.shutdown()
    for (tokens_1, logprobs_1), (tokens_2, logprobs_2) in zip(single, sharded, strict=True):
        assert tokens_2 == tokens_1
        torch.testing.assert_close(logprobs_2, logprobs_1, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_tp2_refuses_an_expert_group_across_ranks(
    float_folders: dict[str, Path], tmp_path: Path
) -> None:
    # Each expert's 64 intermediate features over 2 ranks: 32 each, inside one group of 64.
    # (o_proj's 64 inputs would straddle first: the checkpoint leaves it float.)
    qfolder = wick_quantize(
        float_folders["qwen2_moe"],
        tmp_path / "q",
        "--group-size", "64",
        "--modules-to-not-convert", "o_proj",
    )  # fmt: skip
    message = _load_error(qfolder, tensor_parallel_size=2, num_threads=1)
    assert re.search(r"a group of 64 input features would straddle two tensor-parallel ranks "
                     r"in model\.layers\.\d\.mlp\.experts\.\d\.down_proj\.\w+ \(this rank's "
                     r"input features (0-32|32-64) of 64\)", message), message  # fmt: skip
