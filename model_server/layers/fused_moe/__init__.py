"""Mixture-of-experts layers: the routed experts (`FusedMoE`) and the routers."""

from model_server.layers.fused_moe.layer import DOWN, GATE, UP, FusedMoE
from model_server.layers.fused_moe.router import grouped_topk, softmax_topk

__all__ = ["DOWN", "GATE", "UP", "FusedMoE", "grouped_topk", "softmax_topk"]
