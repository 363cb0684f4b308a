/* Batched LoRA for the CPU, punica's shrink/expand (wick_lora.h has the layout and the contract):
 * rows of a step grouped by adapter slot, then
 *   shrink  h[t, i R + c] = a[s, i R + c, :] . x[t]         for c < ranks[s, i]
 *   expand  y[t, slice i] += sum_c h[t, i R + c] b[s, c, slice i]
 * A row's work is a few ranks times (k + n), a fraction of the base matmul's k n; what it costs
 * is the adapters' weights read from memory (a rank-16 adapter on the seven projections of
 * SmolLM2-135M is 9.7 MB in bf16; the model's matmuls read ~270 MB per step). So the rows of one
 * slot run together (GROUP at a time in registers) and every weight byte is read once per call,
 * by one thread: threads take whole slots where the slots' work splits evenly (no barrier
 * between a slot's shrink and its expand), else the shrink's threads split A's rows and the
 * expand's y's columns (whole lines of 16 floats, so each reads its own columns of B). bf16
 * weights are widened in registers, and prefetched ahead of the tiles (a layer's weights are
 * short runs the hardware finds late).
 *
 * Bits: every output is summed by one thread in one fixed order, whatever the thread count and
 * whichever rows share its register tile: a dot product of the shrink in lanes over k (fused
 * multiply-adds, or vdpbf16ps for bf16 x and A where the build has it), the lanes added by
 * vsum, a k tail after; an expand output over c in order (fused multiply-adds, the scalar tail
 * the same operation as a lane); then one addition to y and one rounding to y's dtype. The
 * order is the build's (its vector width, vdpbf16ps or not): ISA builds may differ in the last
 * bits, as every kernel's here. Both the per-module path (kernels/cpu/lora.py) and the native
 * decoder step (decoder_stack.c's run_linear) call this function, so the two paths agree bit for
 * bit. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "wick_cpu.h"
#include "wick_lora.h"
#include "wick_vec.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define COLUMN_LINE 16 /* the expand's columns per thread are whole lines of 16 floats */
#define GROUP 4        /* rows of one slot per register tile */
#define CHUNK 64       /* sorted rows per pass: bounds the scratch (x widened, h) */
/* Vectors of columns per expand tile: GROUP x EXPAND_VECS accumulators and EXPAND_VECS of B
 * in registers (AVX-512 has 32, the others 16). */
#ifndef EXPAND_VECS
#define EXPAND_VECS (VW == 16 ? 4 : 2)
#endif
#ifndef PREFETCH_BYTES
/* How far ahead of the weights being read they are prefetched (into L2): a layer's A and B are
 * short runs in separate buffers, which the hardware prefetchers pick up late (and not across
 * 4 KiB pages). Busy 2-core Zen 5, one thread, SmolLM2's 120 calls of a 16-row step over 4
 * rank-16 bf16 adapters: the shrink 2.1 ms without, 1.1 ms with; the expand 2.7 / 1.3 ms. */
#define PREFETCH_BYTES 4096
#endif
#define PREFETCH_LOCALITY 2
#ifndef EXPAND_PREFETCH_BYTES
#define EXPAND_PREFETCH_BYTES 256 /* the same along each of B's rows, read side by side */
#endif

/* c + a b rounded as one lane of vfma rounds it (a fused multiply-add where vfma is one). */
static inline float sfma(const float a, const float b, const float c) {
#if VW == 16 || (VW == 8 && defined(__FMA__))
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

/* VW weights from element i of w (fp32 when `wide`, else bf16), as fp32. */
static inline vf wload(const void *w, const int64_t i, const int wide) {
  return wide ? vload((const float *)w + i) : vload_bf16((const bf16_t *)w + i);
}

static inline float wscalar(const void *w, const int64_t i, const int wide) {
  return wide ? ((const float *)w)[i] : bf16_to_f32(((const bf16_t *)w)[i]);
}

/* The lanes of v added, in a fixed order per build. */
static inline float vsum(const vf v) {
#if VW == 16
  return _mm512_reduce_add_ps((__m512)v);
#elif VW == 8 && defined(__AVX2__)
  __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
  float s = 0.f;
  for (int i = 0; i < VW; i++) s += v[i];
  return s;
#endif
}

/* f in every lane. */
static inline vf vsplat(const float f) {
#if VW == 16
  return (vf)_mm512_set1_ps(f);
#elif VW == 8 && defined(__AVX2__)
  return (vf)_mm256_set1_ps(f);
#else
  vf v;
  for (int i = 0; i < VW; i++) v[i] = f;
  return v;
#endif
}

/* v rounded to bf16 (f32_to_bf16 on every lane: ties to even, NaN stays quiet) at p. */
static inline void vstore_bf16(bf16_t *p, const vf v) {
  const vu u = (vu)v;
  const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u); /* all ones where NaN */
  const vu bits = (rounded & ~nan) | (((u >> 16) | 0x40u) & nan);
#if VW == 16
  _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16((__m512i)bits));
