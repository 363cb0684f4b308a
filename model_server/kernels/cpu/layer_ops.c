/* The per-token ops of a decoder layer for CPUs, one call each over all of a step's rows:
 * RMSNorm and LayerNorm (each with the residual add fused in), SiLU-and-mul, GELU (gated or
 * plain) and the neox rotary embedding. They
 * replace chains of 3 to 17 small PyTorch ops whose dispatch dominates a small decode step.
 *
 * `dtype` 0: every tensor of a call fp32, 1: every tensor bf16 (stored as uint16). The math is
 * fp32 and every result is rounded where the PyTorch ops of kernels/portable.py round (each of
 * their bf16 ops computes in fp32 and rounds its result to nearest even), so fp32 results are
 * PyTorch's up to the order of the RMSNorm sum and exp's last ulps, and bf16 ones are
 * bit-identical but where such an fp32 difference flips a rounding. That needs the build's
 * -ffp-contract=off: a fused multiply-add would skip a rounding the PyTorch ops make.
 *
 * Inputs are read in place (row strides given: Qwen3 normalizes [T, H, D] views of the fused
 * qkv projection, rotary reads q and k views of it) and never written; outputs are contiguous.
 * The loops are written for the auto-vectorizer (`omp simd`, -fopenmp-simd), the file compiled
 * once per ISA like paged_attention.c. OpenMP splits the rows only for calls of at least
 * 2 * `min_work_per_thread` elements (see threads_for): a decode step's rows are a few
 * microseconds of work, less than a fork/join.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "wick_cpu.h"
#include "wick_entry.h"

/* Element i of a row as fp32; `is_bf16` is a compile-time constant after inlining. */
static inline float load(const void *row, const int64_t i, const int is_bf16) {
  return is_bf16 ? bf16_to_f32(((const bf16_t *)row)[i]) : ((const float *)row)[i];
}

/* v rounded to the dtype, kept as fp32 (what a PyTorch op of that dtype would store). */
static inline float round_to(const float v, const int is_bf16) {
  return is_bf16 ? round_to_bf16(v) : v;
}

/* Stores v rounded to the dtype as element i. */
static inline void store(void *row, const int64_t i, const float v, const int is_bf16) {
  if (is_bf16) {
    union {
      float f;
      uint32_t u;
    } b = {round_to_bf16(v)};
    ((bf16_t *)row)[i] = (bf16_t)(b.u >> 16);
  } else {
    ((float *)row)[i] = v;
  }
}

static inline int64_t elem_size(const int is_bf16) {
  return is_bf16 ? (int64_t)sizeof(bf16_t) : (int64_t)sizeof(float);
}

/* The row `offset` elements into `base`. */
static inline const void *at(const void *base, const int64_t offset, const int is_bf16) {
  return (const char *)base + offset * elem_size(is_bf16);
}

static inline void *at_mut(void *base, const int64_t offset, const int is_bf16) {
  return (char *)base + offset * elem_size(is_bf16);
}

/* Rows of a [A, B, N] tensor with unit stride along N: row r starts at
 * (r / inner_rows) * outer_stride + (r % inner_rows) * inner_stride elements (inner_rows 1 for
 * evenly spaced rows). */
typedef struct {
  int64_t inner_rows, outer_stride, inner_stride;
} Rows;

static inline int64_t row_start(const Rows rows, const int64_t r) {
  return r / rows.inner_rows * rows.outer_stride + r % rows.inner_rows * rows.inner_stride;
}

/* ---- RMSNorm ------------------------------------------------------------------------------ */

/* sum x[i]^2 over a row; with a residual, x + residual rounded to the dtype is what is summed,
 * and it is stored into `sum_out` (the normalized row is then read back from there). */
static inline __attribute__((always_inline)) float sum_squares(
    const int is_bf16, const int n, const void *restrict x, const void *restrict residual,
    void *restrict sum_out) {
  float squares = 0.f;
  if (residual == NULL) {
#pragma omp simd reduction(+ : squares)
    for (int i = 0; i < n; i++) {
      const float s = load(x, i, is_bf16);
      squares += s * s;
    }
  } else {
#pragma omp simd reduction(+ : squares)
    for (int i = 0; i < n; i++) {
      const float s = round_to(load(x, i, is_bf16) + load(residual, i, is_bf16), is_bf16);
      store(sum_out, i, s, is_bf16);
      squares += s * s;
    }
  }
  return squares;
}

