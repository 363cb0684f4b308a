"""Tensor parallelism over a Ray cluster (`--distributed-executor-backend ray`).

Rank 0 stays in this process, as with `mp`: it schedules, samples and drives every step through
the same step channel (distributed/step_channel.py). Ranks 1..N-1 are Ray actors, one per bundle
of a placement group (one CPU, or one GPU, each), placed wherever the cluster has room, on this
machine or others: so a Ray or KubeRay cluster serves one model across machines without
MASTER_ADDR / NNODES / `worker` nodes. Each actor runs the `mp` worker's loop (worker.py
`run_worker`), rendezvousing with rank 0 at this node's address.

Failures as with `mp`: a watcher waits on the actors' run calls; one that ends before shutdown
(the actor died, or its rank failed) fails the engine: /health turns 503 and the callbacks run.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Any

from model_server.config import EngineConfig
from model_server.distributed.parallel_state import get_tp_group, init_tensor_parallel
from model_server.distributed.rendezvous import free_port
from model_server.distributed.step_channel import MessageKind, StepChannel
from model_server.engine.execution.executor import FailureCallback
from model_server.engine.execution.model_preparation import prepare_model
from model_server.engine.execution.model_runner import ModelRunner
from model_server.engine.execution.multiproc_executor import (
    _JOIN_TIMEOUT_S,
    MultiprocExecutor,
)
from model_server.engine.execution.worker import WorkerSpec, run_worker
from model_server.loader import ModelSource
from model_server.models import check_tensor_parallel
from model_server.platforms import Platform

logger = logging.getLogger(__name__)

_WATCH_POLL_S = 0.5


class _Rank:
    """A Ray actor holding one tensor-parallel rank (made remote in `_actor_class`)."""

    def node(self) -> tuple[str, str]:
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def run(self, spec: WorkerSpec) -> None:
        run_worker(spec)


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RuntimeError(
            "--distributed-executor-backend ray needs Ray: pip install ray"
        ) from None
    return ray


class RayExecutor(MultiprocExecutor):
    """MultiprocExecutor's steps, failures and shutdown, with Ray actors as the worker ranks."""

    def __init__(self, config: EngineConfig, source: ModelSource, platform: Platform) -> None:
        ray = _ray()
        world_size = config.tensor_parallel_size
        check_tensor_parallel(source.hf_config, world_size)
        if platform.name not in ("cpu", "cuda"):
            raise ValueError(
                f"--distributed-executor-backend ray places ranks on CPUs or GPUs, not on "
                f"{platform.name}: use mp"
            )
        if config.device_ids is not None:
            raise ValueError(
                "--device-ids picks this node's devices for mp; with ray the placement group "
                "gives each rank its GPU: drop --device-ids"
            )
        self.platform = platform
        self.world_size = world_size
        self._failure: str | None = None
        self._callbacks: list[FailureCallback] = []
        self._closed = False
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()  # closed by shutdown(), as MultiprocExecutor's
        self.workers = []  # no local processes: the ranks are actors
        atexit.register(self.shutdown)  # unregistered by shutdown(), as MultiprocExecutor's
        if not ray.is_initialized():
            # RAY_ADDRESS (or a `ray start` on this machine) names the cluster; else a local one.
            ray.init(log_to_driver=True)
        gpu = platform.name == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._remove_placement_group = remove_placement_group
        self._pg = placement_group([dict(bundle) for _ in range(world_size - 1)], strategy="PACK")
        ray.get(self._pg.ready(), timeout=600)
        actor_class = ray.remote(_Rank)
        # Every GPU of a node stays visible to its actors (each selects its own, by local rank),
        # as the mp ranks of a node do.
        env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"} if gpu else {}
        self._actors = [
            actor_class.options(
                num_cpus=1,
                num_gpus=1 if gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=i
                ),
                runtime_env={"env_vars": env},
            ).remote()
            for i in range(world_size - 1)
        ]
        here = ray.get_runtime_context().get_node_id()
        master_addr = ray.util.get_node_ip_address()
        nodes = ray.get([a.node.remote() for a in self._actors])
        # Local ranks per node: rank 0 is local rank 0 here; each node numbers its actors.
        local_counts: dict[str, int] = {here: 1}
        local_ranks = []
        for node_id, _ in nodes:
            local_ranks.append(local_counts.get(node_id, 0))
            local_counts[node_id] = local_ranks[-1] + 1
        init_method = f"tcp://{master_addr}:{free_port(master_addr)}"
        log_level = logging.getLogger().getEffectiveLevel()
        self._runs = [
            actor.run.remote(
                WorkerSpec(
                    config=config,
                    rank=rank,
                    local_rank=local_rank,
                    local_world_size=local_counts[node_id],
                    init_method=init_method,
                    log_level=log_level,
                )
            )
            for rank, (actor, local_rank, (node_id, _)) in enumerate(
                zip(self._actors, local_ranks, nodes, strict=True), start=1
            )
        ]
        self._monitor = threading.Thread(target=self._watch_workers, name="wick-ray-monitor")
        self._monitor.daemon = True
        self._monitor.start()
        try:
            platform.select_device(0, None)
            platform.prepare(config.num_threads, local_counts[here])
            platform.init_distributed_backend()
            init_tensor_parallel(
                rank=0,
                world_size=world_size,
                local_rank=0,
                local_world_size=local_counts[here],
                backend=platform.dist_backend,
                init_method=init_method,
            )
            self.channel = StepChannel(get_tp_group().cpu_group)
            self.model_runner = ModelRunner(prepare_model(config, source, platform), platform)
        except BaseException as exc:
            self.shutdown()
            raise self._explain(exc) from exc
        logger.info(
            "tensor parallelism on Ray: %d ranks, %d actors on %d node(s)",
            world_size,
            len(self._actors),
            len(local_counts),
        )

    def _watch_workers(self) -> None:
        ray = _ray()
        pending = list(self._runs)
        while pending and not self._closed:
            done, pending = ray.wait(pending, num_returns=1, timeout=_WATCH_POLL_S)
            if not done or self._closed:
                continue
            rank = self._runs.index(done[0]) + 1
            try:
                ray.get(done[0])
                why = "returned"
            except Exception as exc:  # the actor died, or its rank failed (run_worker exits 1)
                why = f"failed: {type(exc).__name__}"
            self._fail(f"tensor-parallel rank {rank} (a Ray actor) {why}")
            return

    def _stop_workers(self, graceful: bool) -> None:
        ray = _ray()
        channel = getattr(self, "channel", None)
        if graceful and channel is not None and self._lock.acquire(timeout=_JOIN_TIMEOUT_S):
            try:
                channel.send(MessageKind.SHUTDOWN, [])
            except RuntimeError:
                pass  # a rank is already gone: killed below
            finally:
                self._lock.release()
            ray.wait(list(self._runs), num_returns=len(self._runs), timeout=_JOIN_TIMEOUT_S)
        for actor in getattr(self, "_actors", []):
            ray.kill(actor)
        if getattr(self, "_pg", None) is not None:
            self._remove_placement_group(self._pg)
            self._pg = None
