"""Mixture-of-experts experts of GPTQ / AWQ checkpoints kept quantized (layers/quantization/
wna16_moe.py): a FusedMoE built under a checkpoint's quant method takes each expert's
qweight / qzeros / scales (/ g_idx) one expert at a time, repacks them into `WNA16Experts`
whose dequantization is the format's reference decoding (tests/layers/quantization/
checkpoints.py, code by code) expert by expert, holds exactly the packed bytes, and runs the
grouped expert path through each kernel table's wNa16 matmul as the float experts of the
dequantized weights do. Malformed expert tensors are refused naming the tensor;
`modules_to_not_convert` follows transformers' matching rule."""

from __future__ import annotations

import pytest
import torch

from model_server.kernels.fused_moe_torch import fused_experts_grouped, fused_experts_per_token
from model_server.kernels.table import TORCH_KERNELS
from model_server.layers.fused_moe import DOWN, GATE, UP, FusedMoE, softmax_topk
from model_server.layers.quantization.base import building_quantized_linears
from model_server.layers.quantization.wna16 import WNA16Config
from model_server.layers.quantization.wna16_moe import WNA16Experts
from model_server.models.quantization import matches_module_pattern
from model_server.platforms.cpu import CpuPlatform
from tests.layers.quantization.checkpoints import Format, quantize_layer, reference_dequantize

E, H, INTER, TOP_K = 4, 64, 96, 2
FORMATS = [
    Format("gptq", 4, 32),
    Format("gptq", 4, 32, sym=False, desc_act=True),
    Format("gptq", 8, -1),
    Format("awq", 4, 32),
]


def _checkpoint(fmt: Format, seed: int = 0) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Per-expert checkpoint tensors {(expert, proj): {qweight, ...}}, and the reference
    dequantized stacked float weights w13 [E, 2I, H], w2 [E, H, I]."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    w13, w2 = torch.empty(E, 2 * INTER, H), torch.empty(E, H, INTER)
    for e in range(E):
        for proj, shape in (("gate", (INTER, H)), ("up", (INTER, H)), ("down", (H, INTER))):
            w = torch.randn(*shape, generator=gen) * 0.05
            # gate and up read the same input: the same act-order (seed), as GPTQ's.
            t = quantize_layer(w, fmt, seed=100 * e + (2 if proj == "down" else 1))
            tensors[(e, proj)] = t
            ref = reference_dequantize(t, fmt, shape[1])
            if proj == "down":
                w2[e] = ref
            else:
                offset = 0 if proj == "gate" else INTER
                w13[e, offset : offset + INTER] = ref
    return tensors, w13, w2


def _load(moe: FusedMoE, tensors: dict) -> None:
    params = dict(moe.named_parameters())
    shard = {"gate": GATE, "up": UP, "down": DOWN}
    for (e, proj), parts in tensors.items():
        prefix = "w2" if proj == "down" else "w13"
        for suffix, value in parts.items():
            param = params[f"{prefix}_{suffix}"]
            name = f"experts.{e}.{proj}_proj.{suffix}"
            param.weight_loader(param, value, shard[proj], e, checkpoint_name=name)
    moe.quant_method.process_weights_after_loading(moe)


def _quantized_moe(
    fmt: Format, kernels=TORCH_KERNELS
) -> tuple[FusedMoE, torch.Tensor, torch.Tensor]:
    tensors, w13, w2 = _checkpoint(fmt)
    with building_quantized_linears(WNA16Config.from_quantization_config(fmt.config())):
        moe = FusedMoE(E, H, INTER, kernels=kernels)
    _load(moe, tensors)
    return moe, w13, w2


