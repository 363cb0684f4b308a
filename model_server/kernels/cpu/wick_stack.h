/* The structs of wick_decoder_stack (decoder_stack.c), declared once: decoder_stack.c includes
 * this header, and the Python side builds its ctypes mirrors of them from it at load
 * (kernels/cpu/abi.py parses it), so a field added here reaches both.
 *
 * Every field must also be listed in abi_layout.c's table: the loader compares the compiled
 * sizeof and offsetof of each field there with the ctypes structures', and refuses the library
 * (naming the struct and field) when they differ or a field is missing from the table.
 *
 * abi.py parses a C subset: typedef'd structs of fields of the stdint/int/float/double/char
 * types, typedefs (bf16_t), other structs of this header by their typedef name, pointers,
 * `const`, and arrays whose size is a number, a #define or an enum constant. No unions,
 * bit-fields, function pointers or declarations under #if. */
#ifndef WICK_STACK_H
#define WICK_STACK_H

#include <stdint.h>

#include "wick_cpu.h"
#include "wick_lora.h"
#include "wick_moe.h"
#include "wick_moe_routing.h"
#include "wick_moe_wna16.h"

/* How a linear layer multiplies (decoder_stack.py's LINEAR_* values). */
enum {
  LINEAR_PANELS_BF16 = 0, /* panel_gemm.c's pair layout */
  LINEAR_PANELS_F32 = 1,  /* panel_gemm_f32.c's lanes layout, fp32 or bf16 activations */
  LINEAR_GGUF = 2,        /* per segment: gguf_q8.c (segment_q8) or gguf_gemm.c */
  LINEAR_DENSE_GEMM = 3,  /* gemm.c's skinny matmul on the dense weight (`data`: W [n, k]) */
  LINEAR_WNA16 = 4        /* wna16_gemm.c on GPTQ/AWQ codes (`data`) with their scales, offsets */
};
#define MAX_SEGMENTS 4
/* What a WickMoE's routed experts hold (WickMoE.experts_kind; decoder_stack.py's values). */
enum { MOE_EXPERTS_FLOAT = 0, MOE_EXPERTS_WNA16 = 1, MOE_EXPERTS_PANELS = 2 };
/* How a WickMoE routes (WickMoE.routing) and adds its shared expert (WickMoE.shared_kind). */
enum { MOE_ROUTING_SOFTMAX_TOPK = 0, MOE_ROUTING_GROUPED_TOPK = 1 };
enum { MOE_SHARED_GATED = 0, MOE_SHARED_PLAIN = 1 };

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
  /* LINEAR_WNA16: scales and offsets [n, groups] fp32, 4 or 8 bits per code, group size */
  const float *scales, *offsets;
  int32_t bits, group_size;
  /* LINEAR_WNA16 act-order: stored column i of W is input feature perm[i] [k] (NULL: in input
   * order); x's columns are gathered in that order into the step's `segment` first. */
  const int64_t *perm;
  /* LINEAR_PANELS_BF16: 1 leaves W's panel streams to the hardware prefetcher (the plan's
   * native_panels_hwpf at this row bucket), 0 prefetches them in software (native_panels). */
  int32_t hw_prefetch_only;
  /* The LoRA adapters' slots on this layer (lora.num_slices 0: none), added after the base
   * product to the rows of WickStackStep.lora_slots (wick_lora.h). */
  WickLoRA lora;
} WickLinear;

/* A mixture-of-experts block in place of the MLP (num_experts > 0; moe.c's calls, in the order
 * the modules run them): router logits, softmax top-k (or DeepSeek's grouped top-k on fp32
 * logits: moe_routing.c), the routed experts; with a shared expert the layer's gate_up/down MLP
 * of the same input, added scaled by sigmoid(shared_gate(x)) (Qwen2-MoE) or as it is
 * (DeepSeek: shared_kind). The experts' weights are float, in the activation dtype, or GPTQ /
 * AWQ codes (experts_kind). */
