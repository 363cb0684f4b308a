/* Paged decode attention for CPUs: one query token per sequence, read straight from the paged
 * KV cache (no gather into a padded copy), grouped-query heads sharing each K/V row.
 *
 * Shapes (fp32, contiguous):
 *   q            [num_seqs, num_heads, head_dim]
 *   k/v_cache    [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables [num_seqs, >= ceil(seq_len / block_size)] int32, row stride `bt_stride`
 *   seq_lens     [num_seqs] int32, each >= 1
 *   out          [num_seqs, num_heads, head_dim]
 * Query head h uses KV head h / (num_heads / num_kv_heads).
 *
 * Work items are (sequence, range of kv heads): all of a sequence's kv heads when there are
 * enough sequences to keep every thread busy, so each token's K/V row (num_kv_heads * head_dim
 * floats) is read from memory in one contiguous run; one kv head per item for small batches.
 * An item streams its K rows once into a scores buffer, takes an exact softmax, then streams its
 * V rows once. Built by kernels/cpu/native.py with -O3 (-march=native, -fopenmp when available).
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* exp(x) for x <= 0 (scores minus their row max) in plain arithmetic, so that the softmax loop
 * vectorizes (glibc's expf is one scalar call per score). Cephes' expf: x = n ln2 + r, ln2 split
 * in two for exactness, e^r by a polynomial, 2^n added to the exponent bits. Relative error
 * below 1e-7; inputs below -87 are clamped (e^-87 ~ 1.6e-38, nothing next to the max's 1). */
static inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float n = (float)(int)(x * 1.44269504088896341f - 0.5f); /* rounded, x <= 0 */
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  union {
    float f;
    int32_t i;
  } bits = {p};
  bits.i += (int32_t)n << 23;
  return bits.f;
}

/* Geometry shared by every work item of one call. */
typedef struct {
  int group;            /* query heads per kv head */
  int block_size;
  int64_t token_stride; /* floats between consecutive tokens of a block */
  int64_t block_stride; /* floats between blocks */
  float scale;
} Geometry;

/* Query heads [kh0 * group, (kh0 + nkh) * group) of one sequence against its `len` cached
 * tokens. `qs` and `os` point at the sequence's head kh0 * group; `scores` holds
 * nkh * group * len floats. Always inlined into one copy per common head_dim, so the inner
 * loops have constant trip counts (unrolled, in registers): ~1.5x faster than a runtime one. */
static inline __attribute__((always_inline)) void attend(
    const int head_dim, const Geometry *geo, const int kh0, const int nkh, const int len,
    const float *restrict qs, const float *restrict k_cache, const float *restrict v_cache,
    const int32_t *restrict table, float *restrict scores, float *restrict os) {
  const int group = geo->group;
  const int rows = nkh * group;
  const int num_blocks = (len + geo->block_size - 1) / geo->block_size;
  float row_max[rows];
  for (int r = 0; r < rows; r++) row_max[r] = -FLT_MAX;

  /* Q K^T, block by block (no division per token), a token's kv heads back to back. */
  for (int b = 0; b < num_blocks; b++) {
    const int64_t base = (int64_t)table[b] * geo->block_stride + (int64_t)kh0 * head_dim;
    const int t0 = b * geo->block_size;
    const int n = len - t0 < geo->block_size ? len - t0 : geo->block_size;
    for (int o = 0; o < n; o++) {
      const float *krow = k_cache + base + (int64_t)o * geo->token_stride;
      for (int r = 0; r < rows; r++) {
        const float *k = krow + (int64_t)(r / group) * head_dim;
        const float *qr = qs + (int64_t)r * head_dim;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < head_dim; d++) dot += qr[d] * k[d];
        dot *= geo->scale;
        scores[(int64_t)r * len + t0 + o] = dot;
        if (dot > row_max[r]) row_max[r] = dot;
      }
    }
  }

  float inv_sum[rows];
  for (int r = 0; r < rows; r++) {
    float *row = scores + (int64_t)r * len;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < len; t++) {
      row[t] = exp_nonpositive(row[t] - row_max[r]);
      sum += row[t];
    }
    inv_sum[r] = 1.f / sum;
  }

  /* P V in the same order; the output rows (rows * head_dim floats) stay in L1. */
  memset(os, 0, sizeof(float) * (size_t)rows * head_dim);
  for (int b = 0; b < num_blocks; b++) {
    const int64_t base = (int64_t)table[b] * geo->block_stride + (int64_t)kh0 * head_dim;
    const int t0 = b * geo->block_size;
    const int n = len - t0 < geo->block_size ? len - t0 : geo->block_size;
    for (int o = 0; o < n; o++) {
      const float *vrow = v_cache + base + (int64_t)o * geo->token_stride;
      for (int r = 0; r < rows; r++) {
        const float *v = vrow + (int64_t)(r / group) * head_dim;
        const float p = scores[(int64_t)r * len + t0 + o];
        float *out_r = os + (int64_t)r * head_dim;
#pragma omp simd
        for (int d = 0; d < head_dim; d++) out_r[d] += p * v[d];
      }
    }
  }
  for (int r = 0; r < rows; r++) {
    float *out_r = os + (int64_t)r * head_dim;
    for (int d = 0; d < head_dim; d++) out_r[d] *= inv_sum[r];
  }
}

