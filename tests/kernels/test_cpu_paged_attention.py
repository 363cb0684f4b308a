"""The native CPU paged attention (kernels/cpu/paged_attention.c) against the per-request PyTorch
reference, on every ISA path this machine runs (AVX2 forced on AVX-512 machines), fp32 and bf16,
decodes and prefills over cached prefixes, GQA, odd head dims, block boundaries, sliding windows
and logit soft caps (Gemma 2/3); its KV-cache store (strided k/v views, padding slots) against the
reference store."""

from __future__ import annotations

import logging

import pytest
import torch

from model_server.kernels.cpu import isa as isa_mod
from model_server.kernels.cpu import native
from model_server.kernels.reference import paged_attention_reference, store_kv_reference
from tests.kernels.helpers import make_batch

# Every path the CPU under test can run, best first (generic always).
RUNNABLE = [i.name for i in isa_mod.supported_isas(isa_mod.cpu_flags())]
# fp32 sums in another order; bf16 differs from the fp32 reference by the output's rounding
# (2^-8 relative) and, on avx512_bf16, by the dot products' bf16 pair sums.
TOL = {torch.float32: {"atol": 3e-5, "rtol": 3e-5}, torch.bfloat16: {"atol": 1.6e-2, "rtol": 1e-2}}

# (num_cached, num_new): decodes at and around block boundaries incl. a one-token context,
# a whole prompt, chunks after cached prefixes (crossing blocks, longer than a query tile),
# a prefix hit of exactly one block, a one-token prefill.
MIXED = [(0, 1), (7, 1), (8, 1), (26, 1), (0, 13), (9, 30), (8, 5), (3, 2), (0, 1), (40, 17)]


def _kernels(isa: str) -> native.NativeKernels:
    kernels = native.load_kernels(isa)
    assert kernels is not None and kernels.isa == isa
    assert kernels.lib.wick_isa().decode() == isa  # the build really is that path
    return kernels


