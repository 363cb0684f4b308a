/* Matmuls on GGUF block-quantized weights (llama.cpp's formats) without a float copy of W:
 * y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), W kept as the GGUF stores it.
 *
 * Shapes (`dtype` 0: x, bias and y fp32; 1: bf16, stored as uint16):
 *   x    [M, K], rows `x_stride` elements apart (the last dimension contiguous)
 *   W    [N, row_bytes] uint8: each row is K / block_elems blocks of the ggml `type`, as in the
 *        file (rows are independent: a row never shares a block with the next one)
 *   bias [N] or NULL;  y [M, N] contiguous in x's dtype
 *
 * How: each thread takes a contiguous range of W's rows, so W is read once per call in its
 * packed size (0.56 bytes per weight for Q4_1, 1.06 for Q8_0) whatever M is.
 *   - Up to FUSED_MAX_ROWS rows of x, Q4_0 / Q4_1 / Q8_0 (the embedded model's types): each
 *     block's codes are widened to fp32 in vector registers and multiplied there with every row
 *     of x (fused_row below): the decode step's path.
 *   - Otherwise (more rows, or the other types): four rows of W at a time are decoded block by
 *     block into an L1-resident scratch (plain loops that GCC vectorizes at the build's width,
 *     one per format), then multiplied with four rows of x at a time in 4x4 register tiles.
 * The products are those of dequantize-then-matmul in fp32; only the summation order differs.
 * Many rows (prefills) are served by dequantize-then-GEMM instead (gguf_linear.py), which
 * `wick_gguf_dequant` feeds.
 *
 * Beside it, gguf_q8.c quantizes x to int8 per 32 values and uses integer dot products
 * (llama.cpp's way, vpdpbusd on AVX-512 VNNI): fewer instructions per weight, at the price of
 * rounding x to 8 bits per block. This kernel keeps the dequantized model's products exactly,
 * serves every type (Q2_K and Q3_K have no integer path) and is what the startup tuner
 * (kernels/cpu/linear_tuning.py) times against it per shape and row count.
 *
 * Vector paths: compiled once per ISA (kernels/cpu/native.py); the vector extension width of
 * wick_vec.h (16 floats on AVX-512, 8 on AVX2, 4 otherwise) and the byte-widening intrinsics of
 * cvt_u8 / cvt_s8 / cvt_nibbles (scalar loops in the generic build) are the differences.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "wick_cpu.h"
#include "wick_entry.h"
#include "wick_gguf.h"
#include "wick_vec.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* ---- block decoders: one block at b -> its values at y (fp32) ----------------------------- */

static inline void dq_f32(const uint8_t *restrict b, float *restrict y) { memcpy(y, b, 128); }

static inline void dq_f16(const uint8_t *restrict b, float *restrict y) {
  for (int j = 0; j < 32; j++) y[j] = f16_at(b + 2 * j);
}

static inline void dq_bf16(const uint8_t *restrict b, float *restrict y) {
  uint16_t h[32];
  memcpy(h, b, 64);
  bf16_to_f32_row(h, y, 1.f, 32);
}

/* Q4_0 (18 B): f16 d, 16 bytes of nibbles; byte j holds element j (low) and j + 16 (high);
 * x = d * (q - 8). */
static inline void dq_q4_0(const uint8_t *restrict b, float *restrict y) {
  const float d = f16_at(b);
  const uint8_t *restrict qs = b + 2;
#pragma omp simd
  for (int j = 0; j < 16; j++) {
    y[j] = (float)((int)(qs[j] & 15) - 8) * d;
    y[j + 16] = (float)((int)(qs[j] >> 4) - 8) * d;
  }
}

/* Q4_1 (20 B): f16 d, f16 m, 16 bytes of nibbles; x = d * q + m. */
static inline void dq_q4_1(const uint8_t *restrict b, float *restrict y) {
  const float d = f16_at(b), m = f16_at(b + 2);
  const uint8_t *restrict qs = b + 4;
#pragma omp simd
  for (int j = 0; j < 16; j++) {
    y[j] = (float)(qs[j] & 15) * d + m;
    y[j + 16] = (float)(qs[j] >> 4) * d + m;
  }
}

