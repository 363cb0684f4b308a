"""Random PEFT LoRA adapters for a served model, for benchmarks (`bench serve --lora-modules`):
one folder per adapter (`adapter_config.json` + `adapter_model.safetensors`, PEFT's names),
random non-zero A and B on the chosen projections of every decoder layer, shapes from the
model's config (an HF folder, a .gguf file, or the embedded SmolLM2 by default).

    .venv/bin/python -m tools.lora_adapters --out /tmp/loras [--count 4] [--rank 16]
        [--model PATH] [--targets q_proj k_proj ...]

prints the `--lora-modules` value for `./wick serve` (name=path ...) and for `bench serve`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def model_shapes(model: str | None) -> dict[str, Any]:
    """hidden, intermediate, layer count and q/k/v widths of `model` (None: the embedded one)."""
    from model_server.loader.embedded import embedded_model_path

    path = model or embedded_model_path()
    if path.endswith(".gguf"):
        from model_server.loader.gguf_config import gguf_hf_config
        from model_server.loader.gguf_file import read_gguf

        config = gguf_hf_config(read_gguf(path))
    else:
        import transformers

        config = transformers.AutoConfig.from_pretrained(path)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return {
        "hidden": config.hidden_size,
        "intermediate": config.intermediate_size,
        "layers": config.num_hidden_layers,
        "q": heads * head_dim,
        "kv": kv_heads * head_dim,
    }


def projection_shapes(shapes: dict[str, Any]) -> dict[str, tuple[str, int, int]]:
    """PEFT module suffix -> (its parent, inputs, outputs)."""
    h, i, q, kv = shapes["hidden"], shapes["intermediate"], shapes["q"], shapes["kv"]
    return {
        "q_proj": ("self_attn", h, q),
        "k_proj": ("self_attn", h, kv),
        "v_proj": ("self_attn", h, kv),
        "o_proj": ("self_attn", q, h),
        "gate_proj": ("mlp", h, i),
        "up_proj": ("mlp", h, i),
        "down_proj": ("mlp", i, h),
    }


def write_adapter(
    folder: Path,
    shapes: dict[str, Any],
    rank: int,
    alpha: float,
    targets: list[str],
    seed: int,
) -> None:
    """One adapter: A ~ N(0, 1/in) and B ~ N(0, 0.1 / r) (non-zero, small against the base)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    proj = projection_shapes(shapes)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(shapes["layers"]):
        for name in targets:
            parent, n_in, n_out = proj[name]
            key = f"base_model.model.model.layers.{layer}.{parent}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) / n_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.1 / rank
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": targets,
        "bias": "none",
        "lora_dropout": 0.0,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder of the adapters' folders")
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded)")
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--targets", nargs="+", default=list(ALL_TARGETS), choices=ALL_TARGETS)
    args = parser.parse_args(argv)
    if args.count < 1 or args.rank < 1:
        parser.error("--count and --rank must be positive")
    shapes = model_shapes(args.model)
    names = []
    for i in range(args.count):
        name = f"lora{i + 1}"
        write_adapter(args.out / name, shapes, args.rank, args.alpha, args.targets, seed=i + 1)
        names.append(name)
    print("serve:", " ".join(f"{n}={args.out / n}" for n in names))
    print("bench:", " ".join(names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
