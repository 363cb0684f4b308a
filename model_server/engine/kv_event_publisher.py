"""Publishing KV cache events over ZeroMQ as vLLM does (`--kv-events-config`), for KV-aware
routers (`vllm-router --policy kv_aware --kv-event-source`), llm-d's KV cache indexer, Dynamo.

The wire, as vLLM's `ZmqEventPublisher`:
  - a PUB socket on `endpoint` (bound when it has a wildcard host, `*` or `::`, or is ipc:// or
    inproc://; connected otherwise) sends each step's events as three frames: the topic, the
    sequence number (8 bytes, big-endian, from 0 and +1 per batch) and the batch;
  - the batch is msgpack as vLLM's msgspec structs encode it: the envelope positional
    (`EventBatch` is array-like), `[ts (unix seconds), [event, ...], data_parallel_rank (0)]`,
    each event a map tagged by its class name under "type" with vLLM's field names:
    `{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
    "lora_id", "medium", "lora_name"}`, `{"type": "BlockRemoved", "block_hashes", "medium"}`,
    `{"type": "AllBlocksCleared"}` (engine/core/kv_events.py);
  - with `replay_endpoint`, a ROUTER socket answers a request whose last frame is a start
    sequence number (8 bytes, big-endian) with `(seq, batch)` for every batch still in the
    buffer (the last `buffer_steps`) from there on, then `(-1, b"")`.

The engine thread only queues (`publish`); a thread of its own encodes, sends and serves replays,
so a slow or absent subscriber never stalls a step (past `hwm` queued messages ZeroMQ drops them).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

from model_server.config import KVEventsConfig
from model_server.engine.core.kv_events import KVCacheEvent

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def event_to_wire(event: KVCacheEvent) -> dict[str, Any]:
    """An event as vLLM's tagged msgspec struct encodes it: "type" (the class name) first."""
    return {"type": type(event).__name__, **{f.name: getattr(event, f.name) for f in fields(event)}}


def encode_batch(ts: float, events: list[KVCacheEvent], data_parallel_rank: int = 0) -> bytes:
    import msgpack

    batch = [ts, [event_to_wire(e) for e in events], data_parallel_rank]
    return msgpack.packb(batch, use_bin_type=True)


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host or a local transport is bound, anything else connected."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


@dataclass(slots=True)
class _Pending:
    ts: float
    events: list[KVCacheEvent]


class ZmqEventPublisher:
    """PUB socket plus an optional replay ROUTER socket, served by one thread."""

    POLL_S = 0.05

    def __init__(self, config: KVEventsConfig) -> None:
        import zmq

        self.config = config
        self._queue: queue.Queue[_Pending | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            if binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(
                f"--kv-events-config: cannot open {config.endpoint} / {config.replay_endpoint}: "
                f"{exc}"
            ) from None
        self._dropped = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info(
            "KV cache events: publishing on %s%s (topic %r)",
            config.endpoint,
            f", replay on {config.replay_endpoint}" if config.replay_endpoint else "",
            config.topic,
        )

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events (engine thread; never blocks). Nothing to say: no batch."""
        if not events:
            return
        try:
            self._queue.put_nowait(_Pending(time.time(), events))
        except queue.Full:
            # Lost events would leave subscribers with a wrong view: say so, loudly but rarely.
            self._dropped += 1
            if self._dropped & (self._dropped - 1) == 0:
                logger.warning(
                    "KV cache events: queue full (max_queue_size %d), %d batches dropped",
                    self.config.max_queue_size,
                    self._dropped,
                )

    def shutdown(self, timeout: float = 2.0) -> None:
        """Send what is queued, then close the sockets."""
        if not self._thread.is_alive():
            return
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            logger.warning("KV cache events: the queue did not drain; unsent batches dropped")
            return  # a daemon thread: it goes with the process
        self._thread.join(timeout)

    def _run(self) -> None:
        seq = 0
        try:
            while True:
                if self._replay is not None:
                    while self._replay.poll(0):
                        self._serve_replay()
                try:
                    pending = self._queue.get(timeout=self.POLL_S)
                except queue.Empty:
                    continue
                if pending is None:
                    return
                payload = encode_batch(pending.ts, pending.events)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                seq += 1
        except Exception:
            logger.exception("KV cache events: the publisher stopped")
        finally:
            self._close_sockets()

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV cache events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=500)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