#else
  const vh h = __builtin_convertvector(bits, vh);
  memcpy(p, &h, sizeof h);
#endif
}

/* out[i][q] = a_i . x_q for two rows a_0, a_1 of A (fp32 or bf16; a_1 = a_0 where one is
 * wanted) and GROUP rows of x (repeated pointers where fewer are wanted): each A row read once
 * for the tile. Constant `wide` after inlining, so the 8 accumulators live in registers. */
static inline __attribute__((always_inline)) void shrink_tile(const void *a0, const void *a1,
                                                              const int wide,
                                                              const float *const x[GROUP],
                                                              const int64_t k,
                                                              const char *pf,
                                                              const int64_t pf_step,
                                                              float out[2][GROUP]) {
  vf s0[GROUP], s1[GROUP];
  for (int q = 0; q < GROUP; q++) s0[q] = s1[q] = (vf){0};
  const int64_t kv = k - k % VW;
  for (int64_t i = 0; i < kv; i += VW, pf += pf_step) {
    for (int64_t at = 0; at < pf_step; at += 64) __builtin_prefetch(pf + at, 0, PREFETCH_LOCALITY);
    const vf w0 = wload(a0, i, wide), w1 = wload(a1, i, wide);
    for (int q = 0; q < GROUP; q++) {
      const vf xv = vload(x[q] + i);
      s0[q] = vfma(w0, xv, s0[q]);
      s1[q] = vfma(w1, xv, s1[q]);
    }
  }
  for (int q = 0; q < GROUP; q++) {
    float t0 = vsum(s0[q]), t1 = vsum(s1[q]);
    for (int64_t i = kv; i < k; i++) {
      t0 = sfma(wscalar(a0, i, wide), x[q][i], t0);
      t1 = sfma(wscalar(a1, i, wide), x[q][i], t1);
    }
    out[0][q] = t0, out[1][q] = t1;
  }
}

#if defined(__AVX512BF16__)
#define HAVE_DPBF16 1
/* shrink_tile for bf16 x and A on vdpbf16ps, 32 values of k per step (its products of bf16
 * pairs are exact, each added to the lane's fp32 sum in turn; denormals flushed); the k % 32
 * tail loaded masked, its missing lanes zero. Half the instructions of the widening path, whose
 * bits it does not give: a build runs one or the other for every call (HAVE_DPBF16). */
static inline __attribute__((always_inline)) void shrink_tile_dp(const bf16_t *a0,
                                                                 const bf16_t *a1,
                                                                 const bf16_t *const x[GROUP],
                                                                 const int64_t k,
                                                                 const char *pf,
                                                                 const int64_t pf_step,
                                                                 float out[2][GROUP]) {
  __m512 s0[GROUP], s1[GROUP];
  for (int q = 0; q < GROUP; q++) s0[q] = s1[q] = _mm512_setzero_ps();
  const int64_t kv = k - k % 32;
  for (int64_t i = 0; i < kv; i += 32, pf += pf_step) {
    for (int64_t at = 0; at < pf_step; at += 64) __builtin_prefetch(pf + at, 0, PREFETCH_LOCALITY);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(a0 + i);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(a1 + i);
    for (int q = 0; q < GROUP; q++) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x[q] + i);
      s0[q] = _mm512_dpbf16_ps(s0[q], xv, w0);
      s1[q] = _mm512_dpbf16_ps(s1[q], xv, w1);
    }
  }
  if (kv < k) {
    const __mmask32 m = (__mmask32)((1ull << (k - kv)) - 1);
    const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(m, a0 + kv);
    const __m512bh w1 = (__m512bh)_mm512_maskz_loadu_epi16(m, a1 + kv);
    for (int q = 0; q < GROUP; q++) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x[q] + kv);
      s0[q] = _mm512_dpbf16_ps(s0[q], xv, w0);
      s1[q] = _mm512_dpbf16_ps(s1[q], xv, w1);
    }
  }
  for (int q = 0; q < GROUP; q++) out[0][q] = vsum((vf)s0[q]), out[1][q] = vsum((vf)s1[q]);
}
#else
#define HAVE_DPBF16 0
#endif