def _check(
    isa: str,
    requests: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    min_work_per_thread: int = native.MIN_WORK_PER_THREAD,
) -> None:
    b = make_batch(
        requests,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        fill=float("nan"),  # a read of a slot past a request's context poisons its output
        seed=seed,
    )
    md = b.metadata
    store_kv_reference(b.k, b.v, b.k_cache, b.v_cache, md.slot_mapping)
    scale = head_dim**-0.5
    out = native.paged_attention(
        _kernels(isa),
        b.q,
        b.k_cache,
        b.v_cache,
        md.block_tables,
        md.query_start_loc,
        md.seq_lens,
        scale,
        min_work_per_thread=min_work_per_thread,
    )
    expected = paged_attention_reference(
        b.q, b.k_cache, b.v_cache, md.query_start_loc_cpu, md.seq_lens_cpu, b.block_tables, scale
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(9, 3, 64), (4, 4, 128), (8, 2, 80), (6, 2, 96), (4, 1, 72), (3, 3, 36)],
)
def test_mixed_batch_matches_reference(isa, dtype, num_heads, num_kv_heads, head_dim) -> None:
    _check(isa, MIXED, num_heads, num_kv_heads, head_dim, 8, dtype)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_block_sizes(isa, dtype, block_size) -> None:
    requests = [(0, 1), (block_size - 1, 1), (block_size, 1), (block_size + 1, 3), (5, 20)]
    _check(isa, requests, 4, 2, 64, block_size, dtype)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_few_tiles_take_one_kv_head_per_item(isa, dtype) -> None:
    """Fewer tiles than 4 per thread: one kv head per item, on two threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _check(isa, [(33, 1), (20, 6)], 8, 4, 96, 8, dtype, min_work_per_thread=0)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_many_decodes_take_whole_sequence_items(isa, dtype, num_threads) -> None:
    """With >= 4 tiles per thread an item covers all kv heads of a sequence (the kernel's other
    split): same results, with one thread and with two (forced: the steps are small)."""
    requests = [(n, 1) for n in (0, 5, 7, 8, 9, 15, 16, 17, 30, 41, 63)] + [(4, 9)]
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        _check(isa, requests, 8, 2, 64, 8, dtype, seed=1, min_work_per_thread=0)
    finally:
        torch.set_num_threads(previous)


# Cached tokens before each decode's query: a context of one token, within a block, at and
# across block boundaries (blocks of 8), past one chunk of keys (16 lanes on AVX-512) and past
# the prefetch distance (32 tokens).
DECODE_CONTEXTS = [0, 1, 6, 7, 8, 9, 15, 16, 17, 40, 150]


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 3, 4, 8, 12])  # 12: more heads than one pass holds (8)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 72, 40])
def test_decodes_match_reference(isa, dtype, group, head_dim) -> None:
    """The decode path (one query per item) for GQA groups and head dims, the common ones
    specialized and the odd ones (72, 40: a partial last vector on some ISAs) generic."""
    num_kv_heads = 2 if group < 12 else 1
    requests = [(n, 1) for n in DECODE_CONTEXTS]
    _check(isa, requests, group * num_kv_heads, num_kv_heads, head_dim, 8, dtype, seed=group)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_seqs", [1, 2, 40])
def test_decodes_on_two_threads(isa, dtype, num_seqs) -> None:
    """SmolLM2's heads (9 and 3, head_dim 64, blocks of 16) on two threads: one or two
    sequences split into an item per kv head, 40 into whole-sequence items."""
    requests = [(1 + 37 * i % 300, 1) for i in range(num_seqs)]
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _check(isa, requests, 9, 3, 64, 16, dtype, seed=num_seqs, min_work_per_thread=0)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_tiles_of_one_query(isa, dtype) -> None:
    """A prefill's last tile of one query (17 and 33 queries: tiles of 16 + 1) runs on the
    decode path next to the tiles of 16 on the general one."""
    _check(isa, [(0, 17), (5, 33), (20, 1)], 8, 2, 64, 8, dtype)


# Gemma 2/3 layers: decodes of contexts inside, at and far past the window (tokens before it in
# whole blocks then), prefill chunks starting before / after the window's edge, tiles of 16 + 1.
WINDOWED = [(0, 1), (4, 1), (12, 1), (13, 1), (40, 1), (150, 1), (0, 13), (9, 30), (3, 2)]
WINDOWED += [(40, 17), (0, 33), (60, 1)]


def _poison_before_windows(b, window: int, block_size: int) -> None:
    """Every block wholly before the first query's window of each request becomes a spare
    NaN-filled block in the tables (what the KV manager's null block may hold): any read of it
    poisons the output."""
    used = {block for table in b.block_tables for block in table}
    nan_block = next(i for i in range(b.k_cache.shape[0]) if i not in used)
    b.k_cache[nan_block] = float("nan")
    b.v_cache[nan_block] = float("nan")
    md = b.metadata
    tables = md.block_tables.clone()
    for row, seq_len in enumerate(md.seq_lens_cpu):
        q0 = seq_len - (md.query_start_loc_cpu[row + 1] - md.query_start_loc_cpu[row])
        dead = max(0, q0 - window + 1) // block_size
        tables[row, :dead] = nan_block
        b.block_tables[row][:dead] = [nan_block] * dead
    md.block_tables = tables


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("window", "soft_cap"), [(5, None), (None, 0.8), (13, 1.5), (1, 30.0)])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(8, 2, 64), (4, 1, 72)])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_sliding_window_and_soft_cap_match_reference(
    isa, dtype, window, soft_cap, num_heads, num_kv_heads, head_dim, num_threads
) -> None:
    """The windowed entry point, decode and prefill paths, fused KV store included: equal to the
    reference with the same window and cap, blocks before each window never read, and really
    different from plain attention."""
    block_size = 4
    b = make_batch(
        WINDOWED,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        fill=float("nan"),
        seed=7,
    )
    if window is not None:
        _poison_before_windows(b, window, block_size)
    md = b.metadata
    scale = head_dim**-0.5 * 3  # scores of a few units: the soft caps bite
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out = native.paged_attention(
            _kernels(isa),
            b.q,
            b.k_cache,
            b.v_cache,
            md.block_tables,
            md.query_start_loc,
            md.seq_lens,
            scale,
            min_work_per_thread=0,
            k=b.k,
            v=b.v,
            slot_mapping=md.slot_mapping,
            sliding_window=window,
            logits_soft_cap=soft_cap,
        )
    finally:
        torch.set_num_threads(previous)
    args = (b.q, b.k_cache, b.v_cache, md.query_start_loc_cpu, md.seq_lens_cpu, b.block_tables)
    expected = paged_attention_reference(
        *args, scale, sliding_window=window, logits_soft_cap=soft_cap
    )
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])
    if window is None:  # the plain reference over the same cache differs
        plain = paged_attention_reference(*args, scale)
        assert not torch.allclose(plain, expected, atol=1e-2)


def test_windowed_entry_point_refuses_bad_values() -> None:
    b = make_batch([(3, 1)], num_heads=2, num_kv_heads=1, head_dim=16, block_size=4)
    md = b.metadata
    args = (b.q, b.k_cache, b.v_cache, md.block_tables, md.query_start_loc, md.seq_lens, 0.25)
    kernels = native.load_kernels()
    with pytest.raises(ValueError, match="sliding_window 0"):
        native.paged_attention(kernels, *args, sliding_window=0)
    with pytest.raises(ValueError, match="logits_soft_cap -1"):
        native.paged_attention(kernels, *args, logits_soft_cap=-1.0)


def _bits(cache: torch.Tensor) -> torch.Tensor:
    """The cache's bit patterns: NaN-filled slots compare equal to themselves."""
    return cache.view(torch.int16 if cache.dtype == torch.bfloat16 else torch.int32)


def _fused_kv(b, num_heads: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """b's k and v as the model hands them over: [T, Hkv, D] views of one fused qkv projection
    output (token stride (H + 2 Hkv) D)."""
    num_tokens, num_kv_heads, head_dim = b.k.shape
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    qkv = qkv.to(b.k.dtype)
    _, k, v = qkv.split([num_heads * head_dim, *[num_kv_heads * head_dim] * 2], dim=-1)
    return k.view(b.k.shape), v.view(b.v.shape)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 8), (8, 2, 80, 16), (6, 2, 96, 1), (4, 4, 128, 8)],
)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_kv_store_fused_into_attention(
    isa, dtype, num_heads, num_kv_heads, head_dim, block_size, num_threads
) -> None:
    """The step's K/V (strided views of the fused qkv) are written at their slots before the
    queries attend: the caches then hold exactly those rows there, and nothing else changed
    (the NaN fill of unused slots included); the output is the reference's over those caches.
    The batch's new tokens cross block boundaries; two threads split the store (forced)."""
    b = make_batch(
        MIXED,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        fill=float("nan"),
        seed=2,
    )
    md = b.metadata
    k, v = _fused_kv(b, num_heads, seed=3)
    assert not k.is_contiguous()
    k_expected, v_expected = b.k_cache.clone(), b.v_cache.clone()
    store_kv_reference(k, v, k_expected, v_expected, md.slot_mapping)
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out = native.paged_attention(
            _kernels(isa),
            b.q,
            b.k_cache,
            b.v_cache,
            md.block_tables,
            md.query_start_loc,
            md.seq_lens,
            head_dim**-0.5,
            min_work_per_thread=0,
            k=k,
            v=v,
            slot_mapping=md.slot_mapping,
        )
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(_bits(b.k_cache), _bits(k_expected))
    assert torch.equal(_bits(b.v_cache), _bits(v_expected))
    expected = paged_attention_reference(
        b.q,
        k_expected,
        v_expected,
        md.query_start_loc_cpu,
        md.seq_lens_cpu,
        b.block_tables,
        head_dim**-0.5,
    )
    torch.testing.assert_close(out.float(), expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kv_store_skips_padding_and_converts(dtype) -> None:
    """A slot < 0 (a padding token) writes nothing; contiguous k/v of another dtype are cast to
    the cache's."""
    b = make_batch(
        [(3, 1), (9, 1), (0, 4)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=4,
        dtype=dtype,
        fill=float("nan"),
    )
    md = b.metadata
    slots = md.slot_mapping.clone()
    slots[1] = -1
    k, v = b.k.double(), b.v.double()
    k_expected, v_expected = b.k_cache.clone(), b.v_cache.clone()
    store_kv_reference(k, v, k_expected, v_expected, slots)
    native.paged_attention(
        native.load_kernels(),
        b.q,
        b.k_cache,
        b.v_cache,
        md.block_tables,
        md.query_start_loc,
        md.seq_lens,
        0.2,
        k=k,
        v=v,
        slot_mapping=slots,
    )
    assert torch.equal(_bits(b.k_cache), _bits(k_expected))
    assert torch.equal(_bits(b.v_cache), _bits(v_expected))


def test_kv_store_slot_past_the_cache_is_refused_before_any_write() -> None:
    b = make_batch([(2, 1), (0, 3)], num_heads=2, num_kv_heads=1, head_dim=16, block_size=4)
    md = b.metadata
    slots = md.slot_mapping.clone()
    slots[-1] = b.k_cache.shape[0] * b.k_cache.shape[1]
    k_before, v_before = b.k_cache.clone(), b.v_cache.clone()
    with pytest.raises(IndexError, match="past the cache"):
        native.paged_attention(
            native.load_kernels(),
            b.q,
            b.k_cache,
            b.v_cache,
            md.block_tables,
            md.query_start_loc,
            md.seq_lens,
            0.25,
            k=b.k,
            v=b.v,
            slot_mapping=slots,
        )
    assert torch.equal(b.k_cache, k_before) and torch.equal(b.v_cache, v_before)


def test_paged_decode_wrapper() -> None:
    b = make_batch([(3, 1), (17, 1)], num_heads=4, num_kv_heads=2, head_dim=32, block_size=4)
    md = b.metadata
    store_kv_reference(b.k, b.v, b.k_cache, b.v_cache, md.slot_mapping)
    out = native.paged_decode(
        native.load_kernels(), b.q, b.k_cache, b.v_cache, md.block_tables, md.seq_lens, 0.2
    )
    expected = paged_attention_reference(
        b.q, b.k_cache, b.v_cache, md.query_start_loc_cpu, md.seq_lens_cpu, b.block_tables, 0.2
    )
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


def test_more_queries_than_context_is_refused() -> None:
    q = torch.randn(2, 2, 16)
    cache = torch.randn(4, 4, 2, 16)
    with pytest.raises(ValueError, match="more query tokens"):
        native.paged_attention(
            native.load_kernels(),
            q,
            cache,
            cache,
            torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([0, 2]),
            torch.tensor([1]),
            0.25,
        )


@pytest.mark.parametrize(
    ("q_dtype", "kv_dtype", "head_dim", "reason"),
    [
        (torch.float16, torch.float16, 64, "float16 is not supported"),
        (torch.bfloat16, torch.float32, 64, "float32 KV cache under torch.bfloat16"),
        (torch.float32, torch.float16, 64, "float16 KV cache"),
        (torch.bfloat16, torch.bfloat16, 1024, "head_dim 1024"),
    ],
)
def test_unsupported_reasons(q_dtype, kv_dtype, head_dim, reason) -> None:
    q = torch.zeros(1, 1, head_dim, dtype=q_dtype)
    cache = torch.zeros(1, 1, 1, head_dim, dtype=kv_dtype)
    assert reason in native.unsupported_reason(q, cache, head_dim)
    ok = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    assert native.unsupported_reason(ok, torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16), 64) is None
    # Caches the kernel reads beside q's dtype: bf16 under fp32 queries, int8 and fp8 codes.
    for q_dtype, kv_dtype in [
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.int8),
        (torch.float32, torch.float8_e4m3fn),
        (torch.bfloat16, torch.float8_e5m2),
    ]:
        q = torch.zeros(1, 1, 64, dtype=q_dtype)
        assert native.unsupported_reason(q, torch.zeros(1, 1, 1, 64, dtype=kv_dtype), 64) is None


