"""Decode graphs (engine/execution/cuda_graph.py): bucketing, padding and greedy parity with
eager runs.

On the CPU the Triton backend runs interpreted and a stand-in capturer "replays" by rerunning
the captured function on the static buffers: everything but the CUDA recording itself is the
real code path (static inputs, padding rows, bucket choice, output slicing). With a GPU the
`gpu` test does the same with real CUDA graphs.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model_server.engine.execution.cuda_graph import CUDAGraphRunner, GraphKey, capture_sizes
from model_server.engine.execution.input_batch import SeqChunk
from model_server.engine.execution.step_input import StepInput
from model_server.engine.llm import LLM
from model_server.layers.attention.triton_backend import TritonAttentionBackend
from model_server.platforms.cpu import CpuPlatform
from model_server.sampling_params import SamplingParams
from tests.kernels.helpers import TINY_CONFIGS, tiny_llm

pytestmark = pytest.mark.kernels


class CaptureGuard(TorchDispatchMode):
    """Records the ops that break (or silently corrupt) a CUDA graph capture.

    On a GPU these fail only at capture time: a host read of a device value (`.item()`,
    `.tolist()`, `bool(t)`, `repeat_interleave` without `output_size`), an op whose output shape
    depends on the data (`nonzero`, boolean-mask indexing, `unique`), or a tensor built from Python
    values inside the captured function (a host-to-device copy baked into the graph with that
    step's values). Run under this mode on the CPU, the captured forward must issue none of them.
    """

    _DATA_DEPENDENT = frozenset(
        {
            "aten._local_scalar_dense",
            "aten.nonzero",
            "aten.masked_select",
            "aten._unique2",
            "aten.unique_consecutive",
            "aten.unique_dim",
            "aten.lift_fresh",
        }
    )

    def __init__(self) -> None:
        super().__init__()
        self.violations: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket._qualified_op_name.replace("::", ".")
        if name in self._DATA_DEPENDENT:
            self.violations.append(name)
        elif name == "aten.repeat_interleave" and kwargs.get("output_size") is None:
            if args and isinstance(args[0], torch.Tensor) and len(args) < 2:
                self.violations.append(name)
        elif name == "aten.index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())
        ):
            self.violations.append("aten.index with a boolean mask")
        return func(*args, **kwargs)


class RerunCapturer:
    """Replays by calling the function again and writing its result into the first output.

    The capture run happens under `CaptureGuard`: an op a real capture would reject fails here.
    """

    def __init__(self) -> None:
        self.captured: list[int] = []
        self.replays = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        with CaptureGuard() as guard:
            output = fn()
        assert not guard.violations, f"not capturable: {sorted(set(guard.violations))}"
        self.captured.append(output.shape[0])

        def replay() -> None:
            self.replays += 1
            output.copy_(fn())

        return replay, output


@pytest.fixture
def rerun_graphs(monkeypatch) -> RerunCapturer:
    """Make the CPU platform "support graphs" with the stand-in capturer.

    With CUDA present the engine runs on it, not on the patched CPU platform: the tests that use
    the stand-in skip there (the `gpu` tests run real graphs instead).
    """
    if torch.cuda.is_available():
        pytest.skip("CPU stand-in for CUDA graphs: with CUDA the gpu tests capture real ones")
    capturer = RerunCapturer()
    monkeypatch.setattr(CpuPlatform, "supports_graphs", True)
    monkeypatch.setattr(CpuPlatform, "graph_capturer", lambda self: capturer, raising=False)
    return capturer


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(10) == [1, 2, 4, 8, 16]
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(1000)[-1] == 512


def test_bucket_choice() -> None:
    runner = CUDAGraphRunner(
        lambda ids, positions, md: torch.zeros(ids.shape[0], 4),
        RerunCapturer(),
        sizes=[1, 2, 4, 8],
        block_size=4,
        max_model_len=32,
        device=torch.device("cpu"),
    )
    decode = SeqChunk([5], 3, [0])
    assert runner.bucket_for([decode]) is None  # nothing captured yet
    runner.capture()
    assert sorted(runner.graphs) == [(1, 32), (2, 32), (4, 32), (8, 32)]
    assert runner.bucket_for([decode] * 3) == GraphKey(4, 32)
    assert runner.bucket_for([decode] * 8) == GraphKey(8, 32)
    assert runner.bucket_for([decode] * 9) is None  # larger than the largest bucket: eager
    assert runner.bucket_for([decode, SeqChunk([1, 2], 0, [1])]) is None  # a prefill: eager
    assert runner.bucket_for([]) is None


class RecordingForward:
    """A forward that records the metadata's host bound of each call and returns zeros."""

    def __init__(self) -> None:
        self.bounds: list[int] = []

    def __call__(self, ids, positions, md) -> torch.Tensor:
        self.bounds.append(md.max_seq_len)
        assert md.seq_lens_cpu == [md.max_seq_len] * ids.shape[0]
        return torch.zeros(ids.shape[0], 4)


def test_context_bound_is_the_smallest_captured_above_the_longest_context() -> None:
    forward = RecordingForward()
    runner = CUDAGraphRunner(
        forward,
        RerunCapturer(),
        sizes=[1, 2, 4],
        block_size=4,
        max_model_len=64,
        device=torch.device("cpu"),
        # Batch 4 fills the device without splitting: one bound (max_model_len) is enough.
        context_bounds=lambda bs: [8, 16, 64] if bs < 4 else [64],
    )
    runner.capture()
    assert sorted(runner.graphs) == [(1, 8), (1, 16), (1, 64), (2, 8), (2, 16), (2, 64), (4, 64)]
    short, mid = SeqChunk([5], 3, [0]), SeqChunk([5], 8, [0, 1, 2])  # contexts 4 and 9
    long = SeqChunk([5], 40, list(range(11)))  # context 41
    assert runner.bucket_for([short]) == GraphKey(1, 8)
    assert runner.bucket_for([short, mid]) == GraphKey(2, 16)  # the longest decides
    assert runner.bucket_for([mid, long]) == GraphKey(2, 64)
    assert runner.bucket_for([short] * 3) == GraphKey(4, 64)
    forward.bounds.clear()
    runner.run([short, mid], GraphKey(2, 16))
    assert forward.bounds == [16]  # the replayed graph is the one captured at bound 16


def test_triton_backend_captures_one_bound_per_split_count() -> None:
    cpu = torch.device("cpu")
    backend = TritonAttentionBackend(16, 8, 128, 0.1)  # Llama-3.1-8B's heads
    backend._sm_count = 132  # an H100: 528 programs wanted
    # Batch 1 (8 programs): 1, 2, 4, 8, 16 splits at 256, 512, ... tokens; 16 from 4096 on.
    assert backend.graph_context_bounds(1, 131072, cpu) == [256, 512, 1024, 2048, 131072]
    assert [backend.decode_splits(1, b, cpu) for b in (256, 512, 1024, 2048, 131072)] == [
        1, 2, 4, 8, 16,
    ]  # fmt: skip
    assert backend.decode_splits(1, 300, cpu) == 2  # a context between two bounds
    # Batch 64 (512 programs) fills the GPU unsplit: one graph, at max_model_len.
    assert backend.graph_context_bounds(64, 131072, cpu) == [131072]
    assert backend.graph_context_bounds(1, 200, cpu) == [200]  # shorter than one split
    windowed = TritonAttentionBackend(16, 8, 128, 0.1, sliding_window=512)
    windowed._sm_count = 132
    assert windowed.graph_context_bounds(1, 8192, cpu) == [256, 8192]  # 2 splits at most


def test_step_inputs_come_from_persistent_staging_buffers() -> None:
    runner = CUDAGraphRunner(
        lambda ids, positions, md: torch.zeros(ids.shape[0], 4),
        RerunCapturer(),
        sizes=[1, 2, 4],
        block_size=4,
        max_model_len=32,
        device=torch.device("cpu"),
    )
    runner.capture()
    staging = (runner.host_token_inputs, runner.host_seq_lens, runner.host_block_tables)
    pointers = [t.data_ptr() for t in staging]
    chunks = [SeqChunk([11], 5, [7, 3]), SeqChunk([12], 0, [9]), SeqChunk([13], 8, [1, 2, 6])]
    runner.run(chunks, runner.bucket_for(chunks))
    # The device buffers: three rows, then one padding row (slot -1, length 0).
    assert runner.token_inputs[:, :4].tolist() == [
        [11, 12, 13, 0],
        [5, 0, 8, 0],
        [3 * 4 + 1, 9 * 4 + 0, 6 * 4 + 0, -1],
    ]
    assert runner.seq_lens[:4].tolist() == [6, 1, 9, 0]
    assert runner.block_tables[0, :2].tolist() == [7, 3]
    assert runner.block_tables[2, :3].tolist() == [1, 2, 6]
    # A smaller step: stale rows past it become padding again.
    runner.run(chunks[1:2], runner.bucket_for(chunks[1:2]))
    assert runner.token_inputs[:, :1].tolist() == [[12], [0], [36]]
    assert runner.seq_lens[:1].tolist() == [1]
    # The same staging tensors every step (no per-step host tensors).
    assert [t.data_ptr() for t in staging] == pointers
    assert not any(t.is_pinned() for t in staging)  # pinned on CUDA only


def _llm(tmp_path, name: str, **overrides) -> LLM:
    # max_num_seqs 6: buckets 1, 2, 4, 8.
    return tiny_llm(tmp_path, name, **{"max_num_seqs": 6, **overrides})


PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate((5, 19, 11, 3, 8))]
# Different lengths, so the decode batch shrinks through the buckets as requests finish.
PARAMS = [
    SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (14, 9, 20, 5, 11)
]


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_greedy_output_identical_with_and_without_graphs(tmp_path, rerun_graphs, name) -> None:
    eager = _llm(tmp_path, name, enforce_eager=True)
    assert eager.engine.core.model_runner.graph_runner is None
    expected = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, PARAMS)]

    llm = _llm(tmp_path, name)
    runner = llm.engine.core.model_runner
    assert runner.graph_runner is not None
    assert rerun_graphs.captured == [8, 4, 2, 1]  # largest first
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert got == expected
    assert [len(t) for t in got] == [14, 9, 20, 5, 11]
    # Most decode steps replayed a graph (prefill and mixed steps ran eagerly).
    assert rerun_graphs.replays >= 10


