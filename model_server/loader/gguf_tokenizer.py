"""A fast HF tokenizer built from a GGUF's `tokenizer.*` metadata.

The vocabulary-to-`tokenizers` conversion is transformers' own (`convert_gguf_tokenizer`, the
code behind `AutoTokenizer.from_pretrained(..., gguf_file=...)`), fed with the metadata our
reader already parsed, so the ids match transformers' GGUF tokenizer without its slow reader.
A byte-level vocabulary then gets the pre-tokenizer its `tokenizer.ggml.pre` names
(`gguf_pretokenizer.py`): transformers knows only some of those names and cuts text the GPT-2
way for the rest, which changes the ids of digit runs, CJK text and newlines.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from model_server.loader.gguf_file import GGUFFile
from model_server.loader.gguf_pretokenizer import gguf_pre_tokenizer
from model_server.loader.source import ModelLoadError

if TYPE_CHECKING:
    import transformers

logger = logging.getLogger(__name__)

# HF special-token attribute -> GGUF metadata key holding its id
_SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def gguf_tokenizer(gf: GGUFFile) -> transformers.PreTrainedTokenizerFast | None:
    """None (with a warning) when the file carries no vocabulary."""
    from transformers import PreTrainedTokenizerFast

    md = gf.metadata
    tokens = md.get("tokenizer.ggml.tokens")
    if not tokens:
        logger.warning("%s: no tokenizer in the GGUF metadata; serving token ids only", gf.path)
        return None
    renames, convert = _converter()
    # llama.cpp key (without "tokenizer.") -> the name transformers' converters expect
    tokenizer_dict = {
        new: md[f"tokenizer.{old}"] for old, new in renames.items() if f"tokenizer.{old}" in md
    }
    try:
        backend, extra = convert(gf.architecture, tokenizer_dict)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise ModelLoadError(f"{gf.path}: cannot build the tokenizer: {exc}") from exc
    if md.get("tokenizer.ggml.model") == "gpt2":
        _set_pre_tokenizer(gf, backend)

    kwargs: dict[str, Any] = dict(extra)
    for attr, key in _SPECIAL_TOKEN_KEYS.items():
        token_id = md.get(key)
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            kwargs[attr] = tokens[int(token_id)]
    # llama.cpp prepends BOS to sentencepiece ("llama") vocabularies unless the file says not to
    default_bos = md.get("tokenizer.ggml.model") == "llama"
    kwargs["add_bos_token"] = bool(md.get("tokenizer.ggml.add_bos_token", default_bos))
    kwargs["add_eos_token"] = bool(md.get("tokenizer.ggml.add_eos_token", False))
    context = md.get(f"{gf.architecture}.context_length")
    if context:
        kwargs["model_max_length"] = int(context)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        name_or_path=gf.path,
        chat_template=md.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
        **kwargs,
    )
    return tokenizer


def _set_pre_tokenizer(gf: GGUFFile, backend: Any) -> None:
    """Split text the way this vocabulary's merges were learned, named by `tokenizer.ggml.pre`."""
    pre = gf.metadata.get("tokenizer.ggml.pre")
    if pre is None:
        return  # older files: transformers' GPT-2 split, as llama.cpp's "default" roughly does
    pre_tokenizer = gguf_pre_tokenizer(str(pre))
    if pre_tokenizer is not None:
        backend.pre_tokenizer = pre_tokenizer
    elif str(pre) not in _transformers_pre_names():
        logger.warning(
            "%s: tokenizer.ggml.pre %r is not a pre-tokenizer Wick knows; splitting text the "
            "GPT-2 way, so ids of digits, CJK text or newlines may differ from the model's own",
            gf.path,
            pre,
        )


def _transformers_pre_names() -> frozenset[str]:
    """The `tokenizer.ggml.pre` names transformers' converter gives their own split regex."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_PRE_TOKENIZER_SPLITS,
        )
    except ImportError:  # a transformers without them
        return frozenset()
    return frozenset(GGUF_PRE_TOKENIZER_SPLITS)


def _converter() -> tuple[dict[str, str], Callable[[str, dict], tuple[Any, dict]]]:
    """transformers' GGUF key renames and converter (moved in transformers 5)."""
    try:
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:  # transformers 4.x (untested here)
        from transformers.integrations.ggml import (  # type: ignore[no-redef]
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    return GGUF_TOKENIZER_MAPPING["tokenizer"], convert_gguf_tokenizer