# ---- ISA selection -----------------------------------------------------------------------------

# Every CPU with avx512_bf16 also has avx512_vnni, which that build uses (gguf_q8.c).
AVX512_BF16_FLAGS = "sse2 avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_vnni avx512_bf16"
AVX2_HOST = "sse2 avx2 fma f16c"


@pytest.fixture
def fresh_choice(monkeypatch):
    isa_mod._choose.cache_clear()
    yield monkeypatch
    isa_mod._choose.cache_clear()


@pytest.mark.parametrize(
    ("flags", "forced", "best"),
    [
        (AVX512_BF16_FLAGS, None, "avx512_bf16"),
        (AVX512_BF16_FLAGS, "avx2", "avx2"),
        (AVX512_BF16_FLAGS, "AVX512", "avx512"),
        (AVX512_BF16_FLAGS.replace(" avx512_bf16", ""), None, "avx512"),
        (AVX512_BF16_FLAGS.replace(" avx512_vnni", ""), None, "avx512"),
        ("sse2 avx2 fma f16c", None, "avx2"),
        ("sse2 avx", None, "generic"),
        ("", "generic", "generic"),
    ],
)
def test_isa_follows_the_flags_and_the_override(fresh_choice, flags, forced, best) -> None:
    fresh_choice.setenv(isa_mod.CPU_FLAGS_ENV, flags)
    if forced is None:
        fresh_choice.delenv(isa_mod.CPU_ISA_ENV, raising=False)
    else:
        fresh_choice.setenv(isa_mod.CPU_ISA_ENV, forced)
    chosen = isa_mod.choose_isas()
    assert chosen[0].name == best
    assert chosen[-1].name == "generic"  # lower paths remain as build fallbacks


