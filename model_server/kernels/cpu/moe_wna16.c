/* Routed experts kept as GPTQ / AWQ codes (contract in wick_moe_wna16.h): moe.c's grouping and
 * slot-order sum (wick_moe_grouping.h) around wna16_gemm.c's matmul, run on each expert's slice
 * of the stacked codes as they are (no float copy of an expert is ever made). The kernel table's
 * `fused_experts` on `WNA16Experts` (kernels/cpu/moe_wna16.py) and decoder_stack.c's MoE layers
 * call this same function, so the modules and the native step give the same bits.
 *
 * The matmul is the dense layers' wNa16 kernel whatever an expert's row count: one row (decode)
 * dequantizes in registers, more rows dequantize each tile of W once for all of them
 * (wna16_gemm.c), which is what a prefill's few dozen rows per expert want. */
#include <stdint.h>
#include <stdlib.h>

#include "wick_cpu.h"
#include "wick_entry.h"
#include "wick_moe_grouping.h"
#include "wick_moe_wna16.h"

/* Scratch: moe.c's (wick_moe_grouping.h). */
int64_t wick_moe_wna16_scratch_bytes(int dtype, int64_t num_tokens, int top_k, int64_t hidden,
                                     int64_t inter) {
  return moe_scratch_bytes(dtype, num_tokens, top_k, hidden, inter);
}

typedef struct {
  int dtype, num_threads;
  const WickExpertsWNA16 *w[2]; /* w13, w2 */
  void *gathered; /* act-order: an expert's input in its codes' order [rows, k] (else NULL) */
} CodedExperts;

/* y [rows, w->n] = x [rows, w->k] @ W_e^T: expert e's slice of the stacked codes (act-order:
 * x's columns gathered in the order of expert e's codes first). */
static int coded_matmul(const void *ctx, int proj, int e, const void *x, void *y, int64_t rows) {
  const CodedExperts *c = ctx;
  const WickExpertsWNA16 *w = c->w[proj];
  const int64_t code_bytes = w->bits == 4 ? w->k / 2 : w->k;
  const int64_t groups = (w->k + w->group_size - 1) / w->group_size;
  const int64_t rows_e = (int64_t)e * w->n;
  if (w->perm != NULL) {
    gather_columns(c->dtype == 1 ? 2 : 4, x, w->perm + (int64_t)e * w->k, c->gathered, rows,
                   w->k);
    x = c->gathered;
  }
  return wick_wna16_gemm(c->dtype, x, w->k, w->codes + rows_e * code_bytes,
                         w->scales + rows_e * groups, w->offsets + rows_e * groups, NULL, y,
                         (int)rows, (int)w->n, (int)w->k, w->bits, w->group_size, c->num_threads,
                         w->min_work_per_thread);
}

int wick_moe_wna16_experts(int dtype, const void *x, int64_t num_tokens,
                           const WickExpertsWNA16 *w13, const WickExpertsWNA16 *w2,
                           int num_experts, const float *weights, const int64_t *ids, int top_k,
                           void *out, void *scratch, int num_threads, int64_t act_min_work) {
  const int64_t hidden = w13->k, inter = w2->k;
  if (w13->n != 2 * inter || w2->n != hidden) return -3;
  /* act-order: one buffer for every expert's gathered input, the widest projection's (an
   * expert has at most T k rows) */
  void *gathered = NULL;
  if (w13->perm != NULL || w2->perm != NULL) {
    const int64_t k = hidden > inter ? hidden : inter;
    gathered = malloc((size_t)(num_tokens * top_k * k * (dtype == 1 ? 2 : 4)));
    if (gathered == NULL) return -1;
  }
  const CodedExperts ctx = {dtype, num_threads, {w13, w2}, gathered};
  const int status =
      moe_run_experts(dtype, x, num_tokens, hidden, inter, num_experts, weights, ids, top_k,
                      out, scratch, num_threads, act_min_work, coded_matmul, NULL, &ctx);
  free(gathered);
  return status;
}