typedef struct {
  int32_t num_experts, top_k, renormalize, has_shared;
  /* Tensor parallelism with a shared expert (each rank holds a slice of every expert's I and
   * of the shared expert's): the half stops before the add, leaving the routed experts' partial
   * sum in `sandwich` and the shared expert's in hidden_out for the caller to all-reduce (as
   * FusedMoE and the shared expert's down projection do), then wick_stack_moe_shared_add. */
  int32_t split_shared_add;
  int64_t inter;                /* each expert's intermediate size I (this rank's slice) */
  const void *w13, *w2;         /* [E, 2I, hidden], [E, hidden, I] */
  WickLinear router;            /* [E, hidden] */
  WickLinear shared_gate;       /* [1, hidden] (has_shared) */
  int64_t gemm_min_work;        /* the experts' matmuls' (gemm.py's MIN_WORK_PER_THREAD) */
  /* MOE_EXPERTS_FLOAT: w13, w2 above (moe.c); MOE_EXPERTS_WNA16: GPTQ / AWQ codes, w13_wna16
   * and w2_wna16 (moe_wna16.c; w13 and w2 unused); MOE_EXPERTS_PANELS: float experts packed
   * into panels by the experts' plan (kernels/cpu/experts_plan.py), w13_panels and w2_panels
   * (moe.c's wick_moe_panel_experts; w13 and w2 unused). */
  int32_t experts_kind;
  WickExpertsWNA16 w13_wna16, w2_wna16;
  WickExpertsPanels w13_panels, w2_panels;
  /* MOE_ROUTING_SOFTMAX_TOPK: `router` then wick_moe_softmax_topk (renormalize);
   * MOE_ROUTING_GROUPED_TOPK: wick_moe_grouped_topk with `grouped` (`router` unused). */
  int32_t routing;
  WickGroupedTopk grouped;
  int32_t shared_kind; /* MOE_SHARED_* (has_shared); MOE_SHARED_PLAIN: no shared_gate */
} WickMoE;

/* Multi-head latent attention (DeepSeek) in place of the q/k/v attention (kv_lora_rank > 0):
 * q = q_b(RMSNorm(q_a(x))) (q_lora_rank 0: q_b is q_proj of x), [latent, k_pe] = the layer's
 * qkv (kv_a_proj_with_mqa [L + R, hidden]), RMSNorm of the latent, neox rotary of q's rope
 * dims and k_pe (the layer's cos_sin, rotary_dim R), then mla_attention.c (the latents stored
 * in the layer's k_cache [blocks, block_size, L + R]) and the layer's o. Buffers:
 * `mla_scratch` (wick_stack_mla_bytes). */
typedef struct {
  int32_t kv_lora_rank, q_lora_rank;
  int32_t qk_nope_head_dim, qk_rope_head_dim, v_head_dim;
  float q_a_eps, kv_a_eps;
  WickLinear q_a, q_b;              /* q_a_proj (q_lora_rank > 0); q_b_proj or q_proj */
  const void *q_a_norm, *kv_a_norm; /* [q_lora_rank], [L] */
  const void *w_kv_b;               /* [H (Dn + Dv), L] */
} WickMLA;

/* The MLP's activation (WickLayer.activation): ACT_GELU is the exact (erf) one. */
enum { ACT_SILU = 0, ACT_GELU_TANH = 1, ACT_GELU = 2 };
/* The layer's norms (WickLayer.norm_kind) and MLP (WickLayer.mlp_kind). */
enum { NORM_RMS = 0, NORM_LAYER = 1 };
enum { MLP_GATED = 0, MLP_PLAIN = 1 };

typedef struct {
  const void *input_norm;          /* [hidden] */
  const void *post_attention_norm; /* [hidden]: the norm before the MLP (HF's name) */
  /* Sandwich norms (Gemma 2/3, GLM-4), or NULL: on the attention output before the residual
   * add, and on the MLP output. */
  const void *attn_out_norm, *mlp_out_norm; /* [hidden] */
  const void *q_norm, *k_norm;     /* per-head RMSNorm of q and k before rotary [D], or NULL */
  const void *cos_sin;             /* this layer's rotary cache [max_position, rotary_dim] */
  int32_t rotary_dim;              /* the leading dims of a head that rotate (<= D, even) */
  WickLinear qkv, o, gate_up, down;
  int32_t fuse_silu;               /* gate_up runs the panels' fused SiLU-and-mul */
  int32_t activation;              /* ACT_*, when not fused */
  int32_t sliding_window;          /* keys in (p - W, p] only; 0: full attention */
  float logits_soft_cap;           /* scores s -> c tanh(s / c); 0: none */
  int32_t kv_group;                /* 0: the step's slots and block tables; 1: the sliding ones */
  int64_t num_slots;               /* slots of this layer's cache (num_blocks * block_size) */
  void *k_cache, *v_cache;         /* [num_blocks, block_size, Hkv, D] */
  float *k_scales, *v_scales;      /* quantized caches: [num_blocks, block_size, Hkv], else NULL */
  float kv_fixed_scale;            /* quantized caches: every stored row's static scale; 0: own */
  /* LayerNorm families (Phi-2, StableLM, StarCoder2). NORM_LAYER: input_norm and
   * post_attention_norm are LayerNorms with these biases (NULL: none); sandwich norms stay
   * RMSNorm (no family mixes them). */
  int32_t norm_kind;               /* NORM_* */
  const void *input_norm_bias, *post_attention_norm_bias; /* [hidden], or NULL */
  /* Attention and MLP both from the input norm's output (post_attention_norm unused): the
   * layer's output is attn + mlp (rounded), added to the residual by the next norm. */
  int32_t parallel_residual;
  /* Tensor parallelism (parallel_residual): the half stops before the add, leaving the MLP's
   * partial sum in hidden_out for the caller to all-reduce, add its bias and then the reduced
   * attention output (`proj`) to, as the modules do (each RowParallelLinear reduces apart). */
  int32_t split_parallel_add;
  /* MLP_PLAIN: gate_up is fc1 [inter, hidden] (bias allowed), then `activation` alone. */
  int32_t mlp_kind;                /* MLP_* */
  /* Routed experts instead of the MLP (moe.num_experts 0: none); gate_up/down then hold the
   * shared expert, if any. */
  WickMoE moe;
  /* Latent attention instead of q/k/v (mla.kv_lora_rank 0: none). */
  WickMLA mla;
} WickLayer;

