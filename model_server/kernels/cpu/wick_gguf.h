/* What the GGUF kernels (gguf_gemm.c: codes widened to float; gguf_q8.c: int8 dot products on
 * activations quantized per 32 values) share: the ggml type ids, block shapes, the f16 scale
 * fields, the K-quants' packed 6-bit scales, and the output store in x's dtype. Static inline:
 * each kernel file is its own translation unit of one library. */
#ifndef WICK_GGUF_H
#define WICK_GGUF_H

#include <stdint.h>
#include <string.h>

#include "wick_cpu.h"
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* ggml type ids (gguf.GGMLQuantizationType) */
enum {
  T_F32 = 0,
  T_F16 = 1,
  T_Q4_0 = 2,
  T_Q4_1 = 3,
  T_Q5_0 = 6,
  T_Q5_1 = 7,
  T_Q8_0 = 8,
  T_Q2_K = 10,
  T_Q3_K = 11,
  T_Q4_K = 12,
  T_Q5_K = 13,
  T_Q6_K = 14,
  T_BF16 = 30,
};

/* IEEE half (little-endian bytes) -> float. */
static inline float f16_at(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  union {
    uint32_t u;
    float f;
  } v;
  if (exp == 0) {
    v.f = (float)mant * (1.f / 16777216.f); /* zero or subnormal: mant * 2^-24 */
    v.u |= sign;
  } else if (exp == 31) {
    v.u = sign | 0x7f800000u | (mant << 13);
  } else {
    v.u = sign | ((exp + 112u) << 23) | (mant << 13);
  }
  return v.f;
#endif
}

/* Elements and bytes per block; 0 for a type this file does not know. Float types are read in
 * "blocks" of 32 values so that one loop serves every type. */
static inline int block_shape(const int type, int *elems, int *bytes) {
  switch (type) {
    case T_F32: *elems = 32, *bytes = 128; return 1;
    case T_F16: *elems = 32, *bytes = 64; return 1;
    case T_BF16: *elems = 32, *bytes = 64; return 1;
    case T_Q4_0: *elems = 32, *bytes = 18; return 1;
    case T_Q4_1: *elems = 32, *bytes = 20; return 1;
    case T_Q5_0: *elems = 32, *bytes = 22; return 1;
    case T_Q5_1: *elems = 32, *bytes = 24; return 1;
    case T_Q8_0: *elems = 32, *bytes = 34; return 1;
    case T_Q2_K: *elems = 256, *bytes = 84; return 1;
    case T_Q3_K: *elems = 256, *bytes = 110; return 1;
    case T_Q4_K: *elems = 256, *bytes = 144; return 1;
    case T_Q5_K: *elems = 256, *bytes = 176; return 1;
    case T_Q6_K: *elems = 256, *bytes = 210; return 1;
    default: return 0;
  }
}

/* The j-th 6-bit (scale, min) pair of a Q4_K / Q5_K block's 12 packed bytes. */
static inline void scale_min_k4(const int j, const uint8_t *restrict q, int *d, int *m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

static inline void store(void *y, const int dtype, const int64_t idx, const float v) {
  if (dtype == 0)
    ((float *)y)[idx] = v;
  else
    ((bf16_t *)y)[idx] = f32_to_bf16(v);
}

static inline float load_bias(const void *bias, const int dtype, const int64_t j) {
  if (bias == NULL) return 0.f;
  return dtype == 0 ? ((const float *)bias)[j] : bf16_to_f32(((const bf16_t *)bias)[j]);
}

#endif /* WICK_GGUF_H */
