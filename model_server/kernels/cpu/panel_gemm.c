/* bf16 matmul on a weight re-laid out once into panels for vdpbf16ps: y[M, N] = x[M, K] @ W^T
 * (+ bias), any M, for builds with AVX512-BF16 (the others report no kernel and the linear
 * tuner leaves the candidate out).
 *
 * Panel layout (`wick_panel_pack`): W [N, K] bf16 -> [ceil(N / 16)][ceil(K / 2)][16][2]: panel
 * p holds outputs 16 p .. 16 p + 15; its k-pair j is one 64-byte vector whose 32-bit lane i is
 * (W[16 p + i][2 j], W[16 p + i][2 j + 1]): exactly what vdpbf16ps multiplies against one
 * broadcast pair of x. Rows past N and the odd K's last column are zero.
 *
 * Why this layout: outputs lie across the vector's lanes, so a register tile of MR rows of x by
 * NP panels accumulates its MR x NP x 16 outputs over the whole of K with no horizontal sums
 * (the [N, K] layout of gemm.c reduces every accumulator at the end), each weight vector loaded
 * once per MR rows and each x pair broadcast from memory once per NP panels; a panel is one
 * contiguous stream, which the hardware prefetcher follows. On a 2-thread Zen 4 with SmolLM2's
 * shapes, weights read from memory: 1.3x oneDNN's packed kernel at 16 rows, 1.15x at 64; from
 * 128 rows on it falls 3-12 % behind (2048 rows, one weight in cache: 371-405 GFLOP/s against
 * oneDNN's 432-452; no cache blocking of K or N yet).
 *
 * Shapes (contiguous unless said): x [M, K] bf16, rows `x_stride` elements apart; panels as
 * above; bias [N] bf16 or NULL; y [M, N] bf16. fp32 accumulation (pairs of exact products added
 * into fp32 lanes; bf16 denormals read as zero); the bias is added in fp32, then each output is
 * rounded once to nearest even. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "wick_cpu.h"
#include "wick_entry.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#define PANEL 16 /* outputs per panel: one vector of fp32 lanes */
#define MR 12    /* rows of x per register tile, at most (see tile_shape) */
#define NP 8     /* panels per register tile, at most */
/* How far ahead of the pair being read each panel stream is prefetched into L2, in k-pairs
 * (64 bytes each), when a call prefetches (its `prefetch` argument): with few rows of x a call
 * is bound by reading W, and the hardware prefetcher alone left it 1.2-2.2x slower than gemm.c's
 * prefetching kernel at 1-8 rows (Zen 4). On a 2-core Zen 5 the other way round in the widest
 * tile of 1-2 rows (8 panels: 8 streams, one line of each per k-pair), which the hardware
 * prefetcher follows alone: the Llama-3.2-1B layer's four linears at 1 row, one thread,
 * 4.12-4.23 ms with the prefetches, 3.70-3.79 without; at 16 rows (12 x 2 tiles) 5.6 ms with,
 * 8.0 without. So no CPU's rule is built in: the linear tuner times the panels both ways per
 * shape and row bucket (linear_tuning.py's native_panels and native_panels_hwpf) and the plan
 * passes its choice to every call; outputs are the same bits either way. */
#define PREFETCH_PAIRS 64