/* Q5_0 (22 B): f16 d, u32 of fifth bits (bit j for element j), 16 bytes of nibbles;
 * x = d * (q - 16). Q5_1 (24 B): f16 d, f16 m, then the same; x = d * q + m. */
static inline void dq_q5(const uint8_t *restrict b, float *restrict y, const int with_min) {
  const float d = f16_at(b), m = with_min ? f16_at(b + 2) : -16.f * d;
  const uint8_t *restrict p = b + (with_min ? 4 : 2);
  uint32_t qh;
  memcpy(&qh, p, 4);
  const uint8_t *restrict qs = p + 4;
#pragma omp simd
  for (int j = 0; j < 16; j++) {
    const int lo = (qs[j] & 15) | (int)(((qh >> j) << 4) & 0x10u);
    const int hi = (qs[j] >> 4) | (int)((qh >> (j + 12)) & 0x10u);
    y[j] = (float)lo * d + m;
    y[j + 16] = (float)hi * d + m;
  }
}

/* Q8_0 (34 B): f16 d, 32 int8; x = d * q. */
static inline void dq_q8_0(const uint8_t *restrict b, float *restrict y) {
  const float d = f16_at(b);
  const int8_t *restrict qs = (const int8_t *)(b + 2);
#pragma omp simd
  for (int j = 0; j < 32; j++) y[j] = (float)qs[j] * d;
}

/* Q2_K (84 B, 256 values): scales[16] (low nibble scale, high nibble min per 16 values),
 * qs[64] (2-bit codes, four planes of 32 bytes per 128 values), f16 d, f16 dmin;
 * x = d * scale * q - dmin * min. */
static inline void dq_q2_k(const uint8_t *restrict b, float *restrict y) {
  const uint8_t *restrict sc = b, *restrict q = b + 16;
  const float d = f16_at(b + 80), dmin = f16_at(b + 82);
  int is = 0;
  for (int n = 0; n < 256; n += 128) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int half = 0; half < 2; half++) {
        const float dl = d * (float)(sc[is] & 0xF), ml = dmin * (float)(sc[is] >> 4);
        is++;
        const uint8_t *restrict qq = q + 16 * half;
#pragma omp simd
        for (int l = 0; l < 16; l++) y[l] = dl * (float)((qq[l] >> shift) & 3) - ml;
        y += 16;
      }
    }
    q += 32;
  }
}

/* Q3_K (110 B): hmask[32] (third bit, cleared = subtract 4), qs[64] (low 2 bits), scales[12]
 * (sixteen 6-bit scales, offset 32), f16 d; x = d * (scale - 32) * (q - 4 * !hbit). */
static inline void dq_q3_k(const uint8_t *restrict b, float *restrict y) {
  const uint8_t *restrict hm = b, *restrict q = b + 32;
  const float d_all = f16_at(b + 108);
  uint32_t aux[4];
  memcpy(aux, b + 96, 12);
  const uint32_t kmask1 = 0x03030303u, kmask2 = 0x0f0f0f0fu, tmp = aux[2];
  aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
  aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
  aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
  aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
  int8_t scales[16];
  memcpy(scales, aux, 16);
  int is = 0;
  uint8_t m = 1;
  for (int n = 0; n < 256; n += 128) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int half = 0; half < 2; half++) {
        const float dl = d_all * (float)(scales[is++] - 32);
        const uint8_t *restrict qq = q + 16 * half, *restrict hh = hm + 16 * half;
#pragma omp simd
        for (int l = 0; l < 16; l++)
          y[l] = dl * (float)((int)((qq[l] >> shift) & 3) - ((hh[l] & m) ? 0 : 4));
        y += 16;
      }
      m <<= 1;
    }
    q += 32;
  }
}

/* Q4_K (144 B): f16 d, f16 dmin, scales[12] (eight 6-bit scale/min pairs), qs[128] (per 64
 * values: 32 bytes, low nibbles first 32 values, high nibbles next 32);
 * x = d * scale * q - dmin * min. */
