/* A stack of pre-norm decoder layers in one call: RMSNorm or LayerNorm (with bias), fused
 * q/k/v (biases allowed), optional per-head q/k RMSNorm, neox rotary (a cache per layer),
 * paged attention (optional sliding window and logit soft cap, each layer in its KV cache
 * group), or DeepSeek's latent attention (mla_half: mla_attention.c), output projection,
 * optional sandwich norms (Gemma 2/3), the norm with the residual add, gated MLP (SiLU or
 * GeGLU tanh) or plain fc1 -> GELU (erf or tanh) -> fc2 with biases, or a mixture-of-experts
 * block (router, softmax top-k, routed experts, optional gated shared
 * expert: moe.c); or attention and MLP in parallel from the input norm (Phi-2: x + attn + mlp).
 *
 * Why: a batch-1 decode of SmolLM2-135M spends ~4 of its ~13 ms between the kernels, in Python
 * (module calls, tensor allocation, argument marshalling: ~125 us per layer on a 2-core Zen 4),
 * not in them. This file runs the same kernel entry points as the per-module path
 * (layer_ops.c, panel_gemm.c, panel_gemm_f32.c, gguf_gemm.c, gguf_q8.c, paged_attention.c) with
 * the same arguments, in the same order, so its results equal that path's bit for bit; only
 * the Python between them is gone. kernels/cpu/decoder_stack.py decides when it applies and
 * fills the structs of wick_stack.h (its ctypes mirrors are built from that header).
 *
 * Buffers (all [T, ...] contiguous in the activation dtype, owned by the caller):
 *   hidden_in    the embedding; read, never written
 *   normed       the attention / MLP input norms' output        [T, hidden]
 *   qkv          the fused projection                           [T, (H + 2 Hkv) D]
 *   q_normed, k_normed  q and k after their per-head norms      [T, H D], [T, Hkv D]
 *   q_rot, k_rot rotated q and k                                [T, H D], [T, Hkv D]
 *   attn         attention output                               [T, H D]
 *   proj         o_proj output                                  [T, hidden]
 *   sandwich     a sandwich norm's input or output; a parallel layer's MLP output; an MoE
 *                layer's routed experts' output beside a shared expert [T, hidden]
 *   residual_a/b the residual stream, alternating per norm (the fused norm never writes its
 *                inputs)                                        [T, hidden]
 *   gate_up      gate/up output where the MLP's SiLU is not fused [T, 2 inter] (else unused);
 *                a plain MLP's fc1 output                       [T, inter]
 *   mid          act(gate) * up, or act(fc1)                    [T, inter]
 *   segment      one GGUF segment's output before it is copied into its columns, or an
 *                act-order GPTQ linear's gathered input (every linear's k fits) [T, max N]
 *   hidden_out   the last layer's MLP output                    [T, hidden]
 *   moe_scratch  MoE layers' router logits, routing, shared expert and experts' scratch
 *                (`moe_parts`)
 *   mla_scratch  latent attention layers' q, kv_a, norms, rotated parts and attention output
 *                (`mla_parts`)
 * On return `*residual_out` says which residual buffer holds the stream before hidden_out. */

#include <stdint.h>
#include <string.h>

#include "wick_cpu.h"
#include "wick_entry.h"
#include "wick_lora.h"
#include "wick_mla.h"
#include "wick_moe.h"
#include "wick_moe_routing.h"
#include "wick_moe_wna16.h"
#include "wick_stack.h"

/* Error codes: (layer << 4) | STAGE_*, negated; the failing kernel's own code goes to
 * `status`. */
enum { STAGE_NORM = 1, STAGE_QKV, STAGE_ROTARY, STAGE_ATTN, STAGE_O, STAGE_NORM2, STAGE_MLP,
       STAGE_DOWN, STAGE_LAYOUT };

static int64_t elem_size(const WickStackStep *s) { return s->dtype == 1 ? 2 : 4; }

