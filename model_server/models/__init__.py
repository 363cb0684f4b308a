"""Model implementations (one file per architecture family) and the architecture registry."""

from model_server.models.registry import (
    SUPPORTED_ARCHITECTURES,
    build_model,
    check_tensor_parallel,
    get_model_class,
    init_dummy_weights,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "build_model",
    "check_tensor_parallel",
    "get_model_class",
    "init_dummy_weights",
]