/* out = weight * round(s * rstd), rounded (HF Llama: the normalized value is cast to the dtype
 * before the weight multiplies it). */
static inline __attribute__((always_inline)) void scale_row(const int is_bf16, const int n,
                                                            const float rstd,
                                                            const void *restrict s,
                                                            const void *restrict weight,
                                                            void *restrict out) {
#pragma omp simd
  for (int i = 0; i < n; i++)
    store(out, i, load(weight, i, is_bf16) * round_to(load(s, i, is_bf16) * rstd, is_bf16),
          is_bf16);
}

/* One row: s = x (+ residual, stored into sum_out), out = rms_norm(s) * weight. */
static inline __attribute__((always_inline)) void rms_norm_row(
    const int is_bf16, const int n, const float eps, const void *x, const void *residual,
    const void *weight, void *out, void *sum_out) {
  const float squares = sum_squares(is_bf16, n, x, residual, sum_out);
  /* PyTorch: rsqrt(sum / n + eps), its rsqrt 1 / sqrt. */
  const float rstd = 1.f / sqrtf(squares / (float)n + eps);
  scale_row(is_bf16, n, rstd, residual == NULL ? x : sum_out, weight, out);
}

/* ---- LayerNorm ---------------------------------------------------------------------------- */

/* sum x[i] over a row; with a residual, x + residual rounded to the dtype is what is summed,
 * and it is stored into `sum_out` (the normalized row is then read back from there). */
static inline __attribute__((always_inline)) float row_sum(const int is_bf16, const int n,
                                                           const void *restrict x,
                                                           const void *restrict residual,
                                                           void *restrict sum_out) {
  float total = 0.f;
  if (residual == NULL) {
#pragma omp simd reduction(+ : total)
    for (int i = 0; i < n; i++) total += load(x, i, is_bf16);
  } else {
#pragma omp simd reduction(+ : total)
    for (int i = 0; i < n; i++) {
      const float s = round_to(load(x, i, is_bf16) + load(residual, i, is_bf16), is_bf16);
      store(sum_out, i, s, is_bf16);
      total += s;
    }
  }
  return total;
}

/* One row: s = x (+ residual, stored into sum_out), out = (s - mean) rstd weight (+ bias),
 * all in fp32 and rounded once (PyTorch's layer_norm on bf16 rounds its fp32 result once too).
 * The corrected two-pass statistics: a first mean, then the sums of d = s - mean and d^2,
 * which correct the mean's rounding (mean + sum d / n) and the variance's (sum d^2 - (sum d)^2
 * / n): no cancellation on large means, and a mean as exact as fp32 sums allow. */
static inline __attribute__((always_inline)) void layer_norm_row(
    const int is_bf16, const int n, const float eps, const void *x, const void *residual,
    const void *weight, const void *bias, void *out, void *sum_out) {
  const float first = row_sum(is_bf16, n, x, residual, sum_out) / (float)n;
  const void *restrict s = residual == NULL ? x : sum_out;
  float deviations = 0.f, squares = 0.f;
#pragma omp simd reduction(+ : deviations, squares)
  for (int i = 0; i < n; i++) {
    const float d = load(s, i, is_bf16) - first;
    deviations += d;
    squares += d * d;
  }
  const float mean = first + deviations / (float)n;
  const float var = (squares - deviations * deviations / (float)n) / (float)n;
  const float rstd = 1.f / sqrtf((var > 0.f ? var : 0.f) + eps);
  if (bias == NULL) {
#pragma omp simd
    for (int i = 0; i < n; i++)
      store(out, i, (load(s, i, is_bf16) - mean) * rstd * load(weight, i, is_bf16), is_bf16);
  } else {
#pragma omp simd
    for (int i = 0; i < n; i++)
      store(out, i,
            (load(s, i, is_bf16) - mean) * rstd * load(weight, i, is_bf16) +
                load(bias, i, is_bf16),
            is_bf16);
  }
}

/* The rows of one norm call: `layer` 0 RMSNorm (bias unused), 1 LayerNorm. The kind and the
 * dtype are tested per row, outside the vector loops: each copy of the row function has them
 * as constants (OpenMP outlines the loop body before constants propagate into it). */
