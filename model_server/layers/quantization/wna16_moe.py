"""The routed experts of GPTQ and AWQ mixture-of-experts checkpoints (Mixtral, Qwen2/3-MoE)
kept quantized: every expert's gate / up / down projection is its own GPTQ or AWQ matrix in
the checkpoint (`experts.N.gate_proj.qweight`, `.qzeros`, `.scales`, GPTQ's `.g_idx`; Mixtral's
`w1` / `w3` / `w2`), laid out as wna16.py describes for one linear layer.

`WNA16MoEMethod` registers those tensors on a `FusedMoE`, stacked over the experts as its
float weights are (this rank's shard; names as vLLM's quantized MoE layers use):
    w13_qweight, w13_qzeros, w13_scales, w13_g_idx   gate rows then up rows: N = 2 * I_local,
                                                     K = hidden
    w2_qweight,  w2_qzeros,  w2_scales,  w2_g_idx    down: N = hidden, K = I_local
each with a leading expert dim [E, ...]. Loaders take one expert's checkpoint tensor at a time
and slice it as a column-parallel gate_up (split N) and a row-parallel down (split K along
whole groups: a group across two ranks, and act-order on a split K, are refused) would be.
After loading, each expert is repacked (wna16.py `repack`) into `WNA16Experts`: the wNa16
layout of every expert stacked, so that expert e's matmul is the kernel table's
`wna16_linear` on views [e] (kernels/fused_moe_torch.py groups the tokens per expert first).
No float copy of the experts is ever made.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from model_server.kernels.portable import dequantize_wna16
from model_server.kernels.table import KernelTable
from model_server.layers.quantization.wna16 import WNA16Codes, WNA16Config, repack


class WNA16Experts(WNA16Codes):
    """One projection of every expert, W_e [N, K], in the wNa16 layout stacked over experts:
    codes [E, N, K / 2] (4 bits) or [E, N, K] (8 bits) uint8, scales and offsets [E, N, G]
    float32, perm [E, K] int64 (act-order: expert e's codes are stored in K order perm[e])."""

    @property
    def shape(self) -> torch.Size:
        """(E, N, K), as a stacked float expert weight's."""
        e, n, stored = self.codes.shape
        return torch.Size((e, n, stored * 8 // self.bits))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[E, N, K] (for references and tests)."""
        out = torch.stack(
            [
                dequantize_wna16(c, s, o, self.bits, self.group_size, dtype)
                for c, s, o in zip(self.codes, self.scales, self.offsets, strict=True)
            ]
        )
        if self.perm is None:
            return out
        unpermuted = torch.empty_like(out)
        for e in range(out.shape[0]):
            unpermuted[e][:, self.perm[e]] = out[e]  # stored column i is input feature perm[i]
        return unpermuted

    def expert_linear(self, expert: int, x: torch.Tensor, kernels: KernelTable) -> torch.Tensor:
        """x [M, K] @ W_expert^T -> [M, N] through the table's `wna16_linear`."""
        if self.perm is not None:
            x = x.index_select(-1, self.perm[expert])
        return kernels.wna16_linear(
            x,
            self.codes[expert],
            self.scales[expert],
            self.offsets[expert],
            self.bits,
            self.group_size,
            None,
        )

    def extra_repr(self) -> str:
        e, n, k = self.shape
        group = "per-channel" if self.group_size == k else f"group {self.group_size}"
        order = ", act-order" if self.perm is not None else ""
        return f"{self.method} w{self.bits} {e} x ({n}, {k}), {group}{order}"


@dataclass(slots=True, frozen=True)
class ExpertShard:
    """Where this rank's part of one projection of an expert lies, answered as a LinearBase
    answers wna16.py's loader: input features (first, count, total) and, per checkpoint part
    (shard id), (offset in this rank's fused output, rows, first row of the checkpoint
    tensor, its rows)."""

    k_start: int
    k_size: int
    k_total: int
    parts: dict[str, tuple[int, int, int, int]]

    def input_shard(self) -> tuple[int, int, int]:
        return self.k_start, self.k_size, self.k_total

    def output_shard(self, shard_id: int | str | None = None) -> tuple[int, int, int, int]:
        return self.parts[str(shard_id)]

    @property
    def n(self) -> int:
        return sum(size for _, size, _, _ in self.parts.values())


class WNA16MoEMethod:
    """A GPTQ / AWQ checkpoint's quant method for a FusedMoE's experts (see the module doc)."""

    def __init__(self, config: WNA16Config) -> None:
        self.config = config

    @property
    def method(self) -> str:
        return self.config.method

    @property
    def description(self) -> str:
        return self.config.description

    def create_weights(
        self, moe: nn.Module, num_experts: int, shards: dict[str, ExpertShard]
    ) -> None:
        """Register `{prefix}_{qweight,qzeros,scales[,g_idx]}` [E, ...] on `moe` for each
        projection `shards[prefix]` ("w13", "w2"). A group straddling two ranks is refused as
        the tensors load (`WNA16Config.load_tensor`)."""
        for prefix, shard in shards.items():
            for name, shape in self.config.checkpoint_shapes(shard.n, shard.k_size).items():
                dtype = torch.float32 if name == "scales" else torch.int32
                param = nn.Parameter(
                    torch.empty((num_experts, *shape), dtype=dtype), requires_grad=False
                )
                param.weight_loader = partial(  # type: ignore[attr-defined]
                    self._load, moe, prefix, shard, name
                )
                moe.register_parameter(f"{prefix}_{name}", param)

    def _load(
        self,
        moe: nn.Module,
        prefix: str,
        shard: ExpertShard,
        name: str,
        param: nn.Parameter,
        loaded: torch.Tensor,
        shard_id: str | None = None,
        expert_id: int | None = None,
        checkpoint_name: str | None = None,
    ) -> None:
        """One expert's checkpoint tensor `name` of part `shard_id` (gate, up or down) into
        expert `expert_id`'s slot; ValueError naming the checkpoint tensor otherwise."""
        label = checkpoint_name or (
            f"{getattr(param, 'checkpoint_name', f'{prefix}_{name}')} "
            f"(expert {expert_id}, {shard_id})"
        )
        num_experts = param.shape[0]
        if expert_id is None:
            raise ValueError(
                f"{label}: quantized experts are loaded one expert at a time "
                "(experts.N.<proj>.qweight ...), not stacked"
            )
        if not 0 <= expert_id < num_experts:
            raise ValueError(
                f"{label}: expert {expert_id} out of range (the model has {num_experts})"
            )
        if str(shard_id) not in shard.parts:
            raise ValueError(
                f"{label}: not a part of the experts' {prefix} ({', '.join(shard.parts)})"
            )
        parts: dict[tuple[str, int], set[int | str]] = moe.__dict__.setdefault("_g_idx_parts", {})
        seen = parts.setdefault((prefix, expert_id), set())
        self.config.load_tensor(
            shard, name, param.data[expert_id], loaded, label, str(shard_id), seen
        )

    def process_weights_after_loading(self, moe: nn.Module) -> None:
        """Repack each projection's loaded tensors, expert by expert, into a WNA16Experts set
        as `moe.w13_weight` / `moe.w2_weight`; the checkpoint-format tensors are released."""
        config = self.config
        for prefix in ("w13", "w2"):
            qweight, qzeros, scales = (
                moe._parameters.pop(f"{prefix}_{name}").data
                for name in ("qweight", "qzeros", "scales")
            )
            g_idx_param = moe._parameters.pop(f"{prefix}_g_idx", None)
            g_idx = None if g_idx_param is None else g_idx_param.data
            num_experts = qweight.shape[0]
            codes = scales_out = offsets = None
            perms: list[torch.Tensor | None] = []
            for e in range(num_experts):
                w = repack(
                    config, qweight[e], qzeros[e], scales[e], None if g_idx is None else g_idx[e]
                )
                if codes is None:
                    codes = w.codes.new_empty((num_experts, *w.codes.shape))
                    scales_out = w.scales.new_empty((num_experts, *w.scales.shape))
                    offsets = w.offsets.new_empty((num_experts, *w.offsets.shape))
                assert scales_out is not None and offsets is not None
                codes[e].copy_(w.codes)
                scales_out[e].copy_(w.scales)
                offsets[e].copy_(w.offsets)
                perms.append(None if w.perm is None else w.perm.data)
                group_size = w.group_size
            assert codes is not None and scales_out is not None and offsets is not None
            perm = None
            if any(p is not None for p in perms):
                k = w.shape[1]
                identity = torch.arange(k, device=codes.device)
                perm = torch.stack([identity if p is None else p for p in perms])
            del qweight, qzeros, scales, g_idx
            setattr(
                moe,
                f"{prefix}_weight",
                WNA16Experts(
                    config.method, config.bits, group_size, codes, scales_out, offsets, perm
                ),
            )
