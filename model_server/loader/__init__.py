"""Model loading: a model reference (None, .gguf file, HF folder, hub id, dummy preset) -> a
ModelSource (HF config, tokenizer, lazy HF-named weights).

Only light modules are imported here; transformers, gguf and safetensors load on first use.
"""

from model_server.loader.embedded import embedded_model_path
from model_server.loader.load import LOAD_FORMATS, load_model_source
from model_server.loader.source import ModelLoadError, ModelSource

__all__ = [
    "LOAD_FORMATS",
    "ModelLoadError",
    "ModelSource",
    "embedded_model_path",
    "load_model_source",
]
