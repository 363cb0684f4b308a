/* Matmuls on GGUF block-quantized weights with integer dot products (llama.cpp's way):
 * y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), W kept as the GGUF stores it (gguf_gemm.c has
 * the shapes and the ggml layouts), x quantized to int8 per 32 values once per call.
 *
 * x quantization (`quantize_x`, also exported for the tests as wick_gguf_q8_quantize): per
 * row and block of 32 values, dx = max|x| / 127 and qx = round-to-nearest-even(x * (1 / dx)),
 * so x ~ xq = dx * qx with |qx| <= 127 (an all-zero block has dx = 0, qx = 0). Each block also
 * keeps sx = dx * sum(qx) (and per 16 values, for Q6_K). The kernel computes W @ xq exactly
 * up to fp32 rounding of the per-block terms: the only approximation is x -> xq (at most half
 * a step of 1/127 of the block's largest |x| per value), the rounding of llama.cpp's Q8_0 /
 * Q8_1 activations.
 *
 * Every W block of 32 values (a K-quant super-block is 8 of them) is unpacked to 32 unsigned
 * codes c with w = a * c + o (a: the block's scale, or d * sub-block scale; o: its offset), so
 *     sum_i w_i xq_i = a * dx * sum_i c_i qx_i + o * sx,
 * an integer dot product, one multiply-add per block, and an offset term per block.
 *
 * Vector builds (AVX2, AVX-512, AVX-512 VNNI): per W row, the codes of each group of 8 blocks
 * (256 values) are stored transposed in 4-byte chunks: chunk j holds bytes 4j..4j+3 of block
 * 0, then of block 1, ..., block 7. x's codes are stored the same way. (The last K % 256
 * values, if any, stay in order and are multiplied block by block.) A common permutation
 * leaves dot products unchanged, and now lane i of each
 * u8 x s8 -> int32 instruction (vpdpbusd, or vpmaddubsw + vpmaddwd without VNNI) sums block i's
 * bytes: 8 instructions give the 8 blocks' integer sums in one vector, with no horizontal
 * reduction, converted and scaled by (a * dx) of the 8 blocks in one multiply-add. Each W row
 * is unpacked once per call (into L1) and serves every row of x, 4 rows of x at a time.
 * Q6_K's codes (0..63) carry a scale per 16 values: its pairs of int16 sums are scaled by
 * vpmaddwd (vpdpwssd on VNNI). Q8_0 without VNNI multiplies |w| by qx with w's signs
 * (vpmaddubsw would saturate on w + 128); with VNNI its codes are w + 128.
 * The generic build does the same sums in plain integer loops, block by block.
 * The AVX-512 VNNI build, from PANEL_MIN_ROWS rows of x, unpacks 16 W rows at a time into
 * column panels (lane c of each vector: W row c; see q8_panels_range), which serve every row
 * of x without horizontal sums, and adds the very same terms in the very same order as the
 * paths above: every build gives a row of x the same output bits whatever the batch.
 *
 * Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (wick_gguf_q8_supports); others (Q2_K,
 * Q3_K, floats) return -1 and run the float kernels of gguf_gemm.c.
 *
 * Threads: contiguous ranges of W's rows (of panels), so W is read once per call in its packed
 * size.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "wick_cpu.h"
#include "wick_entry.h"
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

/* x [m, k] (fp32 or bf16, rows x_stride apart) -> q [m, kp] int8 (natural order, zeros past k),
 * d and s [m, kp / 32], s16 [m, kp / 16] (zeros past k). */
static void quantize_x(const int dtype, const void *x, const int64_t x_stride, const int64_t m,
                       const int64_t k, const int64_t kp, int8_t *restrict q, float *restrict d,
                       float *restrict s, float *restrict s16) {
  const int64_t nb = k / 32, nbp = kp / 32;
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
      int8_t *restrict qb = q + i * kp + b * 32;
#if defined(__AVX2__)
      const __m256 iv = _mm256_set1_ps(inv);
      __m256i r[4];
      for (int h = 0; h < 4; h++) /* round to nearest even (MXCSR default), as rintf */
        r[h] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * h), iv));
      const __m256i p16 = _mm256_packs_epi32(r[0], r[1]), p16b = _mm256_packs_epi32(r[2], r[3]);
      /* packs interleave 128-bit lanes: restore the order with one permute */
      const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16, p16b),
                                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256((__m256i *)qb, p8);
#else
      for (int e = 0; e < 32; e++) qb[e] = (int8_t)rintf(v[e] * inv);
#endif
      int lo = 0, hi = 0;
      for (int e = 0; e < 16; e++) lo += qb[e], hi += qb[e + 16];
      d[i * nbp + b] = dx;
      s[i * nbp + b] = dx * (float)(lo + hi);
      s16[2 * (i * nbp + b)] = dx * (float)lo;
      s16[2 * (i * nbp + b) + 1] = dx * (float)hi;
    }
    for (int64_t b = nb; b < nbp; b++)
      d[i * nbp + b] = s[i * nbp + b] = s16[2 * (i * nbp + b)] = s16[2 * (i * nbp + b) + 1] = 0.f;
    memset(q + i * kp + k, 0, (size_t)(kp - k));
  }
}

/* For the tests: the quantization above, q [m, k] int8 (natural order) and d [m, k/32] fp32.
 * Returns -1 when k is not a multiple of 32, -2 without memory. */
int wick_gguf_q8_quantize(const int dtype, const void *x, const int64_t x_stride, const int64_t m,
                          const int64_t k, int8_t *q, float *d) {
  if (k % 32) return -1;
  float *s = malloc(sizeof(float) * (size_t)(3 * m * (k / 32) + 1));
  if (s == NULL) return -2;
  quantize_x(dtype, x, x_stride, m, k, k, q, d, s, s + m * (k / 32));
  free(s);
  return 0;
}

