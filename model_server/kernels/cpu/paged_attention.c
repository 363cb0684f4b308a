/* Paged attention for CPUs, decodes and prefills in one call, read straight from the paged KV
 * cache (no gather into a padded copy), grouped-query heads sharing each K/V row.
 *
 * Shapes (contiguous; `dtype` 0: every tensor fp32, 1: every tensor bf16 stored as uint16):
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
 *
 * Work items are (sequence, tile of <= QUERY_TILE queries, range of kv heads): all of a
 * sequence's kv heads when there are enough tiles to keep every thread busy, so each token's
 * K/V row (num_kv_heads * head_dim values) is read in one contiguous run; one kv head per item
 * otherwise. An item streams its K rows once into a scores buffer (every query row of the tile
 * and the group reuses a K row while it is in L1), takes an exact softmax per row, then streams
 * its V rows once. A decode is a tile of one query.
 *
 * Vector paths: this file is compiled once per ISA by kernels/cpu/native.py with explicit -m
 * flags (no -march=native), and the loops below are written for the auto-vectorizer
 * (`omp simd`, -fopenmp-simd): bf16 -> fp32 is a 16-bit left shift of the bits, so AVX2 and
 * AVX-512 both vectorize it (vpmovzxwd + vpslld). With AVX512-BF16 (__AVX512BF16__) and
 * -DWICK_VDPBF16PS, Q.K on bf16 runs on vdpbf16ps instead (off by default: see dot_bf16). Built with -fno-strict-aliasing: the bf16 shifts write floats through uint32_t.
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "wick_cpu.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#define QUERY_TILE 16 /* queries per prefill work item: K/V rows are reused this many times */

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

/* One cached K or V row as fp32: in place for an fp32 cache; converted into `buf` for bf16
 * (once per row, then reused by every query row of the work item). */
static inline const float *cache_row(const void *cache, const int64_t at, const int is_bf16,
                                     float *restrict buf, const int head_dim) {
  if (!is_bf16) return (const float *)cache + at;
  bf16_to_f32_row((const bf16_t *)cache + at, buf, 1.f, head_dim);
  return buf;
}

/* Off by default: with Q.K on vdpbf16ps, SmolLM2-135M in bf16 on a Zen 4 EPYC answered
 * "What is the capital of France?" with gibberish, while the shift-conversion path (the same
 * build without it) and the torch backend answer "Paris", although the kernel tests against the
 * PyTorch reference pass on both. Until that is understood, -DWICK_VDPBF16PS turns it on. */
#if defined(__AVX512BF16__) && defined(WICK_VDPBF16PS)
/* sum_d a[d] * b[d] over bf16 rows on vdpbf16ps (pairs of products added into fp32 lanes); the
 * tail (head_dim not a multiple of 32) is loaded masked, its missing lanes zero. */
static inline float dot_bf16(const bf16_t *a, const bf16_t *b, const int n) {
  __m512 acc = _mm512_setzero_ps();
  int d = 0;
  for (; d + 32 <= n; d += 32)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a + d),
                           (__m512bh)_mm512_loadu_si512(b + d));
  if (d < n) {
    const __mmask32 m = (__mmask32)((1ull << (n - d)) - 1);
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(m, a + d),
                           (__m512bh)_mm512_maskz_loadu_epi16(m, b + d));
  }
  return _mm512_reduce_add_ps(acc);
}
#define HAVE_DOT_BF16 1
#else
#define HAVE_DOT_BF16 0
#endif

/* Geometry shared by every work item of one call. Strides count elements, not bytes. */
typedef struct {
  int num_heads;
  int group; /* query heads per kv head */
  int block_size;
  int64_t token_stride; /* between consecutive tokens of a block: num_kv_heads * head_dim */
  int64_t block_stride; /* between blocks: block_size * token_stride */
  float scale;
} Geometry;

/* Per-thread buffers, grown as needed. Rows are the item's query rows, ordered
 * (kv head, query, head in group): row r = (kk * nq + jj) * group + g. */
typedef struct {
  float *scores; /* [rows, len]: scores, then probabilities (row r valid up to its vis) */
  float *q;      /* [rows, head_dim]: scaled fp32 queries */
  float *acc;    /* [rows, head_dim]: P V accumulators */
  float *row;    /* [head_dim]: one K or V row converted to fp32 */
  float *stats;  /* [2 * rows]: row max, then 1 / row sum */
  int64_t scores_cap, q_cap, acc_cap, row_cap, stats_cap;
} Scratch;

static int grow(float **buf, int64_t *cap, int64_t need) {
  if (need <= *cap) return 0;
  free(*buf);
  *buf = (float *)malloc(sizeof(float) * (size_t)need);
  *cap = *buf == NULL ? 0 : need;
  return *buf == NULL ? -1 : 0;
}

static int reserve(Scratch *s, int64_t rows, int64_t len, int64_t head_dim) {
  return grow(&s->scores, &s->scores_cap, rows * len) |
         grow(&s->q, &s->q_cap, rows * head_dim) | grow(&s->acc, &s->acc_cap, rows * head_dim) |
         grow(&s->row, &s->row_cap, head_dim) | grow(&s->stats, &s->stats_cap, 2 * rows);
}