/* The shrink's tile for the call's types: vdpbf16ps (`dp`: x and A bf16, where the build has
 * it), or fp32 FMAs on x as fp32 rows and A fp32 (`wide`) or bf16. */
static inline void shrink(const int dp, const int wide, const void *a0, const void *a1,
                          const void *const x[GROUP], const int64_t k, const char *pf,
                          const int64_t pf_step, float out[2][GROUP]) {
#if HAVE_DPBF16
  if (dp) {
    shrink_tile_dp((const bf16_t *)a0, (const bf16_t *)a1, (const bf16_t *const *)x, k, pf,
                   pf_step, out);
    return;
  }
#else
  (void)dp;
#endif
  if (wide)
    shrink_tile(a0, a1, 1, (const float *const *)x, k, pf, pf_step, out);
  else
    shrink_tile(a0, a1, 0, (const float *const *)x, k, pf, pf_step, out);
}

/* y_q[j] += acc (one rounding to y's dtype: bf16 when `ybf`) for VW columns at j. */
static inline void add_to_y(void *y, const int64_t j, const vf acc, const int ybf) {
  if (ybf) {
    bf16_t *p = (bf16_t *)y + j;
    vstore_bf16(p, vload_bf16(p) + acc);
  } else {
    float *p = (float *)y + j;
    const vf v = vload(p) + acc;
    memcpy(p, &v, sizeof v);
  }
}

/* For GROUP rows q (repeated where fewer are wanted; `rows` are written): columns [lo, hi) of
 * y_q += sum_c h_q[c] b[c, :] over c < r (b's rows `ldb` apart, fp32 or bf16, b pointing at
 * column 0). EXPAND_VECS vectors of columns at a time, then one, then single columns; each
 * B row segment read once for the GROUP rows. */
static inline __attribute__((always_inline)) void expand_rows(
    const float *const h[GROUP], const int rows, const void *b, const int wide,
    const int64_t ldb, const int r, const int64_t lo, const int64_t hi, void *const y[GROUP],
    const int ybf, const int prefetch) {
  const int64_t es = wide ? 4 : 2;
  int64_t j = lo;
  for (; j + EXPAND_VECS * VW <= hi; j += EXPAND_VECS * VW) {
    vf acc[GROUP][EXPAND_VECS];
    for (int q = 0; q < GROUP; q++)
      for (int v = 0; v < EXPAND_VECS; v++) acc[q][v] = (vf){0};
    for (int c = 0; c < r; c++) {
      if (prefetch) /* the lines of this row EXPAND_PREFETCH_BYTES ahead of the tile's */
        for (int64_t at = 0; at < EXPAND_VECS * VW * es; at += 64)
          __builtin_prefetch((const char *)b + (c * ldb + j) * es + EXPAND_PREFETCH_BYTES + at,
                             0, PREFETCH_LOCALITY);
      vf bv[EXPAND_VECS];
      for (int v = 0; v < EXPAND_VECS; v++) bv[v] = wload(b, c * ldb + j + v * VW, wide);
      for (int q = 0; q < GROUP; q++) {
        const vf hv = vsplat(h[q][c]);
        for (int v = 0; v < EXPAND_VECS; v++) acc[q][v] = vfma(hv, bv[v], acc[q][v]);
      }
    }
    for (int q = 0; q < rows; q++)
      for (int v = 0; v < EXPAND_VECS; v++) add_to_y(y[q], j + v * VW, acc[q][v], ybf);
  }
  for (; j + VW <= hi; j += VW) {
    vf acc[GROUP];
    for (int q = 0; q < GROUP; q++) acc[q] = (vf){0};
    for (int c = 0; c < r; c++) {
      const vf bv = wload(b, c * ldb + j, wide);
      for (int q = 0; q < GROUP; q++) acc[q] = vfma(vsplat(h[q][c]), bv, acc[q]);
    }
    for (int q = 0; q < rows; q++) add_to_y(y[q], j, acc[q], ybf);
  }
  for (; j < hi; j++)
    for (int q = 0; q < rows; q++) {
      float acc = 0.f;
      for (int c = 0; c < r; c++) acc = sfma(h[q][c], wscalar(b, c * ldb + j, wide), acc);
      if (ybf) {
        bf16_t *p = (bf16_t *)y[q] + j;
        *p = f32_to_bf16(bf16_to_f32(*p) + acc);
      } else {
        ((float *)y[q])[j] += acc;
      }
    }
}