def test_graphs_split_k_by_the_longest_context_of_the_batch(
    tmp_path, rerun_graphs, monkeypatch
) -> None:
    """With 8-token splits the Triton backend captures each bucket at several context bounds
    (one per split count); steps replay the bound of their longest context, and the greedy
    output equals the eager run's."""
    monkeypatch.setitem(
        TritonAttentionBackend.__init__.__kwdefaults__, "decode_min_split_tokens", 8
    )
    expected = [
        o.outputs[0].token_ids
        for o in _llm(tmp_path, "llama-gqa", enforce_eager=True).generate(PROMPTS, PARAMS)
    ]
    replayed: list[GraphKey] = []
    run = CUDAGraphRunner.run

    def spy(self, chunks, key):
        replayed.append(key)
        return run(self, chunks, key)

    monkeypatch.setattr(CUDAGraphRunner, "run", spy)
    llm = _llm(tmp_path, "llama-gqa")
    graph_runner = llm.engine.core.model_runner.graph_runner
    # CPU stand-in SM count 16 -> 64 programs; 2 KV heads: batch 1 splits up to 16 ways, 8 up
    # to 4 ways; bounds 8, 16, 32, ... (powers of two of the split length) then max_model_len.
    assert graph_runner.bounds[1] == [8, 16, 32, 64, 256]
    assert graph_runner.bounds[8] == [8, 16, 256]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
    assert len({key.max_context for key in replayed}) >= 2
    for key in replayed:  # never a bound below the batch's longest context (checked in run)
        assert key.max_context in graph_runner.bounds[key.batch_size]


