/* Skinny matmul for CPUs: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]) for the few rows of a
 * decode batch (M = 1..16), where BLAS/oneDNN kernels tuned for large M stream W slowly.
 *
 * Shapes (`dtype` 0: x, W, bias and y fp32; 1: all bf16, stored as uint16):
 *   x    [M, K], rows `x_stride` elements apart (the last dimension contiguous)
 *   W    [N, K] contiguous (a torch Linear's weight as it is: no packing)
 *   bias [N] or NULL
 *   y    [M, N] contiguous, x's dtype
 * Products accumulate in fp32; bf16 outputs are rounded once (bias added first), to nearest
 * even, as torch does.
 *
 * W is read once per call, whatever M: its N rows are split into one contiguous range per
 * thread (each thread streams its own part of W), and a range is taken TILE_N rows at a time;
 * every row of x meets those rows while they are in L1 (x itself, M * K values, stays in L2).
 * A register tile is up to TILE_M rows of x by TILE_N rows of W: TILE_M * TILE_N vector
 * accumulators over the whole of K, reduced four W rows at a time into the four adjacent outputs
 * of a row of y. No K blocking: SmolLM2's K of 576 and 1536 keep a tile's W rows (4.5-12 KB in
 * bf16) in L1, and where they do not (K = 4096, 14336) the later rows of x read them from L2
 * about as fast: blocks of 1024-4096 values of K were no faster (Zen 4, 1-16 rows of x).
 * While the first rows of x run, W is prefetched into L2 PREFETCH_BYTES ahead of the tile: rows
 * of a few hundred values are too short for the hardware prefetcher to ramp up on (on a Zen 4,
 * W read from memory: 1.5-2.3x at one row of x; 16 KB ahead into L2 beat 1-4 KB, and L1).
 *
 * Vector paths: this file is compiled once per ISA (kernels/cpu/native.py). The loops use GCC
 * vector extensions of the ISA's width (16 floats on AVX-512, 8 on AVX2, 4 otherwise), so one
 * source serves every build; x86 intrinsics only where GCC would not emit the instruction (FMA
 * under -std=c11, the 16-lane bf16 widening, the reductions). bf16 runs one of two ways:
 *   - shift: x converted to fp32 once per call, W widened to fp32 as it is read (a 16-bit left
 *     shift of the bits), fp32 FMAs. Every build.
 *   - dpbf16: x and W read as bf16 by vdpbf16ps (32 multiply-adds per instruction, pairs of
 *     exact products added into fp32 lanes; bf16 denormals read as zero). Builds with
 *     AVX512-BF16 (__AVX512BF16__), where the caller allows it (`use_dpbf16`), from
 *     DPBF16_MIN_ROWS rows of x.
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
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512BF16__)
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 16384 /* how far ahead of the tile being read W is prefetched */
#endif
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 2 /* __builtin_prefetch's: 2 (prefetcht1) into L2 */
#endif
/* Rows of x from which bf16 runs on vdpbf16ps (where allowed): with fewer, the shift path was
 * 0-20% faster on a Zen 4 with W read from memory (both are bound by it there), with 4 rows
 * vdpbf16ps was 5-15% faster, with 8 rows 15-35%. */
#define DPBF16_MIN_ROWS 4
#define TILE_M 4 /* rows of x per register tile, at most (see tile_rows) */
#define TILE_N 4 /* rows of W per register tile: one 4-lane row of outputs */

/* Four outputs of a row of y (adjacent columns): a tile's results, bias and rounding. */
typedef float v4f __attribute__((vector_size(16)));
typedef uint32_t v4u __attribute__((vector_size(16)));
typedef uint16_t v4h __attribute__((vector_size(8)));

/* How a call computes: fp32, or bf16 (shift or dpbf16, see the header). */
enum { MODE_F32, MODE_BF16_SHIFT, MODE_BF16_DP };

static inline float hsum(const vf v) {
  float s = 0.f;
  for (int i = 0; i < VW; i++) s += v[i];
  return s;
}

/* The lane sums of a, b, c, d as one 4-lane vector: halves added pairwise across the four
 * vectors, so that four reductions cost about one and a half. */
