"""Tensor-parallel worker processes (ranks 1..N-1): load this rank's shard, then run every step
rank 0 broadcasts until it says stop.

On node 0 the engine's MultiprocExecutor spawns them; on other nodes `python -m model_server
worker` (`run_worker_node`) spawns this node's ranks from the torchrun-style environment.
A worker exits when its parent process exits, so none outlives the server.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from model_server.config import EngineConfig

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerSpec:
    config: EngineConfig  # as given: each rank resolves max_model_len itself (ModelRunner)
    rank: int
    local_rank: int
    local_world_size: int
    init_method: str
    log_level: int = logging.WARNING


def check_device_ids(device_ids: Sequence[int] | None, local_world_size: int) -> None:
    """This node's ids, one per local rank: fewer leaves a rank without a device, more leaves
    devices idle (on one node EngineConfig.validate already refused that, naming -tp)."""
    if device_ids is not None and len(device_ids) != local_world_size:
        raise ValueError(
            f"--device-ids {','.join(map(str, device_ids))} names {len(device_ids)} device(s) "
            f"but this node runs {local_world_size} tensor-parallel ranks "
            "(--tensor-parallel-size / NNODES): name one device per rank"
        )


def _exit_with_parent() -> None:
    """Die as soon as the process that spawned us is gone (no orphans, even after SIGKILL)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="wick-parent-watch", daemon=True).start()


def run_worker(spec: WorkerSpec) -> None:
    """Process entry point of one worker rank."""
    _exit_with_parent()
    logging.basicConfig(
        level=spec.log_level,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s [tp rank {spec.rank}] %(name)s: %(message)s",
    )
    try:
        _serve_steps(spec)
    except Exception as exc:  # one line: rank 0 reports the exit, this says why
        logger.error("tensor-parallel rank %d failed: %s: %s", spec.rank, type(exc).__name__, exc)
        sys.stderr.flush()
        os._exit(1)


def _serve_steps(spec: WorkerSpec) -> None:
    from model_server.distributed.parallel_state import (
        cpu_all_reduce_min,
        destroy_tensor_parallel,
        get_tp_group,
        init_tensor_parallel,
    )
    from model_server.distributed.step_channel import MessageKind, StepChannel
    from model_server.engine.execution.model_preparation import prepare_model
    from model_server.engine.execution.model_runner import ModelRunner
    from model_server.engine.execution.step_input import StepInput
    from model_server.loader import load_model_source
    from model_server.platforms import get_platform

    platform = get_platform(spec.config.device)
    config = platform.with_defaults(spec.config)  # as rank 0's EngineCore resolves it
    platform.select_device(spec.local_rank, config.device_ids)
    platform.prepare(config.num_threads, spec.local_world_size)
    platform.init_distributed_backend()
    tp = init_tensor_parallel(
        rank=spec.rank,
        world_size=config.tensor_parallel_size,
        local_rank=spec.local_rank,
        local_world_size=spec.local_world_size,
        backend=platform.dist_backend,
        init_method=spec.init_method,
    )
    try:
        source = load_model_source(
            config.model, config.load_format, hf_overrides=config.hf_overrides
        )
        runner = ModelRunner(prepare_model(config, source, platform), platform)
        # In step with rank 0's determine_num_blocks: a profile forward (collectives) and the
        # reduction; then every rank checks the same count (rank 0 raises the same error).
        num_blocks = cpu_all_reduce_min(runner.local_num_blocks(config.kv_cache_memory))
        runner.check_num_blocks(num_blocks)
        runner.allocate_kv_cache(num_blocks)
        channel = StepChannel(get_tp_group().cpu_group)
        logger.info("rank %d ready", tp.rank)
        while True:
            kind, payload = channel.recv()
            if kind is MessageKind.SHUTDOWN:
                break
            runner.execute_step(StepInput.unpack(payload))
    finally:
        destroy_tensor_parallel()


# ---------------------------------------------------------------- other nodes (multi-node)


def run_worker_node(config: EngineConfig) -> int:
    """`python -m model_server worker`: run this node's ranks (NODE_RANK >= 1) until rank 0's
    node stops them; exit non-zero if any of them fails."""
    from model_server.distributed.rendezvous import rendezvous_from_env
    from model_server.platforms import get_platform

    config.validate()
    rdzv = rendezvous_from_env()
    if rdzv.nnodes < 2 or rdzv.node_rank == 0:
        raise ValueError(
            "`worker` runs the ranks of nodes 1..NNODES-1: set NNODES, NODE_RANK >= 1, "
            "MASTER_ADDR and MASTER_PORT (node 0 runs `serve`)"
        )
    local_world_size = rdzv.local_world_size(config.tensor_parallel_size)
    check_device_ids(config.device_ids, local_world_size)
    get_platform(config.device)  # a missing runtime is one clear error, before spawning
    first = rdzv.first_rank(config.tensor_parallel_size)
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for local_rank in range(local_world_size):
        spec = WorkerSpec(
            config=config,
            rank=first + local_rank,
            local_rank=local_rank,
            local_world_size=local_world_size,
            init_method=rdzv.init_method,
            log_level=logging.getLogger().getEffectiveLevel(),
        )
        proc = ctx.Process(target=run_worker, args=(spec,), name=f"wick-tp-worker-{spec.rank}")
        proc.start()
        procs.append(proc)
    logger.info("node %d: ranks %d-%d started", rdzv.node_rank, first, first + len(procs) - 1)
    code = 0
    pending = {p.sentinel: p for p in procs}
    while pending:
        for sentinel in multiprocessing.connection.wait(list(pending)):
            proc = pending.pop(sentinel)
            proc.join()
            if proc.exitcode and not code:
                code = 1
                logger.error("%s exited with code %s: stopping this node", proc.name, proc.exitcode)
                for other in pending.values():
                    other.terminate()
    return code
