"""Adapters in host memory (an LRU of --max-cpu-loras) and in the device slots (--max-loras),
and the per-step row grouping every wrapped layer reads.

Invariants:
  - `slots[s]` is the id of the adapter whose weights every wrapped layer holds in slot s (an
    unloaded adapter's too, until the slot is reused), or None (zeros);
  - a step uses at most `max_loras` adapters (the scheduler admits no more into `running`), so
    `prepare_batch` always finds them slots: those of this step are never evicted for another;
  - `cpu_cache` holds at most `max_cpu_loras` adapters; one evicted from it (or removed) is read
    again from its folder when a request still names it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from model_server.kernels.cpu.lora import lora_kernels
from model_server.kernels.lora_weights import StackedLoRA
from model_server.lora.config import LoRAConfig
from model_server.lora.layers import LoRABatch, LoRALinear, LoRATarget, find_targets
from model_server.lora.peft import LoRAAdapter, load_peft_adapter
from model_server.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAModelManager:
    """Wraps `model`'s LoRA-able layers (at construction) and keeps their slots filled."""

    def __init__(
        self,
        model: nn.Module,
        config: LoRAConfig,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.config = config
        self.device = device
        self.targets: list[LoRATarget] = find_targets(model)
        if not self.targets:
            raise ValueError(
                f"--enable-lora: {type(model).__name__} has no LoRA layers (q/k/v/o_proj, "
                "gate/up/down_proj of its decoder layers): serve it without --enable-lora"
            )
        self.batch = LoRABatch()
        # The wrapped layers run the native batched kernel where it takes the activations;
        # its slots are then in the model's dtype (bf16 halves what a step reads).
        self.batch.native = lora_kernels(torch.empty(0, dtype=dtype, device=device)) is not None
        weight_dtype = dtype if self.batch.native else torch.float32
        self.layers: dict[str, LoRALinear] = {}
        for target in self.targets:
            parent_name, _, leaf = target.module_name.rpartition(".")
            parent = model.get_submodule(parent_name)
            base = getattr(parent, leaf)
            wrapped = LoRALinear(
                base,
                target,
                self.batch,
                config.max_loras,
                config.max_lora_rank,
                device,
                weight_dtype,
            )
            setattr(parent, leaf, wrapped)
            if leaf == "gate_up_proj" and getattr(parent, "fuse_silu", False):
                # The fused SiLU reads gate_up_proj's planned weight and skips its forward
                # (and so the adapters' products).
                parent.fuse_silu = False
            self.layers[target.module_name] = wrapped
        self.slots: list[int | None] = [None] * config.max_loras
        # Slot numbers, least recently used first.
        self._slot_lru: OrderedDict[int, None] = OrderedDict.fromkeys(range(config.max_loras))
        self.cpu_cache: OrderedDict[int, LoRAAdapter] = OrderedDict()

    def stacks(self) -> dict[nn.Module, StackedLoRA]:
        """Each wrapped layer's base module -> its slots (for a native decoder step, which
        describes the layers by their base modules)."""
        return {layer.base: layer.stacked for layer in self.layers.values()}

    # ---- host memory --------------------------------------------------------------------

    def add_adapter(self, request: LoRARequest) -> LoRAAdapter:
        """Read and check `request`'s folder (ValueError with the reason), keep it in the
        host LRU. An adapter already held is only touched."""
        adapter = self.cpu_cache.get(request.lora_int_id)
        if adapter is not None:
            self.cpu_cache.move_to_end(request.lora_int_id)
            return adapter
        adapter = load_peft_adapter(request, self.targets, self.config.max_lora_rank)
        self.cpu_cache[request.lora_int_id] = adapter
        while len(self.cpu_cache) > self.config.max_cpu_loras:
            self.cpu_cache.popitem(last=False)
        logger.info(
            "LoRA adapter %s (id %d, rank %d, scale %g, %d layers, %.1f MiB) from %s",
            request.lora_name,
            request.lora_int_id,
            adapter.rank,
            adapter.scaling,
            len(adapter.weights),
            adapter.num_bytes / 1024**2,
            request.lora_path,
        )
        return adapter

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Drop an adapter from host memory; whether it was held at all. Its slot keeps the
        weights (requests still running with it go on using them) but is the first to be
        reused; if they need it after that, it is read again from its folder."""
        held = self.cpu_cache.pop(lora_int_id, None) is not None
        for slot, owner in enumerate(self.slots):
            if owner == lora_int_id:
                self._slot_lru.move_to_end(slot, last=False)
                held = True
        return held

    # ---- device slots -------------------------------------------------------------------

    def _write_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        for name, layer in self.layers.items():
            layer.set_slot(slot, None if adapter is None else adapter.weights.get(name))
        self.slots[slot] = None if adapter is None else adapter.request.lora_int_id

    def _slot_for(self, request: LoRARequest, keep: set[int]) -> int:
        """The slot holding `request`'s adapter, loading it into the least recently used slot
        whose adapter this step does not use."""
        if request.lora_int_id in self.slots:
            slot = self.slots.index(request.lora_int_id)
        else:
            slot = next(s for s in self._slot_lru if self.slots[s] not in keep)
            self._write_slot(slot, self.add_adapter(request))
        self._slot_lru.move_to_end(slot)
        return slot

    def prepare_batch(self, rows: Sequence[tuple[LoRARequest | None, int]]) -> None:
        """Set this step's adapters: `rows` is each sequence's adapter (None: base model) and
        token count, in the flat batch's order."""
        self.batch.clear()
        ids = {r.lora_int_id for r, _ in rows if r is not None}
        if not ids:
            return
        if len(ids) > self.config.max_loras:
            raise RuntimeError(
                f"a step uses {len(ids)} adapters, more than --max-loras {self.config.max_loras}"
            )
        slot_of: dict[int, int] = {}
        token_slots: list[int] = []  # per flat row: its slot, -1 for the base model
        for request, n in rows:
            slot = -1
            if request is not None:
                slot = slot_of.get(request.lora_int_id, -1)
                if slot < 0:
                    slot = slot_of[request.lora_int_id] = self._slot_for(request, ids)
            token_slots += [slot] * n
        self.batch.set(token_slots, self.config.max_loras, self.device)

    def clear_batch(self) -> None:
        self.batch.clear()
