/* Matmuls on GGUF block-quantized weights with integer dot products (llama.cpp's way):
 * y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), W kept as the GGUF stores it (gguf_gemm.c has
 * the shapes and the ggml layouts), x quantized to int8 per 32 values once per call.
 *
 * x quantization (`quantize_x`, also exported for the tests as wick_gguf_q8_quantize): per
 * row and block of 32 values, dx = max|x| / 127 and qx = round-to-nearest-even(x * (1 / dx)),
 * so x ~ xq = dx * qx with |qx| <= 127 (an all-zero block has dx = 0, qx = 0). Each block also
 * keeps sx = dx * sum(qx). The kernel computes W @ xq exactly up to fp32 rounding of the
 * per-block terms: the only approximation is x -> xq (half a step of 1/254 of the block's
 * largest |x| per value), the same rounding as llama.cpp's Q8_0 / Q8_1 activations.
 *
 * Per weight block of 32 values (a K-quant super-block is 8 of them) the codes are unpacked
 * to 32 bytes c with w = a * c + o (a: the block's scale, or d * sub-block scale; o: the
 * offset, 0 for the signed formats), then for every row of x:
 *     sum_i w_i xq_i = a * dx * sum_i c_i qx_i + o * sx.
 * The integer sum is one vpdpbusd (u8 x s8 -> 8 int32 lanes) on AVX-512 VNNI builds,
 * vpmaddubsw + vpmaddwd on AVX2 (and AVX-512 without VNNI); the lanes are scaled by a * dx in
 * fp32 and accumulated in 8 float lanes, summed once per output. Signed codes (Q8_0, Q6_K's
 * q - 32) use the sign trick: |c| as the unsigned operand, qx negated where c < 0 (|qx| <= 127,
 * so vpmaddubsw never saturates: 2 * 128 * 127 < 2^15). The generic build does the same sums
 * in plain integer loops.
 *
 * Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (wick_gguf_q8_supports); others (Q2_K,
 * Q3_K, floats) return -1 and run the float kernels of gguf_gemm.c.
 *
 * Threads: contiguous ranges of W's rows (W read once per call in its packed size); each W
 * block is unpacked once per 4 rows of x (register tiles of 1 W row x up to 4 x rows).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "wick_cpu.h"
#include "wick_gguf.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* Rows of x per register tile. */
#define Q8_TILE 4

int wick_gguf_q8_supports(const int type) {
  switch (type) {
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0:
    case T_Q4_K: case T_Q5_K: case T_Q6_K: return 1;
    default: return 0;
  }
}

/* Whether this build's integer dot product is vpdpbusd (for the tests and the log). */
int wick_gguf_q8_has_vnni(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return 1;
#else
  return 0;
#endif
}

/* x [m, k] (fp32 or bf16, rows x_stride apart) -> q [m, k] int8, d [m, k/32], s [m, k/32]. */
static void quantize_x(const int dtype, const void *x, const int64_t x_stride, const int64_t m,
                       const int64_t k, int8_t *restrict q, float *restrict d, float *restrict s) {
  const int64_t nb = k / 32;
  for (int64_t i = 0; i < m; i++) {
    for (int64_t b = 0; b < nb; b++) {
      float v[32];
      if (dtype == 0)
        memcpy(v, (const float *)x + i * x_stride + b * 32, sizeof v);
      else
        bf16_to_f32_row((const bf16_t *)x + i * x_stride + b * 32, v, 1.f, 32);
      float amax = 0.f;
      for (int e = 0; e < 32; e++) amax = fmaxf(amax, fabsf(v[e]));
      const float dx = amax / 127.f, inv = dx > 0.f ? 1.f / dx : 0.f;
      int8_t *restrict qb = q + i * k + b * 32;
      int sum = 0;
#if defined(__AVX2__)
      const __m256 iv = _mm256_set1_ps(inv);
      __m256i r[4];
      for (int h = 0; h < 4; h++)  /* round to nearest even (MXCSR default), as rintf */
        r[h] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * h), iv));
      const __m256i p16 = _mm256_packs_epi32(r[0], r[1]), p16b = _mm256_packs_epi32(r[2], r[3]);
      /* packs interleave 128-bit lanes: restore the order with one permute */
      const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16, p16b),
                                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256((__m256i *)qb, p8);
      for (int e = 0; e < 32; e++) sum += qb[e];
