/* wNa16 matmul for CPUs: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), W held as 4- or 8-bit codes
 * with per-group scales and offsets (GPTQ and AWQ checkpoints kept quantized), dequantized in
 * registers as it is read: the few rows of a decode step stream half a byte (4 bits) or a byte
 * (8 bits) per weight instead of two or four.
 *
 * The layout (kernels/portable.py, "wNa16"; layers/quantization/wna16.py fills it):
 *   codes    uint8; 8 bits: [N, K], one code per byte; 4 bits: [N, K / 2], K in blocks of 32, byte
 *            j (0..15) of a block holding k = 32 b + j in its low nibble and 32 b + 16 + j in its
 *            high one
 *   scales   [N, G] float32, offsets [N, G] float32: W[n, k] = scales[n, g] * q + offsets[n, g],
 *            g = k / group_size, G = ceil(K / group_size) (group_size and K multiples of 32;
 *            the last group is shorter where group_size does not divide K)
 *   x        [M, K] fp32 (`dtype` 0) or bf16 (1), rows `x_stride` elements apart
 *   bias     [N] in x's dtype, or NULL;  y [M, N] contiguous, x's dtype
 * A weight is dequantized in fp32 with one FMA (q * scale + offset: the portable reference rounds
 * twice, so results differ from it by float rounding only), products accumulate in fp32; bf16
 * outputs are rounded once (bias added first), to nearest even.
 *
 * Work split as in gemm.c: W's rows in one contiguous range per thread, taken TILE_N rows at a
 * time; a register tile is up to tile_rows() rows of x by TILE_N rows of W, TILE_M x TILE_N
 * vector accumulators over the whole of K. With at most one tile of x rows (decode), W is
 * dequantized in registers: per step of VW codes of a W row, a widening load of VW bytes (or
 * VW / 2 for the nibbles), a mask or shift, an int-to-float conversion and one FMA with the
 * group's scale and offset, shared by every row of x in the tile. With more rows, each TILE_N
 * rows of W are dequantized once into a per-thread fp32 buffer (4 K floats: L1 or L2) that every
 * block of x rows then reads, so the dequantization is not repeated per block. bf16 x is widened
 * to fp32 once per call; on AVX512-BF16 builds, bf16 x with more rows than one tile stays bf16
 * and runs on vdpbf16ps against the W tile rounded to bf16 (one more rounding of each weight,
 * 2^-9 relative, as a bf16 model's weights have).
 *
 * Vector paths: compiled once per ISA (kernels/cpu/native.py) with GCC vector extensions of the
 * ISA's width (wick_vec.h: 16 lanes on AVX-512, 8 on AVX2, 4 otherwise); the byte widening uses
 * the ISA's zero-extending load where there is one.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "wick_cpu.h"
#include "wick_entry.h"
#include "wick_vec.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512BF16__)
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

#define WNA16_BLOCK 32
#define TILE_M 4 /* rows of x per register tile, at most (see tile_rows) */
#define TILE_N 4 /* rows of W per register tile */
#ifndef WNA16_PREFETCH
#define WNA16_PREFETCH 1024 /* bytes of codes prefetched ahead of the ones being read */
#endif

typedef int32_t vi __attribute__((vector_size(VW * sizeof(int32_t))));

/* VW bytes at p, zero-extended to VW int32 lanes. */
static inline vi load_u8(const uint8_t *p) {
#if VW == 16
  return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif VW == 8
  return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
  uint8_t b[VW];
  memcpy(b, p, VW);
  return (vi){b[0], b[1], b[2], b[3]};
#endif
}

static inline float hsum_vf(const vf v) {
  float s = 0.f;
  for (int i = 0; i < VW; i++) s += v[i];
  return s;
}

