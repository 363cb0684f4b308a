/* fp32 matmul on a weight re-laid out once into panels of VW outputs: y[M, N] = x[M, K] @ W^T
 * (+ bias), any M, on every ISA build (VW = 16 on AVX-512, 8 on AVX2, 4 otherwise). The
 * panel_gemm.c idea without vdpbf16ps: outputs across the vector's lanes, x broadcast, no
 * horizontal sums.
 *
 * Layout (`wick_panel_f32_pack`): W [N, K] -> [ceil(N / VW)][K][VW] in W's dtype (fp32, or bf16
 * widened to fp32 as it is read, a 16-bit shift): panel p's row k holds W[VW p + l][k] in lane l;
 * lanes past N are zero.
 *
 * Shapes: x [M, K] rows `x_stride` elements apart, bias [N] or NULL, y [M, N] contiguous; x,
 * bias and y in `dtype` (0 fp32, 1 bf16), W's panels too. fp32 products and sums; bf16 outputs
 * rounded once to nearest even (bias added first), as torch does. bf16 rows of x are widened
 * into a per-thread buffer, one register tile's rows at a time. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "wick_cpu.h"
#include "wick_entry.h"
#include "wick_vec.h"

/* Register tiles by the rows of x a call has (accumulators: MR_F32 x NP_F32 vectors at most),
 * sized for the ISA's registers: 32 on AVX-512, 16 on AVX2 and SSE. */
#if VW == 16
#define MR_F32 12
#define NP_F32 4
#else
#define MR_F32 6
#define NP_F32 4
#endif
#define PREFETCH_ROWS 32 /* W rows (k) each panel stream is prefetched ahead into L2 */
/* More rows than one register tile (a prefill): W in blocks of KC_F32 k rows of NC_PANELS
 * panels (32-128 KiB: stays in L2 while every row tile of x passes over it), x's tile of the
 * block in L1, the partial sums in a per-thread buffer between K blocks. One row tile (a decode)
 * streams each panel's whole K once instead (prefetched ahead: bandwidth-bound). */
#define KC_F32 256
#define NC_PANELS 8

int64_t wick_panel_f32_elements(int64_t n, int64_t k) { return (n + VW - 1) / VW * k * VW; }

int wick_panel_f32_lanes(void) { return VW; }

/* W [N, K] (rows K apart, `dtype` 0 fp32 / 1 bf16) -> panels of the same dtype. */
void wick_panel_f32_pack(int dtype, const void *w, int64_t n, int64_t k, void *panels) {
  const size_t elem = dtype == 1 ? sizeof(bf16_t) : sizeof(float);
  const int64_t num_panels = (n + VW - 1) / VW;
  for (int64_t p = 0; p < num_panels; p++)
    for (int64_t kk = 0; kk < k; kk++)
      for (int l = 0; l < VW; l++) {
        const int64_t row = p * VW + l;
        char *dst = (char *)panels + ((p * k + kk) * VW + l) * (int64_t)elem;
        if (row < n)
          memcpy(dst, (const char *)w + (row * k + kk) * (int64_t)elem, elem);
        else
          memset(dst, 0, elem);
      }
}

/* c[i ldc + j VW + l] (+)= sum over k of xf[i][k] * W[VW (p0 + j) + l][k]: mr rows of x (fp32,
 * `xs` apart) by np panels (mr, np compile-time constants after inlining). `accumulate`
 * continues the sums c holds (a K block after the first): each output's chain of FMAs runs
 * over k in order either way, so splitting K changes no bit. */
