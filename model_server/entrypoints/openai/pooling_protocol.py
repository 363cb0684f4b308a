"""Request bodies of the pooling endpoints (pydantic, at the HTTP boundary only).

OpenAI `/v1/embeddings`, TEI's `/embed` and `/rerank` (the bodies OPEA's ChatQnA sends),
Jina/Cohere's `/v1/rerank` and vLLM's `/v1/score`. Unknown fields are refused (400 naming them),
not ignored: a client that asks for something Wick does not do should hear so.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# OpenAI's documented limit of inputs per embeddings request; the same bound for every endpoint.
MAX_INPUTS = 2048


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EmbeddingRequest(_Body):
    """OpenAI's body, plus vLLM's `truncate_prompt_tokens` and `normalize`."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    # -1: keep the first max-input-length tokens; k: keep the first k (the start, as
    # sentence-transformers truncates); None: refuse inputs longer than the model's maximum.
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    normalize: bool | None = None


class TEIEmbedRequest(_Body):
    inputs: str | list[str]
    normalize: bool = True
    truncate: bool = False
    truncation_direction: Literal["Right", "right"] = "Right"
    prompt_name: None = None
    dimensions: int | None = Field(default=None, ge=1)


class TEIRerankRequest(_Body):
    query: str
    texts: list[str]
    truncate: bool = False
    truncation_direction: Literal["Right", "right"] = "Right"
    raw_scores: bool = False
    return_text: bool = False


class RerankRequest(_Body):
    """Jina / Cohere rerank (also vLLM's `/v1/rerank`)."""

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)


class ScoreRequest(_Body):
    """vLLM's `/v1/score`: `text_1` against each of `text_2` (1:1, 1:N, or N:N pairwise)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
