"""The pooling scheduler: FCFS batches under the token budget, no overtaking."""

from __future__ import annotations

import pytest

from model_server.engine.pooling.params import PoolingParams
from model_server.engine.pooling.request import PoolingRequest
from model_server.engine.pooling.scheduler import PoolingScheduler


def _req(name: str, n: int) -> PoolingRequest:
    return PoolingRequest(name, list(range(1, n + 1)), PoolingParams())


def test_batches_fill_the_token_budget_in_arrival_order() -> None:
    s = PoolingScheduler(max_num_seqs=8, max_num_batched_tokens=100, max_model_len=50)
    for name, n in [("a", 10), ("b", 20), ("c", 30), ("d", 5), ("e", 50), ("f", 50)]:
        s.add_request(_req(name, n))
    # Packed, not padded: a, b, c, d are 65 tokens (padded to the longest they would be 120);
    # e would make 115.
    assert [r.request_id for r in s.schedule()] == ["a", "b", "c", "d"]
    # e, f: 100.
    assert [r.request_id for r in s.schedule()] == ["e", "f"]
    assert s.schedule() == [] and not s.has_unfinished_requests()


def test_max_num_seqs_and_no_overtaking() -> None:
    s = PoolingScheduler(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    for name, n in [("a", 4), ("b", 4), ("c", 4), ("long", 64), ("d", 1)]:
        s.add_request(_req(name, n))
    assert [r.request_id for r in s.schedule()] == ["a", "b"]
    assert [r.request_id for r in s.schedule()] == ["c"]  # "long" does not fit beside it
    assert [r.request_id for r in s.schedule()] == ["long"]  # and "d" did not overtake it
    assert [r.request_id for r in s.schedule()] == ["d"]


def test_budget_is_raised_to_the_longest_input_and_bad_inputs_are_refused() -> None:
    s = PoolingScheduler(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32)
    assert s.max_num_batched_tokens == 32
    with pytest.raises(ValueError, match="maximum input length is 32 tokens"):
        s.add_request(_req("x", 33))
    with pytest.raises(ValueError, match="empty"):
        s.add_request(_req("y", 0))
    s.add_request(_req("a", 3))
    s.add_request(_req("b", 3))
    s.finish_requests(["a"])
    assert [r.request_id for r in s.schedule()] == ["b"]
