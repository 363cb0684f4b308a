/* Mixture-of-experts layers: the router's softmax top-k, the routed experts grouped by expert,
 * and Qwen2-MoE's gated shared expert add (contracts in wick_moe.h). The kernel table's MoE
 * slots on the CPU (kernels/cpu/moe.py) and decoder_stack.c's MoE layers call these same
 * functions with the same arguments, so the two paths give the same bits.
 *
 * Why one C path for both: the native decoder step runs every layer in one call, so it cannot
 * route in PyTorch between its kernels; and PyTorch's softmax and sigmoid round otherwise than
 * libm's expf, so the modules route here too. The experts' matmuls are gemm.c's skinny matmul
 * on each expert's slice of the stacked weights as they are (no packing): an expert sees a few
 * of a step's rows, the case that kernel is written for. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "wick_cpu.h"
#include "wick_entry.h"
#include "wick_moe.h"

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

/* Rounded to the dtype, kept as fp32 (a PyTorch op's stored value). */
static float rounded(int dtype, float v) { return dtype == 1 ? round_to_bf16(v) : v; }

int wick_moe_softmax_topk(int dtype, const void *logits, int64_t num_tokens, int num_experts,
                          int top_k, int renormalize, float *weights, int64_t *ids) {
  if (top_k < 1 || top_k > num_experts) return -1;
  float probs[num_experts];
  for (int64_t t = 0; t < num_tokens; t++) {
    const int64_t row = t * num_experts;
    float max = load(dtype, logits, row);
    for (int e = 1; e < num_experts; e++) {
      const float v = load(dtype, logits, row + e);
      if (v > max) max = v;
    }
    float sum = 0.f;
    for (int e = 0; e < num_experts; e++) {
      probs[e] = expf(load(dtype, logits, row + e) - max);
      sum += probs[e];
    }
    for (int e = 0; e < num_experts; e++) probs[e] = probs[e] / sum;
    /* top k by selection, best first; a tie goes to the lower id (strict >) */
    float *w = weights + t * top_k;
    int64_t *id = ids + t * top_k;
    for (int j = 0; j < top_k; j++) {
      int best = -1;
      for (int e = 0; e < num_experts; e++) {
        int taken = 0;
        for (int i = 0; i < j; i++) taken |= id[i] == e;
        if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
      }
      id[j] = best;
      w[j] = probs[best];
    }
    if (renormalize) {
      float total = 0.f;
      for (int j = 0; j < top_k; j++) total += w[j];
      for (int j = 0; j < top_k; j++) w[j] = w[j] / total;
    }
  }
  return 0;
}

/* Scratch, in this order, each part 64-byte aligned: pos [T k] int64 (each pair's row in the
 * grouped order), xs [T k, H] (the pairs' tokens grouped by expert), gate_up [T k, 2I],
 * mid [T k, I], ys [T k, H] (each grouped pair's expert output). */
static int64_t aligned(int64_t bytes) { return (bytes + 63) / 64 * 64; }

int64_t wick_moe_scratch_bytes(int dtype, int64_t num_tokens, int top_k, int64_t hidden,
                               int64_t inter) {
  const int64_t pairs = num_tokens * top_k, es = elem_size(dtype);
  return aligned(pairs * 8) + aligned(pairs * hidden * es) + aligned(pairs * 2 * inter * es) +
         aligned(pairs * inter * es) + aligned(pairs * hidden * es);
}

int wick_moe_experts(int dtype, const void *x, int64_t num_tokens, int64_t hidden,
                     const void *w13, const void *w2, int num_experts, int64_t inter,
                     const float *weights, const int64_t *ids, int top_k, void *out,
                     void *scratch, int num_threads, int64_t gemm_min_work,
                     int64_t act_min_work) {
  const int64_t pairs = num_tokens * top_k, es = elem_size(dtype);
  if (num_tokens <= 0) return 0;
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
    const char *w13_e = (const char *)w13 + (int64_t)e * 2 * inter * hidden * es;
    const char *w2_e = (const char *)w2 + (int64_t)e * hidden * inter * es;
    int status = wick_gemm(dtype, xs + start[e] * hidden * es, hidden, w13_e, NULL, gate_up,
                           (int)rows, (int)(2 * inter), (int)hidden, 1, num_threads,
                           gemm_min_work);
    if (status != 0) return status;
    status = wick_silu_and_mul(dtype, gate_up, 2 * inter, mid, rows, (int)inter, num_threads,
                               act_min_work);
    if (status != 0) return status;
    status = wick_gemm(dtype, mid, inter, w2_e, NULL, ys + start[e] * hidden * es, (int)rows,
                       (int)hidden, (int)inter, 1, num_threads, gemm_min_work);
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

int wick_moe_shared_expert_add(int dtype, const void *routed, const void *gate,
                               const void *shared, void *out, int64_t num_tokens,
                               int64_t hidden) {
  for (int64_t t = 0; t < num_tokens; t++) {
    const float g = rounded(dtype, 1.f / (1.f + expf(-load(dtype, gate, t))));
    for (int64_t h = 0; h < hidden; h++) {
      const int64_t i = t * hidden + h;
      const float scaled = rounded(dtype, g * load(dtype, shared, i));
      store(dtype, out, i, load(dtype, routed, i) + scaled);
    }
  }
  return 0;
}
