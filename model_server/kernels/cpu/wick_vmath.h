/* Vector math of the attention kernels (paged_attention.c, varlen_attention.c) on wick_vec.h's
 * vectors: lane masks, max, the softmax's exp and the bf16 store. Everything is static inline:
 * each kernel file is its own translation unit of one library. */
#ifndef WICK_VMATH_H
#define WICK_VMATH_H

#include <stdint.h>
#include <string.h>

#include "wick_cpu.h"
#include "wick_vec.h"

typedef int32_t vi __attribute__((vector_size(VW * sizeof(int32_t))));

/* Every lane x: x - 0 is x for every x (x + 0 is not, for -0.f, and would stay an add). */
static inline vf vsplat(const float x) { return x - (vf){0}; }

static inline void vstore(float *p, const vf v) { memcpy(p, &v, sizeof v); }

static inline vf vmax(const vf a, const vf b) {
  const vi a_wins = a > b;
  return (vf)(((vi)a & a_wins) | ((vi)b & ~a_wins));
}

/* exp_nonpositive (wick_cpu.h) on a vector: the same reduction and polynomial, with fused
 * multiply-adds where the ISA has them (then within an ulp of the scalar one, not equal). */
static inline vf vexp_nonpositive(vf x) {
  x = vmax(x, vsplat(-87.f));
  const vf n =
      __builtin_convertvector(__builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi), vf);
  const vf r = vfma(n, vsplat(2.12194440e-4f), vfma(n, vsplat(-0.693359375f), x));
  vf p = vsplat(1.9875691500e-4f);
  p = vfma(p, r, vsplat(1.3981999507e-3f));
  p = vfma(p, r, vsplat(8.3334519073e-3f));
  p = vfma(p, r, vsplat(4.1665795894e-2f));
  p = vfma(p, r, vsplat(1.6666665459e-1f));
  p = vfma(p, r, vsplat(5.0000001201e-1f));
  p = vfma(p * r, r, r) + 1.f;
  return (vf)((vi)p + (__builtin_convertvector(n, vi) << 23));
}

/* fp32 -> bf16 lane by lane as f32_to_bf16: round to nearest even, NaN stays a quiet NaN. */
static inline void vstore_bf16(bf16_t *p, const vf x) {
  const vu u = (vu)x;
  const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const vu quiet_nan = (u >> 16) | 0x40u;
  const vu is_nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
  const vh h = __builtin_convertvector((rounded & ~is_nan) | (quiet_nan & is_nan), vh);
  memcpy(p, &h, sizeof h);
}

#endif /* WICK_VMATH_H */
