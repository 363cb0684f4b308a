"""Tensor-parallel arithmetic without processes: head / vocabulary partitions and their errors,
the layers' shard loaders (each rank's output is its slice of the unsharded output), the step
message wire format and the rendezvous environment."""

from __future__ import annotations

import pytest
import torch

from model_server.distributed.partition import (
    HeadShard,
    TensorParallelSplitError,
    shard_heads,
    shard_vocab,
)
from model_server.distributed.rendezvous import rendezvous_from_env
from model_server.engine.execution.input_batch import SeqChunk
from model_server.engine.execution.step_input import PromptLogprobsRows, StepInput
from model_server.layers import embedding, linear
from model_server.models import check_tensor_parallel


def test_kv_groups_split_unevenly_like_smollm2() -> None:
    # 9 query heads, 3 KV heads over 2 ranks: 2 groups (6 heads) + 1 group (3 heads).
    assert shard_heads(9, 3, 2, 0) == HeadShard(q_start=0, num_heads=6, kv_start=0, num_kv_heads=2)
    assert shard_heads(9, 3, 2, 1) == HeadShard(q_start=6, num_heads=3, kv_start=2, num_kv_heads=1)
    assert shard_heads(32, 8, 4, 3) == HeadShard(24, 8, 6, 2)
    assert shard_heads(4, 4, 1, 0) == HeadShard(0, 4, 0, 4)


def test_fewer_kv_heads_than_ranks_replicates_them() -> None:
    shards = [shard_heads(8, 2, 4, r) for r in range(4)]
    assert [s.kv_start for s in shards] == [0, 0, 1, 1]
    assert [(s.q_start, s.num_heads, s.num_kv_heads) for s in shards] == [
        (0, 2, 1), (2, 2, 1), (4, 2, 1), (6, 2, 1)
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "needle"),
    [
        (9, 3, 4, "3 KV heads cannot be spread over --tensor-parallel-size 4"),
        (6, 2, 4, "num_attention_heads (6) is not divisible by --tensor-parallel-size 4"),
        (6, 4, 2, "must be a multiple of num_key_value_heads"),
    ],
)
def test_impossible_head_splits_are_clear_errors(
    heads: int, kv_heads: int, tp: int, needle: str
) -> None:
    with pytest.raises(TensorParallelSplitError) as info:
        for rank in range(tp):
            shard_heads(heads, kv_heads, tp, rank)
    assert needle in str(info.value) and isinstance(info.value, ValueError)


def test_vocab_is_padded_not_refused() -> None:
    shards = [shard_vocab(250, 4, r) for r in range(4)]
    assert [(s.start, s.size, s.padded_size) for s in shards] == [
        (0, 63, 63), (63, 63, 63), (126, 63, 63), (189, 61, 63)
    ]  # fmt: skip
    assert sum(s.size for s in shards) == 250
    assert shard_vocab(9, 4, 3).size == 0  # a rank past the end holds only padding


def test_check_tensor_parallel_reads_the_config_only() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        architectures=["LlamaForCausalLM"],
    )
    check_tensor_parallel(config, 2)
    config.intermediate_size = 90
    with pytest.raises(
        TensorParallelSplitError, match=r"intermediate_size \(90\) is not divisible"
    ):
        check_tensor_parallel(config, 4)


# ------------------------------------------------------------ layers, one rank at a time


def _as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, size: int) -> None:
    for module in (linear, embedding):
        monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: rank)
        monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: size)


def _loaded(layer: torch.nn.Module, *weights: tuple[object, ...]) -> torch.nn.Module:
    for param_name, tensor, *shard in weights:
        param = getattr(layer, param_name)
        param.weight_loader(param, tensor, *shard)
    return layer


