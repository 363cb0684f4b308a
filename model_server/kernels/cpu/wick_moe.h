/* Mixture-of-experts layers (moe.c), declared once: moe.c and decoder_stack.c include this
 * header, and the Python side binds its functions with the types declared here
 * (kernels/cpu/abi.py). Both paths run these three calls, with the same arguments in the same
 * order: the CPU kernel table's `moe_softmax_topk`, `fused_experts` and `shared_expert_add`
 * (kernels/cpu/moe.py) under the modules, and decoder_stack.c's MoE layers.
 *
 * dtype 0: fp32, 1: bf16 (activations and the experts' weights alike). Shapes:
 *   logits  [T, E] the router's output, in the dtype
 *   weights [T, k] fp32, ids [T, k] int64: each token's experts, best first
 *   x [T, H]; w13 [E, 2I, H] (each expert's gate rows, then its up rows); w2 [E, H, I];
 *   out [T, H] in the dtype. */
#ifndef WICK_MOE_H
#define WICK_MOE_H

#include <stdint.h>

/* softmax(logits) in fp32, its top k (ties to the lower expert id), renormalised to sum 1
 * when `renormalize` (Mixtral; Qwen's norm_topk_prob). Returns 0, -1 for k outside [1, E]. */
int wick_moe_softmax_topk(int dtype, const void *logits, int64_t num_tokens, int num_experts,
                          int top_k, int renormalize, float *weights, int64_t *ids);

/* The bytes of wick_moe_experts' scratch for these sizes. */
int64_t wick_moe_scratch_bytes(int dtype, int64_t num_tokens, int top_k, int64_t hidden,
                               int64_t inter);

/* out[t] = sum_j weights[t, j] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])),
 * e = ids[t, j]: the (token, slot) pairs grouped by expert (stable), each expert's two matmuls
 * once over its rows (gemm.c's wick_gemm, outputs rounded to the dtype; layer_ops.c's SiLU
 * and mul between), each pair's row times its weight in fp32, a token's k rows summed in slot
 * order in fp32 and rounded once. `scratch`: wick_moe_scratch_bytes of them. Returns 0, -2 for
 * an expert id outside [0, E), or a matmul's error. */
int wick_moe_experts(int dtype, const void *x, int64_t num_tokens, int64_t hidden,
                     const void *w13, const void *w2, int num_experts, int64_t inter,
                     const float *weights, const int64_t *ids, int top_k, void *out,
                     void *scratch, int num_threads, int64_t gemm_min_work,
                     int64_t act_min_work);

/* One projection of every expert, W_e [n, k], packed once into panels (kernels/cpu/
 * experts_plan.py's PanelExperts, which takes the stacked weight's place): expert e's panels at
 * data + e * elements, in panel_gemm.c's k-pair layout (pairs: bf16 on AVX512-BF16 builds) or
 * panel_gemm_f32.c's lanes layout (fp32, and bf16 elsewhere). */
typedef struct {
  const void *data;            /* [E, elements] in the activation dtype */
  int64_t n, k, elements;      /* each expert's W [n, k]; its panels' elements */
  int32_t pairs;               /* 1: panel_gemm.c's layout, 0: panel_gemm_f32.c's */
  int64_t min_work_per_thread; /* multiply-adds worth another thread (panel_gemm.py's) */
} WickExpertsPanels;

/* wick_moe_experts' contract on experts kept as panels: w13 n = 2I, k = H; w2 n = H, k = I,
 * each expert's two matmuls the panel kernel's (row-invariant: a token's output does not depend
 * on how many rows its experts got). `scratch`: wick_moe_scratch_bytes of them. Returns 0, -2
 * for an expert id outside [0, E), -3 when w13 and w2 do not fit, -4 for the pair layout with
 * fp32 activations or on a build without AVX512-BF16, -1 when a matmul cannot allocate. */
int wick_moe_panel_experts(int dtype, const void *x, int64_t num_tokens,
                           const WickExpertsPanels *w13, const WickExpertsPanels *w2,
                           int num_experts, const float *weights, const int64_t *ids, int top_k,
                           void *out, void *scratch, int num_threads, int64_t act_min_work);

/* out [T, H] = routed + sigmoid(gate) * shared, gate [T] (one column), each op rounded to the
 * dtype as PyTorch rounds `routed + torch.sigmoid(gate) * shared` (Qwen2-MoE's shared
 * expert). out may be routed or shared (each element is read before its own is written). */
int wick_moe_shared_expert_add(int dtype, const void *routed, const void *gate,
                               const void *shared, void *out, int64_t num_tokens,
                               int64_t hidden);

#endif /* WICK_MOE_H */
