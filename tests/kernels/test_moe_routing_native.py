"""DeepSeek's grouped top-k router on kernels/cpu/moe_routing.c (the CPU kernel table's
`moe_grouped_topk`, kernels/cpu/moe_routing.py) against the portable `grouped_topk` (kernels/
fused_moe_torch.py, HF's arithmetic): every scoring and topk_method, group counts and limits,
with and without V3's correction bias and norm_topk_prob, the same experts and the weights to
fp32 rounding; ties to the lower expert (and group) id; from x, the fp32 router matmul in fp32
and bf16, the same bits whatever the thread count. The native decoder step runs these same C
functions (tests/kernels/test_native_step_moe_deepseek.py)."""

from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch

from model_server.kernels.cpu.gemm import default_kernels
from model_server.kernels.cpu.moe_routing import (
    grouped_topk_reason,
    grouped_topk_struct,
    native_grouped_topk,
)
from model_server.kernels.fused_moe_torch import (
    GroupedTopk,
    grouped_topk_of,
    route_grouped,
)

pytestmark = pytest.mark.skipif(
    default_kernels() is None, reason="the native CPU kernels need a C compiler"
)

# (scoring, topk_method, n_group, topk_group, E, k)
ROUTINGS = [
    ("softmax", "greedy", None, None, 16, 4),
    ("softmax", "greedy", None, None, 64, 6),  # V2-Lite's 64 experts, top 6
    ("softmax", "group_limited_greedy", 4, 2, 16, 4),
    ("softmax", "group_limited_greedy", 8, 3, 32, 6),
    ("softmax", "group_limited_greedy", 4, 1, 16, 3),  # fewer experts allowed than one group
    ("softmax", "group_limited_greedy", 1, 1, 8, 2),
    ("sigmoid", "noaux_tc", None, None, 16, 4),  # no groups
    ("sigmoid", "noaux_tc", 1, 1, 16, 4),  # one group: no limit
    ("sigmoid", "noaux_tc", 4, 2, 16, 4),
    ("sigmoid", "noaux_tc", 8, 4, 64, 8),  # V3's 256 / 8 / 4, scaled down
    ("sigmoid", "noaux_tc", 8, 8, 16, 3),  # groups of two, every group allowed
]


def _router(
    scoring: str,
    method: str,
    n_group: int | None,
    topk_group: int | None,
    num_experts: int,
    top_k: int,
    *,
    hidden: int = 1,
    bias: bool = False,
    norm: bool = False,
    seed: int = 0,
) -> GroupedTopk:
    gen = torch.Generator().manual_seed(seed)
    return GroupedTopk(
        weight=torch.randn(num_experts, hidden, generator=gen) * hidden**-0.5,
        correction_bias=torch.randn(num_experts, generator=gen) * 0.3 if bias else None,
        top_k=top_k,
        scoring=scoring,
        topk_method=method,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=2.5,
        norm_topk_prob=norm,
    )