static inline __attribute__((always_inline)) void tile_f32(
    const int mr, const int np, const int w_bf16, const float *restrict xf, const int64_t xs,
    const int64_t k, const void *restrict w, const int64_t panel_stride, const int accumulate,
    float *restrict c, const int64_t ldc) {
  vf acc[MR_F32][NP_F32];
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < np; j++) {
      if (accumulate)
        memcpy(&acc[i][j], c + i * ldc + j * VW, sizeof(vf));
      else
        acc[i][j] = (vf){0};
    }
  const size_t elem = w_bf16 ? sizeof(bf16_t) : sizeof(float);
  for (int64_t kk = 0; kk < k; kk++) {
    vf wv[NP_F32];
    for (int j = 0; j < np; j++) {
      const int64_t at = j * panel_stride + kk * VW;
      __builtin_prefetch((const char *)w + (at + PREFETCH_ROWS * VW) * (int64_t)elem, 0, 2);
      wv[j] = w_bf16 ? vload_bf16((const bf16_t *)w + at) : vload((const float *)w + at);
    }
    for (int i = 0; i < mr; i++) {
      const vf xb = xf[i * xs + kk] - (vf){0};
      for (int j = 0; j < np; j++) acc[i][j] = vfma(xb, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < np; j++) memcpy(c + i * ldc + j * VW, &acc[i][j], sizeof(vf));
}

static void tile_f32_any(const int mr, const int np, const int w_bf16, const float *xf,
                         const int64_t xs, const int64_t k, const void *w,
                         const int64_t panel_stride, const int accumulate, float *c,
                         const int64_t ldc) {
  /* Few rows take four panels (enough independent chains), more rows two, wider tiles. */
#define T(R, P)                                                                 \
  if (w_bf16)                                                                   \
    tile_f32(R, P, 1, xf, xs, k, w, panel_stride, accumulate, c, ldc);          \
  else                                                                          \
    tile_f32(R, P, 0, xf, xs, k, w, panel_stride, accumulate, c, ldc);          \
  return;
#define ROWS(R)        \
  case R:              \
    if (np == 4) {     \
      T(R, 4)          \
    } else if (np == 2) { \
      T(R, 2)          \
    } else {           \
      T(R, 1)          \
    }
  switch (mr) {
    ROWS(1)
    ROWS(2)
    ROWS(3)
    ROWS(4)
    ROWS(5)
#if MR_F32 > 6
    ROWS(6)
    ROWS(7)
    ROWS(8)
    ROWS(9)
    ROWS(10)
    ROWS(11)
#endif
    default:
      if (np == 4) {
        T(MR_F32, 4)
      } else if (np == 2) {
        T(MR_F32, 2)
      } else {
        T(MR_F32, 1)
      }
  }
#undef ROWS
#undef T
}

/* Tile shape for a call's row count: (rows per tile, panels per tile) with their product of
 * accumulators within the registers. */
static inline void tile_shape_f32(const int64_t m, int *rows, int *panels) {
#if VW == 16
  if (m <= 6) {
    *rows = 6;
    *panels = 4; /* 1-6 rows: 4-24 accumulators */
  } else {
    *rows = MR_F32;
    *panels = 2; /* 24 */
  }
#else
  if (m <= 3) {
    *rows = 3;
    *panels = 4; /* 4-12 */
  } else {
    *rows = MR_F32;
    *panels = 2; /* 12 */
  }
#endif
}

/* Output columns [n0, n0 + cols) of tile rows [0, mr) (rows `ldt` apart) into y (rows `n`
 * apart, from row m0): tile (+ bias) rounded once to y's dtype. */
static inline void store_tile_f32(const int is_bf16, const int mr, const int cols,
                                  const float *tile, const int64_t ldt, const void *bias,
                                  const int64_t n0, const int64_t n, const int64_t m0, void *y) {
  for (int i = 0; i < mr; i++)
    for (int c = 0; c < cols; c++) {
      float v = tile[i * ldt + c];
      if (bias != NULL)
        v += is_bf16 ? bf16_to_f32(((const bf16_t *)bias)[n0 + c]) : ((const float *)bias)[n0 + c];
      const int64_t at = (m0 + i) * n + n0 + c;
      if (is_bf16)
        ((bf16_t *)y)[at] = f32_to_bf16(v);
      else
        ((float *)y)[at] = v;
    }
}

/* silu(gate) * up of the tiles into y's columns [n0, n0 + cols) (rows `inter` apart), rounded
 * where the unfused pair rounds: the matmul's outputs (bf16: once), then layer_ops.c's
 * SiLU-and-mul formula, exp included: that pair's result bit for bit (same -ffp-contract=off). */
static inline void store_silu_tile_f32(const int is_bf16, const int mr, const int cols,
                                       const float *gate, const float *up, const int64_t ldt,
                                       const int64_t n0, const int64_t inter, const int64_t m0,
                                       void *y) {
  for (int i = 0; i < mr; i++) {
    const int64_t row = (m0 + i) * inter + n0;
#pragma omp simd
    for (int c = 0; c < cols; c++) {
      const float g = is_bf16 ? round_to_bf16(gate[i * ldt + c]) : gate[i * ldt + c];
      const float u = is_bf16 ? round_to_bf16(up[i * ldt + c]) : up[i * ldt + c];
      const float e = exp_nonpositive(-fabsf(g));
      const float silu = (g >= 0.f ? g : g * e) / (1.f + e);
      const float v = (is_bf16 ? round_to_bf16(silu) : silu) * u;
      if (is_bf16) {
        union {
          float f;
          uint32_t u;
        } b = {round_to_bf16(v)};
        ((bf16_t *)y)[row + c] = (bf16_t)(b.u >> 16);
      } else {
        ((float *)y)[row + c] = v;
      }
    }
  }
}

/* Rows [m0, m0 + mr), columns [k0, k0 + kc) of x as fp32 rows `*xs` apart: in place (fp32),
 * or widened into xbuf (bf16). */
static inline const float *x_tile(const int is_bf16, const void *x, const int64_t x_stride,
                                  const int64_t m0, const int mr, const int64_t k0,
                                  const int64_t kc, float *xbuf, int64_t *xs) {
  if (!is_bf16) {
    *xs = x_stride;
    return (const float *)x + m0 * x_stride + k0;
  }
  for (int i = 0; i < mr; i++)
    bf16_to_f32_row((const bf16_t *)x + (m0 + i) * x_stride + k0, xbuf + i * kc, 1.f, (int)kc);
  *xs = kc;
  return xbuf;
}

/* panel_f32_run's contract for m > one register tile's rows, cache-blocked (KC_F32,
 * NC_PANELS): the same FMA chains in the same order, so the same bits as the unblocked loop. */
static int panel_f32_blocked(const int is_bf16, const void *x, const int64_t x_stride,
                             const void *panels, const void *bias, void *y, const int64_t m,
                             const int64_t n, const int64_t inter, const int64_t k,
                             const int rows, const int per_group, const int threads) {
  const size_t elem = is_bf16 ? sizeof(bf16_t) : sizeof(float);
  const int64_t panel_stride = k * VW;
  const int64_t num_panels = inter > 0 ? inter / VW : (n + VW - 1) / VW;
  const char *up_panels = (const char *)panels + num_panels * panel_stride * (int64_t)elem;
  const int64_t chunks = (num_panels + NC_PANELS - 1) / NC_PANELS;
  const int64_t ldc = NC_PANELS * VW; /* the partial sums' row stride */
  const int halves = inter > 0 ? 2 : 1; /* gate and up sums */
  int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    float *xbuf = is_bf16 ? (float *)malloc(sizeof(float) * (size_t)(rows * KC_F32)) : NULL;
    float *sums = (float *)malloc(sizeof(float) * (size_t)(halves * m * ldc));
    if ((is_bf16 && xbuf == NULL) || sums == NULL) {
#pragma omp atomic write
      failed = 1;
    }
    float *up_sums = sums == NULL ? NULL : sums + m * ldc;
#pragma omp for schedule(static)
    for (int64_t ch = 0; ch < chunks; ch++) {
      if ((is_bf16 && xbuf == NULL) || sums == NULL) continue;
      const int64_t first = ch * NC_PANELS;
      const int64_t count = num_panels - first < NC_PANELS ? num_panels - first : NC_PANELS;
      for (int64_t k0 = 0; k0 < k; k0 += KC_F32) {
        const int64_t kc = k - k0 < KC_F32 ? k - k0 : KC_F32;
        const int accumulate = k0 > 0;
        for (int64_t m0 = 0; m0 < m; m0 += rows) {
          const int mr = m - m0 < rows ? (int)(m - m0) : rows;
          int64_t xs;
          const float *xf = x_tile(is_bf16, x, x_stride, m0, mr, k0, kc, xbuf, &xs);
          for (int64_t p0 = first; p0 < first + count;) {
            const int np = first + count - p0 >= per_group ? per_group : 1;
            const int64_t offset = (p0 * panel_stride + k0 * VW) * (int64_t)elem;
            const int64_t col = (p0 - first) * VW;
            tile_f32_any(mr, np, is_bf16, xf, xs, kc, (const char *)panels + offset,
                         panel_stride, accumulate, sums + m0 * ldc + col, ldc);
            if (inter > 0)
              tile_f32_any(mr, np, is_bf16, xf, xs, kc, up_panels + offset, panel_stride,
                           accumulate, up_sums + m0 * ldc + col, ldc);
            p0 += np;
          }
        }
      }
      /* the chunk's columns, rounded once */
      const int64_t n0 = first * VW;
      for (int64_t m0 = 0; m0 < m; m0 += rows) {
        const int mr = m - m0 < rows ? (int)(m - m0) : rows;
        if (inter > 0) {
          store_silu_tile_f32(is_bf16, mr, (int)(count * VW), sums + m0 * ldc,
                              up_sums + m0 * ldc, ldc, n0, inter, m0, y);
        } else {
          const int cols = n - n0 < count * VW ? (int)(n - n0) : (int)(count * VW);
          store_tile_f32(is_bf16, mr, cols, sums + m0 * ldc, ldc, bias, n0, n, m0, y);
        }
      }
    }
    free(xbuf);
    free(sums);
  }
  return failed ? -1 : 0;
}