def test_padding_rows_write_no_kv(tmp_path, rerun_graphs) -> None:
    """Three decodes in the 4-bucket: exactly their three slots change in the KV cache."""
    llm = _llm(tmp_path, "llama-gqa")
    runner = llm.engine.core.model_runner
    before = [c.clone() for c in runner.kv_caches]
    chunks = [SeqChunk([11], 0, [2]), SeqChunk([12], 9, [0, 5]), SeqChunk([13], 3, [7])]
    key = runner.graph_runner.bucket_for(chunks)
    assert key.batch_size == 4
    with torch.inference_mode():  # as in ModelRunner.execute_step
        hidden = runner.graph_runner.run(chunks, key)
    assert hidden.shape[0] == 3 and torch.isfinite(hidden).all()
    bs = runner.block_size
    expected_slots = {2 * bs + 0, 5 * bs + 1, 7 * bs + 3}
    for layer_before, layer_after in zip(before, runner.kv_caches, strict=True):
        # [2, num_blocks, block_size, Hkv, D] -> changed slots (over K and V)
        changed = (layer_before != layer_after).flatten(3).any(-1).any(0).flatten()
        assert set(changed.nonzero().flatten().tolist()) == expected_slots


def test_graphs_off_for_enforce_eager_and_host_bound_backends(tmp_path, rerun_graphs) -> None:
    assert (
        _llm(tmp_path, "llama-gqa", enforce_eager=True).engine.core.model_runner.graph_runner
        is None
    )
    torch_llm = _llm(tmp_path, "llama-gqa", attention_backend="torch")
    assert torch_llm.engine.core.model_runner.graph_runner is None
    assert rerun_graphs.captured == []


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_real_cuda_graphs_match_eager(tmp_path, name) -> None:
    expected = [
        o.outputs[0].token_ids
        for o in _llm(tmp_path, name, enforce_eager=True).generate(PROMPTS, PARAMS)
    ]
    llm = _llm(tmp_path, name)
    assert llm.engine.core.model_runner.graph_runner is not None
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected


