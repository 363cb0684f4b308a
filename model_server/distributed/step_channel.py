"""Rank 0 -> every rank: one small message per model step, over the cpu (gloo) group.

A message is a kind and a list of ints (no pickle: nothing from the network is executed). It
travels in one fixed-size int64 broadcast, [kind, length, payload..., padding]; a payload too
long for it (a big batch of long block tables) follows in a second broadcast.
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist

# int64 slots in the fixed message: 16 KiB, enough for a decode step of ~100 sequences.
INLINE_SLOTS = 2048
_HEADER = 2


class MessageKind(enum.IntEnum):
    EXECUTE = 1
    SHUTDOWN = 2


class StepChannel:
    """Both ends of the broadcast; only rank 0 (`src`) calls `send`, the others `recv`."""

    def __init__(self, group: dist.ProcessGroup, src: int = 0) -> None:
        self.group = group
        self.src = src
        self._buf = torch.zeros(INLINE_SLOTS, dtype=torch.int64)
        self._np = self._buf.numpy()  # shares memory with _buf

    def send(self, kind: MessageKind, payload: list[int]) -> None:
        n = len(payload)
        inline = min(n, INLINE_SLOTS - _HEADER)
        self._np[0] = int(kind)
        self._np[1] = n
        if inline:
            self._np[_HEADER : _HEADER + inline] = payload[:inline]
        dist.broadcast(self._buf, self.src, group=self.group)
        if n > inline:
            rest = torch.tensor(payload[inline:], dtype=torch.int64)
            dist.broadcast(rest, self.src, group=self.group)

    def recv(self) -> tuple[MessageKind, list[int]]:
        dist.broadcast(self._buf, self.src, group=self.group)
        kind, n = MessageKind(int(self._np[0])), int(self._np[1])
        inline = min(n, INLINE_SLOTS - _HEADER)
        payload = self._np[_HEADER : _HEADER + inline].tolist()
        if n > inline:
            rest = torch.empty(n - inline, dtype=torch.int64)
            dist.broadcast(rest, self.src, group=self.group)
            payload.extend(rest.tolist())
        return kind, payload