/* y [T, n] = x [T, k] @ W^T + bias, as the per-module path computes it. */
static int run_base_linear(const WickStackStep *s, const WickLinear *w, const void *x, void *y) {
  const int64_t m = s->num_tokens;
  switch (w->kind) {
  case LINEAR_PANELS_BF16:
    return wick_panel_gemm((const bf16_t *)x, w->k, (const bf16_t *)w->data,
                           (const bf16_t *)w->bias, (bf16_t *)y, m, w->n, w->k, s->num_threads,
                           w->min_work_per_thread, !w->hw_prefetch_only);
  case LINEAR_PANELS_F32:
    return wick_panel_f32_gemm(s->dtype, x, w->k, w->data, w->bias, y, m, w->n, w->k,
                               s->num_threads, w->min_work_per_thread);
  case LINEAR_DENSE_GEMM: /* gemm.py's gemm_linear: vdpbf16ps allowed where the build has it */
    return wick_gemm(s->dtype, x, w->k, w->data, w->bias, y, (int)m, (int)w->n, (int)w->k, 1,
                     s->num_threads, w->min_work_per_thread);
  case LINEAR_WNA16: /* wna16.py's wna16_native_linear, after WNA16Weight.apply's gather */
    if (w->perm != NULL) {
      gather_columns(elem_size(s), x, w->perm, s->segment, m, w->k);
      x = s->segment;
    }
    return wick_wna16_gemm(s->dtype, x, w->k, (const uint8_t *)w->data, w->scales, w->offsets,
                           w->bias, y, (int)m, (int)w->n, (int)w->k, w->bits, w->group_size,
                           s->num_threads, w->min_work_per_thread);
  case LINEAR_GGUF: {
    const int64_t es = elem_size(s);
    if (w->num_segments == 1) {
      const void *bias = w->bias;
      return w->segment_q8[0]
                 ? wick_gguf_q8_gemm(w->segment_type[0], s->dtype, x, w->k,
                                     (const uint8_t *)w->segment_blocks[0], bias, y, m, w->n, w->k,
                                     s->num_threads, w->min_work_per_thread)
                 : wick_gguf_gemm(w->segment_type[0], s->dtype, x, w->k,
                                  (const uint8_t *)w->segment_blocks[0], bias, y, m, w->n, w->k,
                                  s->num_threads, w->min_work_per_thread);
    }
    /* Several segments: each into `segment`, then into its columns (GGUFWeight.apply's cat);
     * a bias is refused by the Python side (it adds it after the cat, in another rounding). */
    int64_t col = 0;
    for (int i = 0; i < w->num_segments; i++) {
      const int64_t rows = w->segment_rows[i];
      const int status =
          w->segment_q8[i]
              ? wick_gguf_q8_gemm(w->segment_type[i], s->dtype, x, w->k,
                                  (const uint8_t *)w->segment_blocks[i], NULL, s->segment, m, rows,
                                  w->k, s->num_threads, w->min_work_per_thread)
              : wick_gguf_gemm(w->segment_type[i], s->dtype, x, w->k,
                               (const uint8_t *)w->segment_blocks[i], NULL, s->segment, m, rows,
                               w->k, s->num_threads, w->min_work_per_thread);
      if (status != 0) return status;
      for (int64_t t = 0; t < m; t++)
        memcpy((char *)y + (t * w->n + col) * es, (const char *)s->segment + t * rows * es,
               (size_t)(rows * es));
      col += rows;
    }
    return 0;
  }
  default:
    return -1;
  }
}

/* The base product, then the step's LoRA adapters' on their rows (the module path's
 * LoRALinear: base, then kernels/cpu/lora.py's wick_lora_add on its output). */
static int run_linear(const WickStackStep *s, const WickLinear *w, const void *x, void *y) {
  const int status = run_base_linear(s, w, x, y);
  if (status != 0 || s->lora_slots == NULL || w->lora.num_slices == 0) return status;
  return wick_lora_add(s->dtype, x, w->k, y, w->n, s->num_tokens, s->lora_slots, &w->lora,
                       s->num_threads);
}

/* mid [T, inter] = act(x @ gate^T) * (x @ up^T): SiLU fused into the panels where the layer
 * says so, else the gate/up matmul then the activation's own kernel. */