def test_forcing_an_isa_the_cpu_lacks_warns(fresh_choice, caplog) -> None:
    fresh_choice.setenv(isa_mod.CPU_FLAGS_ENV, "sse2 avx2 fma f16c")
    fresh_choice.setenv(isa_mod.CPU_ISA_ENV, "avx512_bf16")
    with caplog.at_level(logging.WARNING):
        assert isa_mod.choose_isas()[0].name == "avx2"
    assert "lacks" in caplog.text and "avx512_bf16" in caplog.text


def test_faked_flags_never_build_what_the_hardware_lacks(fresh_choice, caplog) -> None:
    """WICK_CPU_FLAGS naming AVX-512 BF16 on an AVX2-only CPU: the choice follows the faked
    flags, the build the hardware's (an avx512 build died with SIGILL at its first call)."""
    fresh_choice.setenv(isa_mod.CPU_FLAGS_ENV, AVX512_BF16_FLAGS)
    fresh_choice.delenv(isa_mod.CPU_ISA_ENV, raising=False)
    fresh_choice.setattr(isa_mod, "read_cpu_flags", lambda path: frozenset(AVX2_HOST.split()))
    isa_mod._warn_lacking.cache_clear()
    assert isa_mod.choose_isas()[0].name == "avx512_bf16"
    with caplog.at_level(logging.WARNING):
        built = isa_mod.hardware_isas(isa_mod.choose_isas())
    assert [i.name for i in built] == ["avx2", "generic"]
    assert "WICK_CPU_FLAGS names flags this CPU lacks" in caplog.text and "avx2" in caplog.text
    # Unreadable hardware flags remove nothing; a runnable choice is kept as it is.
    fresh_choice.setattr(isa_mod, "read_cpu_flags", lambda path: frozenset())
    assert isa_mod.hardware_isas(isa_mod.choose_isas())[0].name == "avx512_bf16"
    fresh_choice.setenv(isa_mod.CPU_FLAGS_ENV, AVX2_HOST)
    fresh_choice.setattr(
        isa_mod, "read_cpu_flags", lambda path: frozenset(AVX512_BF16_FLAGS.split())
    )
    assert [i.name for i in isa_mod.hardware_isas(isa_mod.choose_isas())] == ["avx2", "generic"]


