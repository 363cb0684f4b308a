"""The CPU's linear plan as weights: one `PlannedWeight` per planned linear layer, from the
tuner's `SitePlan`s (kernels/cpu/linear_tuning.py).

Float weights get their kernels bound to them (the dense tensor, or the packed copy that took
its values' place); quantized weights (int8, GPTQ/AWQ, GGUF) keep their own `apply` and get the
model's kernel table with their planned slot in place (a `RowBucketDispatch`, per GGUF segment
a `GGUFSegmentDispatch`). Nothing here changes the model: the model-preparation stage installs
the weights.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from model_server.kernels.cpu.linear_tuning import BlocksBesideFloat, SitePlan, panels_prefetch
from model_server.kernels.cpu.panel_gemm import Panels, panel_silu_and_mul, silu_and_mul_applies
from model_server.kernels.planned_weight import (
    GGUFSegmentDispatch,
    PlannedWeight,
    RowBucketDispatch,
    bucket_index,
)
from model_server.kernels.table import KernelTable


def _bind(
    fn: Callable[..., torch.Tensor],
    weight: torch.Tensor | None,
    x: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    return fn(x, weight, bias)


def _fused_silu_and_mul(
    panels: Panels, prefetch: tuple[bool, ...], x: torch.Tensor
) -> torch.Tensor:
    """panel_silu_and_mul with the prefetch the plan chose at x's row bucket (as the native
    step's WickLinear.hw_prefetch_only)."""
    return panel_silu_and_mul(x, panels, prefetch=prefetch[bucket_index(x.shape[0], len(prefetch))])


def _blocks_call(
    holder: torch.nn.Module, kernels: KernelTable, x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return holder.apply(x, bias, kernels)  # type: ignore[operator]


def planned_weights(
    plans: Sequence[SitePlan | BlocksBesideFloat], table: KernelTable, dtype: torch.dtype
) -> dict[str, PlannedWeight]:
    """Module name -> its planned weight, for every module with a plan (`table`: the model's
    kernel table; `dtype`: the activations')."""
    by_module: dict[str, list[SitePlan]] = {}
    out: dict[str, PlannedWeight] = {}
    for plan in plans:
        if isinstance(plan, BlocksBesideFloat):
            out[plan.module] = _beside_twin(plan, table, dtype)
        else:
            by_module.setdefault(plan.site.module, []).append(plan)
    for module, site_plans in by_module.items():
        first = site_plans[0]
        site, holder = first.site, first.site.holder
        if site.ggml_type is not None:
            out[module] = _gguf_weight(site_plans, table, dtype)
        elif site.bits:
            out[module] = PlannedWeight(
                shape=tuple(holder.shape),
                dtype=dtype,
                kernel_names=first.names,
                layout=f"{holder.method} codes",
                source=holder,
                kernels=replace(table, wna16_linear=RowBucketDispatch(first.fns)),
            )
        elif site.weight.dtype == torch.int8:
            out[module] = PlannedWeight(
                shape=tuple(holder.shape),
                dtype=dtype,
                kernel_names=first.names,
                layout="int8 codes",
                source=holder,
                kernels=replace(table, int8_linear=RowBucketDispatch(first.fns)),
            )
        else:
            out[module] = _float_weight(first)
    return out


def _gguf_weight(
    site_plans: Sequence[SitePlan], table: KernelTable, dtype: torch.dtype
) -> PlannedWeight:
    """A GGUF weight in its blocks: per segment (ggml type, rows) its kernel per row bucket."""
    dispatch = GGUFSegmentDispatch(
        tuple(((p.site.ggml_type, p.site.weight.shape[0]), p.fns) for p in site_plans),
        table.gguf_linear,
    )
    names = tuple(
        "|".join(dict.fromkeys(n for p in site_plans for n in p.names[i : i + 1]))
        for i in range(max(len(p.names) for p in site_plans))
    )
    holder = site_plans[0].site.holder
    return PlannedWeight(
        shape=tuple(holder.shape),
        dtype=dtype,
        kernel_names=names,
        layout="gguf blocks",
        source=holder,
        kernels=replace(table, gguf_linear=dispatch),
    )


def _beside_twin(plan: BlocksBesideFloat, table: KernelTable, dtype: torch.dtype) -> PlannedWeight:
    """The blocks for the leading buckets and the float twin for the rest; either alone where
    the other runs no bucket (the unused one is dropped with its memory)."""
    twin = _float_weight(plan.twin)
    cut = plan.blocks_buckets
    if cut == 0:
        return twin
    blocks = _gguf_weight(plan.blocks, table, dtype)
    if cut >= len(twin.calls):
        return blocks
    assert blocks.kernels is not None
    call = functools.partial(_blocks_call, blocks.source, blocks.kernels)
    return PlannedWeight(
        shape=tuple(blocks.shape),
        dtype=dtype,
        kernel_names=blocks.kernel_names[:cut] + twin.kernel_names[cut:],
        layout="gguf blocks",
        source=blocks.source,
        calls=(call,) * cut + twin.calls[cut:],
        kernels=blocks.kernels,
        twin=twin,
        blocks_buckets=cut,
    )


def _float_weight(plan: SitePlan) -> PlannedWeight:
    weight = plan.site.weight
    source = None if plan.values_moved else weight
    calls = tuple(functools.partial(_bind, fn, source) for fn in plan.fns)
    panels = plan.packed if isinstance(plan.packed, Panels) else None
    fused = None
    if plan.values_moved and panels is not None and silu_and_mul_applies(panels):
        prefetch = tuple(map(panels_prefetch, plan.names))
        fused = functools.partial(_fused_silu_and_mul, panels, prefetch)
    layout = "dense"
    if plan.packed_kind is not None:
        layout = plan.packed_kind if plan.values_moved else f"dense + {plan.packed_kind} copy"
    return PlannedWeight(
        shape=(int(weight.shape[0]), int(weight.shape[1])),
        dtype=weight.dtype,
        kernel_names=plan.names,
        layout=layout,
        source=source,
        calls=calls,
        packed=plan.packed,
        packed_data=panels.data if plan.values_moved and panels is not None else None,
        fused_silu_and_mul=fused,
    )