static int check(const int dtype, const WickLoRA *l, const int32_t *token_slots) {
  if (l->num_slices < 0 || l->num_slices > MAX_LORA_SLICES || l->max_loras < 1 ||
      l->max_rank < 1 || l->k < 1 || l->n < 1 || l->a == NULL || l->b == NULL ||
      l->ranks == NULL || token_slots == NULL || (dtype != 0 && dtype != 1) ||
      (l->weight_dtype != 0 && l->weight_dtype != 1))
    return -3;
  for (int i = 0; i < l->num_slices; i++)
    if (l->slice_offset[i] < 0 || l->slice_size[i] < 0 ||
        l->slice_offset[i] + l->slice_size[i] > l->n)
      return -3;
  for (int64_t i = 0; i < (int64_t)l->max_loras * l->num_slices; i++)
    if (l->ranks[i] < 0 || l->ranks[i] > l->max_rank) return -3;
  return 0;
}

/* One pass over sorted rows [c0, c1) (at most CHUNK): xr / yr their rows of x (bf16 for `dp`,
 * else fp32) and y, h [CHUNK, width] scratch; used[u0:u1] the slots with rows in the pass. */
typedef struct {
  const WickLoRA *l;
  int wide, ybf, dp;
  int64_t c0, c1;
  const int64_t *start;
  const int32_t *used;
  int u0, u1;
  const void *const *xr;
  void *const *yr;
  float *h;
} Pass;

/* The multiply-adds of slot s's rows in the pass: its tiles', GROUP rows each (a slot's weights
 * are read for its first row, and cost about a tile's work). */
static int64_t slot_work(const Pass *P, const int s) {
  const WickLoRA *l = P->l;
  const int64_t *start = P->start;
  const int64_t p0 = start[s] > P->c0 ? start[s] : P->c0;
  const int64_t p1 = start[s + 1] < P->c1 ? start[s + 1] : P->c1;
  const int64_t tiled = (p1 - p0 + GROUP - 1) / GROUP * GROUP;
  int64_t work = 0;
  for (int i = 0; i < l->num_slices; i++)
    work += tiled * l->ranks[s * l->num_slices + i] * (l->k + l->slice_size[i]);
  return work;
}

/* Shrink items [it, end) of the pass: (slot used[u0 + it / width], row it % width of its A),
 * two rows of A of one slot per tile. */
static void shrink_items(const Pass *P, int64_t it, const int64_t end) {
  const WickLoRA *l = P->l;
  const int R = l->max_rank, ns = l->num_slices;
  const int64_t k = l->k, width = (int64_t)ns * R, es = P->wide ? 4 : 2;
  const int32_t *ranks = l->ranks;
  while (it < end) {
    const int s = P->used[P->u0 + it / width];
    const int64_t q = it % width;
    if (q % R >= ranks[s * ns + q / R]) { /* past the slot's rank (read never) */
      it++;
      continue;
    }
    const int two = it + 1 < end && q + 1 < width && (q + 1) % R < ranks[s * ns + (q + 1) / R];
    const char *a0 = (const char *)l->a + ((int64_t)s * width + q) * k * es;
    const char *a1 = two ? a0 + k * es : a0;
    const int64_t p0 = P->start[s] > P->c0 ? P->start[s] : P->c0;
    const int64_t p1 = P->start[s + 1] < P->c1 ? P->start[s + 1] : P->c1;
    for (int64_t p = p0; p < p1; p += GROUP) {
      const void *xs[GROUP];
      float sums[2][GROUP];
      for (int g = 0; g < GROUP; g++) xs[g] = P->xr[(p + g < p1 ? p + g : p1 - 1) - P->c0];
      /* the slot's first rows prefetch the A rows after the tile's: a stream PREFETCH_BYTES
       * ahead, as fast as the tile reads its rows */
      const int64_t per_step = (1 + two) * (P->dp ? 32 : VW) * es;
      shrink(P->dp, P->wide, a0, a1, xs, k, a0 + PREFETCH_BYTES, p == p0 ? per_step : 0, sums);
      for (int g = 0; g < GROUP && p + g < p1; g++) {
        P->h[(p + g - P->c0) * width + q] = sums[0][g];
        if (two) P->h[(p + g - P->c0) * width + q + 1] = sums[1][g];
      }
    }
    it += 1 + two;
  }
}

