/* Paged attention's work items, included by paged_attention.c (the entry, which splits a call
 * into items and dispatches each to a compiled copy of `attend_item`) and by the files holding
 * those copies: paged_attention_f32.c, paged_attention_bf16.c, paged_attention_quant_f32.c and
 * paged_attention_quant_bf16.c. The copies are most of the library's build time; spread over
 * four files, kernels/cpu/native.py compiles them in parallel. Everything here is static inline
 * except the copies, which the lists at the end declare once (hidden: the library exports only
 * wick_entry.h's names).
 *
 * Vector paths: compiled once per ISA by kernels/cpu/native.py with explicit -m flags (no
 * -march=native), on GCC vector extensions of the ISA's width (wick_vec.h): AVX-512, AVX2 and a
 * 4-lane generic build run the same source.
 * Built with -fno-strict-aliasing: the bf16 shifts write floats through uint32_t.
 */
#ifndef WICK_ATTEND_H
#define WICK_ATTEND_H

#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "wick_cpu.h"
#include "wick_kv.h"
#include "wick_vec.h"
#include "wick_vmath.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define QUERY_TILE 16 /* queries per prefill work item: K/V rows are reused this many times */
/* Decodes (one query per item) take a kv head's query heads PASS_HEADS at a time, the count of a
 * pass a compile-time constant (1 to PASS_HEADS) so that its vectors live in registers: each K
 * and V vector is loaded (and converted) once per pass and used by all of its heads. Zen 4 loads
 * one 512-bit vector per cycle, as many as it multiplies-adds: loads are what to save. */
#define PASS_HEADS 4
/* P.V chunks: tokens per load and store of the accumulators. */
#define PV_TOKENS 16
/* How many tokens ahead of use K and V rows are prefetched. */
#define PREFETCH_AHEAD 32

/* ---- Vectors of the decode path ---------------------------------------------------------------
 * GCC / Clang vector extensions at the build's native width, so that one source serves every
 * ISA build: a vf is one zmm (AVX-512), ymm (AVX2) or xmm (generic) of VW floats. Loads and
 * stores go through memcpy (unaligned). Multiply-adds are fused where the ISA has FMA (the
 * intrinsic: under -std=c11 GCC does not contract a * b + c). */
/* P.V accumulator vectors in registers per pass (16 of AVX-512's 32 registers, 8 of AVX2's or
 * SSE's 16), split between its heads; longer head rows take several slices of a chunk. */
#if VW == 16
#define PV_REGS 16
#else
#define PV_REGS 8
#endif

/* The first n < VW values of a cache row (format kv, unscaled) from element `at` as fp32, the
 * other lanes zero: a row's last vector when head_dim is not a multiple of VW. Out of line:
 * rare, and every inlined copy would cost compile time. */
static __attribute__((noinline, cold, unused)) vf load_part(const void *cache, const int64_t at,
                                                    const int kv, const int n) {
  float part[VW] = {0};
  for (int i = 0; i < n; i++) part[i] = kv_value(cache, at + i, kv);
  return vload(part);
}

/* VW values of a cache row (format kv: quantized codes unscaled) from element `at` as fp32,
 * only the first `n` (<= VW) read and the other lanes zero. */
static inline vf load_row(const void *cache, const int64_t at, const int kv, const int n) {
  if (n < VW) return load_part(cache, at, kv, n);
  if (kv == KV_F32) return vload((const float *)cache + at);
  if (kv == KV_BF16) return vload_bf16((const bf16_t *)cache + at);
  return vload_code(cache, at, kv);
}

static inline float hsum(const vf v) {
  float s = 0.f;
  for (int i = 0; i < VW; i++) s += v[i];
  return s;
}

static inline float hmax(const vf v) {
  float m = v[0];
  for (int i = 1; i < VW; i++) m = v[i] > m ? v[i] : m;
  return m;
}

/* Two-source shuffles with constant lane indices (0 .. VW - 1: a's lanes, VW .. 2 VW - 1: b's);
 * LANES(F, h) lists F(i, h) for the VW lanes i. */
#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif
#if VW == 16
#define LANES(F, s) \
  F(0, s), F(1, s), F(2, s), F(3, s), F(4, s), F(5, s), F(6, s), F(7, s), F(8, s), F(9, s), \
      F(10, s), F(11, s), F(12, s), F(13, s), F(14, s), F(15, s)
#elif VW == 8
#define LANES(F, s) F(0, s), F(1, s), F(2, s), F(3, s), F(4, s), F(5, s), F(6, s), F(7, s)
#else
#define LANES(F, s) F(0, s), F(1, s), F(2, s), F(3, s)
#endif
/* Within each 128-bit lane of a and b (lanes 4k .. 4k + 3): the pairs (a[4k + j], b[4k + j]) for
 * j = 0, 1 (lo) or j = 2, 3 (hi): vunpcklps / vunpckhps. */
#define UNPACK_PS(i, hi) ((i) / 4 * 4 + (i) % 4 / 2 + (i) % 2 * VW + (hi) * 2)
/* The same with pairs of lanes: (a[4k], a[4k + 1], b[4k], b[4k + 1]) or the upper pairs. */
#define UNPACK_PD(i, hi) ((i) / 4 * 4 + (i) % 2 + (i) % 4 / 2 * VW + (hi) * 2)
/* Of the 2 VW / 4 128-bit lanes of (a, b): the even ones (lo) or the odd ones (hi), in order. */
#define LANES128(i, hi) ((i) / 4 * 8 + (i) % 4 + (hi) * 4)
#define ADD_SHUFFLES(a, b, F) (SHUFFLE(a, b, LANES(F, 0)) + SHUFFLE(a, b, LANES(F, 1)))