/* The matmul over panels [0, out_panels) of y's columns; `inter` > 0 instead multiplies gate
 * panels [0, inter / VW) and their up panels (inter / VW further on) and stores silu(gate) * up
 * (y [M, inter]). Returns 0; -1 when a thread's x buffer could not be allocated (y then
 * partial). */
static int panel_f32_run(const int is_bf16, const void *x, const int64_t x_stride,
                         const void *panels, const void *bias, void *y, const int64_t m,
                         const int64_t n, const int64_t inter, const int64_t k,
                         const int num_threads, const int64_t min_work_per_thread) {
  const size_t elem = is_bf16 ? sizeof(bf16_t) : sizeof(float);
  const int64_t panel_stride = k * VW;
  const int64_t num_panels = inter > 0 ? inter / VW : (n + VW - 1) / VW;
  const char *up_panels = (const char *)panels + num_panels * panel_stride * (int64_t)elem;
  int rows, per_group;
  tile_shape_f32(m, &rows, &per_group);
  const int64_t groups = (num_panels + per_group - 1) / per_group;
  const int threads = threads_for(m * (inter > 0 ? 2 * inter : n) * k, min_work_per_thread,
                                  num_threads);
  if (m > rows)
    return panel_f32_blocked(is_bf16, x, x_stride, panels, bias, y, m, n, inter, k, rows,
                             per_group, threads);
  int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    /* bf16 rows of x widened for one tile (fp32 x is read in place). */
    float *xbuf = is_bf16 ? (float *)malloc(sizeof(float) * (size_t)(rows * k)) : NULL;
    if (is_bf16 && xbuf == NULL) {
#pragma omp atomic write
      failed = 1;
    }
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
      if (is_bf16 && xbuf == NULL) continue;
      const int64_t first = g * per_group;
      const int in_group =
          num_panels - first < per_group ? (int)(num_panels - first) : per_group;
      const int np = in_group == per_group ? per_group : 1; /* a short last group: one by one */
      float tile[MR_F32][NP_F32 * VW], up[MR_F32][NP_F32 * VW];
      for (int64_t m0 = 0; m0 < m; m0 += rows) {
        const int mr = m - m0 < rows ? (int)(m - m0) : rows;
        int64_t xs;
        const float *xf = x_tile(is_bf16, x, x_stride, m0, mr, 0, k, xbuf, &xs);
        for (int64_t p0 = first; p0 < first + in_group; p0 += np) {
          const int64_t offset = p0 * panel_stride * (int64_t)elem, n0 = p0 * VW;
          tile_f32_any(mr, np, is_bf16, xf, xs, k, (const char *)panels + offset, panel_stride,
                       0, &tile[0][0], NP_F32 * VW);
          if (inter > 0) {
            tile_f32_any(mr, np, is_bf16, xf, xs, k, up_panels + offset, panel_stride, 0,
                         &up[0][0], NP_F32 * VW);
            store_silu_tile_f32(is_bf16, mr, np * VW, &tile[0][0], &up[0][0], NP_F32 * VW, n0,
                                inter, m0, y);
          } else {
            const int cols = n - n0 < np * VW ? (int)(n - n0) : np * VW;
            store_tile_f32(is_bf16, mr, cols, &tile[0][0], NP_F32 * VW, bias, n0, n, m0, y);
          }
        }
      }
    }
    free(xbuf);
  }
  return failed ? -1 : 0;
}