def test_graph_step_with_a_non_sampling_single_token_chunk(tmp_path, rerun_graphs) -> None:
    """A one-token chunk in the middle of a prompt (chunked prefill) rides in a graph batch but
    does not sample: the logits are those of the sampling rows only, as in an eager step."""
    runner = _llm(tmp_path, "llama-gqa").engine.core.model_runner
    step = StepInput(
        [SeqChunk([11], 4, [2]), SeqChunk([12], 9, [0, 5]), SeqChunk([13], 3, [7])],
        [True, False, True],
    )
    graph_out = runner.execute_step(step)
    replays = rerun_graphs.replays
    assert replays == 1
    graph_runner, runner.graph_runner = runner.graph_runner, None
    eager_out = runner.execute_step(step)
    runner.graph_runner = graph_runner
    assert rerun_graphs.replays == replays  # the second step ran eagerly
    assert graph_out.sample_indices == eager_out.sample_indices == [0, 2]
    torch.testing.assert_close(graph_out.logits, eager_out.logits)


def test_capture_guard_flags_what_a_real_capture_rejects() -> None:
    x = torch.arange(6.0)
    cases = {
        "aten._local_scalar_dense": lambda: x.sum().item(),
        "aten.nonzero": lambda: (x > 2).nonzero(),
        "aten.index with a boolean mask": lambda: x[x > 2],
        "aten.lift_fresh": lambda: torch.tensor([1, 2, 3]),
    }
    for expected, fn in cases.items():
        with CaptureGuard() as guard:
            fn()
        assert expected in guard.violations, (expected, guard.violations)
    with CaptureGuard() as guard:  # static-shape device work is fine
        torch.where(x > 2, x, 0.0).softmax(0)[torch.arange(3)]
    assert guard.violations == []


# ---- speculative verification steps (rows = tokens) ---------------------------------------


def test_capture_sizes_reach_the_verification_rows() -> None:
    assert capture_sizes(6, verification_rows=15) == [1, 2, 4, 8, 16]
    assert capture_sizes(256, verification_rows=15) == capture_sizes(256)  # no graph added
    assert capture_sizes(4, verification_rows=0) == [1, 2, 4]
    assert capture_sizes(4, verification_rows=5000)[-1] == 512  # MAX_CAPTURE_SIZE still caps


