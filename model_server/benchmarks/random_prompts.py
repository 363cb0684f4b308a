"""Random prompts for `bench serve`, like vLLM's "random" dataset.

Input and output lengths are drawn uniformly from `[L·(1-r), L·(1+r)]` (`--random-range-ratio`).

- With a tokenizer, a prompt is random token ids (special tokens excluded) decoded to text, then
  re-encoded and cut back to its drawn length (decoding and re-encoding can merge tokens), so its
  client-side length is exact for that tokenizer. Servers that tokenize differently (or add a BOS
  token) report their own count in `usage`, which the benchmark prefers.
- Without one, a prompt is random common English words separated by spaces: about one token per
  word for most tokenizers, so input lengths are approximate (the server's `usage` corrects the
  reported totals).

Both are deterministic for a given `--seed` (and tokenizer), so the same command sends the same
prompts to every server being compared.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# Short, common words: each is one token in the usual BPE vocabularies (with its leading space).
_WORD_TEXT = """the of and to in is was for on are as with his they at be this from have or by one
    had not but what all were when we there can an your which their said if do will each about how
    up out them then she many some so these would other into has more her two like him see time
    could no make than first been its who now people my made over did down only way find use may
    water long little very after words called just where most know get through back much go good
    new write our me man too any day same right look think also around another came come work
    three word must because does part even place well such here take why things help put years
    different away again off went old number great tell men say small every found still between
    name should home big give air line set own under read last never us left end along while
    might next sound below saw something thought both few those always looked show large often
    together asked house world going want school important until form food keep children feet
    land side without boy once animals life enough took sometimes four head above kind began
    almost live page got earth need far hand high year mother light parts country father let
    night following picture being study second eyes soon times story boys since white days ever
    paper hard near sentence better best across during today others however sure means knew
    try told young miles sun ways thing whole hear example heard several change answer room sea
    against top turned learn point city play toward five using himself usually"""


@dataclass(frozen=True, slots=True)
class SampleRequest:
    """One benchmark request: the prompt text, its expected token count, the tokens to ask for."""

    prompt: str
    prompt_len: int
    output_len: int


def draw_length(rng: random.Random, mean: int, range_ratio: float) -> int:
    """Uniform integer in `[mean·(1-r), mean·(1+r)]`, at least 1."""
    low = max(1, int(mean * (1.0 - range_ratio)))
    high = max(low, int(mean * (1.0 + range_ratio)))
    return rng.randint(low, high)


def sample_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    tokenizer: Any | None = None,
) -> list[SampleRequest]:
    """`num_prompts` random requests (see the module docstring)."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {num_prompts}")
    if input_len < 1 or output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be at least 1")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    allowed = _allowed_token_ids(tokenizer) if tokenizer is not None else None
    words = _WORD_TEXT.split()
    requests = []
    for _ in range(num_prompts):
        n_in = draw_length(rng, input_len, range_ratio)
        n_out = draw_length(rng, output_len, range_ratio)
        if allowed is None:
            prompt, prompt_len = " ".join(rng.choice(words) for _ in range(n_in)), n_in
        else:
            prompt, prompt_len = _token_prompt(tokenizer, rng, allowed, n_in)
        requests.append(SampleRequest(prompt, prompt_len, n_out))
    return requests


def _allowed_token_ids(tokenizer: Any) -> list[int]:
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    ids = [i for i in range(len(tokenizer)) if i not in special]
    if not ids:
        raise ValueError("the tokenizer has no ordinary tokens to build prompts from")
    return ids


def _token_prompt(
    tokenizer: Any, rng: random.Random, allowed: list[int], length: int
) -> tuple[str, int]:
    ids = [rng.choice(allowed) for _ in range(length)]
    text = tokenizer.decode(ids)
    reencoded = tokenizer.encode(text, add_special_tokens=False)
    if len(reencoded) > length:
        text = tokenizer.decode(reencoded[:length])
        reencoded = tokenizer.encode(text, add_special_tokens=False)
    return text, len(reencoded)


def load_tokenizer(spec: str | None) -> tuple[Any | None, str]:
    """The tokenizer named by `--tokenizer`, and a description for the report.

    `spec`: "none" (random words), a `.gguf` file, an HF folder or hub id; None means the
    embedded default model's tokenizer (SmolLM2) when its package is installed, else none.
    """
    if spec is not None and spec.lower() == "none":
        return None, "none (random words)"
    if spec is None:
        from model_server.loader.embedded import embedded_model_available, embedded_model_path

        if not embedded_model_available():
            return None, "none (random words)"
        spec = embedded_model_path()
    if os.path.isfile(spec):
        from model_server.loader.gguf_file import read_gguf
        from model_server.loader.gguf_tokenizer import gguf_tokenizer

        tokenizer = gguf_tokenizer(read_gguf(spec))
        if tokenizer is None:
            raise ValueError(f"{spec}: the GGUF file carries no tokenizer")
        return tokenizer, spec
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(spec), spec
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"cannot load tokenizer {spec!r}: {exc} (pass --tokenizer none for random words)"
        ) from exc