static int run_mlp_in(const WickStackStep *s, const WickLayer *l, const void *x) {
  const WickLinear *w = &l->gate_up;
  /* the layer's own (a shared expert's may differ from the dense layers') */
  const int64_t m = s->num_tokens, inter = l->down.k;
  if (l->mlp_kind == MLP_PLAIN) { /* fc1 [T, inter] (its bias in the kernel), then the GELU */
    if (l->activation != ACT_GELU && l->activation != ACT_GELU_TANH) return -1;
    const int status = run_linear(s, w, x, s->gate_up);
    if (status != 0) return status;
    return wick_gelu(s->dtype, s->gate_up, inter, s->mid, m, (int)inter,
                     l->activation == ACT_GELU_TANH, s->num_threads, s->norm_min_work);
  }
  if (l->fuse_silu) {
    if (w->kind == LINEAR_PANELS_BF16)
      return wick_panel_gemm_silu((const bf16_t *)x, w->k, (const bf16_t *)w->data,
                                  (bf16_t *)s->mid, m, inter, w->k, s->num_threads,
                                  w->min_work_per_thread, !w->hw_prefetch_only);
    if (w->kind == LINEAR_PANELS_F32)
      return wick_panel_f32_gemm_silu(s->dtype, x, w->k, w->data, s->mid, m, inter, w->k,
                                      s->num_threads, w->min_work_per_thread);
    return -1;
  }
  const int status = run_linear(s, w, x, s->gate_up);
  if (status != 0) return status;
  if (l->activation == ACT_GELU_TANH)
    return wick_gelu_tanh_and_mul(s->dtype, s->gate_up, 2 * inter, s->mid, m, (int)inter,
                                  s->num_threads, s->norm_min_work);
  return wick_silu_and_mul(s->dtype, s->gate_up, 2 * inter, s->mid, m, (int)inter,
                           s->num_threads, s->norm_min_work);
}

/* A MoE layer's scratch (s->moe_scratch), carved in this order, each part 64-byte aligned:
 * router logits [T, E] (grouped routing: wick_moe_grouped_topk's scratch instead), weights
 * [T, k] fp32, ids [T, k] int64, the shared expert's gate logit [T] and output [T, hidden],
 * then the experts' own (wick_moe_experts' or, for GPTQ / AWQ codes, wick_moe_wna16_experts').
 * Returns the bytes; fills `parts` when given. */
typedef struct {
  void *logits, *gate, *shared, *experts;
  float *weights;
  int64_t *ids;
} MoEParts;

static int64_t aligned64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

static int64_t moe_parts(const WickStackStep *s, const WickMoE *m, MoEParts *parts) {
  const int64_t T = s->num_tokens, es = elem_size(s), k = m->top_k;
  const int64_t routing =
      m->routing == MOE_ROUTING_GROUPED_TOPK
          ? wick_moe_grouped_topk_bytes(s->dtype, T, s->hidden, m->num_experts)
          : T * m->num_experts * es;
  const int64_t sizes[5] = {aligned64(routing), aligned64(T * k * 4),
                            aligned64(T * k * 8), aligned64(T * es), aligned64(T * s->hidden * es)};
  char *at = (char *)s->moe_scratch;
  void *starts[5];
  int64_t total = 0;
  for (int i = 0; i < 5; i++) {
    starts[i] = at == NULL ? NULL : at + total;
    total += sizes[i];
  }
  if (parts != NULL) {
    parts->logits = starts[0], parts->weights = (float *)starts[1];
    parts->ids = (int64_t *)starts[2], parts->gate = starts[3], parts->shared = starts[4];
    parts->experts = at + total;
  }
  if (m->experts_kind == MOE_EXPERTS_WNA16)
    return total + wick_moe_wna16_scratch_bytes(s->dtype, T, m->top_k, s->hidden, m->inter);
  return total + wick_moe_scratch_bytes(s->dtype, T, m->top_k, s->hidden, m->inter);
}

int64_t wick_stack_moe_bytes(const WickStackStep *s, const WickLayer *layer) {
  return layer->moe.num_experts > 0 ? moe_parts(s, &layer->moe, NULL) : 0;
}

static int run_mlp_in(const WickStackStep *s, const WickLayer *l, const void *x);
static void add_rows(const WickStackStep *s, const void *a, const void *b, void *y);

/* y [T, hidden] = the layer's MoE block of x (moe.c, moe_routing.c, as the CPU kernel table's
 * MoE slots run it under the modules): router, softmax top-k (or the grouped top-k router),
 * routed experts; with a shared expert its MLP (gate_up, down) and gate, then routed +
 * sigmoid(gate) * shared (MOE_SHARED_PLAIN: routed + shared). Under tensor parallelism
 * (split_shared_add) the routed and shared partial sums stay apart, in `sandwich` and y, the
 * gate logits in the scratch, for the caller's all-reduces and wick_stack_moe_shared_add. */