def _verify(token_ids: list[int], start: int, blocks: list[int]) -> SeqChunk:
    """A request's last token then its drafts, attending as decodes (as prepare_step builds)."""
    return SeqChunk(token_ids, start, blocks, attend_as_decodes=True)


def test_verification_bucket_choice() -> None:
    runner = CUDAGraphRunner(
        lambda ids, positions, md: torch.zeros(ids.shape[0], 4),
        RerunCapturer(),
        sizes=[1, 2, 4, 8, 16],
        block_size=4,
        max_model_len=64,
        device=torch.device("cpu"),
        context_bounds=lambda rows: [8, 16, 64],
    )
    runner.capture()
    decode = SeqChunk([5], 3, [0])  # context 4
    three = _verify([5, 6, 7], 3, [0, 1])  # 3 rows, last context 6
    five = _verify([5, 6, 7, 8, 9], 10, [0, 1, 2, 3])  # 5 rows, last context 15
    assert runner.bucket_for([three]) == GraphKey(4, 8)
    assert runner.bucket_for([decode, three]) == GraphKey(4, 8)  # 1 + 3 rows
    # Mixed draft counts: 1 + 3 + 5 rows; the last draft's context (15) sets the bound.
    assert runner.bucket_for([decode, three, five]) == GraphKey(16, 16)
    assert runner.bucket_for([_verify([5, 6], 6, [0, 1])]) == GraphKey(2, 8)  # context 8
    assert runner.bucket_for([_verify([5, 6], 7, [0, 1, 2])]) == GraphKey(2, 16)  # context 9
    assert runner.bucket_for([five] * 3) == GraphKey(16, 16)
    assert runner.bucket_for([five] * 4) is None  # 20 rows: more than the largest bucket
    # A multi-token chunk that does not attend as decodes is a prefill: eager.
    assert runner.bucket_for([three, SeqChunk([1, 2], 0, [1])]) is None


def test_verification_rows_are_staged_one_per_token() -> None:
    forward = RecordingForward()
    runner = CUDAGraphRunner(
        forward, RerunCapturer(), sizes=[1, 2, 4, 8], block_size=4, max_model_len=32,
        device=torch.device("cpu"),
    )  # fmt: skip
    runner.capture()
    # A decode (no drafts), a verification of 2 drafts crossing a block, one of 1 draft.
    chunks = [
        SeqChunk([11], 5, [7, 3]),
        _verify([12, 13, 14], 2, [9, 4]),
        _verify([15, 16], 0, [6]),
    ]
    key = runner.bucket_for(chunks)
    assert key.batch_size == 8
    hidden = runner.run(chunks, key)
    assert hidden.shape == (6, 4)  # the real rows only, in the eager path's flat order
    assert runner.token_inputs.tolist() == [
        [11, 12, 13, 14, 15, 16, 0, 0],
        [5, 2, 3, 4, 0, 1, 0, 0],
        [3 * 4 + 1, 9 * 4 + 2, 9 * 4 + 3, 4 * 4 + 0, 6 * 4 + 0, 6 * 4 + 1, -1, -1],
    ]
    # Each token attends as its decode: its own position + 1; padding rows read nothing.
    assert runner.seq_lens.tolist() == [6, 3, 4, 5, 1, 2, 0, 0]
    tables = runner.block_tables.tolist()
    assert tables[0][:2] == [7, 3]
    assert [tables[r][:2] for r in (1, 2, 3)] == [[9, 4]] * 3  # the request's table per row
    assert tables[4][0] == tables[5][0] == 6
    # A decode step after it: the verification rows become padding again.
    runner.run(chunks[:1], runner.bucket_for(chunks[:1]))
    assert runner.token_inputs[2, :1].tolist() == [3 * 4 + 1]
    assert runner.seq_lens[:1].tolist() == [6]