/* A tile: mr rows of x (fp32, rows xs apart) against nr rows of W (codes rows `cs` bytes apart,
 * scales/offsets rows G apart). sums[i][j]: x row i . W row j. mr, nr and bits are constants
 * after inlining, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void tile(const int mr, const int nr, const int bits,
                                                       const float *restrict x, const int64_t xs,
                                                       const uint8_t *restrict codes,
                                                       const int64_t cs,
                                                       const float *restrict scales,
                                                       const float *restrict offsets, const int G,
                                                       const int K, const int group_size,
                                                       float sums[TILE_M][TILE_N]) {
  vf acc[TILE_M][TILE_N];
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) acc[i][j] = (vf){0};
  for (int g = 0; g < G; g++) {
    vf sc[TILE_N], of[TILE_N];
    for (int j = 0; j < nr; j++) {
      sc[j] = (vf){0} + scales[(int64_t)j * G + g];
      of[j] = (vf){0} + offsets[(int64_t)j * G + g];
    }
    const int k0 = g * group_size, k1 = k0 + group_size < K ? k0 + group_size : K;
    if (bits == 4) {
      for (int k = k0; k < k1; k += WNA16_BLOCK) {
        const uint8_t *cb = codes + k / 2;
        for (int j = 0; j < nr; j++)
          __builtin_prefetch(cb + (int64_t)j * cs + WNA16_PREFETCH, 0, 2);
        /* 16 bytes: k .. k + 15 in the low nibbles, k + 16 .. k + 31 in the high ones. */
        for (int c = 0; c < 16; c += VW) {
          vf lo[TILE_N], hi[TILE_N];
          for (int j = 0; j < nr; j++) {
            const vi b = load_u8(cb + (int64_t)j * cs + c);
            lo[j] = vfma(__builtin_convertvector(b & 15, vf), sc[j], of[j]);
            hi[j] = vfma(__builtin_convertvector(b >> 4, vf), sc[j], of[j]);
          }
          for (int i = 0; i < mr; i++) {
            const vf xl = vload(x + i * xs + k + c);
            const vf xh = vload(x + i * xs + k + 16 + c);
            for (int j = 0; j < nr; j++) {
              acc[i][j] = vfma(xl, lo[j], acc[i][j]);
              acc[i][j] = vfma(xh, hi[j], acc[i][j]);
            }
          }
        }
      }
    } else {
      for (int k = k0; k < k1; k += VW) {
        if (k % 64 == 0)
          for (int j = 0; j < nr; j++)
            __builtin_prefetch(codes + (int64_t)j * cs + k + WNA16_PREFETCH, 0, 2);
        vf w[TILE_N];
        for (int j = 0; j < nr; j++)
          w[j] = vfma(__builtin_convertvector(load_u8(codes + (int64_t)j * cs + k), vf), sc[j],
                      of[j]);
        for (int i = 0; i < mr; i++) {
          const vf xv = vload(x + i * xs + k);
          for (int j = 0; j < nr; j++) acc[i][j] = vfma(xv, w[j], acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) sums[i][j] = hsum_vf(acc[i][j]);
}

static void tile_any(const int bits, const int mr, const int nr, const float *x, const int64_t xs,
                     const uint8_t *codes, const int64_t cs, const float *scales,
                     const float *offsets, const int G, const int K, const int group_size,
                     float sums[TILE_M][TILE_N]) {
#define TILE(MR, NR)                                                                         \
  if (mr == MR && nr == NR) {                                                                \
    if (bits == 4)                                                                           \
      tile(MR, NR, 4, x, xs, codes, cs, scales, offsets, G, K, group_size, sums);            \
    else                                                                                     \
      tile(MR, NR, 8, x, xs, codes, cs, scales, offsets, G, K, group_size, sums);            \
    return;                                                                                  \
  }
#define TILES(MR) TILE(MR, 4) TILE(MR, 1)
  TILES(1)
  TILES(2)
  TILES(3)
  TILES(4)
#undef TILES
#undef TILE
}

/* Rows of x per tile: 4 with AVX-512's 32 vector registers, 2 with 16 (AVX2, generic), where
 * 4 x 4 accumulators plus the widened W rows and their scales would spill. */
static inline int tile_rows(void) { return VW == 16 ? TILE_M : 2; }

/* Dequantize rows [n, n + nr) of W into buf [nr][K] (fp32, the same FMA as `tile`). */
static void dequant_rows(const int bits, const int nr, const uint8_t *codes, const int64_t cs,
                         const float *scales, const float *offsets, const int G, const int K,
                         const int group_size, float *restrict buf) {
  for (int j = 0; j < nr; j++) {
    const uint8_t *c = codes + (int64_t)j * cs;
    float *out = buf + (int64_t)j * K;
    for (int g = 0; g < G; g++) {
      const vf sc = (vf){0} + scales[(int64_t)j * G + g];
      const vf of = (vf){0} + offsets[(int64_t)j * G + g];
      const int k0 = g * group_size, k1 = k0 + group_size < K ? k0 + group_size : K;
      if (bits == 4) {
        for (int k = k0; k < k1; k += WNA16_BLOCK)
          for (int h = 0; h < 16; h += VW) {
            const vi b = load_u8(c + k / 2 + h);
            const vf lo = vfma(__builtin_convertvector(b & 15, vf), sc, of);
            const vf hi = vfma(__builtin_convertvector(b >> 4, vf), sc, of);
            memcpy(out + k + h, &lo, sizeof lo);
            memcpy(out + k + 16 + h, &hi, sizeof hi);
          }
      } else {
        for (int k = k0; k < k1; k += VW) {
          const vf w = vfma(__builtin_convertvector(load_u8(c + k), vf), sc, of);
          memcpy(out + k, &w, sizeof w);
        }
      }
    }
  }
}

/* A tile of fp32 x rows against nr dequantized W rows (buf, rows K apart). */
static inline __attribute__((always_inline)) void tile_f32(const int mr, const int nr,
                                                           const float *restrict x,
                                                           const int64_t xs,
                                                           const float *restrict w, const int K,
                                                           float sums[TILE_M][TILE_N]) {
  vf acc[TILE_M][TILE_N];
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) acc[i][j] = (vf){0};
  for (int k = 0; k < K; k += VW) {
    vf wv[TILE_N];
    for (int j = 0; j < nr; j++) wv[j] = vload(w + (int64_t)j * K + k);
    for (int i = 0; i < mr; i++) {
      const vf xv = vload(x + i * xs + k);
      for (int j = 0; j < nr; j++) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) sums[i][j] = hsum_vf(acc[i][j]);
}

static void tile_f32_any(const int mr, const int nr, const float *x, const int64_t xs,
                         const float *w, const int K, float sums[TILE_M][TILE_N]) {
#define TILE(MR, NR)                          \
  if (mr == MR && nr == NR) {                 \
    tile_f32(MR, NR, x, xs, w, K, sums);      \
    return;                                   \
  }
#define TILES(MR) TILE(MR, 4) TILE(MR, 1)
  TILES(1)
  TILES(2)
  TILES(3)
  TILES(4)
#undef TILES
#undef TILE
}

static void store_tile(const int mr, const int nr, float sums[TILE_M][TILE_N], const void *bias,
                       const int out_bf16, void *y, const int m, const int n, const int N) {
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) {
      float v = sums[i][j];
      const int64_t at = (int64_t)(m + i) * N + n + j;
      if (out_bf16) {
        if (bias != NULL) v += bf16_to_f32(((const bf16_t *)bias)[n + j]);
        ((bf16_t *)y)[at] = f32_to_bf16(v);
      } else {
        if (bias != NULL) v += ((const float *)bias)[n + j];
        ((float *)y)[at] = v;
      }
    }
}

#if HAVE_DPBF16
/* Rows [n, n + nr) of W dequantized (fp32, as dequant_rows) and rounded to bf16 into buf. */
static void dequant_rows_bf16(const int bits, const int nr, const uint8_t *codes, const int64_t cs,
                              const float *scales, const float *offsets, const int G, const int K,
                              const int group_size, float *tmp, bf16_t *restrict buf) {
  for (int j = 0; j < nr; j++) {
    dequant_rows(bits, 1, codes + (int64_t)j * cs, cs, scales + (int64_t)j * G,
                 offsets + (int64_t)j * G, G, K, group_size, tmp);
    for (int k = 0; k < K; k += 16)
      _mm256_storeu_si256((__m256i *)(buf + (int64_t)j * K + k),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(tmp + k)));
  }
}