/* The quantized x of one call: row t of q at q + t * kp (vector builds: groups transposed,
 * see the top); d and s at t * nbp, s16 (dx times the code sums of each 16 values) at
 * 2 t nbp. k: the row stride kp; nb: nbp. */
typedef struct {
  const int8_t *q;
  const float *d, *s, *s16;
  int64_t k, nb;
} xq_t;

#if defined(__AVX2__)
/* ---- AVX2 / AVX-512 builds ----------------------------------------------------------------- */

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline void store32(void *p, const __m256i v) { _mm256_storeu_si256((__m256i *)p, v); }

/* r[i] = 8 dwords of row i -> r[j] = dword j of rows 0..7. */
static inline void transpose8(__m256i r[8]) {
  const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
  const __m256i t4 = _mm256_unpacklo_epi32(r[4], r[5]), t5 = _mm256_unpackhi_epi32(r[4], r[5]);
  const __m256i t6 = _mm256_unpacklo_epi32(r[6], r[7]), t7 = _mm256_unpackhi_epi32(r[6], r[7]);
  const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
  const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
  const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
  const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
  r[0] = _mm256_permute2x128_si256(u0, u4, 0x20), r[4] = _mm256_permute2x128_si256(u0, u4, 0x31);
  r[1] = _mm256_permute2x128_si256(u1, u5, 0x20), r[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
  r[2] = _mm256_permute2x128_si256(u2, u6, 0x20), r[6] = _mm256_permute2x128_si256(u2, u6, 0x31);
  r[3] = _mm256_permute2x128_si256(u3, u7, 0x20), r[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

/* Each group of 8 blocks of 32 bytes at p (groups bytes) transposed in 4-byte chunks. */
static inline void transpose_groups(void *p, const int64_t groups) {
  uint8_t *g = (uint8_t *)p;
  for (int64_t i = 0; i < groups; i++, g += 256) {
    __m256i r[8];
    for (int b = 0; b < 8; b++) r[b] = load32(g + 32 * b);
    transpose8(r);
    for (int b = 0; b < 8; b++) store32(g + 32 * b, r[b]);
  }
}

/* How a block's codes meet qx: u8 x s8 sums (DOT_U), the same with Q6_K's sub-block scales
 * applied to int16 pair sums (DOT_SCALED), or Q8_0's |w| times qx with w's signs (DOT_SIGNED,
 * builds without VNNI). */
enum { DOT_U = 0, DOT_SCALED = 1, DOT_SIGNED = 2 };
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q8_VNNI 1
#else
#define Q8_VNNI 0
#endif

static inline int dot_kind(const int type) {
  if (type == T_Q6_K) return DOT_SCALED;
  if (type == T_Q8_0 && !Q8_VNNI) return DOT_SIGNED;
  return DOT_U;
}

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

/* One ggml block at blk -> its 32-value blocks (1, or 8 for a K-quant super-block): codes c[]
 * (u8; DOT_SIGNED: |w|, with w in sg[]), a in dw[], o in ow[] (Q6_K: two per 32 values, per
 * 16), and for Q6_K each 32 values' int16 scales in sc[16 * i ...]: 8 times the first half's,
 * then 8 times the second's. Returns the number of 32-value blocks. */
static inline __attribute__((always_inline)) int decode_block(
    const int type, const uint8_t *restrict blk, __m256i *c, __m256i *sg, float *dw, float *ow,
    int16_t *sc) {
  const __m256i lo4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
  if (type == T_Q4_0 || type == T_Q4_1) {
    const float d = f16_at(blk);
    dw[0] = d, ow[0] = type == T_Q4_0 ? -8.f * d : f16_at(blk + 2);
    c[0] = nibbles16(blk + (type == T_Q4_0 ? 2 : 4));
    return 1;
  }
  if (type == T_Q5_0 || type == T_Q5_1) {
    const float d = f16_at(blk);
    dw[0] = d, ow[0] = type == T_Q5_0 ? -16.f * d : f16_at(blk + 2);
    const uint8_t *p = blk + (type == T_Q5_0 ? 2 : 4);
    uint32_t qh;
    memcpy(&qh, p, 4);
    c[0] = _mm256_or_si256(nibbles16(p + 4), fifth_bits(qh));
    return 1;
  }
  if (type == T_Q8_0) {
    const float d = f16_at(blk);
    const __m256i v = load32(blk + 2);
    dw[0] = d;
    if (dot_kind(type) == DOT_SIGNED) {
      ow[0] = 0.f, sg[0] = v, c[0] = _mm256_abs_epi8(v);
    } else { /* w + 128 as u8, the 128 taken back through the offset */
      ow[0] = -128.f * d, c[0] = _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80));
    }
    return 1;
  }
  if (type == T_Q4_K || type == T_Q5_K) {
    const int five = type == T_Q5_K;
    const float d = f16_at(blk), dmin = f16_at(blk + 2);
    const uint8_t *scales = blk + 4, *qs = blk + (five ? 48 : 16);
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
      c[2 * pair] = c0, c[2 * pair + 1] = c1;
      for (int h = 0; h < 2; h++) {
        int sc_, mn;
        scale_min_k4(2 * pair + h, scales, &sc_, &mn);
        dw[2 * pair + h] = d * (float)sc_, ow[2 * pair + h] = -dmin * (float)mn;
      }
    }
    return 8;
  }
  /* T_Q6_K: codes q in [0, 63], w = d * sc * (q - 32), sc per 16 values */
  const float d = f16_at(blk + 208);
  const __m256i hi2 = _mm256_set1_epi8(0x30);
  for (int half = 0; half < 2; half++) {
    const uint8_t *ql = blk + 64 * half, *qhp = blk + 128 + 32 * half;
    const int8_t *s8 = (const int8_t *)(blk + 192 + 8 * half);
    const __m256i a = load32(ql), bq = load32(ql + 32), h = load32(qhp);
    __m256i *cc = c + 4 * half;
    cc[0] = _mm256_or_si256(_mm256_and_si256(a, lo4), _mm256_and_si256(_mm256_slli_epi16(h, 4), hi2));
    cc[1] = _mm256_or_si256(_mm256_and_si256(bq, lo4), _mm256_and_si256(_mm256_slli_epi16(h, 2), hi2));
    cc[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), lo4), _mm256_and_si256(h, hi2));
    cc[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bq, 4), lo4),
                            _mm256_and_si256(_mm256_srli_epi16(h, 2), hi2));
    for (int i = 0; i < 4; i++) {
      const int sub = 4 * half + i;
      dw[sub] = d;
      for (int e = 0; e < 2; e++) {
        ow[2 * sub + e] = -32.f * d * (float)s8[2 * i + e];
        for (int l = 0; l < 8; l++) sc[16 * sub + 8 * e + l] = s8[2 * i + e];
      }
    }
  }
  return 8;
}

