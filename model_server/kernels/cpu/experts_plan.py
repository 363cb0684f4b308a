"""How a model's stacked float experts run on the CPU, decided once at preparation (an
`ExpertsPlan`), and the weight holder of experts packed into panels (`PanelExperts`).

The stacked layout (`FusedMoE.w13_weight` [E, 2I, H], `w2_weight` [E, H, I], as loaded) runs
each expert's slice through gemm.c's skinny matmul (kernels/cpu/moe.c's wick_moe_experts). The
panel layout packs every expert's two projections once into the panel kernels' layouts
(panel_gemm.c's k pairs for bf16 on AVX512-BF16 builds, panel_gemm_f32.c's lanes for fp32) and
replaces the stacked tensors (same bytes, give or take the last panel's padding): `PanelExperts`
takes `w13_weight`'s and `w2_weight`'s place on the module, so the kernel table's
`fused_experts` (kernels/cpu/moe.py) and the native step's MoE layers (decoder_stack.py reads the
same holders) run the same wick_moe_panel_experts, with the same bits. Panels run every row
count: keeping the stacked copy for the row counts where it wins would double the experts'
memory (Qwen3-30B-A3B: 58 GB of bf16 experts), and one kernel per expert whatever its rows keeps
a token's output independent of the batch (the panel kernels are row-invariant).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import nn

from model_server.kernels.cpu import abi, native
from model_server.kernels.cpu.gemm import MIN_WORK_PER_THREAD
from model_server.kernels.cpu.panel_gemm import Panels, panel_linear

# Rows per expert from which the panels beat gemm.c's skinny matmul on an expert's w13 and w2,
# per (dtype, pair layout). Measured once (2026-11-28, a busy 2-core AVX512-BF16 guest (AMD EPYC
# family 26), A/B alternating, medians; Qwen3-30B-A3B's experts: hidden 2048, moe_intermediate
# 768, top-8, each expert given R rows, gate/up fused with the SiLU as wick_moe_panel_experts
# runs it), stacked / panels time per expert at R = 1, 4, 16, 64, 128 on one thread: fp32
# lanes 1.13, 1.34, 1.65, 1.52, 1.49; bf16 pairs 1.16, 1.10, 1.43, 1.26, 1.20. A layout
# packs where its threshold is 1 row: fewer rows would need the stacked copy beside the panels.
# bf16 without AVX512-BF16 (lanes, fp32 products) is unmeasured: it keeps the stacked experts.
PANEL_MIN_ROWS: dict[tuple[torch.dtype, bool], int] = {
    (torch.float32, False): 1,
    (torch.bfloat16, True): 1,
}


@dataclass(slots=True, frozen=True)
class ExpertsPlan:
    """The stacked float experts' layout for a model whose activations are `dtype`."""

    dtype: torch.dtype
    layout: str  # "stacked" (as loaded, gemm.c) or "panels" (packed, the stacked tensors freed)
    pairs: bool  # panels: panel_gemm.c's k-pair layout, else panel_gemm_f32.c's lanes
    reason: str  # why this layout (logged at preparation)


def plan_experts(dtype: torch.dtype, kernels: native.NativeKernels | None) -> ExpertsPlan:
    """The layout of `dtype` experts on this build (`kernels`: None when it did not build)."""
    if kernels is None or dtype not in native.DTYPE_CODES:
        return ExpertsPlan(dtype, "stacked", False, "no native panel kernel for these experts")
    pairs = dtype == torch.bfloat16 and bool(kernels.lib.wick_panel_gemm_available())
    min_rows = PANEL_MIN_ROWS.get((dtype, pairs))
    kind = "k-pair panels" if pairs else "lane panels"
    if min_rows != 1:
        why = "unmeasured" if min_rows is None else f"faster only from {min_rows} rows"
        return ExpertsPlan(dtype, "stacked", pairs, f"{kind} {why}: stacked experts, gemm.c")
    return ExpertsPlan(dtype, "panels", pairs, f"{kind} (faster at every row count)")


