"""`POST /tokenize` and `POST /detokenize` (vLLM's extension endpoints)."""

from __future__ import annotations

from model_server.entrypoints.openai.protocol import (
    APIError,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
    template_kwargs,
)
from model_server.entrypoints.openai.request_limits import check_unicode
from model_server.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """Prompt text, or messages through the chat template (counted exactly as chat
        completions count their prompt tokens)."""
        self.limits.check_tokenize(request)
        check_unicode(request)  # before any message (the 404's too) quotes the request's text
        self.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            tokens = self.chat_prompt(
                request.messages,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                template_kwargs=template_kwargs(
                    request.chat_template_kwargs, request.enable_thinking
                ),
            )
        else:
            tokens = self.encode(
                "prompt", request.prompt, add_special_tokens=request.add_special_tokens
            )
        return TokenizeResponse(
            count=len(tokens), max_model_len=self.engine_client.max_model_len, tokens=tokens
        )

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        check_unicode(request)
        self.check_model(request.model)
        tokenizer = self.tokenizer()
        vocab_size = len(tokenizer)
        bad = [t for t in request.tokens if not 0 <= t < vocab_size]
        if bad:
            raise APIError(
                f"token id {bad[0]} is out of range for the vocabulary (0-{vocab_size - 1})",
                400,
                param="tokens",
            )
        return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))