/* One W row of nblocks ggml blocks -> codes [nbp * 32] (transposed groups, see the top;
 * DOT_SIGNED: |w|, with w in signs), dw [nbp], ow [nbp] (Q6_K: [2 nbp], per 16 values), sc16
 * (Q6_K: per group two int16 vectors, lane pair 2i, 2i + 1 holding block i's scale of its
 * first, then second, 16 values). */
static inline __attribute__((always_inline)) void unpack_row_t(
    const int type, const uint8_t *restrict w, const int64_t nblocks, uint8_t *restrict codes,
    int8_t *restrict signs, float *restrict dw, float *restrict ow, int16_t *restrict sc16) {
  int elems = 32, bytes = 0;
  block_shape(type, &elems, &bytes);
  const int q6 = type == T_Q6_K;
  int64_t nb = 0; /* blocks of 32 unpacked */
  for (int64_t b = 0; b < nblocks; b++) {
    __m256i c[8], sg[8];
    int16_t sc[8 * 16];
    const int count = decode_block(type, w + b * bytes, c, sg, dw + nb, ow + (q6 ? 2 * nb : nb), sc);
    for (int i = 0; i < count; i++, nb++) {
      store32(codes + 32 * nb, c[i]);
      if (dot_kind(type) == DOT_SIGNED) store32(signs + 32 * nb, sg[i]);
      if (q6) {
        int16_t *g = sc16 + 32 * (nb / 8) + 2 * (nb % 8);
        g[0] = g[1] = sc[16 * i], g[16] = g[17] = sc[16 * i + 8];
      }
    }
  }
  transpose_groups(codes, nb / 8); /* the last nb % 8 blocks stay in order */
  if (dot_kind(type) == DOT_SIGNED) transpose_groups(signs, nb / 8);
}

/* unpack_row_t with the type a constant. */
static void unpack_row(const int type, const uint8_t *restrict w, const int64_t nblocks,
                       uint8_t *restrict codes, int8_t *restrict signs, float *restrict dw,
                       float *restrict ow, int16_t *restrict sc16) {
#define UNPACK(TYPE) unpack_row_t(TYPE, w, nblocks, codes, signs, dw, ow, sc16); return
  switch (type) {
    case T_Q4_0: UNPACK(T_Q4_0);
    case T_Q4_1: UNPACK(T_Q4_1);
    case T_Q5_0: UNPACK(T_Q5_0);
    case T_Q5_1: UNPACK(T_Q5_1);
    case T_Q8_0: UNPACK(T_Q8_0);
    case T_Q4_K: UNPACK(T_Q4_K);
    case T_Q5_K: UNPACK(T_Q5_K);
    default: UNPACK(T_Q6_K);
  }
#undef UNPACK
}

/* lane i of the result = the sum of v[i]'s 8 lanes. */
static inline __m256i reduce8(const __m256i v[8]) {
  const __m256i a01 = _mm256_hadd_epi32(v[0], v[1]), a23 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i a45 = _mm256_hadd_epi32(v[4], v[5]), a67 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i b0 = _mm256_hadd_epi32(a01, a23), b1 = _mm256_hadd_epi32(a45, a67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20),
                          _mm256_permute2x128_si256(b0, b1, 0x31));
}

/* One 32-value block's integer sum per lane group: codes c (with signs sg) times x8. */
static inline __attribute__((always_inline)) __m256i block_dot(const int KIND, const __m256i c,
                                                                const __m256i sg, __m256i x8,
                                                                const int16_t *sc) {
  if (KIND == DOT_SCALED)
    return _mm256_madd_epi16(_mm256_maddubs_epi16(c, x8), load32(sc));
  if (KIND == DOT_SIGNED) x8 = _mm256_sign_epi8(x8, sg);
#if Q8_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), c, x8);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(c, x8), _mm256_set1_epi16(1));
#endif
}

/* Few rows of x (decodes): each W group of 8 blocks decoded into registers and multiplied
 * with MT rows of x in natural order (not transposed), the 8 blocks' sums gathered into one
 * vector by reduce8. No row buffer, no transposes. */