/* v[0 .. VW) -> the vector whose lane t is the sum of v[t]'s lanes: a transpose-and-add tree
 * of VW - 1 steps of two shuffles and an add, instead of a horizontal reduction per v[t].
 * Within 128-bit lanes first (cheap shuffles), so that only the last VW / 8 steps cross them.
 * Clobbers v. */
static inline vf lane_sums(vf *v) {
  /* v[i]: tokens 2i, 2i + 1 alternating, each 128-bit lane a pair of partial sums per token. */
  for (int i = 0; i < VW / 2; i++) v[i] = ADD_SHUFFLES(v[2 * i], v[2 * i + 1], UNPACK_PS);
  /* v[i]: tokens 4i .. 4i + 3 in every 128-bit lane, one partial sum each. */
  for (int i = 0; i < VW / 4; i++) v[i] = ADD_SHUFFLES(v[2 * i], v[2 * i + 1], UNPACK_PD);
  /* Sum the 128-bit lanes: twice as many tokens per vector, half as many partials, each step. */
  for (int n = VW / 8; n >= 1; n /= 2)
    for (int i = 0; i < n; i++) v[i] = ADD_SHUFFLES(v[2 * i], v[2 * i + 1], LANES128);
  return v[0];
}

/* Geometry shared by every work item of one call. Strides count elements, not bytes. */
typedef struct {
  int num_heads;
  int group; /* query heads per kv head */
  int block_size;
  int64_t token_stride; /* between consecutive tokens of a block: num_kv_heads * head_dim */
  int64_t block_stride; /* between blocks: block_size * token_stride */
  float scale;
  int window;     /* sliding window W (0: none): position p sees keys in (p - W, p] */
  float soft_cap; /* logit soft cap c (0: none): scaled scores s become c * tanh(s / c) */
  /* Quantized caches: a float32 scale per slot and kv head (wick_kv.h); NULL otherwise. */
  const float *k_scales, *v_scales;
} Geometry;

/* ---- Sliding windows and logit soft-capping (Gemma 2/3, Mistral-style windows) -------------
 * The window only moves the first key a query reads: keys before it, and the blocks holding
 * only such keys (the KV manager may have freed them: the null block), are never read. The
 * soft cap applies to the scaled score before the max and the softmax, as HF's eager path. */

/* The first position a query at position `pos` sees. */
static inline int window_start(const Geometry *geo, const int pos) {
  return geo->window > 0 && pos - geo->window + 1 > 0 ? pos - geo->window + 1 : 0;
}

/* Per-thread buffers, grown as needed. Rows are the item's query rows, ordered
 * (kv head, query, head in group): row r = (kk * nq + jj) * group + g. */
typedef struct {
  float *scores; /* [rows, len]: scores, then probabilities (row r valid up to its vis) */
  float *q;      /* [rows, head_dim]: scaled fp32 queries */
  float *acc;    /* [rows, head_dim]: P V accumulators */
  float *stats;  /* [2 * rows]: row max, then 1 / row sum */
  float *kbuf;   /* prefill tiles: the context's K rows of one kv head as fp32 */
  float *vbuf;   /* and its V rows */
  int64_t scores_cap, q_cap, acc_cap, stats_cap, kbuf_cap, vbuf_cap;
} Scratch;


static inline int64_t round_up(const int64_t x, const int64_t m) { return (x + m - 1) / m * m; }

/* ---- Decodes ------------------------------------------------------------------------------------
 * An item of one query (a decode, or a prefill tile of one query) takes its query heads in passes
 * of up to PASS_HEADS heads of one kv head, which share every K and V row. Q.K runs in chunks of
 * VW keys: each key vector is loaded (and converted) once per pass and multiplied into a
 * partial-sum vector per head, the queries held in registers; a transpose-and-add tree
 * (lane_sums) then turns a head's VW partial-sum vectors into one vector of VW scores, instead
 * of a horizontal reduction per score. An exact softmax per head (max, then exp and sum, both
 * vectorized), then P.V in chunks of PV_TOKENS values, each value vector loaded once per pass,
 * the pass's accumulators in registers across the chunk. The chunks are the outer loops, so a
 * chunk's rows of all the item's kv heads (contiguous in the cache) are read together, and rows
 * PREFETCH_AHEAD tokens ahead are prefetched: blocks lie anywhere in memory. */

/* Element offsets, in a cache, of the rows of the kv head at `head_off` for n tokens from t0. */
static inline void token_offsets(const Geometry *geo, const int32_t *restrict table, const int t0,
                                 const int n, const int64_t head_off, int64_t *restrict off) {
  int b = t0 / geo->block_size, o = t0 - b * geo->block_size;
  for (int i = 0; i < n; i++) {
    off[i] = (int64_t)table[b] * geo->block_stride + (int64_t)o * geo->token_stride + head_off;
    if (++o == geo->block_size) {
      o = 0;
      b++;
    }
  }
}

/* Starts loading the rows of tokens [t0, t1) (`bytes` from head_off on) into L2 ahead of their
 * use: blocks lie anywhere in the cache, beyond what the hardware prefetchers guess, and
 * prefetches into L1 would stall on its few outstanding misses. */
static inline void prefetch_tokens(const Geometry *geo, const int32_t *restrict table,
                                   const void *cache, const size_t elem, const int t0,
                                   const int t1, const int64_t head_off, const int64_t bytes) {
  int b = t0 / geo->block_size, o = t0 - b * geo->block_size;
  for (int t = t0; t < t1; t++) {
    const int64_t at =
        (int64_t)table[b] * geo->block_stride + (int64_t)o * geo->token_stride + head_off;
    const uintptr_t row = (uintptr_t)((const char *)cache + at * (int64_t)elem);
    for (uintptr_t line = row & ~(uintptr_t)63; line < row + bytes; line += 64)
      __builtin_prefetch((const void *)line, 0, 2);
    if (++o == geo->block_size) {
      o = 0;
      b++;
    }
  }
}

