"""`bench kv-cache-dtype`: what a quantized KV cache costs in accuracy, and in decode time.

Accuracy: 16 chat prompts (the model's chat template) generate `--output-len` greedy tokens with
the reference cache (the engine flags' `--kv-cache-dtype`, `auto` by default: the model's dtype)
and with each of `--kv-cache-dtypes`, in one batch each. Per cache it prints the prompts whose
greedy tokens all match the reference's, the share of tokens generated before each prompt's
first divergence, and the drift of the top token's logprob at the positions both runs share (the
same context: every position up to and including the first divergence), mean and max of
|logprob - reference logprob|:

    kv-cache-dtype accuracy: embedded model, cpu bfloat16, 16 prompts x 64 greedy tokens;
        reference auto (bfloat16)
    int8:     16/16 prompts identical; 100.0% of tokens before the first divergence;
        top-token logprob drift mean 0.0041, max 0.0312 (1024 positions)
    fp8_e4m3: ...

(each a single line). Timing (`--timing`): `--batch-size` requests with `--context` random
prompt tokens each are prefilled, then the median of `--steps` decode steps (the whole engine
step: model and sampling) is timed per cache:

    decode step, batch 16, context 1000 (16512 tokens cached): auto 41.2 ms; int8 38.7 ms (0.94x)

Every cache is a fresh engine with the same flags, one after the other (the previous freed).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import random
import statistics
import time

from model_server.config import EngineConfig
from model_server.sampling_params import SamplingParams

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three primary colors.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "What does a compiler do?",
    "Translate 'good morning' into Spanish and German.",
    "Tell me a joke about computers.",
    "What is 17 times 23? Show your steps.",
    "Summarize the plot of Romeo and Juliet.",
    "What are the benefits of regular exercise?",
    "Describe a cat to someone who has never seen one.",
    "Write a Python function that reverses a string.",
    "What is photosynthesis?",
    "Name the planets of the solar system in order.",
)


def add_kv_cache_dtype_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-cache-dtypes",
        nargs="+",
        default=["int8", "fp8_e4m3", "fp8_e5m2"],
        help="Caches compared against the reference (--kv-cache-dtype).",
    )
    parser.add_argument("--output-len", type=int, default=64, help="Greedy tokens per prompt.")
    parser.add_argument(
        "--no-accuracy", action="store_true", help="Skip the greedy agreement comparison."
    )
    parser.add_argument(
        "--timing", action="store_true", help="Also time decode steps at --batch-size/--context."
    )
    parser.add_argument("--batch-size", type=int, default=16, help="Timing: decoding requests.")
    parser.add_argument("--context", type=int, default=1000, help="Timing: prompt tokens each.")
    parser.add_argument("--steps", type=int, default=16, help="Timing: decode steps timed.")


@dataclasses.dataclass(slots=True)
class Agreement:
    identical: int = 0  # prompts whose greedy tokens all match
    matched_tokens: int = 0  # tokens before each prompt's first divergence
    total_tokens: int = 0
    drifts: list[float] = dataclasses.field(default_factory=list)  # |Δ top-token logprob|

    def line(self, name: str, num_prompts: int) -> str:
        mean = statistics.fmean(self.drifts) if self.drifts else 0.0
        top = max(self.drifts, default=0.0)
        share = 100 * self.matched_tokens / max(1, self.total_tokens)
        return (
            f"{name + ':':<10}{self.identical}/{num_prompts} prompts identical; {share:.1f}% of "
            f"tokens before the first divergence; top-token logprob drift mean {mean:.4f}, max "
            f"{top:.4f} ({len(self.drifts)} positions)"
        )


Run = list[tuple[list[int], list[float]]]  # per prompt: greedy token ids, their logprobs


def compare(reference: Run, candidate: Run) -> Agreement:
    """Greedy agreement of `candidate` with `reference` (see the module docstring)."""
    result = Agreement()
    for (ref_ids, ref_lps), (ids, lps) in zip(reference, candidate, strict=True):
        result.total_tokens += len(ref_ids)
        n = 0
        while n < min(len(ids), len(ref_ids)) and ids[n] == ref_ids[n]:
            n += 1
        result.matched_tokens += n
        result.identical += int(n == len(ref_ids) == len(ids))
        # Positions [0, n] share their context (the divergent one included): the top token's
        # logprob there is comparable.
        for i in range(min(n + 1, len(ids), len(ref_ids))):
            result.drifts.append(abs(lps[i] - ref_lps[i]))
    return result


def _generate(config: EngineConfig, prompts: list[list[int]], output_len: int) -> Run:
    from model_server.engine.llm import LLM

    llm = LLM.from_config(config)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    run = []
    for out in outs:
        sample = out.outputs[0]
        run.append((list(sample.token_ids), [lp.logprob for lp in sample.logprobs or []]))
    llm.engine.shutdown()
    del llm
    gc.collect()
    return run


def _chat_prompts(config: EngineConfig) -> tuple[list[list[int]], str, str]:
    """The prompts as token ids, and the device and dtype the reference engine runs."""
    from model_server.engine.chat_template import render_chat
    from model_server.engine.llm import LLM

    llm = LLM.from_config(config)
    tokenizer = llm.engine.tokenizer
    prompts = [render_chat(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    runner = llm.engine.core.model_runner
    device, dtype = runner.device.type, str(runner.dtype).removeprefix("torch.")
    llm.engine.shutdown()
    del llm
    gc.collect()
    return prompts, device, dtype


def _decode_step_ms(config: EngineConfig, batch: int, context: int, steps: int) -> float:
    """Median ms of an engine step while `batch` requests of `context` prompt tokens decode."""
    from model_server.engine.llm_engine import LLMEngine

    engine = LLMEngine(config)
    rng = random.Random(0)
    vocab = min(engine.vocab_size, 10_000)
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), [rng.randrange(1, vocab) for _ in range(context)], params)
    scheduler = engine.scheduler
    # Prefill (and the first decode steps, unrecorded) until every request decodes.
    while (
        any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running)
        or len(scheduler.running) < batch
    ):
        engine.step()
    for _ in range(2):
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(1000 * (time.perf_counter() - start))
        if len(scheduler.running) < batch:
            break
    engine.shutdown()
    del engine
    gc.collect()
    return statistics.median(times)


def run_kv_cache_dtype_benchmark(args: argparse.Namespace, config: EngineConfig) -> int:
    if args.output_len < 1:
        raise ValueError("--output-len must be at least 1")
    reference_name = config.kv_cache_dtype
    configs = {
        name: dataclasses.replace(config, kv_cache_dtype=name) for name in args.kv_cache_dtypes
    }
    if not args.no_accuracy:
        prompts, device, dtype = _chat_prompts(config)
        ref_label = reference_name if reference_name != "auto" else f"auto ({dtype})"
        model = config.model or "embedded model"
        print(
            f"kv-cache-dtype accuracy: {model}, {device} {dtype}, {len(prompts)} prompts x "
            f"{args.output_len} greedy tokens; reference {ref_label}",
            flush=True,
        )
        reference = _generate(config, prompts, args.output_len)
        for name, cfg in configs.items():
            agreement = compare(reference, _generate(cfg, prompts, args.output_len))
            print(agreement.line(name, len(prompts)), flush=True)
    if args.timing:
        need = args.batch_size * (args.context + args.steps + 8)
        timing = dataclasses.replace(
            config,
            max_num_seqs=max(config.max_num_seqs, args.batch_size),
            max_model_len=max(config.max_model_len or 0, args.context + args.steps + 8),
            enable_prefix_caching=False,
        )
        if timing.kv_cache_memory is None:
            # Room for the whole batch in the largest (float32) cache of this model's size.
            timing = dataclasses.replace(timing, kv_cache_memory=2 * 1024**3)
        base = _decode_step_ms(timing, args.batch_size, args.context, args.steps)
        parts = [f"{reference_name} {base:.1f} ms"]
        for name in configs:
            ms = _decode_step_ms(
                dataclasses.replace(timing, kv_cache_dtype=name),
                args.batch_size,
                args.context,
                args.steps,
            )
            parts.append(f"{name} {ms:.1f} ms ({ms / base:.2f}x)")
        print(
            f"decode step, batch {args.batch_size}, context {args.context} "
            f"({need} tokens cached): " + "; ".join(parts),
            flush=True,
        )
    return 0
