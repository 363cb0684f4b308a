"""One model step as every tensor-parallel rank needs it, and its flat-int wire form.

Rank 0 turns the scheduler's output into a `StepInput`; the workers receive it packed as ints
(see distributed/step_channel.py) and build the same model inputs from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from model_server.engine.execution.input_batch import SeqChunk


@dataclass(slots=True)
class StepInput:
    chunks: list[SeqChunk]
    # Parallel to chunks: the chunk reaches its sequence's last token, so it samples.
    sample: list[bool]

    def pack(self, block_size: int) -> list[int]:
        """[B, then per chunk: n_tokens, num_computed, n_blocks, sample, n_sliding, tokens...,
        blocks..., sliding blocks...]. Only the blocks the chunk's positions reach are sent."""
        out = [len(self.chunks)]
        for chunk, sample in zip(self.chunks, self.sample, strict=True):
            end = chunk.num_computed_tokens + len(chunk.token_ids)
            blocks = list(chunk.block_ids[: -(-end // block_size)])
            sliding = list(chunk.sliding_block_ids[: -(-end // block_size)])
            out += (len(chunk.token_ids), chunk.num_computed_tokens, len(blocks), int(sample))
            out.append(len(sliding))
            out += chunk.token_ids
            out += blocks
            out += sliding
        return out

    @classmethod
    def unpack(cls, data: list[int]) -> StepInput:
        chunks: list[SeqChunk] = []
        sample: list[bool] = []
        pos = 1
        for _ in range(data[0]):
            n_tokens, num_computed, n_blocks, samples, n_sliding = data[pos : pos + 5]
            pos += 5
            tokens = data[pos : pos + n_tokens]
            pos += n_tokens
            blocks = data[pos : pos + n_blocks]
            pos += n_blocks
            chunks.append(SeqChunk(tokens, num_computed, blocks, data[pos : pos + n_sliding]))
            pos += n_sliding
            sample.append(bool(samples))
        return cls(chunks, sample)
