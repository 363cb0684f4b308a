"""`make_connector`: the connector that `LLM_CONNECTOR` names, over one shared `ModelServer`."""

from __future__ import annotations

from microservice.connectors.base import Connector
from microservice.connectors.generic import GenericConnector
from microservice.settings import MicroserviceSettings
from microservice.upstream import ModelServer


def make_connector(settings: MicroserviceSettings) -> Connector:
    model_server = ModelServer(
        settings.model_server_endpoint,
        api_key=settings.api_key_value,
        connect_timeout=settings.connect_timeout,
        read_timeout=settings.read_timeout,
        model_name=settings.model_name,
    )
    if settings.connector == "langchain":
        # Imported here: langchain-core is only loaded when it is the chosen connector.
        try:
            from microservice.connectors.langchain import LangchainConnector
        except ImportError as exc:
            raise RuntimeError(
                f"LLM_CONNECTOR=langchain needs langchain-core ({exc}): "
                "pip install 'wick[microservice]'"
            ) from exc

        return LangchainConnector(model_server)
    return GenericConnector(model_server)