int wick_panel_gemm_available(void) {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

/* Elements of the panel layout of an [N, K] weight. */
int64_t wick_panel_elements(int64_t n, int64_t k) {
  return (n + PANEL - 1) / PANEL * ((k + 1) / 2) * PANEL * 2;
}

/* W [N, K] bf16 (rows K apart) -> panels (wick_panel_elements(N, K) values). */
void wick_panel_pack(const bf16_t *w, int64_t n, int64_t k, bf16_t *panels) {
  const int64_t pairs = (k + 1) / 2, num_panels = (n + PANEL - 1) / PANEL;
  for (int64_t p = 0; p < num_panels; p++)
    for (int64_t j = 0; j < pairs; j++) {
      bf16_t *dst = panels + (p * pairs + j) * PANEL * 2;
      for (int i = 0; i < PANEL; i++)
        for (int e = 0; e < 2; e++) {
          const int64_t row = p * PANEL + i, col = 2 * j + e;
          dst[2 * i + e] = row < n && col < k ? w[row * k + col] : 0;
        }
    }
}

#if defined(__AVX512BF16__)
/* The pair (x[0], x[1]) in every 32-bit lane; `last`: only x[0], the other half zero. */
static inline __m512bh broadcast_pair(const bf16_t *x, const int last) {
  int32_t pair; /* one 32-bit load, so that the broadcast reads memory (vpbroadcastd zmm, m32) */
  if (last)
    pair = x[0];
  else
    memcpy(&pair, x, sizeof pair);
  return (__m512bh)_mm512_set1_epi32(pair);
}

/* tile[i][j * 16 + l] = sum over k of x[i][k] * W[16 (p0 + j) + l][k], for mr rows of x and np
 * panels: one accumulator per output, adding the k-pairs in order (the odd K's last column, whose
 * pair's second half is zero in the panel and in x, last). mr and np are compile-time constants
 * after inlining, so the accumulators stay in registers; so is `prefetch` (whether each panel
 * stream is prefetched PREFETCH_PAIRS ahead), which changes no output bit. Row invariance:
 * every (mr, np) sums an output the same way, so a row's output is the same bits whatever M and
 * the tile it falls in (see tile_shape). */
static inline __attribute__((always_inline)) void panel_tile(
    const int prefetch, const int mr, const int np, const bf16_t *restrict x, const int64_t xs,
    const int64_t k, const bf16_t *restrict w, const int64_t panel_stride,
    float tile[MR][NP * PANEL]) {
  __m512 acc[MR][NP];
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < np; j++) acc[i][j] = _mm512_setzero_ps();
  const int64_t full = k / 2;
  for (int64_t pair = 0; pair < (k + 1) / 2; pair++) {
    if (prefetch) /* a compile-time constant: see panel_tile_any */
      for (int j = 0; j < np; j++)
        __builtin_prefetch(w + j * panel_stride + (pair + PREFETCH_PAIRS) * 2 * PANEL, 0, 2);
    __m512bh wv[NP];
    for (int j = 0; j < np; j++)
      wv[j] = (__m512bh)_mm512_loadu_si512(w + j * panel_stride + pair * 2 * PANEL);
    for (int i = 0; i < mr; i++) {
      const __m512bh xp = broadcast_pair(x + i * xs + 2 * pair, pair == full);
      for (int j = 0; j < np; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xp, wv[j]);
    }
  }
  for (int i = 0; i < mr; i++)
    for (int j = 0; j < np; j++) _mm512_storeu_ps(&tile[i][j * PANEL], acc[i][j]);
}

/* Register tiles by the rows of x a call has: few rows take more panels, so that enough
 * independent vdpbf16ps chains are in flight (one row by two panels was latency bound: 1.5-2x
 * slower than gemm.c at 1-8 rows), many rows more rows per weight load: 1-2 rows x 8 panels,
 * 3-6 rows x 4, 7+ rows 12 x 2. Threads take whole units of panels (4, 4, 2), so a call's
 * panels split as evenly as the narrower units allow; a thread's range runs wide tiles, then
 * a unit, then single panels at the right edge.
 * Row invariance: all tiles sum an output in one chain over K in order (panel_tile), so a
 * speculative verification chunk of k + 1 rows computes each row exactly as a one-row decode
 * does (engine/spec_decode/row_invariance.py relies on it). Two accumulator sets over
 * alternate k-pairs for 1-3 rows (and one from 4) made rows depend on M; one set with 3 x 4
 * tiles from 4 rows (two sets everywhere) cost plain decoding 3.5 % at 16 streams. */
typedef enum { SHAPE_FEW, SHAPE_SOME, SHAPE_MANY } TileShape;

