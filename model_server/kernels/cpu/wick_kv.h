/* KV cache formats of paged attention (wick_attend.h, paged_attention.c; `--kv-cache-dtype`,
 * kernels/kv_cache_dtype.py): how a cached K or V row is read as fp32 and how the KV-cache store
 * writes one.
 *
 * Float caches: KV_F32 and KV_BF16 (the values 0 and 1 of the kernel's `is_bf16`, so a cache in
 * the query's dtype passes is_bf16 as its format). Quantized caches (KV_I8, KV_E4M3, KV_E5M2):
 * one byte per value (int8, or fp8 e4m3fn / e5m2 bits) and a float32 scale per slot and kv head,
 * scales[slot * num_kv_heads + head]: a cached row reads as codes * scale. Rows start at
 * multiples of head_dim elements in the cache, so the scale of the row at element `at` is
 * scales[at / head_dim].
 *
 * The store quantizes as kv_cache_dtype.quantize_kv does, bit for bit: scale = max|x| / QMAX
 * (127, 448, 57344), codes = x / scale (an all-zero row divides by 1) clamped to +-QMAX, then
 * rounded half to even (int8) or to the nearest fp8 value, ties to even.
 *
 * Reading fp8: a fp8 byte moved into the bits of an fp16 is that fp16 value exactly (e5m2: the
 * fp16's upper byte; e4m3: sign, then its 4 exponent and 3 mantissa bits below the fp16's top
 * exponent bit, which is the value / 256, subnormals included), and F16C (part of the AVX2 and
 * AVX-512 builds) converts fp16 to fp32 in one instruction. */
#ifndef WICK_KV_H
#define WICK_KV_H

#include <stdint.h>
#include <string.h>

#include "wick_cpu.h"
#include "wick_vec.h"

#define KV_F32 0
#define KV_BF16 1
#define KV_I8 2
#define KV_E4M3 3
#define KV_E5M2 4
#define KV_QUANT(kv) ((kv) >= KV_I8)

static inline size_t kv_elem_size(const int kv) {
  return kv == KV_F32 ? sizeof(float) : kv == KV_BF16 ? sizeof(bf16_t) : 1;
}

static inline float kv_qmax(const int kv) {
  return kv == KV_I8 ? 127.f : kv == KV_E4M3 ? 448.f : 57344.f;
}

/* fp16 bits -> fp32 (the generic build's path; finite inputs). */
static inline float f16_bits_to_f32(const uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  union {
    uint32_t u;
    float f;
  } bits;
  if (e == 0) {
    const float f = (float)m * 5.9604644775390625e-08f; /* subnormal: m * 2^-24 */
    return sign ? -f : f;
  }
  bits.u = sign | (e == 31 ? 0x7f800000u : (e + 112u) << 23) | (m << 13);
  return bits.f;
}

/* The fp16 bits holding fp8 byte b exactly (e5m2), or b's value / 256 (e4m3). */
static inline uint16_t fp8_as_f16_bits(const uint8_t b, const int kv) {
  if (kv == KV_E5M2) return (uint16_t)(b << 8);
  return (uint16_t)(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));
}

/* One quantized code as fp32, unscaled. */
static inline float kv_code(const void *cache, const int64_t i, const int kv) {
  const uint8_t b = ((const uint8_t *)cache)[i];
  if (kv == KV_I8) return (float)(int8_t)b;
  const float f = f16_bits_to_f32(fp8_as_f16_bits(b, kv));
  return kv == KV_E4M3 ? f * 256.f : f;
}

/* One cached value as fp32, unscaled. */
static inline float kv_value(const void *cache, const int64_t i, const int kv) {
  if (kv == KV_F32) return ((const float *)cache)[i];
  if (kv == KV_BF16) return bf16_to_f32(((const bf16_t *)cache)[i]);
  return kv_code(cache, i, kv);
}

/* VW quantized codes from element `at` as fp32, unscaled. */
static inline vf vload_code(const void *cache, const int64_t at, const int kv) {
  const uint8_t *p = (const uint8_t *)cache + at;
#if VW == 16
  if (kv == KV_I8)
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
  __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
  if (kv == KV_E5M2) return (vf)_mm512_cvtph_ps(_mm256_slli_epi16(h, 8));
  h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8),
                      _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7f)), 7));
  return (vf)_mm512_cvtph_ps(h) * 256.f;
#elif VW == 8
  if (kv == KV_I8)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
  __m128i h = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
  if (kv == KV_E5M2) return (vf)_mm256_cvtph_ps(_mm_slli_epi16(h, 8));
  h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x80)), 8),
                   _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7f)), 7));
  return (vf)_mm256_cvtph_ps(h) * 256.f;
#else
  vf v;
  for (int i = 0; i < VW; i++) v[i] = kv_code(p, i, kv);
  return v;
#endif
}

/* fp32 y (finite, |y| <= the format's largest value) -> the nearest fp8 e4m3fn / e5m2 bits,
 * ties to even, subnormals included: the rounding of PyTorch's cast, in integer arithmetic. */
static inline uint8_t f32_to_fp8(const float y, const int kv) {
  const int mbits = kv == KV_E4M3 ? 3 : 2, bias = kv == KV_E4M3 ? 7 : 15;
  union {
    float f;
    uint32_t u;
  } bits = {y};
  const uint32_t sign = (bits.u >> 24) & 0x80u, u = bits.u & 0x7fffffffu;
  const int e = (int)(u >> 23) - 127 + bias; /* the fp8 biased exponent */
  uint32_t mant = u & 0x7fffffu, base = 0;
  int sh = 23 - mbits;
  if (e >= 1) {
    base = (uint32_t)e << mbits;
  } else {
    mant |= 0x800000u; /* below the fp8 normals: the implicit bit shifts in as a subnormal */
    sh += 1 - e;
    if (u < 0x800000u || sh > 24) return (uint8_t)sign; /* rounds to zero */
  }
  const uint32_t q = mant >> sh, rem = mant & ((1u << sh) - 1), half = 1u << (sh - 1);
  return (uint8_t)(sign | (base + q + (rem > half || (rem == half && (q & 1u)))));
}

/* One token's row of head_dim values (fp32 or bf16 by is_bf16) -> codes and scale: the row's
 * own scale max|x| / qmax, or `fixed` > 0 (a static per-layer scale from a calibration file:
 * values beyond qmax * fixed clamp). */
static inline void quantize_row(const void *x, const int is_bf16, const int kv, const int head_dim,
                                const float fixed, uint8_t *restrict codes,
                                float *restrict scale) {
  float row[512]; /* head_dim <= native.MAX_HEAD_DIM */
  float amax = 0.f;
  for (int d = 0; d < head_dim; d++) {
    row[d] = is_bf16 ? bf16_to_f32(((const bf16_t *)x)[d]) : ((const float *)x)[d];
    const float a = row[d] < 0.f ? -row[d] : row[d];
    amax = a > amax ? a : amax;
  }
  const float qmax = kv_qmax(kv), s = fixed > 0.f ? fixed : amax / qmax, div = s > 0.f ? s : 1.f;
  *scale = s;
  for (int d = 0; d < head_dim; d++) {
    float y = row[d] / div;
    y = y > qmax ? qmax : y < -qmax ? -qmax : y;
    codes[d] = kv == KV_I8 ? (uint8_t)(int8_t)__builtin_nearbyintf(y) : f32_to_fp8(y, kv);
  }
}

#endif /* WICK_KV_H */