def _route_logits(router: GroupedTopk, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """wick_moe_grouped_topk_logits on router logits [T, E] fp32."""
    num_tokens = logits.shape[0]
    struct = grouped_topk_struct(router)
    weights = torch.empty(num_tokens, router.top_k)
    ids = torch.empty(num_tokens, router.top_k, dtype=torch.int64)
    status = default_kernels().lib.wick_moe_grouped_topk_logits(
        ctypes.addressof(struct), logits.data_ptr(), num_tokens, weights.data_ptr(), ids.data_ptr()
    )
    assert status == 0
    return weights, ids


def _by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (ids ascending, their weights): torch.topk's unsorted order is its own."""
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


def _choice(router: GroupedTopk, logits: torch.Tensor) -> torch.Tensor:
    scores = logits.softmax(-1) if router.scoring == "softmax" else logits.sigmoid()
    bias = router.correction_bias
    return scores if bias is None else scores + bias


# V2's softmax routers have no correction bias and never renormalise; V3's sigmoid ones with
# and without either.
CASES = [
    (routing, bias, norm)
    for routing in ROUTINGS
    for bias in ((False,) if routing[0] == "softmax" else (False, True))
    for norm in ((False,) if routing[0] == "softmax" else (False, True))
]


@pytest.mark.parametrize(
    ("routing", "bias", "norm"),
    CASES,
    ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else str(v),
)
def test_the_c_router_chooses_grouped_topks_experts_and_weights(
    routing: tuple, bias: bool, norm: bool
) -> None:
    scoring = routing[0]
    router = _router(*routing, bias=bias, norm=norm, seed=len(routing) + routing[4])
    gen = torch.Generator().manual_seed(routing[4] * 7 + routing[5])
    logits = torch.randn(97, routing[4], generator=gen) * 2.0
    weights, ids = _route_logits(router, logits)
    ref_weights, ref_ids = route_grouped(logits, router)
    ids_sorted, weights_sorted = _by_id(weights, ids)
    ref_ids_sorted, ref_weights_sorted = _by_id(ref_weights, ref_ids)
    assert torch.equal(ids_sorted, ref_ids_sorted)
    # expf and PyTorch's vectorized exp, a division and a reciprocal: a few fp32 ulps
    torch.testing.assert_close(weights_sorted, ref_weights_sorted, rtol=1e-5, atol=1e-6)
    # best first by the choice (the corrected scores)
    chosen = _choice(router, logits).gather(1, ids)
    assert bool((chosen[:, :-1] >= chosen[:, 1:]).all())
    if scoring == "sigmoid" and norm:
        torch.testing.assert_close(weights.sum(-1), torch.full((97,), 2.5), rtol=1e-6, atol=0)


def test_the_correction_bias_chooses_and_the_scores_weigh() -> None:
    """V3: the bias makes group 2 (experts 4, 5) the best; the weights are the uncorrected
    sigmoids, renormalised, times the scaling factor."""
    logits = torch.tensor([[0.0, 0.1, 2.0, 1.9, -1.0, -1.2, 0.5, 0.4]])
    router = dataclasses.replace(
        _router("sigmoid", "noaux_tc", 4, 1, 8, 2, norm=True),
        correction_bias=torch.tensor([0.0, 0.0, 0.0, 0.0, 5.0, 5.0, 0.0, 0.0]),
    )
    weights, ids = _route_logits(router, logits)
    assert ids.tolist() == [[4, 5]]
    s = torch.sigmoid(logits[0, [4, 5]])
    torch.testing.assert_close(weights[0], 2.5 * s / s.sum(), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("routing", "logits", "expected"),
    [
        # three experts tie for the best: the two lower ids
        (("softmax", "greedy", None, None, 6, 2), [0.5, 2.0, 2.0, 2.0, -1.0, 0.0], [1, 2]),
        # groups {0,1} {2,3} {4,5}: groups 1 and 2 tie at 3.0 for one place -> group 1
        (
            ("softmax", "group_limited_greedy", 3, 1, 6, 2),
            [0.0, 1.0, 3.0, 2.0, 3.0, 2.5],
            [2, 3],
        ),
        # sigmoid groups ranked by the sum of their two best: groups 0 and 1 tie; every expert
        # of group 0 ties too
        (("sigmoid", "noaux_tc", 3, 1, 6, 2), [1.0, 1.0, 1.0, 1.0, -3.0, 2.0], [0, 1]),
        # one group's experts all tie with another group's: the lower ids
        (("sigmoid", "noaux_tc", 2, 2, 4, 3), [0.5, 0.5, 0.5, 0.5], [0, 1, 2]),
    ],
)
def test_ties_go_to_the_lower_group_and_expert(
    routing: tuple, logits: list[float], expected: list[int]
) -> None:
    """torch.topk leaves the order of ties to its implementation (its unsorted output too):
    the C router breaks them to the lower id, and the modules route on it on the CPU, so both
    paths choose alike."""
    router = _router(*routing)
    weights, ids = _route_logits(router, torch.tensor([logits]))
    assert ids.tolist() == [expected]
    scores = _choice(router, torch.tensor([logits]))[0, expected] * 2.5
    torch.testing.assert_close(weights[0], scores, rtol=1e-6, atol=0)


def test_random_ties_follow_a_stable_descending_sort() -> None:
    """Logits of a few values (many ties in experts and groups): the ids are a stable sort's,
    the groups chosen likewise (a reference in PyTorch with stable sorts)."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randint(-2, 3, (200, 16), generator=gen).float()
    for routing in (("softmax", "group_limited_greedy", 4, 2, 16, 4),
                    ("sigmoid", "noaux_tc", 4, 2, 16, 4)):  # fmt: skip
        router = _router(*routing)
        _, ids = _route_logits(router, logits)
        choice = _choice(router, logits).view(200, 4, 4)
        if router.scoring == "softmax":
            group_scores = choice.max(-1).values
        else:
            group_scores = choice.topk(2, -1).values.sum(-1)
        groups = group_scores.sort(dim=-1, descending=True, stable=True).indices[:, :2]
        allowed = torch.zeros(200, 4, dtype=torch.bool).scatter_(1, groups, True)
        fill = 0.0 if router.scoring == "softmax" else float("-inf")
        masked = choice.masked_fill(~allowed.unsqueeze(-1), fill).view(200, 16)
        expected = masked.sort(dim=-1, descending=True, stable=True).indices[:, :4]
        assert torch.equal(ids, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_routing_from_x_scores_in_fp32(dtype: torch.dtype, num_tokens: int) -> None:
    """x [T, H] -> the router's fp32 logits (x widened, fp32 weight) -> the routing: the
    experts of `grouped_topk_of` (HF's F.linear(x.float(), W.float())), the weights to fp32
    rounding, and the same bits on one thread as on two."""
    router = _router("sigmoid", "noaux_tc", 4, 2, 32, 4, hidden=96, bias=True, norm=True)
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 96, generator=gen).to(dtype)
    kernels = default_kernels()
    weights, ids = native_grouped_topk(kernels, x, router)
    ref_weights, ref_ids = grouped_topk_of(x, router)
    assert torch.equal(_by_id(weights, ids)[0], _by_id(ref_weights, ref_ids)[0])
    torch.testing.assert_close(
        _by_id(weights, ids)[1], _by_id(ref_weights, ref_ids)[1], rtol=1e-5, atol=1e-6
    )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native_grouped_topk(kernels, x, router)
        torch.set_num_threads(2)
        two = native_grouped_topk(kernels, x, router)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    assert torch.equal(one[0], weights) and torch.equal(one[1], ids)


def test_what_the_c_router_does_not_take_is_named_and_runs_in_pytorch() -> None:
    router = _router("softmax", "group_limited_greedy", 4, 2, 16, 4, hidden=8)
    assert grouped_topk_reason(router) is None
    assert grouped_topk_reason(dataclasses.replace(router, n_group=3)) == (
        "the best 2 of 3 groups of 16 experts"
    )
    assert grouped_topk_reason(dataclasses.replace(router, topk_method="noaux_tc")) == (
        "softmax scoring with topk_method noaux_tc"
    )
    half = dataclasses.replace(router, weight=router.weight.to(torch.bfloat16))
    assert grouped_topk_reason(half) == (
        "a router weight that is not a contiguous float32 [E, hidden] tensor"
    )
    single = _router("sigmoid", "noaux_tc", 8, 2, 8, 2)
    assert grouped_topk_reason(single) == (
        "groups of one expert (noaux_tc ranks a group by its two best)"
    )
    # what the C code refuses, it refuses itself too (-1), and the table's slot runs PyTorch's
    struct = grouped_topk_struct(router)
    struct.n_group = 3
    out = torch.empty(1, 4)
    ids = torch.empty(1, 4, dtype=torch.int64)
    lib = default_kernels().lib
    status = lib.wick_moe_grouped_topk_logits(
        ctypes.addressof(struct), torch.zeros(1, 16).data_ptr(), 1, out.data_ptr(), ids.data_ptr()
    )
    assert status == -1
    x = torch.randn(3, 8)
    weights, ids = native_grouped_topk(default_kernels(), x, half)
    ref_weights, ref_ids = grouped_topk_of(x, half)
    assert torch.equal(weights, ref_weights) and torch.equal(ids, ref_ids)