static inline TileShape tile_shape(const int64_t m) {
  return m <= 2 ? SHAPE_FEW : m <= 6 ? SHAPE_SOME : SHAPE_MANY;
}
static inline int tile_rows(const TileShape shape) {
  return shape == SHAPE_FEW ? 2 : shape == SHAPE_SOME ? 6 : MR;
}
static inline int tile_panels(const TileShape shape) {
  return shape == SHAPE_FEW ? 8 : shape == SHAPE_SOME ? 4 : 2;
}
static inline int thread_unit(const TileShape shape) { return shape == SHAPE_MANY ? 2 : 4; }

/* panel_tile for runtime mr (at most tile_rows(shape)) and np (tile_panels(shape), its thread
 * unit, or 1): one copy per combination, for a compile-time `prefetch` (panel_tiles below). */
static inline __attribute__((always_inline)) void panel_tile_any(
    const int prefetch, const TileShape shape, const int mr, const int np, const bf16_t *x,
    const int64_t xs, const int64_t k, const bf16_t *w, const int64_t panel_stride,
    float tile[MR][NP * PANEL]) {
#define ARGS_AT(R, P) prefetch, R, P, x, xs, k, w, panel_stride, tile
#define TILE(R, P)            \
  case R:                     \
    if (np == P)              \
      panel_tile(ARGS_AT(R, P)); \
    else if (np == 4)         \
      panel_tile(ARGS_AT(R, 4)); \
    else                      \
      panel_tile(ARGS_AT(R, 1)); \
    return;
  if (shape == SHAPE_FEW) {
    switch (mr) {
      TILE(1, 8)
      default:
        if (np == 8)
          panel_tile(ARGS_AT(2, 8));
        else if (np == 4)
          panel_tile(ARGS_AT(2, 4));
        else
          panel_tile(ARGS_AT(2, 1));
    }
  } else if (shape == SHAPE_SOME) {
    switch (mr) {
      TILE(1, 4)
      TILE(2, 4)
      TILE(3, 4)
      TILE(4, 4)
      TILE(5, 4)
      default:
        if (np == 4)
          panel_tile(ARGS_AT(6, 4));
        else
          panel_tile(ARGS_AT(6, 1));
    }
  } else {
#undef TILE
#define TILE(R, P)            \
  case R:                     \
    if (np == P)              \
      panel_tile(ARGS_AT(R, P)); \
    else                      \
      panel_tile(ARGS_AT(R, 1)); \
    return;
    switch (mr) {
      TILE(1, 2)
      TILE(2, 2)
      TILE(3, 2)
      TILE(4, 2)
      TILE(5, 2)
      TILE(6, 2)
      TILE(7, 2)
      TILE(8, 2)
      TILE(9, 2)
      TILE(10, 2)
      TILE(11, 2)
      default:
        if (np == 2)
          panel_tile(ARGS_AT(MR, 2));
        else
          panel_tile(ARGS_AT(MR, 1));
    }
  }
#undef TILE
#undef ARGS_AT
}

/* The two instantiations of panel_tile_any (with and without software prefetch); a call picks
 * one outside its loops, so the hot loop has no branch on the flag. */
typedef void (*PanelTiles)(TileShape, int, int, const bf16_t *, int64_t, int64_t, const bf16_t *,
                           int64_t, float[MR][NP * PANEL]);
static void panel_tiles_prefetch(const TileShape shape, const int mr, const int np,
                                 const bf16_t *x, const int64_t xs, const int64_t k,
                                 const bf16_t *w, const int64_t panel_stride,
                                 float tile[MR][NP * PANEL]) {
  panel_tile_any(1, shape, mr, np, x, xs, k, w, panel_stride, tile);
}
static void panel_tiles_hw(const TileShape shape, const int mr, const int np, const bf16_t *x,
                           const int64_t xs, const int64_t k, const bf16_t *w,
                           const int64_t panel_stride, float tile[MR][NP * PANEL]) {
  panel_tile_any(0, shape, mr, np, x, xs, k, w, panel_stride, tile);
}
static inline PanelTiles panel_tiles(const int prefetch) {
  return prefetch ? panel_tiles_prefetch : panel_tiles_hw;
}

