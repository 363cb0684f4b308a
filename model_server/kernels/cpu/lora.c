/* Batched LoRA for the CPU, punica's shrink/expand (wick_lora.h has the layout and the contract):
 * rows of a step grouped by adapter slot, then
 *   shrink  h[t, i R + c] = a[s, i R + c, :] . x[t]         for c < ranks[s, i]
 *   expand  y[t, slice i] += sum_c h[t, i R + c] b[s, c, slice i]
 * The rows of one slot run together, so its A and B are read once per call (per thread), not
 * once per row: a decode step of 16 rows over 4 adapters reads 4 adapters' weights. A row's
 * work is a few ranks times (k + n), a fraction of the base matmul's k n; what it costs is
 * mostly the adapters' weights read from memory (a rank-16 adapter on the seven projections of
 * SmolLM2-135M is 19 MB in fp32, 9 MB in bf16; the model's matmuls read ~270 MB per step),
 * hence the grouping, and bf16 weights for bf16 models (widened a row at a time).
 *
 * Threads: the shrink splits (slot, A row) items, the expand splits y's columns (in 16-float
 * lines); each output is computed by one thread in a fixed order (dot products in the build's
 * `omp simd` order, four rows per read of A; then the ranks in order), so the bits never depend
 * on the thread count, nor on a row's place in the batch.
 * Both the per-module path (kernels/cpu/lora.py) and the native decoder step (decoder_stack.c's
 * run_linear) call this function, so the two paths agree bit for bit. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "wick_cpu.h"
#include "wick_lora.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#define COLUMN_LINE 16 /* the expand's columns per thread are whole lines of 16 floats */

/* out[i] = a . x_i for four rows of x (a repeated pointer where fewer are wanted): one read of
 * a for four independent sums. Every row takes this one path, so its sum is rounded the same
 * wherever it sits in its group. */
static inline void dot4(const float *restrict a, const float *x0, const float *x1,
                        const float *x2, const float *x3, const int64_t k, float out[4]) {
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t i = 0; i < k; i++) {
    s0 += a[i] * x0[i];
    s1 += a[i] * x1[i];
    s2 += a[i] * x2[i];
    s3 += a[i] * x3[i];
  }
  out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

/* f rounded to bf16 (ties to even, NaN stays quiet): f32_to_bf16's bits, without its branch,
 * so that the loop writing y vectorizes. */
static inline bf16_t to_bf16(const float f) {
  union {
    float f;
    uint32_t u;
  } b = {round_to_bf16(f)};
  return (bf16_t)(b.u >> 16);
}

#define LANES 16 /* the expand's register block of y's columns */

/* For four rows q (a repeated row where fewer are wanted; `rows` are written): acc_q[0:w] =
 * sum_c h_q[c] b[c, 0:w] over c < r (b rows `ldb` apart, fp32 or bf16), then y_q[0:w] += acc_q
 * in y's dtype. One block of w <= LANES columns; each B row read once for the four rows, the
 * four sums independent (each in c's order, the same whatever rows share the call). */
