"""A KV event subscriber as routers write them (vLLM's example subscriber's protocol): SUB on the
publisher's endpoint, batches applied in sequence order, a gap (a late join, a drop) filled from
the replay endpoint. Written against the wire, not Wick's code: msgpack and zmq only."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq


@dataclass
class KVEventSubscriber:
    endpoint: str  # where to connect, e.g. tcp://127.0.0.1:5557
    replay_endpoint: str | None = None
    topic: str = ""
    cached: set[int] = field(default_factory=set)
    next_seq: int = 0
    batches: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        self._sub.connect(self.endpoint)

    def close(self) -> None:
        self._sub.close(linger=0)
        self._ctx.term()

    def drain(self, quiet_s: float = 1.0, timeout_s: float = 30.0) -> None:
        """Apply batches until none came for `quiet_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self._sub.poll(int(quiet_s * 1000)):
                return
            topic, seq_bytes, payload = self._sub.recv_multipart()
            assert topic == self.topic.encode()
            seq = int.from_bytes(seq_bytes, "big")
            if seq < self.next_seq:
                continue  # already had it through a replay
            if seq > self.next_seq:
                self.replay()
                if seq < self.next_seq:
                    continue
            assert seq == self.next_seq, f"batch {seq} after {self.next_seq - 1}"
            self.apply(payload)
            self.next_seq = seq + 1
        raise TimeoutError("the publisher never went quiet")

    def replay(self) -> None:
        """Ask the replay endpoint for every batch from `next_seq` on and apply them."""
        assert self.replay_endpoint is not None, f"missed batches before {self.next_seq}"
        # DEALER with an empty delimiter frame, so the ROUTER's many answers all come back.
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart((b"", self.next_seq.to_bytes(8, "big")))
            while True:
                assert dealer.poll(10_000), "no replay answer"
                empty, seq_bytes, payload = dealer.recv_multipart()
                assert empty == b""
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == -1:
                    return
                assert seq == self.next_seq, f"replayed {seq}, wanted {self.next_seq}"
                self.apply(payload)
                self.next_seq = seq + 1
        finally:
            dealer.close(linger=0)

    def apply(self, payload: bytes) -> None:
        """One batch: `[ts, events, data_parallel_rank]`, each event a map tagged by "type"."""
        ts, events, *_ = msgpack.unpackb(payload, raw=False)
        for event in events:
            self.check(event)
        self.batches.append({"ts": ts, "events": events})
        for event in events:
            if event["type"] == "BlockStored":
                self.cached.update(event["block_hashes"])
            elif event["type"] == "BlockRemoved":
                self.cached.difference_update(event["block_hashes"])
            else:
                self.cached.clear()

    @staticmethod
    def check(event: dict[str, Any]) -> None:
        """vLLM's fields for each tag (vllm/distributed/kv_events.py; defaulted ones omitted)."""
        names = {
            "BlockStored": {"block_hashes", "parent_block_hash", "token_ids", "block_size",
                            "lora_id", "medium", "lora_name"},
            "BlockRemoved": {"block_hashes", "medium"},
            "AllBlocksCleared": set(),
        }  # fmt: skip
        assert event.get("type") in names, f"unknown event {event!r}"
        assert set(event) - {"type"} == names[event["type"]], f"fields of {event!r}"

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for b in self.batches for e in b["events"] if e["type"] == kind]