/* Panels [*p0, *p1) of thread t of `threads` over num_panels, in whole units of `unit`. */
static inline void thread_panels(const int64_t num_panels, const int unit, const int t,
                                 const int threads, int64_t *p0, int64_t *p1) {
  const int64_t units = (num_panels + unit - 1) / unit;
  *p0 = units * t / threads * unit;
  const int64_t end = units * (t + 1) / threads * unit;
  *p1 = end < num_panels ? end : num_panels;
}

/* The tile width at panel p of a thread's range ending at p1: wide tiles while they fit, then
 * a unit, then one panel. */
static inline int tile_width(const TileShape shape, const int64_t p, const int64_t p1) {
  const int wide = tile_panels(shape), unit = thread_unit(shape);
  return p1 - p >= wide ? wide : p1 - p >= unit ? unit : 1;
}

/* Rows [0, mr) of y (rows n apart, from its column n0 on) = tile (+ bias), rounded to bf16 (ties
 * to even, as f32_to_bf16; vcvtneps2bf16 rounds the same way); up to NP panels of columns, fewer
 * at the right edge. */
static inline void store_tile(const int mr, const int np, float tile[MR][NP * PANEL],
                              const bf16_t *bias, const int64_t n0, const int64_t n, bf16_t *y) {
  const int cols = n - n0 < np * PANEL ? (int)(n - n0) : np * PANEL;
  for (int c0 = 0; c0 < cols; c0 += PANEL) {
    const int width = cols - c0 < PANEL ? cols - c0 : PANEL;
    const __mmask16 lanes = (__mmask16)((1u << width) - 1);
    __m512 b = _mm512_setzero_ps();
    if (bias != NULL)
      b = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, bias + n0 + c0)), 16));
    for (int i = 0; i < mr; i++) {
      const __m512 v = _mm512_add_ps(_mm512_loadu_ps(&tile[i][c0]), b);
      _mm256_mask_storeu_epi16(y + (int64_t)i * n + n0 + c0, lanes,
                               (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

/* Rows [0, mr) of y (rows `inter` apart, from column n0 on, np whole panels) = silu(gate) * up
 * of the tiles, each rounded where the unfused path rounds: the matmul's bf16 outputs (+ 0 as
 * store_tile adds a zero bias, so -0 reads as +0 there too), then layer_ops.c's SiLU-and-mul
 * formula, exp included, so the result is that path's bit for bit (same -ffp-contract=off). */
static inline void store_silu_tile(const int mr, const int np, float gate[MR][NP * PANEL],
                                   float up[MR][NP * PANEL], const int64_t n0,
                                   const int64_t inter, bf16_t *y) {
  for (int i = 0; i < mr; i++) {
    bf16_t *out = y + (int64_t)i * inter + n0;
#pragma omp simd
    for (int c = 0; c < np * PANEL; c++) {
      const float g = round_to_bf16(gate[i][c] + 0.f), u = round_to_bf16(up[i][c] + 0.f);
      const float e = exp_nonpositive(-fabsf(g));
      const float silu = (g >= 0.f ? g : g * e) / (1.f + e);
      union {
        float f;
        uint32_t u;
      } v = {round_to_bf16(round_to_bf16(silu) * u)};
      out[c] = (bf16_t)(v.u >> 16);
    }
  }
}
#endif

/* y = x @ W^T (+ bias) from W's panels, on up to num_threads threads (each takes whole pairs of
 * panels; fewer threads for small calls, see threads_for). Returns 0; -2 on a build without
 * AVX512-BF16 (nothing written). */
int wick_panel_gemm(const bf16_t *x, int64_t x_stride, const bf16_t *panels, const bf16_t *bias,
                    bf16_t *y, int64_t m, int64_t n, int64_t k, int num_threads,
                    int64_t min_work_per_thread, int prefetch) {
#if defined(__AVX512BF16__)
  const PanelTiles tiles = panel_tiles(prefetch);
  const int64_t num_panels = (n + PANEL - 1) / PANEL, panel_stride = (k + 1) / 2 * 2 * PANEL;
  const TileShape shape = tile_shape(m);
  const int rows = tile_rows(shape);
  const int threads = threads_for(m * n * k, min_work_per_thread, num_threads);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int t = 0; t < threads; t++) {
    int64_t p, p1;
    thread_panels(num_panels, thread_unit(shape), t, threads, &p, &p1);
    float tile[MR][NP * PANEL];
    for (int np; p < p1; p += np) {
      np = tile_width(shape, p, p1);
      for (int64_t m0 = 0; m0 < m; m0 += rows) {
        const int mr = m - m0 < rows ? (int)(m - m0) : rows;
        tiles(shape, mr, np, x + m0 * x_stride, x_stride, k, panels + p * panel_stride,
              panel_stride, tile);
        store_tile(mr, np, tile, bias, p * PANEL, n, y + m0 * n);
      }
    }
  }
  return 0;
#else
  (void)x, (void)x_stride, (void)panels, (void)bias, (void)y, (void)m, (void)n, (void)k;
  (void)num_threads, (void)min_work_per_thread, (void)prefetch;
  return -2;
#endif
}

/* The MLP's gate/up projection and SiLU-and-mul in one pass: W [2 inter, K] is the merged
 * weight (gate rows, then up rows) in panels, inter a multiple of PANEL, so gate panel j and
 * its up panel inter / PANEL + j cover the same outputs; y [M, inter] = silu(x @ G^T) *
 * (x @ U^T), equal to wick_panel_gemm then wick_silu_and_mul (bf16, no bias) without the
 * [M, 2 inter] intermediate. Each tile runs the gate panels, then the up panels over the same
 * rows of x (still in L1). Returns 0; -2 on a build without AVX512-BF16; -3 when inter is not
 * a multiple of PANEL (nothing written). */
int wick_panel_gemm_silu(const bf16_t *x, int64_t x_stride, const bf16_t *panels, bf16_t *y,
                         int64_t m, int64_t inter, int64_t k, int num_threads,
                         int64_t min_work_per_thread, int prefetch) {
#if defined(__AVX512BF16__)
  const PanelTiles tiles = panel_tiles(prefetch);
  if (inter % PANEL != 0) return -3;
  const int64_t gate_panels = inter / PANEL, panel_stride = (k + 1) / 2 * 2 * PANEL;
  const bf16_t *up_panels = panels + gate_panels * panel_stride;
  const TileShape shape = tile_shape(m);
  const int rows = tile_rows(shape);
  const int threads = threads_for(m * 2 * inter * k, min_work_per_thread, num_threads);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int t = 0; t < threads; t++) {
    int64_t p, p1;
    thread_panels(gate_panels, thread_unit(shape), t, threads, &p, &p1);
    float gate[MR][NP * PANEL], up[MR][NP * PANEL];
    for (int np; p < p1; p += np) {
      np = tile_width(shape, p, p1);
      for (int64_t m0 = 0; m0 < m; m0 += rows) {
        const int mr = m - m0 < rows ? (int)(m - m0) : rows;
        const bf16_t *xm = x + m0 * x_stride;
        tiles(shape, mr, np, xm, x_stride, k, panels + p * panel_stride, panel_stride, gate);
        tiles(shape, mr, np, xm, x_stride, k, up_panels + p * panel_stride, panel_stride, up);
        store_silu_tile(mr, np, gate, up, p * PANEL, inter, y + m0 * inter);
      }
    }
  }
  return 0;
#else
  (void)x, (void)x_stride, (void)panels, (void)y, (void)m, (void)inter, (void)k;
  (void)num_threads, (void)min_work_per_thread, (void)prefetch;
  return -2;
#endif
}
