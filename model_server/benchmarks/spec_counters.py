"""What speculative decoding did during a `bench serve` run, from the server's own counters.

Wick and vLLM export `vllm:spec_decode_num_drafts` (requests' verification rounds),
`vllm:spec_decode_num_draft_tokens` and `vllm:spec_decode_num_accepted_tokens` at `/metrics`.
They are read before and after the run; a server without them (or that never speculated)
reports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
_NAMES = (DRAFTS, DRAFT_TOKENS, ACCEPTED)


@dataclass(slots=True, frozen=True)
class SpecCounters:
    drafts: float
    draft_tokens: float
    accepted: float

    def describe(self) -> str:
        """One line: the acceptance rate and the mean tokens a verification round emitted (its
        accepted drafts plus the target's own token)."""
        rate = self.accepted / self.draft_tokens if self.draft_tokens else 0.0
        length = 1.0 + self.accepted / self.drafts if self.drafts else 1.0
        return (
            f"speculative decoding: {self.drafts:.0f} drafts of {self.draft_tokens:.0f} tokens, "
            f"{self.accepted:.0f} accepted ({rate:.1%}); mean acceptance length {length:.2f}"
        )


def parse_spec_counters(text: str) -> SpecCounters | None:
    """The three counters of a Prometheus text exposition, summed over label sets; None when
    one is missing."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                for name in _NAMES:
                    if sample.name in (name, name + "_total"):
                        totals[name] = totals.get(name, 0.0) + float(sample.value)
    except ValueError:
        return None
    if any(name not in totals for name in _NAMES):
        return None
    return SpecCounters(totals[DRAFTS], totals[DRAFT_TOKENS], totals[ACCEPTED])


async def read_spec_counters(
    client: httpx.AsyncClient, base_url: str, headers: dict[str, str] | None
) -> SpecCounters | None:
    import httpx

    try:
        r = await client.get(base_url + "/metrics", headers=headers)
    except httpx.HTTPError:
        return None
    return parse_spec_counters(r.text) if r.status_code == 200 else None


def spec_delta(before: SpecCounters | None, after: SpecCounters | None) -> SpecCounters | None:
    """What the run added (None: no counters, or no draft verified during the run)."""
    if before is None or after is None or after.drafts <= before.drafts:
        return None
    return SpecCounters(
        after.drafts - before.drafts,
        after.draft_tokens - before.draft_tokens,
        after.accepted - before.accepted,
    )