static inline v4f hsum4(const vf a, const vf b, const vf c, const vf d) {
#if VW == 16
  /* 128-bit blocks [a0 + a2, a1 + a3, b0 + b2, b1 + b3], and the same for c, d */
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4((__m512)a, (__m512)b, 0x44),
                                  _mm512_shuffle_f32x4((__m512)a, (__m512)b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4((__m512)c, (__m512)d, 0x44),
                                  _mm512_shuffle_f32x4((__m512)c, (__m512)d, 0xEE));
  /* block j: four partial sums of the j-th vector; then every lane of a block its sum */
  __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4E));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, 0xB1));
  const __m512i first_lanes = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
  return (v4f)_mm512_castps512_ps128(_mm512_permutexvar_ps(first_lanes, s));
#elif VW == 8 && defined(__AVX2__)
  const __m256 ab = _mm256_hadd_ps((__m256)a, (__m256)b);
  const __m256 cd = _mm256_hadd_ps((__m256)c, (__m256)d);
  const __m256 s = _mm256_hadd_ps(ab, cd); /* [a b c d] partials in each 128-bit half */
  return (v4f)_mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
#else
  return (v4f){hsum(a), hsum(b), hsum(c), hsum(d)};
#endif
}

/* sums[i] lane j = the lanes of acc[i][j] added, i < mr, j < nr. */
static inline __attribute__((always_inline)) void reduce_tile(const int mr, const int nr,
                                                              vf acc[TILE_M][TILE_N],
                                                              v4f sums[TILE_M]) {
  for (int i = 0; i < mr; i++) {
    if (nr == 4) {
      sums[i] = hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
    } else {
      for (int j = 0; j < nr; j++) sums[i][j] = hsum(acc[i][j]);
    }
  }
}

/* A tile on fp32 FMAs: x fp32 rows `xs` apart, W (fp32, or bf16 when `w_bf16`) rows K apart;
 * `pf` (or NULL): where to prefetch from. `mr`, `nr` and `w_bf16` are constants after
 * inlining, so the accumulators live in registers. The K % VW tail is added in scalars. */
static inline __attribute__((always_inline)) void tile_fma(const int mr, const int nr,
                                                           const int w_bf16,
                                                           const float *restrict x,
                                                           const int64_t xs,
                                                           const void *restrict w, const int K,
                                                           const char *pf, v4f sums[TILE_M]) {
  vf acc[TILE_M][TILE_N];
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) acc[i][j] = (vf){0};
  /* W cache lines read per step, prefetched as many per step PREFETCH_BYTES ahead */
  const int lines = nr * VW * (w_bf16 ? 2 : 4) / 64;
  const int kv = K - K % VW;
  for (int k = 0; k < kv; k += VW, pf += pf != NULL ? lines * 64 : 0) {
    if (pf != NULL)
      for (int l = 0; l < lines; l++) __builtin_prefetch(pf + l * 64, 0, PREFETCH_LOCALITY);
    vf wv[TILE_N];
    for (int j = 0; j < nr; j++)
      wv[j] = w_bf16 ? vload_bf16((const bf16_t *)w + (int64_t)j * K + k)
                     : vload((const float *)w + (int64_t)j * K + k);
    for (int i = 0; i < mr; i++) {
      const vf xv = vload(x + i * xs + k);
      for (int j = 0; j < nr; j++) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
  reduce_tile(mr, nr, acc, sums);
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++)
      for (int k = kv; k < K; k++) {
        const float wk = w_bf16 ? bf16_to_f32(((const bf16_t *)w)[(int64_t)j * K + k])
                                : ((const float *)w)[(int64_t)j * K + k];
        sums[i][j] += x[i * xs + k] * wk;
      }
}

#if HAVE_DPBF16
/* A tile on vdpbf16ps: x and W bf16 (rows `xs` and K apart), 32 values of K per step; the
 * K % 32 tail is loaded masked, its missing lanes zero. */
