"""The pre-tokenizer a GGUF's `tokenizer.ggml.pre` names, checked against llama.cpp's own split
regexes (`llama-vocab.cpp`, copied below as llama.cpp writes them, not as Wick does) run two ways:
through `tokenizers`' Split and through the `regex` package with llama.cpp's split semantics; and
against the HF tokenizers of the families that transformers ships (Qwen2) or whose
`tokenizer.json` rule transformers carries (Llama 3). GGUFs written with gguf's GGUFWriter (a
byte-level vocabulary whose merges join whole pieces, and across them) must give the ids of the
same BPE behind llama.cpp's splits. The embedded SmolLM2 GGUF (`smollm`) keeps today's ids."""

from __future__ import annotations

import logging
import unicodedata
from pathlib import Path

import gguf
import pytest
import regex
import transformers
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers.convert_slow_tokenizer import bytes_to_unicode

from model_server.loader.dummy import embedded_model_path
from model_server.loader.gguf_file import read_gguf
from model_server.loader.gguf_pretokenizer import (
    DEEPSEEK_LLM_SPLITS,
    PRE_TOKENIZERS,
    gguf_pre_tokenizer,
)
from model_server.loader.gguf_tokenizer import gguf_tokenizer

# ---- llama.cpp's regex lists, per pre-tokenizer type ------------------------------------------

_LC_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LC_LLAMA3 = (
    _LC_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_LC_QWEN2 = (
    _LC_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_LC_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LC_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_LC_CJK = r"[一-龥ࠀ-一가-퟿]+"
# the letter class is checked on its own below (its code points do not survive copying)
_LC_DEEPSEEK_LLM = (
    r"[\r\n]",
    DEEPSEEK_LLM_SPLITS[1],
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    _LC_CJK,
    r"\p{N}+",
)
_LC_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _LC_CJK, r"\p{N}")
_LC_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _LC_GPT2, r"[0-9][0-9][0-9]")
_LC_STARCODER = (r"\p{N}", _LC_GPT2)

LLAMA_CPP: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe", "glm4", "chatglm-bpe"),
        _LC_LLAMA3,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), _LC_QWEN2),
    "deepseek-llm": _LC_DEEPSEEK_LLM,
    "deepseek-coder": _LC_DEEPSEEK_CODER,
    "deepseek-v3": _LC_DEEPSEEK3,
    "falcon": _LC_FALCON,
    **dict.fromkeys(("gpt-2", "phi-2"), (_LC_GPT2,)),
    **dict.fromkeys(("starcoder", "refact", "smollm"), _LC_STARCODER),
}

TEXTS = (
    "12345678",
    "你好世界",
    'Hello, world! (a+b)*c=d; x:=y... "quoted" [1,2] {k: v} ~/path/to-file.py #tag @me',
    "line one\nline two\r\n\n\tindented  \n  ",
    "I'm sure they'll say it's what we'd've done. DON'T YOU'RE",
    "Pi is 3.14159, 你好，世界123！こんにちは カタカナ 한국어 ΑΒΓ абв",
    "  leading spaces,\ttabs\t\tand trailing   ",
)
_BYTE = bytes_to_unicode()


def _llama_cpp_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in LLAMA_CPP[pre]]
    return pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def _llama_cpp_split(text: str, patterns: tuple[str, ...]) -> list[str]:
    """llama.cpp's `unicode_regex_split`: each regex cuts every piece into matches and gaps."""
    pieces = [text]
    for pattern in patterns:
        rx = regex.compile(pattern)
        cut: list[str] = []
        for piece in pieces:
            pos = 0
            for m in rx.finditer(piece):
                if m.start() > pos:
                    cut.append(piece[pos : m.start()])
                if m.end() > m.start():
                    cut.append(m.group())
                pos = m.end()
            if pos < len(piece):
                cut.append(piece[pos:])
        pieces = cut
    return ["".join(_BYTE[b] for b in p.encode()) for p in pieces]


def _pieces(pre_tokenizer: pre_tokenizers.PreTokenizer, text: str) -> list[str]:
    return [piece for piece, _ in pre_tokenizer.pre_tokenize_str(text)]