/* A tile on vdpbf16ps: bf16 x rows (xs apart) against nr bf16 W rows (buf, K apart), K a
 * multiple of 32. */
static inline __attribute__((always_inline)) void tile_dp(const int mr, const int nr,
                                                          const bf16_t *restrict x,
                                                          const int64_t xs,
                                                          const bf16_t *restrict w, const int K,
                                                          float sums[TILE_M][TILE_N]) {
  vf acc[TILE_M][TILE_N];
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) acc[i][j] = (vf){0};
  for (int k = 0; k < K; k += 32) {
    __m512bh wv[TILE_N];
    for (int j = 0; j < nr; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + (int64_t)j * K + k);
    for (int i = 0; i < mr; i++) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * xs + k);
      for (int j = 0; j < nr; j++)
        acc[i][j] = (vf)_mm512_dpbf16_ps((__m512)acc[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) sums[i][j] = hsum_vf(acc[i][j]);
}

static void tile_dp_any(const int mr, const int nr, const bf16_t *x, const int64_t xs,
                        const bf16_t *w, const int K, float sums[TILE_M][TILE_N]) {
#define TILE(MR, NR)                     \
  if (mr == MR && nr == NR) {            \
    tile_dp(MR, NR, x, xs, w, K, sums);  \
    return;                              \
  }
#define TILES(MR) TILE(MR, 4) TILE(MR, 1)
  TILES(1)
  TILES(2)
  TILES(3)
  TILES(4)
#undef TILES
#undef TILE
}

