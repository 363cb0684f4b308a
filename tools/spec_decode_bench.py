"""Speculative decoding (n-gram prompt lookup) on and off, one stream, greedy: decode tok/s
(first token to last, per request), acceptance and the output identity, on issue 35's editing
workload (the answer rewrites a given passage with a small change, so most of it is copied from
the prompt) and on plain chat.

    .venv/bin/python -m tools.spec_decode_bench [--model PATH] [--max-tokens 160] [--runs 2]

Each configuration runs every prompt alone, `--runs` times, the configurations interleaved; the
better run counts (one sitting, as docs/benchmarks.md's figures). Output: one line per workload
and configuration, then the speedups.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass

PASSAGES = [
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. Every "
    "night its keeper climbed the narrow stairs, trimmed the wick and polished the great lens, "
    "so that the ships passing through the strait could find their way between the rocks. "
    "When the storms came in winter, the keeper stayed awake until morning, writing in his "
    "logbook the names of the ships he saw and the hours at which they passed.",
    "To make a simple tomato sauce, warm two spoons of olive oil in a wide pan over a medium "
    "heat. Add one chopped onion and cook it slowly until it is soft and golden, then add two "
    "cloves of garlic and cook for one more minute. Pour in the tomatoes, season with salt and "
    "a little sugar, and let the sauce simmer for twenty minutes, stirring from time to time, "
    "until it is thick enough to coat the back of a spoon.",
    "Our team meets every Monday morning at nine o'clock in the small conference room on the "
    "third floor. Each person gives a short update on what they finished last week, what they "
    "plan to do this week, and anything that is blocking their work. The meeting should never "
    "last more than thirty minutes, and the notes are shared with the whole department by noon.",
]
EDITS = [
    ("two hundred years", "three hundred years"),
    ("olive oil", "butter"),
    ("Monday morning", "Tuesday morning"),
]
CHAT = [
    "What is the capital of France?",
    "Give me a short tip for learning to cook pasta well at home, with a reason.",
    "Why is the sky blue? Answer briefly.",
]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}  # fmt: skip


def editing_prompts() -> list[str]:
    return [
        f'Rewrite the following passage exactly, but change "{old}" to "{new}". Write only '
        f"the rewritten passage.\n\n{passage}"
        for passage, (old, new) in zip(PASSAGES, EDITS, strict=True)
    ]


@dataclass(slots=True)
class Run:
    tokens: int  # decoded after each request's first token
    seconds: float  # first token -> last token, summed over the requests
    outputs: list[list[int]]
    drafts: int
    draft_tokens: int
    accepted: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def run_workload(llm, prompts: list[list[int]], max_tokens: int) -> Run:
    """Every prompt alone; decode time is first token -> last token (the prefill, which
    speculation does not change, left out)."""
    from model_server.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, output_kind=RequestOutputKind.DELTA
    )
    engine = llm.engine
    stats = engine.core.scheduler.spec_decoding_stats
    before = (0, 0, 0) if stats is None else (
        stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)  # fmt: skip
    outputs: list[list[int]] = []
    tokens, seconds = 0, 0.0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{i}", prompt, params)
        ids: list[int] = []
        first = last = 0.0
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                if not ids:
                    first = now
                ids += out.outputs[0].token_ids_delta
                last = now
        tokens += len(ids) - 1
        seconds += last - first
        outputs.append(ids)
    after = (0, 0, 0) if stats is None else (
        stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)  # fmt: skip
    d = [a - b for a, b in zip(after, before, strict=True)]
    return Run(tokens, seconds, outputs, d[0], d[1], d[2])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="Default: the embedded SmolLM2.")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--speculative-config", default=json.dumps(SPEC))
    args = parser.parse_args(argv)

    from model_server.engine.llm import LLM

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average before: {load} (other work on the machine skews both columns)")
    configs = {"off": None, "on": args.speculative_config}
    llms = {
        name: LLM(args.model, dtype=args.dtype, kv_cache_memory=256 * 1024**2,
                  speculative_config=cfg)
        for name, cfg in configs.items()
    }  # fmt: skip
    print(f"dtype: {llms['off'].engine.core.model_runner.dtype}".replace("torch.", ""))
    chat = (
        [[{"role": "user", "content": q}] for q in editing_prompts()],
        [[{"role": "user", "content": q}] for q in CHAT],
    )
    workloads = {
        "editing": [llms["off"].apply_chat_template(c) for c in chat[0]],
        "chat": [llms["off"].apply_chat_template(c) for c in chat[1]],
    }
    best: dict[tuple[str, str], Run] = {}
    for workload, prompts in workloads.items():
        for llm in llms.values():
            run_workload(llm, prompts, 16)  # warm up: every row bucket's first plan and step
        # Interleaved, so that a load change on the machine hits both configurations alike.
        for _ in range(args.runs):
            for name, llm in llms.items():
                r = run_workload(llm, prompts, args.max_tokens)
                if (workload, name) not in best or r.tok_s > best[workload, name].tok_s:
                    best[workload, name] = r
        for name in llms:
            r = best[workload, name]
            accept = (
                f", {r.drafts} drafts, {r.accepted}/{r.draft_tokens} draft tokens accepted "
                f"(mean acceptance length {1 + r.accepted / r.drafts:.2f})"
                if r.drafts
                else ""
            )
            print(
                f"{workload:8s} spec {name:3s}: {r.tokens} tokens decoded in {r.seconds:.2f}s = "
                f"{r.tok_s:.1f} tok/s{accept}",
                flush=True,
            )
    for workload in workloads:
        off, on = best[workload, "off"], best[workload, "on"]
        same = on.outputs == off.outputs
        print(f"{workload:8s} speedup {on.tok_s / off.tok_s:.2f}x; greedy output identical: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
