"""Compiles every Triton kernel, as the engine launches it, for NVIDIA GPUs that are not here.

    python -m tools.compile_check                  # sm_80, sm_89, sm_90
    python -m tools.compile_check --arch 90 --preset llama-3.1-8b --dtype bf16
    python -m tools.compile_check --kv-cache-dtype int8,fp8_e4m3   # attention on those caches

The CPU test suite runs the kernels under the Triton interpreter, which accepts programs the GPU
compiler rejects (and runs bf16 dots upcast, unlike the GPU variant). This check closes that gap
without a GPU: it drives the real call sites (the `triton` attention backend's forward, the fused
RMSNorm / add+RMSNorm / SiLU-and-mul, the int8 and wNa16 matmuls, the fused-MoE grouped GEMMs of
MoE presets, the MLA latent decode of MLA presets, the pooling models' varlen attention, the
multi-LoRA shrink and expand) on small
CPU tensors shaped like real models' (the dummy presets' configs), with Triton's launcher swapped
for compile-only. Each launch goes through Triton's own pipeline down to a cubin (its bundled
ptxas) for the target architecture and is never executed, so outputs stay unwritten.

Per kernel variant it reports the dynamic shared memory a program needs against the
architecture's per-block limit, and the registers and spilled (local) bytes per thread from the
cubin (cuobjdump). Exit status 1 when a kernel fails to compile, needs more shared memory than
the architecture has, or more registers than a block may hold (registers per thread times the
block's threads over the 64 Ki register file: the launch would fail with "too many resources
requested"); spills are reported, not failed (they cost speed, not correctness).

The compile-only launcher reaches into Triton's runtime (`JITFunction.run`, the active driver
through kernels/triton_compat.py); it is written for Triton >= 3.4. Run it in a fresh process: the
kernel modules must be imported with TRITON_INTERPRET off, which `main` sets before importing them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class Arch:
    """A CUDA compute capability and what bounds a kernel on it."""

    capability: int  # e.g. 90 for sm_90
    gpus: str
    sm_count: int  # of the named GPU, so the backend picks the split-K it would pick there
    max_shared_bytes: int  # opt-in dynamic shared memory per block
    # 32-bit registers: a thread may address 255; one block's threads share a 64 Ki file.
    max_registers_per_thread: int = 255
    max_registers_per_block: int = 64 * 1024


ARCHS: dict[int, Arch] = {
    80: Arch(80, "A100", 108, 163 * 1024),
    86: Arch(86, "A10, RTX 30xx", 72, 99 * 1024),
    89: Arch(89, "L4, L40S, RTX 40xx", 58, 99 * 1024),
    90: Arch(90, "H100, H200", 132, 227 * 1024),
}
DEFAULT_ARCHS = (80, 89, 90)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(slots=True)
class ModelShape:
    """What the kernels' variants depend on, from an HF config (one tensor-parallel rank)."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    qk_norm: bool  # Qwen3 normalises per-head views of q and k
    # Mixture of experts (0: dense): routed experts, each expert's intermediate size, top k.
    num_experts: int = 0
    moe_intermediate_size: int = 0
    top_k: int = 0
    # Multi-head latent attention (DeepSeek-V2/V3; 0: none): the latent and rotary widths.
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    @classmethod
    def from_preset(cls, name: str) -> ModelShape:
        from model_server.loader.dummy import preset_file

        path = preset_file(name)
        if path is None:
            raise ValueError(f"no dummy preset named {name!r}")
        cfg = json.loads(Path(path).read_text())
        heads = cfg["num_attention_heads"]
        experts = (
            cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts")
        )
        return cls(
            name=name,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            qk_norm=cfg.get("model_type") == "qwen3",
            num_experts=experts or 0,
            moe_intermediate_size=(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
            if experts
            else 0,
            top_k=cfg.get("num_experts_per_tok", 0) if experts else 0,
            kv_lora_rank=cfg.get("kv_lora_rank") or 0,
            qk_rope_head_dim=cfg.get("qk_rope_head_dim") or 0,
        )


@dataclass(slots=True)
class Variant:
    """One compiled kernel variant (a distinct cubin) and where it was first launched from."""

    kernel: str
    arch: int
    case: str
    shared_bytes: int
    num_warps: int
    num_stages: int
    registers: int | None = None
    local_bytes: int | None = None


@dataclass(slots=True)
class Report:
    variants: list[Variant] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


class _TargetDriver:
    """The slice of Triton's driver interface that compiling (not launching) needs.

    The device index is the capability, so each architecture gets its own per-device kernel
    cache (and target) inside every JITFunction.
    """

    def __init__(self, capability: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.capability = capability
        self.target = GPUTarget("cuda", capability, 32)

    def get_current_device(self) -> int:
        return self.capability

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


@contextmanager
def compile_only(capability: int) -> Iterator[list[tuple[str, Any]]]:
    """Within the block, a kernel launch compiles for `capability` and returns without running.

    Yields the list of (kernel name, CompiledKernel) launched, in launch order.
    """
    from triton.runtime.jit import JITFunction

    from model_server.kernels.triton_compat import restore_active_driver, swap_active_driver

    launched: list[tuple[str, Any]] = []
    original_run = JITFunction.run

    def run(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        launched.append((self.fn.__name__, kernel))
        return kernel

    previous = swap_active_driver(_TargetDriver(capability))
    JITFunction.run = run
    try:
        yield launched
    finally:
        JITFunction.run = original_run
        restore_active_driver(previous)


_RESOURCE_LINE = re.compile(r"REG:(\d+).*?LOCAL:(\d+)")


def cubin_resources(cubin: bytes) -> tuple[int, int] | None:
    """(registers, local bytes) per thread of the cubin's kernel, from Triton's cuobjdump."""
    from model_server.kernels.triton_compat import cuobjdump_path

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            out = subprocess.run(
                [cuobjdump_path(), "--dump-resource-usage", f.name],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        except (OSError, subprocess.CalledProcessError):
            return None
    match = _RESOURCE_LINE.search(out)
    return (int(match[1]), int(match[2])) if match else None


# (name, [(cached tokens, new tokens) per request]). Decodes come first, as in the engine's steps.
# A wide decode batch fills the GPU without split-K; one long decode takes the split path.
ATTENTION_CASES: tuple[tuple[str, list[tuple[int, int]]], ...] = (
    ("decode batch", [(40, 1)] * 64),
    ("long decode (split-K)", [(4096, 1)]),
    ("prefill", [(0, 37), (0, 20)]),
    ("mixed: decodes + chunk after a cached prefix", [(40, 1)] * 3 + [(48, 16)]),
)


def attention_calls(
    shape: ModelShape,
    dtype: torch.dtype,
    block_size: int,
    sm_count: int,
    kv_cache_dtype: str = "auto",
) -> Iterator[tuple[str, Callable[[], object]]]:
    """The `triton` backend's forward (store K/V, decode, split reduce, prefill) per case, on a
    cache of `kv_cache_dtype` (--kv-cache-dtype: quantized ones with their scales)."""
    from model_server.kernels.kv_cache_dtype import resolve_kv_cache_dtype
    from model_server.layers.attention.triton_backend import TritonAttentionBackend
    from tools.kernel_bench import Case, Shape, build_case_inputs

    kv = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
    kshape = Shape(shape.num_heads, shape.num_kv_heads, shape.head_dim, block_size, dtype)
    for name, requests in ATTENTION_CASES:
        case = Case(name, requests)
        md, q, k, v, k_cache, v_cache = build_case_inputs(case, kshape, torch.device("cpu"))
        scales: dict[str, torch.Tensor] = {}
        if kv.quantized:
            k_cache, v_cache = (torch.zeros(c.shape, dtype=kv.storage) for c in (k_cache, v_cache))
            scales = {
                "k_scales": torch.zeros(k_cache.shape[:-1]),
                "v_scales": torch.zeros(k_cache.shape[:-1]),
            }
        elif kv.storage != dtype:
            k_cache, v_cache = k_cache.to(kv.storage), v_cache.to(kv.storage)
        backend = TritonAttentionBackend(
            shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.head_dim**-0.5
        )
        backend._sm_count = sm_count

        def forward(
            backend=backend, md=md, q=q, k=k, v=v, kc=k_cache, vc=v_cache, scales=scales
        ) -> object:
            return backend.forward(q, k, v, kc, vc, md, **scales)

        label = name if kv_cache_dtype == "auto" else f"{name}, {kv_cache_dtype} KV cache"
        yield label, forward


def fused_op_calls(
    shape: ModelShape, dtype: torch.dtype, num_tokens: int = 8
) -> Iterator[tuple[str, Callable[[], object]]]:
    """The fused ops (and the int8 and wNa16 matmuls) at the model's widths, in the layouts the
    decoder layers pass."""
    from model_server.kernels.activation import silu_and_mul
    from model_server.kernels.int8_linear import int8_linear
    from model_server.kernels.rms_norm import fused_add_rms_norm, rms_norm
    from model_server.kernels.rotary import rotary_embedding
    from model_server.kernels.wna16_linear import wna16_linear

    t, hidden, eps = num_tokens, shape.hidden_size, 1e-6
    x = torch.randn(t, hidden, dtype=dtype)
    weight = torch.ones(hidden, dtype=dtype)
    yield "rms_norm", lambda: rms_norm(x, weight, eps)
    yield "add + rms_norm", lambda: fused_add_rms_norm(x, x.clone(), weight, eps)
    if shape.qk_norm:
        # q's per-head view of the fused qkv projection: rows strided by the qkv width.
        width = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
        qkv = torch.randn(t, width, dtype=dtype)
        q = qkv[:, : shape.num_heads * shape.head_dim].view(t, shape.num_heads, shape.head_dim)
        head_weight = torch.ones(shape.head_dim, dtype=dtype)
        yield "q/k norm (head views)", lambda: rms_norm(q, head_weight, eps)
    gate_up = torch.randn(t, 2 * shape.intermediate_size, dtype=dtype)
    yield "silu_and_mul", lambda: silu_and_mul(gate_up)
    # Rotary on q/k views of the fused qkv projection (MLA models rotate their own slices).
    if not shape.kv_lora_rank:
        heads = shape.num_heads + 2 * shape.num_kv_heads
        qkv = torch.randn(t, heads * shape.head_dim, dtype=dtype)
        q_rot = qkv[:, : shape.num_heads * shape.head_dim].view(t, shape.num_heads, -1)
        k_rot = qkv[:, shape.num_heads * shape.head_dim :][:, : shape.num_kv_heads * shape.head_dim]
        k_rot = k_rot.view(t, shape.num_kv_heads, -1)
        cos_sin = torch.randn(64, shape.head_dim, dtype=dtype)
        positions = torch.arange(t)
        yield "rotary", lambda: rotary_embedding(positions, q_rot, k_rot, cos_sin)
    # --quantization int8: a decode-sized and a prefill-sized step (N only matters through its
    # divisibility, so a slice of the layer's outputs stands in for all of them).
    qweight = torch.zeros(256, hidden, dtype=torch.int8)
    scale = torch.ones(256, dtype=torch.bfloat16)  # as Int8Weight stores them
    for rows in (t, 64):
        xs = torch.randn(rows, hidden, dtype=dtype)
        yield f"int8 linear, {rows} rows", lambda xs=xs: int8_linear(xs, qweight, scale)
    # GPTQ / AWQ kept quantized: w4 g128 and w8 per-channel (the layout of kernels/portable.py).
    for bits, group in ((4, 128), (8, hidden)):
        if hidden % 32:
            continue
        codes = torch.zeros(256, hidden * bits // 8, dtype=torch.uint8)
        scales = torch.ones(256, hidden // group)
        offsets = torch.zeros(256, hidden // group)
        for rows in (t, 64):
            xs = torch.randn(rows, hidden, dtype=dtype)
            yield (
                f"w{bits}a16 linear g{group}, {rows} rows",
                lambda xs=xs, c=codes, s=scales, o=offsets, b=bits, g=group: wna16_linear(
                    xs, c, s, o, b, g
                ),
            )


def _standin(size: int, floor: int = 128) -> int:
    """A small size Triton specializes like `size` (it keys integer arguments, strides included,
    on divisibility by 16): stands in for a weight dimension without allocating the weight."""
    return floor + size % 16


def moe_calls(shape: ModelShape, dtype: torch.dtype) -> Iterator[tuple[str, Callable[[], object]]]:
    """The fused-MoE grouped GEMMs (gate_up with the token gather, down with the routing
    weights; kernels/fused_moe.py) at a decode and a prefill size, with the table's Triton
    SiLU-and-mul between them. Expert count and weight sizes are stand-ins (`_standin`): the
    variants depend on top k (A_ROW_DIV), the dtype and the sizes' divisibility only."""
    if not shape.num_experts:
        return
    from model_server.kernels.fused_moe import fused_experts_triton
    from model_server.kernels.table import triton_kernels

    experts = min(shape.num_experts, 8)
    hidden, inter = _standin(shape.hidden_size), _standin(shape.moe_intermediate_size)
    w13 = torch.zeros(experts, 2 * inter, hidden, dtype=dtype)
    w2 = torch.zeros(experts, hidden, inter, dtype=dtype)
    kernels = triton_kernels()
    for tokens in (1, 64):
        x = torch.zeros(tokens, hidden, dtype=dtype)
        ids = torch.randint(0, experts, (tokens, shape.top_k))
        weights = torch.full((tokens, shape.top_k), 1.0 / shape.top_k)
        yield (
            f"fused MoE top-{shape.top_k}, {tokens} tokens",
            lambda x=x, ids=ids, weights=weights: fused_experts_triton(
                x, w13, w2, weights, ids, kernels
            ),
        )


def mla_calls(
    shape: ModelShape, dtype: torch.dtype, block_size: int
) -> Iterator[tuple[str, Callable[[], object]]]:
    """The MLA latent decode (kernels/mla_decode.py) at the model's latent and rotary widths and
    head count: query [B, H, L + R] against the compressed cache [blocks, block_size, L + R]."""
    if not shape.kv_lora_rank:
        return
    from model_server.kernels.mla_decode import mla_decode_attention

    width = shape.kv_lora_rank + shape.qk_rope_head_dim
    for batch in (1, 32):
        query = torch.zeros(batch, shape.num_heads, width, dtype=dtype)
        cache = torch.zeros(4 * batch, block_size, width, dtype=dtype)
        seq_lens = torch.full((batch,), 3 * block_size, dtype=torch.int32)
        tables = torch.arange(4 * batch, dtype=torch.int32).view(batch, 4)
        yield (
            f"MLA decode, batch {batch}",
            lambda q=query, c=cache, s=seq_lens, t=tables: mla_decode_attention(
                q, c, s, t, shape.kv_lora_rank, 0.1
            ),
        )


def varlen_attention_calls(
    shape: ModelShape, dtype: torch.dtype
) -> Iterator[tuple[str, Callable[[], object]]]:
    """The pooling models' packed attention (kernels/varlen_attention_triton.py) at the model's
    heads: bidirectional (encoders) and causal (the decoder as an embedding model), on q/k/v
    views of a fused qkv projection."""
    if shape.kv_lora_rank:
        return
    from model_server.kernels.varlen_attention_triton import varlen_attention_triton

    q_width, kv_width = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    qkv = torch.zeros(40, q_width + 2 * kv_width, dtype=dtype)
    q, k, v = qkv[:, :q_width], qkv[:, q_width:-kv_width], qkv[:, -kv_width:]
    cu = torch.tensor([0, 5, 40], dtype=torch.int32)
    for causal in (False, True):
        yield (
            f"varlen attention, causal={causal}",
            lambda c=causal: varlen_attention_triton(
                q, k, v, cu, shape.num_heads, shape.num_kv_heads, 0.1, c
            ),
        )


def lora_calls(shape: ModelShape, dtype: torch.dtype) -> Iterator[tuple[str, Callable[[], object]]]:
    """Multi-LoRA layers' shrink and expand (kernels/batched_lora.py) on the model's fused q/k/v
    and down projections, ranks 16 and 64, adapters in float32 (the manager's choice off the
    native CPU kernel): a decode batch (the split-K shrink) and a prefill chunk of one adapter."""
    if shape.kv_lora_rank:
        return
    from model_server.kernels.batched_lora import lora_add_triton
    from model_server.kernels.batched_lora_torch import LoRARows
    from model_server.kernels.lora_weights import StackedLoRA

    hidden, q = shape.hidden_size, shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    layers = {
        "qkv": (hidden, ((0, q), (q, kv), (q + kv, kv))),
        "down": (shape.intermediate_size, ((0, hidden),)),
    }
    num_slots = 4
    for name, (in_features, slices) in layers.items():
        out_features = sum(size for _, size in slices)
        for rank in (16, 64):
            stacked = StackedLoRA(
                torch.zeros(num_slots, len(slices) * rank, in_features),
                torch.zeros(num_slots, rank, out_features),
                torch.zeros(num_slots, len(slices), dtype=torch.int32),
                slices,
            )
            for rows_name, slots in (
                ("decodes", [i % (num_slots + 1) - 1 for i in range(8)]),
                ("prefill chunk", [1] * 40),
            ):
                rows = LoRARows.build(slots, num_slots, "cpu")
                x = torch.zeros(len(slots), in_features, dtype=dtype)
                out = torch.zeros(len(slots), out_features, dtype=dtype)
                yield (
                    f"LoRA {name} rank {rank}, {rows_name}",
                    lambda x=x, out=out, rows=rows, stacked=stacked: lora_add_triton(
                        x, out, rows, stacked
                    ),
                )


def check(
    archs: Sequence[int],
    shapes: Sequence[ModelShape],
    dtypes: Sequence[str],
    block_size: int = 16,
    log: Callable[[str], None] = print,
    kv_cache_dtypes: Sequence[str] = ("auto",),
) -> Report:
    """Compiles every variant the call sites launch; see the module docstring."""
    report = Report()
    for capability in archs:
        arch = ARCHS[capability]
        seen: set[str] = set()
        for shape in shapes:
            for dtype_name in dtypes:
                dtype = DTYPES[dtype_name]
                calls = [
                    call
                    for kv in kv_cache_dtypes
                    for call in attention_calls(shape, dtype, block_size, arch.sm_count, kv)
                ]
                calls += fused_op_calls(shape, dtype)
                calls += moe_calls(shape, dtype)
                calls += mla_calls(shape, dtype, block_size)
                calls += varlen_attention_calls(shape, dtype)
                calls += lora_calls(shape, dtype)
                for case, call in calls:
                    where = f"sm_{capability} {shape.name} {dtype_name} {case}"
                    with compile_only(capability) as launched:
                        try:
                            call()
                        except Exception as exc:  # a compile error: report it, go on
                            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                            report.failures.append(f"{where}: {type(exc).__name__}: {first}")
                            log(f"FAIL {where}: {type(exc).__name__}: {exc}")
                            continue
                    for kernel_name, kernel in launched:
                        digest = kernel.metadata.hash
                        if digest in seen:
                            continue
                        seen.add(digest)
                        report.variants.append(_variant(kernel_name, kernel, arch, where, report))
    return report


def _variant(kernel_name: str, kernel: Any, arch: Arch, where: str, report: Report) -> Variant:
    md = kernel.metadata
    variant = Variant(
        kernel=kernel_name,
        arch=arch.capability,
        case=where,
        shared_bytes=md.shared,
        num_warps=md.num_warps,
        num_stages=md.num_stages,
    )
    resources = cubin_resources(kernel.asm["cubin"])
    if resources is not None:
        variant.registers, variant.local_bytes = resources
    threads = md.num_warps * 32
    if variant.registers is not None and (
        variant.registers > arch.max_registers_per_thread
        or variant.registers * threads > arch.max_registers_per_block
    ):
        report.failures.append(
            f"{where}: {kernel_name} needs {variant.registers} registers per thread x {threads} "
            f"threads; sm_{arch.capability} allows {arch.max_registers_per_thread} per thread "
            f"and {arch.max_registers_per_block} per block"
        )
    if md.shared > arch.max_shared_bytes:
        report.failures.append(
            f"{where}: {kernel_name} needs {md.shared / 1024:.1f} KiB of shared memory per "
            f"program; sm_{arch.capability} ({arch.gpus}) allows "
            f"{arch.max_shared_bytes // 1024} KiB"
        )
    return variant


def format_report(report: Report, archs: Sequence[int]) -> str:
    lines = [
        f"{'arch':<6} {'kernel':<24} {'warps':>5} {'stages':>6} {'shared KiB':>10} "
        f"{'regs':>5} {'spill B':>7}  first launched by"
    ]
    for v in report.variants:
        regs = "?" if v.registers is None else str(v.registers)
        spill = "?" if v.local_bytes is None else str(v.local_bytes)
        lines.append(
            f"sm_{v.arch:<3} {v.kernel:<24} {v.num_warps:>5} {v.num_stages:>6} "
            f"{v.shared_bytes / 1024:>10.1f} {regs:>5} {spill:>7}  {v.case}"
        )
    for capability in archs:
        arch = ARCHS[capability]
        mine = [v for v in report.variants if v.arch == capability]
        if not mine:
            continue
        peak = max(v.shared_bytes for v in mine)
        spilled = sum(1 for v in mine if v.local_bytes)
        regs = max((v.registers or 0) * v.num_warps * 32 for v in mine)
        lines.append(
            f"sm_{capability} ({arch.gpus}): {len(mine)} variants compiled; most shared memory "
            f"{peak / 1024:.1f} of {arch.max_shared_bytes // 1024} KiB; most registers per block "
            f"{regs} of {arch.max_registers_per_block}; {spilled} spill registers"
        )
    if report.failures:
        lines.append(f"{len(report.failures)} FAILED:")
        lines.extend(f"  {failure}" for failure in report.failures)
    else:
        lines.append("all kernels compiled")
    return "\n".join(lines)


def _parse_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    from model_server.loader.dummy import preset_names

    p = argparse.ArgumentParser(
        prog="python -m tools.compile_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--arch",
        default=",".join(str(a) for a in DEFAULT_ARCHS),
        help=f"compute capabilities, comma-separated, of: {', '.join(map(str, ARCHS))}",
    )
    p.add_argument(
        "--preset",
        default=",".join(preset_names()),
        help="model shapes, comma-separated dummy presets (default: all)",
    )
    p.add_argument("--dtype", default="bf16,fp16,fp32", help=f"of: {', '.join(DTYPES)}")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto,int8,fp8_e4m3,fp8_e5m2",
        help="KV cache dtypes the attention kernels are compiled for, comma-separated",
    )
    args = p.parse_args(argv)

    try:
        archs = [int(a) for a in _parse_list(args.arch)]
    except ValueError:
        p.error(f"--arch takes numbers such as 90, got {args.arch!r}")
    unknown = [a for a in archs if a not in ARCHS]
    if unknown:
        p.error(f"unknown --arch {unknown}; known: {', '.join(map(str, ARCHS))}")
    dtypes = _parse_list(args.dtype)
    if bad := [d for d in dtypes if d not in DTYPES]:
        p.error(f"unknown --dtype {bad}; known: {', '.join(DTYPES)}")
    try:
        shapes = [ModelShape.from_preset(name) for name in _parse_list(args.preset)]
    except ValueError as exc:
        p.error(f"{exc}; presets: {', '.join(preset_names())}")

    # Kernels decorated under the interpreter are not JITFunctions: nothing would compile.
    if "model_server.kernels.paged_decode" in sys.modules and os.environ.get("TRITON_INTERPRET"):
        print("compile_check must run in a fresh process without TRITON_INTERPRET", file=sys.stderr)
        return 2
    os.environ["TRITON_INTERPRET"] = "0"
    torch.manual_seed(0)
    from model_server.settings_spec import KV_CACHE_DTYPES

    kv_dtypes = _parse_list(args.kv_cache_dtype)
    if bad := [d for d in kv_dtypes if d not in KV_CACHE_DTYPES]:
        p.error(f"unknown --kv-cache-dtype {bad}; known: {', '.join(KV_CACHE_DTYPES)}")
    report = check(archs, shapes, dtypes, args.block_size, kv_cache_dtypes=kv_dtypes)
    print(format_report(report, archs))
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