def _routing(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weights, ids = softmax_topk(torch.randn(num_tokens, E, generator=gen), TOP_K, True)
    return torch.randn(num_tokens, H, generator=gen), weights, ids


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_experts_repack_to_the_reference_decoding_and_packed_bytes(fmt: Format) -> None:
    moe, w13, w2 = _quantized_moe(fmt)
    assert isinstance(moe.w13_weight, WNA16Experts) and isinstance(moe.w2_weight, WNA16Experts)
    assert moe.w13_weight.shape == (E, 2 * INTER, H) and moe.w2_weight.shape == (E, H, INTER)
    torch.testing.assert_close(moe.w13_weight.dequantize(), w13, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(moe.w2_weight.dequantize(), w2, atol=1e-6, rtol=1e-5)
    # Only the packed layout is held: no checkpoint-format tensor, no float matrix.
    names = {name for name, _ in moe.named_parameters()}
    assert not any(n.startswith(("w13_q", "w2_q", "w13_scales", "w2_g")) for n in names)
    groups = {
        "w13": 1 if fmt.group_size == -1 else H // 32,
        "w2": 1 if fmt.group_size == -1 else INTER // 32,
    }
    for prefix, (n, k) in (("w13", (2 * INTER, H)), ("w2", (H, INTER))):
        experts = getattr(moe, f"{prefix}_weight")
        assert experts.codes.dtype == torch.uint8
        packed = (
            E * n * k * fmt.bits // 8 + 2 * E * n * groups[prefix] * 4
        )  # codes, scales, offsets
        perm = E * k * 8 if fmt.desc_act else 0
        held = sum(p.numel() * p.element_size() for p in experts.parameters())
        assert held == packed + perm, (prefix, held, packed + perm)
        assert (experts.perm is not None) == fmt.desc_act


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("num_tokens", [1, 9])
def test_quantized_experts_compute_the_dequantized_experts(fmt: Format, num_tokens: int) -> None:
    cpu = CpuPlatform().kernel_table()
    for kernels in (TORCH_KERNELS, cpu):
        moe, w13, w2 = _quantized_moe(fmt, kernels)
        x, weights, ids = _routing(num_tokens, seed=num_tokens)
        got = moe(x, weights, ids)
        want = fused_experts_grouped(x, w13, w2, weights, ids, TORCH_KERNELS)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        naive = fused_experts_per_token(x, moe.w13_weight, moe.w2_weight, weights, ids, kernels)
        torch.testing.assert_close(naive, want, atol=1e-4, rtol=1e-4)


def test_bf16_activations() -> None:
    moe, w13, w2 = _quantized_moe(Format("gptq", 4, 32), CpuPlatform().kernel_table())
    x, weights, ids = _routing(6, seed=3)
    got = moe(x.bfloat16(), weights, ids)
    want = fused_experts_grouped(x, w13, w2, weights, ids, TORCH_KERNELS)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def _build(fmt: Format) -> FusedMoE:
    with building_quantized_linears(WNA16Config.from_quantization_config(fmt.config())):
        return FusedMoE(E, H, INTER)


def test_an_expert_tensor_of_the_wrong_shape_names_it() -> None:
    fmt = Format("gptq", 4, 32)
    tensors, _, _ = _checkpoint(fmt)
    moe = _build(fmt)
    scales = tensors[(2, "up")]["scales"][:1]  # one group instead of H / 32
    with pytest.raises(ValueError) as info:
        moe.w13_scales.weight_loader(
            moe.w13_scales,
            scales,
            UP,
            2,
            checkpoint_name="model.layers.0.mlp.experts.2.up_proj.scales",
        )
    message = str(info.value)
    assert message.startswith("model.layers.0.mlp.experts.2.up_proj.scales: checkpoint tensor")
    assert "has shape (1, 96), expected (2, 96)" in message  # G = H / 32 groups of up's rows


def test_int_scales_and_a_bad_expert_id_are_refused() -> None:
    fmt = Format("awq", 4, 32)
    tensors, _, _ = _checkpoint(fmt)
    moe = _build(fmt)
    name = "model.layers.0.mlp.experts.1.down_proj.scales"
    with pytest.raises(ValueError, match=rf"^{name}: expected a float tensor"):
        moe.w2_scales.weight_loader(
            moe.w2_scales, tensors[(1, "down")]["scales"].int(), DOWN, 1, checkpoint_name=name
        )
    with pytest.raises(ValueError, match="expert 4 out of range"):
        moe.w2_scales.weight_loader(moe.w2_scales, tensors[(1, "down")]["scales"], DOWN, 4)


def test_gate_and_up_of_one_expert_must_share_their_act_order() -> None:
    fmt = Format("gptq", 4, 32, desc_act=True)
    tensors, _, _ = _checkpoint(fmt)
    moe = _build(fmt)
    moe.w13_g_idx.weight_loader(moe.w13_g_idx, tensors[(0, "gate")]["g_idx"], GATE, 0)
    # Another expert's order is its own business; the same expert's up must match its gate.
    moe.w13_g_idx.weight_loader(moe.w13_g_idx, tensors[(1, "up")]["g_idx"], UP, 1)
    with pytest.raises(ValueError, match="differs from the g_idx of the layer's other parts"):
        moe.w13_g_idx.weight_loader(
            moe.w13_g_idx, tensors[(0, "up")]["g_idx"].flip(0).contiguous(), UP, 0
        )


@pytest.mark.parametrize(
    ("name", "patterns", "hit"),
    [
        ("model.layers.0.block_sparse_moe.gate", ["gate"], True),  # AutoAWQ's Mixtral list
        ("model.layers.0.mlp.gate_up_proj", ["gate"], False),
        ("model.layers.0.mlp.shared_expert_gate", ["gate"], True),  # a suffix
        ("model.layers.1.self_attn.o_proj", ["model.layers.1"], True),  # a prefix to a boundary
        ("model.layers.11.self_attn.o_proj", ["model.layers.1"], False),
        ("model.layers.3.mlp.experts.0.down_proj", [r"model.layers.\d+.mlp.experts"], True),
        ("lm_head", ["lm_head", "gate"], True),
        ("model.layers.0.mlp.shared_expert.up_proj", ["shared_expert"], True),  # a run of names
        ("model.layers.0.mlp.shared_expert_gate", ["shared_expert"], False),
        ("model.layers.0.self_attn.q_proj", [], False),
    ],
)
def test_modules_to_not_convert_matching(name: str, patterns: list[str], hit: bool) -> None:
    assert matches_module_pattern(name, patterns) is hit
