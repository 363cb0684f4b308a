"""Connectors: how a `GenerationRequest` reaches the model server (`LLM_CONNECTOR`)."""

from __future__ import annotations

from microservice.connectors.base import Connector
from microservice.connectors.registry import make_connector

__all__ = ["Connector", "make_connector"]
