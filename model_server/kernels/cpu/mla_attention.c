/* Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of latents: wick_mla.h.
 *
 * The cache keeps per token the normalised KV latent c (L values) and the rotated shared rope
 * key k_pe (R values). Every query row, decode or prefill, attends absorbed (exact for both):
 * per head h, q_lat = q_nope W_uk[h] (L values, fp32), score_j = (q_lat . c_j + q_pe . k_pe_j)
 * * scale, p = softmax over the row's causal context, o_lat = sum_j p_j c_j (fp32) and
 * out = W_uv[h] o_lat, rounded once to the dtype. Nothing is expanded per token (the
 * module path's PyTorch prefill expands the context through kv_b_proj and runs SDPA: the same
 * value up to rounding; this kernel is what both the `cpu` backend's modules and the native
 * decoder step run, so those two agree bit for bit).
 *
 * Work item: one query row's heads, or a group of them (enough items for the threads), computed
 * by one thread; every head's sums run in a fixed order (left to right, `omp simd` reductions
 * of this build's width) whatever the grouping, so the bits do not depend on the thread count
 * or on how rows are batched. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "wick_cpu.h"
#include "wick_mla.h"

/* src [n] in the dtype as fp32: src itself (fp32), or widened into buf (bf16). */
static inline const float *as_f32(const void *src, int is_bf16, float *buf, int n) {
  if (!is_bf16) return (const float *)src;
  bf16_to_f32_row((const bf16_t *)src, buf, 1.f, n);
  return buf;
}

static inline float dot(const float *restrict a, const float *restrict b, int n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int i = 0; i < n; i++) acc += a[i] * b[i];
  return acc;
}

/* Context position j's slot in the paged cache: its block's id from the row's block table. */
static inline int64_t context_slot(const int32_t *table, int j, int block_size) {
  return (int64_t)table[j / block_size] * block_size + j % block_size;
}

/* One thread's buffers for a group of nh heads: q_lat, o_lat [nh, L], q_pe [nh, R], one
 * widened cache or weight row, scores [nh, keys], each head's max and sum [nh]. */
typedef struct {
  float *q_lat, *q_pe, *o_lat, *row, *scores, *max, *sum;
} Scratch;

typedef struct {
  int is_bf16, heads, nope, rope, v, lora, block_size;
  int64_t q_token_stride, q_head_stride;
  float scale;
  const char *q_nope, *q_pe, *w;
  const char *cache;
  char *out;
} Geometry;

/* out row t, heads [h0, h0 + nh): attention of their queries over `keys` context positions of
 * the row's sequence (block table `table`). Each cache row is widened once for the nh heads;
 * each head's sums run in the same order whatever nh is, so the grouping changes no bit. */
