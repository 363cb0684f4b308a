/* The vector layer shared by the CPU kernels' vectorized loops (gemm.c, paged_attention.c): GCC /
 * Clang vector extensions at the build's native width, so that one source serves every ISA
 * build. A vf is one zmm (AVX-512), ymm (AVX2) or xmm (generic) of VW floats; loads go through
 * memcpy (unaligned); intrinsics only where one instruction does what the generic code splits. */
#ifndef WICK_VEC_H
#define WICK_VEC_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "wick_cpu.h"

#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX2__)
#define VW 8
#else
#define VW 4
#endif

typedef float vf __attribute__((vector_size(VW * sizeof(float))));
typedef uint32_t vu __attribute__((vector_size(VW * sizeof(uint32_t))));
typedef uint16_t vh __attribute__((vector_size(VW * sizeof(uint16_t))));

static inline vf vload(const float *p) {
  vf v;
  memcpy(&v, p, sizeof v);
  return v;
}

/* VW bf16 values as fp32 (exact: the bf16 bits are the fp32's upper half). GCC 12 splits the
 * generic widening into 128-bit pieces, hence the intrinsics where there is one instruction. */
static inline vf vload_bf16(const bf16_t *p) {
#if VW == 16
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif VW == 8
  return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
  vh h;
  memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vu) << 16);
#endif
}

/* a * b + c, fused where the ISA has FMA: under -std=c11 GCC does not contract a * b + c. */
static inline vf vfma(const vf a, const vf b, const vf c) {
#if VW == 16
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif VW == 8 && defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

#endif /* WICK_VEC_H */