def test_qkv_shards_are_per_part_and_cover_every_head(monkeypatch: pytest.MonkeyPatch) -> None:
    heads, kv_heads, d, hidden = 9, 3, 4, 16
    torch.manual_seed(0)
    wq, wk, wv = (torch.randn(n * d, hidden) for n in (heads, kv_heads, kv_heads))
    bias = [torch.randn(n * d) for n in (heads, kv_heads, kv_heads)]
    x = torch.randn(5, hidden)
    full_q, full_k, full_v = x @ wq.T + bias[0], x @ wk.T + bias[1], x @ wv.T + bias[2]
    parts: dict[str, list[torch.Tensor]] = {"q": [], "k": [], "v": []}
    for rank in range(2):
        _as_rank(monkeypatch, rank, 2)
        layer = linear.QKVParallelLinear(hidden, d, heads, kv_heads, bias=True)
        for sid, w, b in zip("qkv", (wq, wk, wv), bias, strict=True):
            _loaded(layer, ("weight", w, sid), ("bias", b, sid))
        q, k, v = layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        parts["q"].append(q), parts["k"].append(k), parts["v"].append(v)
    torch.testing.assert_close(torch.cat(parts["q"], -1), full_q)
    torch.testing.assert_close(torch.cat(parts["k"], -1), full_k)
    torch.testing.assert_close(torch.cat(parts["v"], -1), full_v)


def test_gate_up_shards_each_part_and_fused_checkpoints_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(1)
    gate, up, x = torch.randn(8, 6), torch.randn(8, 6), torch.randn(3, 6)
    for rank in range(2):
        _as_rank(monkeypatch, rank, 2)
        split = _loaded(linear.MergedColumnParallelLinear(6, [8, 8]), ("weight", gate, 0))
        _loaded(split, ("weight", up, 1))
        fused = _loaded(
            linear.MergedColumnParallelLinear(6, [8, 8]), ("weight", torch.cat([gate, up]))
        )
        rows = slice(4 * rank, 4 * rank + 4)
        expected = torch.cat([x @ gate[rows].T, x @ up[rows].T], dim=-1)  # gate_r | up_r
        torch.testing.assert_close(split(x), expected)
        torch.testing.assert_close(fused(x), expected)


def test_row_parallel_partials_sum_to_the_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(2)
    w, x = torch.randn(5, 36), torch.randn(2, 36)
    partials = []
    # Uneven input split (o_proj after 6 + 3 heads of 4).
    for rank, (start, size) in enumerate([(0, 24), (24, 12)]):
        _as_rank(monkeypatch, rank, 2)
        layer = linear.RowParallelLinear(36, 5, input_partition=(start, size))
        _loaded(layer, ("weight", w))
        partials.append(
            linear.dense(x[:, start : start + size], layer.weight, kernels=layer.kernels)
        )
    torch.testing.assert_close(partials[0] + partials[1], x @ w.T)


def test_shard_loaders_reject_wrong_checkpoint_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    _as_rank(monkeypatch, 1, 2)
    layer = linear.ColumnParallelLinear(6, 8)
    with pytest.raises(
        ValueError, match=r"checkpoint tensor has shape \(9, 6\), expected \(8, 6\)"
    ):
        _loaded(layer, ("weight", torch.zeros(9, 6)))
    emb = embedding.VocabParallelEmbedding(10, 4)
    assert emb.weight.shape == (5, 4)
    with pytest.raises(ValueError, match="expected \\(10, 4\\)"):
        _loaded(emb, ("weight", torch.zeros(11, 4)))


def test_vocab_shard_rows_and_padding(monkeypatch: pytest.MonkeyPatch) -> None:
    table = torch.arange(10 * 3, dtype=torch.float32).view(10, 3)
    _as_rank(monkeypatch, 2, 3)  # rows 8, 9 and two padding rows
    emb = _loaded(embedding.VocabParallelEmbedding(10, 3), ("weight", table))
    assert emb.weight.shape == (4, 3)
    torch.testing.assert_close(emb.weight[:2], table[8:])
    assert not emb.weight[2:].any()


# -------------------------------------------------------------------- wire and environment


