/* A stack of pre-norm decoder layers (Llama's: RMSNorm, fused q/k/v, neox rotary, paged
 * attention, output projection, RMSNorm with the residual add, SwiGLU MLP) in one call.
 *
 * Why: a batch-1 decode of SmolLM2-135M spends ~4 of its ~13 ms between the kernels, in Python
 * (module calls, tensor allocation, argument marshalling: ~125 us per layer on a 2-core Zen 4),
 * not in them. This file runs the same kernel entry points as the per-module path
 * (layer_ops.c, panel_gemm.c, panel_gemm_f32.c, gguf_gemm.c, gguf_q8.c, paged_attention.c) with
 * the same arguments, in the same order, so its results equal that path's bit for bit; only
 * the Python between them is gone. kernels/cpu/decoder_stack.py decides when it applies and
 * fills the structs below (their layout is mirrored there with ctypes).
 *
 * Buffers (all [T, ...] contiguous in the activation dtype, owned by the caller):
 *   hidden_in    the embedding; read, never written
 *   normed       the attention / MLP input norms' output        [T, hidden]
 *   qkv          the fused projection                           [T, (H + 2 Hkv) D]
 *   q_rot, k_rot rotated q and k                                [T, H D], [T, Hkv D]
 *   attn         attention output                               [T, H D]
 *   proj         o_proj output                                  [T, hidden]
 *   residual_a/b the residual stream, alternating per norm (the fused norm never writes its
 *                inputs)                                        [T, hidden]
 *   gate_up      gate/up output where the MLP's SiLU is not fused [T, 2 inter] (else unused)
 *   mid          silu(gate) * up                                [T, inter]
 *   segment      one GGUF segment's output before it is copied into its columns [T, max N]
 *   hidden_out   the last layer's MLP output                    [T, hidden]
 * On return `*residual_out` says which residual buffer holds the stream before hidden_out. */

#include <stdint.h>
#include <string.h>

#include "wick_cpu.h"
#include "wick_entry.h"

/* How a linear layer multiplies (decoder_stack.py's LINEAR_* values). */
enum {
  LINEAR_PANELS_BF16 = 0, /* panel_gemm.c's pair layout */
  LINEAR_PANELS_F32 = 1,  /* panel_gemm_f32.c's lanes layout, fp32 or bf16 activations */
  LINEAR_GGUF = 2         /* per segment: gguf_q8.c (segment_q8) or gguf_gemm.c */
};
#define MAX_SEGMENTS 4

typedef struct {
  int32_t kind;     /* LINEAR_* */
  int32_t num_segments; /* GGUF kinds: row segments of W, each its own ggml type */
  int64_t n, k;     /* W [n, k] */
  const void *data; /* the panels (panel kinds) */
  const void *bias; /* [n] in the activation dtype, or NULL */
  int64_t min_work_per_thread;
  int32_t segment_type[MAX_SEGMENTS];
  int64_t segment_rows[MAX_SEGMENTS];
  const void *segment_blocks[MAX_SEGMENTS];
  /* Per segment: whether it runs the int8 kernel (gguf_q8.c) or the float one (gguf_gemm.c). */
  int32_t segment_q8[MAX_SEGMENTS];
} WickLinear;

typedef struct {
  const void *input_norm;          /* [hidden] */
  const void *post_attention_norm; /* [hidden] */
  WickLinear qkv, o, gate_up, down;
  int32_t fuse_silu;               /* gate_up runs the panels' fused SiLU-and-mul */
  void *k_cache, *v_cache;         /* [num_blocks, block_size, Hkv, D] */
  float *k_scales, *v_scales;      /* quantized caches: [num_blocks, block_size, Hkv], else NULL */
} WickLayer;

typedef struct {
  int32_t dtype; /* 0 fp32, 1 bf16 */
  int32_t num_threads;
  int64_t num_tokens, hidden, num_heads, num_kv_heads, head_dim, intermediate;
  float eps, scale;
  /* rotary */
  const int64_t *positions;
  const void *cos_sin;
  int64_t max_position;
  /* attention */
  const int64_t *slot_mapping;
  int64_t num_slots;
  const int32_t *block_tables;
  int64_t bt_stride;
  const int32_t *query_start_loc, *seq_lens;
  int32_t num_seqs, block_size, kv_format;
  int32_t status; /* out: the failing kernel's own return code (0 when none failed) */
  /* threads per kind of kernel (the per-module path's defaults) */
  int64_t norm_min_work, attn_min_work;
  /* buffers (see the top of the file) */
  const void *hidden_in;
  void *normed, *qkv, *q_rot, *k_rot, *attn, *proj, *residual_a, *residual_b, *gate_up, *mid,
      *segment, *hidden_out;
} WickStackStep;

/* Error codes: (layer << 4) | STAGE_*, negated; the failing kernel's own code goes to
 * `status`. */
enum { STAGE_NORM = 1, STAGE_QKV, STAGE_ROTARY, STAGE_ATTN, STAGE_O, STAGE_NORM2, STAGE_MLP,
       STAGE_DOWN, STAGE_LAYOUT };

static int64_t elem_size(const WickStackStep *s) { return s->dtype == 1 ? 2 : 4; }