/* Expand used[ua:ub]'s rows of the pass on y's columns [j0, j1), slice by slice. */
static void expand_slots(const Pass *P, const int ua, const int ub, const int64_t j0,
                         const int64_t j1) {
  const WickLoRA *l = P->l;
  const int R = l->max_rank, ns = l->num_slices, wide = P->wide, ybf = P->ybf;
  const int64_t n = l->n, width = (int64_t)ns * R, es = wide ? 4 : 2;
  for (int u = ua; u < ub; u++) {
    const int s = P->used[u];
    const int64_t p0 = P->start[s] > P->c0 ? P->start[s] : P->c0;
    const int64_t p1 = P->start[s + 1] < P->c1 ? P->start[s + 1] : P->c1;
    const char *b = (const char *)l->b + (int64_t)s * R * n * es;
    for (int64_t p = p0; p < p1; p += GROUP) {
      const int rows = p1 - p < GROUP ? (int)(p1 - p) : GROUP;
      for (int i = 0; i < ns; i++) {
        const int64_t off = l->slice_offset[i], end = off + l->slice_size[i];
        const int64_t lo = off > j0 ? off : j0, hi = end < j1 ? end : j1;
        const int r = l->ranks[s * ns + i];
        if (lo >= hi || r == 0) continue;
        const float *hs[GROUP];
        void *ys[GROUP];
        for (int g = 0; g < GROUP; g++) {
          const int64_t pg = (g < rows ? p + g : p + rows - 1) - P->c0;
          hs[g] = P->h + pg * width + (int64_t)i * R;
          ys[g] = P->yr[pg];
        }
        const int pf = p == p0; /* the slot's first rows read B from memory */
        if (wide && ybf)
          expand_rows(hs, rows, b, 1, n, r, lo, hi, ys, 1, pf);
        else if (wide)
          expand_rows(hs, rows, b, 1, n, r, lo, hi, ys, 0, pf);
        else if (ybf)
          expand_rows(hs, rows, b, 0, n, r, lo, hi, ys, 1, pf);
        else
          expand_rows(hs, rows, b, 0, n, r, lo, hi, ys, 0, pf);
      }
    }
  }
}

static void lora_pass(const Pass *P, const int num_threads) {
  const WickLoRA *l = P->l;
  const int64_t n = l->n, width = (int64_t)l->num_slices * l->max_rank;
  const int nu = P->u1 - P->u0;
  int64_t work = 0;
  for (int u = P->u0; u < P->u1; u++) work += slot_work(P, P->used[u]);
  if (work == 0) return; /* every slot of the pass is empty on this layer */
  const int64_t lines = (n + COLUMN_LINE - 1) / COLUMN_LINE;
  int nt = threads_for(work, l->min_work_per_thread, num_threads);
  if (nt > lines) nt = (int)lines;
  if (nt < 1) nt = 1;
  /* Threads take whole slots (each its slots' shrink then expand: no barrier between) where
   * the slots' work splits evenly enough, within BY_SLOT_SLACK of an equal share; else they
   * split A's rows, then (after a barrier) y's columns. first[t]: thread t's first slot, the
   * one whose work's midpoint falls in its share. Either way each output's bits are the same. */
  int by_slot = nt > 1 && nu >= nt;
  int first[by_slot ? nt + 1 : 1];
  if (by_slot) {
    int64_t before = 0, most = 0, share = 0;
    int t = 0;
    first[0] = P->u0;
    for (int u = P->u0; u < P->u1; u++) {
      const int64_t w = slot_work(P, P->used[u]);
      const int owner = (int)((2 * before + w) * nt / (2 * work));
      while (t < owner) {
        most = share > most ? share : most;
        share = 0, first[++t] = u;
      }
      share += w, before += w;
    }
    most = share > most ? share : most;
    while (t < nt) first[++t] = P->u1;
    for (t = 0; t < nt; t++) by_slot &= first[t + 1] > first[t];
    by_slot &= most * nt * 4 <= work * 5; /* BY_SLOT_SLACK: 1.25 */
  }
  const int64_t items = (int64_t)nu * width;
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
#ifdef _OPENMP
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
#else
    const int t = 0, T = 1;
#endif
    if (by_slot && T == nt) {
      shrink_items(P, (int64_t)(first[t] - P->u0) * width, (int64_t)(first[t + 1] - P->u0) * width);
      expand_slots(P, first[t], first[t + 1], 0, n);
    } else {
      shrink_items(P, items * t / T, items * (t + 1) / T);
#pragma omp barrier
      const int64_t j0 = lines * t / T * COLUMN_LINE;
      const int64_t j1 = lines * (t + 1) / T * COLUMN_LINE;
      expand_slots(P, P->u0, P->u1, j0, j1 < n ? j1 : n);
    }
  }
}

