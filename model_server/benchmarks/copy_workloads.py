"""Prompts whose answers copy more or less of them, for `bench serve --dataset-name editing|rag|
chat`: the workloads that say what speculative decoding by prompt lookup is worth.

- editing: rewrite a passage word for word with one word changed; the answer is nearly all copy.
- rag: a question and three retrieved passages (one holds the answer); answers quote some.
- chat: a plain question; answers copy almost nothing.

The passages are this module's own short texts (no download), in English. Requests are drawn
round robin over the workload's prompts, shuffled by `--seed`, so the same command sends the
same prompts to every server compared. `copy_share` measures what the answers copied: the
share of their word trigrams that occur in their prompt.
"""

from __future__ import annotations

import random
import re
from typing import Any

from model_server.benchmarks.random_prompts import SampleRequest

WORKLOADS = ("editing", "rag", "chat")

# (topic, passage, a word of the passage and its replacement, a question the passage answers)
_PASSAGES: tuple[tuple[str, str, tuple[str, str], str], ...] = (
    (
        "lighthouses",
        "Lighthouses were built along dangerous coasts to warn ships away from rocks and "
        "shallow water. Early towers burned wood or coal in an open fire at the top, which was "
        "hard to see in rain and fog. In the nineteenth century glass lenses made of many "
        "rings focused the light of a single lamp into a strong beam that sailors could see "
        "from more than twenty miles away. Each lighthouse flashed in its own pattern, so a "
        "captain could tell which one he was looking at and find his position on the chart. "
        "Today most lighthouses run automatically and no keeper lives in them.",
        ("ships", "boats"),
        "How could a captain tell which lighthouse he was looking at?",
    ),
    (
        "bread",
        "Bread is made from flour, water, salt and yeast. When the dough is mixed and kneaded, "
        "proteins in the flour form a stretchy network called gluten. The yeast eats sugars "
        "in the flour and releases carbon dioxide, and the gas is trapped by the gluten, so "
        "the dough rises. A slow rise in a cool room gives the yeast time to make more flavor. "
        "In the oven the gas expands, the water turns to steam, and the outside of the loaf "
        "browns into a crust while the inside sets into a soft crumb.",
        ("dough", "mixture"),
        "Why does bread dough rise?",
    ),
    (
        "bees",
        "Honey bees live in colonies of up to sixty thousand insects. A single queen lays the "
        "eggs, while thousands of female workers clean the hive, feed the young, build wax "
        "combs and collect nectar and pollen from flowers. When a worker finds a good patch of "
        "flowers, she returns to the hive and performs a waggle dance. The direction of the "
        "dance tells the other bees the direction of the flowers relative to the sun, and its "
        "length tells them how far away the flowers are.",
        ("flowers", "blossoms"),
        "How does a worker bee tell others where to find flowers?",
    ),
    (
        "rivers",
        "A river begins as small streams high in the hills, fed by rain and melting snow. As "
        "the streams join, the river grows wider and carries sand and stones downhill. Where "
        "the land is steep the water flows fast and cuts deep valleys; where the land is flat "
        "it slows down and winds from side to side in large loops. Near the sea the river "
        "drops the fine mud it carries, and over many years this mud builds up a wide, flat "
        "delta where the river splits into many channels.",
        ("river", "stream"),
        "What builds a delta near the sea?",
    ),
    (
        "trains",
        "The first public railways carried coal from mines to ports in horse drawn wagons on "
        "wooden rails. Steam engines changed this in the early nineteenth century: a fire "
        "heated water in a boiler, and the steam pushed pistons that turned the wheels. Iron "
        "rails replaced wood, and railway lines soon linked the large cities of many "
        "countries. Trains carried people and goods faster and more cheaply than any road, "
        "and towns grew up around the stations. Later, diesel and electric engines replaced "
        "most steam engines.",
        ("cities", "towns"),
        "What pushed the pistons of a steam engine?",
    ),
    (
        "volcanoes",
        "A volcano forms where melted rock, called magma, rises from deep inside the earth to "
        "the surface. The magma collects in a chamber below the volcano, and pressure builds "
        "as gas in the magma cannot escape. When the pressure is high enough the volcano "
        "erupts. Some eruptions are quiet, with rivers of lava flowing slowly down the sides. "
        "Others are violent explosions that throw ash high into the sky, where wind can carry "
        "it hundreds of miles. Over time, layers of lava and ash build the mountain higher.",
        ("magma", "molten rock"),
        "What makes the pressure build up inside a volcano?",
    ),
    (
        "libraries",
        "Public libraries lend books to anyone who lives nearby, free of charge. A library "
        "sorts its books by subject, so that all the books about one topic stand together on "
        "the shelves, and a catalog lists every book with its place. Librarians help readers "
        "find what they need, run reading groups for children and teach people to use "
        "computers. Many libraries now also lend electronic books, music and films, and offer "
        "quiet rooms where students can work.",
        ("books", "volumes"),
        "How does a library sort its books?",
    ),
    (
        "tides",
        "The tides are the daily rise and fall of the sea. They are caused mostly by the moon, "
        "whose gravity pulls the water of the oceans toward it and makes a bulge on the side "
        "of the earth that faces the moon. A second bulge forms on the opposite side. As the "
        "earth turns, a coast passes through both bulges, so most places have two high tides "
        "and two low tides each day. When the sun and the moon line up, their pulls add "
        "together and the tides are especially high.",
        ("moon", "Moon"),
        "Why do most coasts have two high tides each day?",
    ),
)

