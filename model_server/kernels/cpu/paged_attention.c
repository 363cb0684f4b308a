/* Paged attention for CPUs, decodes and prefills in one call, read straight from the paged KV
 * cache (no gather into a padded copy), grouped-query heads sharing each K/V row.
 *
 * Shapes (contiguous; `dtype` 0: q, k, v and out fp32, 1: bf16 stored as uint16; the caches in
 * format `kv_format` (wick_kv.h): q's dtype, bf16 under an fp32 q, or int8 / fp8 codes with
 * float32 scales k/v_scales [num_blocks, block_size, num_kv_heads], NULL for float caches):
 *   q               [T, num_heads, head_dim]            the step's query tokens, flattened
 *   k/v_cache       [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables    [num_seqs, >= ceil(seq_len / block_size)] int32, row stride `bt_stride`
 *   query_start_loc [num_seqs + 1] int32: sequence s owns query rows [qsl[s], qsl[s + 1])
 *   seq_lens        [num_seqs] int32: context after this step, >= its query count
 *   out             [T, num_heads, head_dim], same dtype as q
 *   k, v            [T, num_kv_heads, head_dim] this step's keys and values (or NULL: already
 *                   stored), each token's row contiguous, tokens `k_stride` / `v_stride`
 *                   elements apart (views of the fused qkv projection)
 *   slot_mapping    [T] int64: the cache slot (block * block_size + offset) of token t's K/V;
 *                   < 0 skips the token (padding)
 * The step's K/V are written into the caches first (the KV-cache store of every attention
 * backend), then every query attends.
 * Sequence s's j-th query sits at position ctx + j (ctx = seq_len - query_len) and attends to
 * positions [0, ctx + j] (causal; its own K/V must already be in the cache). Query head h uses
 * KV head h / (num_heads / num_kv_heads). Accumulation is fp32 throughout; bf16 outputs are
 * rounded to nearest even, as torch does.
 * wick_paged_attention_windowed adds a sliding window W (query at position p sees (p - W, p];
 * blocks wholly before it are never read) and a logit soft cap c (scaled scores s become
 * c * tanh(s / c)): Gemma 2/3 (see "Sliding windows and logit soft-capping").
 *
 * Work items are (sequence, tile of <= QUERY_TILE queries, range of kv heads): all of a
 * sequence's kv heads when there are enough tiles to keep every thread busy, so each token's
 * K/V row (num_kv_heads * head_dim values) is read in one contiguous run; one kv head per item
 * otherwise. An item of one query (every decode) runs `attend_decode` (wick_attend.h, "Decodes"); a
 * prefill tile runs `attend` ("Prefill tiles"), which converts the context's K/V rows of a kv
 * head to fp32 once and multiplies them against all of the tile's query rows of that head in
 * register blocks.
 *
 * The items' code is in wick_attend.h; this file splits a call into items and dispatches each
 * to a compiled copy of it (compiled in the paged_attention_*.c files, see there).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "wick_attend.h"
#include "wick_entry.h"

/* Which build this is, for the loader's log and the tests. */
const char *wick_isa(void) {
#if defined(__AVX512BF16__)
  return "avx512_bf16";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "generic";
#endif
}

/* Per-thread buffers, grown as needed (Scratch: wick_attend.h). */
static int grow(float **buf, int64_t *cap, int64_t need) {
  if (need <= *cap) return 0;
  free(*buf);
  *buf = (float *)malloc(sizeof(float) * (size_t)need);
  *cap = *buf == NULL ? 0 : need;
  return *buf == NULL ? -1 : 0;
}

/* Scratch of a decode item (prefill tiles take reserve_tile): score rows padded to whole chunks
 * of VW tokens, head rows to whole vectors (head_dim rounded up to VW values). */
static int reserve(Scratch *s, int64_t rows, int64_t len, int64_t head_dim) {
  const int64_t dp = round_up(head_dim, VW);
  return grow(&s->scores, &s->scores_cap, rows * round_up(len, VW)) |
         grow(&s->q, &s->q_cap, rows * dp) | grow(&s->acc, &s->acc_cap, rows * dp) |
         grow(&s->stats, &s->stats_cap, 2 * rows);
}

/* Scratch of a prefill tile item (the layouts of wick_attend.h's "Prefill tiles"); returns 0, or
 * -1 when out of memory. */
static int reserve_tile(Scratch *s, const int64_t rows, const int64_t len,
                        const int64_t head_dim) {
  const int64_t dp = round_up(head_dim, VW), rp = round_up(rows, VW);
  const int64_t padded = round_up(len, QK_TB);
  return grow(&s->scores, &s->scores_cap, padded * rp) | grow(&s->q, &s->q_cap, head_dim * rp) |
         grow(&s->acc, &s->acc_cap, rp * dp) | grow(&s->kbuf, &s->kbuf_cap, padded * dp) |
         grow(&s->vbuf, &s->vbuf_cap, padded * dp) | grow(&s->stats, &s->stats_cap, rp);
}

