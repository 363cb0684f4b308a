"""Weight-only int8 quantization in situ (`--quantization int8`).

After the weights load, each linear layer's float weight W [N, K] (this rank's shard) is replaced
by int8 codes Q [N, K] and one bf16 scale per output row (symmetric, per output channel):

    s[n] = max_k |W[n, k]| / 127 (rounded up to a bf16 value),   Q[n, k] = round(W[n, k] / s[n])

The LM head is quantized too; a head tied to the input embedding gets its own int8 copy and the
embedding keeps its float table for lookups (a step gathers only a few of its rows). Norms,
embeddings and the KV cache stay in the model dtype.

The matmul is the model's `KernelTable.int8_linear` (the platform's choice). Decode steps read
each weight once per step, so at a few rows a step moves 1 byte per weight instead of 4 (fp32) or
2 (bf16): that is what makes batch-1 decode faster on bandwidth-bound CPUs. The portable
implementation (`kernels.portable.int8_linear_dequant`) dequantizes the whole matrix on every
call: correct, but slower than the float model; gcu and hpu, which have no int8 kernel, run it
for the memory (`Platform.quantization_methods` lists what each platform accepts).
`models.quantization.quantize_model` swaps the weights in.

Layouts (`Platform.int8_weights_layout`): "int8" holds `Int8Weight` (the `int8_linear` slot);
"wna16" holds the same weights as an 8-bit per-channel `WNA16Weight` (`quantize_int8_wna16`:
unsigned codes Q + 128 with offsets -128 s, every weight the same value s * Q exactly), so that
a platform with native wNa16 kernels runs `-q int8` on them, its native decoder step included.
"""

from __future__ import annotations

import torch
from torch import nn

from model_server.kernels.portable import dequantize_int8
from model_server.kernels.table import Int8LinearFn, KernelTable
from model_server.layers.quantization.base import QuantizedWeight
from model_server.layers.quantization.wna16 import WNA16Weight


class Int8Weight(QuantizedWeight):
    """A quantized weight in place of a float `weight` parameter: `dense` dispatches on it.

    The scales are stored in bf16 and are exactly the values the codes were made with, so kernels
    that take bf16 scales (PyTorch's int8 weight-only matmul) and kernels that widen them to
    float32 apply the same scales. Its tensors are parameters (without grad) so that
    `model.parameters()` still lists every byte a step reads (see benchmarks/bandwidth.py).
    """

    method = "int8"

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.qweight = nn.Parameter(qweight, requires_grad=False)  # [N, K] int8
        # [N] bf16; `scale` must hold bf16 values already (quantize_int8 rounds them up).
        self.scale = nn.Parameter(scale.to(torch.bfloat16), requires_grad=False)

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int8(self.qweight, self.scale, dtype)

    def apply(
        self, x: torch.Tensor, bias: torch.Tensor | None, kernels: KernelTable
    ) -> torch.Tensor:
        return int8_dense(x, self, bias, kernels.int8_linear)

    def extra_repr(self) -> str:
        return f"int8 {tuple(self.qweight.shape)}, per-row scales"


def _round_up_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """The smallest bf16 value >= x, for positive finite float32 x (as float32)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & ~0xFFFF).view(torch.float32)


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """weight [N, K] float -> Int8Weight, weight ~= scale[:, None] * qweight.

    scale = max|row| / 127 rounded up to a bf16 value (a step at most 0.4 % coarser), so every
    code fits in [-127, 127] and the error per weight is at most scale / 2.
    """
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: codes 0
    scale = _round_up_to_bf16(scale)  # float32 holding bf16 values: the cast below is exact
    qweight = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(qweight, scale)


def quantize_int8_wna16(weight: torch.Tensor) -> WNA16Weight:
    """weight [N, K] float -> `quantize_int8`'s weights in the wNa16 layout (kernels/
    portable.py): codes [N, K] uint8 = Q + 128 (Q's bits with the sign bit flipped), scales
    [N, 1] float32 = s and offsets -128 s, so scales * codes + offsets is s * Q exactly (s has
    a bf16 mantissa and Q + 128 eight bits: the product and the sum are exact in float32)."""
    q = quantize_int8(weight)
    codes = (q.qweight.view(torch.uint8) ^ 0x80).contiguous()
    scales = q.scale.float().reshape(-1, 1).contiguous()
    k = int(codes.shape[1])
    return WNA16Weight("int8", 8, k, codes, scales, (-128.0 * scales).contiguous(), None)


def int8_dense(
    x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None, int8_linear: Int8LinearFn
) -> torch.Tensor:
    """x [..., K] @ dequantized(weight)^T + bias -> [..., N] in x's dtype, through the
    `int8_linear` kernel (which takes 2-D inputs)."""
    if x.dim() == 2:
        return int8_linear(x, weight.qweight, weight.scale, bias)
    lead = x.shape[:-1]
    out = int8_linear(x.reshape(-1, x.shape[-1]), weight.qweight, weight.scale, bias)
    return out.view(*lead, out.shape[-1])