static inline void dq_q4_k(const uint8_t *restrict b, float *restrict y) {
  const float d = f16_at(b), dmin = f16_at(b + 2);
  const uint8_t *restrict scales = b + 4, *restrict q = b + 16;
  for (int is = 0; is < 8; is += 2) {
    int sc, mn;
    scale_min_k4(is, scales, &sc, &mn);
    const float d1 = d * (float)sc, m1 = dmin * (float)mn;
    scale_min_k4(is + 1, scales, &sc, &mn);
    const float d2 = d * (float)sc, m2 = dmin * (float)mn;
#pragma omp simd
    for (int l = 0; l < 32; l++) {
      y[l] = d1 * (float)(q[l] & 0xF) - m1;
      y[l + 32] = d2 * (float)(q[l] >> 4) - m2;
    }
    y += 64;
    q += 32;
  }
}

/* Q5_K (176 B): as Q4_K plus qh[32] (before qs) holding each value's fifth bit. */
static inline void dq_q5_k(const uint8_t *restrict b, float *restrict y) {
  const float d = f16_at(b), dmin = f16_at(b + 2);
  const uint8_t *restrict scales = b + 4, *restrict qh = b + 16, *restrict ql = b + 48;
  int shift = 0;
  for (int is = 0; is < 8; is += 2) {
    int sc, mn;
    scale_min_k4(is, scales, &sc, &mn);
    const float d1 = d * (float)sc, m1 = dmin * (float)mn;
    scale_min_k4(is + 1, scales, &sc, &mn);
    const float d2 = d * (float)sc, m2 = dmin * (float)mn;
#pragma omp simd
    for (int l = 0; l < 32; l++) {
      y[l] = d1 * (float)((ql[l] & 0xF) | (((qh[l] >> shift) & 1) << 4)) - m1;
      y[l + 32] = d2 * (float)((ql[l] >> 4) | (((qh[l] >> (shift + 1)) & 1) << 4)) - m2;
    }
    y += 64;
    ql += 32;
    shift += 2;
  }
}

/* Q6_K (210 B): ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] int8, f16 d;
 * x = d * scale * (q - 32). */