#else
      for (int e = 0; e < 32; e++) {
        const int c = (int)rintf(v[e] * inv);
        qb[e] = (int8_t)c;
        sum += c;
      }
#endif
      d[i * nb + b] = dx;
      s[i * nb + b] = dx * (float)sum;
    }
  }
}

/* For the tests: the quantization above, q [m, k] int8 and d [m, k/32] fp32. Returns -1 when
 * k is not a multiple of 32, -2 without memory. */
int wick_gguf_q8_quantize(const int dtype, const void *x, const int64_t x_stride, const int64_t m,
                          const int64_t k, int8_t *q, float *d) {
  if (k % 32) return -1;
  float *s = malloc(sizeof(float) * (size_t)(m * (k / 32) + 1));
  if (s == NULL) return -2;
  quantize_x(dtype, x, x_stride, m, k, q, d, s);
  free(s);
  return 0;
}

/* The quantized x of one call: row t of q at q + t * k; d and s at t * nb. */
typedef struct {
  const int8_t *q;
  const float *d, *s;
  int64_t k, nb;
} xq_t;

#if defined(__AVX2__)
/* ---- AVX2 / AVX-512 builds: 32 codes in one ymm ------------------------------------------- */

/* sum of u[i] * s[i] over each group of 4 bytes -> 8 int32 lanes (u unsigned, s signed). */
static inline __m256i dot_u8s8(const __m256i u, const __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* 16 bytes of nibbles -> 32 codes: byte j's low nibble at j, its high nibble at j + 16. */
static inline __m256i nibbles16(const uint8_t *qs) {
  const __m128i v = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

/* Bit e of `bits` -> byte e = 0x10 (set) or 0 (Q5_0 / Q5_1's fifth bits). */
static inline __m256i fifth_bits(const uint32_t bits) {
  const __m256i shuf = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                          0x0303030303030303LL);
  const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  const __m256i r = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuf), sel);
  return _mm256_and_si256(_mm256_cmpeq_epi8(r, sel), _mm256_set1_epi8(0x10));
}

static inline float hsum8(const __m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* acc[t] += (a * dx_t) * sum(c * qx_t) and off[t] += o * sx_t for x block xb of every tile row.
 * `a` is a vector (Q6_K's two 16-value scales differ within a block); o == 0: no offset. */
#define APPLY_UNSIGNED(C, A, O, XB)                                                             \
  do {                                                                                          \
    for (int t = 0; t < MT; t++) {                                                              \
      const __m256i p_ = dot_u8s8((C), load32(xq->q + (t0 + t) * xq->k + (XB) * 32));           \
      const __m256 scale_ = _mm256_mul_ps((A), _mm256_set1_ps(xq->d[(t0 + t) * xq->nb + (XB)]));   \
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p_), scale_, acc[t]);                              \
      off[t] += (O) * xq->s[(t0 + t) * xq->nb + (XB)];                                          \
    }                                                                                           \
  } while (0)

/* The same for signed codes C (as int8): |C| times qx with C's signs. */
#define APPLY_SIGNED(C, A, XB)                                                                  \
  do {                                                                                          \
    const __m256i u_ = _mm256_abs_epi8(C);                                                       \
    for (int t = 0; t < MT; t++) {                                                              \
      const __m256i sx_ = _mm256_sign_epi8(load32(xq->q + (t0 + t) * xq->k + (XB) * 32), (C));   \
      const __m256 scale_ = _mm256_mul_ps((A), _mm256_set1_ps(xq->d[(t0 + t) * xq->nb + (XB)]));   \
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(u_, sx_)), scale_, acc[t]);                \
    }                                                                                           \
  } while (0)

/* One W row (`nblocks` blocks of `type`) against x rows t0 .. t0 + MT -> out[0 .. MT). MT and
 * type are compile-time constants after inlining (see q8_rows). */