static void norm_rows(const int layer, const int dtype, const void *x, const Rows x_rows,
                      const void *residual, const Rows r_rows, const void *weight,
                      const void *bias, void *out, void *sum_out, const int64_t num_rows,
                      const int n, const float eps, const int num_threads,
                      const int64_t min_work_per_thread) {
  const int is_bf16 = dtype == 1;
  const int threads = threads_for(num_rows * n, min_work_per_thread, num_threads);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t r = 0; r < num_rows; r++) {
    const void *xr = at(x, row_start(x_rows, r), is_bf16);
    const void *rr = residual == NULL ? NULL : at(residual, row_start(r_rows, r), is_bf16);
    void *sr = sum_out == NULL ? NULL : at_mut(sum_out, r * n, is_bf16);
    void *o = at_mut(out, r * n, is_bf16);
    if (layer && is_bf16)
      layer_norm_row(1, n, eps, xr, rr, weight, bias, o, sr);
    else if (layer)
      layer_norm_row(0, n, eps, xr, rr, weight, bias, o, sr);
    else if (is_bf16)
      rms_norm_row(1, n, eps, xr, rr, weight, o, sr);
    else
      rms_norm_row(0, n, eps, xr, rr, weight, o, sr);
  }
}

/* x [num_rows, n] (rows per x_*) -> out [num_rows, n] = rms_norm(x) * weight [n]. With a
 * residual (rows per r_*, not NULL): s = x + residual is stored into sum_out [num_rows, n] and
 * normalized instead. Returns 0. */
int wick_rms_norm(int dtype, const void *x, int64_t x_inner_rows, int64_t x_outer_stride,
                  int64_t x_inner_stride, const void *residual, int64_t r_inner_rows,
                  int64_t r_outer_stride, int64_t r_inner_stride, const void *weight, void *out,
                  void *sum_out, int64_t num_rows, int n, float eps, int num_threads,
                  int64_t min_work_per_thread) {
  const Rows x_rows = {x_inner_rows, x_outer_stride, x_inner_stride};
  const Rows r_rows = {r_inner_rows, r_outer_stride, r_inner_stride};
  norm_rows(0, dtype, x, x_rows, residual, r_rows, weight, NULL, out, sum_out, num_rows, n, eps,
            num_threads, min_work_per_thread);
  return 0;
}

/* x [num_rows, n] (rows per x_*) -> out [num_rows, n] = layer_norm(x) * weight [n] + bias [n]
 * (bias NULL: none). With a residual (rows per r_*, not NULL): s = x + residual is stored into
 * sum_out [num_rows, n] and normalized instead. Returns 0. The module path (layers/norm.py's
 * LayerNorm on the native table) and decoder_stack.c both run it: their bits agree. */
int wick_layer_norm(int dtype, const void *x, int64_t x_inner_rows, int64_t x_outer_stride,
                    int64_t x_inner_stride, const void *residual, int64_t r_inner_rows,
                    int64_t r_outer_stride, int64_t r_inner_stride, const void *weight,
                    const void *bias, void *out, void *sum_out, int64_t num_rows, int n,
                    float eps, int num_threads, int64_t min_work_per_thread) {
  const Rows x_rows = {x_inner_rows, x_outer_stride, x_inner_stride};
  const Rows r_rows = {r_inner_rows, r_outer_stride, r_inner_stride};
  norm_rows(1, dtype, x, x_rows, residual, r_rows, weight, bias, out, sum_out, num_rows, n, eps,
            num_threads, min_work_per_thread);
  return 0;
}

/* ---- SiLU-and-mul ------------------------------------------------------------------------- */

/* out[i] = round(round(silu(gate[i])) * up[i]) over x = [gate (d) | up (d)]. silu(g) =
 * g / (1 + e^-g), computed from e = e^-|g| <= 1 so that exp never overflows: g / (1 + e) for
 * g >= 0, g e / (1 + e) below. */
static inline __attribute__((always_inline)) void silu_and_mul_row(const int is_bf16,
                                                                   const int d,
                                                                   const void *restrict x,
                                                                   void *restrict out) {
#pragma omp simd
  for (int i = 0; i < d; i++) {
    const float g = load(x, i, is_bf16);
    const float up = load(x, d + i, is_bf16);
    const float e = exp_nonpositive(-fabsf(g));
    const float silu = (g >= 0.f ? g : g * e) / (1.f + e);
    store(out, i, round_to(silu, is_bf16) * up, is_bf16);
  }
}