static inline void dq_q6_k(const uint8_t *restrict b, float *restrict y) {
  const uint8_t *restrict ql = b, *restrict qh = b + 128;
  const int8_t *restrict sc = (const int8_t *)(b + 192);
  const float d = f16_at(b + 208);
  for (int n = 0; n < 256; n += 128) {
    float s[8];
    for (int i = 0; i < 8; i++) s[i] = d * (float)sc[i];
    for (int l = 0; l < 32; l++) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = s[is] * (float)q1;
      y[l + 32] = s[is + 2] * (float)q2;
      y[l + 64] = s[is + 4] * (float)q3;
      y[l + 96] = s[is + 6] * (float)q4;
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

static inline void dq_q5_0(const uint8_t *restrict b, float *restrict y) { dq_q5(b, y, 0); }
static inline void dq_q5_1(const uint8_t *restrict b, float *restrict y) { dq_q5(b, y, 1); }

/* Row decoders: a whole row of `nblocks` blocks, the block decoder inlined into the loop (one
 * indirect call per row instead of one per block of 32 values). */
typedef void (*row_decoder_fn)(const uint8_t *restrict, float *restrict, int64_t);

#define ROW_DECODER(NAME, ELEMS, BYTES)                                                        \
  static void row_##NAME(const uint8_t *restrict w, float *restrict y, const int64_t nblocks) { \
    for (int64_t i = 0; i < nblocks; i++) dq_##NAME(w + i * (BYTES), y + i * (ELEMS));          \
  }
ROW_DECODER(f32, 32, 128)
ROW_DECODER(f16, 32, 64)
ROW_DECODER(bf16, 32, 64)
ROW_DECODER(q4_0, 32, 18)
ROW_DECODER(q4_1, 32, 20)
ROW_DECODER(q5_0, 32, 22)
ROW_DECODER(q5_1, 32, 24)
ROW_DECODER(q8_0, 32, 34)
ROW_DECODER(q2_k, 256, 84)
ROW_DECODER(q3_k, 256, 110)
ROW_DECODER(q4_k, 256, 144)
ROW_DECODER(q5_k, 256, 176)
ROW_DECODER(q6_k, 256, 210)

static row_decoder_fn row_decoder(const int type) {
  switch (type) {
    case T_F32: return row_f32;
    case T_F16: return row_f16;
    case T_BF16: return row_bf16;
    case T_Q4_0: return row_q4_0;
    case T_Q4_1: return row_q4_1;
    case T_Q5_0: return row_q5_0;
    case T_Q5_1: return row_q5_1;
    case T_Q8_0: return row_q8_0;
    case T_Q2_K: return row_q2_k;
    case T_Q3_K: return row_q3_k;
    case T_Q4_K: return row_q4_k;
    case T_Q5_K: return row_q5_k;
    case T_Q6_K: return row_q6_k;
    default: return NULL;
  }
}

/* ---- dot products of a decoded W row with rows of x ---------------------------------------- */

static inline float hsum_vf(const vf v) {
  float s = 0.f;
  for (int i = 0; i < VW; i++) s += v[i];
  return s;
}

/* ---- few rows of x: blocks decoded in registers ----------------------------------------------
 * For up to FUSED_MAX_ROWS rows of x and the 32-value formats with 4- or 8-bit codes (Q4_0,
 * Q4_1, Q8_0), each block's codes are widened to fp32 in vector registers and multiplied with
 * every row of x there, without the scratch row: per block and row of x, t = sum_i q_i * x_i
 * (VW lanes), then acc += d * t; the offset term (Q4_1's m, Q4_0's -8 d) is m * sum_i x_i, with
 * the block sums of x computed once per call. Only the rounding of the sums differs from
 * dequantize-then-matmul. */
#define FUSED_MAX_ROWS 4

/* VW codes as fp32: unsigned bytes, signed bytes, and the low / high nibbles of VW bytes.
 * Intrinsics where one widening instruction exists (GCC scalarizes the generic conversion). */
static inline vf cvt_u8(const uint8_t *p) {
#if VW == 16
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif VW == 8
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
  vf v;
  for (int i = 0; i < VW; i++) v[i] = (float)p[i];
  return v;
#endif
}

static inline vf cvt_s8(const uint8_t *p) {
#if VW == 16
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif VW == 8
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
  vf v;
  for (int i = 0; i < VW; i++) v[i] = (float)(int8_t)p[i];
  return v;
#endif
}

static inline void cvt_nibbles(const uint8_t *p, vf *lo, vf *hi) {
#if VW == 16
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
  *lo = (vf)_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  *hi = (vf)_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
#elif VW == 8
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
  *lo = (vf)_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
  *hi = (vf)_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
#else
  for (int i = 0; i < VW; i++) (*lo)[i] = (float)(p[i] & 15), (*hi)[i] = (float)(p[i] >> 4);
#endif
}

static inline int fused_type(const int type) {
  return type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0;
}

/* MT rows of x (a compile-time count after inlining) times W row w (nblocks blocks of 32),
 * into out[0..MT). xsum: block sums of x, row t at t * nblocks. */
static inline __attribute__((always_inline)) void fused_row(
    const int type, const uint8_t *restrict w, const int64_t nblocks, const float *restrict x,
    const int64_t xs, const float *restrict xsum, const int MT, float *out) {
  vf acc[FUSED_MAX_ROWS] = {{0}};
  float offs[FUSED_MAX_ROWS] = {0};
  const int bytes = type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : 34;
  for (int64_t b = 0; b < nblocks; b++) {
    const uint8_t *blk = w + b * bytes;
    const float *xb = x + b * 32;
    vf part[FUSED_MAX_ROWS] = {{0}};
    if (type == T_Q8_0) {
      for (int h = 0; h < 32; h += VW) {
        const vf q = cvt_s8(blk + 2 + h);
        for (int t = 0; t < MT; t++) part[t] = vfma(q, vload(xb + t * xs + h), part[t]);
      }
    } else {
      const uint8_t *qs = blk + (type == T_Q4_1 ? 4 : 2);
      for (int h = 0; h < 16; h += VW) {
        vf lo, hi;
        cvt_nibbles(qs + h, &lo, &hi);
        for (int t = 0; t < MT; t++) {
          part[t] = vfma(lo, vload(xb + t * xs + h), part[t]);
          part[t] = vfma(hi, vload(xb + t * xs + 16 + h), part[t]);
        }
      }
    }
    const float d = f16_at(blk);
    if (type != T_Q8_0) {
      const float m = type == T_Q4_1 ? f16_at(blk + 2) : -8.f * d;
      for (int t = 0; t < MT; t++) offs[t] += m * xsum[t * nblocks + b];
    }
    const vf dv = (vf){0} + d;
    for (int t = 0; t < MT; t++) acc[t] = vfma(dv, part[t], acc[t]);
  }
  for (int t = 0; t < MT; t++) out[t] = hsum_vf(acc[t]) + offs[t];
}

/* fused_row specialized per type and row count (constants folded after inlining). */
#define FUSED_CASE(TYPE, MT) fused_row(TYPE, w, nblocks, x, xs, xsum, MT, out)
static void fused_rows(const int type, const uint8_t *restrict w, const int64_t nblocks,
                       const float *restrict x, const int64_t xs, const float *restrict xsum,
                       const int mt, float *out) {
#define FUSED_TYPE(TYPE)             \
  switch (mt) {                      \
    case 1: FUSED_CASE(TYPE, 1); return; \
    case 2: FUSED_CASE(TYPE, 2); return; \
    case 3: FUSED_CASE(TYPE, 3); return; \
    default: FUSED_CASE(TYPE, 4); return; \
  }
  if (type == T_Q4_0) FUSED_TYPE(T_Q4_0)
  if (type == T_Q4_1) FUSED_TYPE(T_Q4_1)
  FUSED_TYPE(T_Q8_0)
#undef FUSED_TYPE
}
#undef FUSED_CASE

/* Returns 0, -1 for an unknown type or a K that is not a multiple of its block, -2 when scratch
 * memory cannot be allocated. */
int wick_gguf_gemm(const int type, const int dtype, const void *x, const int64_t x_stride,
                   const uint8_t *w, const void *bias, void *y, const int64_t m, const int64_t n,
                   const int64_t k, const int num_threads, const int64_t min_work_per_thread) {
  int elems, bytes;
  const row_decoder_fn decode = row_decoder(type);
  if (decode == NULL || !block_shape(type, &elems, &bytes) || k % elems) return -1;
  const int64_t row_bytes = k / elems * bytes, nblocks = k / elems;
  /* x as contiguous fp32 rows (bf16 widened once per call; fp32 read in place). */
  const float *xf = (const float *)x;
  int64_t xs = x_stride;
  float *xbuf = NULL;
  if (dtype != 0) {
    xbuf = malloc((size_t)(m * k) * sizeof(float));
    if (xbuf == NULL) return -2;
    for (int64_t i = 0; i < m; i++)
      bf16_to_f32_row((const bf16_t *)x + i * x_stride, xbuf + i * k, 1.f, (int)k);
    xf = xbuf, xs = k;
  }
  const int threads = threads_for(n * k * (m < 4 ? m : 4), min_work_per_thread, num_threads);

  if (m <= FUSED_MAX_ROWS && fused_type(type)) {
    float xsum[FUSED_MAX_ROWS * 512];
    float *sums = nblocks <= 512 ? xsum : malloc((size_t)(m * nblocks) * sizeof(float));
    if (sums == NULL) {
      free(xbuf);
      return -2;
    }
    for (int64_t i = 0; i < m; i++)
      for (int64_t b = 0; b < nblocks; b++) {
        float s = 0.f;
        for (int e = 0; e < 32; e++) s += xf[i * xs + b * 32 + e];
        sums[i * nblocks + b] = s;
      }
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t j = 0; j < n; j++) {
      float o[FUSED_MAX_ROWS];
      fused_rows(type, w + j * row_bytes, nblocks, xf, xs, sums, (int)m, o);
      const float b = load_bias(bias, dtype, j);
      for (int64_t i = 0; i < m; i++) store(y, dtype, i * n + j, o[i] + b);
    }
    if (sums != xsum) free(sums);
    free(xbuf);
    return 0;
  }
  /* Tiles of 4 W rows (decoded into scratch) by 4 rows of x: 16 accumulators over K, each
   * W and x vector loaded once per 4 FMAs. Short tiles repeat their last row (results not
   * stored). */
  const int64_t wtiles = (n + 3) / 4;
  int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    float *rows = malloc((size_t)(4 * k) * sizeof(float));
    if (rows == NULL) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(static)
    for (int64_t jt = 0; jt < wtiles; jt++) {
      if (rows == NULL) continue;
      const int64_t j0 = jt * 4;
      const int jn = n - j0 < 4 ? (int)(n - j0) : 4;
      for (int b = 0; b < jn; b++) decode(w + (j0 + b) * row_bytes, rows + b * k, nblocks);
      const float *wr[4];
      for (int b = 0; b < 4; b++) wr[b] = rows + (b < jn ? b : jn - 1) * k;
      for (int64_t i0 = 0; i0 < m; i0 += 4) {
        const int im = m - i0 < 4 ? (int)(m - i0) : 4;
        const float *xr[4];
        for (int a = 0; a < 4; a++) xr[a] = xf + (i0 + (a < im ? a : im - 1)) * xs;
        vf acc[4][4] = {{{0}}};
        for (int64_t c = 0; c < k; c += VW) {
          const vf w0 = vload(wr[0] + c), w1 = vload(wr[1] + c);
          const vf w2 = vload(wr[2] + c), w3 = vload(wr[3] + c);
          for (int a = 0; a < 4; a++) {
            const vf xv = vload(xr[a] + c);
            acc[a][0] = vfma(w0, xv, acc[a][0]);
            acc[a][1] = vfma(w1, xv, acc[a][1]);
            acc[a][2] = vfma(w2, xv, acc[a][2]);
            acc[a][3] = vfma(w3, xv, acc[a][3]);
          }
        }
        for (int a = 0; a < im; a++)
          for (int b = 0; b < jn; b++)
            store(y, dtype, (i0 + a) * n + j0 + b, hsum_vf(acc[a][b]) + load_bias(bias, dtype, j0 + b));
      }
    }
    free(rows);
  }
  free(xbuf);
  return failed ? -2 : 0;
}

