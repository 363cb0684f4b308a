"""Attention backends behind one interface; `get_attention_backend` picks one by name."""

from __future__ import annotations

from model_server.layers.attention.backend import AttentionBackend, AttentionMetadata

ATTENTION_BACKENDS = ("torch", "cpu", "triton")


def get_attention_backend(name: str) -> type[AttentionBackend]:
    """Import lazily: the triton backend pulls in triton, which CPU-only installs may lack."""
    if name == "torch":
        from model_server.layers.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend
    if name == "cpu":
        from model_server.layers.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend
    if name == "triton":
        from model_server.layers.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend
    raise ValueError(f"unknown attention backend {name!r}; choose one of {ATTENTION_BACKENDS}")


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "get_attention_backend"]