static inline __attribute__((always_inline)) void tile_dp(const int mr, const int nr,
                                                          const bf16_t *restrict x,
                                                          const int64_t xs,
                                                          const bf16_t *restrict w,
                                                          const int K, const char *pf,
                                                          v4f sums[TILE_M]) {
  vf acc[TILE_M][TILE_N];
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < nr; j++) acc[i][j] = (vf){0};
  const int kv = K - K % 32;
  for (int k = 0; k < kv; k += 32, pf += pf != NULL ? nr * 64 : 0) {
    if (pf != NULL)
      for (int l = 0; l < nr; l++) __builtin_prefetch(pf + l * 64, 0, PREFETCH_LOCALITY);
    __m512bh wv[TILE_N];
    for (int j = 0; j < nr; j++) {
      wv[j] = (__m512bh)_mm512_loadu_si512(w + (int64_t)j * K + k);
      /* Keeps the row in a register: GCC 12 otherwise loads it again for every row of x. */
      __asm__("" : "+v"(wv[j]));
    }
    for (int i = 0; i < mr; i++) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * xs + k);
      for (int j = 0; j < nr; j++)
        acc[i][j] = (vf)_mm512_dpbf16_ps((__m512)acc[i][j], xv, wv[j]);
    }
  }
  if (kv < K) {
    const __mmask32 m = (__mmask32)((1ull << (K - kv)) - 1);
    __m512bh wv[TILE_N];
    for (int j = 0; j < nr; j++)
      wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(m, w + (int64_t)j * K + kv);
    for (int i = 0; i < mr; i++) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + i * xs + kv);
      for (int j = 0; j < nr; j++)
        acc[i][j] = (vf)_mm512_dpbf16_ps((__m512)acc[i][j], xv, wv[j]);
    }
  }
  reduce_tile(mr, nr, acc, sums);
}
#endif

/* One copy of the tile per (mr, nr, mode) the driver uses: full tiles, the last rows of x
 * (blocks of fewer rows), and single W rows for the end of a thread's range. */
static void tile_any(const int mode, const int mr, const int nr, const void *x, const int64_t xs,
                     const void *w, const int K, const char *pf, v4f sums[TILE_M]) {
#if HAVE_DPBF16
#define TILE_DP(MR, NR)                                                 \
  if (mode == MODE_BF16_DP) {                                           \
    tile_dp(MR, NR, (const bf16_t *)x, xs, (const bf16_t *)w, K, pf, sums); \
    return;                                                             \
  }
#else
#define TILE_DP(MR, NR)
#endif
#define TILE(MR, NR)                              \
  if (mr == MR && nr == NR) {                     \
    TILE_DP(MR, NR)                               \
    if (mode == MODE_BF16_SHIFT)                  \
      tile_fma(MR, NR, 1, x, xs, w, K, pf, sums); \
    else                                          \
      tile_fma(MR, NR, 0, x, xs, w, K, pf, sums); \
    return;                                       \
  }
#define TILES(MR) TILE(MR, 4) TILE(MR, 1)
  TILES(1)
  TILES(2)
  TILES(3)
  TILES(4)
#undef TILES
#undef TILE
#undef TILE_DP
}

/* y[0, j] = s[j] + bias[j] for j < nr (1 or 4), in y's dtype: four outputs at once. */
static inline void store_outputs(const int out_bf16, const int nr, v4f s, const void *bias,
                                 void *y) {
  if (nr == 4) {
    if (bias != NULL) {
      if (out_bf16) {
        v4h b;
        memcpy(&b, bias, sizeof b);
        s += (v4f)(__builtin_convertvector(b, v4u) << 16);
      } else {
        v4f b;
        memcpy(&b, bias, sizeof b);
        s += b;
      }
    }
    if (out_bf16) {
      /* f32_to_bf16 on four lanes: round to nearest even; a NaN stays a quiet NaN */
      const v4u u = (v4u)s;
      const v4u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
      const v4u nan = (v4u)((u & 0x7fffffffu) > 0x7f800000u); /* all ones where NaN */
      const v4u bits = (rounded & ~nan) | (((u >> 16) | 0x40u) & nan);
      const v4h h = __builtin_convertvector(bits, v4h);
      memcpy(y, &h, sizeof h);
    } else {
      memcpy(y, &s, sizeof s);
    }
    return;
  }
  for (int j = 0; j < nr; j++) {
    float v = s[j];
    if (out_bf16) {
      if (bias != NULL) v += bf16_to_f32(((const bf16_t *)bias)[j]);
      ((bf16_t *)y)[j] = f32_to_bf16(v);
    } else {
      if (bias != NULL) v += ((const float *)bias)[j];
      ((float *)y)[j] = v;
    }
  }
}

/* Rows of x per tile: TILE_M with AVX-512's 32 vector registers (4 x 4 accumulators, 4 W rows,
 * one x row); fewer with 16 (AVX2, SSE), where 4 rows spill: 3 for fp32, 2 for the shift path,
 * whose widening takes registers too (measured on a Zen 4 with the AVX2 build: 1.2-1.4x). */
static inline int tile_rows(const int mode) {
  if (VW == 16) return TILE_M;
  return mode == MODE_F32 ? 3 : 2;
}