/* x [num_rows, 2 d] (rows `x_stride` elements apart) -> out [num_rows, d]. Returns 0. */
int wick_silu_and_mul(int dtype, const void *x, int64_t x_stride, void *out, int64_t num_rows,
                      int d, int num_threads, int64_t min_work_per_thread) {
  const int is_bf16 = dtype == 1;
  const int threads = threads_for(num_rows * 3 * (int64_t)d, min_work_per_thread, num_threads);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t r = 0; r < num_rows; r++) {
    const void *xr = at(x, r * x_stride, is_bf16);
    void *o = at_mut(out, r * d, is_bf16);
    if (is_bf16)
      silu_and_mul_row(1, d, xr, o);
    else
      silu_and_mul_row(0, d, xr, o);
  }
  return 0;
}

/* gelu(g) with the tanh approximation, g / 2 (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))),
 * tanh(a) = sign(a) (1 - e) / (1 + e) with e = e^-2|a| <= 1 (no overflow). Not PyTorch's bits:
 * the module path (GeluAndMul and the plain MLPs' gelu on this table) and the native decoder
 * stack both run it. */
static inline __attribute__((always_inline)) float gelu_tanh_value(const float g) {
  const float a = 0.7978845608028654f * (g + 0.044715f * g * g * g);
  const float e = exp_nonpositive(-2.f * fabsf(a));
  const float t = (1.f - e) / (1.f + e);
  return 0.5f * g * (1.f + (a >= 0.f ? t : -t));
}

/* out[i] = round(round(gelu_tanh(gate[i])) * up[i]) over x = [gate (d) | up (d)]: GeGLU with
 * the tanh approximation (Gemma). */
static inline __attribute__((always_inline)) void gelu_tanh_and_mul_row(const int is_bf16,
                                                                        const int d,
                                                                        const void *restrict x,
                                                                        void *restrict out) {
#pragma omp simd
  for (int i = 0; i < d; i++) {
    const float up = load(x, d + i, is_bf16);
    store(out, i, round_to(gelu_tanh_value(load(x, i, is_bf16)), is_bf16) * up, is_bf16);
  }
}

/* x [num_rows, 2 d] (rows `x_stride` elements apart) -> out [num_rows, d]. Returns 0. */
int wick_gelu_tanh_and_mul(int dtype, const void *x, int64_t x_stride, void *out,
                           int64_t num_rows, int d, int num_threads,
                           int64_t min_work_per_thread) {
  const int is_bf16 = dtype == 1;
  const int threads = threads_for(num_rows * 3 * (int64_t)d, min_work_per_thread, num_threads);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t r = 0; r < num_rows; r++) {
    const void *xr = at(x, r * x_stride, is_bf16);
    void *o = at_mut(out, r * d, is_bf16);
    if (is_bf16)
      gelu_tanh_and_mul_row(1, d, xr, o);
    else
      gelu_tanh_and_mul_row(0, d, xr, o);
  }
  return 0;
}

/* ---- GELU (plain: Phi-2's and StarCoder2's fc1 -> act -> fc2) ------------------------------ */

/* gelu(g) = g / 2 erfc(-g / sqrt 2) (the exact, erf GELU). erfc(z), z = |g| / sqrt 2 >= 0, is
 * t e^(-z^2 + P(t)), t = 1 / (1 + z / 2), P the Chebyshev fit of Numerical Recipes' erfcc
 * (relative error < 1.2e-7 everywhere), and erfc(-z) = 2 - erfc(z): no libm call, so the loop
 * vectorizes. Not PyTorch's bits (both Wick paths run this). */
static inline __attribute__((always_inline)) float gelu_erf_value(const float g) {
  const float z = fabsf(g) * 0.7071067811865476f;
  const float t = 1.f / (1.f + 0.5f * z);
  float p = 0.17087277f;
  p = p * t - 0.82215223f;
  p = p * t + 1.48851587f;
  p = p * t - 1.13520398f;
  p = p * t + 0.27886807f;
  p = p * t - 0.18628806f;
  p = p * t + 0.09678418f;
  p = p * t + 0.37409196f;
  p = p * t + 1.00002368f;
  p = p * t - 1.26551223f;
  /* -z^2 + P(t) <= 3e-8 (at z = 0): exp_nonpositive's range, up to that rounding */
  const float erfc_z = t * exp_nonpositive(-z * z + p);
  return 0.5f * g * (g >= 0.f ? 2.f - erfc_z : erfc_z);
}