/* Query heads [0, group) of one token (q: head_dim values each) as fp32 rows of dp values,
 * scaled and zero-padded past head_dim. */
static inline void load_queries(const int head_dim, const int is_bf16, const void *restrict q,
                                const int group, const float scale, const int dp,
                                float *restrict qf) {
  for (int h = 0; h < group; h++) {
    float *dst = qf + (int64_t)h * dp;
    const int64_t src = (int64_t)h * head_dim;
    if (is_bf16) {
      bf16_to_f32_row((const bf16_t *)q + src, dst, scale, head_dim);
    } else {
      const float *qs = (const float *)q + src;
#pragma omp simd
      for (int d = 0; d < head_dim; d++) dst[d] = qs[d] * scale;
    }
    for (int d = head_dim; d < dp; d++) dst[d] = 0.f;
  }
}

/* Vector c of a row of head_dim values: how many of its VW lanes are in the row. */
static inline int lanes_in_row(const int head_dim, const int c) {
  return head_dim - c * VW < VW ? head_dim - c * VW : VW;
}

/* Scores of query heads [0, nh) (rows of qf, dp apart) against the n <= VW keys at
 * `off` + shift, into lanes [0, VW) of scores + h * stride (lanes past n get 0: rows are padded
 * for them). nh <= PASS_HEADS is a compile-time constant. */
static inline __attribute__((always_inline)) void score_heads(
    const int head_dim, const int kv, const int nh, const float *restrict qf, const int dp,
    const void *restrict k_cache, const float *restrict k_scales, const int64_t *restrict off,
    const int n, const int64_t shift, float *restrict scores, const int64_t stride) {
  const int nv = (head_dim + VW - 1) / VW; /* vectors per row */
  vf part[PASS_HEADS][VW];                 /* [head][key]: the key's score in partial sums */
  for (int t = 0; t < n; t++) {
    const int64_t at = off[t] + shift;
    vf s[PASS_HEADS];
    const vf k0 = load_row(k_cache, at, kv, lanes_in_row(head_dim, 0));
    for (int h = 0; h < nh; h++) s[h] = k0 * vload(qf + (int64_t)h * dp);
    for (int c = 1; c < nv; c++) {
      const vf k = load_row(k_cache, at + c * VW, kv, lanes_in_row(head_dim, c));
      for (int h = 0; h < nh; h++) s[h] = vfma(k, vload(qf + (int64_t)h * dp + c * VW), s[h]);
    }
    /* A quantized key's scale multiplies its partial sums (the dot of q with codes * s). */
    const float ks = KV_QUANT(kv) ? k_scales[at / head_dim] : 1.f;
    for (int h = 0; h < nh; h++) part[h][t] = KV_QUANT(kv) ? s[h] * ks : s[h];
  }
  for (int t = n; t < VW; t++)
    for (int h = 0; h < nh; h++) part[h][t] = vsplat(0.f);
  for (int h = 0; h < nh; h++) vstore(scores + h * stride, lane_sums(part[h]));
}

/* score_heads for a runtime nh in [1, PASS_HEADS]: one copy per count. */
static inline __attribute__((always_inline)) void score_pass(
    const int head_dim, const int kv, const int nh, const float *restrict qf, const int dp,
    const void *restrict k_cache, const float *restrict k_scales, const int64_t *restrict off,
    const int n, const int64_t shift, float *restrict scores, const int64_t stride) {
#define SCORE_HEADS(NH) \
  score_heads(head_dim, kv, NH, qf, dp, k_cache, k_scales, off, n, shift, scores, stride)
  switch (nh) {
    case 1:
      SCORE_HEADS(1);
      break;
    case 2:
      SCORE_HEADS(2);
      break;
    case 3:
      SCORE_HEADS(3);
      break;
    default:
      SCORE_HEADS(PASS_HEADS);
  }
#undef SCORE_HEADS
}

/* v with its lanes from n on (n <= VW) replaced by `fill`. */
static inline vf lanes_below(const vf v, const int n, const float fill) {
  vi lane;
  for (int i = 0; i < VW; i++) lane[i] = i;
  const vi in = lane < n;
  return (vf)(((vi)v & in) | ((vi)vsplat(fill) & ~in));
}

/* s[0, len) -> exp(s - max s) in place; returns 1 / their sum. The row is padded to whole
 * vectors: its last one is read and written whole, its lanes past len left out of the sums. */
static inline float softmax_row(float *restrict s, const int len) {
  const int last = (len - 1) / VW * VW, n_last = len - last; /* the last vector, maybe partial */
  vf m = lanes_below(vload(s + last), n_last, -FLT_MAX);
  for (int t = 0; t < last; t += VW) m = vmax(m, vload(s + t));
  const vf mx = vsplat(hmax(m));
  vf sums = vsplat(0.f);
  for (int t = 0; t <= last; t += VW) {
    const vf e = vexp_nonpositive(vload(s + t) - mx);
    vstore(s + t, e);
    sums += t < last ? e : lanes_below(e, n_last, 0.f);
  }
  return 1.f / hsum(sums);
}

/* acc + h * dp += sum over the n <= PV_TOKENS values at `off` + shift of p[h][t] * V[t], for
 * heads [0, nh), p[h] = probs + h * stride. nh <= PASS_HEADS is a compile-time constant; the
 * accumulators of a slice of PV_REGS / nh vectors per head stay in registers over the chunk. */