int wick_lora_add(int dtype, const void *x, int64_t x_stride, void *y, int64_t y_stride,
                  int64_t m, const int32_t *token_slots, const WickLoRA *lora, int num_threads) {
  if (lora == NULL) return -3;
  if (lora->num_slices == 0 || m <= 0) return 0;
  const int bad = check(dtype, lora, token_slots);
  if (bad != 0) return bad;
  const int S = lora->max_loras;
  const int64_t k = lora->k, width = (int64_t)lora->num_slices * lora->max_rank;
  const int ybf = dtype == 1;
  /* bf16 x and A on vdpbf16ps where the build has it (x read in place), else x widened */
  const int dp = HAVE_DPBF16 && ybf && lora->weight_dtype == 1;
  const int64_t cap = m < CHUNK ? m : CHUNK; /* rows of one pass, at most */

  /* One allocation: the rows grouped by slot (a stable counting sort: slot s's rows are
   * order[start[s]:start[s+1]], `used` the slots with rows), then one pass's row pointers, h
   * and (bf16) its rows of x widened. */
  const size_t bytes = sizeof(int64_t) * ((size_t)S * 2 + 1 + (size_t)m) +
                       sizeof(void *) * 2 * (size_t)cap + sizeof(int32_t) * (size_t)S +
                       sizeof(float) * (size_t)cap * (size_t)(width + (ybf && !dp ? k : 0)) +
                       64;
  char *mem = (char *)malloc(bytes);
  if (mem == NULL) return -1;
  int64_t *start = (int64_t *)mem, *next = start + S + 1, *order = next + S;
  const void **xr = (const void **)(order + m);
  void **yr = (void **)(xr + cap);
  float *h = (float *)(yr + cap);
  float *xw = h + cap * width;
  int32_t *used = (int32_t *)(xw + (ybf && !dp ? cap * k : 0));
  int status = 0;
  memset(start, 0, sizeof(int64_t) * ((size_t)S + 1));
  for (int64_t t = 0; t < m; t++) {
    const int32_t s = token_slots[t];
    if (s < -1 || s >= S) {
      status = -2;
      goto done;
    }
    if (s >= 0) start[s + 1]++;
  }
  for (int s = 0; s < S; s++) start[s + 1] += start[s];
  const int64_t active = start[S];
  int num_used = 0;
  for (int s = 0; s < S; s++) {
    next[s] = start[s];
    if (start[s + 1] > start[s]) used[num_used++] = s;
  }
  for (int64_t t = 0; t < m; t++) {
    const int32_t s = token_slots[t];
    if (s >= 0) order[next[s]++] = t;
  }

  const int ys = ybf ? 2 : 4;
  for (int64_t c0 = 0, u0 = 0; c0 < active; c0 += CHUNK) {
    const int64_t c1 = active - c0 < CHUNK ? active : c0 + CHUNK;
    while (start[used[u0] + 1] <= c0) u0++;
    int64_t u1 = u0;
    while (u1 < num_used && start[used[u1]] < c1) u1++;
    for (int64_t p = c0; p < c1; p++) {
      const int64_t row = order[p];
      yr[p - c0] = (char *)y + row * y_stride * ys;
      if (dp) {
        xr[p - c0] = (const bf16_t *)x + row * x_stride;
      } else if (ybf) {
        float *w = xw + (p - c0) * k;
        bf16_to_f32_row((const bf16_t *)x + row * x_stride, w, 1.f, (int)k);
        xr[p - c0] = w;
      } else {
        xr[p - c0] = (const float *)x + row * x_stride;
      }
    }
    const Pass pass = {lora, lora->weight_dtype == 0, ybf, dp, c0, c1, start, used, (int)u0,
                       (int)u1, xr, yr, h};
    lora_pass(&pass, num_threads);
  }

done:
  free(mem);
  return status;
}