static inline __attribute__((always_inline)) void gelu_row(const int is_bf16, const int tanh_,
                                                           const int d, const void *restrict x,
                                                           void *restrict out) {
  if (tanh_) {
#pragma omp simd
    for (int i = 0; i < d; i++) store(out, i, gelu_tanh_value(load(x, i, is_bf16)), is_bf16);
  } else {
#pragma omp simd
    for (int i = 0; i < d; i++) store(out, i, gelu_erf_value(load(x, i, is_bf16)), is_bf16);
  }
}

/* x [num_rows, d] (rows `x_stride` elements apart) -> out [num_rows, d] = gelu(x), rounded once;
 * approximate 1: the tanh form (gelu_new, gelu_pytorch_tanh), 0: the erf one. Returns 0. */
int wick_gelu(int dtype, const void *x, int64_t x_stride, void *out, int64_t num_rows, int d,
              int approximate, int num_threads, int64_t min_work_per_thread) {
  const int is_bf16 = dtype == 1, tanh_ = approximate == 1;
  const int threads = threads_for(num_rows * 2 * (int64_t)d, min_work_per_thread, num_threads);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t r = 0; r < num_rows; r++) {
    const void *xr = at(x, r * x_stride, is_bf16);
    void *o = at_mut(out, r * d, is_bf16);
    if (is_bf16)
      gelu_row(1, tanh_, d, xr, o);
    else
      gelu_row(0, tanh_, d, xr, o);
  }
  return 0;
}

/* ---- Rotary embedding (neox) -------------------------------------------------------------- */

/* One head: dims i and half + i rotate by the angle whose cos and sin are cs[i], cs[half + i]:
 * (x1 c - x2 s, x2 c + x1 s), each product rounded, then the sum (PyTorch's four muls and two
 * adds of the dtype). */
static inline __attribute__((always_inline)) void rotate_head(const int is_bf16, const int half,
                                                              const void *restrict x,
                                                              const void *restrict cs,
                                                              void *restrict out) {
#pragma omp simd
  for (int i = 0; i < half; i++) {
    const float x1 = load(x, i, is_bf16), x2 = load(x, half + i, is_bf16);
    const float c = load(cs, i, is_bf16), s = load(cs, half + i, is_bf16);
    store(out, i, round_to(x1 * c, is_bf16) - round_to(x2 * s, is_bf16), is_bf16);
    store(out, half + i, round_to(x2 * c, is_bf16) + round_to(x1 * s, is_bf16), is_bf16);
  }
}

/* Geometry of one rotary call; strides count elements. The first rotary_dim dims of a head
 * rotate, the others (partial rotary: GLM-4, Phi-2, StableLM) pass through. */
typedef struct {
  int64_t q_token_stride, q_head_stride, k_token_stride, k_head_stride;
  int num_heads, num_kv_heads, head_dim, rotary_dim;
} RotaryGeometry;

/* One head of head_dim values: the first rotary_dim rotate (`rotate_head`), the rest copy. */
static inline __attribute__((always_inline)) void rotate_partial(const int is_bf16,
                                                                 const RotaryGeometry *geo,
                                                                 const void *restrict x,
                                                                 const void *restrict cs,
                                                                 void *restrict out) {
  rotate_head(is_bf16, geo->rotary_dim / 2, x, cs, out);
  const size_t es = is_bf16 ? 2 : 4;
  if (geo->rotary_dim < geo->head_dim)
    memcpy((char *)out + (size_t)geo->rotary_dim * es, (const char *)x + (size_t)geo->rotary_dim * es,
           (size_t)(geo->head_dim - geo->rotary_dim) * es);
}