def test_forced_isa_is_what_loads(fresh_choice) -> None:
    fresh_choice.setenv(isa_mod.CPU_ISA_ENV, "avx2")
    if "avx2" not in RUNNABLE:
        pytest.skip("this CPU has no AVX2")
    native.clear_cache()
    try:
        kernels = native.load_kernels()
        assert kernels is not None and kernels.isa == "avx2"
    finally:
        native.clear_cache()


def test_builds_are_cached_per_isa(tmp_path, monkeypatch) -> None:
    """Two ISAs' builds side by side in one cache, each loaded again without a rebuild. The
    session's own build (this CPU's best ISA) is copied in when it is one of the two, so that
    one build runs here, not two (each is most of a minute on two cores)."""
    import shutil

    from model_server.kernels.cpu.gemm import default_kernels

    own = default_kernels()
    (tmp_path / "kernels").mkdir()
    if own is not None and own.isa in RUNNABLE[-2:]:
        shutil.copy2(own.lib._name, tmp_path / "kernels")
    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path))
    native.clear_cache()
    try:
        for isa in RUNNABLE[-2:]:
            assert native.load_kernels(isa) is not None
        built = sorted(p.name for p in (tmp_path / "kernels").glob("wick_cpu-*.so"))
        assert [name.split("-")[1] for name in built] == sorted(RUNNABLE[-2:])
        mtimes = [(tmp_path / "kernels" / n).stat().st_mtime_ns for n in built]
        native.clear_cache()
        for isa in RUNNABLE[-2:]:
            assert native.load_kernels(isa) is not None
        assert [(tmp_path / "kernels" / n).stat().st_mtime_ns for n in built] == mtimes
    finally:
        native.clear_cache()


