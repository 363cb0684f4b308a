"""The seeds' own `serve` flags, declared as aliases of Wick's settings (settings_spec.py).

candle-vllm(-gcu) spells its server's command line `--w FOLDER llama3 --mem 8192 --penalty 1.1`,
vLLM-GCU's api_server adds `--trust-remote-code --disable-log-requests`. Each alias here maps
onto one or more settings: entrypoints/seed_flags.py writes them into the parsed namespace
before the settings layer reads it, so the usual precedence (flag, then environment, then
default) holds and every value is checked where the setting's own flag would be. Aliases that
are plain spellings of one setting with the same value (`--penalty`, `--max-gen-tokens`) are
that setting's `aliases` instead. Shown in `serve --help` (their own argument group) and
docs/configuration.md.

Imports nothing of ours: settings_spec renders these in docs/configuration.md.
"""

from __future__ import annotations

from dataclasses import dataclass

# candle-vllm's positional MODEL_TYPE -> the HF architectures it names. candle-vllm's README
# lists llama, llama3, mistral, phi2, phi3, qwen2, gemma, yi, stable-lm; candle-vllm-gcu adds
# qwen3, glm4, deep-seek and the MoE families. Llama-layout families (Yi, Llama 2/3) share
# LlamaForCausalLM, so `llama` and `llama3` accept the same checkpoints.
MODEL_TYPES: dict[str, tuple[str, ...]] = {
    "llama": ("LlamaForCausalLM",),
    "llama3": ("LlamaForCausalLM",),
    "yi": ("LlamaForCausalLM",),
    "mistral": ("MistralForCausalLM", "LlamaForCausalLM"),
    "phi2": ("PhiForCausalLM",),
    "phi3": ("Phi3ForCausalLM",),
    "qwen2": ("Qwen2ForCausalLM",),
    "qwen3": ("Qwen3ForCausalLM",),
    "qwen2moe": ("Qwen2MoeForCausalLM",),
    "qwen3moe": ("Qwen3MoeForCausalLM",),
    "gemma": ("GemmaForCausalLM",),
    "gemma2": ("Gemma2ForCausalLM",),
    "gemma3": ("Gemma3ForCausalLM",),
    "stable-lm": ("StableLmForCausalLM",),
    "glm4": ("Glm4ForCausalLM",),
    "mixtral": ("MixtralForCausalLM",),
    "deep-seek": ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
}


@dataclass(slots=True, frozen=True)
class FlagAlias:
    """A seed's flag: `flags` (the first names it), the settings it sets (`targets`, for the
    docs), what it means, and the seed it comes from. `switch`: takes no value."""

    flags: tuple[str, ...]
    targets: tuple[str, ...]
    help: str
    origin: str
    switch: bool = False
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return "alias_" + self.flags[0].lstrip("-").replace("-", "_")


FLAG_ALIASES: tuple[FlagAlias, ...] = (
    FlagAlias(
        ("--weight-path", "--w"),
        ("model",),
        "A local model folder: --model FOLDER (with --f, the folder of that file).",
        "candle-vllm",
        metavar="FOLDER",
    ),
    FlagAlias(
        ("--model-id", "--m"),
        ("model",),
        "A Hugging Face hub id: --model ID.",
        "candle-vllm",
        metavar="ID",
    ),
    FlagAlias(
        ("--f",),
        ("model",),
        "A GGUF file: --model FILE, inside --weight-path's folder when the path is relative.",
        "candle-vllm",
        metavar="FILE",
    ),
    FlagAlias(
        ("--d",),
        ("device_ids", "tensor_parallel_size"),
        "Device ids, e.g. 0,1: --device-ids, and (candle-vllm shards over every id given) "
        "--tensor-parallel-size their count unless -tp is given.",
        "candle-vllm",
        metavar="IDS",
    ),
    FlagAlias(
        ("--p",),
        ("port",),
        "The port: --port.",
        "candle-vllm",
        metavar="PORT",
    ),
    FlagAlias(
        ("--mem",),
        ("kv_cache_memory",),
        "KV cache budget in MiB (candle-vllm's unit): --mem 8192 is --kv-cache-memory 8192MiB. "
        "A unit may be written (--mem 8GiB).",
        "candle-vllm",
        metavar="MIB",
    ),
    FlagAlias(
        ("--prefill-chunk-size",),
        ("max_num_batched_tokens", "enable_chunked_prefill"),
        "Prefill chunk size in tokens: N > 0 is --max-num-batched-tokens N (the step's token "
        "budget, which bounds every prefill chunk: a chunk gets what the step's decodes leave "
        "of it) with chunked prefill on; 0 is --no-enable-chunked-prefill (candle-vllm's "
        "'disable').",
        "candle-vllm",
        metavar="TOKENS",
    ),
    FlagAlias(
        ("--quant",),
        ("quantization",),
        "candle-vllm-gcu's quantization: gptq or awq (the checkpoint's format, checked as "
        "--quantization's), or q8_0 (8-bit weights at load: --quantization int8).",
        "candle-vllm",
        metavar="METHOD",
    ),
    FlagAlias(
        ("--log",),
        ("access_log", "log_level"),
        "candle-vllm's switch for its logs: --access-log (one line per request) and "
        "--log-level info unless --log-level is given; overrides LLM_ACCESS_LOG=false.",
        "candle-vllm",
        switch=True,
    ),
    FlagAlias(
        ("--disable-log-requests",),
        ("access_log",),
        "vLLM's switch for its per-request log lines: --no-access-log.",
        "vLLM-GCU",
        switch=True,
    ),
    FlagAlias(
        ("--trust-remote-code",),
        (),
        "Accepted for vLLM's command lines and ignored: Wick implements every architecture it "
        "loads and never runs a checkpoint's Python code (logged once at startup).",
        "vLLM-GCU",
        switch=True,
    ),
)

MODEL_TYPE_HELP = (
    "candle-vllm's optional positional model type, checked against the model's architecture "
    "(a mismatch is an error): " + ", ".join(MODEL_TYPES) + ". It may come first or last; after "
    "--served-model-name (which takes several names) write it after `--`."
)


def aliases_markdown() -> list[str]:
    """docs/configuration.md's section on the seeds' flags."""
    out = [
        "",
        "## candle-vllm and vLLM-GCU flags (`serve`)",
        "",
        "The seeds' own spellings, mapped onto the settings above (they have no variables of "
        "their own: set the settings' `LLM_*` names). A flag and an alias of it that disagree "
        "are an error. The positional `MODEL_TYPE` ("
        + ", ".join(f"`{t}`" for t in MODEL_TYPES)
        + ") is checked against the model's architecture: a mismatch is an error naming both.",
        "",
        "| Flag | Origin | Sets | Meaning |",
        "|---|---|---|---|",
    ]
    for a in FLAG_ALIASES:
        flags = ", ".join(f"`{f}`" for f in a.flags)
        targets = ", ".join(f"`--{t.replace('_', '-')}`" for t in a.targets) or "nothing"
        meaning = a.help.replace("|", "\\|")
        out.append(f"| {flags} | {a.origin} | {targets} | {meaning} |")
    return out
