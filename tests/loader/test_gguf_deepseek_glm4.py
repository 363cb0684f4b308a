"""GGUF files of DeepSeek-V2/V3 (llama.cpp's `deepseek2`: multi-head latent attention, MoE with
group-limited / grouped top-k, the correction bias `exp_probs_b`, shared experts, a dense first
layer, yarn) and GLM-4 (`glm4`: sandwich norms, interleaved partial rotary, fused gate_up, q/k/v
bias), written with the gguf package's writer from tiny random HF models the way llama.cpp's
converter writes them: deepseek2 both ways, today's (kv_b_proj split into attn_k_b, each head
transposed, and attn_v_b; the MQA-over-the-latent metadata with key/value_length_mla) and the
older one (one attn_kv_b, the per-head sizes in key/value_length, no gating key).

Loaded through `load_model_source`, the model built from the rebuilt config gives HF's prefill
logits and 32 greedy tokens. Q8_0 files (the gguf package's quantizer) run through `LLM` kept
quantized and dequantized with the same greedy tokens. Malformed files are refused in one line
naming the tensor."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from model_server.engine.llm import LLM
from model_server.layers.attention import get_attention_backend
from model_server.layers.quantization.gguf import GGUFWeight
from model_server.loader import ModelLoadError, load_model_source
from model_server.loader.gguf_file import read_gguf
from model_server.models import build_model
from model_server.sampling_params import SamplingParams
from tests.loader.test_gguf_families import _expert_tensors, _gguf_name
from tests.models import test_parity_moe as moe
from tests.models.test_parity_families import CONFIGS as FAMILY_CONFIGS
from tests.models.test_parity_tiny import MAX_MODEL_LEN
from tests.weights import held

_F16, _Q8_0 = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0
# Our name -> (HF config: MOE_CONFIGS / the families' glm4, how kv_b_proj is written, the
# matrices' type: F32 when None).
CASES: dict[str, tuple[str, str | None, gguf.GGMLQuantizationType | None]] = {
    # V2: q without LoRA (V2-Lite), softmax group-limited routing, yarn with mscale
    "deepseek_v2_split": ("deepseek_v2", "split", None),
    "deepseek_v2_kv_b_f16": ("deepseek_v2", "kv_b", _F16),
    # V3: q LoRA, sigmoid routing with the correction bias, grouped top-k, norm_topk_prob
    "deepseek_v3_split": ("deepseek_v3", "split", None),
    "deepseek_v3_split_f16": ("deepseek_v3", "split", _F16),
    "glm4": ("glm4", None, None),
}
_OPTS = {"kv_cache_memory": 16 * 1024**2, "max_model_len": MAX_MODEL_LEN, "seed": 0}


def _hf_model(config_name: str, **overrides: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = FAMILY_CONFIGS["glm4"]() if config_name == "glm4" else moe.MOE_CONFIGS[config_name]()
    if overrides:  # rebuilt, so that the sizes HF derives follow
        config = type(config)(**{**config.to_dict(), **overrides})
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # HF inits these to constants: perturbed so that mix-ups show
        for pname, p in hf.named_parameters():
            if pname.endswith(".bias") or "norm" in pname:
                p.add_(torch.randn_like(p) * (0.1 if "norm" in pname else 0.02))
        for bname, b in hf.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    return hf


def _deepseek_metadata(
    w: gguf.GGUFWriter,
    cfg: transformers.PretrainedConfig,
    split: bool,
    gating: gguf.ExpertGatingFuncType | None,
    head_size_keys: bool,
) -> None:
    """What llama.cpp's DeepseekV2Model converter writes (today's when `split`, else the
    older one's: the real head sizes in key/value_length, no gating function key)."""
    nope, rope, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    lora = cfg.kv_lora_rank
    w.add_head_count_kv(1 if split else cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(lora)
    if split:
        w.add_key_length(lora + rope)
        w.add_value_length(lora)
        if head_size_keys:
            w.add_key_length_mla(nope + rope)
            w.add_value_length_mla(v)
    elif head_size_keys:
        w.add_key_length(nope + rope)
        w.add_value_length(v)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    if gating is None and cfg.model_type == "deepseek_v3":
        gating = gguf.ExpertGatingFuncType.SIGMOID
    elif gating is None and split:
        gating = gguf.ExpertGatingFuncType.SOFTMAX
    if gating is not None:
        w.add_expert_gating_func(gating)
    w.add_rope_dimension_count(rope)
    params = cfg.rope_parameters
    if params.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(params["factor"])
        w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(params["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(params["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * params["mscale_all_dim"])


def _deepseek_tensors(
    cfg: transformers.PretrainedConfig, name: str, tensor: torch.Tensor, split: bool
) -> list[tuple[str, torch.Tensor]]:
    """HF name -> the converter's (name, tensor) before the name map."""
    name = name.replace("e_score_correction_bias", "e_score_correction.bias")
    if not (split and name.endswith("kv_b_proj.weight")):
        return [(name, tensor)]
    heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    k_b, v_b = tensor.view(heads, nope + v, -1).split([nope, v], dim=1)
    return [
        (name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2)),
        (name.replace("kv_b_proj", "v_b_proj"), v_b),
    ]


def _write_gguf(
    path: Path,
    hf: torch.nn.Module,
    layout: str | None,
    *,
    qtype: gguf.GGMLQuantizationType | None = None,
    drop: tuple[str, ...] = (),
    gating: gguf.ExpertGatingFuncType | None = None,
    head_size_keys: bool = True,
) -> None:
    """`qtype`: F16 matrices, or every matrix whose rows hold whole 32-value blocks in that
    type (the others, and the router, F32 as llama.cpp leaves them); `drop`: GGUF names left out;
    `gating`: deepseek2's expert_gating_func instead of the converter's; `head_size_keys`
    False: no per-head key/value sizes (the *_mla keys, or the older files' key/value_length)."""
    cfg = hf.config
    arch = "glm4" if cfg.model_type == "glm4" else "deepseek2"
    state = {k: v.detach().float() for k, v in hf.state_dict().items()}
    state.update(_expert_tensors(state))
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    tmap = gguf.get_tensor_name_map(arch_enum, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    params = cfg.rope_parameters
    w.add_rope_freq_base(params["rope_theta"])
    if arch == "glm4":
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        partial = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
        w.add_rope_dimension_count(int(cfg.head_dim * partial))
    else:
        _deepseek_metadata(w, cfg, layout == "split", gating, head_size_keys)
    tokens = ["<unk>", "<s>", "</s>", "ab"] + [chr(ord("a") + i) for i in range(26)]
    tokens += [f"t{i}" for i in range(cfg.vocab_size - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, tensor in state.items():
        if (cfg.tie_word_embeddings and name == "lm_head.weight") or "rotary_emb" in name:
            continue
        parts = (
            [(name, tensor)]
            if arch == "glm4"
            else _deepseek_tensors(cfg, name, tensor, layout == "split")
        )
        for hf_name, data in parts:
            gguf_name = _gguf_name(tmap, hf_name)
            if gguf_name in drop:
                continue
            array = np.ascontiguousarray(data.numpy())
            matrix = array.ndim >= 2 and "ffn_gate_inp" not in gguf_name
            if matrix and qtype == _F16:
                w.add_tensor(gguf_name, array.astype(np.float16))
            elif matrix and qtype is not None and array.shape[-1] % 32 == 0:
                w.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
            else:
                w.add_tensor(gguf_name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=list(CASES))
def gguf_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    config_name, layout, qtype = CASES[request.param]
    hf = _hf_model(config_name)
    if qtype == _F16:  # HF runs the weights the file holds (fp32 compute on both sides)
        with torch.no_grad():
            for pname, p in hf.named_parameters():
                if p.dim() >= 2 and not pname.endswith("mlp.gate.weight"):
                    p.copy_(p.half().float())
    path = tmp_path_factory.mktemp(request.param) / f"{request.param}.gguf"
    _write_gguf(path, hf, layout, qtype=qtype)
    types = {t.name: t.ggml_type for t in read_gguf(str(path)).tensors}
    assert types["blk.1.attn_output.weight"] == (qtype or gguf.GGMLQuantizationType.F32)
    source = load_model_source(str(path))
    assert source.format == "gguf"
    config = source.hf_config
    assert config.architectures == [type(hf).__name__]
    ours = build_model(config, get_attention_backend("torch"), max_model_len=MAX_MODEL_LEN)
    assert source.weights is not None
    loaded = ours.load_weights(source.weights())
    assert loaded == {name for name, _ in ours.named_parameters()}
    return moe.Pair(hf=hf, ours=ours, native=None, folder=path), request.param


def test_gguf_prefill_logits_match_hf(gguf_pair) -> None:
    moe.test_prefill_logits_match_hf(gguf_pair[0])


def test_gguf_greedy_tokens_match_hf(gguf_pair) -> None:
    moe.test_greedy_tokens_match_hf_generate(gguf_pair[0])


def test_gguf_config_keeps_what_the_family_needs(gguf_pair) -> None:
    pair, name = gguf_pair
    ours, theirs = pair.ours.config, pair.hf.config
    assert ours.model_type == theirs.model_type
    fields = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "attention_bias", "tie_word_embeddings"]  # fmt: skip
    if name == "glm4":
        fields += ["head_dim"]
        assert ours.rope_parameters["partial_rotary_factor"] == 0.5
    else:
        fields += ["q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                   "v_head_dim", "n_routed_experts", "num_experts_per_tok",
                   "moe_intermediate_size", "n_shared_experts", "first_k_dense_replace",
                   "routed_scaling_factor", "norm_topk_prob", "n_group", "topk_group"]  # fmt: skip
        if theirs.model_type == "deepseek_v2":
            fields.append("topk_method")
        # the latent cache: kv_lora_rank + rope dims per token and layer, not per-head K/V
        assert pair.ours.kv_cache_shape(3, 4) == (3, 4, theirs.kv_lora_rank + 8)
        theirs_rope, ours_rope = theirs.rope_parameters, ours.rope_parameters
        for key in ("rope_type", "factor", "original_max_position_embeddings", "mscale",
                    "mscale_all_dim", "beta_fast", "beta_slow"):  # fmt: skip
            assert ours_rope.get(key) == pytest.approx(theirs_rope.get(key)), key
    for field in fields:
        assert getattr(ours, field) == getattr(theirs, field), (name, field)


@pytest.mark.parametrize("layout", ["split", "kv_b"])
def test_head_sizes_come_from_the_tensors_without_their_keys(layout: str, tmp_path: Path) -> None:
    """Files without the per-head sizes: q_b's rows give nope + rope, attn_v_b / kv_b the v
    size (a split file's key_length is the latent's, not a head's)."""
    path = tmp_path / "sizes.gguf"
    _write_gguf(path, _hf_model("deepseek_v3"), layout, head_size_keys=False)
    config = load_model_source(str(path)).hf_config
    assert (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim) == (16, 8, 12)


# ---- kept quantized ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config_name", "layout"),
    [("deepseek_v2", "kv_b"), ("deepseek_v3", "split"), ("glm4", None)],
    ids=["deepseek_v2_kv_b", "deepseek_v3_split", "glm4"],
)
def test_q8_0_kept_quantized_matches_dequantized(
    config_name: str, layout: str | None, tmp_path: Path
) -> None:
    """One Q8_0 file, two layouts: fp32 activations, so only summation orders differ and every
    greedy token and its logprob (to 2e-3) agree. Matrices stay GGUFWeights, rows permuted in
    their blocks where the model de-interleaves rope rows (GLM-4's q/k, DeepSeek's q and
    kv_a_proj_with_mqa); DeepSeek's kv_b_proj (read by the attention itself, absorbed into the
    queries) is always a float tensor, merged from llama.cpp's Q8_0 attn_k_b / attn_v_b."""
    path = tmp_path / "q8_0.gguf"
    # V3 with 32 nope dims per head, so that attn_k_b ([H, L, nope]) is Q8_0 too
    overrides = {"qk_nope_head_dim": 32} if config_name == "deepseek_v3" else {}
    _write_gguf(path, _hf_model(config_name, **overrides), layout, qtype=_Q8_0)
    if config_name == "deepseek_v3":
        types = {t.name: t.ggml_type for t in read_gguf(str(path)).tensors}
        assert types["blk.1.attn_k_b.weight"] == types["blk.1.attn_v_b.weight"] == _Q8_0
    kept = LLM(str(path), dtype="float32", gguf_weights="quantized", **_OPTS)
    ref = LLM(str(path), dtype="float32", gguf_weights="dequantized", **_OPTS)
    model = kept.engine.core.model_runner.model
    attn = model.model.layers[1].self_attn
    assert isinstance(held(model.lm_head.weight), GGUFWeight)
    assert isinstance(held(model.model.layers[0].mlp.gate_up_proj.weight), GGUFWeight)
    if config_name == "glm4":
        assert isinstance(held(attn.qkv_proj.weight), GGUFWeight)
    else:
        assert isinstance(held(attn.kv_a_proj_with_mqa.weight), GGUFWeight)
        rope_q = attn.q_proj if attn.q_lora_rank is None else attn.q_a_proj
        assert isinstance(held(rope_q.weight), GGUFWeight)
        kv_b = attn.kv_b_proj.weight
        assert isinstance(kv_b, torch.nn.Parameter) and kv_b.dtype == torch.float32
    prompts = [[5, 9, 14, 20, 33], [40, 41, 42], [7] * 12, list(range(3, 40))]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)
    got = [o.outputs[0] for o in kept.generate(prompts, params)]
    want = [o.outputs[0] for o in ref.generate(prompts, params)]
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        for a, b in zip(g.logprobs, w.logprobs, strict=True):  # the chosen tokens'
            assert abs(a.logprob - b.logprob) < 2e-3


# ---- malformed files -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config_name", "layout", "dropped"),
    [
        ("deepseek_v3", "split", "blk.1.attn_v_b.weight"),
        ("deepseek_v3", "split", "blk.1.exp_probs_b.bias"),
        ("deepseek_v2", "kv_b", "blk.0.attn_kv_b.weight"),
        ("glm4", None, "blk.1.post_ffw_norm.weight"),
    ],
)
def test_a_missing_tensor_is_named_in_one_line(
    config_name: str, layout: str | None, dropped: str, tmp_path: Path
) -> None:
    path = tmp_path / "missing.gguf"
    _write_gguf(path, _hf_model(config_name), layout, drop=(dropped,))
    with pytest.raises(ModelLoadError) as info:
        load_model_source(str(path))
    message = str(info.value)
    assert f"GGUF file has no tensor {dropped}" in message and "\n" not in message


def test_softmax_routing_with_a_correction_bias_is_refused(tmp_path: Path) -> None:
    """A V3-shaped file (exp_probs_b) whose gating says softmax is neither V2 nor V3."""
    path = tmp_path / "mixed.gguf"
    _write_gguf(path, _hf_model("deepseek_v3"), "split", gating=gguf.ExpertGatingFuncType.SOFTMAX)
    with pytest.raises(ModelLoadError, match="exp_probs_b") as info:
        load_model_source(str(path))
    assert "\n" not in str(info.value)
