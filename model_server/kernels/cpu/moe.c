/* Mixture-of-experts layers: the router's softmax top-k, the routed experts grouped by expert,
 * and Qwen2-MoE's gated shared expert add (contracts in wick_moe.h). The kernel table's MoE
 * slots on the CPU (kernels/cpu/moe.py) and decoder_stack.c's MoE layers call these same
 * functions with the same arguments, so the two paths give the same bits.
 *
 * Why one C path for both: the native decoder step runs every layer in one call, so it cannot
 * route in PyTorch between its kernels; and PyTorch's softmax and sigmoid round otherwise than
 * libm's expf, so the modules route here too. The experts' matmuls are gemm.c's skinny matmul
 * on each expert's slice of the stacked weights as they are (wick_moe_experts), or, where the
 * preparation's experts plan packed them (kernels/cpu/experts_plan.py), the panel kernels on
 * each expert's panels (wick_moe_panel_experts). Both share wick_moe_grouping.h's frame. */
#include <math.h>
#include <stdint.h>

#include "wick_cpu.h"
#include "wick_entry.h"
#include "wick_moe.h"
#include "wick_moe_grouping.h"

/* Rounded to the dtype, kept as fp32 (a PyTorch op's stored value). */
static float rounded(int dtype, float v) { return dtype == 1 ? round_to_bf16(v) : v; }

int wick_moe_softmax_topk(int dtype, const void *logits, int64_t num_tokens, int num_experts,
                          int top_k, int renormalize, float *weights, int64_t *ids) {
  if (top_k < 1 || top_k > num_experts) return -1;
  float probs[num_experts];
  for (int64_t t = 0; t < num_tokens; t++) {
    for (int e = 0; e < num_experts; e++) probs[e] = moe_load(dtype, logits, t * num_experts + e);
    moe_softmax(probs, num_experts);
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

int64_t wick_moe_scratch_bytes(int dtype, int64_t num_tokens, int top_k, int64_t hidden,
                               int64_t inter) {
  return moe_scratch_bytes(dtype, num_tokens, top_k, hidden, inter);
}

/* The stacked experts as they are, each expert's slice through gemm.c's skinny matmul. */
typedef struct {
  int dtype, num_threads;
  const char *w13, *w2;
  int64_t hidden, inter, gemm_min_work;
} PlainExperts;

static int plain_matmul(const void *ctx, int proj, int e, const void *x, void *y, int64_t rows) {
  const PlainExperts *c = ctx;
  const int64_t es = moe_elem_size(c->dtype);
  const int64_t n = proj == 0 ? 2 * c->inter : c->hidden, k = proj == 0 ? c->hidden : c->inter;
  const char *w = (proj == 0 ? c->w13 : c->w2) + (int64_t)e * n * k * es;
  return wick_gemm(c->dtype, x, k, w, NULL, y, (int)rows, (int)n, (int)k, 1, c->num_threads,
                   c->gemm_min_work);
}

int wick_moe_experts(int dtype, const void *x, int64_t num_tokens, int64_t hidden,
                     const void *w13, const void *w2, int num_experts, int64_t inter,
                     const float *weights, const int64_t *ids, int top_k, void *out,
                     void *scratch, int num_threads, int64_t gemm_min_work,
                     int64_t act_min_work) {
  const PlainExperts ctx = {dtype, num_threads, w13, w2, hidden, inter, gemm_min_work};
  return moe_run_experts(dtype, x, num_tokens, hidden, inter, num_experts, weights, ids, top_k,
                         out, scratch, num_threads, act_min_work, plain_matmul, NULL, &ctx);
}

/* The experts as panels (WickExpertsPanels): expert e's slice of the packed projections. */
typedef struct {
  int dtype, num_threads;
  const WickExpertsPanels *w[2]; /* w13, w2 */
} PanelExperts;

/* Expert e's panels of projection w. */
static const char *expert_panels(const PanelExperts *c, const WickExpertsPanels *w, int e) {
  return (const char *)w->data + e * w->elements * moe_elem_size(c->dtype);
}

static int panel_matmul(const void *ctx, int proj, int e, const void *x, void *y, int64_t rows) {
  const PanelExperts *c = ctx;
  const WickExpertsPanels *w = c->w[proj];
  const char *panels = expert_panels(c, w, e);
  int status;
  if (w->pairs)
    status = wick_panel_gemm(x, w->k, (const bf16_t *)panels, NULL, y, rows, w->n, w->k,
                             c->num_threads, w->min_work_per_thread, 1);
  else
    status = wick_panel_f32_gemm(c->dtype, x, w->k, panels, NULL, y, rows, w->n, w->k,
                                 c->num_threads, w->min_work_per_thread);
  return status == -2 ? -4 : status;
}

/* Expert e's gate/up panels and SiLU-and-mul in one pass (the panel kernels' fused entry). */
static int panel_gate_up_silu(const void *ctx, int e, const void *x, void *mid, int64_t rows) {
  const PanelExperts *c = ctx;
  const WickExpertsPanels *w = c->w[0];
  const char *panels = expert_panels(c, w, e);
  int status;
  if (w->pairs)
    status = wick_panel_gemm_silu(x, w->k, (const bf16_t *)panels, mid, rows, w->n / 2, w->k,
                                  c->num_threads, w->min_work_per_thread, 1);
  else
    status = wick_panel_f32_gemm_silu(c->dtype, x, w->k, panels, mid, rows, w->n / 2, w->k,
                                      c->num_threads, w->min_work_per_thread);
  return status == -2 ? -4 : status;
}

int wick_moe_panel_experts(int dtype, const void *x, int64_t num_tokens,
                           const WickExpertsPanels *w13, const WickExpertsPanels *w2,
                           int num_experts, const float *weights, const int64_t *ids, int top_k,
                           void *out, void *scratch, int num_threads, int64_t act_min_work) {
  const int64_t hidden = w13->k, inter = w2->k;
  if (w13->n != 2 * inter || w2->n != hidden) return -3;
  if (w13->pairs != w2->pairs || (w13->pairs && dtype != 1)) return -4;
  const PanelExperts ctx = {dtype, num_threads, {w13, w2}};
  /* The fused gate/up takes I a multiple of a panel's outputs (panel_gemm.c's 16, the lanes of
   * panel_gemm_f32.c): the gate and up halves then start on a panel boundary. */
  const int64_t unit = w13->pairs ? 16 : wick_panel_f32_lanes();
  const MoEExpertGateUpSilu fused = inter % unit == 0 ? panel_gate_up_silu : NULL;
  return moe_run_experts(dtype, x, num_tokens, hidden, inter, num_experts, weights, ids, top_k,
                         out, scratch, num_threads, act_min_work, panel_matmul, fused, &ctx);
}

int wick_moe_shared_expert_add(int dtype, const void *routed, const void *gate,
                               const void *shared, void *out, int64_t num_tokens,
                               int64_t hidden) {
  for (int64_t t = 0; t < num_tokens; t++) {
    const float g = rounded(dtype, 1.f / (1.f + expf(-moe_load(dtype, gate, t))));
    for (int64_t h = 0; h < hidden; h++) {
      const int64_t i = t * hidden + h;
      const float scaled = rounded(dtype, g * moe_load(dtype, shared, i));
      moe_store(dtype, out, i, moe_load(dtype, routed, i) + scaled);
    }
  }
  return 0;
}
