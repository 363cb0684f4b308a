"""torchrun-style rendezvous settings: MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK.

One node: nothing to set (rank 0 listens on 127.0.0.1 at a free port). Several nodes: every
node gets the same MASTER_ADDR (node 0's address, reachable from the others), MASTER_PORT and
NNODES, and its own NODE_RANK; node 0 runs `serve` (or `generate`), the others
`python -m model_server worker` with the same model flags. Each node runs
tensor_parallel_size / NNODES ranks, one per device.

On Kubernetes' LeaderWorkerSet (helm/wick, multiNode) the operator's variables stand in for the
unset ones: LWS_LEADER_ADDRESS for MASTER_ADDR, LWS_GROUP_SIZE for NNODES, LWS_WORKER_INDEX for
NODE_RANK (the leader is index 0).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Rendezvous:
    master_addr: str
    master_port: int
    nnodes: int
    node_rank: int

    @property
    def init_method(self) -> str:
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"

    def local_world_size(self, world_size: int) -> int:
        if world_size % self.nnodes:
            raise ValueError(
                f"--tensor-parallel-size {world_size} is not divisible by NNODES={self.nnodes}"
            )
        return world_size // self.nnodes

    def first_rank(self, world_size: int) -> int:
        return self.node_rank * self.local_world_size(world_size)


# The torchrun-style name -> LeaderWorkerSet's variable that stands in when it is unset.
LWS_FALLBACKS = {
    "MASTER_ADDR": "LWS_LEADER_ADDRESS",
    "NNODES": "LWS_GROUP_SIZE",
    "NODE_RANK": "LWS_WORKER_INDEX",
}


def _env(name: str) -> tuple[str, str]:
    """(the variable that gave it, its value): `name`, else its LeaderWorkerSet stand-in."""
    value = os.environ.get(name, "").strip()
    if not value and name in LWS_FALLBACKS:
        fallback = LWS_FALLBACKS[name]
        if os.environ.get(fallback, "").strip():
            return fallback, os.environ[fallback].strip()
    return name, value


def _int_env(name: str, default: int) -> int:
    source, value = _env(name)
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{source} must be an integer, got {value!r}") from None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rendezvous_from_env() -> Rendezvous:
    """Read the torchrun-style variables; MASTER_PORT may be left unset on a single node."""
    nnodes = _int_env("NNODES", 1)
    node_rank = _int_env("NODE_RANK", 0)
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(f"NODE_RANK={node_rank} must be in [0, NNODES={nnodes})")
    addr = _env("MASTER_ADDR")[1] or "127.0.0.1"
    port = _int_env("MASTER_PORT", 0)
    if not port:
        if nnodes > 1:
            raise ValueError("several nodes (NNODES > 1) need MASTER_ADDR and MASTER_PORT")
        port = free_port(addr)
    return Rendezvous(addr, port, nnodes, node_rank)