/* Returns 0; -1 when a thread's x buffer could not be allocated (y then partial). */
int wick_panel_f32_gemm(int dtype, const void *x, int64_t x_stride, const void *panels,
                        const void *bias, void *y, int64_t m, int64_t n, int64_t k,
                        int num_threads, int64_t min_work_per_thread) {
  return panel_f32_run(dtype == 1, x, x_stride, panels, bias, y, m, n, 0, k, num_threads,
                       min_work_per_thread);
}

/* The MLP's gate/up matmul and SiLU-and-mul in one pass, as wick_panel_gemm_silu (panel_gemm.c)
 * on these panels: W [2 inter, K] merged (gate rows, then up rows), inter a multiple of VW;
 * y [M, inter] = silu(x @ G^T) * (x @ U^T), equal to wick_panel_f32_gemm then
 * wick_silu_and_mul (no bias). Returns 0; -1 as wick_panel_f32_gemm; -3 when inter is not a
 * multiple of VW (nothing written). */
int wick_panel_f32_gemm_silu(int dtype, const void *x, int64_t x_stride, const void *panels,
                             void *y, int64_t m, int64_t inter, int64_t k, int num_threads,
                             int64_t min_work_per_thread) {
  if (inter <= 0 || inter % VW != 0) return -3;
  return panel_f32_run(dtype == 1, x, x_stride, panels, NULL, y, m, 0, inter, k, num_threads,
                       min_work_per_thread);
}