static inline void expand_block(const float *const h[4], const int rows, const void *b,
                                const int wide, const int64_t ldb, const int r, const int64_t w,
                                void *const y[4], const int dtype) {
  float a0[LANES] = {0.f}, a1[LANES] = {0.f}, a2[LANES] = {0.f}, a3[LANES] = {0.f};
  for (int c = 0; c < r; c++) {
    float bv[LANES] = {0.f};
    if (wide) {
      const float *restrict src = (const float *)b + c * ldb;
      for (int64_t j = 0; j < w; j++) bv[j] = src[j];
    } else {
      const bf16_t *restrict src = (const bf16_t *)b + c * ldb;
      for (int64_t j = 0; j < w; j++) bv[j] = bf16_to_f32(src[j]);
    }
    const float h0 = h[0][c], h1 = h[1][c], h2 = h[2][c], h3 = h[3][c];
#pragma omp simd
    for (int j = 0; j < LANES; j++) {
      a0[j] += h0 * bv[j];
      a1[j] += h1 * bv[j];
      a2[j] += h2 * bv[j];
      a3[j] += h3 * bv[j];
    }
  }
  const float *acc[4] = {a0, a1, a2, a3};
  for (int q = 0; q < rows; q++) {
    const float *restrict a = acc[q];
    if (dtype == 1) {
      bf16_t *restrict yv = (bf16_t *)y[q];
#pragma omp simd
      for (int64_t j = 0; j < w; j++) yv[j] = to_bf16(bf16_to_f32(yv[j]) + a[j]);
    } else {
      float *restrict yv = (float *)y[q];
#pragma omp simd
      for (int64_t j = 0; j < w; j++) yv[j] += a[j];
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

int wick_lora_add(int dtype, const void *x, int64_t x_stride, void *y, int64_t y_stride,
                  int64_t m, const int32_t *token_slots, const WickLoRA *lora, int num_threads) {
  if (lora == NULL) return -3;
  if (lora->num_slices == 0 || m <= 0) return 0;
  const int bad = check(dtype, lora, token_slots);
  if (bad != 0) return bad;
  const int S = lora->max_loras, R = lora->max_rank, ns = lora->num_slices;
  const int64_t k = lora->k, n = lora->n, width = (int64_t)ns * R;
  const int32_t *ranks = lora->ranks;
  const int wide = lora->weight_dtype == 0; /* fp32 weights, read in place */

  /* Rows grouped by slot (a stable counting sort): slot s's rows are order[start[s]:start[s+1]];
   * `used` the slots with rows. */
  int64_t *start = (int64_t *)calloc((size_t)S + 1, sizeof(int64_t));
  int64_t *next = (int64_t *)malloc(sizeof(int64_t) * (size_t)S);
  int64_t *order = (int64_t *)malloc(sizeof(int64_t) * (size_t)m);
  int32_t *used = (int32_t *)malloc(sizeof(int32_t) * (size_t)S);
  float *h = NULL, *widened = NULL, *scratch = NULL;
  int status = 0;
  if (start == NULL || next == NULL || order == NULL || used == NULL) {
    status = -1;
    goto done;
  }
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
  if (active == 0) goto done;
  int num_used = 0;
  for (int s = 0; s < S; s++) {
    next[s] = start[s];
    if (start[s + 1] > start[s]) used[num_used++] = s;
  }
  for (int64_t t = 0; t < m; t++) {
    const int32_t s = token_slots[t];
    if (s >= 0) order[next[s]++] = t;
  }

  /* The multiply-adds this call does, for the thread count. */
  int64_t work = 0;
  for (int u = 0; u < num_used; u++) {
    const int s = used[u];
    for (int i = 0; i < ns; i++)
      work += (start[s + 1] - start[s]) * ranks[s * ns + i] * (k + lora->slice_size[i]);
  }
  if (work == 0) goto done; /* every slot used is empty on this layer */

  /* x's rows as fp32, in sorted order for bf16 (widened once), in place for fp32. */
  const float *xf = (const float *)x;
  if (dtype == 1) {
    widened = (float *)malloc(sizeof(float) * (size_t)active * (size_t)k);
    if (widened == NULL) {
      status = -1;
      goto done;
    }
    for (int64_t p = 0; p < active; p++)
      bf16_to_f32_row((const bf16_t *)x + order[p] * x_stride, widened + p * k, 1.f, (int)k);
    xf = widened;
  }
  int nt = threads_for(work, lora->min_work_per_thread, num_threads);
  const int64_t lines = (n + COLUMN_LINE - 1) / COLUMN_LINE;
  if (nt > lines) nt = (int)lines;
  if (nt < 1) nt = 1;
  h = (float *)malloc(sizeof(float) * (size_t)active * (size_t)width);
  /* scratch per thread: a bf16 row of A widened [k] */
  scratch = wide ? NULL : (float *)malloc(sizeof(float) * (size_t)nt * (size_t)k);
  if (h == NULL || (!wide && scratch == NULL)) {
    status = -1;
    goto done;
  }

  const int64_t items = (int64_t)num_used * width;
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
#ifdef _OPENMP
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
#else
    const int t = 0, T = 1;
#endif
    float *row = wide ? NULL : scratch + (int64_t)t * k;
    /* Shrink: items (used slot, row of A), each row of A read once for its slot's rows. */
    for (int64_t it = items * t / T; it < items * (t + 1) / T; it++) {
      const int s = used[it / width];
      const int64_t q = it % width;
      if (q % R >= ranks[s * ns + q / R]) continue; /* past the slot's rank (read never) */
      const int64_t at = ((int64_t)s * width + q) * k;
      const float *arow = (const float *)lora->a + at;
      if (!wide) {
        bf16_to_f32_row((const bf16_t *)lora->a + at, row, 1.f, (int)k);
        arow = row;
      }
      for (int64_t p = start[s]; p < start[s + 1]; p += 4) {
        const float *xs[4];
        float sums[4];
        for (int j = 0; j < 4; j++) {
          const int64_t pj = p + j < start[s + 1] ? p + j : start[s + 1] - 1;
          xs[j] = dtype == 1 ? xf + pj * k : xf + order[pj] * x_stride;
        }
        dot4(arow, xs[0], xs[1], xs[2], xs[3], k, sums);
        for (int j = 0; j < 4 && p + j < start[s + 1]; j++) h[(p + j) * width + q] = sums[j];
      }
    }
#pragma omp barrier
    /* Expand: this thread's columns of each active row, slice by slice, LANES columns at a
     * time summed in registers over the slot's rank (its B rows read from cache by the slot's
     * other rows). */
    const int64_t j0 = lines * t / T * COLUMN_LINE;
    const int64_t j1e = lines * (t + 1) / T * COLUMN_LINE, j1 = j1e < n ? j1e : n;
    const int64_t es = wide ? 4 : 2;
    const int64_t ys = dtype == 1 ? 2 : 4;
    for (int u = 0; u < num_used; u++) {
      const int s = used[u];
      const int64_t p1 = start[s + 1];
      for (int64_t p = start[s]; p < p1; p += 4) {
        const int rows = p1 - p < 4 ? (int)(p1 - p) : 4;
        for (int i = 0; i < ns; i++) {
          const int64_t off = lora->slice_offset[i], end = off + lora->slice_size[i];
          const int64_t lo = off > j0 ? off : j0, hi = end < j1 ? end : j1;
          const int r = ranks[s * ns + i];
          if (lo >= hi || r == 0) continue;
          const char *b = (const char *)lora->b + (int64_t)s * R * n * es;
          const float *h4[4];
          char *y4[4];
          for (int q = 0; q < 4; q++) {
            const int64_t pq = q < rows ? p + q : p + rows - 1;
            h4[q] = h + pq * width + (int64_t)i * R;
            y4[q] = (char *)y + order[pq] * y_stride * ys;
          }
          for (int64_t jb = lo; jb < hi; jb += LANES) {
            const int64_t w = hi - jb < LANES ? hi - jb : LANES;
            void *yb[4] = {y4[0] + jb * ys, y4[1] + jb * ys, y4[2] + jb * ys, y4[3] + jb * ys};
            expand_block(h4, rows, b + jb * es, wide, n, r, w, yb, dtype);
          }
        }
      }
    }
  }

done:
  free(start);
  free(next);
  free(order);
  free(used);
  free(widened);
  free(h);
  free(scratch);
  return status;
}
