"""Loopback ports for the servers the tests start."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port free on 127.0.0.1 now (the OS picks it; a server started right after takes it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