/* Returns 0, or -1 when a scores buffer could not be allocated (the output is then partial). */
int wick_paged_decode_f32(const float *restrict q, const float *restrict k_cache,
                          const float *restrict v_cache, const int32_t *restrict block_tables,
                          int64_t bt_stride, const int32_t *restrict seq_lens,
                          float *restrict out, int num_seqs, int num_heads, int num_kv_heads,
                          int head_dim, int block_size, float scale, int num_threads) {
  const Geometry geo = {
      .group = num_heads / num_kv_heads,
      .block_size = block_size,
      .token_stride = (int64_t)num_kv_heads * head_dim,
      .block_stride = (int64_t)block_size * num_kv_heads * head_dim,
      .scale = scale,
  };
  /* Whole sequences per item once there are a few per thread; else one kv head per item. */
  const int heads_per_item = num_seqs >= 4 * num_threads ? num_kv_heads : 1;
  const int items_per_seq = num_kv_heads / heads_per_item;
  const int num_items = num_seqs * items_per_seq;
  int failed = 0;
#pragma omp parallel num_threads(num_threads)
  {
    float *scores = NULL; /* [heads_per_item * group, seq_len], grown per thread as needed */
    int64_t capacity = 0;
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < num_items; item++) {
      const int s = item / items_per_seq;
      const int kh0 = (item % items_per_seq) * heads_per_item;
      const int len = seq_lens[s];
      const int64_t need = (int64_t)heads_per_item * geo.group * len;
      if (need > capacity) {
        free(scores);
        scores = (float *)malloc(sizeof(float) * need);
        capacity = scores == NULL ? 0 : need;
      }
      if (scores == NULL) {
#pragma omp atomic write
        failed = 1;
        continue;
      }
      const int64_t head0 = (int64_t)s * num_heads + (int64_t)kh0 * geo.group;
      const float *qs = q + head0 * head_dim;
      float *os = out + head0 * head_dim;
      const int32_t *table = block_tables + (int64_t)s * bt_stride;
      switch (head_dim) {
        case 64:
          attend(64, &geo, kh0, heads_per_item, len, qs, k_cache, v_cache, table, scores, os);
          break;
        case 128:
          attend(128, &geo, kh0, heads_per_item, len, qs, k_cache, v_cache, table, scores, os);
          break;
        default:
          attend(head_dim, &geo, kh0, heads_per_item, len, qs, k_cache, v_cache, table, scores,
                 os);
          break;
      }
    }
    free(scores);
  }
  return failed ? -1 : 0;
}
