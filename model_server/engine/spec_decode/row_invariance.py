"""Why a verified row computes exactly as its decode would, and the rows that must.

Greedy speculative output equals non-speculative output only if the target's logits at a
verified position are the bits a one-row decode of that position computes. In bfloat16 three
things made a row's result depend on how many rows its step had (measured on the embedded
SmolLM2, each op alone, a row of an M-row call against the same row alone):

- **The native panel matmul** (kernels/cpu/panel_gemm.c, every projection and the LM head the
  CPU plan gives it): 1-3 rows summed K over two accumulator sets, 4 or more rows over one, so
  rows of a 4-16-row call differed from their one-row result (2-5 rows of 16). Fixed in the
  kernel: every tile sums each output in one chain over K, so a row's output no longer depends
  on M. It must be the one tiling of plain and speculating servers alike: a variant for
  speculation only would round the prefill differently from the plain server's.
- **Paged attention** (kernels/cpu/paged_attention.c): a chunk's queries run the prefill tile
  path, a decode's query the decode path, which sum Q.K, softmax and P.V in other orders (46 of
  300 rows of 5-query chunks differed from their decodes, random data). Fixed by the metadata: a
  verification chunk attends as that many one-query sequences (`SeqChunk.attend_as_decodes`),
  i.e. on the decode path, at the cost of reading the context once per verified row (as the
  decodes it replaces do).
- **The plan** (kernels/cpu/linear_tuning.py): the kernel of a weight is chosen per row bucket,
  and kernels other than the panels are not row-invariant (gemm.c switches to vdpbf16ps at 4
  rows; torch's are not promised to be). With speculation on, the buckets a verifying step can
  take (`verification_rows`) run one row-invariant kernel (`ROW_INVARIANT`), which `wick plan`
  and the startup log show.

Norms, rotary, SiLU-and-mul and the sampler work row by row and are row-invariant already.
float32 was identical before (its kernels sum the same way at every M).
"""

from __future__ import annotations

from model_server.config import SpeculativeConfig


def verification_rows(spec: SpeculativeConfig | None) -> int:
    """The most rows a step of decodes and verifications has while speculating (0: off): up to
    `disable_by_batch_size - 1` running requests, each its last token and k drafts. The plan
    keeps the row buckets up to it on one row-invariant kernel per weight."""
    if spec is None:
        return 0
    return max(1, spec.disable_by_batch_size - 1) * (spec.num_speculative_tokens + 1)
