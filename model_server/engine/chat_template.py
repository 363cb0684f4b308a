"""Chat prompts: a conversation -> prompt token ids, through the model's own chat template."""

from __future__ import annotations

from typing import Any

Message = dict[str, Any]


def render_chat(
    tokenizer: Any,
    messages: list[Message],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    **template_kwargs: Any,
) -> list[int]:
    """Token ids of `messages` under the tokenizer's chat template.

    The rendered text already holds every special token the template wants (BOS, role markers),
    so it is tokenized without adding special tokens again. Raises ValueError when the model has
    no chat template or the template rejects the conversation (its own message).
    """
    text = render_chat_text(
        tokenizer,
        messages,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        **template_kwargs,
    )
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def render_chat_text(
    tokenizer: Any,
    messages: list[Message],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    **template_kwargs: Any,
) -> str:
    """The prompt text of `messages` under the chat template, not yet tokenized (tokenize it
    with add_special_tokens=False); raises ValueError as `render_chat` does."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template: use the completions API instead")
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **template_kwargs,
        )
    except ValueError:
        raise
    except Exception as exc:  # jinja2's TemplateError & co: the conversation is the problem
        raise ValueError(f"the chat template rejected the messages: {exc}") from exc
    return text