static int run_moe(const WickStackStep *s, const WickLayer *l, const void *x, void *y) {
  const WickMoE *m = &l->moe;
  const int64_t T = s->num_tokens;
  MoEParts p;
  moe_parts(s, m, &p);
  int status;
  if (m->routing == MOE_ROUTING_GROUPED_TOPK) {
    status = wick_moe_grouped_topk(s->dtype, x, T, s->hidden, &m->grouped, p.weights, p.ids,
                                   p.logits, s->num_threads, m->gemm_min_work);
  } else {
    status = run_linear(s, &m->router, x, p.logits);
    if (status != 0) return status;
    status = wick_moe_softmax_topk(s->dtype, p.logits, T, m->num_experts, m->top_k,
                                   m->renormalize, p.weights, p.ids);
  }
  if (status != 0) return status;
  void *routed = m->has_shared ? s->sandwich : y;
  if (m->experts_kind == MOE_EXPERTS_WNA16) /* GPTQ / AWQ codes: moe_wna16.c */
    status = wick_moe_wna16_experts(s->dtype, x, T, &m->w13_wna16, &m->w2_wna16, m->num_experts,
                                    p.weights, p.ids, m->top_k, routed, p.experts,
                                    s->num_threads, s->norm_min_work);
  else if (m->experts_kind == MOE_EXPERTS_PANELS) /* the experts' plan packed them: moe.c */
    status = wick_moe_panel_experts(s->dtype, x, T, &m->w13_panels, &m->w2_panels,
                                    m->num_experts, p.weights, p.ids, m->top_k, routed,
                                    p.experts, s->num_threads, s->norm_min_work);
  else
    status = wick_moe_experts(s->dtype, x, T, s->hidden, m->w13, m->w2, m->num_experts, m->inter,
                              p.weights, p.ids, m->top_k, routed, p.experts, s->num_threads,
                              m->gemm_min_work, s->norm_min_work);
  if (status != 0 || !m->has_shared) return status;
  const int gated = m->shared_kind == MOE_SHARED_GATED;
  if (gated) {
    status = run_linear(s, &m->shared_gate, x, p.gate);
    if (status != 0) return status;
  }
  status = run_mlp_in(s, l, x);
  if (status != 0) return status;
  if (m->split_shared_add) return run_linear(s, &l->down, s->mid, y);
  status = run_linear(s, &l->down, s->mid, p.shared);
  if (status != 0) return status;
  if (!gated) { /* DeepSeek's `routed + shared`, one add in the dtype */
    add_rows(s, routed, p.shared, y);
    return 0;
  }
  return wick_moe_shared_expert_add(s->dtype, routed, p.gate, p.shared, y, T, s->hidden);
}

int wick_stack_moe_shared_add(const WickStackStep *s, const WickLayer *layer) {
  const WickMoE *m = &layer->moe;
  if (m->num_experts == 0 || !m->has_shared) return -1;
  if (m->shared_kind == MOE_SHARED_PLAIN) {
    add_rows(s, s->sandwich, s->hidden_out, s->hidden_out);
    return 0;
  }
  MoEParts p;
  moe_parts(s, m, &p);
  return wick_moe_shared_expert_add(s->dtype, s->sandwich, p.gate, s->hidden_out, s->hidden_out,
                                    s->num_tokens, s->hidden);
}

/* y [T, n] = rms_norm(x [T, n]) * weight, rows contiguous (the module path's RMSNorm on a
 * [T, n] tensor). */
static int plain_norm(const WickStackStep *s, const void *x, const void *weight, void *y) {
  return wick_rms_norm(s->dtype, x, 1, s->hidden, 0, NULL, 1, 0, 0, weight, y, NULL,
                       s->num_tokens, (int)s->hidden, s->eps, s->num_threads, s->norm_min_work);
}

/* y [T, hidden] = the layer's norm (RMSNorm, or LayerNorm with `bias`) of x, or with a
 * residual of s = x + residual, stored into sum_out: the module path's norm modules' kernels. */