/* The bf16 rows of more than one tile of x on AVX512-BF16: each TILE_N rows of W dequantized
 * once, rounded to bf16 (buf), then every block of x rows on vdpbf16ps (32 multiply-adds an
 * instruction, twice the fp32 FMA's), as gemm.c's bf16 path from 4 rows. */
static void rows_of_w_dp(const int bits, const bf16_t *x, const int64_t xs, const uint8_t *codes,
                         const float *scales, const float *offsets, const void *bias, void *y,
                         const int M, const int N, const int K, const int group_size,
                         const int n0, const int n1, float *tmp, bf16_t *buf) {
  const int G = (K + group_size - 1) / group_size;
  const int64_t cs = bits == 4 ? K / 2 : K;
  const int blocks = (M + TILE_M - 1) / TILE_M;
  float sums[TILE_M][TILE_N];
  for (int n = n0, nr; n < n1; n += nr) {
    nr = n1 - n < TILE_N ? 1 : TILE_N;
    dequant_rows_bf16(bits, nr, codes + (int64_t)n * cs, cs, scales + (int64_t)n * G,
                      offsets + (int64_t)n * G, G, K, group_size, tmp, buf);
    for (int b = 0, m = 0, mr; b < blocks; b++, m += mr) {
      mr = (M - m + blocks - b - 1) / (blocks - b);
      tile_dp_any(mr, nr, x + (int64_t)m * xs, xs, buf, K, sums);
      store_tile(mr, nr, sums, bias, 1, y, m, n, N);
    }
  }
}
#endif

/* Rows [n0, n1) of W against every row of x into y. Up to one tile of x rows: W dequantized in
 * registers (`tile`). More: each W tile is dequantized once into `buf` (TILE_N rows of K fp32,
 * in L1/L2) and every block of x rows runs fp32 FMAs on it, instead of dequantizing it again
 * per block. */
static void rows_of_w(const int bits, const float *x, const int64_t xs, const uint8_t *codes,
                      const float *scales, const float *offsets, const void *bias,
                      const int out_bf16, void *y, const int M, const int N, const int K,
                      const int group_size, const int n0, const int n1, float *buf) {
  const int G = (K + group_size - 1) / group_size;
  const int64_t cs = bits == 4 ? K / 2 : K; /* bytes per row of codes */
  const int rows = tile_rows();
  const int blocks = (M + rows - 1) / rows;
  float sums[TILE_M][TILE_N];
  for (int n = n0, nr; n < n1; n += nr) {
    nr = n1 - n < TILE_N ? 1 : TILE_N;
    const uint8_t *cn = codes + (int64_t)n * cs;
    const float *sn = scales + (int64_t)n * G, *on = offsets + (int64_t)n * G;
    if (blocks > 1 && buf != NULL)
      dequant_rows(bits, nr, cn, cs, sn, on, G, K, group_size, buf);
    for (int b = 0, m = 0, mr; b < blocks; b++, m += mr) {
      mr = (M - m + blocks - b - 1) / (blocks - b);
      if (blocks > 1 && buf != NULL)
        tile_f32_any(mr, nr, x + (int64_t)m * xs, xs, buf, K, sums);
      else
        tile_any(bits, mr, nr, x + (int64_t)m * xs, xs, cn, cs, sn, on, G, K, group_size, sums);
      store_tile(mr, nr, sums, bias, out_bf16, y, m, n, N);
    }
  }
}

/* Returns 0; -1 when the fp32 copy of a bf16 x could not be allocated; -2 for a shape the
 * layout does not allow (bits not 4 or 8, group_size or K not a multiple of 32). */