_CHAT = (
    "What are three good habits for staying focused while studying?",
    "Explain in simple words why the sky is blue.",
    "Suggest a name for a small cafe by the sea and say why it fits.",
    "What should I pack for a two day hiking trip in the mountains?",
    "Give me a short recipe for a vegetable soup.",
    "How do I start learning to play the guitar?",
    "Write a short poem about autumn leaves.",
    "What is the difference between weather and climate?",
)


def _editing(index: int) -> str:
    _, passage, (old, new), _ = _PASSAGES[index % len(_PASSAGES)]
    return (
        f'Rewrite the passage below word for word, changing only every "{old}" to "{new}". '
        f"Reply with the rewritten passage only.\n\n{passage}"
    )


def _rag(index: int) -> str:
    n = len(_PASSAGES)
    answer = index % n
    # The passage that answers, between two others, as a retriever would return them.
    picks = [(answer + 3) % n, answer, (answer + 5) % n]
    docs = "\n\n".join(f"Passage {i + 1}: {_PASSAGES[p][1]}" for i, p in enumerate(picks))
    return (
        "Answer the question using the passages below, quoting them where you can.\n\n"
        f"{docs}\n\nQuestion: {_PASSAGES[answer][3]}"
    )


def _chat(index: int) -> str:
    return _CHAT[index % len(_CHAT)]


_BUILDERS = {"editing": (_editing, len(_PASSAGES)), "rag": (_rag, len(_PASSAGES)),
             "chat": (_chat, len(_CHAT))}  # fmt: skip


def workload_requests(
    name: str, num_prompts: int, output_len: int, seed: int, tokenizer: Any | None
) -> list[SampleRequest]:
    """`num_prompts` requests of workload `name`, each asking for up to `output_len` tokens;
    prompt lengths by `tokenizer` (words without one)."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    build, distinct = _BUILDERS[name]
    order = list(range(distinct))
    random.Random(seed).shuffle(order)
    requests = []
    for i in range(num_prompts):
        prompt = build(order[i % distinct])
        length = len(tokenizer.encode(prompt)) if tokenizer is not None else len(prompt.split())
        requests.append(SampleRequest(prompt=prompt, prompt_len=length, output_len=output_len))
    return requests


def _trigrams(text: str) -> list[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return [tuple(words[i : i + 3]) for i in range(len(words) - 2)]


def copy_share(prompts: list[str], answers: list[str]) -> float | None:
    """The share of the answers' word trigrams that occur in their own prompt (None: the
    answers hold no trigram)."""
    found = total = 0
    for prompt, answer in zip(prompts, answers, strict=True):
        seen = set(_trigrams(prompt))
        grams = _trigrams(answer)
        found += sum(g in seen for g in grams)
        total += len(grams)
    return found / total if total else None
