"""End-to-end parity of one random-weight model: HF transformers vs Wick eager vs Wick with decode
graphs (stage C of scripts/gpu_check.sh).

    python -m tools.gpu_parity --shape qwen3-0.6b --device cuda --result parity.json
    python -m tools.gpu_parity --shape tiny-qwen3 --device cpu --stand-in-graphs   # the dry run

The model folder is written in the run by transformers (random init, safetensors) from a dummy
preset's config, so all three read the same weights. Checks:
  - fp32: greedy tokens of every prompt identical across HF, Wick eager and Wick graphs. A
    divergence where HF's top two logits lie within `TIE_MARGIN` (a near-tie that fp32 rounding
    may break either way) is reported as such, not failed.
  - bf16: the first generated token's top logprobs of Wick (eager) within `BF16_LOGPROB_TOL` of
    HF's at the same token ids (the prompt's last position: no generated history to diverge).

On a CPU the Triton kernels run interpreted, and `--stand-in-graphs` makes the CPU platform
"capture" by rerunning the forward on the graph runner's static buffers (everything but the CUDA
recording: buckets, padding, persistent inputs). Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TIE_MARGIN = 1e-3  # fp32 logits closer than this may swap order between two implementations
BF16_LOGPROB_TOL = 0.1
TOP_LOGPROBS = 5
# A Qwen3 of 2 layers, 64 wide: what the CPU dry run can afford under the interpreter.
TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


@dataclass(slots=True)
class ParityResult:
    shape: str
    device: str
    prompts: int
    max_tokens: int
    fp32_identical: dict[str, bool] = field(default_factory=dict)  # "eager", "graphs" vs HF
    near_ties: list[str] = field(default_factory=list)
    divergences: list[str] = field(default_factory=list)
    bf16_max_logprob_diff: float | None = None
    graph_replays: int | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    passed: bool = False


def model_config(shape: str) -> dict[str, Any]:
    if shape == "tiny-qwen3":
        return dict(TINY_QWEN3)
    from model_server.loader.dummy import preset_file

    path = preset_file(shape)
    if path is None:
        raise ValueError(f"no dummy preset named {shape!r}")
    return json.loads(Path(path).read_text())


def write_random_model(folder: Path, config: dict[str, Any], seed: int = 0) -> None:
    """config.json and model.safetensors of a randomly initialised HF model of `config`."""
    import torch
    import transformers

    (folder / "config.json").write_text(json.dumps(config))
    hf_config = transformers.AutoConfig.from_pretrained(folder)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)


def prompts_for(vocab_size: int, count: int = 4) -> list[list[int]]:
    """Token-id prompts of different lengths (ids past the special-token range)."""
    lengths = (7, 19, 12, 31, 5, 24, 9, 16)[:count]
    return [
        [(37 * i + 11 * j) % (vocab_size - 10) + 5 for j in range(n)] for i, n in enumerate(lengths)
    ]


def hf_greedy(
    folder: Path, prompts: Sequence[list[int]], max_tokens: int, device: str
) -> tuple[list[list[int]], list[list[float]]]:
    """HF fp32 greedy tokens per prompt, and the top-two logit margin at each generated step."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = model.to(device).eval()
    tokens, margins = [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            tokens.append(out.sequences[0, len(prompt) :].tolist())
            top2 = [s[0].float().topk(2).values for s in out.scores]
            margins.append([float(t[0] - t[1]) for t in top2])
    del model
    return tokens, margins


def hf_first_logprobs(
    folder: Path, prompts: Sequence[list[int]], dtype: Any, device: str
) -> list[Any]:
    """log_softmax of the next-token logits after each prompt ([vocab] float32 tensors)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    model = model.to(device).eval()
    with torch.inference_mode():
        rows = [
            model(torch.tensor([p], device=device)).logits[0, -1].float().log_softmax(-1).cpu()
            for p in prompts
        ]
    del model
    return rows


class RerunCapturer:
    """A CPU stand-in for CUDA graphs: "replay" reruns the captured function on the static
    buffers and writes its result into the first output."""

    def __init__(self) -> None:
        self.replays = 0

    def capture(self, fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        output = fn()

        def replay() -> None:
            self.replays += 1
            output.copy_(fn())

        return replay, output


@contextmanager
def stand_in_graphs() -> Iterator[RerunCapturer]:
    from model_server.platforms.cpu import CpuPlatform

    capturer = RerunCapturer()
    saved = CpuPlatform.__dict__.get("supports_graphs"), CpuPlatform.__dict__.get("graph_capturer")
    CpuPlatform.supports_graphs = True
    CpuPlatform.graph_capturer = lambda self: capturer
    try:
        yield capturer
    finally:
        for name, value in zip(("supports_graphs", "graph_capturer"), saved, strict=True):
            if value is None:
                delattr(CpuPlatform, name)
            else:
                setattr(CpuPlatform, name, value)


def wick_generate(
    folder: Path,
    prompts: Sequence[list[int]],
    max_tokens: int,
    *,
    device: str,
    dtype: str,
    enforce_eager: bool,
) -> tuple[list[list[int]], list[list[tuple[int, float]]], Any]:
    """Wick's greedy tokens and the first generated token's top logprobs per prompt."""
    from model_server.engine.llm import LLM
    from model_server.sampling_params import SamplingParams

    llm = LLM(
        str(folder),
        dtype=dtype,
        device=device,
        attention_backend="triton",
        enforce_eager=enforce_eager,
        max_num_seqs=len(prompts),
        max_model_len=256,
        kv_cache_memory=64 * 1024**2,
        seed=0,
    )
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=TOP_LOGPROBS
    )
    outputs = llm.generate(list(prompts), params)
    graph_runner = llm.engine.core.model_runner.graph_runner
    tokens = [o.outputs[0].token_ids for o in outputs]
    firsts = [o.outputs[0].logprobs[0].top for o in outputs]
    llm.shutdown()
    return tokens, firsts, graph_runner


def compare_greedy(
    label: str,
    expected: Sequence[list[int]],
    got: Sequence[list[int]],
    margins: Sequence[list[float]],
    result: ParityResult,
) -> bool:
    """Whether `got` equals `expected` up to near-ties; divergences are recorded in `result`."""
    ok = True
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        if want == have:
            continue
        step = next(
            (s for s, (a, b) in enumerate(zip(want, have, strict=False)) if a != b),
            min(len(want), len(have)),
        )
        where = f"{label}: prompt {i} diverges at token {step}"
        if step < len(margins[i]) and margins[i][step] < TIE_MARGIN:
            result.near_ties.append(f"{where} (HF top-2 margin {margins[i][step]:.2e})")
        else:
            result.divergences.append(
                f"{where}: HF {want[step : step + 4]}, Wick {have[step : step + 4]}"
            )
            ok = False
    return ok


def run_parity(
    shape: str, device: str, max_tokens: int, num_prompts: int, stand_in: bool, workdir: Path
) -> ParityResult:
    import torch

    config = model_config(shape)
    prompts = prompts_for(config["vocab_size"], num_prompts)
    result = ParityResult(shape, device, len(prompts), max_tokens)
    folder = workdir / "model"
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    write_random_model(folder, config)
    result.seconds["write model"] = time.perf_counter() - start

    start = time.perf_counter()
    hf_tokens, margins = hf_greedy(folder, prompts, max_tokens, device)
    result.seconds["hf fp32"] = time.perf_counter() - start
    all_ok = True
    for label, eager in (("eager", True), ("graphs", False)):
        start = time.perf_counter()
        graphs = stand_in_graphs() if stand_in and not eager else _null()
        with graphs as capturer:
            tokens, _, runner = wick_generate(
                folder, prompts, max_tokens, device=device, dtype="float32", enforce_eager=eager
            )
        result.seconds[f"wick fp32 {label}"] = time.perf_counter() - start
        if not eager:
            if runner is None:
                result.divergences.append("graphs: the engine captured no decode graphs")
                all_ok = False
            if capturer is not None:
                result.graph_replays = capturer.replays
                if not capturer.replays:
                    result.divergences.append("graphs: no decode step replayed a graph")
                    all_ok = False
        ok = compare_greedy(label, hf_tokens, tokens, margins, result)
        result.fp32_identical[label] = ok and not any(t.startswith(label) for t in result.near_ties)
        all_ok &= ok

    start = time.perf_counter()
    hf_rows = hf_first_logprobs(folder, prompts, torch.bfloat16, device)
    _, firsts, _ = wick_generate(
        folder, prompts, 2, device=device, dtype="bfloat16", enforce_eager=True
    )
    result.seconds["bf16 logprobs"] = time.perf_counter() - start
    diff = max(
        abs(lp - float(row[tok]))
        for row, top in zip(hf_rows, firsts, strict=True)
        for tok, lp in top
    )
    result.bf16_max_logprob_diff = diff
    if diff > BF16_LOGPROB_TOL:
        result.divergences.append(f"bf16: first-token logprobs differ by {diff:.3f}")
        all_ok = False
    result.passed = all_ok
    return result


@contextmanager
def _null() -> Iterator[None]:
    yield None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.gpu_parity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--shape", default="qwen3-0.6b", help="a dummy preset, or tiny-qwen3")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument(
        "--stand-in-graphs",
        action="store_true",
        help="CPU only: replay decode graphs by rerunning the forward",
    )
    p.add_argument("--workdir", type=Path, default=None, help="(default: a temporary folder)")
    p.add_argument("--result", type=Path, default=None, help="write the result as JSON here")
    args = p.parse_args(argv)
    if args.stand_in_graphs and args.device != "cpu":
        p.error("--stand-in-graphs is for --device cpu")
    with tempfile.TemporaryDirectory(prefix="wick-parity-") as tmp:
        workdir = args.workdir or Path(tmp)
        result = run_parity(
            args.shape,
            args.device,
            args.max_tokens,
            args.num_prompts,
            args.stand_in_graphs,
            workdir,
        )
    text = json.dumps(asdict(result), indent=2)
    print(text)
    if args.result is not None:
        args.result.write_text(text)
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
