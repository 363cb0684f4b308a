"""What `--kv-cache-dtype` stores: a float cache, or quantized K/V with per-token-per-head scales.

Float caches (`auto`: the model's dtype, `bfloat16`, `float16`) are one tensor per layer,
[2 (k, v), num_blocks, block_size, Hkv, D], as always; K/V are cast on store and read back in
the query's dtype.

Quantized caches (`int8`, `fp8_e4m3`, `fp8_e5m2`) are a `QuantizedKVCache` per layer: the codes
in that same layout (int8, or torch's float8_e4m3fn / float8_e5m2) and, beside the blocks,
`scales` [2, num_blocks, block_size, Hkv] float32, one per token and KV head. A K or V row x
(head_dim values) is stored as codes = x / s rounded to the format (int8: round half to even,
clamped to [-127, 127]; fp8: torch's round-to-nearest-even cast, clamped to the format's
largest finite value) with s = max|x| / QMAX, QMAX the format's largest code magnitude (127,
448, 57344); an all-zero row has s = 0 and codes 0. It reads back as codes * s.

Float32 scales, not bf16: 4 bytes per row of head_dim codes (6 % of a 64-value row) buy exact
scales, and every kernel (C, Triton, PyTorch) multiplies them without a conversion.

Every attention backend stores and reads these formats (torch_backend.py, cpu_backend.py through
kernels/cpu/paged_attention.c, triton_backend.py through kernels/store_kv.py and the shared
attention tile); this module is the reference they are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.float32

# The kernels' format codes (`KV_QUANT` in the Triton kernels, `kv` in paged_attention.c).
FLOAT, INT8, FP8_E4M3, FP8_E5M2 = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class KVCacheDtype:
    """A resolved `--kv-cache-dtype`: `storage` is the cache tensors' element type."""

    name: str  # bfloat16 | float16 | float32 | int8 | fp8_e4m3 | fp8_e5m2
    storage: torch.dtype
    qmax: float  # the largest code magnitude; 0 for float caches
    code: int  # FLOAT, INT8, FP8_E4M3 or FP8_E5M2

    @property
    def quantized(self) -> bool:
        return self.code != FLOAT

    def bytes_per_token_head(self, head_dim: int) -> int:
        """One token's K (or V) row of one KV head, its scale included."""
        elem = torch.empty((), dtype=self.storage).element_size()
        return head_dim * elem + (SCALE_DTYPE.itemsize if self.quantized else 0)


_QUANTIZED: dict[str, KVCacheDtype] = {
    "int8": KVCacheDtype("int8", torch.int8, 127.0, INT8),
    "fp8_e4m3": KVCacheDtype("fp8_e4m3", torch.float8_e4m3fn, 448.0, FP8_E4M3),
    "fp8_e5m2": KVCacheDtype("fp8_e5m2", torch.float8_e5m2, 57344.0, FP8_E5M2),
}
_FLOATS = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> KVCacheDtype:
    """`--kv-cache-dtype` (settings_spec.KV_CACHE_DTYPES) for a model running in `model_dtype`."""
    if name in _QUANTIZED:
        return _QUANTIZED[name]
    storage = model_dtype if name == "auto" else _FLOATS.get(name)
    if storage is None:
        raise ValueError(f"unknown kv_cache_dtype {name!r}")
    return KVCacheDtype(str(storage).removeprefix("torch."), storage, 0.0, FLOAT)


def kv_dtype_of(storage: torch.dtype) -> KVCacheDtype:
    """The quantized format stored as `storage` (int8, float8_e4m3fn, float8_e5m2)."""
    for kv in _QUANTIZED.values():
        if kv.storage == storage:
            return kv
    raise ValueError(f"{storage} is not a quantized KV cache dtype")


def quantize_kv(
    x: torch.Tensor, kv: KVCacheDtype, fixed_scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D] in kv.storage, scales [...] float32): the reference of
    every backend's store (see the module docstring). `fixed_scale`: every row's scale (a
    static per-layer one, `QuantizedKVCache.fixed_scale`) instead of its own."""
    xf = x.to(torch.float32)
    if fixed_scale is not None:
        scales = torch.full(xf.shape[:-1], fixed_scale, dtype=torch.float32, device=xf.device)
    else:
        amax = xf.abs().amax(dim=-1)
        # A tensor divisor: CUDA divides by a Python scalar as a product with its reciprocal,
        # which can differ from the correctly rounded quotient every other backend stores.
        scales = amax / torch.full_like(amax, kv.qmax)
    # An all-zero row divides by 1 instead of 0: its codes are 0 either way.
    y = xf / torch.where(scales > 0, scales, 1.0)[..., None]
    y = y.clamp(-kv.qmax, kv.qmax)
    codes = y.round().to(torch.int8) if kv.code == INT8 else y.to(kv.storage)
    return codes, scales


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., D] (any quantized storage), scales [...] -> [..., D] in `dtype`."""
    return (codes.to(torch.float32) * scales[..., None]).to(dtype)


@dataclass(slots=True)
class QuantizedKVCache:
    """One layer's quantized KV cache: what models pass to `Attention` in place of a tensor."""

    data: torch.Tensor  # [2 (k, v), num_blocks, block_size, Hkv, D] codes
    scales: torch.Tensor  # [2 (k, v), num_blocks, block_size, Hkv] float32
    # A static scale every stored K and V row takes (--quantization-param-path: the layer's
    # calibrated one; rows beyond qmax * scale clamp); None: each row's own max|x| / qmax.
    fixed_scale: float | None = None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


def allocate_kv_cache(
    shape: tuple[int, ...], kv: KVCacheDtype, zeros, fixed_scale: float | None = None
) -> torch.Tensor | QuantizedKVCache:
    """One layer's cache of `shape` ([2, num_blocks, block_size, Hkv, D]) in `kv`'s format;
    `zeros(shape, dtype)` allocates on the device (Platform.allocate_zeros); `fixed_scale`:
    the layer's static scale (quantized caches only)."""
    data = zeros(shape, kv.storage)
    if not kv.quantized:
        if fixed_scale is not None:
            raise ValueError(f"a static KV scale needs a quantized cache, not {kv.name}")
        return data
    return QuantizedKVCache(data, zeros(shape[:-1], SCALE_DTYPE), fixed_scale)


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A quantized cache's codes as uint8 / int8 (fp8 tensors lack index_copy_ on CPU)."""
    return (
        cache.view(torch.uint8)
        if cache.dtype.itemsize == 1 and cache.is_floating_point()
        else cache
    )