/* One work item: queries [j0, j0 + nq) of a sequence whose first query sits at position ctx,
 * kv heads [kh0, kh0 + nkh). `q` and `out` point at the sequence's first query row; `table` at
 * its block table row. `is_bf16` and `head_dim` are compile-time constants after inlining (one
 * copy per dtype and common head_dim: constant trip counts unroll into registers). */
static inline __attribute__((always_inline)) void attend(
    const int head_dim, const int is_bf16, const Geometry *geo, const int ctx, const int j0,
    const int nq, const int kh0, const int nkh, const void *restrict q,
    const void *restrict k_cache, const void *restrict v_cache, const int32_t *restrict table,
    void *restrict out, Scratch *scratch) {
  const int group = geo->group;
  const int rows = nkh * nq * group;
  const int len = ctx + j0 + nq; /* tokens the last query of the tile sees */
  const int num_blocks = (len + geo->block_size - 1) / geo->block_size;
  /* With vdpbf16ps, Q.K reads the bf16 query and key rows as they are (scaled afterwards). */
  const int dp = is_bf16 && HAVE_DOT_BF16;
  float *restrict scores = scratch->scores;
  float *restrict qf = scratch->q;
  float *restrict acc = scratch->acc;
  float *restrict kvrow = scratch->row;
  float *restrict row_max = scratch->stats;
  float *restrict inv_sum = scratch->stats + rows;

  /* Query rows (scaled, fp32) of the item, in row order. */
  for (int kk = 0; kk < nkh; kk++)
    for (int jj = 0; jj < nq; jj++)
      for (int g = 0; g < group; g++) {
        const int r = (kk * nq + jj) * group + g;
        const int64_t src = ((int64_t)(j0 + jj) * geo->num_heads + (kh0 + kk) * group + g) *
                            head_dim;
        float *dst = qf + (int64_t)r * head_dim;
        if (is_bf16) {
          if (!dp) bf16_to_f32_row((const bf16_t *)q + src, dst, geo->scale, head_dim);
        } else {
          const float *qs = (const float *)q + src;
#pragma omp simd
          for (int d = 0; d < head_dim; d++) dst[d] = qs[d] * geo->scale;
        }
        row_max[r] = -FLT_MAX;
      }

  /* Q K^T, block by block (no division per token). Token t is seen by the tile's queries
   * jj >= t - ctx - j0 (all of them for cached tokens), so each token starts at row jj_lo. */
  for (int b = 0; b < num_blocks; b++) {
    const int t0 = b * geo->block_size;
    const int n = len - t0 < geo->block_size ? len - t0 : geo->block_size;
    for (int o = 0; o < n; o++) {
      const int t = t0 + o;
      const int jj_lo = t - ctx - j0 > 0 ? t - ctx - j0 : 0;
      const int64_t at = (int64_t)table[b] * geo->block_stride + (int64_t)o * geo->token_stride;
      for (int kk = 0; kk < nkh; kk++) {
        const int64_t kat = at + (int64_t)(kh0 + kk) * head_dim;
        /* With vdpbf16ps the bf16 row is read as it is: nothing to convert. */
        const float *k = dp ? NULL : cache_row(k_cache, kat, is_bf16, kvrow, head_dim);
        for (int jj = jj_lo; jj < nq; jj++)
          for (int g = 0; g < group; g++) {
            const int r = (kk * nq + jj) * group + g;
            float dot = 0.f;
#if HAVE_DOT_BF16
            if (dp) {
              const int64_t qat =
                  ((int64_t)(j0 + jj) * geo->num_heads + (kh0 + kk) * group + g) * head_dim;
              dot = dot_bf16((const bf16_t *)q + qat, (const bf16_t *)k_cache + kat, head_dim) *
                    geo->scale;
            } else
#endif
            {
              const float *qr = qf + (int64_t)r * head_dim;
#pragma omp simd reduction(+ : dot)
              for (int d = 0; d < head_dim; d++) dot += qr[d] * k[d];
            }
            scores[(int64_t)r * len + t] = dot;
            if (dot > row_max[r]) row_max[r] = dot;
          }
      }
    }
  }

  /* Exact softmax per row over the positions it sees: [0, ctx + j0 + jj]. */
  for (int r = 0; r < rows; r++) {
    const int vis = ctx + j0 + (r / group) % nq + 1;
    float *row = scores + (int64_t)r * len;
    const float mx = row_max[r];
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < vis; t++) {
      row[t] = exp_nonpositive(row[t] - mx);
      sum += row[t];
    }
    inv_sum[r] = 1.f / sum;
  }

  /* P V in the same order; the accumulators (rows * head_dim floats) stay in L1/L2. */
  memset(acc, 0, sizeof(float) * (size_t)rows * head_dim);
  for (int b = 0; b < num_blocks; b++) {
    const int t0 = b * geo->block_size;
    const int n = len - t0 < geo->block_size ? len - t0 : geo->block_size;
    for (int o = 0; o < n; o++) {
      const int t = t0 + o;
      const int jj_lo = t - ctx - j0 > 0 ? t - ctx - j0 : 0;
      const int64_t at = (int64_t)table[b] * geo->block_stride + (int64_t)o * geo->token_stride;
      for (int kk = 0; kk < nkh; kk++) {
        const int64_t vat = at + (int64_t)(kh0 + kk) * head_dim;
        const float *v = cache_row(v_cache, vat, is_bf16, kvrow, head_dim);
        for (int jj = jj_lo; jj < nq; jj++)
          for (int g = 0; g < group; g++) {
            const int r = (kk * nq + jj) * group + g;
            const float p = scores[(int64_t)r * len + t];
            float *acc_r = acc + (int64_t)r * head_dim;
#pragma omp simd
            for (int d = 0; d < head_dim; d++) acc_r[d] += p * v[d];
          }
      }
    }
  }

  /* Normalize and store in the output's dtype. */
  for (int kk = 0; kk < nkh; kk++)
    for (int jj = 0; jj < nq; jj++)
      for (int g = 0; g < group; g++) {
        const int r = (kk * nq + jj) * group + g;
        const int64_t dst =
            ((int64_t)(j0 + jj) * geo->num_heads + (kh0 + kk) * group + g) * head_dim;
        const float *acc_r = acc + (int64_t)r * head_dim;
        const float inv = inv_sum[r];
        if (is_bf16) {
          bf16_t *o = (bf16_t *)out + dst;
          for (int d = 0; d < head_dim; d++) o[d] = f32_to_bf16(acc_r[d] * inv);
        } else {
          float *o = (float *)out + dst;
#pragma omp simd
          for (int d = 0; d < head_dim; d++) o[d] = acc_r[d] * inv;
        }
      }
}