static inline __attribute__((always_inline)) void pv_heads(
    const int head_dim, const int kv, const int nh, const float *restrict probs,
    const int64_t stride, const void *restrict v_cache, const float *restrict v_scales,
    const int64_t *restrict off, const int n, const int64_t shift, const int dp,
    float *restrict acc) {
  const int nv = (head_dim + VW - 1) / VW;
  const int width = PV_REGS / nh; /* vectors per head in a slice */
  for (int c0 = 0; c0 < nv; c0 += width) {
    const int m = nv - c0 < width ? nv - c0 : width;
    vf a[PASS_HEADS][PV_REGS]; /* [head][vector of the slice] */
    for (int h = 0; h < nh; h++)
      for (int c = 0; c < m; c++) a[h][c] = vload(acc + (int64_t)h * dp + (c0 + c) * VW);
    for (int t = 0; t < n; t++) {
      vf v[PV_REGS];
      for (int c = 0; c < m; c++)
        v[c] = load_row(v_cache, off[t] + shift + (c0 + c) * VW, kv,
                        lanes_in_row(head_dim, c0 + c));
      /* A quantized value's scale multiplies its probabilities (p * (codes * s)). */
      const float vs = KV_QUANT(kv) ? v_scales[(off[t] + shift) / head_dim] : 1.f;
      for (int h = 0; h < nh; h++) {
        const vf p = vsplat(KV_QUANT(kv) ? probs[h * stride + t] * vs : probs[h * stride + t]);
        for (int c = 0; c < m; c++) a[h][c] = vfma(p, v[c], a[h][c]);
      }
    }
    for (int h = 0; h < nh; h++)
      for (int c = 0; c < m; c++) vstore(acc + (int64_t)h * dp + (c0 + c) * VW, a[h][c]);
  }
}

/* pv_heads for a runtime nh in [1, PASS_HEADS]: one copy per count. */
static inline __attribute__((always_inline)) void pv_pass(
    const int head_dim, const int kv, const int nh, const float *restrict probs,
    const int64_t stride, const void *restrict v_cache, const float *restrict v_scales,
    const int64_t *restrict off, const int n, const int64_t shift, const int dp,
    float *restrict acc) {
#define PV_HEADS(NH) \
  pv_heads(head_dim, kv, NH, probs, stride, v_cache, v_scales, off, n, shift, dp, acc)
  switch (nh) {
    case 1:
      PV_HEADS(1);
      break;
    case 2:
      PV_HEADS(2);
      break;
    case 3:
      PV_HEADS(3);
      break;
    default:
      PV_HEADS(PASS_HEADS);
  }
#undef PV_HEADS
}

/* One head's output: head_dim values of acc * inv in out's dtype. */
static inline void store_head(const float *restrict acc, const float inv, const int head_dim,
                              const int is_bf16, void *restrict out) {
  const int full = head_dim / VW * VW;
  for (int d = 0; d < full; d += VW) {
    const vf x = vload(acc + d) * inv;
    if (is_bf16)
      vstore_bf16((bf16_t *)out + d, x);
    else
      vstore((float *)out + d, x);
  }
  for (int d = full; d < head_dim; d++) {
    if (is_bf16)
      ((bf16_t *)out)[d] = f32_to_bf16(acc[d] * inv);
    else
      ((float *)out)[d] = acc[d] * inv;
  }
}

/* What the passes of one decode item share. Rows r = kk * group + g of its buffers are query
 * head (kh0 + kk) * group + g, of kv head kh0 + kk. */
typedef struct {
  const Geometry *geo;
  const int32_t *table; /* the sequence's block table */
  int lo;               /* the first token the query sees (> 0 only with a sliding window) */
  int len;              /* tokens the query sees: [lo, len); scores and probs index t - lo */
  int kh0, nkh;         /* the item's kv heads */
  int dp;               /* head_dim rounded up to whole vectors: the rows of q and acc */
  int64_t stride;       /* len - lo rounded up to whole vectors: the rows of scores */
  size_t elem;          /* bytes per q and out value */
  size_t kv_elem;       /* bytes per cache value */
} DecodeItem;

/* Starts loading the item's rows (all its kv heads) of tokens [t0, min(t1, len)). */
static inline void prefetch_item(const DecodeItem *it, const int head_dim, const void *cache,
                                 const int t0, const int t1) {
  if (t0 >= it->len) return;
  prefetch_tokens(it->geo, it->table, cache, it->kv_elem, t0, t1 < it->len ? t1 : it->len,
                  (int64_t)it->kh0 * head_dim, (int64_t)it->nkh * head_dim * (int64_t)it->kv_elem);
}

/* scores[r][0, len - lo) = row r's query (qf + r * dp) . each key from lo on, chunk by chunk;
 * the first PREFETCH_AHEAD tokens' rows are prefetched by the caller. */
static inline __attribute__((always_inline)) void decode_scores(
    const int head_dim, const int kv, const DecodeItem *it, const float *restrict qf,
    const void *restrict k_cache, float *restrict scores) {
  const int group = it->geo->group;
  int64_t off[VW]; /* of the chunk's tokens, for kv head kh0 */
  for (int t0 = it->lo; t0 < it->len; t0 += VW) {
    const int n = it->len - t0 < VW ? it->len - t0 : VW;
    prefetch_item(it, head_dim, k_cache, t0 + PREFETCH_AHEAD, t0 + PREFETCH_AHEAD + n);
    token_offsets(it->geo, it->table, t0, n, (int64_t)it->kh0 * head_dim, off);
    for (int kk = 0; kk < it->nkh; kk++)
      for (int g0 = 0; g0 < group; g0 += PASS_HEADS) {
        const int r = kk * group + g0;
        const int nh = group - g0 < PASS_HEADS ? group - g0 : PASS_HEADS;
        score_pass(head_dim, kv, nh, qf + (int64_t)r * it->dp, it->dp, k_cache,
                   it->geo->k_scales, off, n, kk * head_dim,
                   scores + r * it->stride + (t0 - it->lo), it->stride);
      }
  }
}

