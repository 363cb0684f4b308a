/* Attention over a step's packed sequences without a KV cache, for pooling steps, which compute
 * every input whole in one step and keep nothing of it: the encoders' bidirectional attention
 * (BERT, XLM-RoBERTa; causal = 0) and a decoder embedding model's causal one (causal = 1). No
 * padding: each sequence attends over its own tokens only.
 *
 * Shapes (`dtype` 0: q, k, v and out fp32, 1: all bf16 stored as uint16):
 *   q          [T, num_heads, head_dim]     token t's heads from q + t * q_stride (a view of the
 *                                           fused qkv projection: rows need not be contiguous)
 *   k, v       [T, num_kv_heads, head_dim]  likewise, rows k_stride / v_stride elements apart
 *   out        [T, num_heads, head_dim]     rows out_stride elements apart
 *   cu_seqlens [num_seqs + 1] int32         sequence s owns tokens [cu[s], cu[s + 1])
 * Query j of a sequence of len tokens attends to its tokens [0, len) (causal: [0, j]); query head
 * h reads kv head h / (num_heads / num_kv_heads). Scores are q . k * scale, fp32 throughout;
 * bf16 outputs are rounded to nearest even, as torch does.
 *
 * Work items are (sequence, query head), the longest sequences first (a dynamic schedule, so the
 * long ones do not end the call on one thread). An item converts its kv head's K rows to fp32
 * once, transposed (kt [head_dim][lt]: lt is len rounded up to whole vectors, zeros past len),
 * and its V rows (vb [len][dp]: dp is head_dim rounded up to whole vectors, zeros past
 * head_dim), then takes its queries QB at a time:
 *   scores  sc[r][t] = sum over d of q[r][d] (broadcast) * kt[d][t-vector]: QB rows by TB token
 *           vectors of accumulators in registers, each K vector loaded once per d for QB rows;
 *   softmax along each row (the row's max, exp, sum), 0 where the row does not see the token;
 *   P.V     acc[r][d-vector] += sc[r][t] (broadcast) * vb[t][d-vector]: QB rows by PV_VECS
 *           vectors of head dims in registers, each V vector loaded once per token for QB rows.
 * Every inner loop runs across tokens or head dims, never into a horizontal sum (but the row
 * max and sum, once per row).
 *
 * Compiled once per ISA like paged_attention.c (wick_vec.h's vectors: AVX-512, AVX2, generic).
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "wick_cpu.h"
#include "wick_entry.h"
#include "wick_vec.h"
#include "wick_vmath.h"

/* Register blocks: QB query rows by TB token vectors (scores) or PV_VECS head-dim vectors (P.V).
 * AVX-512: 16 + 2 + 1 of 32 registers; the 16-register ISAs take half the rows. */
#if VW == 16
#define QB 8
#else
#define QB 4
#endif
#define TB 2
#define PV_VECS 2

typedef struct {
  int is_bf16, causal, group, head_dim;
  int dp; /* head_dim rounded up to whole vectors */
  int64_t q_stride, k_stride, v_stride, out_stride;
  float scale;
} VarlenGeometry;

/* One thread's buffers, sized for the call's longest sequence (see the file comment). */
typedef struct {
  float *kt; /* [head_dim][lt] */
  float *vb; /* [len][dp] */
  float *qf; /* [QB][head_dim]: the block's scaled queries, rows past the sequence zero */
  float *sc; /* [QB][lt]: scores, then unnormalized probabilities */
} VarlenScratch;

static inline int64_t round_up_to(const int64_t x, const int64_t m) { return (x + m - 1) / m * m; }

/* Element i of a q/k/v row as fp32; `is_bf16` is a compile-time constant after inlining. */
static inline float element(const void *base, const int64_t i, const int is_bf16) {
  return is_bf16 ? bf16_to_f32(((const bf16_t *)base)[i]) : ((const float *)base)[i];
}