/* y [T, n] = x [T, k] @ W^T + bias, as the per-module path computes it. */
static int run_linear(const WickStackStep *s, const WickLinear *w, const void *x, void *y) {
  const int64_t m = s->num_tokens;
  switch (w->kind) {
  case LINEAR_PANELS_BF16:
    return wick_panel_gemm((const bf16_t *)x, w->k, (const bf16_t *)w->data,
                           (const bf16_t *)w->bias, (bf16_t *)y, m, w->n, w->k, s->num_threads,
                           w->min_work_per_thread);
  case LINEAR_PANELS_F32:
    return wick_panel_f32_gemm(s->dtype, x, w->k, w->data, w->bias, y, m, w->n, w->k,
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

/* mid [T, inter] = silu(x @ gate^T) * (x @ up^T). */
static int run_mlp_in(const WickStackStep *s, const WickLayer *l, const void *x) {
  const WickLinear *w = &l->gate_up;
  const int64_t m = s->num_tokens, inter = s->intermediate;
  if (l->fuse_silu) {
    if (w->kind == LINEAR_PANELS_BF16)
      return wick_panel_gemm_silu((const bf16_t *)x, w->k, (const bf16_t *)w->data,
                                  (bf16_t *)s->mid, m, inter, w->k, s->num_threads,
                                  w->min_work_per_thread);
    if (w->kind == LINEAR_PANELS_F32)
      return wick_panel_f32_gemm_silu(s->dtype, x, w->k, w->data, s->mid, m, inter, w->k,
                                      s->num_threads, w->min_work_per_thread);
    return -1;
  }
  const int status = run_linear(s, w, x, s->gate_up);
  if (status != 0) return status;
  return wick_silu_and_mul(s->dtype, s->gate_up, 2 * inter, s->mid, m, (int)inter,
                           s->num_threads, s->norm_min_work);
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

static int stack_layers(WickStackStep *s, const WickLayer *layers, int num_layers,
                        int *residual_out) {
  const int64_t T = s->num_tokens, hidden = s->hidden, D = s->head_dim;
  const int64_t H = s->num_heads, Hkv = s->num_kv_heads, qkv_n = (H + 2 * Hkv) * D;
  const int64_t es = elem_size(s);
  if (T <= 0 || num_layers <= 0) return -STAGE_LAYOUT;
  const void *x = s->hidden_in; /* this layer's input: the embedding, then the MLP output */
  const void *residual = NULL;  /* the stream before x; NULL at layer 0 (it is x itself) */
  void *next_residual = s->residual_a;
  for (int i = 0; i < num_layers; i++) {
    const WickLayer *l = &layers[i];
    const int err = -(i << 4);
    if (l->qkv.n != qkv_n || l->o.n != hidden || l->down.n != hidden) return err - STAGE_LAYOUT;
    /* 1. input norm (+ the residual add from layer 1 on) */
    if (residual == NULL) {
      STAGE(wick_rms_norm(s->dtype, x, 1, hidden, 0, NULL, 1, 0, 0, l->input_norm, s->normed,
                          NULL, T, (int)hidden, s->eps, s->num_threads, s->norm_min_work),
            STAGE_NORM);
      residual = x;
    } else {
      STAGE(wick_rms_norm(s->dtype, x, 1, hidden, 0, residual, 1, hidden, 0, l->input_norm,
                          s->normed, next_residual, T, (int)hidden, s->eps, s->num_threads,
                          s->norm_min_work),
            STAGE_NORM);
      residual = next_residual;
      next_residual = residual == s->residual_a ? s->residual_b : s->residual_a;
    }
    /* 2. q | k | v */
    STAGE(run_linear(s, &l->qkv, s->normed, s->qkv), STAGE_QKV);
    /* 3. rotary on the q and k views of qkv (token stride qkv_n, head stride D) */
    const char *qkv = (const char *)s->qkv;
    STAGE(wick_rotary_neox(s->dtype, s->positions, T, s->cos_sin, s->max_position, qkv, qkv_n, D,
                           s->q_rot, qkv + H * D * es, qkv_n, D, s->k_rot, (int)H, (int)Hkv,
                           (int)D, s->num_threads, s->norm_min_work),
          STAGE_ROTARY);
    /* 4. store k_rot and v (a view of qkv) into the cache, attend */
    STAGE(wick_paged_attention(s->dtype, s->q_rot, l->k_cache, l->v_cache, s->k_rot,
                               qkv + (H + Hkv) * D * es, Hkv * D, qkv_n, s->slot_mapping,
                               s->num_slots, s->block_tables, s->bt_stride, s->query_start_loc,
                               s->seq_lens, s->attn, s->num_seqs, (int)H, (int)Hkv, (int)D,
                               s->block_size, s->scale, s->num_threads, s->attn_min_work,
                               s->kv_format, l->k_scales, l->v_scales),
          STAGE_ATTN);
    /* 5. output projection */
    STAGE(run_linear(s, &l->o, s->attn, s->proj), STAGE_O);
    /* 6. residual add + the MLP's input norm */
    STAGE(wick_rms_norm(s->dtype, s->proj, 1, hidden, 0, residual, 1, hidden, 0,
                        l->post_attention_norm, s->normed, next_residual, T, (int)hidden, s->eps,
                        s->num_threads, s->norm_min_work),
          STAGE_NORM2);
    residual = next_residual;
    next_residual = residual == s->residual_a ? s->residual_b : s->residual_a;
    /* 7-8. the MLP */
    STAGE(run_mlp_in(s, l, s->normed), STAGE_MLP);
    STAGE(run_linear(s, &l->down, s->mid, s->hidden_out), STAGE_DOWN);
    x = s->hidden_out;
  }
  *residual_out = residual == s->residual_a ? 0 : 1;
  return 0;
}