/* acc[r] = sum over lo <= t < len of probs[r][t - lo] * V[t] (acc zeroed here), chunk by chunk;
 * the first PREFETCH_AHEAD tokens' rows are prefetched by the caller. */
static inline __attribute__((always_inline)) void decode_values(
    const int head_dim, const int kv, const DecodeItem *it, const float *restrict probs,
    const void *restrict v_cache, float *restrict acc) {
  const int group = it->geo->group;
  int64_t off[PV_TOKENS]; /* of the chunk's tokens, for kv head kh0 */
  memset(acc, 0, sizeof(float) * (size_t)it->nkh * group * it->dp);
  for (int t0 = it->lo; t0 < it->len; t0 += PV_TOKENS) {
    const int n = it->len - t0 < PV_TOKENS ? it->len - t0 : PV_TOKENS;
    prefetch_item(it, head_dim, v_cache, t0 + PREFETCH_AHEAD, t0 + PREFETCH_AHEAD + n);
    token_offsets(it->geo, it->table, t0, n, (int64_t)it->kh0 * head_dim, off);
    for (int kk = 0; kk < it->nkh; kk++)
      for (int g0 = 0; g0 < group; g0 += PASS_HEADS) {
        const int r = kk * group + g0;
        const int nh = group - g0 < PASS_HEADS ? group - g0 : PASS_HEADS;
        pv_pass(head_dim, kv, nh, probs + r * it->stride + (t0 - it->lo), it->stride, v_cache,
                it->geo->v_scales, off, n, kk * head_dim, it->dp, acc + (int64_t)r * it->dp);
      }
  }
}

/* Row s[0, n) soft-capped in place, whole vectors (the padding lanes are 0 and stay 0):
 * c * tanh(x / c) with tanh(a) = (1 - e) / (1 + e), e = exp(-2 |a|) <= 1, the sign of x
 * restored. Decodes cap their score rows, prefill tiles their whole [tokens][rows] block. */
static inline void soft_cap_row(float *restrict s, const int64_t n, const float cap) {
  const vi sign = (vi)((vu){0} + 0x80000000u); /* the sign bit of each lane */
  for (int64_t t = 0; t < n; t += VW) {
    const vf x = vload(s + t);
    const vf e = vexp_nonpositive((vf)((vi)x & ~sign) * (-2.f / cap));
    vstore(s + t, (vf)((vi)((1.f - e) / (1.f + e) * cap) | ((vi)x & sign)));
  }
}

/* A work item of one query, which sees tokens [0, len) (with a window, its last W), for kv heads
 * [kh0, kh0 + nkh): q and out point at the query's row of num_heads heads. Scratch (see
 * reserve): q and acc [rows, dp], scores [rows, stride], stats [rows] (1 / softmax sums). */
static inline __attribute__((always_inline)) void attend_decode(
    const int head_dim, const int is_bf16, const int kv, const Geometry *geo, const int len,
    const int kh0, const int nkh, const void *restrict q, const void *restrict k_cache,
    const void *restrict v_cache, const int32_t *restrict table, void *restrict out,
    Scratch *scratch) {
  const int lo = window_start(geo, len - 1);
  const DecodeItem it = {
      .geo = geo,
      .table = table,
      .lo = lo,
      .len = len,
      .kh0 = kh0,
      .nkh = nkh,
      .dp = (int)round_up(head_dim, VW),
      .stride = round_up(len - lo, VW),
      .elem = is_bf16 ? sizeof(bf16_t) : sizeof(float),
      .kv_elem = kv_elem_size(kv),
  };
  const int rows = nkh * geo->group;
  const int64_t first = (int64_t)kh0 * geo->group * head_dim; /* row 0's head, in q and out */
  float *restrict inv_sum = scratch->stats;

  prefetch_item(&it, head_dim, k_cache, lo, lo + PREFETCH_AHEAD);
  load_queries(head_dim, is_bf16, (const char *)q + first * it.elem, rows, geo->scale, it.dp,
               scratch->q);
  decode_scores(head_dim, kv, &it, scratch->q, k_cache, scratch->scores);
  prefetch_item(&it, head_dim, v_cache, lo, lo + PREFETCH_AHEAD); /* under the softmax */
  if (geo->soft_cap > 0.f)
    for (int r = 0; r < rows; r++)
      soft_cap_row(scratch->scores + r * it.stride, it.stride, geo->soft_cap);
  for (int r = 0; r < rows; r++)
    inv_sum[r] = softmax_row(scratch->scores + r * it.stride, len - lo);
  decode_values(head_dim, kv, &it, scratch->scores, v_cache, scratch->acc);
  for (int r = 0; r < rows; r++)
    store_head(scratch->acc + (int64_t)r * it.dp, inv_sum[r], head_dim, is_bf16,
               (char *)out + (first + (int64_t)r * head_dim) * it.elem);
}

