/* DeepSeek's grouped top-k router (moe_routing.c), declared once: moe_routing.c and
 * decoder_stack.c include this header, and the Python side binds its functions and mirrors its
 * struct from it (kernels/cpu/abi.py; abi_layout.c lists the struct's fields). Both paths run
 * wick_moe_grouped_topk with the same arguments: the CPU kernel table's `moe_grouped_topk`
 * (kernels/cpu/moe_routing.py) under the modules, and decoder_stack.c's MoE layers.
 *
 * The arithmetic of the portable `grouped_topk` (kernels/fused_moe_torch.py), in fp32:
 *   logits [T, E] = float(x) @ weight^T (HF's F.linear(x.float(), weight.float()));
 *   scores = softmax(logits) (V2) or sigmoid(logits) (V3);
 *   choice = scores, + correction_bias where given (V3's e_score_correction_bias);
 *   GROUP_LIMITED_GREEDY (softmax): groups ranked by their best choice, the experts outside the
 *   best topk_group of n_group set to 0; NOAUX_TC (sigmoid) with n_group > 1: groups ranked by
 *   the sum of their two best choices, the others set to -inf;
 *   ids = the top_k of choice, best first, a tie to the lower id (groups alike);
 *   weights = choice at ids (softmax; no renormalisation, as HF's V2) or scores at ids
 *   (sigmoid), divided by (their sum in slot order + 1e-20) when norm_topk_prob (sigmoid only),
 *   times routed_scaling_factor.
 * PyTorch's topk leaves the order of ties (and of its unsorted output) to its implementation,
 * and its softmax and sigmoid round otherwise than libm's expf: the modules route here too on
 * the CPU, so both paths choose the same experts with the same bits. */
#ifndef WICK_MOE_ROUTING_H
#define WICK_MOE_ROUTING_H

#include <stdint.h>

/* WickGroupedTopk.scoring and .topk_method (kernels/cpu/moe_routing.py's values). */
enum { MOE_SCORING_SOFTMAX = 0, MOE_SCORING_SIGMOID = 1 };
enum { MOE_TOPK_GREEDY = 0, MOE_TOPK_GROUP_LIMITED_GREEDY = 1, MOE_TOPK_NOAUX_TC = 2 };

typedef struct {
  int32_t scoring, topk_method; /* MOE_SCORING_*, MOE_TOPK_* */
  int32_t num_experts, top_k;
  /* the expert groups (E divisible by n_group) and how many of them a token may use; 0: none */
  int32_t n_group, topk_group;
  int32_t norm_topk_prob;
  float routed_scaling_factor;
  const float *weight;          /* the router [E, hidden] fp32 */
  const float *correction_bias; /* [E] fp32, or NULL */
} WickGroupedTopk;

/* The bytes of wick_moe_grouped_topk's scratch: logits [T, E] fp32 and, for bf16 x, x in fp32
 * [T, hidden]. */
int64_t wick_moe_grouped_topk_bytes(int dtype, int64_t num_tokens, int64_t hidden,
                                    int num_experts);

/* Routing of router logits [T, E] fp32 (the contract above from the logits on): weights [T, k]
 * fp32, ids [T, k] int64. Returns 0, -1 for parameters outside the contract (k outside [1, E],
 * groups that do not divide E, topk_group outside [1, n_group], a sigmoid group of one
 * expert, an unknown scoring or method). */
int wick_moe_grouped_topk_logits(const WickGroupedTopk *router, const float *logits,
                                 int64_t num_tokens, float *weights, int64_t *ids);

/* x [T, hidden] in the dtype (0 fp32, 1 bf16) -> the router's logits in fp32 (gemm.c's
 * wick_gemm on fp32 rows), then wick_moe_grouped_topk_logits. `scratch`:
 * wick_moe_grouped_topk_bytes of them. Returns 0, -1 as above, or the matmul's error. */
int wick_moe_grouped_topk(int dtype, const void *x, int64_t num_tokens, int64_t hidden,
                          const WickGroupedTopk *router, float *weights, int64_t *ids,
                          void *scratch, int num_threads, int64_t gemm_min_work);

#endif /* WICK_MOE_ROUTING_H */