static inline __attribute__((always_inline)) void direct_row(
    const int type, const int KIND, const int MT, const uint8_t *restrict w,
    const int64_t nblocks, const xq_t *xq, const int64_t t0, float *out) {
  int elems = 32, bytes = 0;
  block_shape(type, &elems, &bytes);
  const int64_t nbp = xq->nb, kp = xq->k;
  const int q6 = KIND == DOT_SCALED;
  __m256 acc[Q8_TILE], off[Q8_TILE];
  float tail[Q8_TILE];
  for (int t = 0; t < MT; t++) acc[t] = off[t] = _mm256_setzero_ps(), tail[t] = 0.f;
  const int per = elems / 32; /* 32-value blocks per ggml block */
  int64_t b = 0, nb = 0;
  for (; nb + 8 <= nbp; nb += 8) {
    __m256i c[8], sg[8];
    float dw[8], ow[16];
    int16_t sc[8 * 16];
    for (int i = 0; i < 8; i += per, b++)
      decode_block(type, w + b * bytes, c + i, sg + i, dw + i, ow + (q6 ? 2 * i : i), sc + 16 * i);
    const __m256 a = _mm256_loadu_ps(dw);
    for (int t = 0; t < MT; t++) {
      const int8_t *xb = xq->q + (t0 + t) * kp + 32 * nb;
      __m256i v[8];
      for (int i = 0; i < 8; i++) v[i] = block_dot(KIND, c[i], sg[i], load32(xb + 32 * i), sc + 16 * i);
      const __m256 s = _mm256_mul_ps(a, _mm256_loadu_ps(xq->d + (t0 + t) * nbp + nb));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8(v)), s, acc[t]);
      if (q6) {
        const float *sx = xq->s16 + (t0 + t) * 2 * nbp + 2 * nb;
        off[t] = _mm256_fmadd_ps(_mm256_loadu_ps(ow), _mm256_loadu_ps(sx), off[t]);
        off[t] = _mm256_fmadd_ps(_mm256_loadu_ps(ow + 8), _mm256_loadu_ps(sx + 8), off[t]);
      } else {
        const float *sx = xq->s + (t0 + t) * nbp + nb;
        off[t] = _mm256_fmadd_ps(_mm256_loadu_ps(ow), _mm256_loadu_ps(sx), off[t]);
      }
    }
  }
  for (; b < nblocks; b++, nb++) { /* 32-value formats: the blocks after the last group */
    __m256i c[8], sg[8]; /* sized for any type, one block used */
    float dw[8], ow[16];
    int16_t sc[8 * 16];
    decode_block(type, w + b * bytes, c, sg, dw, ow, sc);
    for (int t = 0; t < MT; t++) {
      const __m256i p = block_dot(KIND, c[0], sg[0], load32(xq->q + (t0 + t) * kp + 32 * nb), sc);
      const float s = dw[0] * xq->d[(t0 + t) * nbp + nb];
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(s), acc[t]);
      tail[t] += ow[0] * xq->s[(t0 + t) * nbp + nb];
    }
  }
  for (int t = 0; t < MT; t++) out[t] = hsum8(_mm256_add_ps(acc[t], off[t])) + tail[t];
}

/* Rows of x up to which direct_row runs (no transposes); more rows unpack each W row once. */
#define DIRECT_MAX_ROWS 2

#define DIRECT_ROWS(TYPE)                                                                   \
  do {                                                                                      \
    if (mt == 1)                                                                            \
      direct_row(TYPE, dot_kind(TYPE), 1, w, nblocks, xq, t0, out);                         \
    else                                                                                    \
      direct_row(TYPE, dot_kind(TYPE), 2, w, nblocks, xq, t0, out);                         \
    return;                                                                                 \
  } while (0)
static void direct_rows(const int type, const uint8_t *restrict w, const int64_t nblocks,
                        const xq_t *xq, const int64_t t0, const int mt, float *out) {
  switch (type) {
    case T_Q4_0: DIRECT_ROWS(T_Q4_0);
    case T_Q4_1: DIRECT_ROWS(T_Q4_1);
    case T_Q5_0: DIRECT_ROWS(T_Q5_0);
    case T_Q5_1: DIRECT_ROWS(T_Q5_1);
    case T_Q8_0: DIRECT_ROWS(T_Q8_0);
    case T_Q4_K: DIRECT_ROWS(T_Q4_K);
    case T_Q5_K: DIRECT_ROWS(T_Q5_K);
    default: DIRECT_ROWS(T_Q6_K);
  }
}
#undef DIRECT_ROWS

/* The 8 blocks' integer sums of group c (8 chunks of codes) with x chunks at xg. */
static inline __attribute__((always_inline)) __m256i group_dot(const int KIND, const __m256i *c,
                                                                const int8_t *xg,
                                                                const int8_t *sg,
                                                                const int16_t *scg) {
  if (KIND == DOT_SCALED) { /* int16 pair sums of two chunks (<= 2 * 2 * 63 * 127), scaled */
    __m256i acc = _mm256_setzero_si256();
    for (int j = 0; j < 8; j += 2) {
      const __m256i h = _mm256_add_epi16(_mm256_maddubs_epi16(c[j], load32(xg + 32 * j)),
                                         _mm256_maddubs_epi16(c[j + 1], load32(xg + 32 * j + 32)));
      const __m256i sc = load32(scg + (j < 4 ? 0 : 16));
#if Q8_VNNI
      acc = _mm256_dpwssd_epi32(acc, h, sc);
#else
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(h, sc));
#endif
    }
    return acc;
  }
  if (KIND == DOT_SIGNED) { /* |w| (<= 128) times signed qx: no int16 accumulation */
    __m256i acc = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
      const __m256i x8 = _mm256_sign_epi8(load32(xg + 32 * j), load32(sg + 32 * j));
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(c[j], x8),
                                                    _mm256_set1_epi16(1)));
    }
    return acc;
  }
#if Q8_VNNI
  __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
  for (int j = 0; j < 8; j += 2) {
    a0 = _mm256_dpbusd_epi32(a0, c[j], load32(xg + 32 * j));
    a1 = _mm256_dpbusd_epi32(a1, c[j + 1], load32(xg + 32 * j + 32));
  }
  return _mm256_add_epi32(a0, a1);
#else
  /* codes <= 31 (every DOT_U type without VNNI): four chunks' int16 pair sums stay below
   * 4 * 2 * 31 * 127 < 2^15 */
  __m256i h[2];
  for (int q = 0; q < 2; q++) {
    h[q] = _mm256_maddubs_epi16(c[4 * q], load32(xg + 128 * q));
    for (int j = 1; j < 4; j++)
      h[q] = _mm256_add_epi16(h[q], _mm256_maddubs_epi16(c[4 * q + j], load32(xg + 128 * q + 32 * j)));
  }
  const __m256i ones = _mm256_set1_epi16(1);
  return _mm256_add_epi32(_mm256_madd_epi16(h[0], ones), _mm256_madd_epi16(h[1], ones));