static int layer_norm_of(const WickStackStep *s, const WickLayer *l, const void *x,
                         const void *residual, const void *weight, const void *bias, void *y,
                         void *sum_out) {
  const int64_t hidden = s->hidden;
  if (l->norm_kind == NORM_LAYER)
    return wick_layer_norm(s->dtype, x, 1, hidden, 0, residual, 1, hidden, 0, weight, bias, y,
                           sum_out, s->num_tokens, (int)hidden, s->eps, s->num_threads,
                           s->norm_min_work);
  return wick_rms_norm(s->dtype, x, 1, hidden, 0, residual, 1, hidden, 0, weight, y, sum_out,
                       s->num_tokens, (int)hidden, s->eps, s->num_threads, s->norm_min_work);
}

/* y [T, hidden] = a + b, rounded to the dtype (one PyTorch add of the module path). */
static void add_rows(const WickStackStep *s, const void *a, const void *b, void *y) {
  const int64_t n = s->num_tokens * s->hidden;
  if (s->dtype == 1) {
    const bf16_t *x = (const bf16_t *)a, *z = (const bf16_t *)b;
    bf16_t *out = (bf16_t *)y;
    for (int64_t i = 0; i < n; i++) out[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(z[i]));
  } else {
    const float *x = (const float *)a, *z = (const float *)b;
    float *out = (float *)y;
    for (int64_t i = 0; i < n; i++) out[i] = x[i] + z[i];
  }
}

/* The per-head norm of `heads` heads of D at `x` (token stride `stride`, head stride D) into
 * `out` [T, heads D]: the module path's RMSNorm on a [T, heads, D] view of the fused qkv
 * (layer_ops.py's row layout: `heads` rows per token, `stride` apart). */
static int head_norm(const WickStackStep *s, const void *x, int64_t stride, int64_t heads,
                     const void *weight, void *out) {
  const int64_t D = s->head_dim;
  return wick_rms_norm(s->dtype, x, heads, stride, D, NULL, 1, 0, 0, weight, out, NULL,
                       s->num_tokens * heads, (int)D, s->eps, s->num_threads, s->norm_min_work);
}

static int stack_layers(WickStackStep *s, const WickLayer *layers, int num_layers,
                        int *residual_out);

int wick_decoder_stack(WickStackStep *s, const WickLayer *layers, int num_layers,
                       int *residual_out) {
  s->status = 0;
  return stack_layers(s, layers, num_layers, residual_out);
}

/* Each stage's call: on failure, keep its code in s->status and return the stage's error. */
#define STAGE(call, code)                                                                      \
  do {                                                                                         \
    const int status_ = (call);                                                                \
    if (status_ != 0) {                                                                        \
      s->status = status_;                                                                     \
      return err - (code);                                                                     \
    }                                                                                          \
  } while (0)

/* Attention of one layer: store k_rot and v (a view of qkv) into its cache, attend into attn;
 * the plain entry point, or the one with the window and soft cap where the layer has either
 * (as the module path's cpu backend chooses). */
static int attend(const WickStackStep *s, const WickLayer *l, const char *qkv) {
  const int64_t D = s->head_dim, H = s->num_heads, Hkv = s->num_kv_heads;
  const int64_t qkv_n = (H + 2 * Hkv) * D, es = elem_size(s);
  const int sliding = l->kv_group == 1;
  const int64_t *slots = sliding ? s->sliding_slot_mapping : s->slot_mapping;
  const int32_t *tables = sliding ? s->sliding_block_tables : s->block_tables;
  const int64_t bt_stride = sliding ? s->sliding_bt_stride : s->bt_stride;
  if (slots == NULL || tables == NULL) return -100;
  if (l->sliding_window > 0 || l->logits_soft_cap > 0.f || l->kv_fixed_scale > 0.f)
    return wick_paged_attention_windowed(
        s->dtype, s->q_rot, l->k_cache, l->v_cache, s->k_rot, qkv + (H + Hkv) * D * es, Hkv * D,
        qkv_n, slots, l->num_slots, tables, bt_stride, s->query_start_loc, s->seq_lens, s->attn,
        s->num_seqs, (int)H, (int)Hkv, (int)D, s->block_size, s->scale, s->num_threads,
        s->attn_min_work, s->kv_format, l->k_scales, l->v_scales, l->sliding_window,
        l->logits_soft_cap, l->kv_fixed_scale);
  return wick_paged_attention(s->dtype, s->q_rot, l->k_cache, l->v_cache, s->k_rot,
                              qkv + (H + Hkv) * D * es, Hkv * D, qkv_n, slots, l->num_slots,
                              tables, bt_stride, s->query_start_loc, s->seq_lens, s->attn,
                              s->num_seqs, (int)H, (int)Hkv, (int)D, s->block_size, s->scale,
                              s->num_threads, s->attn_min_work, s->kv_format, l->k_scales,
                              l->v_scales);
}