static void attend(const Geometry *g, int64_t t, int h0, int nh, int keys, const int32_t *table,
                   Scratch *sc) {
  const int L = g->lora, R = g->rope, Dn = g->nope, Dv = g->v, entry = L + R;
  const int64_t es = g->is_bf16 ? 2 : 4;
  float *restrict q_lat = sc->q_lat, *restrict q_pe = sc->q_pe;
  for (int i = 0; i < nh; i++) {
    const int h = h0 + i;
    /* q_lat[i] [L] = sum_d q_nope[d] W_uk[h, d, :], d in order */
    float *restrict ql = q_lat + (int64_t)i * L;
    memset(ql, 0, sizeof(float) * (size_t)L);
    const char *qn = g->q_nope + (t * g->q_token_stride + (int64_t)h * g->q_head_stride) * es;
    const int64_t w_head = (int64_t)h * (Dn + Dv);
    for (int d = 0; d < Dn; d++) {
      const float qd =
          g->is_bf16 ? bf16_to_f32(((const bf16_t *)qn)[d]) : ((const float *)qn)[d];
      const float *w = as_f32(g->w + (w_head + d) * L * es, g->is_bf16, sc->row, L);
#pragma omp simd
      for (int l = 0; l < L; l++) ql[l] += qd * w[l];
    }
    const char *qp = g->q_pe + (t * g->heads + h) * (int64_t)R * es;
    if (g->is_bf16)
      bf16_to_f32_row((const bf16_t *)qp, q_pe + (int64_t)i * R, 1.f, R);
    else
      memcpy(q_pe + (int64_t)i * R, qp, sizeof(float) * (size_t)R);
  }
  /* scores [nh, keys] and each head's max */
  float *restrict scores = sc->scores, *restrict max = sc->max, *restrict sum = sc->sum;
  for (int i = 0; i < nh; i++) max[i] = -INFINITY, sum[i] = 0.f;
  for (int j = 0; j < keys; j++) {
    const int64_t slot = context_slot(table, j, g->block_size);
    const float *e = as_f32(g->cache + slot * entry * es, g->is_bf16, sc->row, entry);
    for (int i = 0; i < nh; i++) {
      const float s =
          (dot(q_lat + (int64_t)i * L, e, L) + dot(q_pe + (int64_t)i * R, e + L, R)) * g->scale;
      scores[(int64_t)i * keys + j] = s;
      max[i] = s > max[i] ? s : max[i];
    }
  }
  for (int i = 0; i < nh; i++) {
    float *restrict p = scores + (int64_t)i * keys;
    float total = 0.f;
    for (int j = 0; j < keys; j++) {
      p[j] = exp_nonpositive(p[j] - max[i]);
      total += p[j];
    }
    sum[i] = total;
  }
  /* o_lat[i] [L] = sum_j p_ij c_j / sum_i, j in order */
  float *restrict o_lat = sc->o_lat;
  memset(o_lat, 0, sizeof(float) * (size_t)nh * L);
  for (int j = 0; j < keys; j++) {
    const int64_t slot = context_slot(table, j, g->block_size);
    const float *c = as_f32(g->cache + slot * entry * es, g->is_bf16, sc->row, L);
    for (int i = 0; i < nh; i++) {
      float *restrict ol = o_lat + (int64_t)i * L;
      const float p = scores[(int64_t)i * keys + j];
#pragma omp simd
      for (int l = 0; l < L; l++) ol[l] += p * c[l];
    }
  }
  for (int i = 0; i < nh; i++) {
    const int h = h0 + i;
    float *restrict ol = o_lat + (int64_t)i * L;
    const float inv = sum[i] > 0.f ? 1.f / sum[i] : 0.f;
#pragma omp simd
    for (int l = 0; l < L; l++) ol[l] *= inv;
    /* out [Dv] = W_uv[h] o_lat */
    char *o = g->out + (t * g->heads + h) * (int64_t)Dv * es;
    const int64_t w_head = (int64_t)h * (Dn + Dv);
    for (int v = 0; v < Dv; v++) {
      const float *w = as_f32(g->w + (w_head + Dn + v) * L * es, g->is_bf16, sc->row, L);
      const float y = dot(ol, w, L);
      if (g->is_bf16)
        ((bf16_t *)o)[v] = f32_to_bf16(y);
      else
        ((float *)o)[v] = y;
    }
  }
}