int wick_wna16_gemm(int dtype, const void *x, int64_t x_stride, const uint8_t *codes,
                    const float *scales, const float *offsets, const void *bias, void *y, int M,
                    int N, int K, int bits, int group_size, int num_threads,
                    int64_t min_work_per_thread) {
  if (M <= 0 || N <= 0) return 0;
  if ((bits != 4 && bits != 8) || group_size <= 0 || group_size % WNA16_BLOCK || K % WNA16_BLOCK)
    return -2;
  /* bf16 x with more rows than one tile: vdpbf16ps on bf16-rounded W tiles, where built. */
  const int use_dp = HAVE_DPBF16 && dtype != 0 && M > tile_rows();
  const float *xr = (const float *)x;
  int64_t xs = x_stride;
  float *converted = NULL;
  if (dtype != 0 && !use_dp) {
    converted = widen_bf16_rows((const bf16_t *)x, M, K, x_stride);
    if (converted == NULL) return -1;
    xr = converted;
    xs = K;
  }
  num_threads = threads_for((int64_t)M * N * K, min_work_per_thread, num_threads);
  const int tiles = (N + TILE_N - 1) / TILE_N;
  if (num_threads > tiles) num_threads = tiles;
  if (num_threads < 1) num_threads = 1;
  int failed = 0; /* a thread's scratch could not be allocated (dp path) */
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
  {
#ifdef _OPENMP
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int t = 0, nt = 1;
#endif
    const int n0 = (int)((int64_t)tiles * t / nt) * TILE_N;
    const int n1e = (int)((int64_t)tiles * (t + 1) / nt) * TILE_N;
    const int n1 = n1e < N ? n1e : N;
    /* More rows than one tile: a per-thread buffer for a dequantized W tile (NULL if it cannot
     * be allocated: the register path serves). */
    float *buf = M > tile_rows() ? (float *)malloc(sizeof(float) * TILE_N * (size_t)K) : NULL;
#if HAVE_DPBF16
    bf16_t *buf16 = use_dp ? (bf16_t *)malloc(sizeof(bf16_t) * TILE_N * (size_t)K) : NULL;
    if (use_dp && buf != NULL && buf16 != NULL)
      rows_of_w_dp(bits, (const bf16_t *)x, x_stride, codes, scales, offsets, bias, y, M, N, K,
                   group_size, n0, n1, buf, buf16);
    else if (!use_dp)
      rows_of_w(bits, xr, xs, codes, scales, offsets, bias, dtype != 0, y, M, N, K, group_size,
                n0, n1, buf);
    else
      failed = 1;
    free(buf16);
#else
    rows_of_w(bits, xr, xs, codes, scales, offsets, bias, dtype != 0, y, M, N, K, group_size, n0,
              n1, buf);
#endif
    free(buf);
  }
  free(converted);
  return failed ? -1 : 0;
}

/* W rows [0, N) dequantized into w [N, K] (`dtype` 0: fp32, 1: bf16, rounded to nearest even):
 * the first half of dequantize-then-matmul for big row counts, on `num_threads` threads (rows
 * split evenly). Returns 0, or -2 for a layout `wick_wna16_gemm` refuses too. */
int wick_wna16_dequantize(int dtype, const uint8_t *codes, const float *scales,
                          const float *offsets, void *w, int N, int K, int bits, int group_size,
                          int num_threads) {
  if (N <= 0) return 0;
  if ((bits != 4 && bits != 8) || group_size <= 0 || group_size % WNA16_BLOCK || K % WNA16_BLOCK)
    return -2;
  const int G = (K + group_size - 1) / group_size;
  const int64_t cs = bits == 4 ? K / 2 : K;
  if (num_threads > N) num_threads = N;
  if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
  {
#ifdef _OPENMP
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int t = 0, nt = 1;
#endif
    const int n0 = (int)((int64_t)N * t / nt), n1 = (int)((int64_t)N * (t + 1) / nt);
    float *row = dtype == 0 ? NULL : (float *)malloc(sizeof(float) * (size_t)K);
    for (int n = n0; n < n1; n++) {
      float *out = dtype == 0 ? (float *)w + (int64_t)n * K : row;
      if (out == NULL) break; /* no scratch row: the caller sees the rows untouched */
      dequant_rows(bits, 1, codes + (int64_t)n * cs, cs, scales + (int64_t)n * G,
                   offsets + (int64_t)n * G, G, K, group_size, out);
      if (dtype != 0)
        for (int k = 0; k < K; k++) ((bf16_t *)w)[(int64_t)n * K + k] = f32_to_bf16(row[k]);
    }
    free(row);
  }
  return 0;
}

/* `wick_wna16_gemm` with its arguments in one int64 array, in its order (pointers as
 * integers): one ctypes argument instead of fifteen. */
int wick_wna16_gemm_packed(const int64_t *a) {
  return wick_wna16_gemm((int)a[0], (const void *)(intptr_t)a[1], a[2],
                         (const uint8_t *)(intptr_t)a[3], (const float *)(intptr_t)a[4],
                         (const float *)(intptr_t)a[5], (const void *)(intptr_t)a[6],
                         (void *)(intptr_t)a[7], (int)a[8], (int)a[9], (int)a[10], (int)a[11],
                         (int)a[12], (int)a[13], a[14]);
}
