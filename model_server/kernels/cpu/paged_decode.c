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
 * Work is split over (sequence, kv head) pairs; each pair streams its K rows once into a
 * scores buffer (group x seq_len), takes an exact softmax, then streams its V rows once.
 * Built by kernels/cpu/native.py with -O3 (-march=native, -fopenmp when available).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int wick_paged_decode_f32(const float *restrict q, const float *restrict k_cache,
                          const float *restrict v_cache, const int32_t *restrict block_tables,
                          int64_t bt_stride, const int32_t *restrict seq_lens,
                          float *restrict out, int num_seqs, int num_heads, int num_kv_heads,
                          int head_dim, int block_size, float scale, int num_threads) {
  const int group = num_heads / num_kv_heads;
  const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
  const int64_t block_stride = (int64_t)block_size * token_stride;
  int failed = 0;
#pragma omp parallel num_threads(num_threads)
  {
    float *scores = NULL; /* [group, seq_len], grown per thread as needed */
    int64_t capacity = 0;
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int s = 0; s < num_seqs; s++) {
      for (int kh = 0; kh < num_kv_heads; kh++) {
        const int len = seq_lens[s];
        if ((int64_t)group * len > capacity) {
          free(scores);
          capacity = (int64_t)group * len;
          scores = (float *)malloc(sizeof(float) * capacity);
        }
        if (scores == NULL) {
          capacity = 0;
#pragma omp atomic write
          failed = 1;
          continue;
        }
        const float *qs = q + ((int64_t)s * num_heads + (int64_t)kh * group) * head_dim;
        const int32_t *table = block_tables + (int64_t)s * bt_stride;
        float row_max[group];
        for (int g = 0; g < group; g++) row_max[g] = -FLT_MAX;

        for (int t = 0; t < len; t++) {
          const float *k = k_cache + (int64_t)table[t / block_size] * block_stride +
                           (int64_t)(t % block_size) * token_stride + (int64_t)kh * head_dim;
          for (int g = 0; g < group; g++) {
            const float *qg = qs + (int64_t)g * head_dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < head_dim; d++) dot += qg[d] * k[d];
            dot *= scale;
            scores[(int64_t)g * len + t] = dot;
            if (dot > row_max[g]) row_max[g] = dot;
          }
        }

        float inv_sum[group];
        for (int g = 0; g < group; g++) {
          float *row = scores + (int64_t)g * len;
          float sum = 0.f;
          for (int t = 0; t < len; t++) {
            row[t] = expf(row[t] - row_max[g]);
            sum += row[t];
          }
          inv_sum[g] = 1.f / sum;
        }

        float *os = out + ((int64_t)s * num_heads + (int64_t)kh * group) * head_dim;
        memset(os, 0, sizeof(float) * (size_t)group * head_dim);
        for (int t = 0; t < len; t++) {
          const float *v = v_cache + (int64_t)table[t / block_size] * block_stride +
                           (int64_t)(t % block_size) * token_stride + (int64_t)kh * head_dim;
          for (int g = 0; g < group; g++) {
            const float p = scores[(int64_t)g * len + t];
            float *og = os + (int64_t)g * head_dim;
#pragma omp simd
            for (int d = 0; d < head_dim; d++) og[d] += p * v[d];
          }
        }
        for (int g = 0; g < group; g++) {
          float *og = os + (int64_t)g * head_dim;
          for (int d = 0; d < head_dim; d++) og[d] *= inv_sum[g];
        }
      }
    }
    free(scores);
  }
  return failed ? -1 : 0;
}
