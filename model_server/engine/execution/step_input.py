"""One model step as every tensor-parallel rank needs it, and its flat-int wire form.

Rank 0 turns the scheduler's output into a `StepInput`; the workers receive it packed as ints
(see distributed/step_channel.py) and build the same model inputs from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model_server.engine.execution.input_batch import SeqChunk
from model_server.lora.request import LoRARequest


@dataclass(slots=True)
class PromptLogprobsRows:
    """A chunk's rows that predict prompt tokens (prompt logprobs): its first `num_rows` tokens'
    logits, row i's target being the prompt token at the chunk's start + i + 1. Every rank runs
    the LM head on those rows (a collective); `k` and `target_ids` are rank 0's only."""

    num_rows: int
    k: int = 0
    target_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class StepInput:
    chunks: list[SeqChunk]
    # Parallel to chunks: the chunk reaches its sequence's last token, so it samples.
    sample: list[bool]
    # Parallel to chunks, or empty when no chunk computes prompt logprobs.
    prompt_logprobs: list[PromptLogprobsRows | None] = field(default_factory=list)
    # Speculative decoding: parallel to chunks, or empty when no chunk verifies drafts. A chunk
    # with d drafts ends with them and samples at its last d + 1 rows. Rank 0 only: not packed
    # (speculation is refused under tensor parallelism).
    num_drafts: list[int] = field(default_factory=list)
    # Parallel to chunks: each one's LoRA adapter (None: the base model), or empty when no
    # chunk has one. Not packed: LoRA runs on one rank (EngineConfig refuses it with TP).
    loras: list[LoRARequest | None] = field(default_factory=list)

    def prompt_logprobs_of(self, index: int) -> PromptLogprobsRows | None:
        return self.prompt_logprobs[index] if self.prompt_logprobs else None

    def pack(self, block_size: int) -> list[int]:
        """[B, then per chunk: n_tokens, num_computed, n_blocks, sample, n_sliding,
        n_prompt_logprob_rows, tokens..., blocks..., sliding blocks...]. Only the blocks the
        chunk's positions reach are sent."""
        out = [len(self.chunks)]
        for i, (chunk, sample) in enumerate(zip(self.chunks, self.sample, strict=True)):
            end = chunk.num_computed_tokens + len(chunk.token_ids)
            blocks = list(chunk.block_ids[: -(-end // block_size)])
            sliding = list(chunk.sliding_block_ids[: -(-end // block_size)])
            out += (len(chunk.token_ids), chunk.num_computed_tokens, len(blocks), int(sample))
            rows = self.prompt_logprobs_of(i)
            out += (len(sliding), rows.num_rows if rows is not None else 0)
            out += chunk.token_ids
            out += blocks
            out += sliding
        return out

    @classmethod
    def unpack(cls, data: list[int]) -> StepInput:
        chunks: list[SeqChunk] = []
        sample: list[bool] = []
        prompt_logprobs: list[PromptLogprobsRows | None] = []
        pos = 1
        for _ in range(data[0]):
            n_tokens, num_computed, n_blocks, samples, n_sliding, n_rows = data[pos : pos + 6]
            pos += 6
            prompt_logprobs.append(PromptLogprobsRows(n_rows) if n_rows else None)
            tokens = data[pos : pos + n_tokens]
            pos += n_tokens
            blocks = data[pos : pos + n_blocks]
            pos += n_blocks
            chunks.append(SeqChunk(tokens, num_computed, blocks, data[pos : pos + n_sliding]))
            pos += n_sliding
            sample.append(bool(samples))
        return cls(chunks, sample, prompt_logprobs if any(prompt_logprobs) else [])