static inline __attribute__((always_inline)) void q8_row(const int type, const uint8_t *restrict w,
                                                         const int64_t nblocks, const xq_t *xq,
                                                         const int64_t t0, const int MT,
                                                         float *out) {
  __m256 acc[Q8_TILE];
  float off[Q8_TILE];
  for (int t = 0; t < Q8_TILE; t++) acc[t] = _mm256_setzero_ps(), off[t] = 0.f;
  for (int64_t b = 0; b < nblocks; b++) {
    if (type == T_Q4_0 || type == T_Q4_1) {
      const uint8_t *blk = w + b * (type == T_Q4_0 ? 18 : 20);
      const float d = f16_at(blk), o = type == T_Q4_0 ? -8.f * d : f16_at(blk + 2);
      const __m256i c = nibbles16(blk + (type == T_Q4_0 ? 2 : 4));
      APPLY_UNSIGNED(c, _mm256_set1_ps(d), o, b);
    } else if (type == T_Q5_0 || type == T_Q5_1) {
      const uint8_t *blk = w + b * (type == T_Q5_0 ? 22 : 24);
      const float d = f16_at(blk), o = type == T_Q5_0 ? -16.f * d : f16_at(blk + 2);
      const uint8_t *p = blk + (type == T_Q5_0 ? 2 : 4);
      uint32_t qh;
      memcpy(&qh, p, 4);
      const __m256i c = _mm256_or_si256(nibbles16(p + 4), fifth_bits(qh));
      APPLY_UNSIGNED(c, _mm256_set1_ps(d), o, b);
    } else if (type == T_Q8_0) {
      const uint8_t *blk = w + b * 34;
      APPLY_SIGNED(load32(blk + 2), _mm256_set1_ps(f16_at(blk)), b);
    } else if (type == T_Q4_K || type == T_Q5_K) {
      const int five = type == T_Q5_K;
      const uint8_t *blk = w + b * (five ? 176 : 144);
      const float d = f16_at(blk), dmin = f16_at(blk + 2);
      const uint8_t *scales = blk + 4, *qs = blk + (five ? 48 : 16);
      const __m256i lo4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
      const __m256i qh = five ? load32(blk + 16) : _mm256_setzero_si256();
      for (int pair = 0; pair < 4; pair++) {
        const __m256i v = load32(qs + 32 * pair);
        __m256i c0 = _mm256_and_si256(v, lo4), c1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
        if (five) {
          const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * pair), one);
          const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * pair + 1), one);
          c0 = _mm256_or_si256(c0, _mm256_slli_epi16(h0, 4));
          c1 = _mm256_or_si256(c1, _mm256_slli_epi16(h1, 4));
        }
        int sc, mn;
        scale_min_k4(2 * pair, scales, &sc, &mn);
        APPLY_UNSIGNED(c0, _mm256_set1_ps(d * (float)sc), -dmin * (float)mn, b * 8 + 2 * pair);
        scale_min_k4(2 * pair + 1, scales, &sc, &mn);
        APPLY_UNSIGNED(c1, _mm256_set1_ps(d * (float)sc), -dmin * (float)mn, b * 8 + 2 * pair + 1);
      }
    } else { /* T_Q6_K: codes q - 32 in [-32, 31], one int8 scale per 16 values */
      const uint8_t *blk = w + b * 210;
      const float d = f16_at(blk + 208);
      const __m256i lo4 = _mm256_set1_epi8(15), hi2 = _mm256_set1_epi8(0x30);
      const __m256i m32 = _mm256_set1_epi8(32);
      for (int half = 0; half < 2; half++) {
        const uint8_t *ql = blk + 64 * half, *qhp = blk + 128 + 32 * half;
        const int8_t *sc = (const int8_t *)(blk + 192 + 8 * half);
        const __m256i a = load32(ql), bq = load32(ql + 32), h = load32(qhp);
        __m256i c[4];
        c[0] = _mm256_or_si256(_mm256_and_si256(a, lo4), _mm256_and_si256(_mm256_slli_epi16(h, 4), hi2));
        c[1] = _mm256_or_si256(_mm256_and_si256(bq, lo4), _mm256_and_si256(_mm256_slli_epi16(h, 2), hi2));
        c[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), lo4), _mm256_and_si256(h, hi2));
        c[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bq, 4), lo4),
                               _mm256_and_si256(_mm256_srli_epi16(h, 2), hi2));
        for (int i = 0; i < 4; i++) {
          const float s0 = d * (float)sc[2 * i], s1 = d * (float)sc[2 * i + 1];
          const __m256 av = _mm256_setr_ps(s0, s0, s0, s0, s1, s1, s1, s1);
          APPLY_SIGNED(_mm256_sub_epi8(c[i], m32), av, b * 8 + 4 * half + i);
        }
      }
    }
  }
  for (int t = 0; t < MT; t++) out[t] = hsum8(acc[t]) + off[t];
}
#undef APPLY_UNSIGNED
#undef APPLY_SIGNED

