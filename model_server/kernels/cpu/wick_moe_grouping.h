/* The routed experts' frame, shared by moe.c (float and panel experts) and moe_wna16.c (GPTQ /
 * AWQ codes), and the routers' softmax (moe.c's and moe_routing.c's):
 * the (token, slot) pairs grouped by expert (a stable counting sort), each expert's gate/up
 * matmul, SiLU-and-mul and down matmul once over its rows, then each token's k rows weighted and
 * summed in slot order in fp32. Only the matmul differs between the two files: it is passed in
 * (MoEExpertMatmul). Internal to the library: no entry point is declared here (the contracts are
 * wick_moe.h's and wick_moe_wna16.h's). */
#ifndef WICK_MOE_GROUPING_H
#define WICK_MOE_GROUPING_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "wick_cpu.h"
#include "wick_entry.h"

static inline int64_t moe_elem_size(int dtype) { return dtype == 1 ? 2 : 4; }

static inline float moe_load(int dtype, const void *p, int64_t i) {
  return dtype == 1 ? bf16_to_f32(((const bf16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void moe_store(int dtype, void *p, int64_t i, float v) {
  if (dtype == 1)
    ((bf16_t *)p)[i] = f32_to_bf16(v);
  else
    ((float *)p)[i] = v;
}

static inline int64_t moe_aligned(int64_t bytes) { return (bytes + 63) / 64 * 64; }

/* v [n] fp32 -> softmax(v) in place: the max, expf(v - max) summed in order, each divided by
 * the sum (libm's expf: PyTorch's softmax rounds otherwise, so both routers run this). */
static inline void moe_softmax(float *v, int n) {
  float max = v[0];
  for (int i = 1; i < n; i++)
    if (v[i] > max) max = v[i];
  float sum = 0.f;
  for (int i = 0; i < n; i++) {
    v[i] = expf(v[i] - max);
    sum += v[i];
  }
  for (int i = 0; i < n; i++) v[i] = v[i] / sum;
}

/* Scratch, in this order, each part 64-byte aligned: pos [T k] int64 (each pair's row in the
 * grouped order), xs [T k, H] (the pairs' tokens grouped by expert), gate_up [T k, 2I],
 * mid [T k, I], ys [T k, H] (each grouped pair's expert output). */
static inline int64_t moe_scratch_bytes(int dtype, int64_t num_tokens, int top_k, int64_t hidden,
                                        int64_t inter) {
  const int64_t pairs = num_tokens * top_k, es = moe_elem_size(dtype);
  return moe_aligned(pairs * 8) + moe_aligned(pairs * hidden * es) +
         moe_aligned(pairs * 2 * inter * es) + moe_aligned(pairs * inter * es) +
         moe_aligned(pairs * hidden * es);
}

/* y [rows, n] = x [rows, k] @ W^T for expert e's projection `proj` (0: w13, n = 2I, k = H;
 * 1: w2, n = H, k = I), outputs rounded to the dtype. Returns 0 or the matmul's error. */
typedef int (*MoEExpertMatmul)(const void *ctx, int proj, int e, const void *x, void *y,
                               int64_t rows);

/* mid [rows, I] = silu(x @ gate_e^T) * (x @ up_e^T) in one pass for expert e: the bits of the
 * w13 matmul then layer_ops.c's SiLU-and-mul, without the [rows, 2I] intermediate. Optional
 * (NULL: the frame runs those two). Returns 0 or the matmul's error. */
typedef int (*MoEExpertGateUpSilu)(const void *ctx, int e, const void *x, void *mid,
                                   int64_t rows);

/* out [T, H] = sum_j weights[t, j] * expert ids[t, j] of x[t] (wick_moe.h's contract) with the
 * matmuls of `matmul(ctx, ...)` (and `gate_up_silu`'s where given). Returns 0, -2 for an expert
 * id outside [0, E), or the matmul's error. */
static inline int moe_run_experts(int dtype, const void *x, int64_t num_tokens, int64_t hidden,
                                  int64_t inter, int num_experts, const float *weights,
                                  const int64_t *ids, int top_k, void *out, void *scratch,
                                  int num_threads, int64_t act_min_work, MoEExpertMatmul matmul,
                                  MoEExpertGateUpSilu gate_up_silu, const void *ctx) {
  if (num_tokens <= 0) return 0;
  const int64_t pairs = num_tokens * top_k, es = moe_elem_size(dtype);
  char *base = (char *)scratch;
  int64_t *pos = (int64_t *)base;
  char *xs = base + moe_aligned(pairs * 8);
  char *gate_up = xs + moe_aligned(pairs * hidden * es);
  char *mid = gate_up + moe_aligned(pairs * 2 * inter * es);
  char *ys = mid + moe_aligned(pairs * inter * es);
  /* Counting sort of the pairs by expert, stable: pos[p] is pair p's row in the grouped order. */
  int64_t start[num_experts + 1];
  for (int e = 0; e <= num_experts; e++) start[e] = 0;
  for (int64_t p = 0; p < pairs; p++) {
    if (ids[p] < 0 || ids[p] >= num_experts) return -2;
    start[ids[p] + 1]++;
  }
  for (int e = 0; e < num_experts; e++) start[e + 1] += start[e];
  int64_t next[num_experts];
  for (int e = 0; e < num_experts; e++) next[e] = start[e];
  for (int64_t p = 0; p < pairs; p++) {
    pos[p] = next[ids[p]]++;
    memcpy(xs + pos[p] * hidden * es, (const char *)x + (p / top_k) * hidden * es,
           (size_t)(hidden * es));
  }
  /* Each expert's rows: gate/up, SiLU-and-mul, down. */
  for (int e = 0; e < num_experts; e++) {
    const int64_t rows = start[e + 1] - start[e];
    if (rows == 0) continue;
    const char *x_e = xs + start[e] * hidden * es;
    int status;
    if (gate_up_silu != NULL) {
      status = gate_up_silu(ctx, e, x_e, mid, rows);
    } else {
      status = matmul(ctx, 0, e, x_e, gate_up, rows);
      if (status == 0)
        status = wick_silu_and_mul(dtype, gate_up, 2 * inter, mid, rows, (int)inter, num_threads,
                                   act_min_work);
    }
    if (status != 0) return status;
    status = matmul(ctx, 1, e, mid, ys + start[e] * hidden * es, rows);
    if (status != 0) return status;
  }
  /* out[t] = the sum over slots j, in order, of ys[pos[t k + j]] * weights[t, j] in fp32. */
  for (int64_t t = 0; t < num_tokens; t++) {
    for (int64_t h = 0; h < hidden; h++) {
      float acc = 0.f;
      for (int j = 0; j < top_k; j++) {
        const int64_t p = t * top_k + j;
        acc += moe_load(dtype, ys, pos[p] * hidden + h) * weights[p];
      }
      moe_store(dtype, out, t * hidden + h, acc);
    }
  }
  return 0;
}

#endif /* WICK_MOE_GROUPING_H */