/* ---- Prefill tiles -----------------------------------------------------------------------------
 * An item of nq > 1 queries works one kv head at a time on that head's R = nq * group query rows
 * (row r = jj * group + g), in layouts that let every inner loop run across rows or across head
 * dims, never into a horizontal sum:
 *   qt   [head_dim][rp]  the scaled queries, transposed (rp: R rounded up to whole vectors)
 *   kbuf [len][dp]       the kv head's K rows of the context as fp32, converted once per item
 *   vbuf [len][dp]       its V rows likewise (dp: head_dim rounded up to whole vectors)
 *   st   [len][rp]       scores, then unnormalized probabilities, token-major
 * Q.K: st[t][rows] = sum over d of kbuf[t][d] (a broadcast scalar) * qt[d][rows], QK_TB tokens by
 * QK_RB row vectors of accumulators in registers, the query vectors loaded once per d. Softmax
 * per row, vectorized across rows: the max over tokens, then exp and sums. P.V:
 * acc[r][d-vector] += st[t][r] (broadcast) * vbuf[t][d-vector], PV_RB rows by a slice of
 * PV_REGS / PV_RB vectors in registers over all tokens. Causality: row r (query jj = r / group)
 * sees tokens t <= ctx + j0 + jj; in the tile's own tokens the (t, r) it does not see get
 * probability 0, so every loop runs over whole token ranges. */
#define QK_TB 4
#if VW == 16
#define QK_RB 4
#else
#define QK_RB 2
#endif
#define PV_RB 4

/* st[t0 + t][0, rb * VW) for t < tb (<= QK_TB) from rb (<= QK_RB, a compile-time constant) row
 * vectors of qt. kbuf holds whole QK_TB-token groups (rows past len are zero). */
static inline __attribute__((always_inline)) void qk_block(
    const int head_dim, const int rb, const float *restrict qt, const int64_t rp,
    const float *restrict kbuf, const int dp, const int t0, const int tb, float *restrict st) {
  vf acc[QK_TB][QK_RB];
  for (int t = 0; t < QK_TB; t++)
    for (int i = 0; i < rb; i++) acc[t][i] = vsplat(0.f);
  const float *k = kbuf + (int64_t)t0 * dp;
  for (int d = 0; d < head_dim; d++) {
    vf q[QK_RB];
    for (int i = 0; i < rb; i++) q[i] = vload(qt + d * rp + i * VW);
    for (int t = 0; t < QK_TB; t++) {
      const vf kd = vsplat(k[t * dp + d]);
      for (int i = 0; i < rb; i++) acc[t][i] = vfma(kd, q[i], acc[t][i]);
    }
  }
  for (int t = 0; t < tb; t++)
    for (int i = 0; i < rb; i++) vstore(st + (t0 + t) * rp + i * VW, acc[t][i]);
}

static inline __attribute__((always_inline)) void tile_scores(
    const int head_dim, const float *restrict qt, const int64_t rp, const float *restrict kbuf,
    const int dp, const int len, float *restrict st) {
  const int nrv = (int)(rp / VW);
  for (int rv = 0; rv < nrv; rv += QK_RB) {
    const int rb = nrv - rv < QK_RB ? nrv - rv : QK_RB;
    for (int t0 = 0; t0 < len; t0 += QK_TB) {
      const int tb = len - t0 < QK_TB ? len - t0 : QK_TB;
#define QK_BLOCK(RB) qk_block(head_dim, RB, qt + rv * VW, rp, kbuf, dp, t0, tb, st + rv * VW)
      switch (rb) {
        case 1:
          QK_BLOCK(1);
          break;
#if QK_RB > 2
        case 2:
          QK_BLOCK(2);
          break;
        case 3:
          QK_BLOCK(3);
          break;
#endif
        default:
          QK_BLOCK(QK_RB);
      }
#undef QK_BLOCK
    }
  }
}

/* Lanes of row vector r0 / VW that token t may not be seen by: rows r < u * group, where u is
 * t's index among the tile's queries (t = first + u); none for tokens before the tile. With a
 * window W also the rows whose window starts after t: r >= (u + W) * group. */
static inline vi tile_hidden(const int t, const int first, const int group, const int r0,
                             const int window) {
  vi lane;
  for (int i = 0; i < VW; i++) lane[i] = r0 + i;
  const int u = t - first;
  const vi causal = u > 0 ? lane < u * group : (vi){0};
  return window > 0 ? causal | (lane >= (u + window) * group) : causal;
}

/* Causal softmax of every row vector, across rows: st becomes exp(s - row max), 0 where the row
 * does not see the token; inv[r] = 1 / row r's sum. `first`: the tile's first query position
 * (in st's token numbering); `window`: the sliding window (0: none). */
static inline void tile_softmax(float *restrict st, const int64_t rp, const int len,
                                const int first, const int group, const int window,
                                float *restrict inv) {
  for (int r0 = 0; r0 < rp; r0 += VW) {
    vf m = vsplat(-FLT_MAX);
    for (int t = 0; t < len; t++) {
      const vf s = vload(st + t * rp + r0);
      const vi hidden = tile_hidden(t, first, group, r0, window);
      m = vmax(m, (vf)(((vi)s & ~hidden) | ((vi)vsplat(-FLT_MAX) & hidden)));
    }
    vf sum = vsplat(0.f);
    for (int t = 0; t < len; t++) {
      const vf e = (vf)((vi)vexp_nonpositive(vload(st + t * rp + r0) - m) &
                        ~tile_hidden(t, first, group, r0, window));
      vstore(st + t * rp + r0, e);
      sum += e;
    }
    vstore(inv + r0, 1.f / sum);
  }
}

/* acc[r0 + i][c0 .. c0 + m vectors) = sum over t < len of st[t][r0 + i] * vbuf[t][...], for
 * nr <= PV_RB rows (a compile-time constant) and m <= PV_REGS / PV_RB vectors. */