def test_every_llama_cpp_name_has_a_reference() -> None:
    assert set(PRE_TOKENIZERS) == set(LLAMA_CPP)


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
@pytest.mark.parametrize("text", TEXTS)
def test_pieces_match_llama_cpp_regexes(pre: str, text: str) -> None:
    ours = _pieces(gguf_pre_tokenizer(pre), text)
    assert ours == _pieces(_llama_cpp_pre_tokenizer(pre), text)
    assert ours == _llama_cpp_split(text, LLAMA_CPP[pre])


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_match_hf_tokenizers(text: str) -> None:
    # Qwen2's own HF tokenizer (the same rule for StableLM 2 and the R1 Qwen distills)
    qwen = transformers.Qwen2Tokenizer(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")])
    expected = _pieces(qwen.backend_tokenizer.pre_tokenizer, text)
    for pre in ("qwen2", "stablelm2", "deepseek-r1-qwen"):
        assert _pieces(gguf_pre_tokenizer(pre), text) == expected, pre
    # Llama 3's tokenizer.json rule, as transformers carries it (GLM-4's is the same)
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    llama3 = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(GGUF_PRE_TOKENIZER_SPLITS["llama-bpe"]), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    for pre in ("llama-bpe", "glm4"):
        assert _pieces(gguf_pre_tokenizer(pre), text) == _pieces(llama3, text), pre
    # SmolLM2's / StarCoder's tokenizer.json: Digits(individual) then GPT-2's ByteLevel
    smollm = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    assert _pieces(gguf_pre_tokenizer("smollm"), text) == _pieces(smollm, text)


def test_digits_cjk_and_newlines_differ_from_the_gpt2_split() -> None:
    """What the fallback got wrong, spelled out for the families issue 16 loads."""
    assert _pieces(gguf_pre_tokenizer("deepseek-v3"), "12345678你好") == [
        "123",
        "456",
        "78",
        "".join(_BYTE[b] for b in "你好".encode()),
    ]
    assert _pieces(gguf_pre_tokenizer("glm4"), "x 12345") == ["x", "Ġ", "123", "45"]
    assert _pieces(gguf_pre_tokenizer("qwen2"), "1234") == ["1", "2", "3", "4"]
    assert _pieces(gguf_pre_tokenizer("deepseek-llm"), "a\n\nb") == ["a", "Ċ", "Ċ", "b"]
    assert _pieces(gguf_pre_tokenizer("llama-bpe"), "a\n\nb") == ["a", "ĊĊ", "b"]
    assert _pieces(gguf_pre_tokenizer("gpt-2"), "a\n\nb 1234") == ["a", "Ċ", "Ċ", "b", "Ġ1234"]


def test_deepseek_letter_class_is_cased_letters() -> None:
    """The class is escaped code points; a range reversed or a letter swapped by NFC fails."""
    body = DEEPSEEK_LLM_SPLITS[1][len(r"\s?[") : -len("]+")]
    chars = regex.findall(r".-.|.", body, flags=regex.DOTALL)
    assert "".join(chars) == body
    for item in chars:
        lo, hi = (item[0], item[2]) if len(item) == 3 else (item, item)
        assert ord(lo) <= ord(hi), item
        for cp in range(ord(lo), ord(hi) + 1):
            assert unicodedata.category(chr(cp)) in ("Lu", "Ll", "Lt", "Cn"), hex(cp)
    assert {"\u1fbe", "\u2126", "\u212a", "\u1f7d"} <= {c for c in body if c != "-"}


# ---- GGUFs through gguf_tokenizer ---------------------------------------------------------------

# pre -> the GGUF architecture a file with it is written for
ARCH = {
    "llama-bpe": "llama",
    "smollm": "llama",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
    "stablelm2": "stablelm",
    "phi-2": "phi2",
    "deepseek-llm": "deepseek2",
    "deepseek-v3": "deepseek2",
    "glm4": "glm4",
    "chatglm-bpe": "glm4",
}


def _vocab() -> tuple[list[str], list[str]]:
    """The 256 byte symbols, then every prefix of every piece that llama.cpp's splits or the
    GPT-2 split give the texts, merged left to right: a piece made whole is one token, and a
    text cut where it should not be comes out as other tokens."""
    tokens = ["<|endoftext|>", *_BYTE.values()]
    seen = set(tokens)
    merges: list[str] = []
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    for text in TEXTS:
        pieces = {p for pre in LLAMA_CPP for p in _pieces(_llama_cpp_pre_tokenizer(pre), text)}
        for piece in sorted(pieces | set(_pieces(gpt2, text))):
            for i in range(1, len(piece)):
                if piece[: i + 1] not in seen:
                    seen.add(piece[: i + 1])
                    tokens.append(piece[: i + 1])
                    merges.append(f"{piece[:i]} {piece[i]}")
    return tokens, merges


def _write(path: Path, arch: str, pre: str | None, tokens: list[str], merges: list[str]) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (len(tokens) - 1))
    writer.add_token_merges(merges)
    writer.add_eos_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def vocab() -> tuple[list[str], list[str]]:
    return _vocab()