typedef struct {
  int32_t dtype; /* 0 fp32, 1 bf16 */
  int32_t num_threads;
  int64_t num_tokens, hidden, num_heads, num_kv_heads, head_dim, intermediate;
  float eps, scale;
  /* rotary (each layer's cache has max_position rows) */
  const int64_t *positions;
  int64_t max_position;
  /* attention: KV cache group 0's slots and block tables, and group 1's (sliding-window
   * layers with a pool of their own; NULL when there is none) */
  const int64_t *slot_mapping;
  const int32_t *block_tables;
  int64_t bt_stride;
  const int64_t *sliding_slot_mapping;
  const int32_t *sliding_block_tables;
  int64_t sliding_bt_stride;
  const int32_t *query_start_loc, *seq_lens;
  int32_t num_seqs, block_size, kv_format;
  int32_t status; /* out: the failing kernel's own return code (0 when none failed) */
  /* The part of the stack one call runs: from layer `first_layer`'s half `first_half` (0: the
   * attention half, input norm to o_proj; 1: the MLP half, the norms before the MLP to down)
   * to layer `last_layer`'s half `last_half`, both included. One rank runs the whole stack in
   * one call; tensor-parallel ranks one half per call, the all-reduce of its output (proj, or
   * hidden_out) between calls. The stream between calls: */
  int32_t first_layer, first_half, last_layer, last_half;
  /* in/out: where the residual stream is: 0 nowhere yet (before layer 0's input norm),
   * 1 residual_a, 2 residual_b, 3 hidden_in (layer 0's input itself) */
  int32_t residual_state;
  /* threads per kind of kernel (the per-module path's defaults) */
  int64_t norm_min_work, attn_min_work;
  /* buffers (see the top of decoder_stack.c) */
  const void *hidden_in;
  void *normed, *qkv, *q_normed, *k_normed, *q_rot, *k_rot, *attn, *proj, *sandwich,
      *residual_a, *residual_b, *gate_up, *mid, *segment, *hidden_out;
  /* [T] each row's LoRA slot (-1: the base model), or NULL: no adapter in this step */
  const int32_t *lora_slots;
  /* MoE layers' scratch: wick_stack_moe_bytes of the largest (NULL without MoE layers) */
  void *moe_scratch;
  /* MLA layers' scratch: wick_stack_mla_bytes of the largest (NULL without MLA layers) */
  void *mla_scratch;
} WickStackStep;

/* decoder_stack.c: all of a decoder stack's layers in one call. */
int wick_decoder_stack(WickStackStep *s, const WickLayer *layers, int num_layers,
                       int *residual_out);

/* decoder_stack.c: the bytes of `moe_scratch` layer `layer` needs at the step's num_tokens,
 * dtype and hidden (0 for a layer without experts). */
int64_t wick_stack_moe_bytes(const WickStackStep *s, const WickLayer *layer);

/* decoder_stack.c: the bytes of `mla_scratch` layer `layer` needs at the step's num_tokens,
 * dtype and num_heads (0 for a layer without latent attention). */
int64_t wick_stack_mla_bytes(const WickStackStep *s, const WickLayer *layer);

/* decoder_stack.c: after a split_shared_add MoE half and the all-reduces of `sandwich` (routed)
 * and hidden_out (shared): hidden_out = sandwich + sigmoid(gate) * hidden_out, the gate logits
 * the half left in moe_scratch (wick_moe_shared_expert_add); MOE_SHARED_PLAIN: sandwich +
 * hidden_out. Returns 0, or -1 for a layer without a shared expert. */
int wick_stack_moe_shared_add(const WickStackStep *s, const WickLayer *layer);

/* abi_layout.c: the compiled layout of the structs above, one row per struct (field "": its
 * sizeof at values[2 i + 1]) and per field (offsetof at values[2 i], sizeof at values[2 i + 1]),
 * names[2 i] the struct and names[2 i + 1] the field. Fills min(rows, capacity) rows and
 * returns the number of rows. */
int wick_abi_layout(const char **names, int64_t *values, int capacity);

#endif /* WICK_STACK_H */