int wick_mla_attention(int dtype, const void *q_nope, int64_t q_token_stride,
                       int64_t q_head_stride, const void *q_pe, const void *latent,
                       int64_t latent_stride, const void *k_pe, int64_t k_pe_stride,
                       const void *w_kv_b, void *kv_cache, const int64_t *slot_mapping,
                       int64_t num_slots, const int32_t *block_tables, int64_t bt_stride,
                       const int32_t *query_start_loc, const int32_t *seq_lens, void *out,
                       int num_seqs, int num_heads, int qk_nope_head_dim, int qk_rope_head_dim,
                       int v_head_dim, int kv_lora_rank, int block_size, float scale,
                       int num_threads, int64_t min_work_per_thread) {
  if (dtype != 0 && dtype != 1) return -4;
  if (num_heads <= 0 || kv_lora_rank <= 0 || qk_rope_head_dim < 0 || qk_nope_head_dim < 0 ||
      v_head_dim <= 0 || block_size <= 0)
    return -2;
  const int is_bf16 = dtype == 1;
  const int64_t es = is_bf16 ? 2 : 4;
  const int L = kv_lora_rank, R = qk_rope_head_dim, entry = L + R;
  const int64_t num_tokens = num_seqs > 0 ? query_start_loc[num_seqs] : 0;
  for (int64_t t = 0; t < num_tokens; t++)
    if (slot_mapping[t] >= num_slots) return -3;
  int max_keys = 1;
  int64_t work = 0;
  for (int s = 0; s < num_seqs; s++) {
    const int qlen = query_start_loc[s + 1] - query_start_loc[s];
    if (qlen < 0 || qlen > seq_lens[s]) return -2;
    if (seq_lens[s] > max_keys) max_keys = seq_lens[s];
    work += (int64_t)qlen * ((seq_lens[s] - qlen / 2) * (int64_t)(2 * L + R) +
                             (int64_t)(qk_nope_head_dim + v_head_dim) * L);
  }
  if (num_tokens == 0) return 0;
  /* each row's sequence */
  int32_t *row_seq = (int32_t *)malloc(sizeof(int32_t) * (size_t)num_tokens);
  if (row_seq == NULL) return -1;
  for (int s = 0; s < num_seqs; s++)
    for (int32_t t = query_start_loc[s]; t < query_start_loc[s + 1]; t++) row_seq[t] = s;
  work *= num_heads;
  num_threads = threads_for(work, min_work_per_thread, num_threads);
  const Geometry g = {
      .is_bf16 = is_bf16,
      .heads = num_heads,
      .nope = qk_nope_head_dim,
      .rope = R,
      .v = v_head_dim,
      .lora = L,
      .block_size = block_size,
      .q_token_stride = q_token_stride,
      .q_head_stride = q_head_stride,
      .scale = scale,
      .q_nope = (const char *)q_nope,
      .q_pe = (const char *)q_pe,
      .w = (const char *)w_kv_b,
      .cache = (const char *)kv_cache,
      .out = (char *)out,
  };
  /* Items: (row, group of heads); whole rows once they keep the threads busy, else each row's
   * heads split in enough groups (the bits are the same either way: `attend`). */
  int groups = 1;
  if (num_tokens < num_threads) {
    groups = (int)((num_threads + num_tokens - 1) / num_tokens);
    if (groups > num_heads) groups = num_heads;
  }
  const int group = (num_heads + groups - 1) / groups;
  groups = (num_heads + group - 1) / group;
  const int64_t num_items = num_tokens * groups;
  int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    /* The store ends in the loop's barrier: every row's entry is in place before any item
     * reads the cache. */
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_tokens; t++) {
      const int64_t slot = slot_mapping[t];
      if (slot < 0) continue;
      char *dst = (char *)kv_cache + slot * entry * es;
      memcpy(dst, (const char *)latent + t * latent_stride * es, (size_t)(L * es));
      memcpy(dst + L * es, (const char *)k_pe + t * k_pe_stride * es, (size_t)(R * es));
    }
    Scratch sc = {0};
    const int width = entry > L ? entry : L;
    sc.q_lat = (float *)malloc(sizeof(float) * (size_t)group * L);
    sc.o_lat = (float *)malloc(sizeof(float) * (size_t)group * L);
    sc.q_pe = (float *)malloc(sizeof(float) * (size_t)group * (R > 0 ? R : 1));
    sc.row = (float *)malloc(sizeof(float) * (size_t)width);
    sc.scores = (float *)malloc(sizeof(float) * (size_t)group * max_keys);
    sc.max = (float *)malloc(sizeof(float) * (size_t)group);
    sc.sum = (float *)malloc(sizeof(float) * (size_t)group);
    const int ok = sc.q_lat && sc.o_lat && sc.q_pe && sc.row && sc.scores && sc.max && sc.sum;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; item++) {
      if (!ok) {
#pragma omp atomic write
        failed = 1;
        continue;
      }
      const int64_t t = item / groups;
      const int h0 = (int)(item % groups) * group;
      const int nh = num_heads - h0 < group ? num_heads - h0 : group;
      const int s = row_seq[t];
      const int qlen = query_start_loc[s + 1] - query_start_loc[s];
      const int i = (int)(t - query_start_loc[s]);
      const int keys = seq_lens[s] - qlen + i + 1;
      attend(&g, t, h0, nh, keys, block_tables + (int64_t)s * bt_stride, &sc);
    }
    free(sc.q_lat);
    free(sc.o_lat);
    free(sc.q_pe);
    free(sc.row);
    free(sc.scores);
    free(sc.max);
    free(sc.sum);
  }
  free(row_seq);
  return failed ? -1 : 0;
}