/* A work item to its copy of attend_item (wick_attend.h's lists). */
#define QUANT_ROW(Q)                                                       \
  {{attend_##Q##_i8_64, attend_##Q##_i8_128, attend_##Q##_i8_any},       \
   {attend_##Q##_e4m3_64, attend_##Q##_e4m3_any, attend_##Q##_e4m3_any}, \
   {attend_##Q##_e5m2_64, attend_##Q##_e5m2_any, attend_##Q##_e5m2_any}}
/* [is_bf16][kv - KV_I8][head_dim 64, 128, other]. */
static const ItemFn QUANT_ITEMS[2][3][3] = {QUANT_ROW(f32), QUANT_ROW(bf16)};
#undef QUANT_ROW

static void attend_any(const int head_dim, const int is_bf16, const int kv, const Geometry *geo,
                       int ctx, int j0, int nq, int kh0, int nkh, const void *q,
                       const void *k_cache, const void *v_cache, const int32_t *table, void *out,
                       Scratch *scratch) {
  if (kv != is_bf16) { /* wick_paged_attention refused the other pairs */
    if (!KV_QUANT(kv)) {
      attend_f32_kvbf16_any(head_dim, ATTEND_ARGS);
      return;
    }
    QUANT_ITEMS[is_bf16][kv - KV_I8][head_dim == 64 ? 0 : head_dim == 128 ? 1 : 2](head_dim,
                                                                                 ATTEND_ARGS);
    return;
  }
#define CASE(D)                                                        \
  case D:                                                              \
    (is_bf16 ? attend_bf16_##D : attend_f32_##D)(head_dim, ATTEND_ARGS); \
    return;
  switch (head_dim) {
    CASE(64)
    CASE(80)
    CASE(96)
    CASE(128)
    default:
      (is_bf16 ? attend_bf16_any : attend_f32_any)(head_dim, ATTEND_ARGS);
  }
#undef CASE
}

/* Token t's K and V rows (`row_bytes` each, tokens `k_step` / `v_step` bytes apart) into slot
 * slot_mapping[t] of the caches, whose slots are rows of the same size. */
static void store_token(const int64_t t, const size_t row_bytes, const char *k, const char *v,
                        const int64_t k_step, const int64_t v_step,
                        const int64_t *slot_mapping, char *k_cache, char *v_cache) {
  const int64_t slot = slot_mapping[t];
  if (slot < 0) return;
  memcpy(k_cache + slot * (int64_t)row_bytes, k + t * k_step, row_bytes);
  memcpy(v_cache + slot * (int64_t)row_bytes, v + t * v_step, row_bytes);
}

/* Token t's K and V (num_kv_heads rows of head_dim values each, in q's dtype, tokens k_step /
 * v_step elements apart) into slot slot_mapping[t] of the caches in format kv: quantized with
 * their scales (each row's own, or `fixed_scale` > 0 for every row), converted (fp32 -> bf16
 * cache), or copied. */
static void store_token_kv(const int64_t t, const int is_bf16, const int kv, const int num_kv_heads,
                           const int head_dim, const void *k, const void *v, const int64_t k_step,
                           const int64_t v_step, const int64_t *slot_mapping, void *k_cache,
                           void *v_cache, float *k_scales, float *v_scales,
                           const float fixed_scale) {
  const int64_t slot = slot_mapping[t];
  if (slot < 0) return;
  const size_t in_elem = is_bf16 ? sizeof(bf16_t) : sizeof(float);
  const int64_t row0 = slot * num_kv_heads; /* the slot's first (row, scale) index */
  for (int side = 0; side < 2; side++) {
    const char *x = (const char *)(side ? v : k) + t * (side ? v_step : k_step) * (int64_t)in_elem;
    void *cache = side ? v_cache : k_cache;
    float *scales = side ? v_scales : k_scales;
    for (int h = 0; h < num_kv_heads; h++) {
      const char *xr = x + (int64_t)h * head_dim * (int64_t)in_elem;
      const int64_t at = (row0 + h) * head_dim;
      if (KV_QUANT(kv)) {
        quantize_row(xr, is_bf16, kv, head_dim, fixed_scale, (uint8_t *)cache + at,
                     scales + row0 + h);
      } else if (kv == is_bf16) {
        memcpy((char *)cache + at * (int64_t)in_elem, xr, (size_t)head_dim * in_elem);
      } else { /* fp32 values into a bf16 cache */
        for (int d = 0; d < head_dim; d++)
          ((bf16_t *)cache)[at + d] = f32_to_bf16(((const float *)xr)[d]);
      }
    }
  }
}

/* `k` NULL: nothing to store (the caches already hold the step's K/V). `kv_format`: the caches'
 * format (wick_kv.h; `dtype` when they hold q's dtype), with `k_scales` / `v_scales` for the
 * quantized ones. `num_slots`: the caches' num_blocks * block_size. `min_work_per_thread`:
 * multiply-adds that justify one more thread (0: use all of them). Returns 0; -1 when a scratch
 * buffer could not be allocated (the output is then partial); -2 on inconsistent lengths (a
 * sequence with more queries than context), -3 on a slot past the caches and -4 on a cache
 * format the query's dtype cannot use (or quantized without scales), all before any work. */
static int paged_attention(int dtype, const void *q, void *k_cache, void *v_cache, const void *k,
                           const void *v, int64_t k_stride, int64_t v_stride,
                           const int64_t *slot_mapping, int64_t num_slots,
                           const int32_t *block_tables, int64_t bt_stride,
                           const int32_t *query_start_loc, const int32_t *seq_lens, void *out,
                           int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                           int block_size, float scale, int num_threads,
                           int64_t min_work_per_thread, int kv_format, float *k_scales,
                           float *v_scales, int window, float soft_cap, float kv_fixed_scale) {
  const Geometry geo = {
      .num_heads = num_heads,
      .group = num_heads / num_kv_heads,
      .block_size = block_size,
      .token_stride = (int64_t)num_kv_heads * head_dim,
      .block_stride = (int64_t)block_size * num_kv_heads * head_dim,
      .scale = scale,
      .window = window > 0 ? window : 0,
      .soft_cap = soft_cap > 0.f ? soft_cap : 0.f,
      .k_scales = k_scales,
      .v_scales = v_scales,
  };
  const int is_bf16 = dtype == 1;
  const size_t elem = is_bf16 ? sizeof(bf16_t) : sizeof(float);
  const int kv = kv_format;
  if (kv < KV_F32 || kv > KV_E5M2 || (is_bf16 && kv == KV_F32) ||
      (KV_QUANT(kv) && (k_scales == NULL || v_scales == NULL)) || head_dim > 512)
    return -4;

  const int64_t num_tokens = num_seqs > 0 ? query_start_loc[num_seqs] : 0;
  if (k != NULL)
    for (int64_t t = 0; t < num_tokens; t++)
      if (slot_mapping[t] >= num_slots) return -3;

  /* Tiles: (sequence, first query) pairs, QUERY_TILE queries each (one for a decode). */
  int64_t num_tiles = 0;
  for (int s = 0; s < num_seqs; s++) {
    const int qlen = query_start_loc[s + 1] - query_start_loc[s];
    if (qlen < 0 || qlen > seq_lens[s]) return -2;
    num_tiles += (qlen + QUERY_TILE - 1) / QUERY_TILE;
  }
  int32_t *tile_seq = (int32_t *)malloc(sizeof(int32_t) * (size_t)(num_tiles + 1));
  int32_t *tile_j0 = (int32_t *)malloc(sizeof(int32_t) * (size_t)(num_tiles + 1));
  if (tile_seq == NULL || tile_j0 == NULL) {
    free(tile_seq);
    free(tile_j0);
    return -1;
  }
  int64_t n = 0;
  for (int s = 0; s < num_seqs; s++) {
    const int qlen = query_start_loc[s + 1] - query_start_loc[s];
    for (int j0 = 0; j0 < qlen; j0 += QUERY_TILE) {
      tile_seq[n] = s;
      tile_j0[n++] = j0;
    }
  }

  /* Threads: no more than the work keeps busy (a batch-1 decode is ~10^5 multiply-adds, tens
   * of microseconds: one thread). Work counts Q.K and P.V multiply-adds, causal prefill
   * triangles halved. */
  int64_t work = 0;
  for (int s = 0; s < num_seqs; s++) {
    const int64_t qlen = query_start_loc[s + 1] - query_start_loc[s];
    const int64_t seen = seq_lens[s] - qlen / 2; /* keys per query, on average */
    work += qlen * (geo.window > 0 && geo.window < seen ? geo.window : seen);
  }
  work *= 2 * (int64_t)num_heads * head_dim;
  num_threads = threads_for(work, min_work_per_thread, num_threads);
  const size_t kv_row_bytes = (size_t)num_kv_heads * head_dim * elem;

  /* Whole sequences' kv heads per item once there are a few tiles per thread. */
  const int heads_per_item = num_tiles >= 4 * num_threads ? num_kv_heads : 1;
  const int items_per_tile = num_kv_heads / heads_per_item;
  const int64_t num_items = num_tiles * items_per_tile;
  int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    Scratch scratch = {0};
    /* The store ends in the loop's barrier: every token's K/V is in place before any item
     * reads the caches. */
    if (k != NULL) {
#pragma omp for schedule(static)
      for (int64_t t = 0; t < num_tokens; t++) {
        if (kv == is_bf16)
          store_token(t, kv_row_bytes, (const char *)k, (const char *)v,
                      k_stride * (int64_t)elem, v_stride * (int64_t)elem, slot_mapping,
                      (char *)k_cache, (char *)v_cache);
        else
          store_token_kv(t, is_bf16, kv, num_kv_heads, head_dim, k, v, k_stride, v_stride,
                         slot_mapping, k_cache, v_cache, k_scales, v_scales, kv_fixed_scale);
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; item++) {
      const int64_t tile = item / items_per_tile;
      const int kh0 = (int)(item % items_per_tile) * heads_per_item;
      const int s = tile_seq[tile], j0 = tile_j0[tile];
      const int qlen = query_start_loc[s + 1] - query_start_loc[s];
      const int nq = qlen - j0 < QUERY_TILE ? qlen - j0 : QUERY_TILE;
      const int ctx = seq_lens[s] - qlen;
      const int64_t rows = (int64_t)heads_per_item * nq * geo.group;
      const int reserved = nq == 1 ? reserve(&scratch, rows, ctx + j0 + nq, head_dim)
                                   : reserve_tile(&scratch, (int64_t)nq * geo.group,
                                                  ctx + j0 + nq, head_dim);
      if (reserved != 0) {
#pragma omp atomic write
        failed = 1;
        continue;
      }
      const int64_t first = (int64_t)query_start_loc[s] * num_heads * head_dim;
      attend_any(head_dim, is_bf16, kv, &geo, ctx, j0, nq, kh0, heads_per_item,
                 (const char *)q + first * elem, k_cache, v_cache,
                 block_tables + (int64_t)s * bt_stride, (char *)out + first * elem, &scratch);
    }
    free(scratch.scores);
    free(scratch.q);
    free(scratch.acc);
    free(scratch.stats);
    free(scratch.kbuf);
    free(scratch.vbuf);
  }
  free(tile_seq);
  free(tile_j0);
  return failed ? -1 : 0;
}

int wick_paged_attention(int dtype, const void *q, void *k_cache, void *v_cache, const void *k,
                         const void *v, int64_t k_stride, int64_t v_stride,
                         const int64_t *slot_mapping, int64_t num_slots,
                         const int32_t *block_tables, int64_t bt_stride,
                         const int32_t *query_start_loc, const int32_t *seq_lens, void *out,
                         int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                         int block_size, float scale, int num_threads,
                         int64_t min_work_per_thread, int kv_format, float *k_scales,
                         float *v_scales) {
  return paged_attention(dtype, q, k_cache, v_cache, k, v, k_stride, v_stride, slot_mapping,
                         num_slots, block_tables, bt_stride, query_start_loc, seq_lens, out,
                         num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale,
                         num_threads, min_work_per_thread, kv_format, k_scales, v_scales, 0, 0.f,
                         0.f);
}

/* wick_paged_attention with a sliding window (`window` > 0: position p sees keys in (p - W, p];
 * the blocks wholly before every query's window are never read), a logit soft cap
 * (`soft_cap` > 0: scaled scores s become c * tanh(s / c)) and, for quantized caches, a static
 * scale every stored K/V row takes (`kv_fixed_scale` > 0, a calibration file's per-layer
 * scale) instead of its own; 0 turns each off. */
int wick_paged_attention_windowed(int dtype, const void *q, void *k_cache, void *v_cache,
                                  const void *k, const void *v, int64_t k_stride,
                                  int64_t v_stride, const int64_t *slot_mapping,
                                  int64_t num_slots, const int32_t *block_tables,
                                  int64_t bt_stride, const int32_t *query_start_loc,
                                  const int32_t *seq_lens, void *out, int num_seqs,
                                  int num_heads, int num_kv_heads, int head_dim, int block_size,
                                  float scale, int num_threads, int64_t min_work_per_thread,
                                  int kv_format, float *k_scales, float *v_scales, int window,
                                  float soft_cap, float kv_fixed_scale) {
  return paged_attention(dtype, q, k_cache, v_cache, k, v, k_stride, v_stride, slot_mapping,
                         num_slots, block_tables, bt_stride, query_start_loc, seq_lens, out,
                         num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale,
                         num_threads, min_work_per_thread, kv_format, k_scales, v_scales, window,
                         soft_cap, kv_fixed_scale);
}
