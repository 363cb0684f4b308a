/* DeepSeek's grouped top-k router (contract in wick_moe_routing.h): V2's softmax scores, greedy
 * or limited to the best expert groups, V3's sigmoid scores chosen with a correction bias
 * (noaux_tc). The CPU kernel table's `moe_grouped_topk` (kernels/cpu/moe_routing.py) and
 * decoder_stack.c's MoE layers call the same functions with the same arguments, so the modules
 * and the native step route alike, bit for bit.
 *
 * The router's matmul is gemm.c's on fp32 rows (fp32 weight, x widened exactly): HF's scoring
 * in float32, whatever the activation dtype. Routing is per token, on the stack: E and k are
 * small (64-256 experts, 6-8 chosen). */
#include <math.h>
#include <stdint.h>

#include "wick_cpu.h"
#include "wick_entry.h"
#include "wick_moe_grouping.h"
#include "wick_moe_routing.h"

static int64_t aligned64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

int64_t wick_moe_grouped_topk_bytes(int dtype, int64_t num_tokens, int64_t hidden,
                                    int num_experts) {
  const int64_t logits = aligned64(num_tokens * num_experts * 4);
  return dtype == 1 ? logits + aligned64(num_tokens * hidden * 4) : logits;
}

/* Whether a token is limited to its best expert groups (grouped_topk's condition). */
static int grouped(const WickGroupedTopk *r) {
  return r->topk_method == MOE_TOPK_GROUP_LIMITED_GREEDY ||
         (r->topk_method == MOE_TOPK_NOAUX_TC && r->n_group > 1 && r->topk_group > 0);
}

static int valid(const WickGroupedTopk *r) {
  const int E = r->num_experts;
  if (E < 1 || r->top_k < 1 || r->top_k > E) return 0;
  if (r->scoring != MOE_SCORING_SOFTMAX && r->scoring != MOE_SCORING_SIGMOID) return 0;
  if (r->topk_method == MOE_TOPK_GROUP_LIMITED_GREEDY && r->scoring != MOE_SCORING_SOFTMAX)
    return 0;
  if (r->topk_method == MOE_TOPK_NOAUX_TC && r->scoring != MOE_SCORING_SIGMOID) return 0;
  if (r->topk_method == MOE_TOPK_GREEDY && r->scoring != MOE_SCORING_SOFTMAX) return 0;
  if (r->topk_method < MOE_TOPK_GREEDY || r->topk_method > MOE_TOPK_NOAUX_TC) return 0;
  if (!grouped(r)) return 1;
  if (r->n_group < 1 || E % r->n_group != 0) return 0;
  if (r->topk_group < 1 || r->topk_group > r->n_group) return 0;
  /* noaux_tc ranks a group by its two best */
  return r->scoring != MOE_SCORING_SIGMOID || E / r->n_group >= 2;
}

/* The index of the largest of v[0..n) not yet taken, a tie to the lower index (callers take
 * fewer than n). */
static int best_untaken(const float *v, const char *taken, int n) {
  int best = -1;
  for (int i = 0; i < n; i++)
    if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
  return best;
}

/* One token: logits [E] -> weights [k], ids [k]. */
static void route(const WickGroupedTopk *r, const float *logits, float *weights, int64_t *ids) {
  const int E = r->num_experts, k = r->top_k;
  float scores[E], choice[E];
  char taken[E];
  if (r->scoring == MOE_SCORING_SOFTMAX) { /* as moe.c's wick_moe_softmax_topk */
    for (int e = 0; e < E; e++) scores[e] = logits[e];
    moe_softmax(scores, E);
  } else {
    for (int e = 0; e < E; e++) scores[e] = 1.f / (1.f + expf(-logits[e]));
  }
  for (int e = 0; e < E; e++) {
    choice[e] = scores[e];
    if (r->correction_bias != NULL && r->scoring == MOE_SCORING_SIGMOID)
      choice[e] = scores[e] + r->correction_bias[e];
  }
  if (grouped(r)) {
    const int G = r->n_group, per = E / G;
    float group_score[G];
    char group_taken[G];
    for (int g = 0; g < G; g++) {
      const float *c = choice + g * per;
      group_taken[g] = 0;
      if (r->scoring == MOE_SCORING_SOFTMAX) { /* the group's best */
        float best = c[0];
        for (int i = 1; i < per; i++)
          if (c[i] > best) best = c[i];
        group_score[g] = best;
      } else { /* the sum of its two best (topk(2)'s values, best first) */
        int first = 0;
        for (int i = 1; i < per; i++)
          if (c[i] > c[first]) first = i;
        int second = first == 0 ? 1 : 0;
        for (int i = 0; i < per; i++)
          if (i != first && c[i] > c[second]) second = i;
        group_score[g] = c[first] + c[second];
      }
    }
    for (int j = 0; j < r->topk_group; j++)
      group_taken[best_untaken(group_score, group_taken, G)] = 1;
    /* the experts of the other groups: 0 (softmax: masked_fill 0.0) or -inf (sigmoid) */
    const float masked = r->scoring == MOE_SCORING_SOFTMAX ? 0.f : -INFINITY;
    for (int e = 0; e < E; e++)
      if (!group_taken[e / per]) choice[e] = masked;
  }
  for (int e = 0; e < E; e++) taken[e] = 0;
  for (int j = 0; j < k; j++) {
    const int e = best_untaken(choice, taken, E);
    taken[e] = 1;
    ids[j] = e;
    weights[j] = r->scoring == MOE_SCORING_SOFTMAX ? choice[e] : scores[e];
  }
  if (r->scoring == MOE_SCORING_SIGMOID && r->norm_topk_prob) {
    float sum = 0.f;
    for (int j = 0; j < k; j++) sum += weights[j];
    const float denominator = sum + 1e-20f;
    for (int j = 0; j < k; j++) weights[j] = weights[j] / denominator;
  }
  for (int j = 0; j < k; j++) weights[j] = weights[j] * r->routed_scaling_factor;
}

int wick_moe_grouped_topk_logits(const WickGroupedTopk *router, const float *logits,
                                 int64_t num_tokens, float *weights, int64_t *ids) {
  if (!valid(router)) return -1;
  const int64_t E = router->num_experts, k = router->top_k;
  for (int64_t t = 0; t < num_tokens; t++)
    route(router, logits + t * E, weights + t * k, ids + t * k);
  return 0;
}

int wick_moe_grouped_topk(int dtype, const void *x, int64_t num_tokens, int64_t hidden,
                          const WickGroupedTopk *router, float *weights, int64_t *ids,
                          void *scratch, int num_threads, int64_t gemm_min_work) {
  if (!valid(router)) return -1;
  if (num_tokens <= 0) return 0;
  const int E = router->num_experts;
  float *logits = (float *)scratch;
  const float *xf = (const float *)x;
  if (dtype == 1) { /* x widened to fp32 (exact): x.float() */
    float *wide = (float *)((char *)scratch + aligned64(num_tokens * E * 4));
    for (int64_t t = 0; t < num_tokens; t++)
      bf16_to_f32_row((const bf16_t *)x + t * hidden, wide + t * hidden, 1.f, (int)hidden);
    xf = wide;
  }
  const int status = wick_gemm(0, xf, hidden, router->weight, NULL, logits, (int)num_tokens, E,
                               (int)hidden, 0, num_threads, gemm_min_work);
  if (status != 0) return status;
  return wick_moe_grouped_topk_logits(router, logits, num_tokens, weights, ids);
}