#endif
}

/* The unpacked row against x rows t0 .. t0 + MT -> out[0 .. MT):
 * sum_b dw[b] dx_t[b] dot(codes_b, qx_t,b) + sum_g ow[g] sx_t[g]. */
static inline __attribute__((always_inline)) void q8_tile(
    const int KIND, const int MT, const uint8_t *restrict codes, const int8_t *restrict signs,
    const float *restrict dw, const float *restrict ow, const int16_t *restrict sc16,
    const xq_t *xq, const int64_t t0, float *out) {
  const int64_t nbp = xq->nb, kp = xq->k;
  __m256 acc[Q8_TILE];
  for (int t = 0; t < MT; t++) acc[t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < nbp / 8; g++) {
    __m256i c[8];
    for (int j = 0; j < 8; j++) c[j] = load32(codes + 256 * g + 32 * j);
    const __m256 a = _mm256_loadu_ps(dw + 8 * g);
    for (int t = 0; t < MT; t++) {
      const __m256i p = group_dot(KIND, c, xq->q + (t0 + t) * kp + 256 * g,
                                  signs + 256 * g, sc16 + 32 * g);
      const __m256 sc = _mm256_mul_ps(a, _mm256_loadu_ps(xq->d + (t0 + t) * nbp + 8 * g));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, acc[t]);
    }
  }
  for (int64_t b = nbp / 8 * 8; b < nbp; b++) { /* the blocks after the last group, in order */
    const __m256i c = load32(codes + 32 * b);
    for (int t = 0; t < MT; t++) {
      __m256i x8 = load32(xq->q + (t0 + t) * kp + 32 * b);
      if (KIND == DOT_SIGNED) x8 = _mm256_sign_epi8(x8, load32(signs + 32 * b));
#if Q8_VNNI
      const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), c, x8);
#else
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(c, x8), _mm256_set1_epi16(1));
#endif
      const float sc = dw[b] * xq->d[(t0 + t) * nbp + b];
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(sc), acc[t]);
    }
  }
  for (int t = 0; t < MT; t++) {
    /* offsets: per 32 values, or per 16 for Q6_K (DOT_SCALED) */
    const int64_t groups = KIND == DOT_SCALED ? 2 * nbp : nbp;
    const float *restrict sx = (KIND == DOT_SCALED ? xq->s16 : xq->s) + (t0 + t) * groups;
    __m256 o = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= groups; i += 8)
      o = _mm256_fmadd_ps(_mm256_loadu_ps(ow + i), _mm256_loadu_ps(sx + i), o);
    float tail = 0.f;
    for (; i < groups; i++) tail += ow[i] * sx[i];
    out[t] = hsum8(_mm256_add_ps(acc[t], o)) + tail;
  }
}

#define Q8_TILES(KIND)                                                              \
  switch (mt) {                                                                     \
    case 1: q8_tile(KIND, 1, codes, signs, dw, ow, sc16, xq, t0, out); return;     \
    case 2: q8_tile(KIND, 2, codes, signs, dw, ow, sc16, xq, t0, out); return;     \
    case 3: q8_tile(KIND, 3, codes, signs, dw, ow, sc16, xq, t0, out); return;     \
    default: q8_tile(KIND, 4, codes, signs, dw, ow, sc16, xq, t0, out); return;    \
  }
static void q8_tiles(const int kind, const uint8_t *codes, const int8_t *signs, const float *dw,
                     const float *ow, const int16_t *sc16, const xq_t *xq, const int64_t t0,
                     const int mt, float *out) {
  if (kind == DOT_SCALED) Q8_TILES(DOT_SCALED)
  if (kind == DOT_SIGNED) Q8_TILES(DOT_SIGNED)
  Q8_TILES(DOT_U)
}
#undef Q8_TILES

/* W rows [j0, j1) against every row of x: each W row unpacked once, then tiles of x rows. */
static int q8_rows_range(const int type, const int dtype, const uint8_t *w, const int64_t row_bytes,
                         const int64_t nblocks, const xq_t *xq, const int64_t m, const void *bias,
                         void *y, const int64_t n, const int64_t j0, const int64_t j1) {
  const int64_t nbp = xq->nb, kp = xq->k;
  if (m <= DIRECT_MAX_ROWS) {
    for (int64_t j = j0; j < j1; j++) {
      float o[Q8_TILE];
      direct_rows(type, w + j * row_bytes, nblocks, xq, 0, (int)m, o);
      const float bj = load_bias(bias, dtype, j);
      for (int t = 0; t < m; t++) store(y, dtype, t * n + j, o[t] + bj);
    }
    return 0;
  }
  /* codes [kp] | signs [kp] | sc16 [kp / 8 int16] | dw [nbp] | ow [2 nbp] */
  char *buf = malloc((size_t)(2 * kp + kp / 4) + sizeof(float) * (size_t)(3 * nbp) + 64);
  if (buf == NULL) return -2;
  uint8_t *codes = (uint8_t *)buf;
  int8_t *signs = (int8_t *)(buf + kp);
  int16_t *sc16 = (int16_t *)(buf + 2 * kp);
  float *dw = (float *)(buf + 2 * kp + kp / 4), *ow = dw + nbp;
  const int kind = dot_kind(type);
  for (int64_t j = j0; j < j1; j++) {
    unpack_row(type, w + j * row_bytes, nblocks, codes, signs, dw, ow, sc16);
    const float bj = load_bias(bias, dtype, j);
    for (int64_t t0 = 0; t0 < m; t0 += Q8_TILE) {
      const int mt = m - t0 < Q8_TILE ? (int)(m - t0) : Q8_TILE;
      float o[Q8_TILE];
      q8_tiles(kind, codes, signs, dw, ow, sc16, xq, t0, mt, o);
      for (int t = 0; t < mt; t++) store(y, dtype, (t0 + t) * n + j, o[t] + bj);
    }
  }
  free(buf);
  return 0;
}

