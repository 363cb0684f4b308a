/* Routed experts kept as GPTQ / AWQ codes (contract in wick_moe_wna16.h): moe.c's grouping and
 * slot-order sum around wna16_gemm.c's matmul, run on each expert's slice of the stacked codes
 * as they are (no float copy of an expert is ever made). The kernel table's `fused_experts` on
 * `WNA16Experts` (kernels/cpu/moe_wna16.py) and decoder_stack.c's MoE layers call this same
 * function, so the modules and the native step give the same bits.
 *
 * The matmul is the dense layers' wNa16 kernel whatever an expert's row count: one row (decode)
 * dequantizes in registers, more rows dequantize each tile of W once for all of them
 * (wna16_gemm.c), which is what a prefill's few dozen rows per expert want. */
#include <stdint.h>
#include <string.h>

#include "wick_cpu.h"
#include "wick_entry.h"
#include "wick_moe_wna16.h"

static int64_t elem_size(int dtype) { return dtype == 1 ? 2 : 4; }

static float load(int dtype, const void *p, int64_t i) {
  return dtype == 1 ? bf16_to_f32(((const bf16_t *)p)[i]) : ((const float *)p)[i];
}

static void store(int dtype, void *p, int64_t i, float v) {
  if (dtype == 1)
    ((bf16_t *)p)[i] = f32_to_bf16(v);
  else
    ((float *)p)[i] = v;
}

/* Scratch, in this order, each part 64-byte aligned (moe.c's): pos [T k] int64 (each pair's
 * row in the grouped order), xs [T k, H] (the pairs' tokens grouped by expert), gate_up
 * [T k, 2I], mid [T k, I], ys [T k, H] (each grouped pair's expert output). */
static int64_t aligned(int64_t bytes) { return (bytes + 63) / 64 * 64; }

int64_t wick_moe_wna16_scratch_bytes(int dtype, int64_t num_tokens, int top_k, int64_t hidden,
                                     int64_t inter) {
  const int64_t pairs = num_tokens * top_k, es = elem_size(dtype);
  return aligned(pairs * 8) + aligned(pairs * hidden * es) + aligned(pairs * 2 * inter * es) +
         aligned(pairs * inter * es) + aligned(pairs * hidden * es);
}

/* y [rows, w->n] = x [rows, w->k] @ W_e^T: expert e's slice of the stacked codes. */
static int expert_matmul(int dtype, const WickExpertsWNA16 *w, int e, const void *x, void *y,
                         int64_t rows, int num_threads) {
  const int64_t code_bytes = w->bits == 4 ? w->k / 2 : w->k;
  const int64_t groups = (w->k + w->group_size - 1) / w->group_size;
  const int64_t rows_e = (int64_t)e * w->n;
  return wick_wna16_gemm(dtype, x, w->k, w->codes + rows_e * code_bytes,
                         w->scales + rows_e * groups, w->offsets + rows_e * groups, NULL, y,
                         (int)rows, (int)w->n, (int)w->k, w->bits, w->group_size, num_threads,
                         w->min_work_per_thread);
}

int wick_moe_wna16_experts(int dtype, const void *x, int64_t num_tokens,
                           const WickExpertsWNA16 *w13, const WickExpertsWNA16 *w2,
                           int num_experts, const float *weights, const int64_t *ids, int top_k,
                           void *out, void *scratch, int num_threads, int64_t act_min_work) {
  const int64_t hidden = w13->k, inter = w2->k;
  if (w13->n != 2 * inter || w2->n != hidden) return -3;
  if (num_tokens <= 0) return 0;
  const int64_t pairs = num_tokens * top_k, es = elem_size(dtype);
  char *base = (char *)scratch;
  int64_t *pos = (int64_t *)base;
  char *xs = base + aligned(pairs * 8);
  char *gate_up = xs + aligned(pairs * hidden * es);
  char *mid = gate_up + aligned(pairs * 2 * inter * es);
  char *ys = mid + aligned(pairs * inter * es);
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
    int status = expert_matmul(dtype, w13, e, xs + start[e] * hidden * es, gate_up, rows,
                               num_threads);
    if (status != 0) return status;
    status = wick_silu_and_mul(dtype, gate_up, 2 * inter, mid, rows, (int)inter, num_threads,
                               act_min_work);
    if (status != 0) return status;
    status = expert_matmul(dtype, w2, e, mid, ys + start[e] * hidden * es, rows, num_threads);
    if (status != 0) return status;
  }
  /* out[t] = the sum over slots j, in order, of ys[pos[t k + j]] * weights[t, j] in fp32. */
  for (int64_t t = 0; t < num_tokens; t++) {
    for (int64_t h = 0; h < hidden; h++) {
      float acc = 0.f;
      for (int j = 0; j < top_k; j++) {
        const int64_t p = t * top_k + j;
        acc += load(dtype, ys, pos[p] * hidden + h) * weights[p];
      }
      store(dtype, out, t * hidden + h, acc);
    }
  }
  return 0;
}