def test_the_build_compiles_every_source_apart_and_at_once_then_links_them(
    tmp_path, monkeypatch, caplog
) -> None:
    """One compiler call per C file, several running at a time where this process has CPUs for
    them, then one link of all the objects; a failing link is reported, nothing is cached."""
    import os

    log = tmp_path / "calls"
    fake_cc = tmp_path / "cc"
    # Compiles write an empty object after 0.3 s (and log their start and end); links fail.
    fake_cc.write_text(
        "#!/bin/sh\n"
        'case "$*" in *" -shared "*) echo "ld: refused for the test" >&2; exit 1;; esac\n'
        'out=""; prev=""; for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done\n'
        f'echo "start $(date +%s.%N) $*" >> {log}\n'
        "sleep 0.3\n"
        f'echo "end $(date +%s.%N)" >> {log}\n'
        ': > "$out"\n'
    )
    fake_cc.chmod(0o755)
    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_compiler", lambda: str(fake_cc))
    monkeypatch.setattr(native, "_THREADING", ((),))  # one attempt per cache directory
    native.clear_cache()
    try:
        with caplog.at_level(logging.WARNING):
            assert native.load_kernels("generic") is None
    finally:
        native.clear_cache()
    assert "ld: refused for the test" in caplog.text
    assert not list((tmp_path / "cache" / "kernels").glob("*.so"))
    lines = log.read_text().splitlines()
    compiles = [line.split(" ", 2)[2] for line in lines if line.startswith("start")]
    sources = [arg for c in compiles for arg in c.split() if arg.endswith(".c")]
    # One attempt (a failed link is not retried in the next cache directory): every source
    # once, in a call of its own.
    assert sorted(sources) == sorted(str(s) for s in native.SOURCES)
    assert len(compiles) == len(native.SOURCES) and all(" -c " in c for c in compiles)
    # Started in SOURCES' order (the longest compiles first): the first `workers` together.
    workers = min(len(native.SOURCES), len(os.sched_getaffinity(0)))
    first = {c.split(" -c ")[1].split()[0] for c in compiles[:workers]}
    assert first == {str(s) for s in native.SOURCES[:workers]}
    if workers >= 2:
        running = peak = 0
        for line in sorted(lines, key=lambda line: float(line.split()[1])):
            running += 1 if line.startswith("start") else -1
            peak = max(peak, running)
        assert peak >= 2


def test_failed_isa_build_falls_back_to_a_lower_path(tmp_path, monkeypatch, caplog) -> None:
    """A compiler that rejects the AVX-512 flags (an old one) still gets the AVX2 build."""
    if "avx512" not in RUNNABLE:
        pytest.skip("needs an AVX-512 CPU")
    import shutil

    real = shutil.which("gcc") or shutil.which("cc")
    fake_cc = tmp_path / "cc"
    fake_cc.write_text(
        f'#!/bin/sh\ncase "$*" in *avx512*) echo "cc: unknown -mavx512f" >&2; exit 1;; esac\n'
        f'exec {real} "$@"\n'
    )
    fake_cc.chmod(0o755)
    monkeypatch.setenv("WICK_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("WICK_CPU_ISA", raising=False)  # the automatic choice falls back
    monkeypatch.setattr(native, "_compiler", lambda: str(fake_cc))
    native.clear_cache()
    try:
        with caplog.at_level(logging.WARNING):
            kernels = native.load_kernels()
        assert kernels is not None and kernels.isa == "avx2"
        assert "using avx2" in caplog.text
    finally:
        native.clear_cache()
