"""How much of a `bench serve` run the server answered from its prefix cache.

`bench serve`'s random prompts are deterministic per `--seed`, so a second run with the same seed
(or a run whose prompts are a prefix of an earlier run's: the first 8 of 64 prompts are the 8 of
a smaller run) sends prompts the server has cached, and its prefill time and TTFT drop for reasons
that have nothing to do with the server's speed. The server's own counters say so: Wick and vLLM
both export `vllm:prefix_cache_queries` (prompt tokens looked up) and `vllm:prefix_cache_hits`
(tokens found) at `/metrics`. They are read before and after the run; servers without them
(llama.cpp) report nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx

QUERIES = "vllm:prefix_cache_queries"
HITS = "vllm:prefix_cache_hits"
# Above this share of cached prompt tokens the run does not measure uncached prefill: warn.
WARN_HIT_RATE = 0.25


@dataclass(slots=True, frozen=True)
class PrefixCounters:
    queries: float
    hits: float


def sum_counters(text: str, names: tuple[str, ...]) -> dict[str, float] | None:
    """Each counter of `names` in a Prometheus text exposition, summed over label sets (one per
    model); None when one is missing or the text does not parse."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                # A counter's value is its `_total` sample (`_created` is a timestamp).
                for name in names:
                    if sample.name in (name, name + "_total"):
                        totals[name] = totals.get(name, 0.0) + float(sample.value)
    except ValueError:
        return None
    return totals if all(name in totals for name in names) else None


def parse_prefix_counters(text: str) -> PrefixCounters | None:
    """The two counters, summed over label sets; None when either is missing."""
    totals = sum_counters(text, (QUERIES, HITS))
    return None if totals is None else PrefixCounters(queries=totals[QUERIES], hits=totals[HITS])


async def read_metrics(
    client: httpx.AsyncClient, base_url: str, headers: dict[str, str] | None
) -> str | None:
    """The server's /metrics text, or None when it has none."""
    import httpx

    try:
        r = await client.get(base_url + "/metrics", headers=headers)
    except httpx.HTTPError:
        return None
    return r.text if r.status_code == 200 else None


def hit_rate(before: PrefixCounters | None, after: PrefixCounters | None) -> float | None:
    """Share of the prompt tokens looked up between the two readings that the cache held."""
    if before is None or after is None:
        return None
    queries = after.queries - before.queries
    if queries <= 0:
        return None
    return max(0.0, after.hits - before.hits) / queries


def hit_rate_warning(rate: float | None, seed: int) -> str | None:
    if rate is None or rate <= WARN_HIT_RATE:
        return None
    return (
        f"warning: the server answered {rate:.0%} of this run's prompt tokens from its prefix "
        f"cache (prompts of an earlier run with --seed {seed}?): prefill and TTFT figures are "
        "not those of new prompts; pass a --seed no earlier run used"
    )