SPEC = json.dumps(
    {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
        "disable_by_batch_size": 3,
    }
)
# Repetitive prompts, so the n-gram proposer drafts from the first decode on.
SPEC_PROMPTS = [[1, 2, 3, 4] * 4, [9, 8, 7] * 4 + [9]]
# Logprobs too: the dummy-weight model's greedy tokens barely depend on attention (it repeats
# its last token), its logprobs do.
SPEC_PARAMS = [
    SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2) for n in (9, 6)
]


def _tokens_and_logprobs(llm: LLM) -> list[tuple[list[int], list[float]]]:
    outputs = [o.outputs[0] for o in llm.generate(SPEC_PROMPTS, SPEC_PARAMS)]
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outputs]


def _assert_same(got, expected) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, expected, strict=True):
        assert tokens == ref_tokens
        assert logprobs == pytest.approx(ref_logprobs, abs=1e-5)


def test_speculative_greedy_identical_with_verification_graphs(
    tmp_path, rerun_graphs, monkeypatch
) -> None:
    """n-gram speculation with graphs on: verification steps replay graphs (some in buckets
    only they reach), and the greedy output and its logprobs equal speculation with graphs off
    and no speculation at all."""
    plain = _llm(tmp_path, "llama-gqa", max_num_seqs=2, enforce_eager=True)
    expected = _tokens_and_logprobs(plain)
    del plain
    eager = _llm(tmp_path, "llama-gqa", max_num_seqs=2, enforce_eager=True, speculative_config=SPEC)
    _assert_same(_tokens_and_logprobs(eager), expected)
    del eager

    widths: list[tuple[GraphKey, tuple[int, ...]]] = []
    run = CUDAGraphRunner.run

    def spy(self, chunks, key):
        widths.append((key, tuple(len(c.token_ids) for c in chunks)))
        return run(self, chunks, key)

    monkeypatch.setattr(CUDAGraphRunner, "run", spy)
    llm = _llm(tmp_path, "llama-gqa", max_num_seqs=2, speculative_config=SPEC)
    # 2 requests x (1 + 3) rows = 8 verification rows: buckets beyond max_num_seqs' 2.
    assert rerun_graphs.captured == [8, 4, 2, 1]
    _assert_same(_tokens_and_logprobs(llm), expected)
    verifications = [(key, w) for key, w in widths if max(w) > 1]
    assert verifications, widths  # verification steps replayed graphs
    for key, w in verifications:
        assert sum(w) <= key.batch_size
    assert any(key.batch_size > 2 for key, _ in verifications)  # a bucket only they use


def test_verification_step_with_mixed_draft_counts(tmp_path, rerun_graphs) -> None:
    """A decode and two verifications of 2 and 1 drafts in one graph step (6 rows, bucket 8):
    the logits, their order and the drafts are the eager step's, and only the six real
    tokens' KV slots are written (the two padding rows write nothing)."""
    runner = _llm(tmp_path, "llama-gqa").engine.core.model_runner
    step = StepInput(
        [SeqChunk([11], 4, [2]), _verify([12, 13, 14], 9, [0, 5]), _verify([15, 16], 3, [7])],
        [True, True, True],
        num_drafts=[0, 2, 1],
    )
    before = [c.clone() for c in runner.kv_caches]
    graph_out = runner.execute_step(step)
    assert rerun_graphs.replays == 1
    bs = runner.block_size
    expected_slots = {2 * bs + 4, 5 * bs + 1, 5 * bs + 2, 5 * bs + 3, 7 * bs + 3, 7 * bs + 4}
    for layer_before, layer_after in zip(before, runner.kv_caches, strict=True):
        changed = (layer_before != layer_after).flatten(3).any(-1).any(0).flatten()
        assert set(changed.nonzero().flatten().tolist()) == expected_slots
    graph_runner, runner.graph_runner = runner.graph_runner, None
    eager_out = runner.execute_step(step)
    runner.graph_runner = graph_runner
    assert rerun_graphs.replays == 1  # the second step ran eagerly
    assert graph_out.sample_indices == eager_out.sample_indices == [0, 1, 1, 1, 2, 2]
    assert graph_out.drafts == eager_out.drafts == {1: [13, 14], 2: [16]}
    torch.testing.assert_close(graph_out.logits, eager_out.logits)