#if Q8_VNNI && defined(__AVX512F__)
#define Q8_PANEL 1
/* ---- AVX-512 VNNI build, PANEL_MIN_ROWS or more rows of x: column panels --------------------
 * W's rows are unpacked PANEL at a time into a panel: chunk j (64 bytes) of 32-value block b
 * holds in lane c the bytes 4j..4j+3 of W row c's block b, so vpdpbusd with 4 bytes of x
 * broadcast leaves column c's partial sum in lane c: every output column in its own lane, no
 * horizontal sums, each unpacked panel reused by every row of x.
 * The sums are direct_row's, in its order, so a row's outputs have the same bits alone (1 or
 * 2 rows: direct_row) or in any batch: its 8 lanes (one per block position b % 8 of each
 * group of 8 blocks) become 8 accumulators per row here, acc[b % 8] += float(isum_b) * (a_b *
 * dx_b) and off[b % 8] += o_b * sx_b (Q6_K: per 16 values, off[h % 8] for half h), the blocks
 * after the last group add each 4-byte chunk's partial sum to acc[chunk] (and their offsets
 * to one scalar tail in order), and the 8 lanes meet as hsum8 adds them:
 * ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)) + tail, v_i = acc_i + off_i. */
#define PANEL 16
/* Rows of x from which the panels run; fewer take q8_rows_range (direct_row or a row buffer).
 * Measured (busy 2-core Zen 5, one thread, Gemma 3 270M's shapes): the panels' unpacking
 * (16 rows staged, then transposed) costs more than the row buffer's up to 9 rows, and their
 * rows cost about half as much above. */
#define PANEL_MIN_ROWS 10
/* Rows of x per tile (each block's codes loaded once for them). */
#define PANEL_ROWS 4

/* W rows [0, rows) (rows <= PANEL; missing lanes are zero) of nblocks ggml blocks at w, each
 * row_bytes apart -> codes [nbp][8][PANEL][4] u8, a [nbp][PANEL], o [halves * nbp][PANEL]
 * (halves: Q6_K 2, per 16 values, else 1), and for Q6_K sc [2 nbp][PANEL] int32 (the scale of
 * each 16 values). Each W row is decoded in order into stage [PANEL][nbp * 32] (W read
 * sequentially), then every block's 16 rows are transposed into lanes. */
static inline __attribute__((always_inline)) void unpack_panel(
    const int type, const uint8_t *restrict w, const int64_t row_bytes, const int64_t nblocks,
    const int rows, uint8_t *restrict stage, uint8_t *restrict codes, float *restrict a,
    float *restrict o, int32_t *restrict sci) {
  int elems = 32, bytes = 0;
  block_shape(type, &elems, &bytes);
  const int per = elems / 32, q6 = type == T_Q6_K, halves = q6 ? 2 : 1;
  const int64_t nbp = nblocks * per;
  for (int r = 0; r < PANEL; r++) {
    uint8_t *restrict st = stage + r * 32 * nbp;
    if (r >= rows) {
      memset(st, 0, (size_t)(32 * nbp));
      for (int64_t i = 0; i < nbp; i++) a[PANEL * i + r] = 0.f;
      for (int64_t i = 0; i < halves * nbp; i++) {
        o[PANEL * i + r] = 0.f;
        if (q6) sci[PANEL * i + r] = 0;
      }
      continue;
    }
    const uint8_t *restrict wr = w + r * row_bytes;
    for (int64_t b = 0; b < nblocks; b++) {
      __m256i c[8], sg[8];
      float dw[8], ow[16];
      int16_t sc[8 * 16];
      decode_block(type, wr + b * bytes, c, sg, dw, ow, sc);
      for (int i = 0; i < per; i++) {
        const int64_t blk = b * per + i;
        store32(st + 32 * blk, c[i]);
        a[PANEL * blk + r] = dw[i];
        for (int e = 0; e < halves; e++) {
          o[PANEL * (halves * blk + e) + r] = ow[halves * i + e];
          if (q6) sci[PANEL * (2 * blk + e) + r] = sc[16 * i + 8 * e];
        }
      }
    }
  }
  for (int64_t blk = 0; blk < nbp; blk++) {
    __m256i lo[8], hi[8];
    for (int r = 0; r < 8; r++)
      lo[r] = load32(stage + r * 32 * nbp + 32 * blk),
      hi[r] = load32(stage + (8 + r) * 32 * nbp + 32 * blk);
    transpose8(lo), transpose8(hi); /* lo[j]: dword j of rows 0..7 */
    for (int j = 0; j < 8; j++)
      _mm512_storeu_si512(codes + 512 * blk + 64 * j,
                          _mm512_inserti64x4(_mm512_castsi256_si512(lo[j]), hi[j], 1));
  }
}

/* Rows t0 .. t0 + MT of x against one unpacked panel -> out[t], lane c: column c's output
 * (before the bias). Each block's codes are loaded once for the MT rows. */
