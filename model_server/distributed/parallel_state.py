"""The tensor-parallel group of this process (vLLM's `parallel_state`, one dimension only).

Layers ask `get_tensor_model_parallel_world_size()` / `..._rank()` when they are built; with no
group initialized (the single-process engine) they see size 1 / rank 0 and never communicate.

Two process groups over the same ranks:
  - `device_group`: the platform's backend (gloo, nccl, eccl, hccl) for the model's all-reduce /
    gather; a finite timeout, so a stuck peer turns into an error instead of a hang.
  - `cpu_group`: gloo, for rank 0's step messages. Workers wait on it between requests, so its
    timeout is effectively unlimited; a dead peer still fails it at once (the socket closes).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Collectives inside a model step, and the rendezvous: long enough for a slow peer to load.
COLLECTIVE_TIMEOUT = timedelta(seconds=300)
IDLE_TIMEOUT = timedelta(days=365)


@dataclass(slots=True)
class TensorParallelGroup:
    rank: int
    world_size: int
    local_rank: int  # rank among the processes on this node
    local_world_size: int
    device_group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


_TP: TensorParallelGroup | None = None


def init_tensor_parallel(
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    backend: str,
    init_method: str,
    timeout: timedelta = COLLECTIVE_TIMEOUT,
) -> TensorParallelGroup:
    """Join the group (blocks until all `world_size` ranks have joined, up to `timeout`)."""
    global _TP
    if _TP is not None:
        raise RuntimeError(
            "a tensor-parallel engine is already running in this process: shut it down first "
            "(LLM.shutdown())"
        )
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    ranks = list(range(world_size))
    cpu_group = (
        dist.new_group(ranks, backend="gloo", timeout=IDLE_TIMEOUT)
        if world_size > 1
        else dist.group.WORLD
    )
    _TP = TensorParallelGroup(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        device_group=dist.group.WORLD,
        cpu_group=cpu_group,
    )
    logger.info("tensor-parallel rank %d/%d joined (%s)", rank, world_size, backend)
    return _TP


def destroy_tensor_parallel() -> None:
    global _TP
    _TP = None
    if dist.is_initialized():
        dist.destroy_process_group()


def get_tp_group() -> TensorParallelGroup | None:
    return _TP


def get_tensor_model_parallel_world_size() -> int:
    return 1 if _TP is None else _TP.world_size


def get_tensor_model_parallel_rank() -> int:
    return 0 if _TP is None else _TP.rank


def _group() -> TensorParallelGroup:
    if _TP is None:
        raise RuntimeError("no tensor-parallel group: call init_tensor_parallel first")
    return _TP


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place (x must be contiguous); returns x."""
    dist.all_reduce(x, group=_group().device_group)
    return x


def tensor_model_parallel_gather(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate every rank's [N, d] along the last dim on rank 0 ([N, world * d]); other
    ranks get None. Every rank must pass the same shape."""
    tp = _group()
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.world_size)] if tp.is_driver else None
    dist.gather(x, parts, dst=0, group=tp.device_group)
    return torch.cat(parts, dim=-1) if parts is not None else None


def cpu_all_reduce_min(value: int) -> int:
    """The smallest `value` over the ranks (on the cpu group: no timeout worth speaking of)."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_group().cpu_group)
    return int(t.item())