class PanelExperts(nn.Module):
    """One projection of every expert, W [E, n, k], as panels `panels` [E, elements] (each
    expert's in `ExpertsPlan`'s layout); stands where the stacked weight stood."""

    def __init__(self, panels: torch.Tensor, n: int, k: int, pairs: bool) -> None:
        super().__init__()
        # The packed bytes, listed by parameters() and state_dict() (memory, bandwidth).
        self.panels = nn.Parameter(panels, requires_grad=False)
        self.n, self.k, self.pairs = n, k, pairs
        self._struct: ctypes.Structure | None = None

    @property
    def shape(self) -> torch.Size:
        """(E, n, k) of the stacked float weight."""
        return torch.Size((self.panels.shape[0], self.n, self.k))

    @property
    def dtype(self) -> torch.dtype:
        return self.panels.dtype

    def struct(self) -> ctypes.Structure:
        """wick_moe.h's WickExpertsPanels of these panels (their address: keep self alive).
        Built on first use: every MoE call of the modules reads it, and the panels stay where
        packing put them (the native step's structs hold the same address)."""
        if self._struct is None:
            out = abi.structure("WickExpertsPanels")()
            out.data = self.panels.data_ptr()
            out.n, out.k, out.elements = self.n, self.k, self.panels.shape[1]
            out.pairs = int(self.pairs)
            out.min_work_per_thread = MIN_WORK_PER_THREAD
            self._struct = out
        return self._struct

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The stacked float weight [E, n, k] (references, tests, slow paths): each expert's
        panels times the identity, W^T exactly (x 1 and + 0 are exact in fp32)."""
        eye = torch.eye(self.k, dtype=self.dtype)
        out = torch.stack(
            [
                panel_linear(eye, Panels(p, self.n, self.k, self.pairs), min_work_per_thread=0)
                .t()
                .contiguous()
                for p in self.panels
            ]
        )
        return out.to(dtype or self.dtype)

    def extra_repr(self) -> str:
        layout = "k-pair" if self.pairs else "lane"
        return f"experts={self.panels.shape[0]}, n={self.n}, k={self.k}, {layout} panels"


def pack_experts(
    weight: torch.Tensor, plan: ExpertsPlan, kernels: native.NativeKernels
) -> PanelExperts:
    """weight [E, n, k] in plan.dtype -> its panels (the caller drops the stacked tensor)."""
    num_experts, n, k = weight.shape
    weight = weight.detach().contiguous()
    lib = kernels.lib
    elements = lib.wick_panel_elements(n, k) if plan.pairs else lib.wick_panel_f32_elements(n, k)
    panels = torch.empty((num_experts, elements), dtype=weight.dtype)
    code = native.DTYPE_CODES[weight.dtype]
    for e in range(num_experts):
        if plan.pairs:
            lib.wick_panel_pack(weight[e].data_ptr(), n, k, panels[e].data_ptr())
        else:
            lib.wick_panel_f32_pack(code, weight[e].data_ptr(), n, k, panels[e].data_ptr())
    return PanelExperts(panels, int(n), int(k), plan.pairs)


def install_expert_panels(
    model: nn.Module, plan: ExpertsPlan, kernels: native.NativeKernels
) -> int:
    """Every module holding stacked float experts (`w13_weight` and `w2_weight` tensors [E, 2I,
    H], [E, H, I] in plan.dtype on the CPU) gets them as `PanelExperts` instead, where the plan
    says panels. Returns how many modules changed."""
    if plan.layout != "panels":
        return 0
    changed = 0
    for module in model.modules():
        w13, w2 = getattr(module, "w13_weight", None), getattr(module, "w2_weight", None)
        if not all(
            isinstance(w, torch.Tensor) and w.dim() == 3 and w.dtype == plan.dtype and w.is_cpu
            for w in (w13, w2)
        ):
            continue
        for name in ("w13_weight", "w2_weight"):
            packed = pack_experts(getattr(module, name), plan, kernels)
            module._parameters.pop(name, None)  # the stacked tensor's memory goes with it
            setattr(module, name, packed)
        changed += 1
    return changed