static inline __attribute__((always_inline)) void panel_tile(
    const int type, const int MT, const uint8_t *restrict codes, const float *restrict a,
    const float *restrict o, const int32_t *restrict sci, const xq_t *xq, const int64_t t0,
    __m512 *out) {
  const int64_t nbp = xq->nb, kp = xq->k, groups = nbp / 8 * 8;
  const int q6 = type == T_Q6_K;
  __m512 acc[PANEL_ROWS][8], off[PANEL_ROWS][8], tail[PANEL_ROWS];
  for (int t = 0; t < MT; t++) {
    tail[t] = _mm512_setzero_ps();
    for (int i = 0; i < 8; i++) acc[t][i] = off[t][i] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < groups; b++) {
    const int i = (int)(b & 7); /* the block's lane in direct_row */
    __m512i z[8];
    for (int j = 0; j < 8; j++) z[j] = _mm512_loadu_si512(codes + 512 * b + 64 * j);
    const __m512 ab = _mm512_loadu_ps(a + PANEL * b);
    for (int t = 0; t < MT; t++) {
      const int8_t *xb = xq->q + (t0 + t) * kp + 32 * b;
      __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
      for (int j = 0; j < 4; j++) { /* chunks 0-3: the first 16 values; 4-7 the second */
        int32_t x0, x1;
        memcpy(&x0, xb + 4 * j, 4), memcpy(&x1, xb + 16 + 4 * j, 4);
        i0 = _mm512_dpbusd_epi32(i0, z[j], _mm512_set1_epi32(x0));
        i1 = _mm512_dpbusd_epi32(i1, z[4 + j], _mm512_set1_epi32(x1));
      }
      __m512i isum;
      if (q6) { /* exact: sc * (sum of 16 code products) per half, as vpmaddwd */
        const __m512i sc0 = _mm512_loadu_si512(sci + PANEL * 2 * b);
        const __m512i sc1 = _mm512_loadu_si512(sci + PANEL * (2 * b + 1));
        isum = _mm512_add_epi32(_mm512_mullo_epi32(i0, sc0), _mm512_mullo_epi32(i1, sc1));
      } else {
        isum = _mm512_add_epi32(i0, i1);
      }
      const __m512 sc = _mm512_mul_ps(ab, _mm512_set1_ps(xq->d[(t0 + t) * nbp + b]));
      acc[t][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sc, acc[t][i]);
      if (q6) { /* direct_row: off += ow[0..8] sx16[0..8] then ow[8..16] sx16[8..16] */
        const float *sx = xq->s16 + (t0 + t) * 2 * nbp + 2 * b;
        const int h = 2 * i; /* halves 2i, 2i + 1 of the group: lanes 2i % 8, (2i + 1) % 8 */
        off[t][h % 8] = _mm512_fmadd_ps(_mm512_loadu_ps(o + PANEL * 2 * b), _mm512_set1_ps(sx[0]),
                                        off[t][h % 8]);
        off[t][(h + 1) % 8] = _mm512_fmadd_ps(_mm512_loadu_ps(o + PANEL * (2 * b + 1)),
                                              _mm512_set1_ps(sx[1]), off[t][(h + 1) % 8]);
      } else {
        off[t][i] = _mm512_fmadd_ps(_mm512_loadu_ps(o + PANEL * b),
                                    _mm512_set1_ps(xq->s[(t0 + t) * nbp + b]), off[t][i]);
      }
    }
  }
  for (int64_t b = groups; b < nbp; b++) { /* 32-value formats only: each chunk to its lane */
    __m512i z[8];
    for (int j = 0; j < 8; j++) z[j] = _mm512_loadu_si512(codes + 512 * b + 64 * j);
    const __m512 ab = _mm512_loadu_ps(a + PANEL * b), ob = _mm512_loadu_ps(o + PANEL * b);
    for (int t = 0; t < MT; t++) {
      const int8_t *xb = xq->q + (t0 + t) * kp + 32 * b;
      const __m512 sc = _mm512_mul_ps(ab, _mm512_set1_ps(xq->d[(t0 + t) * nbp + b]));
      for (int j = 0; j < 8; j++) {
        int32_t xj;
        memcpy(&xj, xb + 4 * j, 4);
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z[j], _mm512_set1_epi32(xj));
        acc[t][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc[t][j]);
      }
      tail[t] = _mm512_add_ps(tail[t],
                              _mm512_mul_ps(ob, _mm512_set1_ps(xq->s[(t0 + t) * nbp + b])));
    }
  }
  for (int t = 0; t < MT; t++) {
    __m512 v[8];
    for (int i = 0; i < 8; i++) v[i] = _mm512_add_ps(acc[t][i], off[t][i]);
    const __m512 s0 = _mm512_add_ps(v[0], v[4]), s1 = _mm512_add_ps(v[1], v[5]);
    const __m512 s2 = _mm512_add_ps(v[2], v[6]), s3 = _mm512_add_ps(v[3], v[7]);
    out[t] = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s2), _mm512_add_ps(s1, s3)), tail[t]);
  }
}

/* W rows [p0 * PANEL, min(n, p1 * PANEL)) against every row of x, a panel at a time. */
static inline __attribute__((always_inline)) int panels_range_t(
    const int type, const int dtype, const uint8_t *w, const int64_t row_bytes,
    const int64_t nblocks, const xq_t *xq, const int64_t m, const void *bias, void *y,
    const int64_t n, const int64_t p0, const int64_t p1) {
  const int64_t nbp = xq->nb;
  /* codes [nbp * 512] | stage [nbp * 512] | a [nbp * PANEL] | o [2 nbp * PANEL] | sc [2 nbp
   * * PANEL] */
  char *buf = malloc((size_t)(1024 * nbp) + sizeof(float) * (size_t)(5 * PANEL * nbp) + 64);
  if (buf == NULL) return -2;
  uint8_t *codes = (uint8_t *)buf, *stage = codes + 512 * nbp;
  float *a = (float *)(buf + 1024 * nbp), *o = a + PANEL * nbp;
  int32_t *sci = (int32_t *)(o + 2 * PANEL * nbp);
  for (int64_t p = p0; p < p1; p++) {
    const int64_t j0 = p * PANEL;
    const int cols = n - j0 < PANEL ? (int)(n - j0) : PANEL;
    unpack_panel(type, w + j0 * row_bytes, row_bytes, nblocks, cols, stage, codes, a, o, sci);
    float bj[PANEL];
    for (int c = 0; c < cols; c++) bj[c] = load_bias(bias, dtype, j0 + c);
    for (int64_t t0 = 0; t0 < m; t0 += PANEL_ROWS) {
      const int mt = m - t0 < PANEL_ROWS ? (int)(m - t0) : PANEL_ROWS;
      __m512 out[PANEL_ROWS];
      switch (mt) {
        case 1: panel_tile(type, 1, codes, a, o, sci, xq, t0, out); break;
        case 2: panel_tile(type, 2, codes, a, o, sci, xq, t0, out); break;
        case 3: panel_tile(type, 3, codes, a, o, sci, xq, t0, out); break;
        default: panel_tile(type, PANEL_ROWS, codes, a, o, sci, xq, t0, out); break;
      }
      for (int t = 0; t < mt; t++) {
        float v[PANEL];
        _mm512_storeu_ps(v, out[t]);
        for (int c = 0; c < cols; c++) store(y, dtype, (t0 + t) * n + j0 + c, v[c] + bj[c]);
      }
    }
  }
  free(buf);
  return 0;
}