/* An MLA layer's scratch (s->mla_scratch), carved in this order, each part 64-byte aligned
 * and [T, ...] in the dtype: q_a [qr], its norm [qr], q [H (Dn + R)], kv_a [L + R], the
 * latent's norm [L], rotated q_pe [H R] and k_pe [R], attention output [H Dv]. */
typedef struct {
  void *q_a, *q_a_normed, *q, *kv_a, *latent, *q_pe, *k_pe, *out;
} MLAParts;

static int64_t mla_parts(const WickStackStep *s, const WickMLA *m, MLAParts *parts) {
  const int64_t T = s->num_tokens, es = elem_size(s), H = s->num_heads;
  const int64_t qr = m->q_lora_rank, L = m->kv_lora_rank, R = m->qk_rope_head_dim;
  const int64_t widths[8] = {qr, qr, H * (m->qk_nope_head_dim + R), L + R, L, H * R, R,
                             H * m->v_head_dim};
  char *at = (char *)s->mla_scratch;
  void *starts[8];
  int64_t total = 0;
  for (int i = 0; i < 8; i++) {
    starts[i] = at == NULL ? NULL : at + total;
    total += aligned64(T * widths[i] * es);
  }
  if (parts != NULL) {
    parts->q_a = starts[0], parts->q_a_normed = starts[1], parts->q = starts[2];
    parts->kv_a = starts[3], parts->latent = starts[4], parts->q_pe = starts[5];
    parts->k_pe = starts[6], parts->out = starts[7];
  }
  return total;
}

int64_t wick_stack_mla_bytes(const WickStackStep *s, const WickLayer *layer) {
  return layer->mla.kv_lora_rank > 0 ? mla_parts(s, &layer->mla, NULL) : 0;
}

/* y [T, n] = rms_norm(x [T, n], rows x_stride apart) * weight: the module path's RMSNorm of a
 * [T, n] tensor or view. */
static int rows_norm(const WickStackStep *s, const void *x, int64_t x_stride, int64_t n,
                     const void *weight, float eps, void *y) {
  return wick_rms_norm(s->dtype, x, 1, x_stride, 0, NULL, 1, 0, 0, weight, y, NULL,
                       s->num_tokens, (int)n, eps, s->num_threads, s->norm_min_work);
}

/* The attention half of an MLA layer from s->normed to s->proj, in the order (and with the
 * arguments) of models/deepseek.py's DeepseekAttention on the cpu backend: q (through its LoRA
 * and norm), kv_a, the latent's norm, rotary of q_pe and k_pe, mla_attention.c (store, then
 * attend), o. */