def test_step_input_round_trips_through_ints() -> None:
    step = StepInput(
        chunks=[
            SeqChunk([5], 17, [3, 9, 4, 11]),  # decode at position 17: blocks 0..4 (of 4)
            SeqChunk(list(range(100, 110)), 0, [7, 8, 2, 6]),  # a chunk that does not sample
        ],
        sample=[True, False],
    )
    packed = step.pack(block_size=4)
    assert all(isinstance(v, int) for v in packed)
    back = StepInput.unpack(packed)
    assert back.sample == [True, False]
    assert [list(c.token_ids) for c in back.chunks] == [[5], list(range(100, 110))]
    assert [c.num_computed_tokens for c in back.chunks] == [17, 0]
    # Only the blocks the chunk reaches travel: position 17 needs 5 blocks of 4 (all 4 given),
    # 10 tokens need 3.
    assert [list(c.block_ids) for c in back.chunks] == [[3, 9, 4, 11], [7, 8, 2]]


def test_step_input_carries_the_prompt_logprobs_rows() -> None:
    """Every rank runs the LM head on the rows of prompt logprobs (a collective): their counts
    travel; the top-k and the target tokens are rank 0's only."""
    step = StepInput(
        chunks=[SeqChunk([5], 17, [3, 9, 4, 11, 1]), SeqChunk([1, 2, 3], 0, [8])],
        sample=[True, False],
        prompt_logprobs=[None, PromptLogprobsRows(3, 2, [2, 3, 4])],
    )
    back = StepInput.unpack(step.pack(block_size=4))
    assert back.prompt_logprobs == [None, PromptLogprobsRows(3)]
    assert StepInput.unpack(StepInput(step.chunks, step.sample).pack(4)).prompt_logprobs == []


def test_rendezvous_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    single = rendezvous_from_env()
    assert (single.master_addr, single.nnodes, single.node_rank) == ("127.0.0.1", 1, 0)
    assert single.master_port > 0 and single.local_world_size(2) == 2
    monkeypatch.setenv("NNODES", "2")
    with pytest.raises(ValueError, match="need MASTER_ADDR and MASTER_PORT"):
        rendezvous_from_env()
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.5")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("NODE_RANK", "1")
    multi = rendezvous_from_env()
    assert multi.init_method == "tcp://10.0.0.5:29500"
    assert multi.local_world_size(8) == 4 and multi.first_rank(8) == 4
    with pytest.raises(ValueError, match="not divisible by NNODES=2"):
        multi.local_world_size(3)
    monkeypatch.setenv("NODE_RANK", "2")
    with pytest.raises(ValueError, match=r"NODE_RANK=2 must be in \[0, NNODES=2\)"):
        rendezvous_from_env()


def test_step_input_carries_the_sliding_block_table() -> None:
    """Models with a sliding-window KV cache group send each chunk's second block table (null
    entries included); the others send none."""
    step = StepInput(
        chunks=[SeqChunk([5], 17, [3, 9, 4, 11, 1], [0, 0, 0, 6, 2]), SeqChunk([1, 2], 0, [8])],
        sample=[True, True],
    )
    back = StepInput.unpack(step.pack(block_size=4))
    assert [list(c.sliding_block_ids) for c in back.chunks] == [[0, 0, 0, 6, 2], []]
    assert [list(c.block_ids) for c in back.chunks] == [[3, 9, 4, 11, 1], [8]]


def test_device_ids_are_one_per_local_rank() -> None:
    """On several nodes --device-ids names this node's devices: tp 4 over NNODES=2 runs 2 local
    ranks, so 0,1 fits and 0,1,2,3 (two devices left idle) or 0 (a rank without one) do not."""
    from model_server.engine.execution.worker import check_device_ids

    check_device_ids([0, 1], 2)
    check_device_ids(None, 2)
    for ids in ([0, 1, 2, 3], [0]):
        with pytest.raises(ValueError, match=f"names {len(ids)} device.* runs 2 tensor-parallel"):
            check_device_ids(ids, 2)