/* W [rows, row_bytes] -> out [rows, k] fp32 (dtype 0) or bf16 (1, rounded to nearest even).
 * Returns 0, -1 for an unknown type or a k that is not a multiple of its block, -2 when
 * scratch memory cannot be allocated. */
int wick_gguf_dequant(const int type, const int dtype, const uint8_t *w, const int64_t rows,
                      const int64_t k, void *out, const int num_threads) {
  int elems, bytes;
  const row_decoder_fn decode = row_decoder(type);
  if (decode == NULL || !block_shape(type, &elems, &bytes) || k % elems) return -1;
  const int64_t row_bytes = k / elems * bytes, nblocks = k / elems;
  const int threads = threads_for(rows * k, 1 << 18, num_threads);
  int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    /* bf16 output: each row decoded into fp32 scratch, then rounded */
    float *tmp = dtype == 0 ? NULL : malloc((size_t)k * sizeof(float));
    if (dtype != 0 && tmp == NULL) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(static)
    for (int64_t j = 0; j < rows; j++) {
      if (dtype == 0) {
        decode(w + j * row_bytes, (float *)out + j * k, nblocks);
      } else if (tmp != NULL) {
        decode(w + j * row_bytes, tmp, nblocks);
        bf16_t *dst = (bf16_t *)out + j * k;
        for (int64_t c = 0; c < k; c++) dst[c] = f32_to_bf16(tmp[c]);
      }
    }
    free(tmp);
  }
  return failed ? -2 : 0;
}