static int q8_panels_range(const int type, const int dtype, const uint8_t *w,
                           const int64_t row_bytes, const int64_t nblocks, const xq_t *xq,
                           const int64_t m, const void *bias, void *y, const int64_t n,
                           const int64_t p0, const int64_t p1) {
#define PANELS(TYPE) \
  return panels_range_t(TYPE, dtype, w, row_bytes, nblocks, xq, m, bias, y, n, p0, p1)
  switch (type) {
    case T_Q4_0: PANELS(T_Q4_0);
    case T_Q4_1: PANELS(T_Q4_1);
    case T_Q5_0: PANELS(T_Q5_0);
    case T_Q5_1: PANELS(T_Q5_1);
    case T_Q8_0: PANELS(T_Q8_0);
    case T_Q4_K: PANELS(T_Q4_K);
    case T_Q5_K: PANELS(T_Q5_K);
    default: PANELS(T_Q6_K);
  }
#undef PANELS
}
#else
#define Q8_PANEL 0
#endif /* Q8_VNNI && __AVX512F__ */

#else
#define Q8_PANEL 0
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

static int q8_rows_range(const int type, const int dtype, const uint8_t *w, const int64_t row_bytes,
                         const int64_t nblocks, const xq_t *xq, const int64_t m, const void *bias,
                         void *y, const int64_t n, const int64_t j0, const int64_t j1) {
  for (int64_t j = j0; j < j1; j++) {
    const float bj = load_bias(bias, dtype, j);
    for (int64_t t0 = 0; t0 < m; t0 += Q8_TILE) {
      const int mt = m - t0 < Q8_TILE ? (int)(m - t0) : Q8_TILE;
      float o[Q8_TILE];
      q8_rows(type, w + j * row_bytes, nblocks, xq, t0, mt, o);
      for (int t = 0; t < mt; t++) store(y, dtype, (t0 + t) * n + j, o[t] + bj);
    }
  }
  return 0;
}
#endif

/* Returns 0, -1 for a type this kernel does not take or a K that is not a multiple of its
 * block, -2 when scratch memory cannot be allocated. Arguments as wick_gguf_gemm's. */
int wick_gguf_q8_gemm(const int type, const int dtype, const void *x, const int64_t x_stride,
                      const uint8_t *w, const void *bias, void *y, const int64_t m,
                      const int64_t n, const int64_t k, const int num_threads,
                      const int64_t min_work_per_thread) {
  int elems, bytes;
  if (!wick_gguf_q8_supports(type) || !block_shape(type, &elems, &bytes) || k % elems) return -1;
  if (m <= 0 || n <= 0) return 0;
  const int64_t row_bytes = k / elems * bytes, nblocks = k / elems;
  const int64_t kp = k, nbp = k / 32; /* K is a multiple of 32 for every type taken */
  /* one allocation: q [m, kp] int8, then d, s [m, nbp] and s16 [m, 2 nbp] fp32 */
  char *scratch = malloc((size_t)(m * kp) + 4 * sizeof(float) * (size_t)(m * nbp) + 64);
  if (scratch == NULL) return -2;
  int8_t *q = (int8_t *)scratch;
  float *d = (float *)(scratch + ((m * kp + 63) & ~(int64_t)63)), *s = d + m * nbp;
  float *s16 = s + m * nbp;
  quantize_x(dtype, x, x_stride, m, k, kp, q, d, s, s16);
  const xq_t xq = {q, d, s, s16, kp, nbp};
  /* Many rows: column panels (same sums, same order); else one W row at a time. */
#if Q8_PANEL
  const int by_panels = m >= PANEL_MIN_ROWS;
  const int64_t units = by_panels ? (n + PANEL - 1) / PANEL : n; /* what the threads split */
#else
  const int by_panels = 0;
  const int64_t units = n;
#endif
#if defined(__AVX2__)
  if (!by_panels && m > DIRECT_MAX_ROWS) /* the row-buffer path reads x's groups transposed */
    for (int64_t i = 0; i < m; i++) transpose_groups(q + i * kp, nbp / 8);
#endif
  const int threads = threads_for(n * k * (m < Q8_TILE ? m : Q8_TILE), min_work_per_thread,
                                  num_threads);
  int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    int tid = 0, count = 1;
#ifdef _OPENMP
    tid = omp_get_thread_num(), count = omp_get_num_threads();
#endif
    /* contiguous ranges of units (panels of PANEL W rows, or W rows), as schedule(static) */
    const int64_t u0 = units * tid / count, u1 = units * (tid + 1) / count;
    const int status =
#if Q8_PANEL
        by_panels ? q8_panels_range(type, dtype, w, row_bytes, nblocks, &xq, m, bias, y, n, u0, u1)
                  :
#endif
                  q8_rows_range(type, dtype, w, row_bytes, nblocks, &xq, m, bias, y, n, u0, u1);
    if (status != 0) {
#pragma omp atomic write
      failed = 1;
    }
  }
  free(scratch);
  return failed ? -2 : 0;
}