static inline __attribute__((always_inline)) void pv_block(
    const int nr, const int m, const float *restrict st, const int64_t rp, const int r0,
    const float *restrict vbuf, const int dp, const int c0, const int len, float *restrict acc) {
  vf a[PV_RB][PV_REGS / PV_RB];
  for (int i = 0; i < nr; i++)
    for (int c = 0; c < m; c++) a[i][c] = vsplat(0.f);
  for (int t = 0; t < len; t++) {
    vf v[PV_REGS / PV_RB];
    for (int c = 0; c < m; c++) v[c] = vload(vbuf + (int64_t)t * dp + (c0 + c) * VW);
    for (int i = 0; i < nr; i++) {
      const vf p = vsplat(st[t * rp + r0 + i]);
      for (int c = 0; c < m; c++) a[i][c] = vfma(p, v[c], a[i][c]);
    }
  }
  for (int i = 0; i < nr; i++)
    for (int c = 0; c < m; c++) vstore(acc + (int64_t)(r0 + i) * dp + (c0 + c) * VW, a[i][c]);
}

static inline __attribute__((always_inline)) void tile_values(
    const int head_dim, const int rows, const float *restrict st, const int64_t rp,
    const float *restrict vbuf, const int dp, const int len, float *restrict acc) {
  const int nv = (head_dim + VW - 1) / VW;
  const int width = PV_REGS / PV_RB;
  for (int r0 = 0; r0 < rows; r0 += PV_RB) {
    const int nr = rows - r0 < PV_RB ? rows - r0 : PV_RB;
    for (int c0 = 0; c0 < nv; c0 += width) {
      const int m = nv - c0 < width ? nv - c0 : width;
#define PV_BLOCK(NR) pv_block(NR, m, st, rp, r0, vbuf, dp, c0, len, acc)
      switch (nr) {
        case 1:
          PV_BLOCK(1);
          break;
        case 2:
          PV_BLOCK(2);
          break;
        case 3:
          PV_BLOCK(3);
          break;
        default:
          PV_BLOCK(PV_RB);
      }
#undef PV_BLOCK
    }
  }
}

/* The kv head's rows (element offset `head_off` in a token) of tokens [t0, len) (t0 > 0: a
 * window's first token) as fp32 rows of dp values (zero past head_dim), row t - t0 for token t,
 * then zero rows up to a whole QK_TB group. Quantized rows (format kv) come dequantized: codes
 * times the row's scale (`scales`). */
static inline __attribute__((always_inline)) void load_context(
    const int head_dim, const int kv, const Geometry *geo, const int32_t *restrict table,
    const void *restrict cache, const float *restrict scales, const int64_t head_off,
    const int t0, const int len, const int dp, float *restrict buf) {
  const int nv = dp / VW, n = len - t0;
  int b = t0 / geo->block_size, o = t0 - b * geo->block_size;
  for (int t = 0; t < n; t++) {
    const int64_t at =
        (int64_t)table[b] * geo->block_stride + (int64_t)o * geo->token_stride + head_off;
    const vf s = vsplat(KV_QUANT(kv) ? scales[at / head_dim] : 1.f);
    for (int c = 0; c < nv; c++) {
      const vf x = load_row(cache, at + c * VW, kv, lanes_in_row(head_dim, c));
      vstore(buf + (int64_t)t * dp + c * VW, KV_QUANT(kv) ? x * s : x);
    }
    if (++o == geo->block_size) {
      o = 0;
      b++;
    }
  }
  memset(buf + (int64_t)n * dp, 0, sizeof(float) * (size_t)(round_up(n, QK_TB) - n) * dp);
}

/* One work item: queries [j0, j0 + nq) of a sequence whose first query sits at position ctx,
 * kv heads [kh0, kh0 + nkh). `q` and `out` point at the sequence's first query row; `table` at
 * its block table row. Scratch: reserve_tile for nq * group rows and ctx + j0 + nq tokens. */
static inline __attribute__((always_inline)) void attend(
    const int head_dim, const int is_bf16, const int kv, const Geometry *geo, const int ctx,
    const int j0, const int nq, const int kh0, const int nkh, const void *restrict q,
    const void *restrict k_cache, const void *restrict v_cache, const int32_t *restrict table,
    void *restrict out, Scratch *scratch) {
  const int group = geo->group;
  const int rows = nq * group;
  const int64_t rp = round_up(rows, VW);
  const int dp = (int)round_up(head_dim, VW);
  const int len = ctx + j0 + nq; /* tokens the last query of the tile sees */
  /* With a window the tile works on tokens [t_first, len) only (t_first: the first query's
   * window start; the blocks before it are never read), numbered from t_first in its buffers. */
  const int t_first = window_start(geo, ctx + j0), n = len - t_first;
  const size_t elem = is_bf16 ? sizeof(bf16_t) : sizeof(float);
  float *restrict qt = scratch->q;
  float *restrict st = scratch->scores;
  float *restrict inv = scratch->stats;

  for (int kk = 0; kk < nkh; kk++) {
    const int kh = kh0 + kk;
    /* qt[d][r] = scale * q of row r = jj * group + g (query j0 + jj, head kh * group + g). */
    for (int r = 0; r < rows; r++) {
      const int64_t src = ((int64_t)(j0 + r / group) * geo->num_heads + kh * group + r % group) *
                          head_dim;
      for (int d = 0; d < head_dim; d++) {
        const float x = is_bf16 ? bf16_to_f32(((const bf16_t *)q)[src + d])
                                : ((const float *)q)[src + d];
        qt[d * rp + r] = x * geo->scale;
      }
    }
    for (int d = 0; d < head_dim; d++)
      for (int r = rows; r < rp; r++) qt[d * rp + r] = 0.f;
    load_context(head_dim, kv, geo, table, k_cache, geo->k_scales, (int64_t)kh * head_dim,
                 t_first, len, dp, scratch->kbuf);
    load_context(head_dim, kv, geo, table, v_cache, geo->v_scales, (int64_t)kh * head_dim,
                 t_first, len, dp, scratch->vbuf);
    tile_scores(head_dim, qt, rp, scratch->kbuf, dp, n, st);
    if (geo->soft_cap > 0.f) soft_cap_row(st, (int64_t)n * rp, geo->soft_cap);
    tile_softmax(st, rp, n, ctx + j0 - t_first, group, geo->window, inv);
    tile_values(head_dim, rows, st, rp, scratch->vbuf, dp, n, scratch->acc);
    for (int r = 0; r < rows; r++) {
      const int64_t dst =
          ((int64_t)(j0 + r / group) * geo->num_heads + kh * group + r % group) * head_dim;
      store_head(scratch->acc + (int64_t)r * dp, inv[r], head_dim, is_bf16,
                 (char *)out + dst * (int64_t)elem);
    }
  }
}