/* Rows [n0, n1) of W against every row of x into y. x is bf16 in MODE_BF16_DP, else fp32. */
static void rows_of_w(const int mode, const void *x, const int64_t xs, const void *w,
                      const void *bias, void *y, const int M, const int N, const int K,
                      const int n0, const int n1) {
  const int out_bf16 = mode != MODE_F32;
  const size_t elem = out_bf16 ? sizeof(bf16_t) : sizeof(float); /* of W, bias and y */
  const size_t x_elem = mode == MODE_BF16_DP ? sizeof(bf16_t) : sizeof(float);
  const int rows = tile_rows(mode);
  v4f sums[TILE_M];
  for (int n = n0, nr; n < n1; n += nr) {
    nr = n1 - n < TILE_N ? 1 : TILE_N; /* the range's tail: one W row at a time */
    const char *wn = (const char *)w + (size_t)n * K * elem;
    const char *bn = bias == NULL ? NULL : (const char *)bias + n * elem;
    /* Rows of x in blocks of at most `rows`, as even as can be (5 rows: 3 + 2, not 4 + 1). */
    const int blocks = (M + rows - 1) / rows;
    for (int b = 0, m = 0, mr; b < blocks; b++, m += mr) {
      mr = (M - m + blocks - b - 1) / (blocks - b); /* the rows left over the blocks left */
      /* The first rows of x prefetch W ahead; the others find the tile in L1. */
      const char *pf = m == 0 && PREFETCH_BYTES > 0 ? wn + PREFETCH_BYTES : NULL;
      tile_any(mode, mr, nr, (const char *)x + (size_t)m * xs * x_elem, xs, wn, K, pf, sums);
      for (int i = 0; i < mr; i++)
        store_outputs(out_bf16, nr, sums[i], bn, (char *)y + ((size_t)(m + i) * N + n) * elem);
    }
  }
}

/* Whether this build has the dpbf16 path (`use_dpbf16` is ignored without it). */
int wick_gemm_has_dpbf16(void) { return HAVE_DPBF16; }

/* `min_work_per_thread`: multiply-adds that justify one more thread (0: use all of them).
 * Returns 0, or -1 when the fp32 copy of a bf16 x could not be allocated (y untouched). */
int wick_gemm(int dtype, const void *x, int64_t x_stride, const void *w, const void *bias,
              void *y, int M, int N, int K, int use_dpbf16, int num_threads,
              int64_t min_work_per_thread) {
  if (M <= 0 || N <= 0) return 0;
  const int mode = dtype == 0                                         ? MODE_F32
                   : HAVE_DPBF16 && use_dpbf16 && M >= DPBF16_MIN_ROWS ? MODE_BF16_DP
                                                                      : MODE_BF16_SHIFT;

  /* The shift path reads x as fp32 rows, converted once here for every thread. */
  const void *xr = x;
  int64_t xs = x_stride;
  float *converted = NULL;
  if (mode == MODE_BF16_SHIFT) {
    converted = widen_bf16_rows((const bf16_t *)x, M, K, x_stride);
    if (converted == NULL) return -1;
    xr = converted;
    xs = K;
  }

  /* Threads: no more than the work keeps busy (a fork/join costs microseconds, more on a
   * loaded machine); each takes a contiguous range of whole tiles of W rows. */
  num_threads = threads_for((int64_t)M * N * K, min_work_per_thread, num_threads);
  const int tiles = (N + TILE_N - 1) / TILE_N;
  if (num_threads > tiles) num_threads = tiles;
  if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
  {
#ifdef _OPENMP
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int t = 0, nt = 1;
#endif
    const int n0 = (int)((int64_t)tiles * t / nt) * TILE_N;
    const int n1e = (int)((int64_t)tiles * (t + 1) / nt) * TILE_N;
    const int n1 = n1e < N ? n1e : N;
    rows_of_w(mode, xr, xs, w, bias, y, M, N, K, n0, n1);
  }
  free(converted);
  return 0;
}

/* `wick_gemm` with its arguments in one array, in its order (pointers as integers): one
 * ctypes argument instead of twelve, about 1.5 us less per call from Python. */
int wick_gemm_packed(const int64_t *a) {
  return wick_gemm((int)a[0], (const void *)(intptr_t)a[1], a[2], (const void *)(intptr_t)a[3],
                   (const void *)(intptr_t)a[4], (void *)(intptr_t)a[5], (int)a[6], (int)a[7],
                   (int)a[8], (int)a[9], (int)a[10], a[11]);
}
