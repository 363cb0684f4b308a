"""What speculative decoding did during a `bench serve` run, from the server's own counters.

Wick and vLLM export `vllm:spec_decode_num_drafts` (requests' verification rounds),
`vllm:spec_decode_num_draft_tokens` and `vllm:spec_decode_num_accepted_tokens` at `/metrics`.
They are read before and after the run (from the /metrics text `bench serve` scrapes for
the prefix counters too); a server without them (or that never speculated)
reports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from model_server.benchmarks.prefix_hits import sum_counters

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
    """The three counters, summed over label sets; None when one is missing."""
    totals = sum_counters(text, _NAMES)
    if totals is None:
        return None
    return SpecCounters(totals[DRAFTS], totals[DRAFT_TOKENS], totals[ACCEPTED])


def spec_delta(before: SpecCounters | None, after: SpecCounters | None) -> SpecCounters | None:
    """What the run added (None: no counters, or no draft verified during the run)."""
    if before is None or after is None or after.drafts <= before.drafts:
        return None
    return SpecCounters(
        after.drafts - before.drafts,
        after.draft_tokens - before.draft_tokens,
        after.accepted - before.accepted,
    )