/* Token t's query and key heads. */
static inline __attribute__((always_inline)) void rotary_token(const int is_bf16,
                                                               const RotaryGeometry *geo,
                                                               const int64_t t, const void *cs,
                                                               const void *q, const void *k,
                                                               void *q_out, void *k_out) {
  const int head_dim = geo->head_dim;
  for (int h = 0; h < geo->num_heads; h++)
    rotate_partial(is_bf16, geo, at(q, t * geo->q_token_stride + h * geo->q_head_stride, is_bf16),
                   cs, at_mut(q_out, (t * geo->num_heads + h) * head_dim, is_bf16));
  for (int h = 0; h < geo->num_kv_heads; h++)
    rotate_partial(is_bf16, geo, at(k, t * geo->k_token_stride + h * geo->k_head_stride, is_bf16),
                   cs, at_mut(k_out, (t * geo->num_kv_heads + h) * head_dim, is_bf16));
}

/* q [T, num_heads, head_dim], k [T, num_kv_heads, head_dim] (strided: token and head strides
 * given, unit stride along head_dim), positions [T] int64, cos_sin [max_position, rotary_dim]
 * (cos in the first half of a row, sin in the second) -> q_out, k_out contiguous: each head's
 * first rotary_dim dims rotated (neox pairs within them), the rest copied. rotary_dim is even
 * and <= head_dim. Returns 0; -2 when a position is outside [0, max_position), -3 for a
 * rotary_dim that is not, before any work. */
int wick_rotary_neox(int dtype, const int64_t *positions, int64_t num_tokens,
                     const void *cos_sin, int64_t max_position, const void *q,
                     int64_t q_token_stride, int64_t q_head_stride, void *q_out, const void *k,
                     int64_t k_token_stride, int64_t k_head_stride, void *k_out, int num_heads,
                     int num_kv_heads, int head_dim, int rotary_dim, int num_threads,
                     int64_t min_work_per_thread) {
  if (rotary_dim < 2 || rotary_dim > head_dim || rotary_dim % 2) return -3;
  for (int64_t t = 0; t < num_tokens; t++)
    if (positions[t] < 0 || positions[t] >= max_position) return -2;
  const RotaryGeometry geo = {q_token_stride, q_head_stride, k_token_stride, k_head_stride,
                              num_heads,      num_kv_heads,  head_dim,       rotary_dim};
  const int is_bf16 = dtype == 1;
  const int64_t work = num_tokens * (num_heads + num_kv_heads) * (int64_t)head_dim;
  const int threads = threads_for(work, min_work_per_thread, num_threads);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t t = 0; t < num_tokens; t++) {
    const void *cs = at(cos_sin, positions[t] * rotary_dim, is_bf16);
    if (is_bf16)
      rotary_token(1, &geo, t, cs, q, k, q_out, k_out);
    else
      rotary_token(0, &geo, t, cs, q, k, q_out, k_out);
  }
  return 0;
}

/* ---- Greedy sampling ---------------------------------------------------------------------- */

/* The index of a row's largest value, the first one on ties, as torch.argmax: a NaN counts as
 * the largest (the first NaN wins). Two vectorized passes, the max (and whether a NaN is there),
 * then the first block of 64 holding it, scanned; n >= 1. */
static inline __attribute__((always_inline)) int64_t argmax_row(const int is_bf16,
                                                                const int64_t n,
                                                                const void *restrict x) {
  float best = -INFINITY;
  int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
  for (int64_t i = 0; i < n; i++) {
    const float v = load(x, i, is_bf16);
    best = v > best ? v : best;
    nan |= v != v;
  }
  for (int64_t i0 = 0; i0 < n; i0 += 64) {
    const int64_t i1 = i0 + 64 < n ? i0 + 64 : n;
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t i = i0; i < i1; i++) {
      const float v = load(x, i, is_bf16);
      hit |= nan ? v != v : v == best;
    }
    if (hit)
      for (int64_t i = i0; i < i1; i++) {
        const float v = load(x, i, is_bf16);
        if (nan ? v != v : v == best) return i;
      }
  }
  return 0; /* not reached */
}

/* x [num_rows, n] (rows `x_stride` elements apart), n >= 1 -> out[r] = argmax of row r. */
int wick_argmax(int dtype, const void *x, int64_t x_stride, int64_t num_rows, int64_t n,
                int64_t *out, int num_threads, int64_t min_work_per_thread) {
  const int is_bf16 = dtype == 1;
  const int threads = threads_for(num_rows * n, min_work_per_thread, num_threads);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t r = 0; r < num_rows; r++) {
    const void *xr = at(x, r * x_stride, is_bf16);
    out[r] = is_bf16 ? argmax_row(1, n, xr) : argmax_row(0, n, xr);
  }
  return 0;
}