/* sc[r][t0, t0 + tb * VW) for every row r of the block; tb <= TB is a compile-time constant. */
static inline __attribute__((always_inline)) void score_block(const int head_dim, const int tb,
                                                              const float *restrict qf,
                                                              const float *restrict kt,
                                                              const int64_t lt, const int64_t t0,
                                                              float *restrict sc) {
  vf acc[QB][TB];
  for (int r = 0; r < QB; r++)
    for (int j = 0; j < tb; j++) acc[r][j] = vsplat(0.f);
  for (int d = 0; d < head_dim; d++) {
    vf kv[TB];
    for (int j = 0; j < tb; j++) kv[j] = vload(kt + d * lt + t0 + j * VW);
    for (int r = 0; r < QB; r++) {
      const vf qv = vsplat(qf[r * head_dim + d]);
      for (int j = 0; j < tb; j++) acc[r][j] = vfma(qv, kv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < QB; r++)
    for (int j = 0; j < tb; j++) vstore(sc + r * lt + t0 + j * VW, acc[r][j]);
}

/* Row s[0, nt) (nt whole vectors) -> exp(s - max) over the row's first n tokens, 0 after them;
 * returns 1 / their sum. */
static inline float softmax_row(float *restrict s, const int64_t nt, const int64_t n) {
  vi lanes;
  for (int i = 0; i < VW; i++) lanes[i] = i;
  vf m = vsplat(-FLT_MAX);
  for (int64_t t0 = 0; t0 < nt; t0 += VW) {
    const vi seen = (lanes + (int32_t)t0) < (int32_t)n;
    m = vmax(m, (vf)(((vi)vload(s + t0) & seen) | ((vi)vsplat(-FLT_MAX) & ~seen)));
  }
  float max = m[0];
  for (int i = 1; i < VW; i++) max = m[i] > max ? m[i] : max;
  const vf vmx = vsplat(max);
  vf sum = vsplat(0.f);
  for (int64_t t0 = 0; t0 < nt; t0 += VW) {
    const vi seen = (lanes + (int32_t)t0) < (int32_t)n;
    const vf e = (vf)((vi)vexp_nonpositive(vload(s + t0) - vmx) & seen);
    vstore(s + t0, e);
    sum += e;
  }
  float total = 0.f;
  for (int i = 0; i < VW; i++) total += sum[i];
  return 1.f / total;
}

/* acc[r][j] = sum over t < n of sc[r][t] * vb[t][dv0 + j * VW ...] for every row r of the block;
 * nv <= PV_VECS is a compile-time constant. */
static inline __attribute__((always_inline)) void pv_block(const int nv, const float *restrict sc,
                                                           const int64_t lt,
                                                           const float *restrict vb, const int dp,
                                                           const int dv0, const int64_t n,
                                                           vf acc[QB][PV_VECS]) {
  for (int r = 0; r < QB; r++)
    for (int j = 0; j < nv; j++) acc[r][j] = vsplat(0.f);
  for (int64_t t = 0; t < n; t++) {
    vf vv[PV_VECS];
    for (int j = 0; j < nv; j++) vv[j] = vload(vb + t * dp + dv0 + j * VW);
    for (int r = 0; r < QB; r++) {
      const vf p = vsplat(sc[r * lt + t]);
      for (int j = 0; j < nv; j++) acc[r][j] = vfma(p, vv[j], acc[r][j]);
    }
  }
}

/* Values [d0, d0 + n) of an output row (n <= VW) = x's first n lanes, in the output dtype. */
static inline void store_out(void *row, const int64_t d0, const vf x, const int n,
                             const int is_bf16) {
  if (n == VW) {
    if (is_bf16)
      vstore_bf16((bf16_t *)row + d0, x);
    else
      vstore((float *)row + d0, x);
    return;
  }
  float part[VW];
  vstore(part, x);
  for (int i = 0; i < n; i++) {
    if (is_bf16)
      ((bf16_t *)row)[d0 + i] = f32_to_bf16(part[i]);
    else
      ((float *)row)[d0 + i] = part[i];
  }
}

/* Query head h of the sequence of `len` tokens from token `first` (see the file comment). */
static void attend_item(const VarlenGeometry *g, const void *q, const void *k, const void *v,
                        void *out, const int64_t first, const int len, const int h,
                        VarlenScratch *s) {
  const int is_bf16 = g->is_bf16, head_dim = g->head_dim, dp = g->dp;
  const size_t elem = is_bf16 ? sizeof(bf16_t) : sizeof(float);
  const int64_t lt = round_up_to(len, VW);
  const int64_t kv_off = (int64_t)(h / g->group) * head_dim;
  for (int t = 0; t < len; t++) {
    const char *krow = (const char *)k + ((first + t) * g->k_stride + kv_off) * (int64_t)elem;
    const char *vrow = (const char *)v + ((first + t) * g->v_stride + kv_off) * (int64_t)elem;
    for (int d = 0; d < head_dim; d++) s->kt[d * lt + t] = element(krow, d, is_bf16);
    for (int d = 0; d < head_dim; d++) s->vb[(int64_t)t * dp + d] = element(vrow, d, is_bf16);
    for (int d = head_dim; d < dp; d++) s->vb[(int64_t)t * dp + d] = 0.f;
  }
  for (int d = 0; d < head_dim; d++)
    for (int64_t t = len; t < lt; t++) s->kt[d * lt + t] = 0.f;

  const int64_t q_off = (int64_t)h * head_dim;
  for (int i0 = 0; i0 < len; i0 += QB) {
    const int nr = len - i0 < QB ? len - i0 : QB;
    for (int r = 0; r < QB; r++) {
      const char *qrow =
          (const char *)q + ((first + i0 + r) * g->q_stride + q_off) * (int64_t)elem;
      for (int d = 0; d < head_dim; d++)
        s->qf[r * head_dim + d] = r < nr ? element(qrow, d, is_bf16) * g->scale : 0.f;
    }
    /* Tokens any row of the block sees, and the whole vectors that hold them. */
    const int64_t seen = g->causal && i0 + QB < len ? i0 + QB : len;
    const int64_t nt = round_up_to(seen, VW);
    for (int64_t t0 = 0; t0 < nt; t0 += TB * VW) {
      if (nt - t0 >= TB * VW)
        score_block(head_dim, TB, s->qf, s->kt, lt, t0, s->sc);
      else
        score_block(head_dim, 1, s->qf, s->kt, lt, t0, s->sc);
    }
    float inv[QB];
    for (int r = 0; r < QB; r++)
      inv[r] = r < nr ? softmax_row(s->sc + r * lt, nt, g->causal ? i0 + r + 1 : len) : 0.f;

    for (int dv0 = 0; dv0 < dp; dv0 += PV_VECS * VW) {
      const int nv = (dp - dv0) / VW < PV_VECS ? (dp - dv0) / VW : PV_VECS;
      vf acc[QB][PV_VECS];
      if (nv == PV_VECS)
        pv_block(PV_VECS, s->sc, lt, s->vb, dp, dv0, seen, acc);
      else
        pv_block(1, s->sc, lt, s->vb, dp, dv0, seen, acc);
      for (int r = 0; r < nr; r++) {
        char *orow = (char *)out + ((first + i0 + r) * g->out_stride + q_off) * (int64_t)elem;
        const vf scale = vsplat(inv[r]);
        for (int j = 0; j < nv; j++) {
          const int d0 = dv0 + j * VW;
          store_out(orow, d0, acc[r][j] * scale, head_dim - d0 < VW ? head_dim - d0 : VW,
                    is_bf16);
        }
      }
    }
  }
}

/* Sorts keys descending (insertion sort on the few hundred sequences of a step). */
static void sort_descending(int64_t *keys, const int n) {
  for (int i = 1; i < n; i++) {
    const int64_t key = keys[i];
    int j = i - 1;
    for (; j >= 0 && keys[j] < key; j--) keys[j + 1] = keys[j];
    keys[j + 1] = key;
  }
}

/* Returns 0, -1 when out of memory, -2 for decreasing cu_seqlens, -4 for bad arguments. */
int wick_varlen_attention(int dtype, const void *q, int64_t q_stride, const void *k,
                          int64_t k_stride, const void *v, int64_t v_stride, void *out,
                          int64_t out_stride, const int32_t *cu_seqlens, int num_seqs,
                          int num_heads, int num_kv_heads, int head_dim, float scale, int causal,
                          int num_threads, int64_t min_work_per_thread) {
  if ((dtype != 0 && dtype != 1) || num_heads < 1 || num_kv_heads < 1 ||
      num_heads % num_kv_heads != 0 || head_dim < 1 || head_dim > 512 || num_seqs < 0)
    return -4;
  const VarlenGeometry geo = {
      .is_bf16 = dtype == 1,
      .causal = causal != 0,
      .group = num_heads / num_kv_heads,
      .head_dim = head_dim,
      .dp = (int)round_up_to(head_dim, VW),
      .q_stride = q_stride,
      .k_stride = k_stride,
      .v_stride = v_stride,
      .out_stride = out_stride,
      .scale = scale,
  };
  int max_len = 0;
  int64_t work = 0;
  for (int s = 0; s < num_seqs; s++) {
    const int64_t len = (int64_t)cu_seqlens[s + 1] - cu_seqlens[s];
    if (len < 0) return -2;
    max_len = len > max_len ? (int)len : max_len;
    work += len * (causal ? (len + 1) / 2 : len);
  }
  if (max_len == 0) return 0;
  /* Sequences by length, longest first: key = len << 32 | index. */
  int64_t *order = (int64_t *)malloc(sizeof(int64_t) * (size_t)num_seqs);
  if (order == NULL) return -1;
  for (int s = 0; s < num_seqs; s++)
    order[s] = ((int64_t)(cu_seqlens[s + 1] - cu_seqlens[s]) << 32) | s;
  sort_descending(order, num_seqs);

  /* Q.K and P.V multiply-adds. */
  work *= 2 * (int64_t)num_heads * head_dim;
  num_threads = threads_for(work, min_work_per_thread, num_threads);
  const int64_t lt = round_up_to(max_len, VW);
  const int64_t num_items = (int64_t)num_seqs * num_heads;
  int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    VarlenScratch scratch = {
        .kt = (float *)malloc(sizeof(float) * (size_t)(head_dim * lt)),
        .vb = (float *)malloc(sizeof(float) * (size_t)(lt * geo.dp)),
        .qf = (float *)malloc(sizeof(float) * (size_t)(QB * head_dim)),
        .sc = (float *)malloc(sizeof(float) * (size_t)(QB * lt)),
    };
    const int ready = scratch.kt && scratch.vb && scratch.qf && scratch.sc;
    if (!ready) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; item++) {
      if (!ready) continue;
      const int s = (int)(order[item / num_heads] & 0xffffffff);
      const int len = cu_seqlens[s + 1] - cu_seqlens[s];
      if (len > 0)
        attend_item(&geo, q, k, v, out, cu_seqlens[s], len, (int)(item % num_heads), &scratch);
    }
    free(scratch.kt);
    free(scratch.vb);
    free(scratch.qf);
    free(scratch.sc);
  }
  free(order);
  return failed ? -1 : 0;
}
