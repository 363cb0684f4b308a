"""How a byte-level BPE GGUF cuts text into pieces before its merges run (`tokenizer.ggml.pre`).

llama.cpp's converter names the model's pre-tokenizer in `tokenizer.ggml.pre`; llama.cpp keeps
one list of split regexes per name (`llama-vocab.cpp`), applied in order, each splitting every
piece the previous ones left into its matches and the text between them. The same cuts in
`tokenizers` are one `Split(isolated)` per regex, then the byte-to-unicode step. Where the model's
own `tokenizer.json` spells an equivalent rule differently (`(?i:'s|...)` where llama.cpp writes
`'[sS]`, `Digits` for `\\p{N}`), its spelling is used, since the ids must match that tokenizer.

Only the character classes of DeepSeek's two tokenizers are spelled with escapes: several of
their letters (U+1FBE, U+2126, U+212A, ...) are canonical singletons that an editor or a copy
through NFC silently turns into other code points, which would reverse a range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers.pre_tokenizers import PreTokenizer


@dataclass(frozen=True, slots=True)
class Step:
    """One stage: `split` (regex, isolated), `digits` (each digit its own piece), `gpt2` (GPT-2's
    own split regex, then bytes to unicode) or `bytes` (bytes to unicode, no split)."""

    kind: str
    pattern: str = ""


_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
# Llama 3 / GLM-4 (cl100k's rule): digits in runs of up to three.
LLAMA3_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2/2.5/3 and StableLM 2: the same with every digit on its own.
QWEN2_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# DeepSeek LLM / V2: the cased letters of many scripts, ASCII and full-width punctuation,
# CJK + Hangul runs, digit runs.
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd"
    "\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d"
    "\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4"
    "\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec"
    "\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b"
    "\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787"
    "\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
DEEPSEEK_LLM_SPLITS = (
    r"[\r\n]",
    r"\s?[" + _DEEPSEEK_LETTERS + "]+",
    r"\s?[!-/:-~" + "\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002" + "]+",
    r"\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    # llama.cpp's rule; the HF file isolates each digit instead, which gives the same ids
    # because that vocabulary has no token of two digits
    r"\p{N}+",
)
DEEPSEEK_CODER_SPLITS = (
    r"[\r\n]",
    r"\s?\p{L}+",
    r"\s?\p{P}+",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    r"\p{N}",
)
# DeepSeek V3 / R1: digits in threes, CJK + kana runs, then a cl100k-like rule.
DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# GPT-2's rule without its last `|\s+`, as llama.cpp keeps it for Falcon.
_GPT2_NO_TAIL = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
FALCON_SPLITS = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_NO_TAIL, r"[0-9][0-9][0-9]")


def _splits(*patterns: str) -> tuple[Step, ...]:
    return (*(Step("split", p) for p in patterns), Step("bytes"))


_GPT2 = (Step("gpt2"),)
# StarCoder's tokenizer (and SmolLM's, trained from it): each digit alone, then GPT-2.
_STARCODER = (Step("digits"), Step("gpt2"))
_LLAMA3 = _splits(LLAMA3_SPLIT)
_QWEN2 = _splits(QWEN2_SPLIT)

# `tokenizer.ggml.pre` -> stages, for the names llama.cpp gives the families Wick loads
# from GGUF (llama, phi2, phi3, gemma*, stablelm, qwen2*, qwen3*, deepseek2, glm4).
PRE_TOKENIZERS: dict[str, tuple[Step, ...]] = {
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "falcon3": _LLAMA3,
    "dbrx": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "glm4": _LLAMA3,
    "chatglm-bpe": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "megrez": _QWEN2,
    "stablelm2": _QWEN2,
    "deepseek-llm": _splits(*DEEPSEEK_LLM_SPLITS),
    "deepseek-coder": _splits(*DEEPSEEK_CODER_SPLITS),
    "deepseek-v3": _splits(*DEEPSEEK_V3_SPLITS),
    "falcon": _splits(*FALCON_SPLITS),
    "gpt-2": _GPT2,
    "phi-2": _GPT2,
    "starcoder": _STARCODER,
    "refact": _STARCODER,
    "smollm": _STARCODER,
}


def build_pre_tokenizer(steps: tuple[Step, ...]) -> PreTokenizer:
    from tokenizers import Regex, pre_tokenizers

    parts: list[PreTokenizer] = []
    for step in steps:
        if step.kind == "split":
            parts.append(pre_tokenizers.Split(Regex(step.pattern), behavior="isolated"))
        elif step.kind == "digits":
            parts.append(pre_tokenizers.Digits(individual_digits=True))
        elif step.kind in ("gpt2", "bytes"):
            use_regex = step.kind == "gpt2"
            parts.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex))
        else:
            raise ValueError(f"unknown pre-tokenizer step {step.kind!r}")
    return parts[0] if len(parts) == 1 else pre_tokenizers.Sequence(parts)


def gguf_pre_tokenizer(pre: str) -> PreTokenizer | None:
    """The pre-tokenizer `tokenizer.ggml.pre` names; None when it is not one of ours."""
    steps = PRE_TOKENIZERS.get(pre)
    return None if steps is None else build_pre_tokenizer(steps)