/* One copy of `attend` per dtype and common head_dim; any other head_dim runs the generic copy
 * (same code, runtime trip counts). */
#define ATTEND_ARGS geo, ctx, j0, nq, kh0, nkh, q, k_cache, v_cache, table, out, scratch
static void attend_any(const int head_dim, const int is_bf16, const Geometry *geo, int ctx,
                       int j0, int nq, int kh0, int nkh, const void *q, const void *k_cache,
                       const void *v_cache, const int32_t *table, void *out, Scratch *scratch) {
#define CASE(D)                                       \
  case D:                                             \
    if (is_bf16)                                      \
      attend(D, 1, ATTEND_ARGS);                      \
    else                                              \
      attend(D, 0, ATTEND_ARGS);                      \
    return;
  switch (head_dim) {
    CASE(64)
    CASE(80)
    CASE(96)
    CASE(128)
    default:
      if (is_bf16)
        attend(head_dim, 1, ATTEND_ARGS);
      else
        attend(head_dim, 0, ATTEND_ARGS);
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

/* `k` NULL: nothing to store (the caches already hold the step's K/V). `num_slots`: the caches'
 * num_blocks * block_size. `min_work_per_thread`: multiply-adds that justify one more thread
 * (0: use all of them). Returns 0; -1 when a scratch buffer could not be allocated (the output
 * is then partial); -2 on inconsistent lengths (a sequence with more queries than context) and
 * -3 on a slot past the caches, both before any work. */
int wick_paged_attention(int dtype, const void *q, void *k_cache, void *v_cache, const void *k,
                         const void *v, int64_t k_stride, int64_t v_stride,
                         const int64_t *slot_mapping, int64_t num_slots,
                         const int32_t *block_tables, int64_t bt_stride,
                         const int32_t *query_start_loc, const int32_t *seq_lens, void *out,
                         int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                         int block_size, float scale, int num_threads,
                         int64_t min_work_per_thread) {
  const Geometry geo = {
      .num_heads = num_heads,
      .group = num_heads / num_kv_heads,
      .block_size = block_size,
      .token_stride = (int64_t)num_kv_heads * head_dim,
      .block_stride = (int64_t)block_size * num_kv_heads * head_dim,
      .scale = scale,
  };
  const int is_bf16 = dtype == 1;
  const size_t elem = is_bf16 ? sizeof(bf16_t) : sizeof(float);

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
    work += qlen * (seq_lens[s] - qlen / 2);
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
      for (int64_t t = 0; t < num_tokens; t++)
        store_token(t, kv_row_bytes, (const char *)k, (const char *)v,
                    k_stride * (int64_t)elem, v_stride * (int64_t)elem, slot_mapping,
                    (char *)k_cache, (char *)v_cache);
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
      if (reserve(&scratch, rows, ctx + j0 + nq, head_dim) != 0) {
#pragma omp atomic write
        failed = 1;
        continue;
      }
      const int64_t first = (int64_t)query_start_loc[s] * num_heads * head_dim;
      attend_any(head_dim, is_bf16, &geo, ctx, j0, nq, kh0, heads_per_item,
                 (const char *)q + first * elem, k_cache, v_cache,
                 block_tables + (int64_t)s * bt_stride, (char *)out + first * elem, &scratch);
    }
    free(scratch.scores);
    free(scratch.q);
    free(scratch.acc);
    free(scratch.row);
    free(scratch.stats);
  }
  free(tile_seq);
  free(tile_j0);
  return failed ? -1 : 0;
}
