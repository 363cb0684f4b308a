"""Wick's LLM microservice: the OPEA-compatible chat service (port 9000) in front of the model
server. It talks to the model server over HTTP only and never imports `model_server`."""

__version__ = "0.1.0"