#else
/* ---- generic build: the same sums in integer loops ---------------------------------------- */

/* Codes of one 32-value block as ints c[32] with w = a[e / 16] * c[e] + o: callers pass the
 * unpacked codes of each format. */
static inline void apply_block(const int *restrict c, const float a0, const float a1, const float o,
                               const xq_t *xq, const int64_t xb, const int64_t t0, const int MT,
                               float *acc, float *off) {
  for (int t = 0; t < MT; t++) {
    const int8_t *restrict qx = xq->q + (t0 + t) * xq->k + xb * 32;
    int s0 = 0, s1 = 0;
    for (int e = 0; e < 16; e++) s0 += c[e] * qx[e];
    for (int e = 16; e < 32; e++) s1 += c[e] * qx[e];
    const float dx = xq->d[(t0 + t) * xq->nb + xb];
    acc[t] += dx * (a0 * (float)s0 + a1 * (float)s1);
    off[t] += o * xq->s[(t0 + t) * xq->nb + xb];
  }
}

static inline __attribute__((always_inline)) void q8_row(const int type, const uint8_t *restrict w,
                                                         const int64_t nblocks, const xq_t *xq,
                                                         const int64_t t0, const int MT,
                                                         float *out) {
  float acc[Q8_TILE] = {0}, off[Q8_TILE] = {0};
  int c[32];
  for (int64_t b = 0; b < nblocks; b++) {
    if (type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q5_1) {
      const int five = type == T_Q5_0 || type == T_Q5_1;
      const int with_min = type == T_Q4_1 || type == T_Q5_1;
      const uint8_t *blk = w + b * (type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : five && !with_min ? 22 : 24);
      const float d = f16_at(blk);
      const float o = with_min ? f16_at(blk + 2) : (five ? -16.f : -8.f) * d;
      const uint8_t *p = blk + (with_min ? 4 : 2);
      uint32_t qh = 0;
      if (five) memcpy(&qh, p, 4), p += 4;
      for (int j = 0; j < 16; j++) {
        c[j] = (p[j] & 15) | (int)(((qh >> j) & 1u) << 4);
        c[j + 16] = (p[j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
      }
      apply_block(c, d, d, o, xq, b, t0, MT, acc, off);
    } else if (type == T_Q8_0) {
      const uint8_t *blk = w + b * 34;
      for (int j = 0; j < 32; j++) c[j] = (int8_t)blk[2 + j];
      const float d = f16_at(blk);
      apply_block(c, d, d, 0.f, xq, b, t0, MT, acc, off);
    } else if (type == T_Q4_K || type == T_Q5_K) {
      const int five = type == T_Q5_K;
      const uint8_t *blk = w + b * (five ? 176 : 144);
      const float d = f16_at(blk), dmin = f16_at(blk + 2);
      const uint8_t *scales = blk + 4, *qh = blk + 16, *qs = blk + (five ? 48 : 16);
      for (int sub = 0; sub < 8; sub++) {
        const uint8_t *q = qs + 32 * (sub / 2);
        for (int l = 0; l < 32; l++) {
          c[l] = sub % 2 ? q[l] >> 4 : q[l] & 15;
          if (five) c[l] |= ((qh[l] >> sub) & 1) << 4;
        }
        int sc, mn;
        scale_min_k4(sub, scales, &sc, &mn);
        apply_block(c, d * (float)sc, d * (float)sc, -dmin * (float)mn, xq, b * 8 + sub, t0, MT,
                    acc, off);
      }
    } else { /* T_Q6_K */
      const uint8_t *blk = w + b * 210;
      const float d = f16_at(blk + 208);
      for (int half = 0; half < 2; half++) {
        const uint8_t *ql = blk + 64 * half, *qh = blk + 128 + 32 * half;
        const int8_t *sc = (const int8_t *)(blk + 192 + 8 * half);
        for (int i = 0; i < 4; i++) {
          for (int l = 0; l < 32; l++) {
            const int low = i % 2 ? ql[l + 32] : ql[l];
            c[l] = ((i < 2 ? low & 15 : low >> 4) | (((qh[l] >> (2 * i)) & 3) << 4)) - 32;
          }
          apply_block(c, d * (float)sc[2 * i], d * (float)sc[2 * i + 1], 0.f, xq,
                      b * 8 + 4 * half + i, t0, MT, acc, off);
        }
      }
    }
  }
  for (int t = 0; t < MT; t++) out[t] = acc[t] + off[t];
}
#endif

/* q8_row specialized per type and tile height (constants folded after inlining). */
#define Q8_TYPE(TYPE)                                        \
  switch (mt) {                                              \
    case 1: q8_row(TYPE, w, nblocks, xq, t0, 1, out); return; \
    case 2: q8_row(TYPE, w, nblocks, xq, t0, 2, out); return; \
    case 3: q8_row(TYPE, w, nblocks, xq, t0, 3, out); return; \
    default: q8_row(TYPE, w, nblocks, xq, t0, 4, out); return; \
  }
static void q8_rows(const int type, const uint8_t *restrict w, const int64_t nblocks,
                    const xq_t *xq, const int64_t t0, const int mt, float *out) {
  switch (type) {
    case T_Q4_0: Q8_TYPE(T_Q4_0)
    case T_Q4_1: Q8_TYPE(T_Q4_1)
    case T_Q5_0: Q8_TYPE(T_Q5_0)
    case T_Q5_1: Q8_TYPE(T_Q5_1)
    case T_Q8_0: Q8_TYPE(T_Q8_0)
    case T_Q4_K: Q8_TYPE(T_Q4_K)
    case T_Q5_K: Q8_TYPE(T_Q5_K)
    default: Q8_TYPE(T_Q6_K)
  }
}
#undef Q8_TYPE

/* Returns 0, -1 for a type this kernel does not take or a K that is not a multiple of its
 * block, -2 when scratch memory cannot be allocated. Arguments as wick_gguf_gemm's. */
int wick_gguf_q8_gemm(const int type, const int dtype, const void *x, const int64_t x_stride,
                      const uint8_t *w, const void *bias, void *y, const int64_t m,
                      const int64_t n, const int64_t k, const int num_threads,
                      const int64_t min_work_per_thread) {
  int elems, bytes;
  if (!wick_gguf_q8_supports(type) || !block_shape(type, &elems, &bytes) || k % elems) return -1;
  if (m <= 0 || n <= 0) return 0;
  const int64_t row_bytes = k / elems * bytes, nblocks = k / elems, nb = k / 32;
  /* one allocation: q [m, k] int8, then d and s [m, nb] fp32 */
  char *scratch = malloc((size_t)(m * k) + 2 * sizeof(float) * (size_t)(m * nb) + 64);
  if (scratch == NULL) return -2;
  int8_t *q = (int8_t *)scratch;
  float *d = (float *)(scratch + ((m * k + 63) & ~(int64_t)63)), *s = d + m * nb;
  quantize_x(dtype, x, x_stride, m, k, q, d, s);
  const xq_t xq = {q, d, s, k, nb};
  const int threads = threads_for(n * k * (m < Q8_TILE ? m : Q8_TILE), min_work_per_thread,
                                  num_threads);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t j = 0; j < n; j++) {
    const float bj = load_bias(bias, dtype, j);
    for (int64_t t0 = 0; t0 < m; t0 += Q8_TILE) {
      const int mt = m - t0 < Q8_TILE ? (int)(m - t0) : Q8_TILE;
      float o[Q8_TILE];
      q8_rows(type, w + j * row_bytes, nblocks, &xq, t0, mt, o);
      for (int t = 0; t < mt; t++) store(y, dtype, (t0 + t) * n + j, o[t] + bj);
    }
  }
  free(scratch);
  return 0;
}
