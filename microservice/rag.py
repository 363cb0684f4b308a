"""RAG prompts as GenAIComps' LLM microservice builds them from `documents` and `chat_template`.

The result is chat messages, so the model server renders them with the model's own chat
template (as OPEA's microservice does by sending the prompt as the user message). Documents
keep the order they came in: a reranker already put the best first.

Rules (GenAIComps' `LLMParamsDoc`/`ChatCompletionRequest` handling):
- `chat_template` with `{question}` (and optionally `{context}`): the filled template replaces
  the question (the last user message).
- `chat_template` with only `{context}`: the filled template is a system message put first.
- no `chat_template`, documents given: a first system message holding `{context}` gets the
  documents; otherwise GenAIComps' default RAG prompt replaces the question.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from string import Formatter

FIELDS = frozenset({"context", "question"})

# GenAIComps' default RAG prompt (comps/llms/src/text-generation/integrations/template.py),
# its wording kept; the indentation its source put inside the string is left out.
DEFAULT_RAG_PROMPT = (
    "### You are a helpful, respectful and honest assistant to help the user with questions. "
    "Please refer to the search results obtained from the local knowledge base. "
    "But be careful to not incorporate the information that you think is not relevant to the "
    "question. If you don't know the answer to a question, please don't share false "
    "information. \n\n"
    "### Search results: {context} \n\n"
    "### Question: {question} \n\n"
    "### Answer:"
)
# Its Chinese twin, chosen when at least 30% of the context's characters are CJK ideographs.
CHINESE_RAG_PROMPT = (
    "### 你将扮演一个乐于助人、尊重他人并诚实的助手，你的目标是帮助用户解答问题。"
    "有效地利用来自本地知识库的搜索结果。确保你的回答中只包含相关信息。"
    "如果你不确定问题的答案，请避免分享不准确的信息。\n"
    "### 搜索结果：{context}\n"
    "### 问题：{question}\n"
    "### 回答："
)
_CJK = re.compile("[\u4e00-\u9fff]")


def template_fields(template: str) -> set[str]:
    """The placeholders of a `str.format` template. Raises ValueError (with a message meant for
    the client) for a malformed template or a placeholder other than {context}/{question}."""
    try:
        parsed = list(Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(
            f"is not a valid template ({exc}); write {{{{ and }}}} for literal braces"
        ) from None
    fields = [(name, spec, conv) for _, name, spec, conv in parsed if name is not None]
    # A format spec or conversion could fail on a str ({context:d}) or ask for gigabytes of
    # padding ({context:>{question}} with a huge number as the question).
    if any(spec or conv for _, spec, conv in fields):
        raise ValueError("may use {context} and {question} only as they are, without : or !")
    names = {name for name, _, _ in fields}
    unknown = sorted(names - FIELDS)
    if unknown:
        shown = ", ".join("{" + n + "}" if n else "{}" for n in unknown)
        raise ValueError(f"may use only {{context}} and {{question}}, got {shown}")
    if not names:
        raise ValueError("must contain {context} and/or {question}")
    return names


def default_prompt(question: str, context: str) -> str:
    chinese = bool(context) and len(_CJK.findall(context)) / len(context) >= 0.3
    template = CHINESE_RAG_PROMPT if chinese else DEFAULT_RAG_PROMPT
    return template.format(context=context, question=question)


def rag_messages(
    messages: list[dict[str, str]], documents: list[str], template: str | None
) -> list[dict[str, str]]:
    """`messages` with the documents and template applied (the same list when neither was
    given). `template` must have passed `template_fields`."""
    if template is None and not documents:
        return messages
    context = "\n".join(documents)
    if template is not None:
        fields = template_fields(template)
        if "question" in fields:
            return _with_question(messages, lambda q: template.format(context=context, question=q))
        return [{"role": "system", "content": template.format(context=context)}, *messages]
    first = messages[0] if messages else None
    if first is not None and first["role"] == "system" and "{context}" in first["content"]:
        filled = {**first, "content": first["content"].replace("{context}", context)}
        return [filled, *messages[1:]]
    return _with_question(messages, lambda q: default_prompt(q, context))


def _with_question(
    messages: list[dict[str, str]], build: Callable[[str], str]
) -> list[dict[str, str]]:
    """The last user message's content replaced by `build(content)`; a new user message when
    there is none."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "user":
            new = {**messages[i], "content": build(messages[i]["content"])}
            return [*messages[:i], new, *messages[i + 1 :]]
    return [*messages, {"role": "user", "content": build("")}]