def _reference(pre: str, tokens: list[str], merges: list[str]) -> Tokenizer:
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merges])
    reference = Tokenizer(bpe)
    reference.pre_tokenizer = _llama_cpp_pre_tokenizer(pre)
    return reference


@pytest.mark.parametrize("pre", list(ARCH))
def test_gguf_tokenizer_ids_match_llama_cpp_splits(
    pre: str, vocab: tuple[list[str], list[str]], tmp_path: Path
) -> None:
    tokens, merges = vocab
    path = tmp_path / f"{pre}.gguf"
    _write(path, ARCH[pre], pre, tokens, merges)
    ours = gguf_tokenizer(read_gguf(str(path)))
    assert ours is not None
    reference = _reference(pre, tokens, merges)
    gpt2 = _reference("gpt-2", tokens, merges)
    differs = False
    for text in TEXTS:
        ids = ours(text, add_special_tokens=False).input_ids
        assert ids == reference.encode(text).ids, (pre, text)
        assert ours.decode(ids) == text
        differs |= ids != gpt2.encode(text).ids
    # the vocabulary tells the splits apart: the GPT-2 fallback would have failed above
    assert differs == (pre != "phi-2")
    special = ours("a<|endoftext|>", add_special_tokens=False).input_ids
    assert special[-1] == 0


def test_unknown_pre_keeps_the_gpt2_split_and_warns_once(
    vocab: tuple[list[str], list[str]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tokens, merges = vocab
    for pre in ("not-a-pre-tokenizer", "tekken", None):  # unknown, transformers' own, absent
        path = tmp_path / f"{pre}.gguf"
        _write(path, "llama", pre, tokens, merges)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="model_server.loader.gguf_tokenizer"):
            ours = gguf_tokenizer(read_gguf(str(path)))
        assert ours is not None
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        if pre == "not-a-pre-tokenizer":
            assert len(warnings) == 1 and "'not-a-pre-tokenizer'" in warnings[0], warnings
            gpt2 = _reference("gpt-2", tokens, merges)
            for text in TEXTS:
                assert ours(text, add_special_tokens=False).input_ids == gpt2.encode(text).ids
        else:
            assert warnings == [], (pre, warnings)


# ---- the embedded SmolLM2 GGUF ----------------------------------------------------------------

# ids from the tokenizer before `smollm` had its own pre-tokenizer: SmolLM2's vocabulary has no
# token joining a digit to anything, so isolating digits changes nothing
SMOLLM2_IDS = {
    "Order 12345678 shipped on 2024-11-24 at 09:30.": [
        22977, 216, 33, 34, 35, 36, 37, 38, 39, 40, 21975, 335, 216, 34, 32, 34, 36, 29, 33,
        33, 29, 34, 36, 418, 216, 32, 41, 42, 35, 32, 30,
    ],
    "你好世界\n\nline two\r\n\ttab": [
        18645, 250, 48392, 138, 7906, 240, 178, 239, 230, 198, 198, 1311, 827, 2738, 197, 15999,
    ],
    "I'm sure they'll say it's what we'd've done!!": [
        57, 5248, 2090, 502, 3060, 1643, 357, 506, 732, 392, 6737, 3543, 2294, 10095,
    ],
}  # fmt: skip


def test_embedded_smollm2_ids_unchanged() -> None:
    gf = read_gguf(embedded_model_path())
    assert gf.metadata["tokenizer.ggml.pre"] == "smollm"
    tok = gguf_tokenizer(gf)
    assert tok is not None
    assert _pieces(tok.backend_tokenizer.pre_tokenizer, "a 12") == ["a", "Ġ", "1", "2"]
    for text, ids in SMOLLM2_IDS.items():
        assert tok(text, add_special_tokens=False).input_ids == ids, text
        assert tok.decode(ids) == text
