/* Helpers shared by the CPU kernels (the .c files of kernels/cpu): bf16 <-> fp32, a vectorizable
 * exp, the thread count for a call's work and an act-order column gather. Everything is static inline: each kernel file is
 * its own translation unit of one library. Type punning goes through unions (built with
 * -fno-strict-aliasing). */
#ifndef WICK_CPU_H
#define WICK_CPU_H

#include <stdint.h>
#include <stdlib.h>

typedef uint16_t bf16_t;

/* exp(x) for x <= 0 (scores minus their row max) in plain arithmetic, so that the softmax loop
 * vectorizes (glibc's expf is one scalar call per score). Cephes' expf: x = n ln2 + r, ln2 split
 * in two for exactness, e^r by a polynomial, 2^n added to the exponent bits. Relative error
 * below 1e-7; inputs below -87 are clamped (e^-87 ~ 1.6e-38, nothing next to the max's 1). */
static inline float exp_nonpositive(float x) {
  /* x = max(x, -87) as a select of bits: GCC sinks the math below into the branches of a
   * conditional on x, and then no longer vectorizes the caller's loop. */
  union {
    float f;
    int32_t i;
  } clamped = {x}, floor = {-87.f};
  const int32_t below = -(int32_t)(x < -87.f);
  clamped.i = (clamped.i & ~below) | (floor.i & below);
  x = clamped.f;
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

/* bf16 row -> fp32 row times `mul`: the bf16 bits are the fp32's upper half. */
static inline void bf16_to_f32_row(const bf16_t *restrict src, float *restrict dst, float mul,
                                   int n) {
  uint32_t *restrict bits = (uint32_t *)dst;
#pragma omp simd
  for (int i = 0; i < n; i++) bits[i] = (uint32_t)src[i] << 16;
  if (mul != 1.f) {
#pragma omp simd
    for (int i = 0; i < n; i++) dst[i] *= mul;
  }
}

/* fp32 -> bf16, round to nearest even; NaN stays a (quiet) NaN. */
static inline bf16_t f32_to_bf16(float f) {
  union {
    float f;
    uint32_t u;
  } b = {f};
  if ((b.u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((b.u >> 16) | 0x40u);
  return (bf16_t)((b.u + 0x7fffu + ((b.u >> 16) & 1u)) >> 16);
}

/* One bf16 value as fp32 (exact: the bf16 bits are the fp32's upper half). */
static inline float bf16_to_f32(const bf16_t b) {
  union {
    uint32_t u;
    float f;
  } bits = {(uint32_t)b << 16};
  return bits.f;
}

/* f rounded to the nearest bf16 (ties to even), kept as fp32: the value PyTorch's bf16 ops
 * store, without the branch of f32_to_bf16 (NaN stays a quiet NaN), so loops vectorize. */
static inline float round_to_bf16(const float f) {
  union {
    float f;
    uint32_t u;
  } b = {f};
  const uint32_t rounded = (b.u + 0x7fffu + ((b.u >> 16) & 1u)) & 0xffff0000u;
  const uint32_t quiet_nan = (b.u & 0xffff0000u) | 0x00400000u;
  b.u = (b.u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
  return b.f;
}

/* Threads worth using for `work` units when each thread should get at least
 * `min_work_per_thread` of them (0: all `num_threads`); at least 1. Small calls (a batch-1
 * decode) stay on the calling thread instead of paying a fork/join, which on a loaded machine
 * can wait a whole scheduler tick for a descheduled thread. */
static inline int threads_for(const int64_t work, const int64_t min_work_per_thread,
                              const int num_threads) {
  if (min_work_per_thread <= 0 || work / min_work_per_thread >= num_threads)
    return num_threads > 1 ? num_threads : 1;
  return work / min_work_per_thread > 1 ? (int)(work / min_work_per_thread) : 1;
}

/* x [m, k] bf16 (rows `x_stride` elements apart) as a new fp32 [m, k] buffer, for kernels that
 * read x as fp32 rows: malloc'ed (the caller frees it), NULL when out of memory. */
static inline float *widen_bf16_rows(const bf16_t *x, const int64_t m, const int64_t k,
                                     const int64_t x_stride) {
  float *rows = (float *)malloc(sizeof(float) * (size_t)(m > 0 ? m : 1) * (k > 0 ? k : 1));
  if (rows != NULL)
    for (int64_t r = 0; r < m; r++) bf16_to_f32_row(x + r * x_stride, rows + r * k, 1.f, (int)k);
  return rows;
}

/* dst [m, k] = the columns of src [m, k] in the order perm [k] (elements of `es` bytes): an
 * act-order GPTQ weight's input, whose codes are stored in that order (WNA16Weight.apply's
 * index_select: the same values, so the same bits). */
static inline void gather_columns(const int64_t es, const void *restrict src,
                                  const int64_t *restrict perm, void *restrict dst,
                                  const int64_t m, const int64_t k) {
  for (int64_t t = 0; t < m; t++) {
    if (es == 2) {
      const uint16_t *x = (const uint16_t *)src + t * k;
      uint16_t *y = (uint16_t *)dst + t * k;
      for (int64_t i = 0; i < k; i++) y[i] = x[perm[i]];
    } else {
      const uint32_t *x = (const uint32_t *)src + t * k;
      uint32_t *y = (uint32_t *)dst + t * k;
      for (int64_t i = 0; i < k; i++) y[i] = x[perm[i]];
    }
  }
}

#endif /* WICK_CPU_H */
