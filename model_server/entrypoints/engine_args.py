"""Engine flags shared by every subcommand (`generate`, `bench`, `serve`); names mirror vLLM's."""

from __future__ import annotations

import argparse

from model_server.config import parse_size
from model_server.layers.attention import ATTENTION_BACKENDS


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="HF folder, .gguf file, HF hub id, or (with --load-format dummy) a preset name such "
        "as qwen3-0.6b / llama-3.1-8b. Default: the embedded SmolLM2-135M-Instruct GGUF.",
    )
    g.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="auto: real weights; dummy: random weights for the model's config (benchmarks).",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        help="auto (fp32 on CPUs without native bf16, bf16 on GPUs), float32, bfloat16, float16.",
    )
    g.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="int8: weight-only int8 quantization at load (per output channel; activations, "
        "norms, embeddings and the KV cache stay in --dtype): 4x less weight memory than "
        "float32 and faster few-row decode steps on CPU; on cuda a Triton w8a16 kernel (cpu and "
        "cuda only). GGUF files are "
        "always read in their own format and dequantized. Default: none.",
    )
    g.add_argument(
        "--device",
        default="cpu",
        help="cpu, cuda, gcu (Enflame, needs torch_gcu), hpu (Intel Gaudi, needs "
        "habana_frameworks) or auto (the best present: cuda > hpu > gcu > cpu). Default: cpu.",
    )
    g.add_argument(
        "--device-ids",
        default=None,
        help="Comma-separated device indices for this node's ranks, e.g. 0,1 (after the vendor's "
        "CUDA_VISIBLE_DEVICES / TOPS_VISIBLE_DEVICES / HABANA_VISIBLE_MODULES). Default: 0, 1, ...",
    )
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="Ranks (devices) to shard the model over; more than one node through MASTER_ADDR, "
        "MASTER_PORT, NNODES and NODE_RANK. Default: 1.",
    )
    g.add_argument("--seed", type=int, default=0, help="Seed for dummy weights. Default: 0.")
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="Longest prompt + output in tokens. Default: the model's context length.",
    )
    g.add_argument(
        "--max-num-seqs", type=int, default=256, help="Most sequences in one step. Default: 256."
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="Token budget of one step, shared by decodes and prefill chunks. Default: 2048.",
    )
    g.add_argument(
        "--block-size", type=int, default=16, help="Tokens per KV cache block. Default: 16."
    )
    g.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        default=None,
        help="KV cache budget, e.g. 2GiB or 512MiB (a bare number is GiB). Default: 2GiB on CPU.",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Reuse the KV blocks of shared prompt prefixes. Default: on.",
    )
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Split long prompts across steps under the token budget. Default: on.",
    )
    g.add_argument(
        "--attention-backend",
        default=None,
        choices=list(ATTENTION_BACKENDS),
        help="Attention implementation: torch (portable PyTorch), cpu (native C decode kernel, "
        "built on first use; falls back to torch without a C compiler), triton (GPU). "
        "Default: the device's (cpu on CPU, triton on CUDA).",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="Never capture CUDA graphs: decode steps run eagerly (CUDA only; by default they "
        "replay a graph captured per batch-size bucket 1, 2, 4, 8, 16, ... up to max_num_seqs, "
        "at most 512).",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="Share of each accelerator's memory this server may use, in (0, 1]. At startup a "
        "forward of the largest step (--max-num-batched-tokens) is profiled, and the KV cache "
        "gets what the share leaves after weights, activations and runtime memory; memory in "
        "use before startup is not counted (nor taken). Unused with --kv-cache-memory and on "
        "CPU. Default: 0.9.",
    )
    g.add_argument(
        "--num-threads", type=int, default=None, help="CPU threads. Default: all available cores."
    )
