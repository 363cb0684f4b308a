"""Hugging Face hub ids (`owner/name`) -> a local snapshot folder, via huggingface_hub.

Honours HF_TOKEN, HF_HUB_OFFLINE (read when called, not at import), HF_HUB_CACHE / HF_HOME and
the local cache: an id already in the cache loads with no network at all in offline mode.
"""

from __future__ import annotations

import os
import re

from model_server.loader.source import ModelLoadError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[A-Za-z0-9][\w.\-]*$")

# modules.json and sentence_bert_config.json: sentence-transformers' pooling setup
# (engine/pooling/config.py); its Pooling module's folder is fetched on its own (POOLING_PATTERNS).
CONFIG_PATTERNS = ["config.json", "generation_config.json", "modules.json",
                   "sentence_bert_config.json"]  # fmt: skip
POOLING_PATTERNS = ["1_Pooling/config.json"]
TOKENIZER_PATTERNS = [
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",  # BERT's WordPiece
    "sentencepiece.bpe.model",  # XLM-RoBERTa's
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
]
WEIGHT_PATTERNS = ["*.safetensors", "model.safetensors.index.json"]
# fnmatch's * also matches "/": keep to the top level (no original/ or onnx/ copies), and skip
# Mistral's duplicate consolidated.safetensors.
IGNORE_PATTERNS = ["*/*", "consolidated*"]


def looks_like_hub_id(model: str) -> bool:
    return bool(_HUB_ID.match(model)) and ".." not in model and not model.endswith(".gguf")


def _offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return env.strip().lower() in ("1", "true", "yes", "on") or bool(constants.HF_HUB_OFFLINE)


def _cache_dir() -> str | None:
    if cache := os.environ.get("HF_HUB_CACHE"):
        return cache
    if home := os.environ.get("HF_HOME"):
        return os.path.join(home, "hub")
    return None  # huggingface_hub's default


def download(repo_id: str, revision: str | None = None, *, weights: bool = True) -> str:
    """The snapshot folder for `repo_id` (config + tokenizer, and safetensors when `weights`)."""
    import huggingface_hub
    from huggingface_hub import errors

    offline = _offline()
    patterns = CONFIG_PATTERNS + TOKENIZER_PATTERNS + (WEIGHT_PATTERNS if weights else [])
    where = f"{repo_id!r} is not a local file or folder, so it was taken as a Hugging Face hub id"
    common = {
        "revision": revision,
        "cache_dir": _cache_dir(),
        "token": os.environ.get("HF_TOKEN") or None,
        "local_files_only": offline,
    }
    try:
        folder = huggingface_hub.snapshot_download(
            repo_id, allow_patterns=patterns, ignore_patterns=IGNORE_PATTERNS, **common
        )
        if os.path.isfile(os.path.join(folder, "modules.json")):
            # A sentence-transformers model: its pooling config sits in a subfolder, which
            # IGNORE_PATTERNS leaves out.
            huggingface_hub.snapshot_download(repo_id, allow_patterns=POOLING_PATTERNS, **common)
        return folder
    except errors.GatedRepoError as exc:
        reason = f"the repo is gated: accept its license and set HF_TOKEN ({_first_line(exc)})"
    except errors.RepositoryNotFoundError:
        reason = "no such repo on the hub (or it is private: set HF_TOKEN)"
    except errors.RevisionNotFoundError:
        reason = f"the repo has no revision {revision!r}"
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled) as exc:
        if offline:
            reason = "HF_HUB_OFFLINE is set and it is not in the local hub cache"
        else:
            reason = f"cannot reach the hub and it is not in the local cache ({_first_line(exc)})"
    except Exception as exc:  # network stacks raise many types; all mean "download failed"
        reason = f"download failed: {type(exc).__name__}: {_first_line(exc)}"
    raise ModelLoadError(f"{where}: {reason}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