/* A work item: on the decode path when it has one query, else on `attend`. */
static inline __attribute__((always_inline)) void attend_item(
    const int head_dim, const int is_bf16, const int kv, const Geometry *geo, const int ctx,
    const int j0, const int nq, const int kh0, const int nkh, const void *restrict q,
    const void *restrict k_cache, const void *restrict v_cache, const int32_t *restrict table,
    void *restrict out, Scratch *scratch) {
  if (nq == 1) {
    const int64_t row = (int64_t)j0 * geo->num_heads * head_dim * (is_bf16 ? 2 : 4); /* bytes */
    attend_decode(head_dim, is_bf16, kv, geo, ctx + j0 + 1, kh0, nkh, (const char *)q + row,
                  k_cache, v_cache, table, (char *)out + row, scratch);
  } else {
    attend(head_dim, is_bf16, kv, geo, ctx, j0, nq, kh0, nkh, q, k_cache, v_cache, table, out,
           scratch);
  }
}

/* ---- The compiled copies ----------------------------------------------------------------------
 * One copy of `attend_item` per dtype, cache format and common head_dim (constant trip counts);
 * any other head_dim runs the generic copy (same code, runtime trip counts). Each copy is a
 * function of its own: GCC takes several times as long on one function holding them all. Caches
 * in q's dtype get four head_dims; the other formats (wick_kv.h) fewer: a bf16 cache under an
 * fp32 q (any head_dim), int8 (64, 128, any) and fp8 (64, any). Each list below is compiled in
 * one file (ATTEND_DEFINE) and declared here for the entry (ATTEND_DECLARE). */
#define ATTEND_F32_COPIES(X)             \
  X(attend_f32_64, 64, 0, KV_F32)        \
  X(attend_f32_80, 80, 0, KV_F32)        \
  X(attend_f32_96, 96, 0, KV_F32)        \
  X(attend_f32_128, 128, 0, KV_F32)      \
  X(attend_f32_any, head_dim, 0, KV_F32) \
  X(attend_f32_kvbf16_any, head_dim, 0, KV_BF16)
#define ATTEND_BF16_COPIES(X)         \
  X(attend_bf16_64, 64, 1, KV_BF16)   \
  X(attend_bf16_80, 80, 1, KV_BF16)   \
  X(attend_bf16_96, 96, 1, KV_BF16)   \
  X(attend_bf16_128, 128, 1, KV_BF16) \
  X(attend_bf16_any, head_dim, 1, KV_BF16)
/* Quantized caches under queries of dtype Q (f32 or bf16; BF16 its is_bf16). */
#define ATTEND_QUANT_COPIES(X, Q, BF16)             \
  X(attend_##Q##_i8_64, 64, BF16, KV_I8)            \
  X(attend_##Q##_i8_128, 128, BF16, KV_I8)          \
  X(attend_##Q##_i8_any, head_dim, BF16, KV_I8)     \
  X(attend_##Q##_e4m3_64, 64, BF16, KV_E4M3)        \
  X(attend_##Q##_e4m3_any, head_dim, BF16, KV_E4M3) \
  X(attend_##Q##_e5m2_64, 64, BF16, KV_E5M2)        \
  X(attend_##Q##_e5m2_any, head_dim, BF16, KV_E5M2)

#define ATTEND_PARAMS                                                                          \
  const int head_dim, const Geometry *geo, int ctx, int j0, int nq, int kh0, int nkh,          \
      const void *q, const void *k_cache, const void *v_cache, const int32_t *table, void *out, \
      Scratch *scratch
#define ATTEND_ARGS geo, ctx, j0, nq, kh0, nkh, q, k_cache, v_cache, table, out, scratch
typedef void (*ItemFn)(ATTEND_PARAMS);
#define ATTEND_DECLARE(NAME, D, BF16, KV) \
  __attribute__((visibility("hidden"))) void NAME(ATTEND_PARAMS);
/* D may be `head_dim`, the parameter: the generic copy. */
#define ATTEND_DEFINE(NAME, D, BF16, KV)                           \
  __attribute__((visibility("hidden"))) void NAME(ATTEND_PARAMS) { \
    (void)head_dim;                                                \
    attend_item(D, BF16, KV, ATTEND_ARGS);                         \
  }

ATTEND_F32_COPIES(ATTEND_DECLARE)
ATTEND_BF16_COPIES(ATTEND_DECLARE)
ATTEND_QUANT_COPIES(ATTEND_DECLARE, f32, 0)
ATTEND_QUANT_COPIES(ATTEND_DECLARE, bf16, 1)

#endif