static int mla_half(WickStackStep *s, const WickLayer *l, const int err) {
  const WickMLA *m = &l->mla;
  const int64_t T = s->num_tokens, H = s->num_heads, es = elem_size(s);
  const int64_t L = m->kv_lora_rank, R = m->qk_rope_head_dim, Dn = m->qk_nope_head_dim;
  const int64_t q_n = H * (Dn + R);
  if (s->mla_scratch == NULL || s->slot_mapping == NULL || s->block_tables == NULL)
    return err - STAGE_LAYOUT;
  MLAParts p;
  mla_parts(s, m, &p);
  const void *q_in = s->normed;
  if (m->q_lora_rank > 0) {
    STAGE(run_linear(s, &m->q_a, s->normed, p.q_a), STAGE_QKV);
    STAGE(rows_norm(s, p.q_a, m->q_lora_rank, m->q_lora_rank, m->q_a_norm, m->q_a_eps,
                    p.q_a_normed),
          STAGE_NORM);
    q_in = p.q_a_normed;
  }
  STAGE(run_linear(s, &m->q_b, q_in, p.q), STAGE_QKV);
  STAGE(run_linear(s, &l->qkv, s->normed, p.kv_a), STAGE_QKV); /* [latent, k_pe] */
  STAGE(rows_norm(s, p.kv_a, L + R, L, m->kv_a_norm, m->kv_a_eps, p.latent), STAGE_NORM);
  /* q_pe: [T, H, R] of q (token stride q_n, head stride Dn + R); k_pe: one head of kv_a */
  STAGE(wick_rotary_neox(s->dtype, s->positions, T, l->cos_sin, s->max_position,
                         (const char *)p.q + Dn * es, q_n, Dn + R, p.q_pe,
                         (const char *)p.kv_a + L * es, L + R, R, p.k_pe, (int)H, 1, (int)R,
                         (int)R, s->num_threads, s->norm_min_work),
        STAGE_ROTARY);
  STAGE(wick_mla_attention(s->dtype, p.q, q_n, Dn + R, p.q_pe, p.latent, L, p.k_pe, R,
                           m->w_kv_b, l->k_cache, s->slot_mapping, l->num_slots,
                           s->block_tables, s->bt_stride, s->query_start_loc, s->seq_lens,
                           p.out, s->num_seqs, (int)H, (int)Dn, (int)R, m->v_head_dim, (int)L,
                           s->block_size, s->scale, s->num_threads, s->attn_min_work),
        STAGE_ATTN);
  STAGE(run_linear(s, &l->o, p.out, s->proj), STAGE_O);
  return 0;
}

/* The attention half of a q/k/v layer from s->normed to s->proj: 2. q | k | v; 3. the per-head
 * q/k norms where the layer has them, then rotary on q and k (views of qkv, token stride qkv_n,
 * head stride D, or the norms' outputs); 4. k_rot and v into the cache, attention; 5. the
 * output projection (a tensor-parallel rank's partial sum: the caller all-reduces). */
static int attention_half(WickStackStep *s, const WickLayer *l, const int err) {
  const int64_t T = s->num_tokens, D = s->head_dim, H = s->num_heads, Hkv = s->num_kv_heads;
  const int64_t qkv_n = (H + 2 * Hkv) * D, es = elem_size(s);
  STAGE(run_linear(s, &l->qkv, s->normed, s->qkv), STAGE_QKV);
  const char *qkv = (const char *)s->qkv;
  const void *q = qkv, *k = qkv + H * D * es;
  int64_t q_stride = qkv_n, k_stride = qkv_n;
  if (l->q_norm != NULL) {
    STAGE(head_norm(s, q, qkv_n, H, l->q_norm, s->q_normed), STAGE_NORM);
    STAGE(head_norm(s, k, qkv_n, Hkv, l->k_norm, s->k_normed), STAGE_NORM);
    q = s->q_normed, k = s->k_normed, q_stride = H * D, k_stride = Hkv * D;
  }
  STAGE(wick_rotary_neox(s->dtype, s->positions, T, l->cos_sin, s->max_position, q, q_stride,
                         D, s->q_rot, k, k_stride, D, s->k_rot, (int)H, (int)Hkv, (int)D,
                         l->rotary_dim, s->num_threads, s->norm_min_work),
        STAGE_ROTARY);
  STAGE(attend(s, l, qkv), STAGE_ATTN);
  STAGE(run_linear(s, &l->o, s->attn, s->proj), STAGE_O);
  return 0;
}

static int stack_layers(WickStackStep *s, const WickLayer *layers, int num_layers,
                        int *residual_out) {
  const int64_t T = s->num_tokens, hidden = s->hidden;
  const int64_t qkv_n = (s->num_heads + 2 * s->num_kv_heads) * s->head_dim;
  if (T <= 0 || num_layers <= 0 || s->first_layer < 0 || s->last_layer >= num_layers ||
      s->first_layer > s->last_layer ||
      (s->first_layer == s->last_layer && s->first_half > s->last_half))
    return -STAGE_LAYOUT;
  /* The stream as the previous call left it: the residual (NULL before layer 0's input norm,
   * where the input itself is the stream) and the buffer the other residual add writes. */
  const void *residual = s->residual_state == 1   ? s->residual_a
                         : s->residual_state == 2 ? s->residual_b
                         : s->residual_state == 3 ? s->hidden_in
                                                  : NULL;
  void *next_residual = residual == s->residual_a ? s->residual_b : s->residual_a;
  for (int i = s->first_layer; i <= s->last_layer; i++) {
    const WickLayer *l = &layers[i];
    const int err = -(i << 4);
    const int has_mlp = l->moe.num_experts == 0 || l->moe.has_shared;
    const int mla = l->mla.kv_lora_rank > 0;
    if ((!mla && l->qkv.n != qkv_n) || l->o.n != hidden || (has_mlp && l->down.n != hidden))
      return err - STAGE_LAYOUT;
    const int from = i == s->first_layer ? s->first_half : 0;
    const int to = i == s->last_layer ? s->last_half : 1;
    if (from == 0) {
      /* this layer's input: the embedding at layer 0, else the last MLP output */
      const void *x = i == 0 ? s->hidden_in : s->hidden_out;
      /* 1. input norm (+ the residual add from layer 1 on) */
      if (residual == NULL) {
        STAGE(layer_norm_of(s, l, x, NULL, l->input_norm, l->input_norm_bias, s->normed, NULL),
              STAGE_NORM);
        residual = x;
      } else {
        STAGE(layer_norm_of(s, l, x, residual, l->input_norm, l->input_norm_bias, s->normed,
                            next_residual),
              STAGE_NORM);
        residual = next_residual;
        next_residual = residual == s->residual_a ? s->residual_b : s->residual_a;
      }
      /* 2-5. attention, from s->normed to s->proj */
      const int status = mla ? mla_half(s, l, err) : attention_half(s, l, err);
      if (status != 0) return status;
    }
    if (to == 1 && l->parallel_residual) {
      /* 6-8. parallel attention + MLP (Phi-2): the MLP of the input norm's output (normed,
       * untouched since), the layer's output attn + mlp; the residual stays the layer's input
       * (the next norm adds it: (attn + mlp) + x, the module path's order). Under tensor
       * parallelism (split_parallel_add) the MLP's partial sum alone, for the caller. */
      STAGE(run_mlp_in(s, l, s->normed), STAGE_MLP);
      if (l->split_parallel_add) {
        STAGE(run_linear(s, &l->down, s->mid, s->hidden_out), STAGE_DOWN);
        continue;
      }
      STAGE(run_linear(s, &l->down, s->mid, s->sandwich), STAGE_DOWN);
      add_rows(s, s->proj, s->sandwich, s->hidden_out);
    } else if (to == 1) {
      /* 6. the attention output's sandwich norm, residual add + the MLP's input norm */
      const void *attn_out = s->proj;
      if (l->attn_out_norm != NULL) {
        STAGE(plain_norm(s, s->proj, l->attn_out_norm, s->sandwich), STAGE_NORM2);
        attn_out = s->sandwich;
      }
      STAGE(layer_norm_of(s, l, attn_out, residual, l->post_attention_norm,
                          l->post_attention_norm_bias, s->normed, next_residual),
            STAGE_NORM2);
      residual = next_residual;
      next_residual = residual == s->residual_a ? s->residual_b : s->residual_a;
      /* 7-8. the MLP (its sandwich norm: on the reduced output, by the next half's caller
       * under tensor parallelism, here on one rank), or the MoE block (a rank's partial sums
       * under tensor parallelism: run_moe) */
      if (l->moe.num_experts > 0) {
        STAGE(run_moe(s, l, s->normed, s->hidden_out), STAGE_MLP);
        continue;
      }
      STAGE(run_mlp_in(s, l, s->normed), STAGE_MLP);
      if (l->mlp_out_norm != NULL) {
        STAGE(run_linear(s, &l->down, s->mid, s->sandwich), STAGE_DOWN);
        STAGE(plain_norm(s, s->sandwich, l->mlp_out_norm, s->hidden_out), STAGE_DOWN);
      } else {
        STAGE(run_linear(s, &l->down, s->mid, s->hidden_out), STAGE_DOWN);
      }
    }
  }
  s->residual_state = residual == NULL          ? 0
                      : residual == s->residual_a ? 1
                      : residual == s->residual_b ? 2
                                                  : 3;
  *residual_out = residual == s->residual_a ? 0 : 1;
  return 0;
}
